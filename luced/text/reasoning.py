"""A model's thinking, as chat templates mark it: `<think>...</think>` before the answer.

Qwen3, DeepSeek-R1 and their kin write their reasoning between `<think>` and `</think>`,
then the answer. Their templates mention the closing marker (to strip or render it), and
read `enable_thinking` and an assistant turn's `reasoning_content`; a template that does
not mention it has no thinking to ask for (`thinks`).

    ThinkSplitter(opened)  the output as ("thinking", text) and ("text", text) pieces,
                           streamed: `push(delta)` as tokens arrive, `end()` at the finish
    split(text, opened)    a whole reply -> (thinking, answer), the same pieces joined

`opened`: the prompt itself ended inside a think block (a template whose generation
prompt writes `<think>`, as DeepSeek-R1's does), so the output starts as thinking. The
newlines around the markers belong to the format, not to either part, and are dropped.
A marker cut across two deltas is held back until it is whole; at the end, text held
back is what it looked like.
"""

from __future__ import annotations

from luced.text.chat_template import ChatTemplate

OPEN, CLOSE = "<think>", "</think>"
THINKING, TEXT = "thinking", "text"

Piece = tuple[str, str]  # (THINKING | TEXT, text)


def thinks(template: ChatTemplate) -> bool:
    """Whether the template's model writes its thinking in `<think>` blocks."""
    return CLOSE in template.source


def opens_thinking(prompt_tail: str) -> bool:
    """Whether a prompt ending in `prompt_tail` leaves the model inside a think block."""
    return prompt_tail.rstrip().endswith(OPEN)


def _held_prefix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that starts `marker` (wait for the rest)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ThinkSplitter:
    """Splits a streamed reply into its thinking and its answer (module docstring)."""

    def __init__(self, opened: bool = False) -> None:
        # before: may still open with <think>; opening: past <think>, its newlines still
        # to drop; think: inside; after: past </think>, its newlines still to drop; text:
        # the answer (or a reply that never thought)
        self._state = "opening" if opened else "before"
        self._held = ""

    def push(self, delta: str) -> list[Piece]:
        self._held += delta
        out: list[Piece] = []
        while True:
            buf = self._held
            if self._state == "before":
                head = buf.lstrip()
                if head.startswith(OPEN):
                    self._state, self._held = "opening", head[len(OPEN) :]
                    continue
                if OPEN.startswith(head):  # nothing yet, or a part of the marker
                    return out
                self._state = "text"
            if self._state in ("opening", "after"):
                self._held = buf = buf.lstrip()
                if not buf:
                    return out
                self._state = "think" if self._state == "opening" else "text"
            if self._state == "think":
                end = buf.find(CLOSE)
                if end >= 0:
                    self._emit(out, THINKING, buf[:end].rstrip())
                    self._state, self._held = "after", buf[end + len(CLOSE) :]
                    continue
                # Hold a partial marker, and the whitespace before it: it may end the part.
                cut = len(buf[: len(buf) - _held_prefix(buf, CLOSE)].rstrip())
                self._emit(out, THINKING, buf[:cut])
                self._held = buf[cut:]
                return out
            self._emit(out, TEXT, self._held)
            self._held = ""
            return out

    def end(self) -> list[Piece]:
        """What is still held back, once the output is complete."""
        held, self._held = self._held, ""
        out: list[Piece] = []
        if self._state == "think":
            self._emit(out, THINKING, held.rstrip())
        elif self._state in ("before", "text"):
            self._emit(out, TEXT, held)
        return out

    @staticmethod
    def _emit(out: list[Piece], kind: str, text: str) -> None:
        if text:
            out.append((kind, text))


def split(text: str, opened: bool = False) -> tuple[str, str]:
    """A whole reply as (thinking, answer): what a stream of it splits into."""
    splitter = ThinkSplitter(opened)
    pieces = [*splitter.push(text), *splitter.end()]
    thinking = "".join(t for kind, t in pieces if kind == THINKING)
    return thinking, "".join(t for kind, t in pieces if kind == TEXT)
