"""The last minutes of the daemon's metrics, one sample a second, for the web page's plots.

Prometheus keeps history only for whoever scrapes it; a person opening the page wants the
last ten minutes without running one. `Metrics` passes every observation on to `add`,
which sums it into the current second; `Metrics.refresh` (once a second, and on every
scrape) sets the gauges. `since(t)` returns the whole seconds after t as columns, the
shape a plotting library draws:

    t                    unix second
    generation_tokens    tokens generated in that second (throughput, tokens/s)
    prompt_tokens        prompt tokens prefilled (counted when a request's prefill ends)
    ttft_s, itl_s        mean time to first token / between tokens observed in that second
    batch_size           mean sequences per batched decode step in that second
    acceptance           accepted / drafted tokens of that second's speculative steps
    running, waiting     requests, the last value seen (carried over quiet seconds)
    kv_usage             KV positions held over the pool (0..1), the last value seen

A mean or ratio with nothing observed in its second is None (a gap, not a zero). Memory is
bounded: at most `span` seconds are kept, and a quiet second keeps nothing.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

SPAN_S = 600  # ten minutes

# Observation names (Metrics.observe's vocabulary) -> what the second keeps of them.
_SUMMED = {
    "generation_tokens": "generation_tokens",
    "prompt_tokens": "prompt_tokens",
    "draft_tokens": "draft_tokens",
    "accepted_tokens": "accepted_tokens",
}
_AVERAGED = {"ttft": "ttft_s", "itl": "itl_s", "batch_size": "batch_size"}
_GAUGES = {"running": "running", "queue": "waiting", "kv_usage": "kv_usage"}

COLUMNS = (
    "t",
    "generation_tokens",
    "prompt_tokens",
    "ttft_s",
    "itl_s",
    "batch_size",
    "acceptance",
    "running",
    "waiting",
    "kv_usage",
)


class _Second:
    __slots__ = ("counts", "gauges", "sums", "t")

    def __init__(self, t: int, gauges: dict[str, float]) -> None:
        self.t = t
        self.sums: dict[str, float] = {}
        self.counts: dict[str, int] = {}  # observations behind each averaged sum
        self.gauges = dict(gauges)  # as they stood when the second began, then updated


class Timeline:
    def __init__(self, span: int = SPAN_S, clock: Callable[[], float] = time.time) -> None:
        self.span = span
        self._clock = clock
        self._began = int(clock())  # no seconds before this one are made up
        self._seconds: deque[_Second] = deque()
        self._gauges = dict.fromkeys(_GAUGES.values(), 0.0)

    def add(self, what: str, value: float) -> None:
        """One observation by Metrics' short name; names not plotted are ignored."""
        if what in _SUMMED:
            sums = self._now().sums
            sums[_SUMMED[what]] = sums.get(_SUMMED[what], 0.0) + value
        elif what in _AVERAGED:
            second = self._now()
            key = _AVERAGED[what]
            second.sums[key] = second.sums.get(key, 0.0) + value
            second.counts[key] = second.counts.get(key, 0) + 1
        elif what in _GAUGES:
            self._gauges[_GAUGES[what]] = value
            self._now().gauges[_GAUGES[what]] = value

    def since(self, t: float | None = None) -> dict[str, list]:
        """The whole seconds after `t` (all kept ones when None), oldest first, as
        {column: [value per second]}; the second now running is left for a later call."""
        now = int(self._clock())
        first = max(now - self.span + 1, self._began)  # what the deque can hold
        if t is not None:
            first = max(first, int(t) + 1)
        kept = {s.t: s for s in self._seconds}
        # A quiet second has no entry: its gauges are those of the latest one before it.
        gauges = self._seconds[0].gauges if self._seconds else self._gauges
        for s in self._seconds:
            if s.t >= first:
                break
            gauges = s.gauges
        out: dict[str, list] = {c: [] for c in COLUMNS}
        for sec in range(first, now):
            s = kept.get(sec)
            if s is not None:
                gauges = s.gauges
            for column, value in _row(sec, s, gauges).items():
                out[column].append(value)
        return out

    def _now(self) -> _Second:
        now = int(self._clock())
        seconds = self._seconds
        if not seconds or seconds[-1].t < now:
            seconds.append(_Second(now, self._gauges))
            while seconds[0].t <= now - self.span:
                seconds.popleft()
        return seconds[-1]


def _row(t: int, s: _Second | None, gauges: dict[str, float]) -> dict[str, float | None]:
    sums = s.sums if s is not None else {}
    counts = s.counts if s is not None else {}

    def mean(key: str) -> float | None:
        n = counts.get(key, 0)
        return sums[key] / n if n else None

    drafted = sums.get("draft_tokens", 0.0)
    return {
        "t": t,
        "generation_tokens": sums.get("generation_tokens", 0.0),
        "prompt_tokens": sums.get("prompt_tokens", 0.0),
        "ttft_s": mean("ttft_s"),
        "itl_s": mean("itl_s"),
        "batch_size": mean("batch_size"),
        "acceptance": sums.get("accepted_tokens", 0.0) / drafted if drafted else None,
        **gauges,
    }
