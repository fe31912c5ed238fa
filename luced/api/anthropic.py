"""Anthropic Messages API: request bodies -> validated requests, engine output -> Anthropic's
response shapes and stream events. Pure functions, no I/O; the routes are in
`luced.api.server` (`POST /v1/messages`, `POST /v1/messages/count_tokens`).

Field policy:

* Honoured: model, messages, system (a string or text blocks), max_tokens (required; not
  for count_tokens), stop_sequences, temperature, top_p, top_k, stream.
* Content is a string or a list of blocks: text blocks (other keys of a block, like
  cache_control and citations, are ignored), tool_use / tool_result blocks with
  `tools` and `tool_choice` (`luced.api.anthropic_tools`), and an assistant's thinking /
  redacted_thinking blocks. Text blocks of one message, and consecutive text messages of
  one role (Anthropic merges them too), are joined with "\\n". A last assistant message
  is a prefill: the reply continues its text.
* `thinking` (`luced.api.anthropic_thinking`): a reply thinks when asked to and the model
  can; then its content opens with a `thinking` block (signature ""), streamed as
  thinking_delta events and one signature_delta. Otherwise it answers without one.
* Rejected with a 400 when set: server tools, any other block type. Other fields
  (metadata, service_tier, ...) and unknown ones are ignored, as on the OpenAI routes.
* `model` may be omitted (the served model); another name is a 404 not_found_error.

Errors: `error_body` gives {"type": "error", "error": {"type", "message"}}; the message
starts with the field's path in Anthropic's dotted style (`messages.0.content.1.type`).

Stream (`MessageFormat`), each event `event: NAME` + `data: {...}`:

    message_start  content_block_start  ping  content_block_delta*  content_block_stop
    message_delta (stop_reason, stop_sequence, usage)  message_stop

and for a reply that thinks, `ping` first and then one block after the other, each opened
when its first text arrives: the thinking block (thinking_delta*, signature_delta), then
the text block.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from luced.api.anthropic_thinking import is_thinking_block, parse_thinking, reasoning_of
from luced.api.anthropic_tools import assistant_turn, is_tool_block, parse_tools, tool_results
from luced.api.content import objects, text_parts
from luced.api.fields import (
    ANTHROPIC,
    INT_RANGES,
    APIError,
    bad,
    json_kind,
    read_bool,
    read_int,
    read_number,
    read_text,
)
from luced.api.formats import dumps
from luced.api.openai import MAX_STOP, MAX_STOP_CHARS, NO_TOOLS, Options
from luced.sampling_params import SamplingParams
from luced.text import reasoning
from luced.text.chat_template import ChatTemplate, ChatTemplateError
from luced.text.prompt import chat_ids
from luced.text.tokenizer import Tokenizer
from luced.text.tool_calls import Tool, ToolChoice, ToolFormat

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens"}


def error_body(exc: APIError) -> dict[str, Any]:
    kind = _ERROR_TYPES.get(exc.status)
    if kind is None:
        kind = "api_error" if exc.status >= 500 else "invalid_request_error"
    return {"type": "error", "error": {"type": kind, "message": exc.message}}


# --- requests ----------------------------------------------------------------------------


@dataclass(frozen=True)
class MessagesRequest:
    options: Options
    messages: tuple[dict[str, Any], ...]  # as the chat template reads them; system first
    prefill: str = ""  # the text of a last assistant message, which the reply continues
    tools: tuple[Tool, ...] = ()
    tool_choice: ToolChoice = NO_TOOLS
    thinking: str | None = None  # asked to think, shown "summarized" or "omitted"

    @property
    def calls_tools(self) -> bool:
        return self.tool_choice.mode != "none"

    def thinks(self, template: ChatTemplate, constrained: bool) -> bool:
        """Whether the reply thinks: asked to, by a model that can, in free text (no
        prefill to continue, no grammar holding it to a call)."""
        free = not self.prefill and not constrained
        return self.thinking is not None and free and reasoning.thinks(template)


def parse_messages(
    body: Mapping[str, Any], *, model_name: str, count_only: bool = False
) -> MessagesRequest:
    """A validated Messages request, or APIError (400, or 404 for an unknown model).
    count_only: the count_tokens route, where max_tokens and sampling are not read."""
    model = body.get("model")
    if model is not None and read_text("model", model) != model_name:
        raise APIError(
            404,
            f"model: {model!r} does not exist; this server serves {model_name!r}",
            param="model",
        )
    thinking = parse_thinking(body)
    tools, tool_choice = parse_tools(body)
    chat = _conversation(body)
    prefill = ""
    if chat[-1]["role"] == "assistant":
        if chat[-1].get("tool_calls"):
            raise bad("messages", "messages: a tool_use turn is answered by a user tool_result")
        prefill = chat.pop()["content"] or ""
        if not chat:
            raise bad("messages", "messages: a lone assistant message has nothing to answer")
        if prefill and tool_choice.mode != "none":
            raise bad("messages", "messages: an assistant prefill cannot be combined with tools")
    if count_only:
        options = Options(model_name, False, False, SamplingParams(), None)
        return MessagesRequest(options, tuple(chat), prefill, tools, tool_choice, thinking)
    if body.get("max_tokens") is None:
        raise bad("max_tokens", "max_tokens: Field required")
    options = Options(
        model=model_name,
        stream=read_bool(body, "stream"),
        include_usage=False,
        params=_sampling(body),
        max_tokens=read_int(body, "max_tokens", *INT_RANGES["max_tokens"]),
        stop=_stop_sequences(body.get("stop_sequences")),
    )
    return MessagesRequest(options, tuple(chat), prefill, tools, tool_choice, thinking)


def _sampling(body: Mapping[str, Any]) -> SamplingParams:
    fields: dict[str, Any] = {}
    for name in ("temperature", "top_p"):
        if (x := read_number(body, name, 0.0, 1.0)) is not None:
            fields[name] = x
    if (k := read_int(body, "top_k", 0, INT_RANGES["top_k"][1])) is not None:
        fields["top_k"] = k
    try:
        return SamplingParams(**fields)
    except (ValueError, TypeError) as exc:
        # SamplingParams' messages start with the field's name ("top_p must be ...").
        name = str(exc).split(" ", 1)[0]
        raise APIError(400, f"{name}: {exc}", param=name if name in body else None) from None


def _stop_sequences(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise bad("stop_sequences", f"stop_sequences: expected an array, got {json_kind(value)}")
    if len(value) > MAX_STOP:
        raise bad("stop_sequences", f"stop_sequences: at most {MAX_STOP}, got {len(value)}")
    out: list[str] = []
    for i, item in enumerate(value):
        text = read_text(f"stop_sequences.{i}", item)
        if len(text) > MAX_STOP_CHARS:
            raise bad("stop_sequences", f"stop_sequences.{i}: longer than {MAX_STOP_CHARS}")
        if text and text not in out:
            out.append(text)
    return tuple(out)


def _conversation(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    chat: list[dict[str, Any]] = []
    system = body.get("system")
    if system is not None:
        text = _text_of("system", system)
        if text:
            chat.append({"role": "system", "content": text})
    messages = body.get("messages")
    turns: list[dict[str, Any]] = []
    for p, m in objects("messages", messages, "a non-empty array of messages", ANTHROPIC):
        role = m.get("role")
        if role not in ("user", "assistant"):
            raise bad(f"{p}.role", f"{p}.role: expected 'user' or 'assistant', got {role!r}")
        content = m.get("content")
        text = _text_of(f"{p}.content", content, skip_blocks=True)
        thought = reasoning_of(f"{p}.content", role, content)
        calls = (
            [(j, b) for j, b in enumerate(content) if is_tool_block(b)]
            if isinstance(content, list)
            else []
        )
        if calls and role == "assistant":
            turns.append(assistant_turn(f"{p}.content", text, calls))
        elif calls:
            turns += tool_results(f"{p}.content", calls)
            if text:
                turns.append({"role": "user", "content": text})
        elif turns and turns[-1]["role"] == role and not turns[-1].get("tool_calls"):
            turns[-1]["content"] = f"{turns[-1]['content'] or ''}\n{text}"
        else:
            turns.append({"role": role, "content": text})
        if thought:  # what a template that shows earlier thinking reads (Qwen3's)
            earlier = turns[-1].get("reasoning_content")
            turns[-1]["reasoning_content"] = f"{earlier}\n{thought}" if earlier else thought
    return chat + turns


def _text_of(param: str, value: Any, *, skip_blocks: bool = False) -> str:
    """The text blocks' text; `skip_blocks`: tool and thinking blocks are read elsewhere."""

    def text(pb: str, block: Any) -> str | None:
        kind = ANTHROPIC.object(pb, block).get("type")
        if skip_blocks and (is_tool_block(block) or is_thinking_block(block)):
            return None
        if kind != "text":
            raise bad(f"{pb}.type", f"{pb}.type: {kind!r} blocks are not supported (only 'text')")
        return read_text(f"{pb}.text", block.get("text"))

    return text_parts(param, value, text, "an array of blocks", ANTHROPIC)


