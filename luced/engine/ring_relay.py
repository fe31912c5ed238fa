"""The feature rings of a DFlash draft on another host: their rows reach it through a
local worker, over the hop "draft".

A slot's ring lives in the daemon's shared memory: the pipeline's workers write the
captured rows of every position they compute (a remote stage's cells come back inline),
and the daemon writes a shared prefix's rows (``Target.share_ring``) and a restored
snapshot's (``KVMover.import_kv``). A draft on another host reads its mirror of the ring,
so before each ``draft`` frame the rows its window reads that the mirror does not hold
yet travel there: a local pipeline worker, whose view of the ring is the daemon's own
memory, sends them (a ``ping`` carrying ``relay_out``), and the draft's frame receives
them (``relay_in``). Only the rows written since they were last sent move: per slot,

    sent        positions below it are current in the mirror
    wrote(p)    a forward (or the daemon) wrote rows from position p on: sent = min(sent, p)
    a window    reading [c - C, c): rows [max(sent, c - C), c) move; sent = c

A new link (the draft's worker reconnected: its mirror is empty) starts every slot over.
Without a local pipeline worker the rows go inline, in the draft frame itself.
"""

from __future__ import annotations

from luced.engine.executor import Slot, WorkerHandle
from luced.engine.feature_ring import FeatureRing, cells
from luced.engine.hops import Hop
from luced.ipc.frames import Carry, Ping, Put
from luced.ipc.regions import buffer


class RingRelay:
    """Rows of the slots' rings to a draft on another host (module docstring)."""

    def __init__(self, hop: Hop | None, relay: Slot | None) -> None:
        self.hop = hop  # None: no local pipeline worker, the rows go inline
        self.relay = relay
        self.sent: dict[int, int] = {}
        self._generation = -1
        self.bytes = 0  # ring bytes sent (inline or relayed)

    def wrote(self, slot: int, position: int) -> None:
        self.sent[slot] = min(self.sent.get(slot, 0), position)

    def forget(self, slot: int) -> None:
        """The draft frame failed: whatever its rows did, send them all again, over a new
        link (a relayed send nobody took would hold up the next one)."""
        self.sent.pop(slot, None)
        if self.hop is not None:
            self.hop.stale = True

    async def carry(self, slot: int, ring: FeatureRing, lo: int, hi: int) -> Carry | None:
        """The carry of `slot`'s draft frame, which reads positions [lo, hi) of `ring`."""
        if self.hop is not None and self.hop.generation != self._generation:
            self.sent.clear()  # a new link: a new mirror
            self._generation = self.hop.generation
        start = max(self.sent.get(slot, 0), lo)
        self.sent[slot] = hi
        if start >= hi:
            return None
        n_capture = ring.region.shape[1]
        regions = tuple(cells(ring.region, start, hi - start, (0, n_capture)))
        self.bytes += sum(r.nbytes for r in regions)
        if self.hop is None or self.relay is None:
            return Carry(
                put=tuple(Put(region=r, data=bytes(buffer(ring.segment, r))) for r in regions)
            )
        relay = self.hop.relay(regions, hi - start)
        worker = self.relay.handle
        assert isinstance(worker, WorkerHandle)
        try:
            await worker.call(Ping(), Carry(relay_out=(relay,)))
        except BaseException:
            self.forget(slot)
            raise
        return Carry(relay_in=(relay,))
