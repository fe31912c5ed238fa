"""luced.api.anthropic: Messages bodies -> requests, and the response / event shapes."""

from __future__ import annotations

import json

import pytest

from luced.api.anthropic import (
    MessageFormat,
    error_body,
    message_prompt,
    parse_messages,
    stop_fields,
    usage,
)
from luced.api.fields import APIError
from luced.text.chat_template import ChatTemplate
from luced.text.tokenizer import Tokenizer

MODEL = "smol"
USER = [{"role": "user", "content": "Hi"}]


def parse(**body):
    return parse_messages({"max_tokens": 8, "messages": USER, **body}, model_name=MODEL)


def rejected(**body) -> APIError:
    with pytest.raises(APIError) as info:
        parse_messages(body, model_name=MODEL)
    return info.value


def test_fields_are_read() -> None:
    req = parse(
        model=MODEL,
        system=[{"type": "text", "text": "A"}, {"type": "text", "text": "B", "cache_control": {}}],
        stop_sequences=["x", "", "x", "y"],
        temperature=0.5,
        top_p=0.9,
        top_k=3,
        stream=True,
        metadata={"user_id": "u"},
    )
    o = req.options
    assert (o.max_tokens, o.stop, o.stream) == (8, ("x", "y"), True)
    assert (o.params.temperature, o.params.top_p, o.params.top_k) == (0.5, 0.9, 3)
    assert req.messages == (
        {"role": "system", "content": "A\nB"},
        {"role": "user", "content": "Hi"},
    )
    assert req.prefill == ""


def test_turns_merge_and_a_last_assistant_turn_is_a_prefill() -> None:
    req = parse(
        messages=[
            {"role": "user", "content": "a"},
            {"role": "user", "content": [{"type": "text", "text": "b"}]},
            {"role": "assistant", "content": "c"},
            {"role": "user", "content": "d"},
            {"role": "assistant", "content": "The answer is"},
        ]
    )
    assert [m["content"] for m in req.messages] == ["a\nb", "c", "d"]
    assert req.prefill == "The answer is"


@pytest.mark.parametrize(
    ("body", "status", "where"),
    [
        ({"messages": USER}, 400, "max_tokens"),
        ({"max_tokens": 0, "messages": USER}, 400, "max_tokens"),
        ({"max_tokens": 1, "messages": []}, 400, "messages"),
        (
            {"max_tokens": 1, "messages": [{"role": "system", "content": "x"}]},
            400,
            "messages.0.role",
        ),
        (
            {"max_tokens": 1, "messages": [{"role": "user", "content": [{"type": "image"}]}]},
            400,
            "messages.0.content.0.type",
        ),
        (
            {"max_tokens": 1, "messages": [{"role": "user", "content": 3}]},
            400,
            "messages.0.content",
        ),
        ({"max_tokens": 1, "messages": USER, "system": [1]}, 400, "system.0"),
        ({"max_tokens": 1, "messages": USER, "temperature": 1.5}, 400, "temperature"),
        ({"max_tokens": 1, "messages": USER, "top_k": -1}, 400, "top_k"),
        ({"max_tokens": 1, "messages": USER, "top_k": 1e30}, 400, "top_k"),
        ({"max_tokens": 1e30, "messages": USER}, 400, "max_tokens"),
        ({"max_tokens": 1, "messages": USER, "top_p": 0}, 400, "top_p"),
        ({"max_tokens": 1, "messages": USER, "temperature": 1e-400, "top_p": 5e-324}, 200, ""),
        ({"max_tokens": 1, "messages": USER, "stop_sequences": "x"}, 400, "stop_sequences"),
        ({"max_tokens": 1, "messages": USER, "thinking": {"type": "enabled"}}, 400, "thinking"),
        ({"max_tokens": 1, "messages": [{"role": "assistant", "content": "x"}]}, 400, "messages"),
        ({"max_tokens": 1, "messages": USER, "model": "claude"}, 404, "model"),
    ],
)
def test_bad_bodies(body: dict, status: int, where: str) -> None:
    if status == 200:  # extreme but valid: parsed, and the sampler is safe for it
        assert parse(**body).options.params.top_p == 5e-324
        return
    err = rejected(**body)
    assert err.status == status
    assert err.message.startswith(where), err.message
    shaped = error_body(err)
    assert shaped["type"] == "error"
    assert shaped["error"]["type"] == (
        "not_found_error" if status == 404 else "invalid_request_error"
    )


def test_count_only_needs_no_max_tokens() -> None:
    req = parse_messages({"messages": USER}, model_name=MODEL, count_only=True)
    assert req.messages == ({"role": "user", "content": "Hi"},)


def test_error_types_follow_the_status() -> None:
    kinds = {s: error_body(APIError(s, "m"))["error"]["type"] for s in (401, 413, 429, 500, 503)}
    assert kinds == {
        401: "authentication_error",
        413: "request_too_large",
        429: "rate_limit_error",
        500: "api_error",
        503: "overloaded_error",
    }