def message_prompt(
    req: MessagesRequest,
    template: ChatTemplate,
    tokenizer: Tokenizer,
    tools: ToolFormat | None = None,
    think: bool = False,
) -> list[int]:
    """The conversation through the chat template (message text never becomes control
    tokens; with `tools`, as that format shows them), then the prefill, if any, as plain
    text after the generation prompt. `think`: whether the reply thinks
    (`MessagesRequest.thinks`), which templates read as `enable_thinking`."""
    messages, variables = list(req.messages), {}
    if tools is not None:
        messages, variables = tools.prepare(req.messages, req.tools)
    variables["enable_thinking"] = think
    try:
        ids = chat_ids(template, tokenizer, messages, add_generation_prompt=True, **variables)
    except ChatTemplateError as exc:
        raise bad("messages", f"messages: {exc}") from None
    if req.prefill:
        ids += tokenizer.encode(req.prefill, add_bos=False)
    return ids


# --- responses ---------------------------------------------------------------------------


def event(name: str, data: dict[str, Any]) -> bytes:
    """One server-sent event the way Anthropic names them."""
    return f"event: {name}\ndata: {dumps(data)}\n\n".encode()


def stop_fields(finish_reason: str, stop_string: str | None) -> dict[str, Any]:
    if finish_reason == "stop" and stop_string is not None:
        return {"stop_reason": "stop_sequence", "stop_sequence": stop_string}
    return {"stop_reason": STOP_REASONS.get(finish_reason, "end_turn"), "stop_sequence": None}


