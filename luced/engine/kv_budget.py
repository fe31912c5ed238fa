"""The KV pool of the running requests: how many positions their sequences may hold at once.

Each running request reserves the positions its sequence will hold before it feeds them:
its prompt when it is admitted, then a little more whenever decoding outgrows what it has
(`RESERVE_STEP` positions at a time, so a request asks every few tokens, not every step).
A request that does not fit is not admitted yet; a running one that cannot grow makes room
by preemption: the request admitted last gives its KV up and waits to be recomputed, so an
older request never waits for a younger one, and no request fails because another is long.

Positions, not bytes: a sequence's KV costs the same per position whatever it holds, and
the pool must hold one whole context (`Engine` checks it), so any single request fits.

A shared prefix (the workers' block pool, `Target.share`) is charged once: the request
that shared a running one's first n positions is credited n (`share`), which its source
pays as part of its own. When a source is released while requests still share its
positions, the one sharing the most (the heir) pays for them from then on, crediting only
what the source itself had shared, and the others share the heir's instead; so a release
never charges more than it frees. Admission still asks for a whole prompt: the credit
comes once the share is made.
"""

from __future__ import annotations

from luced.engine.kvflash.transport import available_memory

# Positions a decoding request reserves at a time beyond its need.
RESERVE_STEP = 16


class KVBudget:
    def __init__(self, positions: int) -> None:
        if positions < 1:
            raise ValueError(f"the KV pool holds at least 1 position, got {positions}")
        self.positions = positions
        self.held: dict[int, int] = {}  # lane -> positions reserved
        self.tickets: dict[int, int] = {}  # lane -> its request's arrival order
        # lane -> (the lane whose blocks it shares, its first positions that lane pays for)
        self.credits: dict[int, tuple[int, int]] = {}

    @property
    def used(self) -> int:
        return sum(self.held.values()) - sum(n for _, n in self.credits.values())

    def share(self, lane: int, source: int, n: int) -> None:
        """The lane's first n positions are the source lane's, charged to it alone."""
        if source not in self.held or lane not in self.held:
            raise ValueError(f"lanes {lane} and {source} must both hold a reservation")
        self.credits[lane] = (source, min(n, self.held[lane]))

    def fits(self, positions: int) -> bool:
        return self.used + positions <= self.positions

    def admit(self, lane: int, ticket: int, positions: int) -> bool:
        """Reserve `positions` for a request entering `lane`; False (nothing changed) when
        they do not fit beside the others'."""
        if lane in self.held:
            raise ValueError(f"lane {lane} already holds a reservation")
        if not self.fits(positions):
            return False
        self.held[lane], self.tickets[lane] = positions, ticket
        return True

    def grow(self, lane: int, end: int) -> bool:
        """Make the lane's reservation reach `end` positions (with RESERVE_STEP to spare
        when it grows); False when that does not fit, the reservation unchanged."""
        have = self.held[lane]
        if end <= have:
            return True
        want = min(end + RESERVE_STEP, self.positions)
        if self.fits(want - have):
            self.held[lane] = want
            return True
        if self.fits(end - have):  # the spare does not fit, the need does
            self.held[lane] = end
            return True
        return False

    def release(self, lane: int) -> None:
        self.held.pop(lane, None)
        self.tickets.pop(lane, None)
        own = self.credits.pop(lane, None)
        sharers = [s for s, (source, _) in self.credits.items() if source == lane]
        if not sharers:
            return
        heir = max(sharers, key=lambda s: self.credits[s][1])
        _, most = self.credits.pop(heir)
        if own is not None:  # what the released lane shared, the heir shares now
            self.credits[heir] = (own[0], min(most, own[1]))
        for s in sharers:
            if s != heir:
                self.credits[s] = (heir, self.credits[s][1])

    def newest(self) -> int:
        """The lane whose request arrived last: the one that gives way."""
        return max(self.tickets, key=self.tickets.__getitem__)


def resolve_kv_pool(
    positions: int,
    max_running: int,
    context: int,
    bytes_per_token: int,
    free_bytes: int | None = None,
) -> int:
    """--kv-pool-tokens: `positions`, or 0 for auto: max_running whole contexts where half
    the free memory holds them, else what that half holds; never less than one context.
    ValueError when a given pool is smaller than one context."""
    if positions:
        if positions < context:
            raise ValueError(
                f"{positions} positions do not hold one whole context ({context}): "
                "a long request could never finish"
            )
        return positions
    free = available_memory() if free_bytes is None else free_bytes
    return max(context, min(max_running * context, free // 2 // max(1, bytes_per_token)))
