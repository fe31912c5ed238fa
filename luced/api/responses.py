"""OpenAI's Responses API, the stateless subset: `POST /v1/responses` bodies -> the chat
request the rest of the API serves, and engine output -> response objects and the typed
`response.*` stream events. Pure functions, no I/O; the route is in `luced.api.server`.

Field policy:

* Honoured: model, input (a string, or items: messages with `input_text` / `output_text`
  parts, `function_call` and `function_call_output`), instructions (a system turn first),
  max_output_tokens, temperature, top_p, stream, tools (function tools, flat:
  {"type": "function", "name", "description", "parameters"}), tool_choice ("auto",
  "none", "required", {"type": "function", "name"}), text.format (text, json_object,
  json_schema {"name", "schema", "strict"}, as `response_format`).
* `previous_response_id` is a 400 naming it: responses are not stored, so send the whole
  conversation as `input`. Other tool types (web_search, file_search, ...) and non-text
  parts are a 400; unknown fields (store, metadata, reasoning, ...) are ignored.

Stream, each event `event: TYPE` + `data: {"type": TYPE, "sequence_number": n, ...}`:

    response.created  response.in_progress
    per output item:  response.output_item.added
      a message:        response.content_part.added  response.output_text.delta*
                        response.output_text.done  response.content_part.done
      a function call:  response.function_call_arguments.delta / .done
                      response.output_item.done
    response.completed (or response.incomplete at max_output_tokens)
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from typing import Any

from luced.api.content import objects, read_role, text_parts
from luced.api.fields import INT_RANGES, APIError, bad, json_kind, read_bool, read_int, read_text
from luced.api.openai import ChatRequest, Options, check_model, sampling_params
from luced.api.response_format import response_format_grammar
from luced.api.tools import function_tool, read_choice, read_tools
from luced.text.tool_calls import Tool, ToolFormat

ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
TEXT_PARTS = ("input_text", "output_text")


def parse_responses(body: Mapping[str, Any], *, model_name: str) -> ChatRequest:
    """A validated Responses body as the chat request it amounts to (APIError otherwise)."""
    check_model(body, model_name)
    if body.get("previous_response_id") is not None:
        raise bad(
            "previous_response_id",
            "previous_response_id is not supported: responses are not stored; "
            "send the whole conversation as input",
        )
    tools = _tools(body.get("tools"))
    options = Options(
        model=model_name,
        stream=read_bool(body, "stream"),
        include_usage=False,
        params=sampling_params(body, None),
        max_tokens=read_int(body, "max_output_tokens", *INT_RANGES["max_tokens"]),
        grammar=_text_format(body.get("text")),
    )
    choice = read_choice(body.get("tool_choice"), tools, flat=True)
    if choice.mode != "none" and options.grammar is not None:
        raise bad("text.format", "text.format cannot be combined with tools")
    messages = []
    if body.get("instructions") is not None:
        messages.append(
            {"role": "system", "content": read_text("instructions", body["instructions"])}
        )
    messages += _input(body.get("input"))
    return ChatRequest(options, tuple(messages), tools, choice)


def _text_format(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise bad("text", f"text must be an object, got {json_kind(value)}")
    fmt = value.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, Mapping):
        raise bad("text.format", f"text.format must be an object, got {json_kind(fmt)}")
    spec = {k: v for k, v in fmt.items() if k != "type"}
    as_chat = {"type": fmt.get("type")}
    if fmt.get("type") == "json_schema":
        as_chat["json_schema"] = spec
    try:
        return response_format_grammar(as_chat)
    except APIError as exc:  # named as response_format.json_schema.X: name ours
        param = (exc.param or "").replace("response_format.json_schema", "text.format")
        param = param.replace("response_format", "text.format")
        message = exc.message.replace("response_format.json_schema", "text.format")
        raise bad(param, message.replace("response_format", "text.format")) from None


def _tools(value: Any) -> tuple[Tool, ...]:
    return read_tools(value, _tool, lambda i: f"tools[{i}]")


def _tool(p: str, t: Any) -> Tool:
    """A function tool in the Responses API's flat spelling."""
    if not isinstance(t, Mapping):
        raise bad(p, f"{p} must be an object, got {json_kind(t)}")
    if t.get("type") != "function":
        kind = t.get("type")
        raise bad(f"{p}.type", f'{p}.type: only "function" tools are supported, got {kind!r}')
    return function_tool(p, t)


