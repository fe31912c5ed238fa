"""KV Flash as an eviction policy over one lane's table in the shared `BlockTables`
(engine/kv/blocks.py): which of the lane's logical blocks are resident in the pool, at
most `quota` (`PagerConfig.n_blocks`) of them; the rest wait in host records (PAGED).

The daemon owns it (pure integers, on the event loop); the workers only run what a step
asks for. Per step the engine calls `plan(start, n, end)`, which pages blocks out and in
through the tables and returns those `Move`s in the order they were made; the engine then
makes the span's own change, `tables.write(lane, start, end)` (copy-on-write, growth),
and the workers run the moves in order before the span's copies and writes::

    quota 7, block 64, sinks 1, tail 4; cur_block 6; step: position 448 (block 7)

    logical  0  1  2  3  4  5  6 | 7         protected: 0 (sink), 3..7 (tail, step)
    entry    0  1  2  3  4  5  6 | -         the quota is full: the victim (lowest
    plan ->  Move(OUT, 1, 1, 0)               score, then least recently touched) is 1;
    write -> Growth(blocks=(1,))              its block takes the new logical block 7

Protected blocks are never evicted: the sinks j < sink_blocks, the tail j >= cur_block -
tail (the append head and the `tail` blocks before it; `cur_block`, the newest block ever
planned, only moves forward) and the step's blocks. The tail is widened to ceil(window /
block) + 1 blocks for a sliding window wider than it. Hence the minimum quota: sinks +
tail + 1 head + 1 evictable victim. A shared block (another table holds it too) counts in
the quota like any other; paged out, it stays in the pool for the tables sharing it, and
this lane reads its own copy back when it pages it in. (Were shared blocks kept, a lane
sharing most of its quota, or a source lane whose prompt others share, could not grow.)

Eviction is on demand: a block that must become resident when the quota is full pages
out the unprotected resident block with the lowest score (policy `qk`, unscored blocks
count -2, below any cosine; ties by least recent use) or, under `lru`, the one touched
least recently. A block is touched when a position in it is planned (or when it is
recalled); attention reads do not count, so LRU over sealed blocks is in practice
first-filled-first-out (StreamingLLM: sinks + recency).

Recall happens only through reselection (policy `qk`; `lru` never reselects). It is due
every max(tau, history / 45) appended positions (`reselect_due`, or `ask_reselect`); the
engine then has the workers score the blocks and hands the scores to `score`, and the
next `plan` starts with the reselection: every materialised block, resident or PAGED,
is ranked (protected first, then by score; ties keep the resident, then the newer
block), the top `quota` stay or become resident and the rest are paged out, so its
moves ride with that plan's. A lane started on a table made elsewhere (`sync`: a shared
prefix, a kept prompt, the prefix cache's restored blocks, resident or PAGED) first
pages in what an `lru` pager that planned those blocks would hold, the sinks and the
newest blocks, under either policy.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from luced.engine.kv.blocks import (
    IN,
    OUT,
    PAGED,
    BlocksExhausted,
    BlockTables,
    Move,
    RecordsExhausted,
)

POLICIES = ("lru", "qk")
UNSCORED = -2.0  # below every cosine score
_NEW = 2  # a planned block past the table's end: the caller's write appends it
_VICTIM = -1  # an OUT whose block is chosen once the reselection has run


class PoolTooSmall(ValueError):
    """A quota below (sinks + tail + 2) blocks: it could not protect what must stay."""


class PoolExhausted(RuntimeError):
    """A step needs more of the lane's quota than is free or evictable (nothing changed)."""


@dataclass(frozen=True)
class PagerConfig:
    pool_tokens: int  # the lane's quota in positions
    block: int = 64
    sink_blocks: int = 1
    tail_blocks: int = 4
    sliding_window: int = 0  # the model's widest sliding window, 0 if none
    policy: Literal["lru", "qk"] = "qk"
    tau: int = 64
    block_bytes: int = 0  # bytes of one block over every pooled layer, K and V (counters)

    def __post_init__(self) -> None:
        if self.block <= 0 or self.sink_blocks < 0 or self.tail_blocks < 1:
            raise ValueError(
                f"KV Flash: bad block geometry (block {self.block}, sinks {self.sink_blocks}, "
                f"tail {self.tail_blocks})"
            )
        if self.policy not in POLICIES:
            raise ValueError(f"KV Flash policy {self.policy!r}: choose one of {POLICIES}")
        if self.tau <= 0 or self.block_bytes < 0 or self.sliding_window < 0:
            raise ValueError("KV Flash: tau must be positive, block_bytes and window >= 0")
        if self.pool_tokens % self.block:
            raise ValueError(
                f"KV Flash pool of {self.pool_tokens} tokens is not a multiple of the "
                f"{self.block}-token block"
            )
        if self.pool_tokens < self.min_pool_tokens:
            why = f" (tail widened for a {self.sliding_window}-token window)" * self.widened
            raise PoolTooSmall(
                f"KV Flash pool of {self.pool_tokens} tokens is below the minimum "
                f"{self.min_pool_tokens} = (sinks {self.sink_blocks} + tail {self.tail} + 2)"
                f" x {self.block}{why}"
            )

    @property
    def tail(self) -> int:
        """Protected blocks before the append head, covering the sliding window."""
        return max(self.tail_blocks, math.ceil(self.sliding_window / self.block) + 1)

    @property
    def widened(self) -> bool:
        return self.tail > self.tail_blocks

    @property
    def min_pool_tokens(self) -> int:
        return (self.sink_blocks + self.tail + 2) * self.block

    @property
    def n_blocks(self) -> int:
        return self.pool_tokens // self.block


