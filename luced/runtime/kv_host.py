"""The host tier's records: one block of K/V rows over every stored layer, copied out of
the shared block pool (`kv_blocks`) and back in byte for byte (KV Flash's pages).

One record, `RecordLayout.nbytes` bytes, for `rows` rows of each stored layer::

    for each stored layer in order:  K rows [Hkv, rows, D] | V rows [Hkv, rows, D]
    (the cache dtype's raw bytes, C order, no padding)

The daemon owns the records (a shared-memory segment of `records` rows); a worker holding
several shards (devices) stores them side by side in each record, shard by shard, each in
its own layout, so one record id covers all of them (`SharedHostTier`: one shard's bytes
of each record). `HostTier` keeps records in this process instead (tests, benchmarks).

A frame's moves copy many blocks at once (`runs`): per stored layer, K and V, one copy
of each stretch of consecutive blocks to consecutive records (the daemon hands out the
lowest free of both), or, where the stretches are short, one gather of the blocks' rows,
one transfer and one scatter into the records (out), or the other way (in). Restoring 64
blocks of a 30-layer model is 60 copies, not 3,840 copies of one block of one layer. No
buffer spans every layer: a fresh one of a whole restore's bytes costs its page faults
on every call.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RecordLayout:
    """Where each stored layer's K and V rows sit in one record, and the batched copies
    between pool blocks and records (`runs`: each copy moves many blocks at once)."""

    shapes: Mapping[int, tuple[int, int]]  # stored layer -> (Hkv, D), in record order
    rows: int  # rows of each layer in one record: a block
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        item = self.dtype.itemsize
        return sum(2 * h * self.rows * d * item for h, d in self.shapes.values())

    def check(self, records: torch.Tensor, ids: Iterable[int] = ()) -> None:
        """ValueError unless `records` is uint8 [n, nbytes] (any row stride: a shard's
        bytes of the daemon's records) holding every record of `ids`."""
        if records.dtype != torch.uint8 or records.dim() != 2 or records.shape[1] != self.nbytes:
            got = f"{records.dtype} {list(records.shape[1:])}"
            raise ValueError(f"a host record is uint8 [{self.nbytes}], got {got}")
        outside = sorted({r for r in ids if not 0 <= r < records.shape[0]})
        if outside:
            raise ValueError(f"host records {outside} outside [0, {records.shape[0]})")

    def _parts(
        self, records: torch.Tensor, k: Mapping[int, torch.Tensor], v: Mapping[int, torch.Tensor]
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Each stored layer's K, then V, in record order, as (its rows in `records`,
        uint8 [n, nbytes], as [n, Hkv, rows, D]; its pool blocks as [blocks, Hkv, rows,
        D]): views as integer words of the cache dtype's size (the copies move bits, and
        index ops take every integer dtype), one `as_strided` each, since on short copies
        every view op costs as much as moving a few KiB."""
        if not self.shapes:  # a worker of recurrent layers only: its records are empty
            return
        word = _WORDS[self.dtype.itemsize]
        table = records.view(word)
        offset = table.storage_offset()
        for layer, (heads, dim) in self.shapes.items():
            for t in (k[layer], v[layer]):
                pool = t.view(word)  # [Hkv, pool rows, D], rows and D contiguous
                yield (
                    self._rows_at(table, offset, heads, dim),
                    pool.as_strided(
                        (pool.shape[1] // self.rows, heads, self.rows, dim),
                        (self.rows * dim, pool.stride(0), dim, 1),
                        pool.storage_offset(),
                    ),
                )
                offset += heads * self.rows * dim

    def _rows_at(self, table: torch.Tensor, offset: int, heads: int, dim: int) -> torch.Tensor:
        """The K or V rows of one layer at word `offset` of every record of `table` (the
        records as words), as [n, Hkv, rows, D]."""
        shape, step = (table.shape[0], heads, self.rows, dim), table.stride(0)
        return table.as_strided(shape, (step, self.rows * dim, dim, 1), offset)

    def k_rows(self, records: torch.Tensor, ids: Sequence[int], layer: int) -> torch.Tensor:
        """`layer`'s K rows of records `ids` as a pool's blocks hold them: [Hkv, len(ids),
        rows, D] of the cache dtype, contiguous, on the records' device (a `qk` block key
        is sealed from these: `kv_qk.BlockKeys.seal`)."""
        word = _WORDS[self.dtype.itemsize]
        table = records.view(word)
        offset = table.storage_offset()
        for stored, (heads, dim) in self.shapes.items():
            if stored == layer:
                at = torch.tensor(list(ids), dtype=torch.int64, device=records.device)
                rows = self._rows_at(table, offset, heads, dim).index_select(0, at)
                return rows.view(self.dtype).transpose(0, 1).contiguous()
            offset += 2 * heads * self.rows * dim
        raise ValueError(f"layer {layer} is not in the record (stored: {list(self.shapes)})")

    def copy_out(
        self,
        k: Mapping[int, torch.Tensor],
        v: Mapping[int, torch.Tensor],
        blocks: Sequence[int],
        records: torch.Tensor,
        ids: Sequence[int],
    ) -> None:
        """Pool blocks `blocks` of every layer into rows `ids` of `records` (checked; a
        record named twice takes the last block), byte-exact: per layer, K and V, a copy
        of each stretch (`_stretches`), or one gather on the pool's device, one transfer
        and one scatter into the records."""
        self._copy(records, ids, k, v, blocks, out=True)

    def copy_in(
        self,
        records: torch.Tensor,
        ids: Sequence[int],
        k: Mapping[int, torch.Tensor],
        v: Mapping[int, torch.Tensor],
        blocks: Sequence[int],
    ) -> None:
        """Rows `ids` of `records` (written by `copy_out`, checked) into pool blocks
        `blocks` (each named once): per layer, K and V, a copy of each stretch, or one
        gather of the records, one transfer to the pool's device and one scatter."""
        self._copy(records, ids, k, v, blocks, out=False)

    def _copy(
        self,
        records: torch.Tensor,
        ids: Sequence[int],
        k: Mapping[int, torch.Tensor],
        v: Mapping[int, torch.Tensor],
        blocks: Sequence[int],
        out: bool,
    ) -> None:
        """`copy_out` (pool -> records) or `copy_in` (records -> pool)."""
        stretches, parts = _stretches(blocks, ids), self._parts(records, k, v)
        if stretches is not None:
            for table, pool in parts:
                for block, record, n in stretches:
                    src, dst = pool[block : block + n], table[record : record + n]
                    (dst if out else src).copy_(src if out else dst)
            return
        at, rows = self._indices(k, blocks, records, ids)
        for table, pool in parts:
            if out:
                table.index_copy_(0, rows, pool.index_select(0, at).to(table.device))
            else:
                pool.index_copy_(0, at, table.index_select(0, rows).to(pool.device))

    def _indices(
        self,
        k: Mapping[int, torch.Tensor],
        blocks: Sequence[int],
        records: torch.Tensor,
        ids: Sequence[int],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`blocks` on the pool's device and `ids` on the records', for index ops."""
        device = k[next(iter(self.shapes))].device if self.shapes else records.device
        at = torch.tensor(blocks, dtype=torch.int64, device=device)
        return at, torch.tensor(ids, dtype=torch.int64, device=records.device)


# A slice copy per stretch costs a call per stretch and layer; a gather and a scatter two
# calls per layer and a second pass over the bytes: stretches of 4 blocks or more on
# average (or one) copy faster as slices (CPU, 16-row blocks; longer blocks favour slices).
STRETCH = 4


def _stretches(blocks: Sequence[int], ids: Sequence[int]) -> list[tuple[int, int, int]] | None:
    """(first block, first record, blocks) of each stretch of moves whose blocks and
    records both advance by one, when they are long enough to copy as slices, else None."""
    stretches: list[tuple[int, int, int]] = []
    for block, record in zip(blocks, ids, strict=True):
        if stretches:
            first, at, n = stretches[-1]
            if (block, record) == (first + n, at + n):
                stretches[-1] = (first, at, n + 1)
                continue
        stretches.append((block, record, 1))
    if len(stretches) == 1 or len(blocks) >= STRETCH * len(stretches):
        return stretches
    return None


_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

Move = tuple[int, int, int, int]  # (kind, logical block, pool block, record): frames.Span


def runs(moves: Iterable[Move]) -> Iterator[list[Move]]:
    """`moves` in order, cut into runs that one batched copy each applies: consecutive
    moves of one kind, a run ending before a move that names one of its records again
    (a record written twice: the last write wins, as one by one). Runs apply in order, so
    an OUT of block b then an IN into b (two kinds) reads the rows the OUT left."""
    run: list[Move] = []
    records: set[int] = set()
    for move in moves:
        if run and (move[0] != run[0][0] or move[3] in records):
            yield run
            run, records = [], set()
        run.append(move)
        records.add(move[3])
    if run:
        yield run


class HostTier:
    """An in-process host tier: record id -> uint8 buffer, made on first use (the daemon's
    shared-memory records stand in for it in a worker: `SharedHostTier`)."""

    def __init__(self, record_bytes: int) -> None:
        self.record_bytes = record_bytes
        self.records: dict[int, torch.Tensor] = {}

    def record(self, record: int) -> torch.Tensor:
        if record not in self.records:
            self.records[record] = torch.empty(self.record_bytes, dtype=torch.uint8)
        return self.records[record]


class SharedHostTier:
    """The worker's view of its host tier in the daemon's shared memory: `records` is
    uint8 [n_records, record_bytes of every shard], record r at row r; this shard's bytes
    of each are [offset, offset + record_bytes) (module docstring)."""

    def __init__(self, records: torch.Tensor, offset: int, record_bytes: int) -> None:
        if records.dim() != 2 or offset + record_bytes > records.shape[1]:
            raise ValueError(f"host records {list(records.shape)} too narrow for this shard")
        self.records = records
        self.offset = offset
        self.record_bytes = record_bytes

    @property
    def rows(self) -> torch.Tensor:
        """This shard's bytes of every record, uint8 [n_records, record_bytes] (a view; record
        r at row r): what `PagedKVCache.apply_moves` copies into and out of."""
        return self.records[:, self.offset : self.offset + self.record_bytes]
