"""A message's content and role, read the same way by every chat API.

Content is a string, or an array of parts whose text is joined with "\\n"; each API reads
its own parts (OpenAI's {"type": "text"}, the Responses API's input_text / output_text,
Anthropic's text blocks) with its own words, and names them in its `Spelling`.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Mapping
from typing import Any

from luced.api.fields import OPENAI, Spelling, bad, json_kind, read_text

# (a part's path, the part) -> its text; None: a part read elsewhere (a tool call)
PartReader = Callable[[str, Any], str | None]


def objects(
    param: str, value: Any, what: str, spelling: Spelling = OPENAI, *, non_empty: bool = True
) -> Iterator[tuple[str, Mapping[str, Any]]]:
    """(path, item) of each item of `param`, an array (`what`, in the error) of objects,
    such as the messages; a 400 naming the array or the item that is not one."""
    if not isinstance(value, list) or (non_empty and not value):
        raise spelling.expected(param, what, "an empty array" if value == [] else json_kind(value))
    for i, item in enumerate(value):
        p = spelling.item(param, i)
        yield p, spelling.object(p, item)


def text_parts(
    param: str, value: Any, read_part: PartReader, parts: str, spelling: Spelling = OPENAI
) -> str:
    """`param`'s text: a string, or the texts of an array of `parts` (its name in the
    error) as `read_part` reads each, joined with "\\n"."""
    if isinstance(value, str):
        return read_text(param, value)
    if not isinstance(value, list):
        raise spelling.expected(param, f"a string or {parts}", json_kind(value))
    texts = (read_part(spelling.item(param, j), part) for j, part in enumerate(value))
    return "\n".join(text for text in texts if text is not None)


def read_role(param: str, message: Any, roles: Collection[str]) -> str:
    """`message`'s role (at `param`.role), one of `roles` (OpenAI's words; Ollama's too)."""
    role = message.get("role")
    if role not in roles:
        raise bad(f"{param}.role", f"{param}.role must be one of {', '.join(roles)}; got {role!r}")
    return role