def _input(value: Any) -> list[dict[str, Any]]:
    if isinstance(value, str):
        return [{"role": "user", "content": read_text("input", value)}]
    turns: list[dict[str, Any]] = []
    for p, item in objects("input", value, "a string or a non-empty array of items"):
        kind = item.get("type", "message")
        if kind == "message":
            role = read_role(p, item, ROLES)
            turns.append(
                {"role": ROLES[role], "content": _content(f"{p}.content", item.get("content"))}
            )
        elif kind == "function_call":
            call = {
                "id": read_text(f"{p}.call_id", item.get("call_id")),
                "type": "function",
                "function": {
                    "name": read_text(f"{p}.name", item.get("name")),
                    "arguments": read_text(f"{p}.arguments", item.get("arguments", "{}")),
                },
            }
            if turns and turns[-1]["role"] == "assistant" and turns[-1].get("tool_calls"):
                turns[-1]["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                turns.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else json.dumps(output)
            call_id = read_text(f"{p}.call_id", item.get("call_id"))
            turns.append({"role": "tool", "tool_call_id": call_id, "content": text})
        else:
            raise bad(f"{p}.type", f"{p}.type {kind!r} is not supported")
    return turns


def _content(param: str, value: Any) -> str:
    return text_parts(param, value, _text_part, "an array of parts")


def _text_part(param: str, part: Any) -> str:
    if not isinstance(part, Mapping) or part.get("type") not in TEXT_PARTS:
        kind = part.get("type") if isinstance(part, Mapping) else json_kind(part)
        only = ", ".join(TEXT_PARTS)
        raise bad(param, f"{param}: {kind!r} parts are not supported (only {only})")
    return read_text(f"{param}.text", part.get("text"))


# --- responses ---------------------------------------------------------------------------


def usage(prompt_tokens: int, cached_tokens: int, output_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {"cached_tokens": cached_tokens},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt_tokens + output_tokens,
    }


def _message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": []}] if status else []
    return {
        "type": "message",
        "id": item_id,
        "status": status,
        "role": "assistant",
        "content": content,
    }


class ResponseFormat:
    """Shapes one request's output: `response(...)`, or `start`, `delta`..., `end` events.
    With `tools` the text is held back to the end and parsed into items."""

    def __init__(
        self, response_id: str, model: str, created: int, req: ChatRequest, tools: ToolFormat | None
    ) -> None:
        self.id = response_id
        self.model = model
        self.created = created
        self.req = req
        self.tools = tools
        self.message_id = f"msg_{uuid.uuid4().hex}"
        self._seq = 0
        self._text: list[str] = []

    def _object(self, status: str, output: list[dict[str, Any]], usage: dict | None) -> dict:
        params = self.req.options.params
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "model": self.model,
            "output": output,
            "usage": usage,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete"
            else None,
            "max_output_tokens": self.req.options.max_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "tools": [{"type": "function", **t.as_openai()["function"]} for t in self.req.tools],
            "tool_choice": self._tool_choice(),
            "parallel_tool_calls": True,
        }

    def _tool_choice(self) -> Any:
        choice = self.req.tool_choice
        return (
            {"type": "function", "name": choice.name} if choice.mode == "function" else choice.mode
        )

    def _items(self, text: str) -> list[dict[str, Any]]:
        if self.tools is None:
            return [_message_item(self.message_id, text)]
        parsed = self.tools.parse(text)
        items = [_message_item(self.message_id, parsed.content)] if parsed.content else []
        for call in parsed.calls:
            items.append({
                "type": "function_call",
                "id": f"fc_{uuid.uuid4().hex}",
                "call_id": call.id,
                "name": call.name,
                "arguments": call.arguments,
                "status": "completed",
            })  # fmt: skip
        return items

    @staticmethod
    def _status(finish_reason: str) -> str:
        return "incomplete" if finish_reason == "length" else "completed"

    def response(self, text: str, finish_reason: str, usage: dict[str, Any]) -> dict[str, Any]:
        return self._object(self._status(finish_reason), self._items(text), usage)

    # -- stream --

    def event(self, kind: str, **data: Any) -> bytes:
        body = {"type": kind, "sequence_number": self._seq, **data}
        self._seq += 1
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n".encode()

    def error_events(self, err: APIError) -> list[bytes]:
        return [self.event("error", code=err.code, message=err.message, param=err.param)]

    def start(self) -> list[bytes]:
        pending = self._object("in_progress", [], None)
        events = [self.event("response.created", response=pending)]
        events.append(self.event("response.in_progress", response=pending))
        if self.tools is None:  # the message streams as it comes
            events += self._open_message(0)
        return events

    def _open_message(self, index: int) -> list[bytes]:
        part = {"type": "output_text", "text": "", "annotations": []}
        item = _message_item(self.message_id, "", status="in_progress")
        return [
            self.event("response.output_item.added", output_index=index, item=item),
            self.event(
                "response.content_part.added",
                item_id=self.message_id, output_index=index, content_index=0, part=part,
            ),
        ]  # fmt: skip

    def _text_delta(self, index: int, text: str) -> bytes:
        return self.event(
            "response.output_text.delta",
            item_id=self.message_id, output_index=index, content_index=0, delta=text, logprobs=[],
        )  # fmt: skip

    def delta(self, text: str) -> list[bytes]:
        self._text.append(text)
        return [] if self.tools is not None else [self._text_delta(0, text)]

    def end(self, finish_reason: str, usage: dict[str, Any]) -> list[bytes]:
        items = self._items("".join(self._text))
        events = []
        for index, item in enumerate(items):
            if item["type"] == "message":
                if self.tools is not None:
                    events += self._open_message(index)
                    events.append(self._text_delta(index, item["content"][0]["text"]))
                events += self._close_message(index, item)
            else:
                events += self._call_events(index, item)
        status = self._status(finish_reason)
        done = "response.completed" if status == "completed" else "response.incomplete"
        return [*events, self.event(done, response=self._object(status, items, usage))]

    def _close_message(self, index: int, item: dict[str, Any]) -> list[bytes]:
        part = item["content"][0]
        ids = {"item_id": self.message_id, "output_index": index, "content_index": 0}
        return [
            self.event("response.output_text.done", **ids, text=part["text"], logprobs=[]),
            self.event("response.content_part.done", **ids, part=part),
            self.event("response.output_item.done", output_index=index, item=item),
        ]

    def _call_events(self, index: int, item: dict[str, Any]) -> list[bytes]:
        opened = {**item, "arguments": "", "status": "in_progress"}
        ids = {"item_id": item["id"], "output_index": index}
        return [
            self.event("response.output_item.added", output_index=index, item=opened),
            self.event("response.function_call_arguments.delta", **ids, delta=item["arguments"]),
            self.event("response.function_call_arguments.done", **ids, arguments=item["arguments"]),
            self.event("response.output_item.done", output_index=index, item=item),
        ]
