"""OpenAI's `tools` and `tool_choice` -> `Tool`s and a `ToolChoice`, validated; and the
`tool_calls` a reply carries (luced.text.tool_calls does the formats).

    tools        [{"type": "function", "function": {"name", "description"?, "parameters"?}}]
    tool_choice  "auto" (the default with tools) | "none" | "required"
                 | {"type": "function", "function": {"name": ...}}

A parameter schema llguidance cannot compile is a 400 naming
`tools[i].function.parameters`, found when the request arrives rather than mid-stream.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from luced.api.fields import OPENAI, bad, json_kind, read_text
from luced.api.formats import ChatFormat
from luced.engine.output import Delta
from luced.text.grammar import GrammarError, json_value
from luced.text.tool_calls import Tool, ToolCall, ToolChoice, ToolFormat

MAX_TOOLS = 128
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")  # OpenAI's rule for function names


def parse_tools(body: Mapping[str, Any]) -> tuple[tuple[Tool, ...], ToolChoice]:
    tools = read_tools(body.get("tools"), _tool, lambda i: f"tools[{i}]")
    return tools, read_choice(body.get("tool_choice"), tools)


def read_tools(
    value: Any, read_one: Callable[[str, Any], Tool], path: Callable[[int], str]
) -> tuple[Tool, ...]:
    """A `tools` array, each entry read by `read_one(its path, entry)` (every API spells
    a tool its own way; `path(i)` in its style); no tools for null or []."""
    if value is None or value == []:
        return ()
    if not isinstance(value, list):
        raise bad("tools", f"tools must be an array of tools, got {json_kind(value)}")
    if len(value) > MAX_TOOLS:
        raise bad("tools", f"tools takes at most {MAX_TOOLS} tools, got {len(value)}")
    tools = tuple(read_one(path(i), t) for i, t in enumerate(value))
    if len({t.name for t in tools}) != len(tools):
        raise bad("tools", "tools must have distinct names")
    return tools


def _tool(param: str, value: Any) -> Tool:
    if OPENAI.object(param, value).get("type") != "function":
        raise bad(f"{param}.type", f'{param}.type must be "function", got {value.get("type")!r}')
    return function_tool(
        f"{param}.function", OPENAI.object(f"{param}.function", value.get("function"))
    )


def function_tool(param: str, spec: Mapping[str, Any], schema_key: str = "parameters") -> Tool:
    """A tool from its `name`, `description` and schema (`schema_key`; none: no arguments),
    the fields named under `param`."""
    name = check_tool_name(f"{param}.name", spec.get("name"))
    description = spec.get("description")
    if description is not None:
        description = read_text(f"{param}.description", description)
    schema = spec.get(schema_key)
    if schema is None:
        schema = {"type": "object", "properties": {}}
    return Tool(name, description or "", checked_parameters(f"{param}.{schema_key}", schema))


def check_tool_name(param: str, value: Any) -> str:
    name = read_text(param, value)
    if not _NAME.match(name):
        raise bad(param, f"{param} must be 1-64 letters, digits, '_', '.' or '-', got {name!r}")
    return name


def checked_parameters(param: str, schema: Any) -> dict[str, Any]:
    """A tool's JSON schema, once llguidance compiles it (else a 400 naming `param`)."""
    if not isinstance(schema, Mapping):
        raise bad(param, f"{param} must be a JSON schema object, got {json_kind(schema)}")
    try:
        json_value(schema)
    except GrammarError as exc:
        raise bad(param, f"{param}: {exc}") from None
    return dict(schema)


def read_choice(value: Any, tools: Sequence[Tool], *, flat: bool = False) -> ToolChoice:
    """OpenAI's `tool_choice`; `flat`: the Responses API's spelling of a named function,
    {"type": "function", "name": ...}, not Chat Completions' {..., "function": {"name"}}."""
    if value is None:
        return ToolChoice("auto" if tools else "none")
    if value in ("auto", "none", "required"):
        if value == "required" and not tools:
            raise bad("tool_choice", 'tool_choice "required" needs tools')
        return ToolChoice(value if tools else "none")
    if isinstance(value, Mapping) and value.get("type") == "function":
        fn = value if flat else value.get("function")
        name = fn.get("name") if isinstance(fn, Mapping) else None
        return function_choice(
            name, tools, f"tool_choice names {name!r}, which is not among the tools"
        )
    named = '"name": ...' if flat else '"function": {"name": ...}'
    raise bad(
        "tool_choice",
        f'tool_choice must be "auto", "none", "required" or {{"type": "function", {named}}}',
    )


def function_choice(name: Any, tools: Sequence[Tool], unknown: str) -> ToolChoice:
    """The choice to call tool `name`; a 400 on tool_choice saying `unknown` when no tool
    has that name."""
    if not any(t.name == name for t in tools):
        raise bad("tool_choice", unknown)
    return ToolChoice("function", name)


def openai_tool_calls(calls: Sequence[ToolCall]) -> list[dict[str, Any]]:
    """A chat message's `tool_calls`."""
    return [
        {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
        for c in calls
    ]


class ToolChatFormat(ChatFormat):
    """Chat output of a request that offered tools. The text is held back to the end (a
    call is only known to be one once it parses), then sent as `content` and/or
    `tool_calls`; finish_reason "tool_calls" when the model called."""

    def __init__(self, *args: Any, tools: ToolFormat, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tools = tools
        self._text: list[str] = []

    def choice(self, deltas: Sequence[Delta], finish_reason: str) -> dict[str, Any]:
        choice = super().choice(deltas, finish_reason)
        parsed = self.tools.parse(choice["message"]["content"])
        choice["message"]["content"] = parsed.content
        if parsed.calls:
            choice["message"]["tool_calls"] = openai_tool_calls(parsed.calls)
            choice["finish_reason"] = _finish(finish_reason)
        return choice

    def chunk(self, delta: Delta) -> dict[str, Any] | None:
        self._text.append(delta.text)
        held = Delta("", delta.token_ids, delta.logprobs)  # logprobs still stream
        return super().chunk(held)

    def finish(self, finish_reason: str) -> list[dict[str, Any]]:
        parsed = self.tools.parse("".join(self._text))
        chunks = []
        if parsed.content:
            chunks.append(self._delta({"content": parsed.content}))
        if parsed.calls:
            calls = [{"index": i, **c} for i, c in enumerate(openai_tool_calls(parsed.calls))]
            chunks.append(self._delta({"tool_calls": calls}))
            finish_reason = _finish(finish_reason)
        return chunks + super().finish(finish_reason)

    def _delta(self, delta: dict[str, Any]) -> dict[str, Any]:
        return self._chunk({"delta": delta, "logprobs": None, "finish_reason": None})


def _finish(reason: str) -> str:
    # A call that ran into max_tokens did not parse, so "stop" is the only end to rename.
    return "tool_calls" if reason == "stop" else reason