@dataclass(frozen=True)
class PagerStats:
    pool_tokens: int
    resident: int  # resident blocks
    paged_out: int  # blocks in the host tier
    evictions: int  # blocks paged out, on demand or by reselection
    recalls: int  # blocks paged back in
    host_bytes: int  # paged_out * block_bytes


class Pager:
    """One lane's residency within its quota of a shared `BlockTables`."""

    def __init__(self, cfg: PagerConfig, tables: BlockTables, lane: int) -> None:
        if tables.block != cfg.block:
            raise ValueError(f"tables of {tables.block}-row blocks, a pager of {cfg.block}")
        self.cfg = cfg
        self.tables = tables
        self.lane = lane
        self.quota = cfg.n_blocks
        self.evictions = 0
        self.recalls = 0
        self.reset()

    # ------------------------------------------------------------------ queries

    def protected(self, j: int, step: range = range(0)) -> bool:
        return self._protected(j, step, self.cur_block)

    def resident(self) -> list[int]:
        return self.tables.resident(self.lane)

    def paged_out(self) -> list[int]:
        return sorted(self.tables.host(self.lane))

    def stats(self) -> PagerStats:
        paged = self.tables.paged(self.lane)
        return PagerStats(
            pool_tokens=self.cfg.pool_tokens,
            resident=self.tables.length(self.lane) - paged,
            paged_out=paged,
            evictions=self.evictions,
            recalls=self.recalls,
            host_bytes=paged * self.cfg.block_bytes,
        )

    def lookahead(self, start: int, want: int) -> int:
        """The longest step from `start` (at most `want` positions) whose blocks after the
        first need no eviction. A DFlash block of that size evicts only what plain decoding
        evicts at `start` (the first block's room), so its later rows, accepted or not,
        change no residency plain decoding would not: speculative == plain, same quota."""
        size = self.cfg.block
        tables, lane = self.tables, self.lane
        length = tables.length(lane)

        def resident(j: int) -> bool:
            return j < length and tables.entry(lane, j) != PAGED

        first = start // size
        free = self.quota - (length - tables.paged(lane)) - (not resident(first))
        n, j = (first + 1) * size - start, first + 1
        while n < want:
            if not resident(j):
                if free <= 0:
                    break
                free -= 1
            n, j = n + size, j + 1
        return min(n, want)

    def touch(self, j: int) -> None:
        """Block j used now (the LRU clock): planned, or recalled."""
        self._clock += 1
        self._last_use[j] = self._clock

    def reselect_due(self) -> bool:
        if self.cfg.policy == "lru":
            return False
        return self._asked or self._since_reselect >= max(self.cfg.tau, self.end // 45)

    def ask_reselect(self) -> None:
        """Make a reselection due now (the end of a prompt the quota could not hold: its
        last query is the question, so the answer's tokens attend to what it asks for)."""
        self._asked = True

    # ------------------------------------------------------------------ steps

    def score(self, scores: Mapping[int, float]) -> None:
        """The workers' scores per logical block (`qk`; ignored under `lru`): eviction
        ranks by them from now on, and the first `plan` at which a reselection is due
        runs it with them."""
        if self.cfg.policy == "lru":
            return
        self.scores = dict(scores)
        self._scored = True

    def plan(self, start: int, n: int, end: int | None = None) -> tuple[Move, ...]:
        """Make the blocks of positions [start, end) resident (`end`, start + n unless
        given, is where the caller's `tables.write(lane, start, end)` grows the table to:
        one more when the worker decodes ahead) and return the moves, in order.

        Checked first: `PoolExhausted` when the step cannot fit the quota (split such a
        step: chunked prefill), `BlocksExhausted` / `RecordsExhausted` when the shared
        pool or host tier cannot take it; either changes nothing."""
        end = start + n if end is None else end
        tables, lane = self.tables, self.lane
        length = tables.length(lane)
        if n <= 0:
            raise ValueError(f"a step needs positions, got {n}")
        if not 0 <= start <= min(self.end, length * self.cfg.block):
            raise ValueError(
                f"lane {lane}: a write at {start} would leave a gap after position "
                f"{min(self.end, length * self.cfg.block)}"
            )
        if end < start + n:
            raise ValueError(f"lane {lane}: the table's end {end} is before {start + n}")
        step = range(start // self.cfg.block, (end - 1) // self.cfg.block + 1)
        cur = max(self.cur_block, step[-1])
        what = f"lane {lane}'s positions [{start}, {end})"
        keep = self._selection(step) if self._scored and self.reselect_due() else None
        adopt = self._adopt if keep is None else None
        target = keep if adopt is None else adopt  # the residency this plan brings
        reselection = self._reselection(target, length)
        ops, candidates = self._step(step, cur, target, length, what)
        # An adoption's blocks keep their order (position), as a fresh pager's would.
        recalled = [j for kind, j in reselection if kind == IN and adopt is None]
        victims = iter(self._victims(candidates, ops.count((OUT, _VICTIM)), recalled))
        ops = [(kind, next(victims) if j == _VICTIM else j) for kind, j in ops]
        self._check_pool([*reselection, *ops], what)

        moves = [self._move(kind, j) for kind, j in reselection]
        if keep is not None:
            self._since_reselect = 0
            self._asked = self._scored = False
        for j in sorted(adopt or ()):
            self.touch(j)
        self._adopt = None  # a reselection brought its own residency instead
        moves += [self._move(kind, j) for kind, j in ops if kind != _NEW]
        for j in step:
            self.touch(j)
        self.cur_block = cur
        old_end, self.end = self.end, start + n
        self._since_reselect += max(0, self.end - old_end)
        return tuple(moves)

    def truncate(self, length: int) -> None:
        """Forget positions >= length for the reselection count (the caller truncates the
        table)."""
        if not 0 <= length <= self.end:
            raise ValueError(f"cannot truncate to {length}: {self.end} positions planned")
        # Reselection counts kept positions, not a rejected draft's.
        self._since_reselect = max(0, self._since_reselect - (self.end - length))
        self.end = length
        if self._adopt is not None:  # not stepped since a sync: as if synced to length
            self._adopt = self._planned_residency(-(-length // self.cfg.block))

    def sync(self, n: int) -> None:
        """The caller made the lane's table anew covering [0, n) (a `share`, an import, a
        restore of the prefix cache's blocks), its entries resident or PAGED (a kept
        prompt's, a restored one's): start over as if a fresh pager had planned those
        blocks in order. The next `plan` first brings the residency to an `lru` pager's
        too, the sinks and the newest blocks within the quota (`_adopt`); under `qk` the
        reselection, due at once, then ranks them by the scores of that first step."""
        blocks = -(-n // self.cfg.block)
        if n < 0 or blocks > self.tables.length(self.lane):
            raise ValueError(
                f"lane {self.lane} holds {self.tables.length(self.lane)} blocks of "
                f"{self.cfg.block}: not {n} positions"
            )
        self.reset()
        for j in range(blocks):
            self.touch(j)
        self.cur_block = blocks - 1
        self.end = self._since_reselect = n
        self._adopt = self._planned_residency(blocks)

    def reset(self) -> None:
        """Forget the lane (the caller frees its table); the counters stay."""
        self.end = 0  # positions [0, end) have been planned
        self.cur_block = -1  # newest block ever planned; only moves forward
        self.scores: dict[int, float] = {}
        self._last_use: dict[int, int] = {}  # logical block -> the use clock when touched
        self._clock = 0
        self._since_reselect = 0
        self._asked = False
        self._scored = False  # scores arrived since the last reselection
        # The residency the next plan brings a synced lane to: what an `lru` pager that
        # had planned its blocks in order would keep.
        self._adopt: set[int] | None = None

    # ------------------------------------------------------------------ internals

    def _protected(self, j: int, step: range, cur: int) -> bool:
        return j < self.cfg.sink_blocks or j >= cur - self.cfg.tail or j in step

    def _shared(self, j: int) -> bool:
        block = self.tables.entry(self.lane, j)
        return block != PAGED and self.tables.refs(block) > 1

    def _planned_residency(self, blocks: int) -> set[int]:
        """What an `lru` pager that planned `blocks` blocks in order keeps: the sinks and
        the newest blocks within the quota."""
        sinks = min(self.cfg.sink_blocks, blocks)
        newest = max(sinks, blocks - (self.quota - sinks))
        return {*range(sinks), *range(newest, blocks)}

    def _shared_record(self, j: int) -> bool:
        """Whether block j's host record stays when it is paged in: another table holds
        it (a record this plan pages out first is its own)."""
        t = self.tables
        return t.entry(self.lane, j) == PAGED and t.record_refs(t.record(self.lane, j)) > 1

    def _victims(self, candidates: list[int], n: int, recalled: list[int]) -> list[int]:
        """The n blocks the step pages out, in order: the lowest score (`qk`), then the
        least recently touched, counting the reselection's recalls, which the plan
        touches first, as the most recent."""
        clock = {j: self._clock + i + 1 for i, j in enumerate(recalled)}

        def key(j: int) -> tuple[float, ...]:
            last = clock.get(j, self._last_use.get(j, 0))
            if self.cfg.policy == "qk":
                return (self.scores.get(j, UNSCORED), last, j)
            return (last, j)

        return heapq.nsmallest(n, candidates, key=key)

    def _selection(self, step: range) -> set[int]:
        """The blocks a reselection keeps resident: protected ones, then by score; ties
        keep the resident, then the newer block."""
        length = self.tables.length(self.lane)

        def rank(j: int) -> tuple[float, bool, int]:
            resident = self.tables.entry(self.lane, j) != PAGED
            if self._protected(j, step, self.cur_block):
                return (math.inf, resident, j)
            return (self.scores.get(j, UNSCORED), resident, j)

        return set(sorted(range(length), key=rank, reverse=True)[: self.quota])

    def _step(
        self, step: range, cur: int, keep: set[int] | None, length: int, what: str
    ) -> tuple[list[tuple[int, int]], list[int]]:
        """The step's page-outs (a victim each, chosen later among the candidates it
        returns), page-ins and new blocks, in order, over the residency after `keep`'s
        reselection; then a new block for each copy-on-write of the caller's write.
        Raises PoolExhausted when there are too few candidates."""
        if keep is None:
            held = length - self.tables.paged(self.lane)

            def resident(j: int) -> bool:
                return self.tables.entry(self.lane, j) != PAGED
        else:
            held, resident = len(keep), keep.__contains__
        want = [j for j in step if j >= length or not resident(j)]
        over = held + len(want) - self.quota
        candidates: list[int] = []
        if over > 0:
            candidates = [
                j for j in range(length) if resident(j) and not self._protected(j, step, cur)
            ]
            if over > len(candidates):
                raise PoolExhausted(
                    f"{what} need {len(want)} more blocks: {max(0, self.quota - held)} free, "
                    f"{len(candidates)} evictable"
                )
        ops: list[tuple[int, int]] = []
        while held > self.quota:  # a share or an import left the lane above its quota
            ops.append((OUT, _VICTIM))
            held -= 1
        for j in want:
            if held == self.quota:
                ops.append((OUT, _VICTIM))
                held -= 1
            ops.append((IN if j < length else _NEW, j))
            held += 1
        ops += [(_NEW, j) for j in step if j < length and resident(j) and self._shared(j)]
        return ops, candidates

    def _reselection(self, keep: set[int] | None, length: int) -> list[tuple[int, int]]:
        """A reselection's page-outs, then its page-ins (nothing without one)."""
        if keep is None:
            return []
        paged = [self.tables.entry(self.lane, j) == PAGED for j in range(length)]
        outs = [(OUT, j) for j in range(length) if not paged[j] and j not in keep]
        return outs + [(IN, j) for j in sorted(keep) if paged[j]]

    def _check_pool(self, ops: list[tuple[int, int]], what: str) -> None:
        """Walk the ops in order over the shared pool's free blocks and records (an OUT
        takes a record and frees its block unless another table shares it, an IN the
        reverse (a shared record stays), a new block or a copy-on-write takes a block;
        records the tables' reclaimer would give up count as free) and refuse the step
        before anything changes."""
        t = self.tables
        blocks, records = t.free_blocks, t.free_records
        spare: int | None = None  # records the reclaimer would give up (asked when needed)
        for kind, j in ops:
            if kind != OUT:
                blocks -= 1
            elif not self._shared(j):  # a shared block stays for the others
                blocks += 1
            if kind == OUT:
                records -= 1
            elif kind == IN and not self._shared_record(j):
                records += 1
            if records < 0 and spare is None:
                spare = t.available_records - t.free_records
                records += spare
            if blocks < 0:
                raise BlocksExhausted(
                    f"the K/V block pool is exhausted: {what} need more than the "
                    f"{t.free_blocks} free of {t.n_blocks} blocks"
                )
            if records < 0:
                raise RecordsExhausted(
                    f"the host tier is exhausted: {what} need more than the "
                    f"{t.free_records + (spare or 0)} free of {t.records} records"
                )

    def _move(self, kind: int, j: int) -> Move:
        if kind == OUT:
            self.evictions += 1
            return self.tables.page_out(self.lane, j)
        self.recalls += 1
        self.touch(j)  # a recalled block is not the next LRU victim
        return self.tables.page_in(self.lane, j)
