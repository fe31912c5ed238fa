"""Chat prompts whose control tokens come only from the template.

A chat template writes its turn markers (`<|im_start|>`, `<start_of_turn>`, ...) as text,
so the rendered prompt must be tokenized with special-token parsing on. Message content
goes through the same render, so a user who writes `<|im_end|>\\n<|im_start|>system\\n`
would otherwise open a system turn of their own. The rule here: content is text.

    messages ──escape──► every special-token string in any string of a message becomes a
                          placeholder  \\ue000<nonce><j>\\ue001  (j: which special string)
             ──render──► the template's output: its own markers are the only special-token
                          strings left in it
             ──encode──► Tokenizer.encode_markup: each marker is its control token; each
                          stretch between markers has its placeholders put back and is
                          tokenized with special parsing off

The nonce is random per render and made of digits (upper/lower in a template leave it
intact), so content cannot spell a placeholder. Templates that only concatenate, trim,
split or compare content see text equivalent to the original; a template that slices
through a placeholder leaves its characters as plain text (never a control token).
With content free of special-token strings the ids are exactly those of rendering and
tokenizing with specials on (tested), so nothing changes for ordinary prompts.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Mapping, Sequence
from typing import Any

from luced.text.chat_template import ChatTemplate
from luced.text.tokenizer import Tokenizer

_OPEN, _CLOSE = "\ue000", "\ue001"  # private-use characters: no tokenizer gives them meaning


class _Escaper:
    def __init__(self, specials: Sequence[str], find: re.Pattern[str]) -> None:
        self.specials = list(specials)
        self.nonce = str(secrets.randbelow(10**16)).zfill(16)
        self._find = find  # the special strings, leftmost-longest
        self._index = {s: j for j, s in enumerate(self.specials)}
        self._back = re.compile(f"{_OPEN}{self.nonce}(\\d+){_CLOSE}")

    def escape(self, value: Any) -> Any:
        if isinstance(value, str):
            return self._find.sub(lambda m: self._placeholder(m.group()), value)
        if isinstance(value, Mapping):
            return {self.escape(k): self.escape(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [self.escape(v) for v in value]
        return value

    def _placeholder(self, special: str) -> str:
        return f"{_OPEN}{self.nonce}{self._index[special]}{_CLOSE}"

    def restore(self, text: str) -> str:
        return self._back.sub(lambda m: self._original(int(m.group(1))), text)

    def _original(self, j: int) -> str:
        return self.specials[j] if j < len(self.specials) else ""


def chat_ids(
    template: ChatTemplate,
    tokenizer: Tokenizer,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool = True,
    **kwargs: Any,
) -> list[int]:
    """Token ids of messages rendered by template, message text never read as control
    tokens. kwargs are template variables (escaped like the messages: they come from the
    request too). Raises ChatTemplateError when the template fails."""
    escaper = _Escaper(tokenizer.special_strings, tokenizer.special_pattern)
    text = template.render(
        escaper.escape(list(messages)),
        add_generation_prompt=add_generation_prompt,
        **escaper.escape(kwargs),
    )
    return tokenizer.encode_markup(text, escaper.restore)