def usage(prompt_tokens: int, cached_tokens: int, output_tokens: int) -> dict[str, int]:
    """Anthropic's input_tokens leaves out what was read from the cache."""
    return {
        "input_tokens": prompt_tokens - cached_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached_tokens,
        "output_tokens": output_tokens,
    }


# luced signs nothing: the thinking blocks it sends carry an empty signature, and those it
# gets back are read without one being checked.
SIGNATURE = ""


@dataclass(frozen=True)
class Thinking:
    """A reply that thinks (`MessagesRequest.thinks`): where its output starts, and how
    its thinking is shown."""

    opened: bool = False  # the prompt ended inside a think block (`reasoning.opens_thinking`)
    omitted: bool = False  # display "omitted": the block keeps its place, not its text


def _block(kind: str, text: str, thinking: Thinking | None = None) -> dict[str, Any]:
    if kind == reasoning.THINKING:
        shown = "" if thinking is not None and thinking.omitted else text
        return {"type": "thinking", "thinking": shown, "signature": SIGNATURE}
    return {"type": "text", "text": text}


def _block_events(index: int, block: dict[str, Any]) -> list[bytes]:
    """A whole content block as a stream shows it: start, its delta(s), stop."""
    if block["type"] == "thinking":  # its text (none when omitted), then its signature
        opened, deltas = {**block, "thinking": ""}, []
        if block["thinking"]:
            deltas.append({"type": "thinking_delta", "thinking": block["thinking"]})
        deltas.append({"type": "signature_delta", "signature": block["signature"]})
    elif block["type"] == "text":
        opened, deltas = _EMPTY_TEXT, [{"type": "text_delta", "text": block["text"]}]
    else:  # tool_use
        opened = {**block, "input": {}}
        deltas = [{"type": "input_json_delta", "partial_json": json.dumps(block["input"])}]
    start = {"type": "content_block_start", "index": index, "content_block": opened}
    return [
        event("content_block_start", start),
        *(_delta_event(index, d) for d in deltas),
        event("content_block_stop", {"type": "content_block_stop", "index": index}),
    ]


