"""A hybrid target's state records: host memory for the recurrent states the prefix cache
keeps (engine/kv/state_store.py), one record = the recurrent state of every worker's
recurrent layers at one position (`runtime/kv_state.py`'s layout, `LoadReply.
kv_state_bytes` each). Segment (created by the daemon once every worker loaded, attached
by the workers, unlinked by the daemon)::

    <name>-kvstate   state-k  uint8 [records, bytes_k]   worker k's part of record r at row r

A record is written by the workers only (`kv_page` state saves: each its own part), or by
the daemon into a record it holds (a state read from disk, before a restore loads it); the
daemon reads one only while it holds it (writing it to disk). Records are handed out
lowest first, so a small working set touches few pages, and counted: a record is free
at its last release.

Size: the states take a share of --prefix-cache-bytes (`STATE_SHARE`), the K/V blocks'
host records the rest (`HostRecords.split_states`, at `Target.start`): a state of a real
model weighs as much as a thousand or more positions of K/V, so a byte budget of blocks
alone would crowd them out. Each kind is given up least recently used within its share.
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Sequence

import numpy as np

from luced.ipc.regions import Region, RegionAllocator, required_bytes, view
from luced.ipc.shm import ShmOwner, shm_room

log = logging.getLogger(__name__)

STATE_SHARE = 0.5  # of --prefix-cache-bytes (and --kv-cache-budget) for recurrent states


def state_records(nbytes: int, record_bytes: int) -> int:
    """How many state records `nbytes` of the prefix cache keep (`STATE_SHARE` of them,
    at least one: a restore reads a state from disk into one)."""
    return max(1, int(nbytes * STATE_SHARE) // max(1, record_bytes))


class StateRecords:
    """The state records of every worker of a hybrid target (the module docstring)."""

    def __init__(self, records: int, widths: Sequence[int]) -> None:
        """records: how many; widths: each pipeline worker's bytes of one (its
        `kv_state_bytes`), in pipeline order."""
        if records < 1 or not widths or min(widths) < 0:
            raise ValueError(f"{records} state records of {list(widths)} bytes")
        self.records = records
        self.widths = list(widths)
        self.regions: list[Region] = []  # worker k's, once carved
        self.arrays: list[np.ndarray] = []  # the daemon's views, uint8 [records, bytes_k]
        self._free = list(range(records))  # a heap: lowest first
        self._refs = [0] * records

    @property
    def nbytes(self) -> int:
        """One record over every worker."""
        return sum(self.widths)

    def carve(self, owner: ShmOwner, name: str, room: int | None = None) -> None:
        """`<name>-kvstate`, of at most `room` bytes (default `shm_room()`: fewer records
        when they do not fit, with a warning)."""
        room = shm_room() if room is None else room
        fits = max(1, room // max(1, self.nbytes))
        if fits < self.records:
            log.warning(
                "prefix cache: %d of %d recurrent state records fit in half of the free "
                "space in /dev/shm (%d MiB); fewer states are kept in memory",
                fits,
                self.records,
                room >> 20,
            )
            self.records, self._free, self._refs = fits, list(range(fits)), [0] * fits
        specs = {f"state-{k}": ([self.records, w], "uint8") for k, w in enumerate(self.widths)}
        segment = owner.create(f"{name}-kvstate", required_bytes(specs.values()))
        alloc = RegionAllocator.for_segment(segment)
        self.regions = [alloc.alloc(key, shape, dtype) for key, (shape, dtype) in specs.items()]
        self.arrays = [view(segment, region) for region in self.regions]

    @property
    def free(self) -> int:
        return len(self._free)

    def hold(self) -> int | None:
        """The lowest free record, held by the caller (`release`); None when all are held."""
        if not self._free:
            return None
        record = heapq.heappop(self._free)
        self._refs[record] = 1
        return record

    def retain(self, record: int) -> None:
        if self._refs[record] < 1:
            raise ValueError(f"state record {record} is free: hold it first")
        self._refs[record] += 1

    def release(self, record: int) -> None:
        if self._refs[record] < 1:
            raise ValueError(f"state record {record} is released more often than held")
        self._refs[record] -= 1
        if not self._refs[record]:
            heapq.heappush(self._free, record)

    def refs(self, record: int) -> int:
        return self._refs[record]
