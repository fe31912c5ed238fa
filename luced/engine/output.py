"""Sampled tokens -> deltas: incremental text, stop strings, logprobs (daemon side).

The engine pushes each sampled token; a delta is released once its text is final (a
partial UTF-8 character or a possible stop-string prefix is held back), carrying the token
ids and logprobs that produced it. The API formats (``luced.api.formats``) shape deltas
into OpenAI chunks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from luced.text.detokenize import IncrementalDetokenizer
from luced.text.stops import StopMatcher
from luced.text.tokenizer import Tokenizer


@dataclass(frozen=True)
class Sampled:
    """A token the workers sampled, with its logprob and the top alternatives when asked."""

    token: int
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] = ()  # (id, logprob), most likely first


@dataclass
class TokenLogprob:
    token_id: int
    token: str
    logprob: float
    bytes: list[int]
    top: list[tuple[str, float, list[int]]] = field(default_factory=list)


@dataclass
class Delta:
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None


class OutputBuilder:
    """Turns sampled tokens into deltas: incremental text, stop strings, logprobs."""

    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...], want_logprobs: bool) -> None:
        self.tokenizer = tokenizer
        self.detok = IncrementalDetokenizer(tokenizer)
        self.stops = StopMatcher(stop)
        self.want_logprobs = want_logprobs
        self._pending_ids: list[int] = []
        self._pending_lp: list[TokenLogprob] = []

    def _entry(self, token: int, logprob: float) -> tuple[str, float, list[int]]:
        raw = self.tokenizer.token_bytes(token)
        return raw.decode("utf-8", errors="replace"), logprob, list(raw)

    def push(self, sampled: Sampled) -> tuple[Delta | None, bool]:
        self._pending_ids.append(sampled.token)
        if self.want_logprobs:
            text, lp, raw = self._entry(sampled.token, sampled.logprob or 0.0)
            top = [self._entry(i, p) for i, p in sampled.top]
            self._pending_lp.append(TokenLogprob(sampled.token, text, lp, raw, top))
        text, hit = self.stops.push(self.detok.push(sampled.token))
        if not text and not hit:
            return None, False  # nothing releasable yet: keep the ids for the next delta
        return self._take(text), hit

    def flush(self) -> Delta | None:
        text = self.stops.push(self.detok.flush())[0] + self.stops.flush()
        if not text and not self._pending_ids:
            return None
        return self._take(text)

    def _take(self, text: str) -> Delta:
        delta = Delta(text, self._pending_ids, self._pending_lp if self.want_logprobs else None)
        self._pending_ids, self._pending_lp = [], []
        return delta
