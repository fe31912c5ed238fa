"""Incremental detokenization: token ids in, text out, never half a character.

A token is a run of bytes, not of characters: byte-level BPE cuts an emoji into two or three
tokens, and SentencePiece's byte fallback spells a rare character as <0xF0><0x93><0x80><0x80>.
Decoding each token alone would print U+FFFD for those halves. Instead we feed each token's bytes
(`Tokenizer.token_bytes`) to one incremental UTF-8 decoder, which holds back an unfinished
sequence (at most 3 bytes) until it completes and turns bytes that can never complete into U+FFFD
at once, exactly as decoding the whole byte string would. So the chunks joined (plus `flush()`)
equal `Tokenizer.decode` of all ids, in O(1) per token.
"""

from __future__ import annotations

import codecs
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from luced.text.tokenizer import Tokenizer


class IncrementalDetokenizer:
    """Text of a growing token sequence, one completed piece per `push`."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        skip_special: bool = True,
        strip_leading_space: bool | None = None,
    ) -> None:
        """strip_leading_space: drop one space at the very start of the text, as `decode` does for
        SentencePiece vocabularies with a prefix space (None: do what `decode` does)."""
        self._tokenizer = tokenizer
        self._skip = tokenizer.special_ids if skip_special else frozenset()
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._strip = (
            tokenizer.strip_leading_space if strip_leading_space is None else strip_leading_space
        )
        self._at_start = True  # no byte emitted or held yet

    def push(self, token_id: int) -> str:
        """The text that token_id completes ("" while a character is still unfinished)."""
        if token_id in self._skip:
            return ""
        data = self._tokenizer.token_bytes(token_id)
        if self._at_start and data:
            self._at_start = False
            if self._strip and data[:1] == b" ":
                data = data[1:]
        return self._utf8.decode(data)

    def flush(self) -> str:
        """End of stream: an unfinished character becomes U+FFFD. The detokenizer can go on."""
        return self._utf8.decode(b"", final=True)

    @property
    def pending_bytes(self) -> int:
        """Bytes held back because they may start a character not yet complete."""
        return len(self._utf8.getstate()[0])
