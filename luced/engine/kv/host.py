"""The host tier of the block pool: each worker's host records, in daemon-owned shared
memory, and the `kv_page` frame that moves a lane's blocks there and back outside a
forward.

A record (`BlockTables`' record id r) holds one block of every stored layer of a worker,
laid out by `runtime/kv_host.py` `RecordLayout` for the pool's block (16 rows, or KV
Flash's 64). Segment (created by the daemon once every worker loaded, attached by the
workers, unlinked by the daemon)::

    <name>-kvhost   host-k  uint8 [records, bytes_k]  worker k's records: record r at
                                                      row r, one block of every stored
                                                      layer, K then V, one shard after
                                                      another (`LoadReply.kv_record_bytes`)

Who pages: under KV Flash each running lane's pager (its moves ride in its spans) and the
kept lanes under pressure (engine/kv/holdings.py); without KV Flash only the kept lanes
(finished prompts kept for sharing), and a lane sharing their paged-out blocks pages them
all in with its first span (engine/runner.py). A record is written only by the worker whose
layers it holds (a page-out or a save: a worker that dies leaves them intact; a restarted
worker starts empty, so the target resets its sequences anyway), or by the daemon into a
record it holds (the block store reading a block from disk, engine/kv/block_store.py,
before the lane adopts it); the daemon reads a record only while it holds it (the block
store writing a saved block to disk). Besides the kept lanes' records, the block store
keeps `store_records` as the prefix cache's memory tier: blocks by prefix key, given up
least recently used first whenever anyone needs a record.

A worker on another host pages to its own mirror of its records (runtime/mirror.py), which
it drops with the daemon's connection: a reconnected worker starts with none, so every
record's contents are lost there (`epoch` counts such losses; the block store gives up
what it held before) and the daemon's copy of that worker's records is never used.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import numpy as np

from luced.engine.executor import Executor, WorkerReplyError
from luced.engine.kv.blocks import SAVE, BlockTables, Move
from luced.engine.kv.state_records import StateRecords, state_records
from luced.ipc.frames import KVPage
from luced.ipc.regions import Region, RegionAllocator, required_bytes, view
from luced.ipc.shm import ShmOwner, shm_room

log = logging.getLogger(__name__)


def kept_records(kept: int, block: int, kept_lanes: int) -> int:
    """Host records for the kept lanes without KV Flash: their `kept` positions in blocks,
    plus one per lane for its partial last block, so the records cost at most what the
    kept lanes could hold in the pool."""
    return -(-kept // block) + kept_lanes if kept > 0 and kept_lanes > 0 else 0


def store_records(context: int, block: int) -> int:
    """The least host records of the prefix cache's block store (engine/kv/block_store.py):
    a context's blocks, which a save or a restore of a whole context passes through."""
    return -(-context // block)


class HostRecords:
    """The host records of every worker of a target (the module docstring's segment)."""

    def __init__(self, records: int) -> None:
        self.records = records
        self.regions: list[Region] = []  # worker k's records, once carved
        self.arrays: list[np.ndarray] = []  # the daemon's views of them, uint8 [records, bytes_k]
        self._record_bytes: dict[tuple[int, int], int] = {}  # worker layers -> one record
        self._state_bytes: dict[tuple[int, int], int] = {}  # -> one state record (a hybrid's)
        self.epoch = 0  # records lost by a worker on another host (the module docstring)

    def loaded(
        self,
        layers: tuple[int, int],
        record_bytes: int,
        group: str,
        state_bytes: int = 0,
        remote: bool = False,
    ) -> None:
        """A worker's load reply: the size of its record, which a restarted worker must
        keep (the records in the daemon's memory are laid out for it), and of its state
        record (a hybrid's, `split_states`). `remote`: a worker on another host, whose
        records a reload finds empty."""
        known = self._record_bytes.get(layers)
        if self.regions and record_bytes != known:
            raise WorkerReplyError(
                f"worker {group}'s host records are of {record_bytes} bytes, not {known}"
            )
        self._record_bytes[layers] = record_bytes
        self._state_bytes[layers] = state_bytes
        if self.regions and remote:
            self.epoch += 1

    def split_states(
        self, layers: Sequence[tuple[int, int]], nbytes: int
    ) -> tuple[StateRecords, int]:
        """A hybrid's state records for the block store (`state_records`: their share of
        its `nbytes`, --prefix-cache-bytes) and the bytes left to its blocks' records (at
        least a context's are kept: `size_store`)."""
        widths = [self._state_bytes[span] for span in layers]
        states = StateRecords(state_records(nbytes, sum(widths)), widths)
        return states, max(1, nbytes - states.records * states.nbytes)

    def size_store(
        self,
        tables: BlockTables,
        layers: Sequence[tuple[int, int]],
        least: int,
        nbytes: int,
        limits: Sequence[int | None] = (),
    ) -> int:
        """Before the carve (every worker loaded, `layers` theirs): the block store's
        records, the last `least` of `tables`' (`store_records`, counted before the size of
        one was known), become `nbytes` of them (--prefix-cache-bytes over one block of
        every worker), and no more than each worker's limit in `limits` (bytes of its own
        records: a worker on another host's --prefix-cache-bytes; None: none) allows, at
        least `least`; `nbytes` 0: none. -> how many."""
        block_bytes = sum(self._record_bytes[span] for span in layers)
        store = nbytes // max(1, block_bytes)
        for span, limit in zip(layers, limits, strict=False):
            if limit is not None:
                store = min(store, limit // self._record_bytes[span])
        store = max(least, store) if nbytes else 0
        tables.resize_records(tables.records - least + store)
        self.records = tables.records
        return store

    def carve(
        self,
        owner: ShmOwner,
        name: str,
        layers: Sequence[tuple[int, int]],
        tables: BlockTables,
        room: int | None = None,
    ) -> int:
        """Once every worker loaded (`layers`: theirs in pipeline order): `<name>-kvhost`,
        of at most `room` bytes (default `shm_room()`: the records that do not fit are
        taken from `tables`, with a warning). -> the bytes of one block over every worker."""
        sizes = [self._record_bytes[span] for span in layers]
        room = shm_room() if room is None else room
        fits = max(1, room // max(1, sum(sizes)))
        if fits < self.records:
            log.warning(
                "host records for paged-out K/V: %d of %d fit in half of the free space in "
                "/dev/shm (%d MiB); a kept prompt past them is given up, the prefix cache "
                "keeps fewer blocks in memory, and a --kv-flash request that needs more "
                "fails (enlarge /dev/shm to keep more)",
                fits,
                self.records,
                room >> 20,
            )
            self.records = fits
            tables.resize_records(fits)
        specs = {f"host-{k}": ([self.records, b], "uint8") for k, b in enumerate(sizes)}
        segment = owner.create(f"{name}-kvhost", required_bytes(specs.values()))
        alloc = RegionAllocator.for_segment(segment)
        self.regions = [alloc.alloc(key, shape, dtype) for key, (shape, dtype) in specs.items()]
        self.arrays = [view(segment, region) for region in self.regions]
        return sum(sizes)

    async def page(
        self,
        executor: Executor,
        lane: int,
        moves: Sequence[Move],
        tokens: Sequence[int] = (),
        states: Sequence[tuple[int, int, int]] = (),
        state_regions: Sequence[Region] = (),
    ) -> None:
        """`lane`'s moves in every worker (`kv_page`, each through its own records; a
        worker on another host pages to its own memory); `tokens`: the ids of the
        positions its adopt moves add; `states`: a hybrid's state moves (`KVPage.states`)
        through each worker's `state_regions` (engine/kv/state_records.py). A failure
        leaves the workers out of step with the tables (`in_sync` is off until they start
        over), unless every move is a SAVE, which changes no table (nor does a state
        save): only the records' contents are lost, which the caller releases."""
        wire = tuple(tuple(m) for m in moves)
        ids = tuple(int(t) for t in tokens)
        kept = tuple(tuple(s) for s in states)
        try:
            await asyncio.gather(
                *(
                    w.call(
                        KVPage(
                            sequence=lane,
                            moves=wire,
                            kv_host=self.regions[i],
                            tokens=ids,
                            states=kept,
                            kv_states=state_regions[i] if kept else None,
                        )
                    )
                    for i, w in enumerate(executor.workers())
                )
            )
        except BaseException:
            if any(m.kind != SAVE for m in moves):
                executor.in_sync = False
            raise
