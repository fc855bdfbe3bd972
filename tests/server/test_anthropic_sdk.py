"""The official `anthropic` SDK against a real server."""

import os

import anthropic
import pytest

from conftest import CODER_CALL, QWEN3_CALL, ROOT, Server

# A chat template with the Qwen3.5/3.6 rules: one system message, first, and
# an opened <think> unless thinking is off.
QWEN_LIKE = os.path.join(ROOT, "crates", "server", "tests", "fixtures", "qwen_like_template.jinja")

TOOLS = [
    {
        "name": "get_weather",
        "description": "Weather for a city",
        "input_schema": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    }
]


def client(server, key="none"):
    return anthropic.Anthropic(base_url=server.base, api_key=key, max_retries=0, timeout=60)


def test_messages_non_streaming_and_count(server):
    c = client(server)
    kw = dict(
        model="demo",
        system="You are a scribe.",
        messages=[{"role": "user", "content": "And God said"}],
    )
    n = c.messages.count_tokens(**kw).input_tokens
    r = c.messages.create(max_tokens=8, extra_body={"temperature": 0}, **kw)
    assert r.type == "message" and r.role == "assistant"
    assert r.stop_reason in ("end_turn", "max_tokens")
    assert r.usage.input_tokens + (r.usage.cache_read_input_tokens or 0) == n
    assert 1 <= r.usage.output_tokens <= 8


def test_messages_streaming(server):
    c = client(server)
    kw = dict(model="demo", max_tokens=10, extra_body={"temperature": 0}, messages=[{"role": "user", "content": "In the beginning"}])
    whole = c.messages.create(**kw)
    events = []
    with c.messages.stream(**kw) as stream:
        for ev in stream:
            events.append(ev.type)
        final = stream.get_final_message()
    assert events[0] == "message_start"
    assert events[-1] == "message_stop"
    assert "message_delta" in events
    assert [b.text for b in final.content] == [b.text for b in whole.content]
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_multi_turn(server):
    c = client(server)
    r = c.messages.create(
        model="demo",
        max_tokens=4,
        messages=[
            {"role": "user", "content": "Hello"},
            {"role": "assistant", "content": "And it came to pass"},
            {"role": "user", "content": [{"type": "text", "text": "Go on"}]},
        ],
    )
    assert r.usage.output_tokens <= 4


def test_errors(server):
    c = client(server)
    with pytest.raises(anthropic.NotFoundError):
        c.messages.create(model="claude-x", max_tokens=4, messages=[{"role": "user", "content": "x"}])
    with pytest.raises(anthropic.BadRequestError):
        c.messages.create(model="demo", max_tokens=4, messages=[{"role": "robot", "content": "x"}])


def test_tool_use_round_trip_on_the_wire():
    s = Server(["--model-name", "demo"], script=[QWEN3_CALL, "It is sunny in Paris.", CODER_CALL])
    try:
        c = client(s)
        msgs = [{"role": "user", "content": "Weather in Paris?"}]
        r = c.messages.create(
            model="demo", max_tokens=200, tools=TOOLS, messages=msgs,
            thinking={"type": "enabled", "budget_tokens": 100},
        )
        assert r.stop_reason == "tool_use"
        assert [b.type for b in r.content] == ["thinking", "tool_use"]
        assert r.content[0].thinking == "The user wants weather."
        use = r.content[1]
        assert use.name == "get_weather" and use.input == {"city": "Paris"}

        msgs.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r.content]})
        msgs.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}]})
        r = c.messages.create(model="demo", max_tokens=200, tools=TOOLS, messages=msgs)
        assert r.stop_reason == "end_turn"
        assert r.content[0].text == "It is sunny in Paris."

        # Streamed, XML form.
        with c.messages.stream(model="demo", max_tokens=200, tools=TOOLS, messages=msgs[:1]) as stream:
            final = stream.get_final_message()
        assert final.stop_reason == "tool_use"
        assert [b.type for b in final.content] == ["text", "tool_use"]
        assert final.content[0].text == "Checking.\n"
        assert final.content[1].input == {"city": "Paris", "days": 3}
    finally:
        s.stop()


def test_mid_conversation_system_message_and_adaptive_thinking():
    """What Claude Code sends: system turns inside `messages`, adaptive
    thinking, effort, context management, cached blocks, its billing header."""
    s = Server(["--model-name", "demo", "--chat-template", QWEN_LIKE])
    try:
        c = client(s)
        kw = dict(
            model="demo",
            system=[
                {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.197; cc_entrypoint=cli;"},
                {"type": "text", "text": "You are a scribe.", "cache_control": {"type": "ephemeral"}},
            ],
            messages=[
                {"role": "user", "content": [{"type": "text", "text": "And God said", "cache_control": {"type": "ephemeral"}}]},
                {"role": "system", "content": "Answer in one line."},
            ],
            thinking={"type": "adaptive"},
        )
        extra = {"output_config": {"effort": "high"}, "temperature": 0,
                 "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]}}
        n = c.messages.count_tokens(**kw).input_tokens
        other = dict(kw, system=[{"type": "text", "text": "x-anthropic-billing-header: cc_version=9;"}, kw["system"][1]])
        assert c.messages.count_tokens(**other).input_tokens == n, "the billing header is not in the prompt"

        r = c.messages.create(max_tokens=8, extra_body=extra, **kw)
        assert r.usage.input_tokens + (r.usage.cache_read_input_tokens or 0) == n
        assert r.content[0].type == "thinking", "adaptive thinking is on: the template opened <think>"

        with c.messages.stream(max_tokens=8, extra_body=extra, **kw) as stream:
            final = stream.get_final_message()
        assert [b.type for b in final.content] == [b.type for b in r.content]
        assert final.content[0].thinking == r.content[0].thinking

        off = c.messages.create(max_tokens=8, extra_body=extra, **dict(kw, thinking={"type": "disabled"}))
        assert all(b.type != "thinking" for b in off.content)
    finally:
        s.stop()
