"""The official `openai` SDK against a real server."""

import json

import openai
import pytest

from conftest import CODER_CALL, QWEN3_CALL, Server

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    }
]


def client(server, key="none"):
    return openai.OpenAI(base_url=server.base + "/v1", api_key=key, max_retries=0, timeout=60)


def test_models(server):
    ids = [m.id for m in client(server).models.list()]
    assert ids == ["demo"]


def test_chat_non_streaming_usage(server):
    r = client(server).chat.completions.create(
        model="demo",
        messages=[{"role": "user", "content": "And it came to pass"}],
        max_tokens=8,
        temperature=0,
        seed=1,
    )
    c = r.choices[0]
    assert c.message.role == "assistant"
    assert isinstance(c.message.content, str)
    assert c.finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens > 3
    assert 1 <= r.usage.completion_tokens <= 8
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_streaming_matches_non_streaming(server):
    c = client(server)
    kw = dict(
        model="demo",
        messages=[{"role": "user", "content": "In the beginning"}],
        max_tokens=10,
        temperature=0,
    )
    whole = c.chat.completions.create(**kw)
    text, usage, finish = "", None, None
    for chunk in c.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            text += ch.delta.content or ""
            finish = ch.finish_reason or finish
    assert text == whole.choices[0].message.content
    assert finish == whole.choices[0].finish_reason
    assert usage.completion_tokens == whole.usage.completion_tokens
    assert usage.prompt_tokens == whole.usage.prompt_tokens


def test_completions(server):
    r = client(server).completions.create(model="demo", prompt="And God said", max_tokens=5, temperature=0)
    assert r.usage.completion_tokens <= 5
    assert isinstance(r.choices[0].text, str)


def test_errors_are_sdk_exceptions(server):
    c = client(server)
    with pytest.raises(openai.NotFoundError) as e:
        c.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "x"}])
    assert "does not exist" in str(e.value)
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model="demo", messages=[{"role": "wizard", "content": "x"}])
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model="demo", messages=[{"role": "user", "content": "x"}], temperature=7)


def test_api_key():
    s = Server(["--model-name", "demo", "--api-key", "k1"])
    try:
        with pytest.raises(openai.AuthenticationError):
            client(s, "wrong").models.list()
        assert [m.id for m in client(s, "k1").models.list()] == ["demo"]
    finally:
        s.stop()


def test_tool_calls_round_trip_on_the_wire():
    s = Server(["--model-name", "demo"], script=[QWEN3_CALL, "It is sunny in Paris.", CODER_CALL])
    try:
        c = client(s)
        msgs = [{"role": "user", "content": "Weather in Paris?"}]
        r = c.chat.completions.create(model="demo", messages=msgs, tools=TOOLS)
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls"
        call = ch.message.tool_calls[0]
        assert call.function.name == "get_weather"
        assert json.loads(call.function.arguments) == {"city": "Paris"}
        assert ch.message.reasoning_content == "The user wants weather."

        msgs.append(ch.message.model_dump(exclude_none=True))
        msgs.append({"role": "tool", "tool_call_id": call.id, "content": "sunny, 24C"})
        r = c.chat.completions.create(model="demo", messages=msgs, tools=TOOLS)
        assert r.choices[0].message.content == "It is sunny in Paris."
        assert r.choices[0].finish_reason == "stop"

        # Streamed, XML form: tool call deltas accumulate to the call.
        calls = {}
        content = ""
        finish = None
        for chunk in c.chat.completions.create(model="demo", messages=msgs[:1], tools=TOOLS, stream=True):
            for chd in chunk.choices:
                content += chd.delta.content or ""
                finish = chd.finish_reason or finish
                for tc in chd.delta.tool_calls or []:
                    d = calls.setdefault(tc.index, {"name": "", "arguments": ""})
                    d["name"] += tc.function.name or ""
                    d["arguments"] += tc.function.arguments or ""
        assert content == "Checking.\n"
        assert finish == "tool_calls"
        assert calls[0]["name"] == "get_weather"
        assert json.loads(calls[0]["arguments"]) == {"city": "Paris", "days": 3}
    finally:
        s.stop()


def test_response_format_penalties_and_logprobs_are_honoured(server):
    c = client(server)
    schema = {
        "type": "object",
        "properties": {"word": {"type": "string", "maxLength": 8}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["word", "n"],
        "additionalProperties": False,
    }
    msgs = [{"role": "user", "content": "And it came to pass"}]
    r = c.chat.completions.create(
        model="demo", messages=msgs, max_tokens=60, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "t", "schema": schema, "strict": True}},
    )
    v = json.loads(r.choices[0].message.content)
    assert set(v) == {"word", "n"} and 0 <= v["n"] <= 9
    plain = c.chat.completions.create(model="demo", messages=msgs, max_tokens=30, temperature=0)
    penalised = c.chat.completions.create(
        model="demo", messages=msgs, max_tokens=30, temperature=0, presence_penalty=2.0
    )
    assert plain.choices[0].message.content != penalised.choices[0].message.content
    r = c.chat.completions.create(
        model="demo", messages=msgs, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2
    )
    entries = r.choices[0].logprobs.content
    assert entries and all(e.top_logprobs[0].token == e.token for e in entries)
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="demo", messages=msgs, max_tokens=4, logit_bias={"5": 10})
    assert e.value.body["param"] == "logit_bias"


def test_second_turn_reuses_the_conversation(server):
    """The reply and the first turn are not prefilled again: the second
    request's usage counts them as cached (the server's state cache)."""
    c = client(server)
    turn1 = [{"role": "user", "content": "Tell me about the sea and the ships upon it."}]
    r1 = c.chat.completions.create(model="demo", messages=turn1, max_tokens=12, temperature=0)
    turn2 = turn1 + [
        {"role": "assistant", "content": r1.choices[0].message.content},
        {"role": "user", "content": "And the harbour?"},
    ]
    r2 = c.chat.completions.create(model="demo", messages=turn2, max_tokens=4, temperature=0)
    cached = r2.usage.prompt_tokens_details.cached_tokens
    assert r1.usage.prompt_tokens <= cached < r2.usage.prompt_tokens, (r1.usage, r2.usage)
    # The same request again (greedy) gives the same reply from the cache.
    r3 = c.chat.completions.create(model="demo", messages=turn2, max_tokens=4, temperature=0)
    assert r3.choices[0].message.content == r2.choices[0].message.content