def _delta_event(index: int, delta: dict[str, Any]) -> bytes:
    return event(
        "content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}
    )


class MessageFormat:
    """Shapes one request's output: `response(...)`, or `start`, `delta`..., `end` events.
    With `thinking`, the output is split into its thinking and its answer, each a block."""

    def __init__(self, message_id: str, model: str, thinking: Thinking | None = None) -> None:
        self.id = message_id
        self.model = model
        self.thinking = thinking
        self._splitter = None if thinking is None else reasoning.ThinkSplitter(thinking.opened)
        self._open: str | None = None  # the kind of the block a thinking stream is in
        self._index = -1

    def _message(self, content: list[dict[str, Any]], **rest: Any) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            **rest,
        }

    def _split(self, text: str) -> tuple[str, str]:
        """(thinking, answer) of the whole output; no thinking without `thinking`."""
        if self.thinking is None:
            return "", text
        return reasoning.split(text, self.thinking.opened)

    def _content(self, text: str) -> list[dict[str, Any]]:
        thought, answer = self._split(text)
        blocks = [_block(reasoning.THINKING, thought, self.thinking)] if thought else []
        if answer or not blocks:
            blocks.append(_block(reasoning.TEXT, answer))
        return blocks

    def response(
        self, text: str, finish_reason: str, stop_string: str | None, usage: dict[str, int]
    ) -> dict[str, Any]:
        return self._message(
            self._content(text), **stop_fields(finish_reason, stop_string), usage=usage
        )

    def start(self, prompt_tokens: int) -> list[bytes]:
        message = self._message(
            [], stop_reason=None, stop_sequence=None, usage=usage(prompt_tokens, 0, 0)
        )
        events = [event("message_start", {"type": "message_start", "message": message})]
        if self._splitter is None:  # one text block, open from the start
            self._open, self._index = reasoning.TEXT, 0
            start = {"type": "content_block_start", "index": 0, "content_block": _EMPTY_TEXT}
            events.append(event("content_block_start", start))
        return [*events, event("ping", {"type": "ping"})]

    def delta(self, text: str) -> bytes:
        if self._splitter is None:
            return b"".join(self._pieces([(reasoning.TEXT, text)]))
        return b"".join(self._pieces(self._splitter.push(text)))

    def end(
        self, finish_reason: str, stop_string: str | None, usage: dict[str, int]
    ) -> list[bytes]:
        events = [] if self._splitter is None else self._pieces(self._splitter.end())
        if self._index < 0:  # nothing at all was written: an empty text block
            events += self._pieces([(reasoning.TEXT, "")])
        return [
            *events,
            *self._close(),
            event(
                "message_delta",
                {
                    "type": "message_delta",
                    "delta": stop_fields(finish_reason, stop_string),
                    "usage": usage,
                },
            ),
            event("message_stop", {"type": "message_stop"}),
        ]

    def _pieces(self, pieces: list[reasoning.Piece]) -> list[bytes]:
        """Stream events for pieces of output: a new block whenever the kind changes."""
        events: list[bytes] = []
        for kind, text in pieces:
            if kind != self._open:
                events += self._close()
                self._open, self._index = kind, self._index + 1
                opened = _block(kind, "")
                start = {"type": "content_block_start", "index": self._index}
                events.append(event("content_block_start", {**start, "content_block": opened}))
            if not text:  # an empty block (a reply that wrote nothing) has no delta
                continue
            if kind == reasoning.THINKING:
                if self.thinking is not None and self.thinking.omitted:
                    continue
                delta = {"type": "thinking_delta", "thinking": text}
            else:
                delta = {"type": "text_delta", "text": text}
            events.append(_delta_event(self._index, delta))
        return events

    def _close(self) -> list[bytes]:
        """End the open block (a thinking block with its signature first)."""
        if self._open is None:
            return []
        events = []
        if self._open == reasoning.THINKING:
            signed = {"type": "signature_delta", "signature": SIGNATURE}
            events.append(_delta_event(self._index, signed))
        stop = {"type": "content_block_stop", "index": self._index}
        self._open = None
        return [*events, event("content_block_stop", stop)]