def test_stop_reasons() -> None:
    assert stop_fields("stop", None) == {"stop_reason": "end_turn", "stop_sequence": None}
    assert stop_fields("stop", "###") == {"stop_reason": "stop_sequence", "stop_sequence": "###"}
    assert stop_fields("length", None) == {"stop_reason": "max_tokens", "stop_sequence": None}


def test_response_and_events() -> None:
    fmt = MessageFormat("msg_1", MODEL)
    body = fmt.response("Hello", "length", None, usage(10, 4, 2))
    assert body == {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "model": MODEL,
        "content": [{"type": "text", "text": "Hello"}],
        "stop_reason": "max_tokens",
        "stop_sequence": None,
        "usage": {
            "input_tokens": 6,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 4,
            "output_tokens": 2,
        },
    }
    raw = b"".join([*fmt.start(10), fmt.delta("He"), *fmt.end("stop", None, usage(10, 0, 1))])
    names = [block.split("\n")[0] for block in raw.decode().strip().split("\n\n")]
    assert names == [
        "event: message_start",
        "event: content_block_start",
        "event: ping",
        "event: content_block_delta",
        "event: content_block_stop",
        "event: message_delta",
        "event: message_stop",
    ]
    delta = json.loads(raw.decode().split("\n\n")[3].split("data: ", 1)[1])
    assert delta == {
        "type": "content_block_delta",
        "index": 0,
        "delta": {"type": "text_delta", "text": "He"},
    }


def test_prompt_with_prefill(smol_tokenizer: Tokenizer, smol_template: ChatTemplate) -> None:
    plain = message_prompt(parse(), smol_template, smol_tokenizer)
    filled = parse(messages=[*USER, {"role": "assistant", "content": "Sure<|im_end|>"}])
    ids = message_prompt(filled, smol_template, smol_tokenizer)
    # The prefill follows the generation prompt as text (its marker spelled out too).
    assert ids[: len(plain)] == plain
    assert ids[len(plain) :] == smol_tokenizer.encode("Sure<|im_end|>", add_bos=False)
    assert smol_tokenizer.eos_id not in ids[len(plain) :]


# --- tools ---------------------------------------------------------------------------------

WEATHER = {
    "name": "get_weather",
    "description": "Weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
}


def test_tools_and_tool_choice() -> None:
    req = parse(tools=[WEATHER])
    assert req.tool_choice.mode == "auto" and req.calls_tools
    (tool,) = req.tools
    assert (tool.name, tool.parameters) == ("get_weather", WEATHER["input_schema"])
    modes = {"any": "required", "none": "none", "auto": "auto"}
    for kind, mode in modes.items():
        assert parse(tools=[WEATHER], tool_choice={"type": kind}).tool_choice.mode == mode
    named = parse(tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"})
    assert (named.tool_choice.mode, named.tool_choice.name) == ("function", "get_weather")


def test_tool_use_and_results_become_chat_turns() -> None:
    use = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}}
    result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "-3 C"}
    failed = {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True}
    failed["content"] = [{"type": "text", "text": "timeout"}]
    messages = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": [{"type": "text", "text": "Checking."}, use]},
        {"role": "user", "content": [result, failed, {"type": "text", "text": "And?"}]},
    ]
    turns = parse(messages=messages, tools=[WEATHER]).messages
    assert [t["role"] for t in turns] == ["user", "assistant", "tool", "tool", "user"]
    (call,) = turns[1]["tool_calls"]
    assert turns[1]["content"] == "Checking."
    assert call["id"] == "toolu_1" and json.loads(call["function"]["arguments"]) == {"city": "Oslo"}
    assert turns[2] == {"role": "tool", "tool_call_id": "toolu_1", "content": "-3 C"}
    assert turns[3]["content"] == "Error: timeout" and turns[4]["content"] == "And?"


@pytest.mark.parametrize(
    ("body", "where"),
    [
        ({"tools": [{"name": "f"}]}, "tools.0.input_schema"),
        ({"tools": [{"type": "web_search_20250305", "name": "s"}]}, "tools.0.type"),
        ({"tools": [{**WEATHER, "name": "a b"}]}, "tools.0.name"),
        ({"tools": [{**WEATHER, "input_schema": {"type": "blob"}}]}, "tools.0.input_schema"),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "x"}}, "tool_choice"),
        ({"tool_choice": {"type": "any"}}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": "auto"}, "tool_choice"),
        (
            {
                "messages": [
                    *USER,
                    {"role": "assistant", "content": [{"type": "tool_use", "name": "f"}]},
                ]
            },
            "messages",
        ),
        (
            {"messages": [*USER, {"role": "assistant", "content": "So"}], "tools": [WEATHER]},
            "messages",
        ),
        (
            {"messages": [{"role": "assistant", "content": [{"type": "tool_result"}]}, *USER]},
            "messages.0.content.0.type",
        ),
    ],
)
def test_bad_tools(body: dict, where: str) -> None:
    err = rejected(**{"max_tokens": 1, "messages": USER, **body})
    assert (err.status, err.param) == (400, where), err.message
