"""Finished requests' K/V kept in the workers' block pool, for the next request that starts
with the same tokens: a chat's next turn (its prompt is the last one's, the answer and a
new message), the same prompt again, several clients with one system prompt.

When a request finishes, its sequence's blocks move to a kept lane: a sequence id past
the running ones (`first_lane` on), which the workers hold like any other sequence. The
move is a `kv_share` of every computed position from the finished slot into the lane, then
the slot's release: the blocks change owner, nothing is copied. A later request whose
prompt starts with a kept lane's tokens shares its blocks exactly as it shares a running
sequence's (`PrefixReuse`), so a multi-turn chat prefills only its new message.

Kept lanes are charged to the KV budget (engine/kv/budget.py) like running ones, and give
way first: admission and growth reclaim the least recently used before a request waits or
is preempted, and they hold at most `limit` positions together (`--kv-keep-tokens`). A
kept lane gives way by paging its blocks but the first out to host records
(engine/kv/holdings.py; `settle` sends the moves to the workers), given up only when the
records run out. Under KV Flash the limit bounds what they hold resident, and pages out
as room does (its sinks stay); a finished prompt held whole, paged-out blocks included, is
kept on those terms too. A
kept lane whose tokens a newer one extends is dropped at once: the newer one holds
every block it does; a finished sequence whose tokens a kept lane holds whole is not
kept.

The prefix cache (cache/) is the tier behind: snapshots copied into host memory and
onto disk, which outlive an eviction and a restart.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

from luced.engine.kv.budget import KVBudget
from luced.engine.kv.prefix_blocks import PrefixBlocks

log = logging.getLogger(__name__)

# Sequence ids the workers keep finished sequences under, past the running ones (the
# workers hold 256; --max-running is at most 64).
KEPT_LANES = 64

# Shorter sequences are recomputed sooner than their blocks are found.
MIN_KEPT = 16


class FinishedPrefixes:
    def __init__(self, budget: KVBudget, first_lane: int, limit: int) -> None:
        """limit: the most positions kept lanes hold together."""
        self.budget = budget
        self.lanes = range(first_lane, first_lane + KEPT_LANES)
        self.limit = limit
        self.blocks = PrefixBlocks()  # kept lane -> the tokens its K/V holds, by block hash

    def lane_for(self, tokens: list[int], slot: int = -1) -> int | None:
        """The lane a finished sequence holding `tokens` in `slot` is kept under, making
        room for it; None when it is not kept (too short, more than every kept lane may
        hold, or held whole by a kept lane already)."""
        n, budget = len(tokens), self.budget
        h = budget.holdings
        flash = h is not None and h.flash
        charge = h.resident(slot, n) if flash else n  # type: ignore[union-attr]
        if n < MIN_KEPT or (not flash and n > self.limit):
            return None
        for lane in self.blocks.lanes:
            if lane not in budget.kept:
                continue
            held = self.blocks.tokens(lane)
            if len(held) >= n and held[:n] == tokens:  # that one holds all of these
                budget.touch(lane)
                return None
            if tokens[: len(held)] == held:
                budget.evict(lane)  # this one holds every block that one does
        # Under KV Flash paging out makes room within the limit; otherwise it counts
        # paged-out positions too, so only a lane given up does.
        make_room = budget.give_way if flash else lambda: budget.evict() is not None
        while budget.kept_positions + charge > self.limit and make_room():
            pass
        if flash and not self._fits_flash(slot, n, charge):
            return None
        lane = self._free_lane()
        if lane is None:
            budget.evict()
            lane = self._free_lane()
        if lane is not None:
            self.blocks.hold(lane, tokens, len(tokens))
        return lane

    def _fits_flash(self, slot: int, n: int, charge: int) -> bool:
        """Under KV Flash: whether the slot's first n positions may be kept beside the kept
        lanes, its own blocks but its sinks paged out when they alone pass the limit, and
        its host records within the kept lanes' (the least recently used given up)."""
        h, budget = self.budget.holdings, self.budget
        assert h is not None
        while h.host_records([*budget.kept, slot]) > h.records and budget.evict() is not None:
            pass
        if budget.kept_positions + charge > self.limit:  # it alone: only its sinks stay
            h.page_out(slot, [*budget.kept, slot], n)
            charge = h.resident(slot, n)
        return (
            budget.kept_positions + charge <= self.limit
            and h.host_records([*budget.kept, slot]) <= h.records
        )

    async def settle(self, target: Any) -> None:
        """Before the next forward: free in the workers the lanes given up, and make the
        kept lanes' page-outs (`kv_page`); a failed page-out gives every kept lane up."""
        for lane in self.forget_evicted():
            with contextlib.suppress(Exception):  # a dead worker forgot it anyway
                await target.release(lane)
        if self.budget.holdings is None:
            return
        for lane, moves in self.budget.holdings.take().items():
            try:
                await target.host.page(target.executor, lane, moves)
            except Exception as exc:  # the workers are out of step: every lane starts over
                log.warning("paging out kept lane %d failed: %s", lane, exc)
                self.forget_all()
                return

    def _free_lane(self) -> int | None:
        """A lane neither kept nor waiting for the workers to free it."""
        taken = self.budget.held.keys() | set(self.budget.evicted)
        return next((lane for lane in self.lanes if lane not in taken), None)

    def match(self, prompt: list[int]) -> tuple[int, int]:
        """The kept lane holding the longest prefix of `prompt` but its last token (fed to
        sample from) -> (lane, positions), or (-1, 0)."""
        return self.blocks.longest(prompt[:-1], among=self.budget.kept)

    def forget_evicted(self) -> list[int]:
        """The lanes given up since the last call, for the workers to free; forgotten here."""
        lanes, self.budget.evicted = self.budget.evicted, []
        for lane in lanes:
            self.blocks.drop(lane)
        return lanes

    def forget_all(self) -> None:
        """A worker restarted: its kept sequences are gone (the others free theirs)."""
        for lane in list(self.budget.kept):
            self.budget.evict(lane)

    def tokens(self, lane: int) -> list[int]:
        """The tokens kept `lane`'s K/V holds."""
        return self.blocks.tokens(lane)

    @property
    def positions(self) -> int:
        return sum(len(self.blocks.tokens(lane)) for lane in self.budget.kept)

    @property
    def paged(self) -> int:
        """The positions of the kept lanes' blocks paged out to host records."""
        h = self.budget.holdings
        if h is None:
            return 0
        return sum(h.tables.paged(lane) for lane in self.budget.kept) * h.tables.block
