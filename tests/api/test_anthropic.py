"""luced.api.anthropic: Messages bodies -> requests, and the response / event shapes."""

from __future__ import annotations

import json

import pytest

from luced.api.anthropic import (
    MessageFormat,
    Thinking,
    ToolMessageFormat,
    error_body,
    message_prompt,
    parse_messages,
    stop_fields,
    usage,
)
from luced.api.fields import APIError
from luced.text.chat_template import CHATML_TEMPLATE, ChatTemplate
from luced.text.tokenizer import Tokenizer
from luced.text.tool_calls import tool_format

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
        ({"max_tokens": 1, "messages": USER, "thinking": {"type": "on"}}, 400, "thinking.type"),
        ({"max_tokens": 1, "messages": USER, "thinking": "on"}, 400, "thinking"),
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
        (  # a lone surrogate no tokenizer takes, in a result given as a plain string
            {
                "messages": [
                    *USER,
                    {
                        "role": "assistant",
                        "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}],
                    },
                    {
                        "role": "user",
                        "content": [
                            {"type": "tool_result", "tool_use_id": "t", "content": "\ud800"}
                        ],
                    },
                ],
                "tools": [WEATHER],
            },
            "messages.2.content.0.content",
        ),
    ],
)
def test_bad_tools(body: dict, where: str) -> None:
    err = rejected(**{"max_tokens": 1, "messages": USER, **body})
    assert (err.status, err.param) == (400, where), err.message


# --- thinking --------------------------------------------------------------------------------

# A template that thinks the way Qwen3's does (written for this test): an assistant turn
# after the last user message shows its reasoning_content in a think block, and a
# generation prompt with enable_thinking false carries an empty one.
THINKING_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}"
    "{%- endif -%}{%- endfor -%}"
    "{%- for m in messages -%}"
    "{{- '<|im_start|>' + m.role + '\\n' -}}"
    "{%- if m.role == 'assistant' and m.reasoning_content and loop.index0 > ns.last_user -%}"
    "{{- '<think>\\n' + m.reasoning_content + '\\n</think>\\n\\n' -}}{%- endif -%}"
    "{{- (m.content or '') + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}{%- endif -%}"
)
THOUGHT = {"type": "thinking", "thinking": "Oslo is cold.", "signature": "c2ln"}
REDACTED = {"type": "redacted_thinking", "data": "ZW5jcnlwdGVk"}


@pytest.mark.parametrize(
    ("thinking", "shown"),
    [
        (None, None),
        ({"type": "disabled"}, None),
        ({"type": "enabled", "budget_tokens": 50}, "summarized"),  # llama.cpp's tests send 50
        ({"type": "enabled", "budget_tokens": 2048.0, "display": "omitted"}, "omitted"),
        ({"type": "adaptive"}, "summarized"),
    ],
)
def test_thinking_is_read(thinking: dict | None, shown: str | None) -> None:
    assert parse(thinking=thinking).thinking == shown
    counted = parse_messages(
        {"messages": USER, "thinking": thinking}, model_name=MODEL, count_only=True
    )
    assert counted.thinking == shown


@pytest.mark.parametrize(
    "thinking",
    [
        {"type": "enabled", "budget_tokens": 0},
        {"type": "enabled", "budget_tokens": "1024"},
        {"type": "enabled", "budget_tokens": 1024, "display": "full"},
    ],
)
def test_bad_thinking(thinking: dict) -> None:
    err = rejected(max_tokens=1, messages=USER, thinking=thinking)
    assert err.status == 400 and err.message.startswith(err.param)
    assert err.param in ("thinking.budget_tokens", "thinking.display")


def test_earlier_thinking_blocks_are_accepted_and_kept_as_reasoning() -> None:
    use = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}}
    result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "-3 C"}
    messages = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": [THOUGHT, REDACTED, use]},
        {"role": "user", "content": [result]},
        {"role": "assistant", "content": [THOUGHT, {"type": "text", "text": "Cold."}]},
        *USER,
    ]
    turns = parse(messages=messages, tools=[WEATHER]).messages
    assert [t["role"] for t in turns] == ["user", "assistant", "tool", "assistant", "user"]
    assert turns[1]["reasoning_content"] == "Oslo is cold." and turns[1]["content"] is None
    assert turns[3] == {
        "role": "assistant",
        "content": "Cold.",
        "reasoning_content": "Oslo is cold.",
    }
    err = rejected(max_tokens=1, messages=[{"role": "user", "content": [THOUGHT]}])
    assert (err.param, err.status) == ("messages.0.content.0.type", 400)
    assert "thinking blocks belong in an assistant message" in err.message


def test_thinking_renders_as_the_template_allows(
    smol_tokenizer: Tokenizer, smol_template: ChatTemplate
) -> None:
    """A template that shows earlier thinking renders it in the current tool loop; one that
    does not (SmolLM2's) drops it; `enable_thinking` follows whether the reply thinks."""
    thinking = ChatTemplate(THINKING_TEMPLATE)
    use = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}}
    result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "-3 C"}
    loop = [
        *USER,
        {"role": "assistant", "content": [THOUGHT, use]},
        {"role": "user", "content": [result]},
    ]
    bare = [*USER, {"role": "assistant", "content": [use]}, {"role": "user", "content": [result]}]
    on = {"type": "enabled", "budget_tokens": 1024}
    req, plain = (
        parse(messages=loop, thinking=on, tools=[WEATHER]),
        parse(messages=bare, tools=[WEATHER]),
    )
    assert req.thinks(thinking, constrained=False) and not req.thinks(smol_template, False)
    assert not req.thinks(thinking, constrained=True)  # a forced call leaves no room
    assert not parse(thinking=on, messages=[*USER, {"role": "assistant", "content": "So"}]).thinks(
        thinking, False
    )  # a prefill is continued, not thought about

    def text(r, template, think, tools=None) -> str:
        return smol_tokenizer.decode(
            message_prompt(r, template, smol_tokenizer, tools, think), skip_special=False
        )

    shown = text(req, thinking, True)
    assert "<|im_start|>assistant\n<think>\nOslo is cold.\n</think>\n\n" in shown
    assert shown.endswith("<|im_start|>assistant\n")
    assert text(req, thinking, False).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    generic = tool_format(smol_template)
    dropped = text(req, smol_template, False, generic)
    assert "Oslo is cold." not in dropped and dropped == text(plain, smol_template, False, generic)
    assert not ChatTemplate(CHATML_TEMPLATE).source.count("</think>")


