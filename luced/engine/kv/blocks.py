"""The K/V block tables: which pool block holds each lane's positions, decided here, in the
daemon, and followed by every worker (runtime/kv_blocks.py keeps the rows).

Each shard of each worker keeps one pool of `n_blocks` blocks of `block` rows
(`frames.Load.kv_blocks`); block b is the same block in every pool, so one table per lane
(a sequence id: a running slot or a kept lane) serves every shard. Lane i's logical block
j (positions `[j * block, (j + 1) * block)`) lives in pool block `table(i)[j]`::

    block = 4                  refcounts: 0:2  1:1  2:1  3:0 (free)

    lane 0 table [0, 1]        positions 0-3 in block 0, 4-7 in block 1
    lane 1 table [0, 2]        shares block 0 (lane 0's first 4 positions), then its own

A block's reference count is the number of tables holding it; the free blocks form a
heap, so the lowest free block is handed out first (a small run touches only the low
blocks, and a worker grows its tensors only that far).

The rules, the same on both sides (the worker applies each change as it comes):

    write     a forward span over [start, end) (and, when the worker decodes ahead, its
              next position: end + 1): each existing block the range touches that another
              table holds too is replaced by a fresh block holding a copy of its rows
              (copy-on-write: `Growth.copies`, (logical index, src, dst)), then fresh blocks
              are appended until the table covers [0, end) (`Growth.blocks`). The span
              carries both and the table length after them; the worker refuses a span
              whose length does not match (`frames.Span.table`).
    share     an empty lane takes a source's first ceil(n / block) blocks (kv_share):
              retained, not copied; a partly shared last block is copied by whichever
              lane writes into it next.
    truncate  blocks wholly past n are released (the `truncate` verb).
    free      every block is released (reset, release, and a kv_import first).
    rollback  a span that starts below what its sequence holds (a verify window's
              rejected rows, a step decoded ahead and dropped, a failed forward undone)
              moves the position only: the table stays, its blocks are written again.

Everything else is the worker's: it neither allocates nor releases on its own.

All of it runs on the event loop at every step: `write` costs O(blocks touched + blocks
appended), a lookup O(1); nothing walks the pool.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass


class BlocksExhausted(RuntimeError):
    """The pool has no free block for a write, a share or an import (nothing changed).
    The KV account (`KVBudget`) admits within the pool, so this is a bookkeeping bug."""


@dataclass(frozen=True)
class Growth:
    """What a lane's table gained for a write: copy-on-write copies, then new blocks."""

    copies: tuple[tuple[int, int, int], ...]  # (logical index, src block, dst block)
    blocks: tuple[int, ...]  # appended, in order
    length: int  # the table's length after them


def pool_blocks(positions: int, lanes: int, block: int) -> int:
    """Blocks a pool needs for `positions` held at once (the KV account's) by at most `lanes`
    tables. A lane that is charged c positions and shares its first n (credited, paid by
    its source) holds at most c + n + 1 positions (its window's end, or one more for the
    position decoded ahead), in ceil((c + n + 1) / block) blocks of which floor(n / block)
    are its source's: at most c / block + 2 blocks of its own. One of the two is its
    partial last block, the other the copy of its partly shared first block. So the pool
    holds ceil(positions / block) + 2 * lanes."""
    return -(-positions // block) + 2 * lanes


class BlockTables:
    """One pool's reference counts, free heap and every lane's table (module docstring)."""

    def __init__(self, n_blocks: int, block: int) -> None:
        if n_blocks < 1 or block < 1:
            raise ValueError(f"a pool of {n_blocks} blocks of {block} rows: both must be >= 1")
        self.n_blocks = n_blocks
        self.block = block
        self._refs = [0] * n_blocks  # block -> tables holding it
        self._free = list(range(n_blocks))  # a heap (sorted is one): lowest first
        self._tables: dict[int, list[int]] = {}  # lane -> logical block -> pool block

    # -- reading ----------------------------------------------------------------------

    def table(self, lane: int) -> tuple[int, ...]:
        return tuple(self._tables.get(lane, ()))

    def length(self, lane: int) -> int:
        table = self._tables.get(lane)
        return len(table) if table is not None else 0

    def refs(self, block: int) -> int:
        return self._refs[block]

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def used_blocks(self) -> int:
        return self.n_blocks - len(self._free)

    @property
    def lanes(self) -> list[int]:
        """The lanes holding at least one block."""
        return [lane for lane, table in self._tables.items() if table]

    # -- changes ------------------------------------------------------------------------

    def write(self, lane: int, start: int, end: int) -> Growth:
        """Make positions [start, end) writable by `lane` alone and covered by its table
        (copy-on-write, then growth); checked first: BlocksExhausted changes nothing."""
        if not 0 <= start <= end:
            raise ValueError(f"a write over [{start}, {end}) of lane {lane}")
        table = self._tables.setdefault(lane, [])
        b = self.block
        last = -(-end // b)
        shared = [j for j in range(start // b, min(last, len(table))) if self._refs[table[j]] > 1]
        grow = max(0, last - len(table))
        self._check_free(len(shared) + grow, f"lane {lane}'s positions [{start}, {end})")
        copies = []
        for j in shared:
            src, dst = table[j], heapq.heappop(self._free)
            self._refs[dst] = 1
            self._refs[src] -= 1  # > 0: another table holds it
            table[j] = dst
            copies.append((j, src, dst))
        new = [heapq.heappop(self._free) for _ in range(grow)]
        for block in new:
            self._refs[block] = 1
        table.extend(new)
        return Growth(tuple(copies), tuple(new), len(table))

    def grow(self, lane: int, end: int) -> tuple[int, ...]:
        """Append fresh blocks until `lane`'s table covers [0, end) -> them (an import's
        table, after `free`)."""
        covered = self.length(lane) * self.block
        return self.write(lane, min(covered, end), end).blocks

    def share(self, lane: int, source: int, n: int) -> None:
        """The empty `lane` takes `source`'s first ceil(n / block) blocks (retained)."""
        if self.length(lane):
            raise ValueError(f"lane {lane} holds {self.length(lane)} blocks: free it first")
        theirs = self._tables.get(source, [])
        want = -(-n // self.block)
        if n < 0 or want > len(theirs):
            raise ValueError(
                f"lane {source} holds {len(theirs)} blocks of {self.block}: not {n} positions"
            )
        mine = theirs[:want]
        for block in mine:
            self._refs[block] += 1
        self._tables[lane] = list(mine)

    def truncate(self, lane: int, n: int) -> None:
        """Release `lane`'s blocks wholly past position n."""
        table = self._tables.get(lane)
        if table is None:
            return
        keep = -(-max(n, 0) // self.block)
        for block in table[keep:]:
            self._release(block)
        del table[keep:]
        if not table:
            del self._tables[lane]

    def free(self, lane: int) -> None:
        """Release every block of `lane`."""
        self.truncate(lane, 0)

    def _release(self, block: int) -> None:
        self._refs[block] -= 1
        if not self._refs[block]:
            heapq.heappush(self._free, block)

    def _check_free(self, need: int, what: str) -> None:
        if need > len(self._free):
            raise BlocksExhausted(
                f"the K/V block pool is exhausted: {what} need {need} more blocks of "
                f"{self.block} rows, {len(self._free)} of {self.n_blocks} are free"
            )
