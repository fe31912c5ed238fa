"""Adaptive speculative block size: draft only as far as it pays, per request.

A speculative step of block B (the anchor plus B-1 proposals) costs about c(B): a
verify of B tokens plus the draft's own work. Proposal i is accepted only if all before
it were, so with a per-proposal acceptance rate a the step commits on average
E(B) = 1 + a + a^2 + ... + a^(B-1) tokens. Plain decoding commits 1 token per c(1).
`BlockSizer` picks the B with the most tokens per second, E(B) / c(B), or plain decoding
(B = 1) when no B beats 1 / c(1); greedy output is the same whatever B is (the verify
loop is exact), so this only moves speed.

`StepCosts` is the daemon's cost table c(n), measured at start (`Engine.calibrate`) and
refreshed from every step as it runs. `BlockSizer` is one request's acceptance estimate:
decayed counts of accepted proposals and of rejections (the maximum-likelihood rate of a
geometric run length that a rejection cuts short), so a request adapts to what it is
generating now, and a request that decodes plainly probes a small block now and then to
learn whether drafting started to pay.
"""

from __future__ import annotations

import bisect


class StepCosts:
    """Wall seconds of a target step that feeds n tokens (n = 1: a plain decode step;
    n = B: a speculative step of block B, draft included), smoothed."""

    def __init__(self, smoothing: float = 0.2) -> None:
        self.smoothing = smoothing
        self._seconds: dict[int, float] = {}

    def observe(self, n: int, seconds: float) -> None:
        if n < 1 or not seconds > 0:
            return
        old = self._seconds.get(n)
        self._seconds[n] = seconds if old is None else old + self.smoothing * (seconds - old)

    def cost(self, n: int) -> float | None:
        """c(n), linear between measured sizes and beyond the largest; None before any
        plain step and some speculative step were measured."""
        sizes = sorted(self._seconds)
        if 1 not in self._seconds or len(sizes) < 2:
            return None
        if n in self._seconds:
            return self._seconds[n]
        i = bisect.bisect_left(sizes, n)
        lo, hi = (sizes[i - 1], sizes[i]) if i < len(sizes) else (sizes[-2], sizes[-1])
        slope = (self._seconds[hi] - self._seconds[lo]) / (hi - lo)
        return max(self._seconds[lo] + slope * (n - lo), 1e-9)

    def table(self) -> dict[int, float]:
        return dict(sorted(self._seconds.items()))


def expected_tokens(alpha: float, block: int) -> float:
    """Tokens one step of `block` commits with per-proposal acceptance alpha: the
    accepted run of proposals plus the target's own token."""
    return sum(alpha**i for i in range(block))


class BlockSizer:
    """One request's block size: starts at max_block, then follows its own acceptance."""

    def __init__(
        self,
        costs: StepCosts,
        max_block: int,
        *,
        decay: float = 0.8,
        probe_every: int = 16,
        probe_block: int = 4,
    ) -> None:
        self.costs = costs
        self.max_block = max_block
        self.decay = decay
        self.probe_every = probe_every
        self.probe_block = min(probe_block, max_block)
        # Decayed counts; one pseudo-observation each (a = 1/2) until the request has its own.
        self.accepted = 1.0
        self.rejections = 1.0
        self.observed = False
        self.plain_run = 0  # plain steps since the last speculative one

    @property
    def alpha(self) -> float:
        return self.accepted / (self.accepted + self.rejections)

    def observe(self, proposed: int, accepted: int) -> None:
        """A verified step: `accepted` of `proposed` proposals were accepted."""
        self.accepted = self.decay * self.accepted + accepted
        self.rejections = self.decay * self.rejections + (1.0 if accepted < proposed else 0.0)
        self.observed = True
        self.plain_run = 0

    def plain_step(self) -> None:
        self.plain_run += 1

    def next_block(self) -> int:
        """The block for the next step; 1 means a plain step."""
        if not self.observed or self.max_block < 2:
            return self.max_block
        best = self.best_block()
        if best == 1 and self.plain_run >= self.probe_every:
            return self.probe_block  # does drafting pay again?
        return best

    def best_block(self) -> int:
        plain = self.costs.cost(1)
        if plain is None:  # nothing measured yet: the configured block
            return self.max_block
        alpha = self.alpha
        best, best_rate = 1, 1.0 / plain
        for block in range(2, self.max_block + 1):
            cost = self.costs.cost(block)
            assert cost is not None
            rate = expected_tokens(alpha, block) / cost
            if rate > best_rate:
                best, best_rate = block, rate
        return best
