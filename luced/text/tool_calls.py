"""Tool calls: how a model is shown the tools, the grammar that holds it to a call, and the
calls parsed back out of what it wrote (torch-free, API-neutral).

Two formats, chosen by the chat template (`tool_format`):

    native (Qwen)  the template renders `tools` itself and the model answers a call with
                   <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>; text
                   around the blocks is the reply's content
    generic        for templates that know no tools (SmolLM2's): the tools are described in
                   the system turn and the whole answer is one JSON object, either
                   {"tool_call": {"name": ..., "arguments": {...}}} or {"response": "..."}

Under `tool_choice` "required" or a named function the output is constrained to a call of
the allowed tools (arguments valid against each tool's parameter schema), so even a small
model emits a well-formed call. The generic format constrains "auto" too (a call or a
response), since its answer is always JSON; the native one leaves "auto" free text.

History goes back through the same format: an assistant turn's `tool_calls` and the
`tool` turns that answer them are rendered natively by a template that knows tools, and
as the generic JSON objects (tool results in a user turn) by one that does not.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from luced.text.chat_template import ChatTemplate
from luced.text.grammar import json_value

Message = dict[str, Any]


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: Mapping[str, Any]  # a JSON schema of the arguments object

    def as_openai(self) -> dict[str, Any]:
        """The tool as templates read it (OpenAI's {"type": "function", "function": ...})."""
        spec = {"name": self.name, "description": self.description, "parameters": self.parameters}
        return {"type": "function", "function": spec}


@dataclass(frozen=True)
class ToolChoice:
    mode: str  # "auto", "none", "required" or "function"
    name: str | None = None  # the function under mode "function"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # the arguments object as JSON text
    id: str = ""

    @staticmethod
    def new(name: str, arguments: Any) -> ToolCall:
        text = arguments if isinstance(arguments, str) else json.dumps(arguments)
        return ToolCall(name, text, f"call_{uuid.uuid4().hex[:24]}")


@dataclass(frozen=True)
class Parsed:
    content: str | None  # the reply's text, None when it only called tools
    calls: tuple[ToolCall, ...]


def _arguments_schema(tool: Tool) -> Any:
    return _closed(tool.parameters or {"type": "object", "properties": {}})


def _closed(schema: Any) -> Any:
    """Objects that list their properties take no others unless they say so (OpenAI's
    strict mode): an open object lets a small model invent keys until max_tokens."""
    if isinstance(schema, Mapping):
        out = {k: _closed(v) for k, v in schema.items()}
        if "properties" in out and "additionalProperties" not in out:
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_closed(v) for v in schema]
    return schema


def _allowed(tools: Sequence[Tool], choice: ToolChoice) -> list[Tool]:
    if choice.mode == "function":
        return [t for t in tools if t.name == choice.name]
    return list(tools)


class ToolFormat:
    """One way of showing tools to a model and reading its calls back."""

    name = ""

    def prepare(
        self, messages: Sequence[Message], tools: Sequence[Tool]
    ) -> tuple[list[Message], dict[str, Any]]:
        """Messages and template variables for a request that offers `tools`."""
        raise NotImplementedError

    def grammar(self, tools: Sequence[Tool], choice: ToolChoice) -> str | None:
        raise NotImplementedError

    def parse(self, text: str) -> Parsed:
        raise NotImplementedError


class NativeToolFormat(ToolFormat):
    """Qwen's: the template renders the tools, calls come in <tool_call> blocks."""

    name = "qwen"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    _BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)

    def prepare(
        self, messages: Sequence[Message], tools: Sequence[Tool]
    ) -> tuple[list[Message], dict[str, Any]]:
        chat = [_with_parsed_arguments(m) for m in messages]
        return chat, {"tools": [t.as_openai() for t in tools] or None}

    def grammar(self, tools: Sequence[Tool], choice: ToolChoice) -> str | None:
        if choice.mode in ("auto", "none"):
            return None  # free text that may hold calls
        call = json_value(_call_schema(_allowed(tools, choice), inner=False))
        block = f'"{self.OPEN}\\n" {call} "\\n{self.CLOSE}"'
        return f'start: {block} ("\\n" {block})*'

    def parse(self, text: str) -> Parsed:
        calls = []
        for body in self._BLOCK.findall(text):
            try:
                obj = json.loads(body)
            except json.JSONDecodeError:
                continue  # not a call: left in the content as written
            if isinstance(obj, dict) and isinstance(obj.get("name"), str):
                calls.append(ToolCall.new(obj["name"], obj.get("arguments", {})))
        if not calls:
            return Parsed(text, ())
        content = self._BLOCK.sub("", text).strip()
        return Parsed(content or None, tuple(calls))


