"""The daemon's handle on the target model: next tokens out of worker frames.

The engine asks for `prefill(prompt)` and `step(token)`; the runner turns those into
`forward` frames over the daemon-owned io segment, and keeps the worker alive
(restart with the same placement after a crash). Today one worker holds the whole
model; the layer split extends this class, not the engine.

io segment "io-<group>" (one per worker, created by the daemon, attached by the
worker; regions carved by `RegionAllocator`, 64-byte aligned)::

    tokens         int32   [max_batch_tokens]        daemon writes ids to feed
    ids            int32   [max_batch_tokens]        worker writes sampled ids
    logprobs       float32 [max_batch_tokens]        worker: logprob of each sampled id
    topk_ids       int32   [max_batch_tokens * 20]   worker: top-k ids (k <= 20)
    topk_logprobs  float32 [max_batch_tokens * 20]   worker: their logprobs

Write ordering: the daemon writes `tokens` and then sends `forward`; the worker writes
its outputs and then replies; the daemon reads them after the reply. One request runs
at a time, so each region has one writer at any moment.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from luced.ipc.frames import Forward, ForwardReply, Load, Reset, Stats, StatsReply
from luced.ipc.regions import Region, RegionAllocator, required_bytes, view
from luced.ipc.shm import Segment, ShmOwner
from luced.workers import WorkerDied, WorkerHandle, WorkerSpec

log = logging.getLogger(__name__)

MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class Sampled:
    token: int
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] = ()  # (id, logprob), most likely first


@dataclass(frozen=True)
class TargetPlacement:
    model: str
    n_layers: int  # from the GGUF header, read by the daemon before any worker starts
    dtype: str
    kv_capacity: int
    max_batch_tokens: int
    worker: WorkerSpec


class TargetRunner:
    def __init__(
        self,
        owner: ShmOwner,
        placement: TargetPlacement,
        on_state_change: Callable[[], None] | None = None,
    ) -> None:
        self.owner = owner
        self.placement = placement
        self.on_state_change = on_state_change
        self.worker: WorkerHandle | None = None
        self.restarts = 0
        self.load_s = 0.0
        self.n_layers = 0
        self.vocab = 0
        self._closing = False
        self._restart_task: asyncio.Task | None = None
        self._segment: Segment | None = None
        self._regions: dict[str, Region] = {}
        self._arrays: dict[str, np.ndarray] = {}
        self._position = 0

    @property
    def ready(self) -> bool:
        return self.worker is not None and self.worker.state == "ready"

    async def start(self) -> None:
        self._make_segment()
        await self._start_worker()

    def _make_segment(self) -> None:
        n = self.placement.max_batch_tokens
        specs = {
            "tokens": ([n], "int32"),
            "ids": ([n], "int32"),
            "logprobs": ([n], "float32"),
            "topk_ids": ([n * MAX_TOP_LOGPROBS], "int32"),
            "topk_logprobs": ([n * MAX_TOP_LOGPROBS], "float32"),
        }
        name = f"io-{self.placement.worker.group.replace(':', '_')}"
        self._segment = self.owner.create(name, required_bytes(specs.values()))
        alloc = RegionAllocator.for_segment(self._segment)
        for key, (shape, dtype) in specs.items():
            region = alloc.alloc(key, shape, dtype)
            self._regions[key] = region
            self._arrays[key] = view(self._segment, region)

    async def _start_worker(self) -> None:
        p = self.placement
        worker = WorkerHandle(p.worker, self.owner.instance, on_exit=self._on_worker_exit)
        self.worker = worker
        self._notify()
        await worker.start()
        reply = await worker.load(
            Load(
                model=p.model,
                layers=(0, p.n_layers),
                dtype=p.dtype,
                devices=p.worker.devices[:1],
                kv_capacity=p.kv_capacity,
                owns_embed=True,
                owns_head=True,
            )
        )
        self.load_s, self.n_layers, self.vocab = reply.load_s, reply.n_layers, reply.vocab
        self._position = 0
        self._notify()

    def _notify(self) -> None:
        if self.on_state_change is not None:
            self.on_state_change()

    def _on_worker_exit(self, worker: WorkerHandle, code: int) -> None:
        self._notify()
        if not self._closing and self._restart_task is None:
            self._restart_task = asyncio.get_running_loop().create_task(self._restart())

    async def _restart(self) -> None:
        delay = 0.5
        try:
            while not self._closing:
                self.restarts += 1
                group = self.placement.worker.group
                log.warning("restarting worker %s (restart #%d)", group, self.restarts)
                try:
                    await self._start_worker()
                    return
                except Exception as exc:  # keep trying: a transient failure must not stick
                    log.error("worker restart failed: %s", exc)
                    if self.worker is not None:
                        await self.worker.stop()
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 30.0)
        finally:
            self._restart_task = None

    async def close(self) -> None:
        self._closing = True
        if self._restart_task is not None:
            self._restart_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._restart_task
        if self.worker is not None:
            await self.worker.stop()

    def _worker(self) -> WorkerHandle:
        if self.worker is None or self.worker.state != "ready":
            raise WorkerDied("the model worker is not ready")
        return self.worker

    async def reset(self) -> None:
        await self._worker().call(Reset())
        self._position = 0

    async def prefill(
        self,
        prompt: list[int],
        sampling: dict,
        logprobs: int | None,
        cancelled: Callable[[], bool] = lambda: False,
    ) -> Sampled | None:
        """Feed the prompt in chunks of max_batch_tokens; sample after the last one.
        Returns None when `cancelled()` turned true between chunks."""
        chunk = self.placement.max_batch_tokens
        for start in range(0, len(prompt), chunk):
            if cancelled():
                return None
            piece = prompt[start : start + chunk]
            last = start + chunk >= len(prompt)
            sampled = await self._forward(piece, sampling, logprobs, sample=last)
        return sampled

    async def step(self, token: int, sampling: dict, logprobs: int | None) -> Sampled:
        """Feed one token, sample the next. logprobs: None, or k = chosen + top k."""
        return await self._forward([token], sampling, logprobs, sample=True)

    async def _forward(
        self, ids: list[int], sampling: dict, logprobs: int | None, sample: bool
    ) -> Sampled | None:
        worker = self._worker()
        n = len(ids)
        self._arrays["tokens"][:n] = ids
        outputs = {"ids": self._regions["ids"].rows(0, 1)}
        k = min(logprobs or 0, MAX_TOP_LOGPROBS)
        if logprobs is not None:
            outputs["logprobs"] = self._regions["logprobs"].rows(0, 1)
        if k:
            outputs["topk_ids"] = self._topk_region("topk_ids", k)
            outputs["topk_logprobs"] = self._topk_region("topk_logprobs", k)
        reply = await worker.call(
            Forward(
                n_tokens=n,
                start_pos=self._position,
                want="sample",
                outputs=outputs,
                tokens=self._regions["tokens"].rows(0, n),
                positions="last",
                sampling=sampling,
                top_logprobs=k,
            )
        )
        assert isinstance(reply, ForwardReply)
        self._position = reply.position
        if not sample:
            return None
        token = int(self._arrays["ids"][0])
        logprob = float(self._arrays["logprobs"][0]) if "logprobs" in outputs else None
        top: tuple[tuple[int, float], ...] = ()
        if k:
            top_ids = self._arrays["topk_ids"][:k]
            top_lp = self._arrays["topk_logprobs"][:k]
            top = tuple((int(i), float(lp)) for i, lp in zip(top_ids, top_lp, strict=True))
        return Sampled(token, logprob, top)

    def _topk_region(self, name: str, k: int) -> Region:
        base = self._regions[name]
        return Region(base.segment, base.offset, (1, k), base.dtype)

    async def stats(self) -> dict:
        reply = await self._worker().call(Stats())
        assert isinstance(reply, StatsReply)
        return dict(reply.stats)

    def describe(self) -> list[dict]:
        if self.worker is None:
            return []
        info = self.worker.describe()
        info["layers"] = [0, self.n_layers] if self.n_layers else None
        info["restarts"] = self.restarts
        return [info]
