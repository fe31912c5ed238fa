"""Anthropic's extended thinking, the request side: the `thinking` option and the thinking
blocks of earlier turns (the shapes of a reply that thinks are in `luced.api.anthropic`).

    thinking   {"type": "enabled", "budget_tokens": N} | {"type": "adaptive"}
               | {"type": "between_tools"}: think, when the model can
               | {"type": "disabled"} (the default): do not
               "display": "summarized" (the default) or "omitted" (the block's text left out)

A reply thinks when thinking is asked for, the chat template's model thinks
(`luced.text.reasoning.thinks`), and its text is free: no prefill to continue and no tool
call forced by a grammar. The template is told so (`enable_thinking`); any other reply is
an answer without thinking. `budget_tokens` is checked, not enforced: max_tokens bounds
the thinking and the answer together, as Anthropic's does.

Agent clients send every earlier assistant turn back whole, thinking blocks included:

    assistant [thinking{thinking, signature}..., redacted_thinking{data}..., text..., tool_use...]
        -> the turn's `reasoning_content`: the thinking text, which a template that knows it
           renders (Qwen3's, for the turns of the current tool loop) and any other ignores;
           redacted blocks hold no text and are dropped; signatures are not checked
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from luced.api.fields import INT32_MAX, as_int, bad, json_kind, read_text

THINKING_BLOCKS = ("thinking", "redacted_thinking")
_THINKS = ("enabled", "adaptive", "between_tools")
DISPLAYS = ("summarized", "omitted")


def parse_thinking(body: Mapping[str, Any]) -> str | None:
    """How a reply should show its thinking ("summarized" or "omitted"), None for none."""
    value = body.get("thinking")
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise bad("thinking", f"thinking: expected an object, got {json_kind(value)}")
    kind = value.get("type")
    if kind == "disabled":
        return None
    if kind not in _THINKS:
        expected = ", ".join(repr(k) for k in (*_THINKS, "disabled"))
        raise bad("thinking.type", f"thinking.type: expected one of {expected}, got {kind!r}")
    if kind == "enabled":
        param = "thinking.budget_tokens"
        if value.get("budget_tokens") is None:
            raise bad(param, f"{param}: Field required")
        budget = as_int(param, value["budget_tokens"])
        if not 1 <= budget <= INT32_MAX:
            raise bad(param, f"{param}: must be in [1, {INT32_MAX}], got {budget}")
    display = value.get("display") or "summarized"
    if display not in DISPLAYS:
        expected = " or ".join(repr(d) for d in DISPLAYS)
        raise bad("thinking.display", f"thinking.display: expected {expected}, got {display!r}")
    return display


def is_thinking_block(block: Any) -> bool:
    return isinstance(block, Mapping) and block.get("type") in THINKING_BLOCKS


def reasoning_of(param: str, role: str, content: Any) -> str:
    """The thinking text of a message's blocks ("" for none): only assistant turns think."""
    if not isinstance(content, list):
        return ""
    texts = []
    for j, block in enumerate(content):
        if not is_thinking_block(block):
            continue
        pb = f"{param}.{j}"
        if role != "assistant":
            raise bad(
                f"{pb}.type", f"{pb}.type: {block['type']} blocks belong in an assistant message"
            )
        if block["type"] == "thinking":
            texts.append(read_text(f"{pb}.thinking", block.get("thinking", "")))
    return "\n".join(t for t in texts if t)
