"""Snapshots of the target's KV: copies between the workers' caches and daemon-owned regions.

A snapshot of the target at n tokens (the prefix cache, docs/design.md) is one region per
``TensorSpec`` of ``layout``, in a daemon-owned segment (the snapshot arena), n along the
token axis (or more: a longer snapshot restores any shorter prefix)::

    "k.{l}", "v.{l}"  [Hkv, >= n, D]  cache dtype   exported / imported by the worker
                                                    holding layer l (frames kv_export /
                                                    kv_import), all workers concurrently
    "ring"            [>= n, n_capture, hidden]     copied here with numpy, from / to
                                                    the feature ring (captures on only)
    "conv.{l}",       the states of recurrent layer l at the snapshot's cut points, one
    "delta.{l}"       slot each [len(cuts), *state] on export (the workers kept them,
                      ``Target.prefill`` ``keep_at``); one slot [1, *state] on import,
                      the state at n (the prefix cache's exact-cut mode picks it)

Ring rows: the ring holds the last ring_cap positions, so a snapshot carries ring rows
only for its positions [max(0, n - ring_cap), n); rows before that are left as they
were (a restore of a prefix m must not trust ring rows below n - ring_cap). And slot
p % ring_cap holds position p only until a later position p + k * ring_cap is fed,
even one rolled back since: with h the highest position fed (exclusive) since p was,
ring row p is right iff p >= h - ring_cap. Export right after the forward that reached
n (h == n) and every exported ring row is right; exporting n < h copies stale rows.

The target (``target.py``) keeps the committed position and the shards' agreement; this
module only checks regions and moves bytes.

A worker on another host keeps its layers' part of a snapshot on its own host
(``runtime/snapshot_store.py``): ``kv_export`` and ``kv_import`` name the prefix cache's entry
id (``store``) instead of regions, so the layout here, the arena and the daemon's disk
files hold only the local workers' tensors, and no KV row crosses the network.
``forget`` tells those workers which entries the prefix cache dropped.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence

from luced.cache.layout import TensorSpec, tensor_specs
from luced.engine.executor import Executor
from luced.engine.feature_ring import FeatureRing
from luced.ipc.frames import Carry, KVExport, KVForget, KVImport, KVLayout, KVLayoutReply
from luced.ipc.regions import Attachments, Region

log = logging.getLogger(__name__)


class KVTransfer:
    def __init__(self, executor: Executor, instance: str) -> None:
        self.executor = executor
        self.instance = instance
        # Each worker's tensors (fixed by its plan, so asked once; None for a worker on
        # another host, which keeps its own) and the snapshot arena's mapping here (for
        # the ring rows), kept for the target's life.
        self._specs: list[list[TensorSpec] | None] | None = None
        self._maps = Attachments()

    def close(self) -> None:
        self._maps.close()

    async def layout(self, ring: FeatureRing | None) -> list[TensorSpec]:
        """Every tensor of a snapshot held in this daemon: each local worker's K/V in
        layer order, then the ring (a remote worker's part stays on its host)."""
        per_worker = await self._worker_layouts()
        return [spec for specs in per_worker for spec in specs or ()] + _ring_spec(ring)

    async def export(
        self,
        n: int,
        regions: dict[str, Region],
        ring: FeatureRing | None,
        cuts: tuple[int, ...] = (),
        sequence: int = 0,
        entry: str = "",
    ) -> None:
        """Copy positions [0, n) into `regions`, one per spec of `layout`, and each
        recurrent state at cuts[i] (default (n,)) into its slot i; a remote worker keeps
        its part as `entry`. Nothing is written before every region checked out; when a
        worker fails the others have finished too (the regions are free again) and the
        first error is raised."""
        per_worker = await self._worker_layouts()
        cuts = cuts or (n,)
        self._check(per_worker, ring, regions, n, len(cuts), entry)
        frames = [
            KVExport(position=n, regions=mine, cuts=cuts, sequence=sequence, store=store)
            for mine, store in _parts(per_worker, regions, entry)
        ]
        await self._call_all(frames)
        if ring is not None:
            self._copy_ring(ring, regions["ring"], n, into_ring=False)

    async def import_frames(
        self,
        n: int,
        regions: dict[str, Region],
        tokens: Region,
        ring: FeatureRing | None,
        sequence: int = 0,
        entry: str = "",
    ) -> list[KVImport]:
        """Each worker's import of positions [0, n) (a remote one's from its own copy of
        `entry`), every region checked first: a bad one raises here, before anything
        changes."""
        per_worker = await self._worker_layouts()
        self._check(per_worker, ring, regions, n, 1, entry)
        return [
            KVImport(position=n, regions=mine, tokens=tokens, sequence=sequence, store=store)
            for mine, store in _parts(per_worker, regions, entry)
        ]

    async def import_(
        self, frames: list[KVImport], region: Region | None, ring: FeatureRing | None
    ) -> None:
        """Run checked imports on every worker, then restore the ring's slots of
        [max(0, n - ring_cap), n) from `region`; raises once every worker has answered."""
        await self._call_all(frames)
        if ring is not None:
            assert region is not None
            self._copy_ring(ring, region, frames[0].position, into_ring=True)

    async def forget(self, entries: Sequence[str]) -> None:
        """Tell the workers on other hosts that the prefix cache dropped `entries` (their
        copies go); one that cannot hear it now keeps them until its own budget evicts
        them, and refuses them if asked (an entry that fails to restore is dropped)."""
        if not entries:
            return
        frame = KVForget(ids=tuple(entries))
        for slot in self.executor.slots:
            h = slot.handle
            if not slot.spec.remote or h is None or h.state != "ready":
                continue
            try:
                await h.call(frame)
            except Exception as exc:  # the worker is gone or going: nothing to undo
                log.info("%s keeps %d dropped snapshot(s): %s", slot.spec.group, len(entries), exc)

    async def _worker_layouts(self) -> list[list[TensorSpec] | None]:
        """Each local worker's K/V specs, in pipeline order, None for a remote one (asked
        once: a worker restarted later serves the same layers in the same dtype)."""
        if self._specs is None:
            workers = self.executor.workers()
            replies = await asyncio.gather(
                *(w.call(KVLayout()) for w in workers if not w.spec.remote)
            )
            local = iter(replies)
            out: list[list[TensorSpec] | None] = []
            for w in workers:
                if w.spec.remote:
                    out.append(None)
                    continue
                reply = next(local)
                assert isinstance(reply, KVLayoutReply)
                out.append(tensor_specs(reply.tensors, reply.dtype, reply.states))
            self._specs = out
        return self._specs

    async def _call_all(self, frames: list[KVExport] | list[KVImport]) -> None:
        """One frame per worker, concurrently; waits for all, then raises the first error.
        A remote worker gets the token ids inline and forgets the arena after the frame."""
        calls = [
            worker.call(frame, Carry(forget=(frame.tokens.segment,)))
            if isinstance(frame, KVImport) and worker.spec.remote
            else worker.call(frame)
            for worker, frame in zip(self.executor.workers(), frames, strict=True)
        ]
        results = await asyncio.gather(*calls, return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise r

    def _check(
        self,
        per_worker: list[list[TensorSpec] | None],
        ring: FeatureRing | None,
        regions: Mapping[str, Region],
        n: int,
        slots: int,
        entry: str,
    ) -> None:
        if None in per_worker and not entry:
            raise ValueError("a snapshot with workers on other hosts needs its entry id")
        specs = [s for specs in per_worker for s in specs or ()] + _ring_spec(ring)
        names = {s.name for s in specs}
        missing, unknown = names - regions.keys(), regions.keys() - names
        if missing or unknown:
            raise ValueError(
                f"snapshot regions must match kv_layout: missing {sorted(missing)}, "
                f"unknown {sorted(unknown)}"
            )
        for spec in specs:
            r = regions[spec.name]
            axis = spec.token_axis
            rows = n if axis is None else r.shape[axis]
            ok = len(r.shape) == len(spec.shape_for(n, slots)) and r.dtype == spec.dtype
            if not ok or rows < n or spec.shape_for(rows, slots) != r.shape:
                want = list(spec.shape_for(n, slots))
                raise ValueError(
                    f"snapshot region {spec.name} must be {spec.dtype} {want} (or longer on "
                    f"axis {axis}), got {r.dtype} {list(r.shape)}"
                )
            if not r.segment.startswith(f"/luced-{self.instance}-"):
                raise ValueError(f"snapshot region {spec.name} is not in this daemon's memory")

    def _copy_ring(self, ring: FeatureRing, region: Region, n: int, into_ring: bool) -> None:
        """Ring slots of positions [max(0, n - ring_cap), n) <-> the same rows of `region`."""
        slots, cap = ring.array, ring.ring_cap
        rows = self._maps.view(region)  # the arena: mapped on first use
        p = max(0, n - cap)
        while p < n:  # at most two runs: the slots wrap once
            slot = p % cap
            k = min(n - p, cap - slot)
            if into_ring:
                slots[slot : slot + k] = rows[p : p + k]
            else:
                rows[p : p + k] = slots[slot : slot + k]
            p += k
        del rows  # no view may outlive the mapping, which close() unmaps


def _parts(
    per_worker: list[list[TensorSpec] | None], regions: Mapping[str, Region], entry: str
) -> list[tuple[dict[str, Region], str]]:
    """Each worker's part of a snapshot: (its regions, "") for a local worker, ({}, the
    entry id) for a remote one, which keeps its part on its own host."""
    return [
        ({s.name: regions[s.name] for s in specs}, "") if specs is not None else ({}, entry)
        for specs in per_worker
    ]


def _ring_spec(ring: FeatureRing | None) -> list[TensorSpec]:
    if ring is None:
        return []
    shape = (1, len(ring.layers), ring.hidden)
    return [TensorSpec("ring", shape, ring.region.dtype, token_axis=0)]