class GenericToolFormat(ToolFormat):
    """For templates without tools: described in the system turn, answered as JSON."""

    name = "generic"

    def prepare(
        self, messages: Sequence[Message], tools: Sequence[Tool]
    ) -> tuple[list[Message], dict[str, Any]]:
        chat = [self._plain(m) for m in messages]
        if tools:
            note = self._describe(tools)
            if chat and chat[0]["role"] == "system":
                chat[0] = {**chat[0], "content": f"{chat[0].get('content') or ''}\n\n{note}"}
            else:
                chat.insert(0, {"role": "system", "content": note})
        return chat, {}

    def grammar(self, tools: Sequence[Tool], choice: ToolChoice) -> str | None:
        if choice.mode == "none":
            return None
        options = [_call_schema(_allowed(tools, choice), inner=True)]
        if choice.mode == "auto":
            options.append(_object({"response": {"type": "string"}}))
        schema = options[0] if len(options) == 1 else {"anyOf": options}
        return f"start: {json_value(schema)}"

    def parse(self, text: str) -> Parsed:
        try:
            obj = json.loads(text)
        except json.JSONDecodeError:
            return Parsed(_partial_response(text), ())
        if isinstance(obj, dict):
            call = obj.get("tool_call")
            if isinstance(call, dict) and isinstance(call.get("name"), str):
                return Parsed(None, (ToolCall.new(call["name"], call.get("arguments", {})),))
            if isinstance(obj.get("response"), str):
                return Parsed(obj["response"], ())
        return Parsed(text, ())

    @staticmethod
    def _describe(tools: Sequence[Tool]) -> str:
        listed = "\n".join(json.dumps(t.as_openai()["function"]) for t in tools)
        return (
            "You can call these tools:\n"
            f"{listed}\n"
            "Answer with one JSON object: to call a tool, "
            '{"tool_call": {"name": "<tool name>", "arguments": {<its arguments>}}}; '
            'to reply to the user, {"response": "<your reply>"}.'
        )

    @staticmethod
    def _plain(message: Message) -> Message:
        """A turn as a template without tools can render it: calls and results as JSON."""
        role = message["role"]
        if role == "assistant" and message.get("tool_calls"):
            (call, *_) = message["tool_calls"]
            fn = call.get("function", {}) if isinstance(call, Mapping) else {}
            body = {"name": fn.get("name"), "arguments": _loads(fn.get("arguments", {}))}
            return {"role": "assistant", "content": json.dumps({"tool_call": body})}
        if role == "assistant" and message.get("content") is not None:
            return {"role": "assistant", "content": json.dumps({"response": message["content"]})}
        if role == "tool":
            result = {"tool_result": message.get("content", "")}
            if message.get("name"):
                result["name"] = message["name"]
            return {"role": "user", "content": json.dumps(result)}
        return dict(message)


def _partial_response(text: str) -> str:
    """The reply of a {"response": "..."} that max_tokens cut short; other text as is."""
    head = '{"response": "'
    if not text.startswith(head):
        return text
    body = text[len(head) :]
    for cut in range(min(len(body), 6) + 1):  # drop a half-written escape (\u00e)
        try:
            return json.loads(f'"{body[: len(body) - cut]}"')
        except json.JSONDecodeError:
            continue
    return text


def has_tool_turns(messages: Sequence[Message]) -> bool:
    """Whether a conversation holds calls or results, which only a tool format renders."""
    return any(m.get("tool_calls") or m.get("role") == "tool" for m in messages)


def tool_format(template: ChatTemplate) -> ToolFormat:
    """Native when the template renders `tools` and Qwen's call blocks; generic otherwise."""
    source = template.source
    if "tools" in source and NativeToolFormat.OPEN in source:
        return NativeToolFormat()
    return GenericToolFormat()


def _object(properties: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": dict(properties),
        "required": list(properties),
        "additionalProperties": False,
    }


def _call_schema(tools: Sequence[Tool], *, inner: bool) -> dict[str, Any]:
    """A call of one of `tools`: {"name", "arguments"}, wrapped in {"tool_call": ...} when
    `inner` (the generic format)."""
    calls = [_object({"name": {"const": t.name}, "arguments": _arguments_schema(t)}) for t in tools]
    call = calls[0] if len(calls) == 1 else {"anyOf": calls}
    return _object({"tool_call": call}) if inner else call


def _loads(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return arguments


def _with_parsed_arguments(message: Message) -> Message:
    """Qwen's template writes `arguments | tojson`: hand it objects, not JSON text."""
    calls = message.get("tool_calls")
    if not calls:
        return dict(message)
    fixed = []
    for call in calls:
        fn = dict(call.get("function", {})) if isinstance(call, Mapping) else {}
        if "arguments" in fn:
            fn["arguments"] = _loads(fn["arguments"])
        fixed.append({**call, "function": fn})
    return {**message, "tool_calls": fixed}
