"""Anthropic's tool use, the request side: `tools` and `tool_choice` -> the shared `Tool`s
and `ToolChoice` (luced.text.tool_calls does the formats), and a message's `tool_use` /
`tool_result` blocks -> the chat turns those formats render, as OpenAI clients send them.

    tools        [{"name", "description"?, "input_schema"}]   client tools; a server tool
                                                              ({"type": "web_search_..."}) is a 400
    tool_choice  {"type": "auto"} (the default with tools) | {"type": "any"} (= required)
                 | {"type": "tool", "name": ...} | {"type": "none"}

    assistant [text..., tool_use{id, name, input}...]  -> {"role": "assistant", "content",
                                                           "tool_calls": [...]}
    user [tool_result{tool_use_id, content}..., text...] -> {"role": "tool", ...} turns,
                                                           then one user turn for the text
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from typing import Any

from luced.api.content import text_parts
from luced.api.fields import ANTHROPIC, bad, read_text
from luced.api.tools import function_choice, function_tool, read_tools
from luced.text.tool_calls import Tool, ToolChoice


def parse_tools(body: Mapping[str, Any]) -> tuple[tuple[Tool, ...], ToolChoice]:
    tools = read_tools(body.get("tools"), _tool, lambda i: f"tools.{i}")
    return tools, _choice(body.get("tool_choice"), tools)


def _tool(param: str, value: Any) -> Tool:
    if ANTHROPIC.object(param, value).get("type") not in (None, "custom"):
        raise bad(
            f"{param}.type", f"{param}.type: server tools ({value['type']!r}) are not supported"
        )
    if value.get("input_schema") is None:
        raise bad(f"{param}.input_schema", f"{param}.input_schema: Field required")
    return function_tool(param, value, "input_schema")


def _choice(value: Any, tools: tuple[Tool, ...]) -> ToolChoice:
    if value is None:
        return ToolChoice("auto" if tools else "none")
    kind = value.get("type") if isinstance(value, Mapping) else None
    if kind == "none" or (kind == "auto" and tools):
        return ToolChoice(kind)
    if kind == "auto":
        return ToolChoice("none")
    if kind == "any":
        if not tools:
            raise bad("tool_choice", 'tool_choice: {"type": "any"} needs tools')
        return ToolChoice("required")
    if kind == "tool":
        name = value.get("name")
        return function_choice(name, tools, f"tool_choice.name: {name!r} is not among the tools")
    raise bad(
        "tool_choice",
        'tool_choice: expected {"type": "auto"}, {"type": "any"}, {"type": "none"} or '
        '{"type": "tool", "name": ...}',
    )


def is_tool_block(block: Any) -> bool:
    return isinstance(block, Mapping) and block.get("type") in ("tool_use", "tool_result")


def assistant_turn(param: str, text: str, blocks: list[tuple[int, Mapping[str, Any]]]) -> dict:
    """An assistant turn with its text and the calls of its `tool_use` blocks."""
    calls = []
    for j, pb, block in _only(param, blocks, "tool_use", "a user message"):
        name = read_text(f"{pb}.name", block.get("name"))
        arguments = ANTHROPIC.object(f"{pb}.input", block.get("input", {}))
        call_id = read_text(f"{pb}.id", block.get("id", f"toolu_{j}"))
        function = {"name": name, "arguments": json.dumps(arguments)}
        calls.append({"id": call_id, "type": "function", "function": function})
    return {"role": "assistant", "content": text or None, "tool_calls": calls}


def tool_results(param: str, blocks: list[tuple[int, Mapping[str, Any]]]) -> list[dict]:
    """The `tool` turns of a user message's `tool_result` blocks."""
    turns = []
    for _, pb, block in _only(param, blocks, "tool_result", "an assistant message"):
        call_id = read_text(f"{pb}.tool_use_id", block.get("tool_use_id"))
        content = _result_text(f"{pb}.content", block.get("content", ""))
        if block.get("is_error"):
            content = f"Error: {content}"
        turns.append({"role": "tool", "tool_call_id": call_id, "content": content})
    return turns


def _only(
    param: str, blocks: list[tuple[int, Mapping[str, Any]]], kind: str, other_place: str
) -> Iterator[tuple[int, str, Mapping[str, Any]]]:
    """(j, path, block) of each `kind` block; a 400 for one of the other kind, which
    belongs in `other_place`."""
    for j, block in blocks:
        pb = f"{param}.{j}"
        if block["type"] != kind:
            raise bad(f"{pb}.type", f"{pb}.type: {block['type']} blocks belong in {other_place}")
        yield j, pb, block


def _result_text(param: str, value: Any) -> str:
    return text_parts(param, value, _result_block, "text blocks", ANTHROPIC)


def _result_block(param: str, block: Any) -> str:
    if not isinstance(block, Mapping) or block.get("type") != "text":
        raise bad(param, f"{param}: only text blocks are supported in a result")
    return read_text(f"{param}.text", block.get("text"))
