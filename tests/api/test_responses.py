"""luced.api.responses: Responses bodies -> the chat request they amount to, and the
response object and event shapes."""

from __future__ import annotations

import json

import pytest

from luced.api.fields import APIError
from luced.api.responses import ResponseFormat, parse_responses, usage
from luced.text.tool_calls import GenericToolFormat

MODEL = "smol"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}


def parse(**body):
    return parse_responses(body, model_name=MODEL)


def rejected(**body) -> APIError:
    with pytest.raises(APIError) as info:
        parse(**body)
    return info.value


def test_a_string_input_with_instructions() -> None:
    req = parse(input="Hi", instructions="Be brief.", max_output_tokens=9, temperature=0.5)
    assert req.messages == (
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
    )
    assert req.options.max_tokens == 9 and req.options.params.temperature == 0.5
    assert not req.calls_tools and req.options.grammar is None


def test_items_become_chat_turns() -> None:
    req = parse(
        input=[
            {"role": "developer", "content": "Rules."},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
            {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
            {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        ],
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
    )
    roles = [m["role"] for m in req.messages]
    assert roles == ["system", "user", "assistant", "tool"]
    assert [c["id"] for c in req.messages[2]["tool_calls"]] == ["c1", "c2"]  # one turn
    assert req.messages[3] == {"role": "tool", "tool_call_id": "c1", "content": "sunny"}
    assert (req.tool_choice.mode, req.tool_choice.name) == ("function", "get_weather")
    assert req.tools[0].parameters == WEATHER["parameters"]


def test_text_format_is_a_grammar() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = {"type": "json_schema", "name": "x", "schema": schema, "strict": True}
    assert "%json" in parse(input="x", text={"format": fmt}).options.grammar
    assert parse(input="x", text={"format": {"type": "text"}}).options.grammar is None


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
        ({"input": []}, "input"),
        ({"input": 3}, "input"),
        ({"input": [{"role": "wizard", "content": "x"}]}, "input[0].role"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
            "input[0].content[0]",
        ),
        ({"input": [{"type": "reasoning"}]}, "input[0].type"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
        (
            {"input": "x", "tools": [{**WEATHER, "parameters": {"type": "blob"}}]},
            "tools[0].parameters",
        ),
        ({"input": "x", "tool_choice": "required"}, "tool_choice"),
        (
            {"input": "x", "text": {"format": {"type": "json_schema", "schema": 3}}},
            "text.format.schema",
        ),
        (
            {"input": "x", "tools": [WEATHER], "text": {"format": {"type": "json_object"}}},
            "text.format",
        ),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ],
)
def test_bad_bodies_name_their_field(body: dict, param: str) -> None:
    err = rejected(**body)
    assert (err.status, err.param) == (400, param), err.message
    assert rejected(input="x", model="gpt-5").status == 404


def events(chunks: list[bytes]) -> list[dict]:
    out = []
    for chunk in chunks:
        kind, data = chunk.decode().strip().split("\n")
        body = json.loads(data.removeprefix("data: "))
        assert kind == f"event: {body['type']}"
        out.append(body)
    return out


def test_a_streamed_message_matches_the_response_object() -> None:
    fmt = ResponseFormat("resp_1", MODEL, 0, parse(input="x"), None)
    chunks = fmt.start() + fmt.delta("Hel") + fmt.delta("lo") + fmt.end("stop", usage(3, 1, 2))
    got = events(chunks)
    assert [e["sequence_number"] for e in got] == list(range(len(got)))
    assert [e["type"] for e in got] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed",
    ]  # fmt: skip
    final = got[-1]["response"]
    assert final == fmt.response("Hello", "stop", usage(3, 1, 2))
    assert final["output"][0]["content"][0]["text"] == "Hello"
    assert final["usage"]["input_tokens_details"] == {"cached_tokens": 1}
    cut = ResponseFormat("resp_2", MODEL, 0, parse(input="x"), None).response("Hel", "length", {})
    assert (
        cut["status"] == "incomplete" and cut["incomplete_details"]["reason"] == "max_output_tokens"
    )


def test_a_call_is_a_function_call_item() -> None:
    req = parse(input="x", tools=[WEATHER], tool_choice="required")
    fmt = ResponseFormat("resp_1", MODEL, 0, req, GenericToolFormat())
    text = '{"tool_call": {"name": "get_weather", "arguments": {"city": "Oslo"}}}'
    got = events(fmt.start() + fmt.delta(text) + fmt.end("stop", {}))
    kinds = [e["type"] for e in got]
    assert "response.output_text.delta" not in kinds
    assert "response.function_call_arguments.done" in kinds
    (item,) = got[-1]["response"]["output"]
    assert item["type"] == "function_call" and item["name"] == "get_weather"
    assert json.loads(item["arguments"]) == {"city": "Oslo"} and item["call_id"].startswith("call_")
    assert got[-1]["response"]["tool_choice"] == "required"
