"""KV Flash's part of the target: each running slot's pager over the target's block
tables (engine/kv/pager.py), the scores in shared memory (transport.py), and the
counters. The host records are the target's (engine/kv/host.py). A kept lane (a finished
prompt held for sharing) never runs, so it has no pager: it keeps what it was given,
paged-out blocks included (their host records are shared, `BlockTables.share`), until
room is needed and its resident blocks but its sinks are paged out too
(engine/kv/holdings.py; `HostRecords.page` sends the moves)."""

from __future__ import annotations

import dataclasses

from luced.engine.kv.blocks import BlockTables
from luced.engine.kv.holdings import Holdings
from luced.engine.kv.pager import Pager, PagerConfig
from luced.engine.kvflash.transport import FlashRegions
from luced.ipc.shm import ShmOwner


class FlashLanes:
    """The pagers of the running slots and the regions their scores use."""

    def __init__(self, cfg: PagerConfig, sequences: int, capacity: int) -> None:
        self.cfg = cfg
        self.sequences = sequences  # the running slots, the only lanes that page
        self.keys = -(-capacity // cfg.block)  # blocks of a context: a lane's records
        self.tables: BlockTables | None = None  # the target's, once carved
        self.regions: FlashRegions | None = None
        self._pagers: dict[int, Pager] = {}

    def records(self, kept: int = 0, kept_lanes: int = 0) -> int:
        """Host records for the block tables: every running slot may page out a context,
        and the kept lanes (finished prompts) hold `kept_records` of their own."""
        return self.sequences * self.keys + self.kept_records(kept, kept_lanes)

    def kept_records(self, kept: int, kept_lanes: int) -> int:
        """Host records the kept lanes may hold: a whole context per running slot (a
        conversation each) and their `kept` resident positions paged out."""
        return self.sequences * self.keys + -(-kept // self.cfg.block) if kept_lanes > 0 else 0

    def holdings(self, tables: BlockTables, kept_records: int) -> Holdings:
        """What the lanes hold in the pool over `tables` (the KV budget's charges), the
        kept lanes within `kept_records` of its host records: a running lane at most its
        quota and its step's block."""
        cap = (self.cfg.n_blocks + 1) * self.cfg.block
        return Holdings(tables, cap, self.cfg.sink_blocks, kept_records)

    def blocks_for(self, kept_blocks: int) -> int:
        """The pool's blocks: each running slot's quota and one more (its decode's next
        block is planned within the quota; the extra one is slack), and `kept_blocks` for
        the lanes past them."""
        return self.sequences * (self.cfg.n_blocks + 1) + kept_blocks

    def carve(
        self, owner: ShmOwner, name: str, workers: int, tables: BlockTables, block_bytes: int
    ) -> None:
        """Once every worker loaded: the scores; `block_bytes`, one block over every worker
        (its host record), for the counters."""
        self.cfg = dataclasses.replace(self.cfg, block_bytes=block_bytes)
        self.tables = tables
        self.regions = FlashRegions(owner, name, self.sequences, self.keys, workers)

    def pager(self, slot: int) -> Pager | None:
        """`slot`'s pager, made on first use (None for a kept lane). A slot keeps it for
        the sequences that follow in it (reset between)."""
        if self.tables is None or slot >= self.sequences:
            return None
        pager = self._pagers.get(slot)
        if pager is None:
            pager = self._pagers[slot] = Pager(self.cfg, self.tables, slot)
        return pager

    def forget(self, slot: int) -> None:
        """`slot`'s sequence is gone (its table freed): its pager starts over."""
        if slot in self._pagers:
            self._pagers[slot].reset()

    def truncate(self, slot: int, position: int) -> None:
        if (pager := self._pagers.get(slot)) is not None:
            pager.truncate(min(position, pager.end))

    def prompt_chunk(self, chunk: int) -> int:
        """A prompt chunk that fits the quota beside the sink, straddling one more block."""
        return min(chunk, (self.cfg.n_blocks - self.cfg.sink_blocks - 1) * self.cfg.block)

    def resident(self, slot: int, n: int) -> int:
        """How many of `slot`'s first n positions lie before its first paged-out block."""
        if self.tables is None:
            return n
        return min(n, self.tables.resident_prefix(slot) * self.tables.block)

    def status(self) -> dict:
        """Pool, policy, block, resident and paged-out blocks, evictions, recalls and host
        bytes, summed over the running slots' pagers and the kept lanes' tables."""
        stats = [p.stats() for p in self._pagers.values()]
        t = self.tables
        kept = [] if t is None else [lane for lane in t.lanes if lane >= self.sequences]
        paged = sum(t.paged(lane) for lane in kept) if t is not None else 0
        held = sum(t.length(lane) for lane in kept) if t is not None else 0
        return {
            "pool_tokens": self.cfg.pool_tokens,
            "policy": self.cfg.policy,
            "block": self.cfg.block,
            "resident_blocks": sum(s.resident for s in stats) + held - paged,
            "paged_out_blocks": sum(s.paged_out for s in stats) + paged,
            "evictions": sum(s.evictions for s in stats),
            "recalls": sum(s.recalls for s in stats),
            "host_bytes": sum(s.host_bytes for s in stats) + paged * self.cfg.block_bytes,
            "sequences": len(stats),
            "kept_lanes": len(kept),
        }