def events_of(raw: bytes) -> list[tuple[str, dict]]:
    out = []
    for block in raw.decode().strip().split("\n\n"):
        name, data = block.split("\n")
        out.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return out


REPLY = "<think>\nThe user greets me.\n</think>\n\nHello!"


@pytest.mark.parametrize("cuts", [[len(REPLY)], [3, 9, 20, 33, 35, 40], list(range(1, len(REPLY)))])
def test_a_reply_that_thinks_streams_its_blocks(cuts: list[int]) -> None:
    import anthropic

    fmt = MessageFormat("msg_t", MODEL, Thinking())
    body = fmt.response(REPLY, "stop", None, usage(5, 0, 9))
    message = anthropic.types.Message.model_validate(body)
    assert [b.type for b in message.content] == ["thinking", "text"]
    assert (message.content[0].thinking, message.content[0].signature) == (
        "The user greets me.",
        "",
    )
    assert message.content[1].text == "Hello!"

    stream = MessageFormat("msg_t", MODEL, Thinking())
    pieces = [REPLY[a:b] for a, b in zip([0, *cuts], [*cuts, len(REPLY)], strict=True)]
    raw = b"".join(
        [*stream.start(5), *map(stream.delta, pieces), *stream.end("stop", None, usage(5, 0, 9))]
    )
    events = events_of(raw)
    names = [n for n, _ in events]
    assert names[:2] == ["message_start", "ping"] and names[-2:] == [
        "message_delta",
        "message_stop",
    ]
    starts = [
        (d["index"], d["content_block"]["type"]) for n, d in events if n == "content_block_start"
    ]
    assert starts == [(0, "thinking"), (1, "text")]
    stops = [d["index"] for n, d in events if n == "content_block_stop"]
    assert stops == [0, 1]
    deltas = [d["delta"] for n, d in events if n == "content_block_delta"]
    kinds = [d["type"] for d in deltas]
    assert "signature_delta" in kinds and kinds.index("signature_delta") < kinds.index("text_delta")
    thought = "".join(d["thinking"] for d in deltas if d["type"] == "thinking_delta")
    said = "".join(d["text"] for d in deltas if d["type"] == "text_delta")
    assert (thought, said) == ("The user greets me.", "Hello!")


def test_omitted_thinking_and_a_reply_without_any() -> None:
    hidden = MessageFormat("m", MODEL, Thinking(omitted=True))
    body = hidden.response(REPLY, "stop", None, usage(5, 0, 9))
    assert body["content"] == [
        {"type": "thinking", "thinking": "", "signature": ""},
        {"type": "text", "text": "Hello!"},
    ]
    raw = b"".join(
        [*hidden.start(5), hidden.delta(REPLY), *hidden.end("stop", None, usage(5, 0, 9))]
    )
    assert b"thinking_delta" not in raw and b"signature_delta" in raw
    # A thinking model that answered at once; the prompt that opened the block (R1's).
    assert MessageFormat("m", MODEL, Thinking()).response("Hi.", "stop", None, {})["content"] == [
        {"type": "text", "text": "Hi."}
    ]
    opened = MessageFormat("m", MODEL, Thinking(opened=True)).response(
        "Hmm.</think>Hi.", "stop", None, {}
    )
    assert [b["type"] for b in opened["content"]] == ["thinking", "text"]
    # Nothing written at all: one empty text block, as without thinking.
    empty = MessageFormat("m", MODEL, Thinking())
    raw = b"".join([*empty.start(5), *empty.end("length", None, usage(5, 0, 0))])
    assert [n for n, _ in events_of(raw)] == [
        "message_start", "ping", "content_block_start", "content_block_stop",
        "message_delta", "message_stop",
    ]  # fmt: skip


def test_a_tool_call_after_thinking(smol_template: ChatTemplate) -> None:
    import anthropic

    generic = tool_format(smol_template)
    call = '{"tool_call": {"name": "get_weather", "arguments": {"city": "Oslo"}}}'
    text = f"<think>I need the weather.</think>\n{call}"
    fmt = ToolMessageFormat("m", MODEL, generic, Thinking())
    body = fmt.response(text, "stop", None, usage(5, 0, 9))
    assert [b["type"] for b in body["content"]] == ["thinking", "tool_use"]
    assert body["stop_reason"] == "tool_use"
    streamed = ToolMessageFormat("m", MODEL, generic, Thinking())
    raw = b"".join(
        [*streamed.start(5), streamed.delta(text), *streamed.end("stop", None, usage(5, 0, 9))]
    )
    events = events_of(raw)
    starts = [d["content_block"]["type"] for n, d in events if n == "content_block_start"]
    assert starts == ["thinking", "tool_use"]
    anthropic.types.Message.model_validate(body)
