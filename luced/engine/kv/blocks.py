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
    share     an empty lane takes a source's first ceil(n / block) entries (kv_share):
              blocks and host records retained, not copied; a partly shared last block
              is copied by whichever lane writes into it next.
    truncate  blocks wholly past n are released (the `truncate` verb).
    free      every block is released (reset, release, and a kv_import first).
    rollback  a span that starts below what its sequence holds (a verify window's
              rejected rows, a step decoded ahead and dropped, a failed forward undone)
              moves the position only: the table stays, its blocks are written again.
    page_out  a resident entry goes to the lowest free host record (`Move(OUT, index,
              block, record)`: the worker copies the block's rows there); the table's
              hold on the block is released (a shared block stays with the tables that
              share it) and the entry becomes PAGED.
    page_in   a PAGED entry takes the lowest free block (`Move(IN, ...)`: the worker
              copies the record's rows into it); this table's hold on the record is
              released (a shared record stays for the tables sharing it).
    save      a resident entry's rows are copied to the lowest free host record
              (`Move(SAVE, index, block, record)`); the table keeps its block, and the
              record is held by the caller (the block store, engine/kv/block_store.py,
              whose memory tier it becomes), not by a table, until it `release_record`s it.
    adopt     a lane's table appends PAGED entries for records held elsewhere
              (`Move(ADOPT, index, PAGED, record)`: a block read from disk becomes the
              lane's logical block `index`), each record retained; its first span pages
              them in as any PAGED entry.

A table entry is a pool block or PAGED (-1): a logical block whose rows wait in a host
record (`records` of them, a heap as for blocks; KV Flash's host tier, engine/kv/pager.py
decides what goes). A record has a reference count like a block: the tables whose
entry it is (a `share` of a PAGED entry retains its record, so a finished prompt kept
for sharing keeps its paged-out blocks too), plus one per hold of an owner outside the
tables (`hold_record` / `retain_record`: the block store's saves, restores and writes).
`write` never reaches a PAGED entry: the pager pages it in first. `truncate` and `free`
release the records of the PAGED entries they drop; a record is free again at its last
release. A record is written only when it is taken free (a page-out's, a save's, or a
`hold_record` to read a block into): a held record's bytes never change, so any holder
may hold it on (the block store keeps a lane's paged-out record as it is: that lane's
next page-out of the block takes a fresh record).

Records held only to be reused later (the block store's memory tier of the prefix cache,
engine/kv/block_store.py) are given up on demand: when a page-out, a save or a hold finds
no free record, the tables ask their `reclaimer` for one, which releases its least
recently used; `available_records` counts those it would give up as free.

Everything else is the worker's: it neither allocates nor releases on its own.

All of it runs on the event loop at every step: `write` costs O(blocks touched + blocks
appended), `page_out` / `page_in` and a lookup O(log pool); nothing walks the pool.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

PAGED = -1  # a table entry whose rows are in a host record, not in a pool block
OUT = 0  # a `Move`'s kind: pool block -> host record
IN = 1  # host record -> pool block
SAVE = 2  # pool block -> host record, the table unchanged
ADOPT = 3  # a held host record -> a new PAGED entry of the table


class BlocksExhausted(RuntimeError):
    """The pool has no free block for a write, a share or an import (nothing changed).
    The KV account (`KVBudget`) admits within the pool, so this is a bookkeeping bug."""


class RecordsExhausted(RuntimeError):
    """The host tier has no free record for a page-out (nothing changed)."""


class Reclaimer(Protocol):
    """An owner of held records that gives them up on demand (module docstring)."""

    def spare(self) -> int:
        """How many of its records it would release now that no one else holds."""
        ...

    def reclaim(self, n: int) -> int:
        """Release up to n of them, least recently used first; -> how many."""
        ...


class Move(NamedTuple):
    """One host-tier change for the workers (a tuple of ints on the wire): `OUT` copies pool
    block `block` to host record `record`, `IN` copies the record back into the block,
    `SAVE` copies the block to the record and keeps it, `ADOPT` appends a PAGED entry for
    the record (`block` PAGED); `index` is the lane's logical block."""

    kind: int
    index: int
    block: int
    record: int


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

    def __init__(self, n_blocks: int, block: int, records: int = 0) -> None:
        if n_blocks < 1 or block < 1 or records < 0:
            raise ValueError(
                f"a pool of {n_blocks} blocks of {block} rows and {records} host records: "
                "blocks and rows must be >= 1, records >= 0"
            )
        self.n_blocks = n_blocks
        self.block = block
        self.records = records
        self._refs = [0] * n_blocks  # block -> tables holding it
        self._free = list(range(n_blocks))  # a heap (sorted is one): lowest first
        self._tables: dict[int, list[int]] = {}  # lane -> logical block -> pool block or PAGED
        self._free_records = list(range(records))  # a heap, as `_free`
        self._host: dict[int, dict[int, int]] = {}  # lane -> PAGED logical block -> record
        self._record_refs = [0] * records  # record -> tables and owners holding it
        self.reclaimer: Reclaimer | None = None  # asked for records when none is free

    # -- reading ----------------------------------------------------------------------

    def table(self, lane: int) -> tuple[int, ...]:
        return tuple(self._tables.get(lane, ()))

    def length(self, lane: int) -> int:
        table = self._tables.get(lane)
        return len(table) if table is not None else 0

    def refs(self, block: int) -> int:
        return self._refs[block]

    def entry(self, lane: int, j: int) -> int:
        """`lane`'s logical block j: its pool block, or PAGED."""
        table = self._tables.get(lane, [])
        if not 0 <= j < len(table):
            raise ValueError(f"lane {lane} holds {len(table)} blocks: it has no block {j}")
        return table[j]

    def record_refs(self, record: int) -> int:
        return self._record_refs[record]

    def record(self, lane: int, j: int) -> int:
        """The host record of `lane`'s PAGED logical block j."""
        record = self._host.get(lane, {}).get(j)
        if record is None:
            raise ValueError(f"lane {lane}'s block {j} is not paged out")
        return record

    def host(self, lane: int) -> dict[int, int]:
        """`lane`'s PAGED logical blocks -> their host records."""
        return dict(self._host.get(lane, {}))

    def paged(self, lane: int) -> int:
        """How many of `lane`'s entries are PAGED."""
        return len(self._host.get(lane, ()))

    def resident(self, lane: int) -> list[int]:
        """`lane`'s logical blocks held in pool blocks."""
        return [j for j, b in enumerate(self._tables.get(lane, ())) if b != PAGED]

    def resident_prefix(self, lane: int) -> int:
        """How many of `lane`'s leading entries are resident (what a snapshot may copy)."""
        table = self._tables.get(lane, [])
        return next((j for j, b in enumerate(table) if b == PAGED), len(table))

    def resize_records(self, n: int) -> None:
        """Hold n host records from now on (before any is used: the workers' records are
        carved once every worker loaded, by then the size of one is known)."""
        if self.used_records:
            raise ValueError(f"{self.used_records} host records are in use: too late to resize")
        if n < 0:
            raise ValueError(f"{n} host records")
        self.records = n
        self._free_records = list(range(n))
        self._record_refs = [0] * n

    @property
    def free_records(self) -> int:
        return len(self._free_records)

    @property
    def available_records(self) -> int:
        """Free records, and those the `reclaimer` would give up for them."""
        spare = self.reclaimer.spare() if self.reclaimer is not None else 0
        return len(self._free_records) + spare

    @property
    def used_records(self) -> int:
        return self.records - len(self._free_records)

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def used_blocks(self) -> int:
        return self.n_blocks - len(self._free)

    @property
    def lanes(self) -> list[int]:
        """The lanes whose tables are not empty (some of their entries may be PAGED)."""
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
        touched = range(start // b, min(last, len(table)))
        if paged := [j for j in touched if table[j] == PAGED]:
            raise ValueError(
                f"lane {lane}'s positions [{start}, {end}) reach its paged-out blocks "
                f"{paged}: page them in first"
            )
        shared = [j for j in touched if self._refs[table[j]] > 1]
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
        """The empty `lane` takes `source`'s first ceil(n / block) entries: their blocks
        and host records retained."""
        if self.length(lane):
            raise ValueError(f"lane {lane} holds {self.length(lane)} blocks: free it first")
        theirs = self._tables.get(source, [])
        want = -(-n // self.block)
        if n < 0 or want > len(theirs):
            raise ValueError(
                f"lane {source} holds {len(theirs)} blocks of {self.block}: not {n} positions"
            )
        mine = theirs[:want]
        host = {j: r for j, r in self._host.get(source, {}).items() if j < want}
        for block in mine:
            if block != PAGED:
                self._refs[block] += 1
        for record in host.values():
            self._record_refs[record] += 1
        self._tables[lane] = list(mine)
        if host:
            self._host[lane] = host

    def truncate(self, lane: int, n: int) -> None:
        """Release `lane`'s blocks wholly past position n."""
        table = self._tables.get(lane)
        if table is None:
            return
        keep = -(-max(n, 0) // self.block)
        host = self._host.get(lane, {})
        for j in range(keep, len(table)):
            if table[j] == PAGED:
                self._release_record(host.pop(j))
            else:
                self._release(table[j])
        del table[keep:]
        if not host:
            self._host.pop(lane, None)
        if not table:
            del self._tables[lane]

    def free(self, lane: int) -> None:
        """Release every block of `lane`."""
        self.truncate(lane, 0)

    def page_out(self, lane: int, j: int) -> Move:
        """`lane`'s resident block j to the lowest free host record; this table's hold on
        the block is released (a shared block stays for the other tables, which go on
        reading it; this lane reads its copy back when it pages it in). Checked first:
        an error changes nothing."""
        block = self.entry(lane, j)
        if block == PAGED:
            raise ValueError(f"lane {lane}'s block {j} is paged out already")
        if not self._record_free():
            raise RecordsExhausted(
                f"the host tier is exhausted: lane {lane}'s block {j} needs a record, "
                f"all {self.records} are used"
            )
        record = self.hold_record()
        self._release(block)
        self._tables[lane][j] = PAGED
        self._host.setdefault(lane, {})[j] = record
        return Move(OUT, j, block, record)

    def page_in(self, lane: int, j: int) -> Move:
        """`lane`'s PAGED block j into the lowest free block; this table's hold on its
        record is released (a shared record stays for the other tables, which page in
        their own copies). Checked first: an error changes nothing."""
        if self.entry(lane, j) != PAGED:
            raise ValueError(f"lane {lane}'s block {j} is resident, not paged out")
        self._check_free(1, f"lane {lane}'s paged-out block {j}")
        block = heapq.heappop(self._free)
        self._refs[block] = 1
        host = self._host[lane]
        record = host.pop(j)
        if not host:
            del self._host[lane]
        self._release_record(record)
        self._tables[lane][j] = block
        return Move(IN, j, block, record)

    def save(self, lane: int, j: int) -> Move:
        """Copy `lane`'s resident block j to the lowest free host record, held for the
        caller (refcount 1; `release_record` frees it); the table is unchanged. Checked
        first: an error changes nothing."""
        block = self.entry(lane, j)
        if block == PAGED:
            raise ValueError(f"lane {lane}'s block {j} is paged out: nothing to save")
        return Move(SAVE, j, block, self.hold_record())

    def adopt(self, lane: int, records: Sequence[int]) -> list[Move]:
        """Append a PAGED entry to `lane`'s table for each of `records` (held: by
        `hold_record`, or another table), each retained by the table; the caller may then
        release its own hold. Checked first: an error changes nothing."""
        if len(set(records)) != len(records):
            raise ValueError(f"records {list(records)} name one twice")
        for record in records:
            if not 0 <= record < self.records or not self._record_refs[record]:
                raise ValueError(f"host record {record} is not held: adopt a held record")
        table = self._tables.setdefault(lane, [])
        host = self._host.setdefault(lane, {})
        moves = []
        for record in records:
            self._record_refs[record] += 1
            host[len(table)] = record
            moves.append(Move(ADOPT, len(table), PAGED, record))
            table.append(PAGED)
        if not table:
            del self._tables[lane]
        if not host:
            del self._host[lane]
        return moves

    def hold_record(self) -> int:
        """The lowest free host record (one reclaimed when none is), held by the caller
        (refcount 1) until its `release_record`; RecordsExhausted when none is free."""
        if not self._record_free():
            raise RecordsExhausted(
                f"the host tier is exhausted: all {self.records} records are used"
            )
        record = heapq.heappop(self._free_records)
        self._record_refs[record] = 1
        return record

    def retain_record(self, record: int) -> None:
        """Another hold on the held `record` (each released by `release_record`)."""
        if not 0 <= record < self.records or not self._record_refs[record]:
            raise ValueError(f"host record {record} is not held")
        self._record_refs[record] += 1

    def release_record(self, record: int) -> None:
        """Drop one hold on `record` (the caller's from `hold_record`); free at the last."""
        if not 0 <= record < self.records or not self._record_refs[record]:
            raise ValueError(f"host record {record} is not held")
        self._release_record(record)

    def _record_free(self) -> bool:
        """Whether a record is free, once the reclaimer gave one up if none was."""
        if not self._free_records and self.reclaimer is not None:
            self.reclaimer.reclaim(1)
        return bool(self._free_records)

    def _release(self, block: int) -> None:
        self._refs[block] -= 1
        if not self._refs[block]:
            heapq.heappush(self._free, block)

    def _release_record(self, record: int) -> None:
        self._record_refs[record] -= 1
        if not self._record_refs[record]:
            heapq.heappush(self._free_records, record)

    def _check_free(self, need: int, what: str) -> None:
        if need > len(self._free):
            raise BlocksExhausted(
                f"the K/V block pool is exhausted: {what} need {need} more blocks of "
                f"{self.block} rows, {len(self._free)} of {self.n_blocks} are free"
            )