_EMPTY_TEXT = {"type": "text", "text": ""}


class ToolMessageFormat(MessageFormat):
    """A reply to a request that offered tools: the text is held back to the end (a call
    is only a call once it parses), then sent as a thinking block (when it thought), a
    text block and/or `tool_use` blocks, with stop_reason "tool_use" when the model
    called."""

    def __init__(
        self, message_id: str, model: str, tools: ToolFormat, thinking: Thinking | None = None
    ) -> None:
        super().__init__(message_id, model, thinking)
        self.tools = tools
        self._text: list[str] = []

    def _blocks(self, text: str) -> tuple[list[dict[str, Any]], bool]:
        thought, answer = self._split(text)
        blocks = [_block(reasoning.THINKING, thought, self.thinking)] if thought else []
        parsed = self.tools.parse(answer)
        if parsed.content:
            blocks.append(_block(reasoning.TEXT, parsed.content))
        for call in parsed.calls:
            call_id = f"toolu_{call.id.removeprefix('call_')}"
            arguments = json.loads(call.arguments)
            blocks.append(
                {"type": "tool_use", "id": call_id, "name": call.name, "input": arguments}
            )
        return blocks, bool(parsed.calls)

    def response(
        self, text: str, finish_reason: str, stop_string: str | None, usage: dict[str, int]
    ) -> dict[str, Any]:
        blocks, called = self._blocks(text)
        return self._message(blocks, **self._stop(called, finish_reason, stop_string), usage=usage)

    def start(self, prompt_tokens: int) -> list[bytes]:
        return [ev for ev in super().start(prompt_tokens) if b"content_block_start" not in ev]

    def delta(self, text: str) -> bytes:
        self._text.append(text)
        return b""

    def end(
        self, finish_reason: str, stop_string: str | None, usage: dict[str, int]
    ) -> list[bytes]:
        blocks, called = self._blocks("".join(self._text))
        events = [ev for i, block in enumerate(blocks) for ev in _block_events(i, block)]
        message_delta = {
            "type": "message_delta",
            "delta": self._stop(called, finish_reason, stop_string),
            "usage": usage,
        }
        return [
            *events,
            event("message_delta", message_delta),
            event("message_stop", {"type": "message_stop"}),
        ]

    @staticmethod
    def _stop(called: bool, finish_reason: str, stop_string: str | None) -> dict[str, Any]:
        if called and finish_reason == "stop":
            return {"stop_reason": "tool_use", "stop_sequence": None}
        return stop_fields(finish_reason, stop_string)
