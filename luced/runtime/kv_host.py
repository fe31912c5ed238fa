"""The host tier's records: one block of K/V rows over every stored layer, copied out of
the shared block pool (`kv_blocks`) and back in byte for byte (KV Flash's pages).

One record, `RecordLayout.nbytes` bytes, for `rows` rows of each stored layer::

    for each stored layer in order:  K rows [Hkv, rows, D] | V rows [Hkv, rows, D]
    (the cache dtype's raw bytes, C order, no padding)

The daemon owns the records (a shared-memory segment of `records` rows); a worker holding
several shards (devices) stores them side by side in each record, shard by shard, each in
its own layout, so one record id covers all of them (`SharedHostTier`: one shard's bytes
of each record). `HostTier` keeps records in this process instead (tests, benchmarks).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RecordLayout:
    """Where each stored layer's K and V rows sit in one record."""

    shapes: Mapping[int, tuple[int, int]]  # stored layer -> (Hkv, D), in record order
    rows: int  # rows of each layer in one record: a block
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        item = self.dtype.itemsize
        return sum(2 * h * self.rows * d * item for h, d in self.shapes.values())

    def check(self, record: torch.Tensor) -> None:
        if record.dtype != torch.uint8 or record.shape != (self.nbytes,):
            got = f"{record.dtype} {list(record.shape)}"
            raise ValueError(f"a host record is uint8 [{self.nbytes}], got {got}")

    def views(self, record: torch.Tensor) -> Iterator[torch.Tensor]:
        """The record's bytes as each layer's K rows, then its V rows, [Hkv, rows, D]."""
        self.check(record)
        offset = 0
        for heads, dim in self.shapes.values():
            shape = (heads, self.rows, dim)
            size = heads * self.rows * dim * self.dtype.itemsize
            for _ in ("k", "v"):
                yield record[offset : offset + size].view(self.dtype).view(shape)
                offset += size

    def _segments(
        self, k: Mapping[int, torch.Tensor], v: Mapping[int, torch.Tensor], first: int
    ) -> Iterator[torch.Tensor]:
        """Pool rows [first, first + rows) of each layer's K, then V, in record order."""
        rows = slice(first, first + self.rows)
        for layer in self.shapes:
            yield k[layer][:, rows]
            yield v[layer][:, rows]

    def copy_out(
        self,
        k: Mapping[int, torch.Tensor],
        v: Mapping[int, torch.Tensor],
        first: int,
        record: torch.Tensor,
    ) -> None:
        """Pool rows [first, first + rows) of every layer into `record` (byte-exact)."""
        for dst, src in zip(self.views(record), self._segments(k, v, first), strict=True):
            dst.copy_(src)

    def copy_in(
        self,
        record: torch.Tensor,
        k: Mapping[int, torch.Tensor],
        v: Mapping[int, torch.Tensor],
        first: int,
    ) -> None:
        """A record written by `copy_out` into pool rows [first, first + rows) (any rows)."""
        for src, dst in zip(self.views(record), self._segments(k, v, first), strict=True):
            dst.copy_(src)


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

    def record(self, record: int) -> torch.Tensor:
        if not 0 <= record < self.records.shape[0]:
            raise ValueError(f"host record {record} outside [0, {self.records.shape[0]})")
        return self.records[record, self.offset : self.offset + self.record_bytes]
