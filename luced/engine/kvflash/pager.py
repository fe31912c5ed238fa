"""KV Flash pager: which 64-token chunks of a sequence are resident in a pool of blocks.

The daemon owns it (pure integers, no tensors); workers only execute what a step asks
for. Per step the engine calls `plan(start, n)` and gets a `StepPlan`:

* `moves`: host-tier copies to run, in order, before the step's K/V writes. `out` copies
  block `block`'s rows to host record `record`; `in` copies a record back into a block
  (any free block: K is stored after RoPE, so a row's slot carries no meaning).
* `write_slots[i]`: the pool row of position start + i (block * 64 + pos % 64).
* `slot_positions[s]`: the position pool row s holds, -1 when free, stale or not this
  sequence's. A query at q sees row s iff 0 <= slot_positions[s] < start, or s is one of
  this step's write slots and slot_positions[s] <= q; a sliding layer also needs
  q - slot_positions[s] < window.

Protected chunks are never evicted: the sink chunks c < sink_chunks, the tail
c >= cur_chunk - tail (the append head and the `tail` chunks before it; `cur_chunk`, the
newest chunk ever allocated, only moves forward), and the chunks of the step being
planned. The tail is widened to ceil(window / 64) + 1 chunks for a sliding window wider
than it. Hence the minimum pool: sinks + tail + 1 head + 1 evictable victim blocks.

Eviction is on demand: a chunk that needs a block when none is free pages out the
unprotected resident chunk with the lowest score (policy `qk`, unscored chunks count
-2, below any cosine) or, under `lru`, the one touched least recently. A chunk is
touched when a position in it is planned; attention reads do not count, so LRU over
sealed chunks is in practice first-filled-first-out (StreamingLLM: sinks + recency).

Recall happens only through `reselect(scores)` (policy `qk`; a no-op under `lru`): all
materialised chunks, resident or paged out, are ranked by score (protected ones first),
the top n_blocks stay or become resident and the rest are paged out. It is due every
max(tau, history / 45) appended positions (`reselect_due`).
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, NamedTuple

from luced.engine.kvflash.blocks import BlockPool, PageTable, PoolExhausted

POLICIES = ("lru", "qk")
UNSCORED = -2.0  # below every cosine score


class PoolTooSmall(ValueError):
    """A pool below (sinks + tail + 2) chunks: it could not protect what must stay."""


@dataclass(frozen=True)
class PagerConfig:
    pool_tokens: int
    chunk: int = 64
    sink_chunks: int = 1
    tail_chunks: int = 4
    sliding_window: int = 0  # the model's widest sliding window, 0 if none
    policy: Literal["lru", "qk"] = "qk"
    tau: int = 64
    chunk_bytes: int = 0  # bytes of one chunk over every pooled layer, K and V (counters)

    def __post_init__(self) -> None:
        if self.chunk <= 0 or self.sink_chunks < 0 or self.tail_chunks < 1:
            raise ValueError(
                f"KV Flash: bad chunk geometry (chunk {self.chunk}, sinks {self.sink_chunks}, "
                f"tail {self.tail_chunks})"
            )
        if self.policy not in POLICIES:
            raise ValueError(f"KV Flash policy {self.policy!r}: choose one of {POLICIES}")
        if self.tau <= 0 or self.chunk_bytes < 0 or self.sliding_window < 0:
            raise ValueError("KV Flash: tau must be positive, chunk_bytes and window >= 0")
        if self.pool_tokens % self.chunk:
            raise ValueError(
                f"KV Flash pool of {self.pool_tokens} tokens is not a multiple of the "
                f"{self.chunk}-token chunk"
            )
        if self.pool_tokens < self.min_pool_tokens:
            why = f" (tail widened for a {self.sliding_window}-token window)" * self.widened
            raise PoolTooSmall(
                f"KV Flash pool of {self.pool_tokens} tokens is below the minimum "
                f"{self.min_pool_tokens} = (sinks {self.sink_chunks} + tail {self.tail} + 2)"
                f" x {self.chunk}{why}"
            )

    @property
    def tail(self) -> int:
        """Protected chunks before the append head, covering the sliding window."""
        return max(self.tail_chunks, math.ceil(self.sliding_window / self.chunk) + 1)

    @property
    def widened(self) -> bool:
        return self.tail > self.tail_chunks

    @property
    def min_pool_tokens(self) -> int:
        return (self.sink_chunks + self.tail + 2) * self.chunk

    @property
    def n_blocks(self) -> int:
        return self.pool_tokens // self.chunk


class Move(NamedTuple):
    """One host-tier copy: `out` block -> record, `in` record -> block."""

    kind: Literal["out", "in"]
    chunk: int
    block: int
    record: int


@dataclass(frozen=True)
class StepPlan:
    start: int
    n: int
    moves: tuple[Move, ...]  # run in order before the step's writes
    write_slots: tuple[int, ...]  # [n] pool row of position start + i
    slot_positions: array  # [pool] int64 ('q'): position held by each row, -1 = none


@dataclass(frozen=True)
class PagerStats:
    pool_tokens: int
    resident: int  # resident chunks
    paged_out: int  # chunks in the host tier
    evictions: int  # chunks paged out, on demand or by reselection
    recalls: int  # chunks paged back in
    host_bytes: int  # paged_out * chunk_bytes


class Pager:
    """One sequence's residency over a `BlockPool` (its own unless one is given)."""

    def __init__(self, cfg: PagerConfig, pool: BlockPool | None = None) -> None:
        self.cfg = cfg
        self.pool = pool if pool is not None else BlockPool(cfg.n_blocks, cfg.chunk)
        if self.pool.chunk != cfg.chunk:
            raise ValueError(f"pool blocks of {self.pool.chunk} rows, pager chunks of {cfg.chunk}")
        self.table = PageTable(cfg.chunk)
        self.slot_pos = array("q", [-1]) * self.pool.rows
        self.end = 0  # positions [0, end) have been planned (written by the workers)
        self.cur_chunk = -1  # newest chunk ever allocated; only moves forward
        self.scores: dict[int, float] = {}
        self.evictions = 0
        self.recalls = 0
        self._pending: list[Move] = []
        self._host_free: list[int] = []
        self._host_next = 0
        self._since_reselect = 0
        self._asked = False

    # ------------------------------------------------------------------ queries

    def protected(self, chunk: int, step: range = range(0)) -> bool:
        return (
            chunk < self.cfg.sink_chunks or chunk >= self.cur_chunk - self.cfg.tail or chunk in step
        )

    def resident(self) -> list[int]:
        return sorted(self.table.blocks)

    def paged_out(self) -> list[int]:
        return sorted(self.table.host)

    @property
    def is_identity(self) -> bool:
        """Every written chunk resident in the block of its own index (prefix snapshots)."""
        return not self.table.host and all(c == b for c, b in self.table.blocks.items())

    def stats(self) -> PagerStats:
        return PagerStats(
            pool_tokens=self.pool.rows,
            resident=len(self.table.blocks),
            paged_out=len(self.table.host),
            evictions=self.evictions,
            recalls=self.recalls,
            host_bytes=len(self.table.host) * self.cfg.chunk_bytes,
        )

    def lookahead(self, start: int, want: int) -> int:
        """The longest step from `start` (at most `want` positions) whose chunks after the
        first need no eviction. A DFlash block of that size evicts only what plain decoding
        evicts at `start` (the first chunk's block), so its later rows, accepted or not,
        change no residency plain decoding would not: speculative == plain, same pool."""
        size = self.cfg.chunk
        first = start // size
        free = self.pool.n_free - (first not in self.table.blocks)
        n, c = (first + 1) * size - start, first + 1
        while n < want:
            if c not in self.table.blocks:
                if free <= 0:
                    break
                free -= 1
            n, c = n + size, c + 1
        return min(n, want)

    def reselect_due(self) -> bool:
        if self.cfg.policy == "lru":
            return False
        return self._asked or self._since_reselect >= max(self.cfg.tau, self.end // 45)

    def ask_reselect(self) -> None:
        """Make a reselection due now (the end of a prompt the pool could not hold: its
        last query is the question, so the answer's tokens attend to what it asks for)."""
        self._asked = True

    # ------------------------------------------------------------------ steps

    def plan(self, start: int, n: int) -> StepPlan:
        """Make the chunks of positions [start, start + n) resident and say where they go.

        Positions >= start + n become invisible (a rejected draft's rows: no rollback).
        Raises `PoolExhausted`, changing nothing, when the step's chunks cannot all be
        resident at once; split such a step (chunked prefill)."""
        if n <= 0:
            raise ValueError(f"a step needs tokens, got {n}")
        if not 0 <= start <= self.end:
            raise ValueError(f"KV write at {start} would leave a gap after position {self.end}")
        size = self.cfg.chunk
        step = range(start // size, (start + n - 1) // size + 1)
        before = self.cur_chunk
        self.cur_chunk = max(before, step[-1])
        blocks = self.table.blocks
        need = sum(1 for c in step if c not in blocks)
        evictable = sum(1 for c in blocks if not self.protected(c, step))
        if need > self.pool.n_free + evictable:
            self.cur_chunk = before
            raise PoolExhausted(
                f"positions [{start}, {start + n}) need {need} more blocks: "
                f"{self.pool.n_free} free, {evictable} evictable"
            )
        for c in step:
            self._make_resident(c, step)
        old_end = self.end
        self._hide(start + n, old_end)
        slots = tuple(self.table.slot(p) for p in range(start, start + n))
        for i, s in enumerate(slots):
            self.slot_pos[s] = start + i
        self.end = start + n
        self._since_reselect += max(0, self.end - old_end)
        moves, self._pending = tuple(self._pending), []
        return StepPlan(start, n, moves, slots, array("q", self.slot_pos))

    def truncate(self, length: int) -> None:
        """Forget positions >= length (optional: the next `plan` hides them anyway)."""
        if not 0 <= length <= self.end:
            raise ValueError(f"cannot truncate to {length}: {self.end} positions planned")
        self._hide(length, self.end)
        # Reselection counts kept positions, not a rejected draft's.
        self._since_reselect = max(0, self._since_reselect - (self.end - length))
        self.end = length

    def reselect(self, scores: Mapping[int, float]) -> None:
        """Rank every materialised chunk (protected first, then by score; ties keep the
        resident, then the newer chunk), keep the top n_blocks resident, page out the rest
        and page the kept ones back in. The copies join the next plan's `moves`."""
        if self.cfg.policy == "lru":
            return
        self.scores = dict(scores)
        self._since_reselect = 0
        self._asked = False
        blocks = self.table.blocks

        def rank(c: int) -> tuple[float, bool, int]:
            score = math.inf if self.protected(c) else self.scores.get(c, UNSCORED)
            return (score, c in blocks, c)

        chunks = sorted({*blocks, *self.table.host}, key=rank, reverse=True)
        keep = set(chunks[: self.pool.n_blocks])
        for c in sorted(blocks):
            if c not in keep:
                self._page_out(c)
        for c in sorted(keep - blocks.keys()):
            self._page_in(c, self.pool.allocate())

    def reset(self) -> None:
        """Drop the sequence: every block back to the pool, the host tier emptied."""
        for block in self.table.blocks.values():
            self.pool.release(block)
        if self.pool.n_free == self.pool.n_blocks:
            self.pool.reset()  # a fresh identity layout for the next sequence
        self.table.clear()
        self.slot_pos = array("q", [-1]) * self.pool.rows
        self.end = 0
        self.cur_chunk = -1
        self.scores = {}
        self._pending = []
        self._host_free = []
        self._host_next = 0
        self._since_reselect = 0
        self._asked = False

    # ------------------------------------------------------------------ internals

    def _make_resident(self, chunk: int, step: range) -> None:
        if chunk not in self.table.blocks:
            if self.pool.n_free == 0:
                self._page_out(self._victim(step))
            block = self.pool.allocate()
            if chunk in self.table.host:
                self._page_in(chunk, block)
            else:
                self.table.blocks[chunk] = block
        self.table.touch(chunk)

    def _victim(self, step: range) -> int:
        candidates = [c for c in self.table.blocks if not self.protected(c, step)]
        if not candidates:
            raise PoolExhausted("every resident chunk is protected")
        last_use = self.table.last_use
        if self.cfg.policy == "qk":
            return min(candidates, key=lambda c: (self.scores.get(c, UNSCORED), last_use[c]))
        return min(candidates, key=lambda c: last_use[c])

    def _page_out(self, chunk: int) -> None:
        block = self.table.blocks.pop(chunk)
        record = self._host_free.pop() if self._host_free else self._next_record()
        self.table.host[chunk] = record
        self._pending.append(Move("out", chunk, block, record))
        size = self.cfg.chunk
        self.slot_pos[block * size : (block + 1) * size] = array("q", [-1]) * size
        self.pool.release(block)
        self.evictions += 1

    def _page_in(self, chunk: int, block: int) -> None:
        record = self.table.host.pop(chunk)
        self._host_free.append(record)
        self.table.blocks[chunk] = block
        self.table.touch(chunk)  # a recalled chunk is not the next LRU victim
        self._pending.append(Move("in", chunk, block, record))
        size = self.cfg.chunk
        first = chunk * size
        for p in range(first, min(first + size, self.end)):
            self.slot_pos[block * size + p - first] = p
        self.recalls += 1

    def _next_record(self) -> int:
        self._host_next += 1
        return self._host_next - 1

    def _hide(self, start: int, end: int) -> None:
        """Mark positions [start, end) as held by no row (stale)."""
        for p in range(start, end):
            if p // self.cfg.chunk in self.table.blocks:
                self.slot_pos[self.table.slot(p)] = -1
