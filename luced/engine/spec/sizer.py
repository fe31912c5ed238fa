"""Adaptive speculative block size: draft only as far as it pays, per request.

A speculative step of block B (the anchor plus B-1 proposals) costs about c(B): a
verify of B tokens plus the draft's own work. Proposal i is accepted only if all before
it were. Drafts are right in runs (a prompt lookup's copied span is accepted whole, a
chance match mostly not at all), so acceptance is two rates: f for the first proposal,
per kind of draft, and t for each later one given the one before it was accepted. A
step then commits on average E(B) = 1 + f (1 + t + ... + t^(B-2)) tokens; plain
decoding commits 1 token per c(1). `BlockSizer` picks the B with the most tokens per
second, E(B) / c(B), or plain decoding (B = 1) when no B beats 1 / c(1); greedy output
is the same whatever B is (the verify loop is exact), so this only moves speed.

`StepCosts` is the daemon's cost table c(n), measured at start (`Engine.calibrate`) and
refreshed from every step as it runs. `BlockSizer` is one request's acceptance estimate:
decayed counts of accepted and rejected first proposals per kind, and of accepted later
proposals and the rejections that cut them (the maximum-likelihood rate of a geometric
run length that a rejection cuts short), so a request adapts to what it is generating
now, and a request that decodes plainly probes a small block now and then to learn
whether drafting started to pay.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping


class StepCosts:
    """Wall seconds of a target step that feeds n tokens (n = 1: a plain decode step;
    n = B: a speculative step of block B, draft included), smoothed.

    Kept as c(1) and ratios c(n) / c(1): on a shared machine every step slows and
    speeds up together, and plain steps are observed far more often than any one block
    size, so absolute seconds per size drifted apart (a live table read c(16) = 6.1 c(1)
    where interleaved measurements gave 3.9). Each observation of n > 1 is taken
    against the current c(1)."""

    def __init__(self, smoothing: float = 0.2) -> None:
        self.smoothing = smoothing
        self._plain: float | None = None  # c(1), seconds
        self._ratio: dict[int, float] = {1: 1.0}  # n -> c(n) / c(1)

    def observe(self, n: int, seconds: float) -> None:
        if n < 1 or not seconds > 0:
            return
        if n == 1:
            old = self._plain
            self._plain = seconds if old is None else old + self.smoothing * (seconds - old)
            return
        if self._plain is None:  # nothing to relate it to yet
            return
        ratio, old = seconds / self._plain, self._ratio.get(n)
        self._ratio[n] = ratio if old is None else old + self.smoothing * (ratio - old)

    def cost(self, n: int) -> float | None:
        """c(n), linear between measured sizes and beyond the largest; None before any
        plain step and some speculative step were measured."""
        sizes = sorted(self._ratio)
        if self._plain is None or len(sizes) < 2:
            return None
        r = self._ratio
        if n in r:
            return self._plain * r[n]
        i = bisect.bisect_left(sizes, n)
        lo, hi = (sizes[i - 1], sizes[i]) if i < len(sizes) else (sizes[-2], sizes[-1])
        ratio = r[lo] + (r[hi] - r[lo]) / (hi - lo) * (n - lo)
        return max(self._plain * ratio, 1e-9)

    def table(self) -> dict[int, float]:
        if self._plain is None:
            return {}
        return {n: self._plain * r for n, r in sorted(self._ratio.items())}


def expected_tokens(block: int, first: float, then: float) -> float:
    """Tokens one step of `block` commits: the target's own token plus the accepted run
    of proposals, where the first proposal is accepted with probability `first` and each
    later one, given all before it were, with probability `then`."""
    return 1.0 + first * sum(then**i for i in range(block - 1))


class BlockSizer:
    """One request's block size: starts at max_block, then follows its own acceptance.

    Acceptance is kept in two parts, because drafts are right in runs: the first
    proposal's rate, per kind of draft (a prompt lookup's "run" of a copy under way is
    accepted almost always, a fresh 2-gram match about half the time: `lookup.py`), and
    the rate of each later proposal given the one before it was accepted, shared. With
    one kind and equal rates this is the plain geometric model."""

    def __init__(
        self,
        costs: StepCosts,
        max_block: int,
        *,
        decay: float = 0.9,
        probe_every: int = 16,
        probe_block: int = 4,
        priors: Mapping[str, float] | None = None,
    ) -> None:
        self.costs = costs
        self.max_block = max_block
        self.decay = decay
        self.probe_every = probe_every
        self.probe_block = min(probe_block, max_block)
        # Decayed counts, from priors worth two observations: a first proposal is right
        # half the time unless `priors` knows its kind better, a later one 9 times in 10 (a
        # copy tends to go on; docs/performance.md, "Measurements behind the code").
        self.priors = dict(priors or {})
        self._first: dict[str, list[float]] = {}  # kind -> [accepted, rejected]
        self._then = [1.8, 0.2]  # later proposals: [accepted, rejections]
        # Until the first verified step: draft max_block, unless the drafter gave priors
        # (it knows its kinds well enough to be sized by them from the start).
        self.observed = priors is not None
        self.plain_run = 0  # plain steps since the last speculative one

    def rates(self, kind: str = "draft") -> tuple[float, float]:
        """(first, then): the first proposal's acceptance for `kind`, a later one's."""
        acc, rej = self._first.get(kind) or self._prior(kind)
        return acc / (acc + rej), self._then[0] / (self._then[0] + self._then[1])

    def _prior(self, kind: str) -> list[float]:
        p = self.priors.get(kind, 0.5)
        return [2.0 * p, 2.0 * (1.0 - p)]

    def observe(self, proposed: int, accepted: int, kind: str = "draft") -> None:
        """A verified step: `accepted` of `proposed` proposals (of `kind`) were accepted."""
        d = self.decay
        first = self._first.setdefault(kind, self._prior(kind))
        first[0], first[1] = d * first[0] + (accepted > 0), d * first[1] + (accepted == 0)
        if accepted > 0:
            # Proposals 2..proposed: accepted - 1 accepted, cut by a rejection if any.
            then = self._then
            then[0] = d * then[0] + (accepted - 1)
            then[1] = d * then[1] + (accepted < proposed)
        self.observed = True
        self.plain_run = 0

    def plain_step(self) -> None:
        self.plain_run += 1

    def next_block(self, kind: str = "draft") -> int:
        """The block for the next step of `kind`; 1 means a plain step. The request's
        first step drafts max_block unless the sizer has priors; a kind not seen yet
        goes by its prior."""
        if not self.observed or self.max_block < 2:
            return self.max_block
        best = self.best_block(kind)
        if best == 1 and self.plain_run >= self.probe_every:
            return self.probe_block  # does drafting pay again?
        return best

    def best_block(self, kind: str = "draft") -> int:
        plain = self.costs.cost(1)
        if plain is None:  # nothing measured yet: the configured block
            return self.max_block
        first, then = self.rates(kind)
        best, best_rate = 1, 1.0 / plain
        for block in range(2, self.max_block + 1):
            cost = self.costs.cost(block)
            assert cost is not None
            rate = expected_tokens(block, first, then) / cost
            if rate > best_rate:
                best, best_rate = block, rate
        return best
