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

A finished request's positions may be kept (`keep`, engine/kv/finished.py): its lane
becomes a kept lane, charged like a running one but first to go. Admission and growth
`reclaim` kept lanes, least recently used first, before anything waits or is preempted;
the workers free them before the next forward (`evicted`).
"""

from __future__ import annotations

from collections import OrderedDict

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
        # Finished requests' lanes kept for their prefix, least recently used first, and
        # those reclaimed since the engine last freed them in the workers.
        self.kept: OrderedDict[int, None] = OrderedDict()
        self.evicted: list[int] = []

    @property
    def used(self) -> int:
        return sum(self.held.values()) - sum(n for _, n in self.credits.values())

    def charge(self, lane: int) -> int:
        """The positions charged to `lane`: its own less what it shares."""
        credit = self.credits.get(lane)
        return self.held.get(lane, 0) - (credit[1] if credit is not None else 0)

    @property
    def kept_positions(self) -> int:
        return sum(self.charge(lane) for lane in self.kept)

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
        if self.evict() is not None:  # a kept lane gives way before anyone waits
            return self.grow(lane, end)
        return False

    def keep(self, lane: int, kept: int, positions: int) -> None:
        """A finished request's first `positions` stay held, under the kept lane `kept`:
        what it shared it still shares, and its sharers share `kept` now."""
        if kept in self.held:
            raise ValueError(f"lane {kept} already holds a reservation")
        self.held[kept] = min(positions, self.held.pop(lane))
        self.tickets.pop(lane, None)
        if (own := self.credits.pop(lane, None)) is not None:
            self.credits[kept] = (own[0], min(own[1], self.held[kept]))
        for s, (source, n) in list(self.credits.items()):
            if source == lane:
                self.credits[s] = (kept, min(n, self.held[kept]))
        self.kept[kept] = None

    def touch(self, kept: int) -> None:
        """A kept lane was just reused: the last to be reclaimed."""
        self.kept.move_to_end(kept)

    def evict(self, kept: int | None = None) -> int | None:
        """Give up a kept lane (the least recently used by default) -> it, or None when
        none is kept. The engine frees it in the workers (`evicted`)."""
        if kept is None:
            kept = next(iter(self.kept), None)
            if kept is None:
                return None
        del self.kept[kept]
        self.release(kept)
        self.evicted.append(kept)
        return kept

    def reclaim(self, positions: int) -> bool:
        """Whether `positions` fit, once kept lanes are given up as needed."""
        while not self.fits(positions) and self.evict() is not None:
            pass
        return self.fits(positions)

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
