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

With host records (`holdings`, engine/kv/holdings.py: under KV Flash, and wherever
finished prompts are kept) a lane is charged what it holds in the workers' pool: a kept
lane its resident positions; a running lane its positions, under KV Flash at most its
quota and its step's block (`Holdings.cap`); a sharer is credited what its source holds
of its prefix. And a kept lane gives way by paging its blocks but its sinks (its first
block without KV Flash) out to host records (it stays whole and shareable); it is given
up only when the host records run out or it holds only its sinks (`give_way`).
"""

from __future__ import annotations

from collections import OrderedDict

from luced.engine.kv.holdings import Holdings
from luced.engine.kvflash.transport import available_memory

# Positions a decoding request reserves at a time beyond its need.
RESERVE_STEP = 16


class KVBudget:
    def __init__(self, positions: int, holdings: Holdings | None = None) -> None:
        """holdings: with host records, what each lane holds in the pool (the charges)."""
        if positions < 1:
            raise ValueError(f"the KV pool holds at least 1 position, got {positions}")
        self.positions = positions
        self.holdings = holdings
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
        return sum(self.charge(lane) for lane in self.held)

    def charge(self, lane: int) -> int:
        """The positions charged to `lane`: its own less what it shares (with host
        records what it holds in the pool less what its source holds of it)."""
        held, credit, h = self.held.get(lane, 0), self.credits.get(lane), self.holdings
        if h is None:
            return held - (credit[1] if credit is not None else 0)
        own = h.own(lane, held, lane in self.kept)
        return max(0, own - (h.common(lane, *credit) if credit is not None else 0))

    @property
    def kept_positions(self) -> int:
        """What counts against the kept limit: under KV Flash the kept lanes' charges
        (their resident positions), otherwise the positions they keep, paged out or not."""
        if self.holdings is not None and self.holdings.flash:
            return sum(self.charge(lane) for lane in self.kept)
        return sum(self.held[lane] for lane in self.kept)

    def share(self, lane: int, source: int, n: int) -> None:
        """The lane's first n positions are the source lane's, charged to it alone."""
        if source not in self.held or lane not in self.held:
            raise ValueError(f"lanes {lane} and {source} must both hold a reservation")
        self.credits[lane] = (source, min(n, self.held[lane]))

    def fits(self, positions: int) -> bool:
        return self.used + positions <= self.positions

    def _more(self, have: int, want: int) -> int:
        """What a running lane's charge grows by from `have` positions held to `want`."""
        cap = self.holdings.cap if self.holdings is not None else None
        if cap is None:
            return want - have
        return max(0, min(want, cap) - min(have, cap))

    def admit(self, lane: int, ticket: int, positions: int) -> bool:
        """Reserve `positions` for a request entering `lane`; False (nothing changed) when
        they do not fit beside the others'."""
        if lane in self.held:
            raise ValueError(f"lane {lane} already holds a reservation")
        if not self.fits(self._more(0, positions)):
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
        if self.fits(self._more(have, want)):
            self.held[lane] = want
            return True
        if self.fits(self._more(have, end)):  # the spare does not fit, the need does
            self.held[lane] = end
            return True
        if self.give_way():  # a kept lane gives way before anyone waits
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
        if self.holdings is not None:  # the workers free it: its page-outs are moot
            self.holdings.forget(kept)
        return kept

    def give_way(self) -> bool:
        """Make room for others: with host records the least recently used kept lane
        that holds more than its sinks pages them out, if the records hold them; else the
        least recently used kept lane is given up. False when none is kept."""
        if self.holdings is not None:
            for lane in self.kept:
                if self.holdings.page_out(lane, self.kept):
                    return True
        return self.evict() is not None

    def reclaim(self, positions: int) -> bool:
        """Whether `positions` fit, once kept lanes give way as needed."""
        need = self._more(0, positions)
        while not self.fits(need) and self.give_way():
            pass
        return self.fits(need)

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
