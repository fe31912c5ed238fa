"""Stop strings matched across token boundaries, holding back text that may start one.

    matcher = StopMatcher(["\\n\\nUser:", "###"])
    out, hit = matcher.push("Hello\\n")   # -> ("Hello", False): "\\n" may begin a stop
    out, hit = matcher.push("\\nUser: hi") # -> ("", True): the stop and all after it dropped
    rest = matcher.flush()                 # text still held back when generation ends

Only text that can no longer become part of a stop string is released, so a client
never sees a stop string or any text after it (OpenAI semantics).
"""

from __future__ import annotations

from collections.abc import Iterable


class StopMatcher:
    def __init__(self, stops: Iterable[str]) -> None:
        self.stops = tuple(s for s in stops if s)
        self._held = ""
        self.matched: str | None = None

    def push(self, text: str) -> tuple[str, bool]:
        """Add newly decoded text; return (text safe to emit, whether a stop matched)."""
        if self.matched is not None:
            return "", True
        if not self.stops:
            return text, False
        buf = self._held + text
        first = min(
            ((i, s) for s in self.stops if (i := buf.find(s)) >= 0),
            default=None,
        )
        if first is not None:
            self.matched = first[1]
            self._held = ""
            return buf[: first[0]], True
        keep = self._partial_suffix(buf)
        self._held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        """Release the held text (generation ended without a stop)."""
        held, self._held = self._held, ""
        return "" if self.matched is not None else held

    def _partial_suffix(self, buf: str) -> int:
        """Length of the longest suffix of buf that is a proper prefix of some stop."""
        best = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(buf)), best, -1):
                if buf.endswith(stop[:n]):
                    best = n
                    break
        return best
