"""The official `openai` SDK's Responses API (`responses.create`,
`responses.stream`) against a real server."""

import json

import openai
import pytest

from conftest import Server

CALL = (
    "<think>\nI should list the files.\n</think>\n\n<tool_call>\n<function=exec_command>\n"
    "<parameter=cmd>\nls -a\n</parameter>\n</function>\n</tool_call>"
)
ANSWER = "The directory holds a.txt."

TOOLS = [
    {
        "type": "function",
        "name": "exec_command",
        "description": "Run a shell command",
        "strict": False,
        "parameters": {
            "type": "object",
            "properties": {"cmd": {"type": "string"}},
            "required": ["cmd"],
        },
    }
]


def client(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def tool_server():
    """TEST FACILITY: replies come from a fixed script (--test-script)."""
    s = Server(["--model-name", "demo"], script=[CALL, ANSWER])
    yield s
    s.stop()


def test_create_text_and_usage(server):
    r = client(server).responses.create(
        model="demo",
        instructions="Continue the story.",
        input="And it came to pass",
        max_output_tokens=8,
        temperature=0,
    )
    assert r.object == "response"
    assert r.status in ("completed", "incomplete")
    assert isinstance(r.output_text, str) and r.output_text
    assert r.instructions == "Continue the story."
    assert r.usage.output_tokens <= 8
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens"


def test_stream_matches_create(server):
    c = client(server)
    kw = dict(model="demo", input="In the beginning", max_output_tokens=10, temperature=0)
    whole = c.responses.create(**kw)
    deltas, final = [], None
    with c.responses.stream(**kw) as stream:
        for event in stream:
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
            # A reply cut by max_output_tokens ends with response.incomplete,
            # which get_final_response() does not take, as with OpenAI.
            if event.type in ("response.completed", "response.incomplete"):
                final = event.response
    assert "".join(deltas) == whole.output_text == final.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert final.usage.input_tokens == whole.usage.input_tokens
    assert final.status == whole.status


def test_function_call_round_trip(tool_server):
    c = client(tool_server)
    history = [{"role": "user", "content": "What is in this directory?"}]
    with c.responses.stream(model="demo", input=history, tools=TOOLS) as stream:
        kinds = [event.type for event in stream]
        first = stream.get_final_response()
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert "response.function_call_arguments.done" in kinds
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1
    assert calls[0].name == "exec_command"
    assert json.loads(calls[0].arguments) == {"cmd": "ls -a"}
    reasoning = [item for item in first.output if item.type == "reasoning"]
    assert reasoning[0].content[0].text == "I should list the files."
    assert first.usage.output_tokens_details.reasoning_tokens > 0

    # Run the "tool" and send everything back, as an agent does.
    history += [item.model_dump(exclude_none=True) for item in first.output]
    history.append({"type": "function_call_output", "call_id": calls[0].call_id, "output": "a.txt"})
    second = c.responses.create(model="demo", input=history, tools=TOOLS)
    assert second.status == "completed"
    assert second.output_text == ANSWER
    assert second.usage.input_tokens > first.usage.input_tokens


def test_refusals_are_sdk_errors(server):
    c = client(server)
    with pytest.raises(openai.BadRequestError) as e:
        c.responses.create(model="demo", input="hi", previous_response_id="resp_123")
    assert e.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.BadRequestError) as e:
        c.responses.create(model="demo", input="hi", extra_body={"best_of": 2})
    assert e.value.body["param"] == "best_of"
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve("resp_123")


SCHEMA = {
    "type": "object",
    "properties": {"word": {"type": "string", "maxLength": 8}, "ok": {"type": "boolean"}},
    "required": ["word", "ok"],
    "additionalProperties": False,
}


def test_text_format_and_forced_calls_are_honoured(server):
    c = client(server)
    r = c.responses.create(
        model="demo",
        input="And it came to pass",
        temperature=0,
        max_output_tokens=60,
        text={"format": {"type": "json_schema", "name": "t", "schema": SCHEMA, "strict": True}},
    )
    v = json.loads(r.output_text)
    assert set(v) == {"word", "ok"} and isinstance(v["ok"], bool)
    short = [dict(TOOLS[0], parameters={"type": "object", "properties": {
        "cmd": {"type": "string", "maxLength": 10}}, "required": ["cmd"]})]
    r = c.responses.create(
        model="demo", input="hi", tools=short, tool_choice="required",
        parallel_tool_calls=False, temperature=0, max_output_tokens=60,
    )
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "exec_command"
    assert isinstance(json.loads(calls[0].arguments)["cmd"], str)
