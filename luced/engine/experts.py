"""The daemon's side of MoE expert compute: the expert worker, the scratch regions, the links.

With ``--moe-hot-experts N --moe-expert-device DEV`` every pipeline worker keeps N experts
per MoE layer and the expert worker (one more ``luced.runtime.worker`` on DEV, a slot of
the target's `Executor`) holds all the others. The daemon's part, never on the per-layer
path (workers call each other directly; ``luced.runtime.expert_link``):

    start      carve one scratch segment per pipeline worker (its largest batch of
               x / ids / weights, ``ipc.links.scratch_bytes``), before the workers load:
               ``load`` names it (``moe_scratch``)
    load       the expert worker answers ``load_experts`` with the fingerprint of the
               placement it complements; every pipeline worker whose ``load`` reported
               the same fingerprint gets a link (a socketpair, one end through each inbox)
    restart    a restarted pipeline worker is linked again when its fingerprint still
               matches the running expert worker's (the experts are reused), else the
               expert worker reloads first; a restarted expert worker relinks every one.
               Meanwhile the pipeline workers compute cold experts in process (or fail
               the forward with ``--moe-expert-required``)
    account    each ``forward`` reply's moe_* deltas add up to /metrics' counters

Across hosts (the expert worker, or a pipeline worker, on another host): no scratch or
socketpair can reach it, so each such pipeline worker and the expert worker are linked by
a hop "experts-k" (``engine/hops.py``; the pipeline worker's ``load`` names it,
``moe_link``) and the rows go over torch.distributed (``runtime/expert_link.HopExperts``).
A forward whose reply counts fallbacks had a hop fail: they are linked again before the
next one.
"""

from __future__ import annotations

import logging

from luced.engine.executor import Executor, Slot, WorkerHandle, error_text
from luced.engine.hops import Hop, Hops
from luced.engine.placement import TargetPlacement
from luced.ipc.frames import (
    ForwardReply,
    LoadExperts,
    LoadExpertsReply,
    LoadReply,
)
from luced.ipc.links import scratch_bytes
from luced.ipc.regions import Region, RegionAllocator
from luced.ipc.shm import ShmOwner

log = logging.getLogger(__name__)


class ExpertWorker:
    def __init__(
        self,
        owner: ShmOwner,
        name: str,
        placement: TargetPlacement,
        executor: Executor,
        hops: Hops,
    ) -> None:
        assert placement.moe_expert is not None and placement.moe_hot is not None
        self.owner, self.name, self.placement, self.executor = owner, name, placement, executor
        self.hops = hops
        self.links: list[Hop] = []  # the hops to pipeline workers on other hosts than it
        self.scratch: dict[int, Region] = {}  # pipeline slot index -> its scratch
        self.fingerprint = ""  # of the placement the running expert worker complements
        self.totals = {"remote_calls": 0, "fallbacks": 0, "remote_bytes": 0}

    def carve(self) -> None:
        hidden, k = self.placement.moe_dims
        nbytes = scratch_bytes(self.placement.max_batch_tokens, hidden, k)
        for slot in self.executor.slots:
            seg = self.owner.create(f"{self.name}-moe-{slot.index}", nbytes)
            alloc = RegionAllocator.for_segment(seg)
            self.scratch[slot.index] = alloc.alloc("scratch", [nbytes], "uint8")

    def crosses(self, slot: Slot) -> bool:
        """Whether `slot` and the expert worker are on different hosts (a hop, no scratch)."""
        expert = self.placement.moe_expert
        return slot.spec.remote or (expert is not None and expert.remote)

    def load_fields(self, slot: Slot) -> dict:
        """What a pipeline worker's ``load`` carries for its experts."""
        if self.crosses(slot):
            return {
                "moe_link": f"experts-{slot.index}",
                "moe_required": self.placement.moe_required,
            }
        return {
            "moe_scratch": self.scratch.get(slot.index),
            "moe_required": self.placement.moe_required,
        }

    async def start(self) -> None:
        """Start the expert worker. Unless it is required, a failure only logs: the cold
        experts run in process meanwhile, and a worker that died is restarted."""
        spec = self.placement.moe_expert
        assert spec is not None
        try:
            await self.executor.add_expert_slot(spec)
        except Exception as exc:
            if self.placement.moe_required:
                raise
            self._add_hops()
            log.error(
                "expert worker on %s did not start (%s): experts in process",
                spec.devices[0],
                error_text(exc),
            )

    async def load(self, slot: Slot, worker: WorkerHandle) -> LoadExpertsReply:
        """The executor's loader for the expert worker: its experts, then every link."""
        p = self.placement
        assert p.moe_hot is not None
        device = slot.spec.devices[0]
        req = LoadExperts(
            model=p.model,
            dtype=p.dtype,  # type: ignore[arg-type]
            device=device,
            hot=p.moe_hot,
            moe_profile=p.moe_profile,
            weights=p.weights_mode,
        )
        reply = await worker.load_experts(req)
        self.fingerprint = reply.fingerprint
        slot.detail = {
            "experts": f"{reply.n_held} cold experts of {reply.n_layers} MoE layers",
            "fingerprint": reply.fingerprint,
        }
        log.info("expert worker holds %s (placement %s)", slot.detail["experts"], self.fingerprint)
        self._add_hops()
        for target in self.executor.slots:
            h = target.handle
            if h is not None and h.state == "ready" and h.loaded is not None:
                self._link(target, h, h.loaded)
        await self.hops.ensure()
        return reply

    def _add_hops(self) -> None:
        """The hops to the pipeline workers on other hosts than the expert worker (once)."""
        expert = self.executor.expert_slot
        if self.links or expert is None:
            return
        self.links = [
            self.hops.add(f"experts-{s.index}", s, expert, serve="experts")
            for s in self.executor.slots
            if self.crosses(s)
        ]

    async def pipeline_loaded(self, slot: Slot, worker: WorkerHandle, reply: LoadReply) -> None:
        """A (re)loaded pipeline worker: link it to the running expert worker, reloading
        the experts first when the placement changed."""
        experts = self.executor.expert_worker()
        if experts is None:
            return  # not started yet, or restarting: its load links everyone
        if reply.moe_fingerprint != self.fingerprint:
            assert self.executor.expert_slot is not None
            log.info("expert placement changed: reloading the expert worker")
            await self.load(self.executor.expert_slot, experts)
            return
        self._link(slot, worker, reply)

    def _link(self, slot: Slot, worker: WorkerHandle, reply: LoadReply) -> None:
        if reply.moe_fingerprint != self.fingerprint:
            log.error(
                "worker %s placed experts as %s, the expert worker as %s: not linked "
                "(its cold experts run in process)",
                worker.spec.group,
                reply.moe_fingerprint,
                self.fingerprint,
            )
            return
        if not self.crosses(slot):  # else its hop links it (Hops.ensure)
            self.executor.link_experts(worker)

    def account(self, reply: ForwardReply) -> None:
        self.totals["remote_calls"] += reply.moe_remote_calls
        self.totals["fallbacks"] += reply.moe_fallbacks
        self.totals["remote_bytes"] += reply.moe_remote_bytes
        if reply.moe_fallbacks:  # a hop failed (or a local link): link the hops anew
            for hop in self.links:
                hop.stale = True
