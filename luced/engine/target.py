"""The daemon's handle on the target model: next tokens out of worker frames.

The engine asks for `prefill(prompt)` and `step(token)`; the runner turns those into
`forward` frames to the target's workers and keeps them alive. The target may be split
(``placement.py``): one worker per backend group, in layer order, each holding a
contiguous layer range as one or more shards (one per device). The engine never sees
the split. One forward of n tokens is a pipeline of frames::

    daemon                         worker 0 [0, a)          worker 1 [a, b) ... last [.., L)
    tokens -> io.tokens
    forward(tokens, want=hidden) -> embed, layers, write
                                   act.boundary-0, reply
    forward(hidden_in=boundary-0, tokens, want=hidden) ->  layers, write boundary-1, reply
    ...
    forward(hidden_in=boundary-(W-2), tokens, want=sample) ------------->  layers, norm, head,
                                                                           sample -> io.ids
    read io.ids / logprobs / top-k <- reply

Every worker also gets the token ids (its sampler history for penalties; only worker 0
embeds them) and, when captures are on, the capture list and the feature ring (see
``feature_ring.py``). Every shard keeps the KV of its own layers; the runner keeps all
of them at one committed position: a forward that fails part-way truncates the workers
that already advanced, `truncate` and `reset` go to every worker, and a worker restarted
after a crash starts empty, so the runner demands a `reset` before the next forward.

Segments ``<name>-io``, ``<name>-act``, ``<name>-ring`` (name "target" by default; created
by the daemon, attached by the workers, unlinked by the daemon)::

    io   tokens         int32   [max_batch_tokens]        daemon writes ids to feed
         ids            int32   [max_batch_tokens]        last worker: sampled / argmax ids
         logprobs       float32 [max_batch_tokens]        last worker: chosen-token logprobs
         topk_ids       int32   [max_batch_tokens * 20]   last worker: top-k ids (k <= 20)
         topk_logprobs  float32 [max_batch_tokens * 20]   last worker: their logprobs
    act  boundary-k     dtype   [max_batch_tokens, hidden]  worker k writes, worker k+1 reads
         project        dtype   [max_batch_tokens, hidden]  daemon writes (projection input)
         logits         float32 [logit_rows, vocab]         last worker writes
    ring (optional)     see feature_ring.py

``act`` is sized from the first load reply (hidden, vocab) and kept across restarts.
Write ordering: a region's writer writes before the frame (daemon) or before its reply
(worker); its reader reads only after that. Frames are sent one at a time, in order,
so each region has one writer at any moment and no locks are needed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from luced.cache.layout import TensorSpec
from luced.engine.executor import WorkerDied, WorkerError, WorkerHandle, WorkerSpec
from luced.engine.feature_ring import FeatureRing
from luced.engine.placement import WorkerPlan, check_interpreters, parse_device, plan_workers
from luced.ipc.frames import (
    DraftBlock,
    Forward,
    ForwardReply,
    KVExport,
    KVImport,
    KVLayout,
    KVLayoutReply,
    Load,
    LoadDraft,
    LoadDraftReply,
    Project,
    ProjectReply,
    Reset,
    Stats,
    StatsReply,
    Truncate,
)
from luced.ipc.regions import Attachments, Region, RegionAllocator, required_bytes, view
from luced.ipc.shm import Segment, ShmOwner

log = logging.getLogger(__name__)

MAX_TOP_LOGPROBS = 20
MAX_BLOCK = 64  # longest DFlash block a request may use


@dataclass(frozen=True)
class Sampled:
    token: int
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] = ()  # (id, logprob), most likely first


@dataclass(frozen=True)
class TargetPlacement:
    """The target model and where its layers run. Give ``worker`` (one worker holding every
    layer) or ``workers`` (the split, in layer order; see ``TargetPlacement.split``)."""

    model: str
    n_layers: int  # from the GGUF header, read by the daemon before any worker starts
    dtype: str
    kv_capacity: int
    max_batch_tokens: int
    worker: WorkerSpec | None = None
    workers: tuple[tuple[WorkerSpec, WorkerPlan], ...] = ()
    logit_rows: int = 16  # rows of the logits region (logits / projection outputs)

    def __post_init__(self) -> None:
        if not self.workers:
            if self.worker is None:
                raise ValueError("a placement needs worker or workers")
            w = self.worker
            plan = WorkerPlan(w.group, w.devices[:1], (0, self.n_layers), (), self.n_layers)
            object.__setattr__(self, "workers", ((w, plan),))

    @classmethod
    def split(
        cls,
        *,
        model: str,
        n_layers: int,
        dtype: str,
        kv_capacity: int,
        max_batch_tokens: int,
        devices: Sequence[str],
        weights: Sequence[float] = (),
        kv_sources: Mapping[int, int] | None = None,
        pythons: Mapping[str, str] | None = None,
        threads: int | None = None,
        cores: int = 1,
        logit_rows: int = 16,
    ) -> TargetPlacement:
        """--target-devices / --target-layer-split -> workers; raises PlacementError.
        `kv_sources` (the GGUF's KV-sharing layers) keeps sharing layers with their sources;
        `threads` None shares `cores` among the workers."""
        plans = plan_workers(devices, weights, n_layers, kv_sources)
        if threads is None:
            threads = max(1, cores // len(plans))
        pythons = dict(pythons or {})
        check_interpreters(plans, pythons)
        workers = []
        for p in plans:
            spec = WorkerSpec(p.group, p.devices, threads=threads)
            if p.group in pythons:
                spec = WorkerSpec(p.group, p.devices, python=pythons[p.group], threads=threads)
            workers.append((spec, p))
        return cls(
            model=model,
            n_layers=n_layers,
            dtype=dtype,
            kv_capacity=kv_capacity,
            max_batch_tokens=max_batch_tokens,
            workers=tuple(workers),
            logit_rows=logit_rows,
        )


class _Slot:
    """One worker of the pipeline: its fixed share, and whichever process serves it now.
    The draft's own worker (``plan`` None) is a slot outside the pipeline."""

    def __init__(self, index: int, spec: WorkerSpec, plan: WorkerPlan | None) -> None:
        self.index = index
        self.spec = spec
        self.plan = plan
        self.handle: WorkerHandle | None = None
        self.restarts = 0
        self.restart_task: asyncio.Task | None = None


class TargetRunner:
    def __init__(
        self,
        owner: ShmOwner,
        placement: TargetPlacement,
        on_state_change: Callable[[], None] | None = None,
        name: str = "target",  # segment name prefix: several runners may share one owner
    ) -> None:
        self.owner = owner
        self.name = name
        self.placement = placement
        self.on_state_change = on_state_change
        self.slots = [_Slot(i, s, p) for i, (s, p) in enumerate(placement.workers)]
        self.load_s = 0.0
        self.n_layers = 0
        self.hidden = 0
        self.vocab = 0
        self.ring: FeatureRing | None = None
        # Wall time of the last forward and the workers' compute time in it (µs): their
        # difference is the orchestration cost (frames, wakeups, waits).
        self.last_wall_us = 0
        self.last_compute_us = 0
        self._closing = False
        self._regions: dict[str, Region] = {}
        self._arrays: dict[str, np.ndarray] = {}
        self._position = 0
        self._ring_floor = 0  # no ring row below this position is valid (after a restore)
        # KV snapshots: each worker's tensors (fixed by its plan, so asked once) and the
        # snapshot arena's mapping here (for the ring rows), kept for the runner's life.
        self._kv_specs: list[list[TensorSpec]] | None = None
        self._snapshot_maps = Attachments()
        self._in_sync = True  # False after a worker restart: every shard must reset
        self.draft: LoadDraftReply | None = None  # the DFlash draft, when one is loaded
        self._draft_path: str | None = None
        self._draft_device = ""
        self.draft_slot: _Slot | None = None  # the draft's own worker, when it has one

    # -- lifecycle -----------------------------------------------------------------------

    @property
    def worker(self) -> WorkerHandle | None:
        """The first worker (the only one when the target is not split)."""
        return self.slots[0].handle

    @property
    def restarts(self) -> int:
        return sum(s.restarts for s in self.slots)

    @property
    def ready(self) -> bool:
        return all(s.handle is not None and s.handle.state == "ready" for s in self._all_slots())

    def _all_slots(self) -> list[_Slot]:
        return [*self.slots, *([self.draft_slot] if self.draft_slot else [])]

    @property
    def position(self) -> int:
        return self._position

    async def start(self) -> None:
        """Start and load every worker (concurrently), then carve the shared regions."""
        self._make_io()
        results = await asyncio.gather(
            *(self._start_worker(s) for s in self.slots), return_exceptions=True
        )
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise errors[0]
        self._make_act()

    def _carve(self, name: str, specs: dict[str, tuple[list[int], str]]) -> Segment:
        segment = self.owner.create(f"{self.name}-{name}", required_bytes(specs.values()))
        alloc = RegionAllocator.for_segment(segment)
        for key, (shape, dtype) in specs.items():
            region = alloc.alloc(key, shape, dtype)
            self._regions[key] = region
            self._arrays[key] = view(segment, region)
        return segment

    def _make_io(self) -> None:
        n = self.placement.max_batch_tokens
        self._carve(
            "io",
            {
                "tokens": ([n], "int32"),
                "ids": ([n], "int32"),
                "logprobs": ([n], "float32"),
                "topk_ids": ([n * MAX_TOP_LOGPROBS], "int32"),
                "topk_logprobs": ([n * MAX_TOP_LOGPROBS], "float32"),
            },
        )

    def _make_act(self) -> None:
        n, dt = self.placement.max_batch_tokens, self.placement.dtype
        specs = {f"boundary-{k}": ([n, self.hidden], dt) for k in range(len(self.slots) - 1)}
        specs["project"] = ([n, self.hidden], dt)
        specs["logits"] = ([self.placement.logit_rows, self.vocab], "float32")
        self._carve("act", specs)

    async def _start_worker(self, slot: _Slot) -> LoadDraftReply | None:
        """Start and load one worker; the draft's own worker answers its draft's reply."""
        p, plan = self.placement, slot.plan
        worker = WorkerHandle(slot.spec, self.owner.instance, on_exit=self._exit_handler(slot))
        slot.handle = worker
        self._notify()
        await worker.start()
        if plan is None:  # the draft's own worker: the draft and the target's edges only
            reply = await self._load_draft_into(worker, target=p.model)
            self._notify()
            return reply
        reply = await worker.load(
            Load(
                model=p.model,
                layers=plan.layers,
                dtype=p.dtype,  # type: ignore[arg-type]
                devices=plan.devices,
                kv_capacity=p.kv_capacity,
                owns_embed=plan.owns_embed,
                owns_head=plan.owns_head,
                device_splits=plan.device_splits,
            )
        )
        self.load_s = max(self.load_s, reply.load_s)
        self.n_layers, self.hidden, self.vocab = reply.n_layers, reply.hidden, reply.vocab
        if self._draft_path is not None and self.draft_slot is None:
            await self._load_draft_into(worker)  # a restarted worker gets its draft back
        self._notify()
        return None

    def _notify(self) -> None:
        if self.on_state_change is not None:
            self.on_state_change()

    def _exit_handler(self, slot: _Slot) -> Callable[[WorkerHandle, int], None]:
        def on_exit(worker: WorkerHandle, code: int) -> None:
            if slot.plan is not None:  # (the draft keeps no state across calls)
                self._in_sync = False  # the survivors' KV no longer matches the restarted one
            self._notify()
            if not self._closing and slot.restart_task is None and worker is slot.handle:
                loop = asyncio.get_running_loop()
                slot.restart_task = loop.create_task(self._restart(slot))

        return on_exit

    async def _restart(self, slot: _Slot) -> None:
        """Replace one dead worker with the same share; the others keep their weights."""
        delay = 0.5
        try:
            while not self._closing:
                slot.restarts += 1
                share = (
                    "the draft"
                    if slot.plan is None
                    else "layers [{}, {})".format(*slot.plan.layers)
                )
                log.warning(
                    "restarting worker %s, %s (restart #%d)", slot.spec.group, share, slot.restarts
                )
                try:
                    await self._start_worker(slot)
                    return
                except Exception as exc:  # keep trying: a transient failure must not stick
                    log.error("worker restart failed: %s", exc)
                    if slot.handle is not None:
                        await slot.handle.stop()
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 30.0)
        finally:
            slot.restart_task = None

    async def close(self) -> None:
        self._closing = True
        slots = self._all_slots()
        for slot in slots:
            if slot.restart_task is not None:
                slot.restart_task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await slot.restart_task
        await asyncio.gather(*(s.handle.stop() for s in slots if s.handle is not None))
        self._snapshot_maps.close()

    def _workers(self) -> list[WorkerHandle]:
        handles = [s.handle for s in self.slots]
        for slot, h in zip(self.slots, handles, strict=True):
            if h is None or h.state != "ready":
                raise WorkerDied(f"the model worker {slot.spec.group} is not ready")
        return handles  # type: ignore[return-value]

    # -- KV position ---------------------------------------------------------------------

    async def reset(self) -> None:
        await asyncio.gather(*(w.call(Reset()) for w in self._workers()))
        self._position = 0
        self._ring_floor = 0
        self._in_sync = True

    async def truncate(self, position: int) -> None:
        """Roll every shard's KV back to `position` committed tokens."""
        if not 0 <= position <= self._position:
            raise ValueError(f"cannot truncate to {position}: {self._position} are committed")
        await asyncio.gather(*(w.call(Truncate(position=position)) for w in self._workers()))
        self._position = position

    # -- captures ------------------------------------------------------------------------

    def enable_capture(
        self, layers: Sequence[int], ring_cap: int, dtype: str = "float32"
    ) -> FeatureRing:
        """Create the feature ring; from now on every forward captures `layers` into it."""
        if self.ring is not None:
            raise RuntimeError("captures are already enabled")
        if not self.hidden:
            raise RuntimeError("start the runner first (the ring width is the model's)")
        bad = [layer for layer in layers if not 0 <= layer < self.n_layers]
        if bad:
            raise ValueError(f"capture layers {bad} outside the model's {self.n_layers} layers")
        ring = FeatureRing(
            self.owner, tuple(layers), ring_cap, self.hidden, dtype, f"{self.name}-ring"
        )
        self.ring = ring
        return self.ring

    # -- DFlash draft -------------------------------------------------------------------

    async def load_draft(
        self,
        path: str,
        device: str | None = None,
        ring_cap: int = 4096,
        block_size: int = 16,
        python: str | None = None,
    ) -> LoadDraftReply:
        """Load the draft and start capturing its feature layers into the ring.

        The draft embeds its block and projects its output with the target's embedding and
        head. It joins the target's worker when that worker holds both (an unsplit target)
        and `device` is None or one of that worker's devices; otherwise it gets a worker of
        its own on `device` (default: the head's device), which loads the target's
        embedding and head beside it. Either way it reads the ring in place.
        """
        if not 2 <= block_size <= MAX_BLOCK:
            raise ValueError(f"block size {block_size} outside [2, {MAX_BLOCK}]")
        self._draft_path = path
        first = self.slots[0]
        assert first.plan is not None
        if device is None and len(self.slots) == 1:
            device = first.plan.devices[0]
        device = device or self.slots[-1].plan.devices[-1]  # type: ignore[union-attr]
        group = parse_device(device)[1]
        self._draft_device = device
        if len(self.slots) == 1 and device in first.plan.devices and group == first.spec.group:
            reply = await self._load_draft_into(self._workers()[0])
        else:
            spec = WorkerSpec(
                group, (device,), python=python or first.spec.python, threads=first.spec.threads
            )
            self.draft_slot = _Slot(len(self.slots), spec, None)
            started = await self._start_worker(self.draft_slot)
            assert started is not None
            reply = started
        if reply.mask_token_id is None:
            raise ValueError(f"{path}: the draft config names no mask_token_id")
        self.draft = reply
        self.enable_capture(reply.capture_layers, min(ring_cap, self.placement.kv_capacity))
        rows = block_size - 1
        self._carve(
            "draft",
            {"draft_ids": ([block_size], "int32"), "draft_probs": ([rows, self.vocab], "float32")},
        )
        return reply

    async def _load_draft_into(
        self, worker: WorkerHandle, target: str | None = None
    ) -> LoadDraftReply:
        return await worker.load_draft(
            LoadDraft(
                path=str(self._draft_path),
                dtype=self.placement.dtype,  # type: ignore[arg-type]
                device=self._draft_device,
                target=target,
            )
        )

    def _draft_worker(self) -> WorkerHandle:
        if self.draft_slot is None:
            return self._workers()[0]
        h = self.draft_slot.handle
        if h is None or h.state != "ready":
            raise WorkerDied(f"the draft worker {self.draft_slot.spec.group} is not ready")
        return h

    async def draft_block(
        self, anchor: int, block_size: int, sampling: dict | None = None
    ) -> list[int]:
        """[anchor, proposal 1, ..., proposal B-1] from the draft, conditioned on the ring's
        features of the committed positions. Greedy proposals, or with a sampling map at
        temperature > 0 drawn from the draft's distributions q, which stay in the
        ``draft_probs`` region for ``verify_sampled``."""
        assert self.draft is not None and self.ring is not None
        limit = self._regions["draft_ids"].shape[0]
        if not 2 <= block_size <= limit:
            raise ValueError(f"block size {block_size} outside [2, {limit}]")
        outputs = {"ids": self._regions["draft_ids"].rows(0, block_size)}
        sampling = sampling or {}
        if sampling and sampling.get("temperature", 1.0) != 0:  # as DraftBlock.sampled
            outputs["probs"] = self._regions["draft_probs"].rows(0, block_size - 1)
        await self._draft_worker().call(
            DraftBlock(
                ring=self.ring.region,
                committed=self._position,
                anchor=anchor,
                outputs=outputs,
                block_size=block_size,
                mask_token_id=self.draft.mask_token_id,
                # A verify feeds up to B positions past the committed ones and rolls back:
                # their slots overwrote the oldest B rows of the ring, so those stay unread;
                # nor are rows below the floor a restored snapshot left valid.
                ctx_window=max(
                    1, min(self.ring.ring_cap - block_size, self._position - self._ring_floor)
                ),
                sampling=sampling,
            )
        )
        return self._arrays["draft_ids"][:block_size].tolist()

    async def verify(
        self, block: list[int], sampling: dict | None = None, logprobs: int | None = None
    ) -> list[Sampled]:
        """Feed the block; the target's greedy next token after each of its positions (row i
        penalized with its own history when `sampling` has penalties), with logprobs."""
        n, k = len(block), min(logprobs or 0, MAX_TOP_LOGPROBS)
        greedy = {**(sampling or {}), "temperature": 0.0}
        outputs = self._row_outputs(n, logprobs)
        await self._forward(
            block, "sample", outputs, positions="all", sampling=greedy, top_logprobs=k
        )
        return self._read_rows(n, outputs)

    async def verify_sampled(
        self, block: list[int], sampling: dict, logprobs: int | None = None
    ) -> tuple[list[Sampled], int]:
        """Feed a block drafted with `sampling`; the head's worker accepts or rejects its
        proposals against the draft's q (rejection sampling with the request's generator).
        Returns (the step's tokens: accepted proposals + the target's own, accepted)."""
        n, k = len(block), min(logprobs or 0, MAX_TOP_LOGPROBS)
        outputs = self._row_outputs(n, logprobs)
        q = self._regions["draft_probs"].rows(0, n - 1)
        reply = await self._forward(
            block,
            "verify",
            outputs,
            positions="all",
            sampling=sampling,
            top_logprobs=k,
            draft_probs=q,
        )
        assert reply.accepted is not None
        return self._read_rows(reply.accepted + 1, outputs), reply.accepted

    # -- forwards ------------------------------------------------------------------------

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
            sampled = await self._sample(piece, sampling, logprobs, sample=last)
        return sampled

    async def step(self, token: int, sampling: dict, logprobs: int | None) -> Sampled:
        """Feed one token, sample the next. logprobs: None, or k = chosen + top k."""
        sampled = await self._sample([token], sampling, logprobs, sample=True)
        assert sampled is not None
        return sampled

    async def logits(self, ids: list[int]) -> np.ndarray:
        """Feed ids (at most logit_rows); a copy of every position's logits [n, vocab]."""
        n = len(ids)
        if not 0 < n <= self.placement.logit_rows:
            raise ValueError(f"logits for 1..{self.placement.logit_rows} tokens, got {n}")
        out = {"logits": self._regions["logits"].rows(0, n)}
        await self._forward(ids, "logits", out, positions="all")
        return self._arrays["logits"][:n].copy()

    async def _sample(
        self, ids: list[int], sampling: dict, logprobs: int | None, sample: bool
    ) -> Sampled | None:
        outputs = self._row_outputs(1, logprobs)
        k = min(logprobs or 0, MAX_TOP_LOGPROBS)
        await self._forward(ids, "sample", outputs, sampling=sampling, top_logprobs=k)
        return self._read_rows(1, outputs)[0] if sample else None

    def _row_outputs(self, n: int, logprobs: int | None) -> dict[str, Region]:
        """Output regions for n rows of ids, and logprobs + top k when asked."""
        outputs = {"ids": self._regions["ids"].rows(0, n)}
        k = min(logprobs or 0, MAX_TOP_LOGPROBS)
        if logprobs is not None:
            outputs["logprobs"] = self._regions["logprobs"].rows(0, n)
        if k:
            outputs["topk_ids"] = self._topk_region("topk_ids", n, k)
            outputs["topk_logprobs"] = self._topk_region("topk_logprobs", n, k)
        return outputs

    def _read_rows(self, n: int, outputs: dict[str, Region]) -> list[Sampled]:
        """The first n rows the last worker wrote into `outputs`."""
        ids = self._arrays["ids"][:n].tolist()
        if "logprobs" not in outputs:
            return [Sampled(t) for t in ids]
        lps = self._arrays["logprobs"][:n].tolist()
        k = outputs["topk_ids"].shape[1] if "topk_ids" in outputs else 0
        top_ids = self._arrays["topk_ids"][: n * k].reshape(n, k).tolist()
        top_lps = self._arrays["topk_logprobs"][: n * k].reshape(n, k).tolist()
        return [
            Sampled(t, lp, tuple(zip(ti, tl, strict=True)))
            for t, lp, ti, tl in zip(ids, lps, top_ids, top_lps, strict=True)
        ]

    async def _forward(
        self,
        ids: list[int],
        want: str,
        outputs: dict[str, Region],
        positions: str = "last",
        sampling: dict | None = None,
        top_logprobs: int = 0,
        draft_probs: Region | None = None,
    ) -> ForwardReply:
        """One pipeline pass of `ids` through every worker; outputs from the last one."""
        workers = self._workers()
        if not self._in_sync:
            raise WorkerDied("a model worker was restarted; the request must start over")
        t0 = time.perf_counter()
        start, n = self._position, len(ids)
        self._arrays["tokens"][:n] = ids
        tokens = self._regions["tokens"].rows(0, n)
        capture = {}
        if self.ring is not None:
            capture = {"capture": self.ring.layers, "ring": self.ring.region}
        advanced: list[WorkerHandle] = []
        compute_us = 0
        try:
            for k, worker in enumerate(workers):
                last = k == len(workers) - 1
                frame = Forward(
                    n_tokens=n,
                    start_pos=start,
                    want=want if last else "hidden",  # type: ignore[arg-type]
                    outputs=outputs if last else {"hidden": self._boundary(k, n)},
                    tokens=tokens,
                    hidden_in=self._boundary(k - 1, n) if k else None,
                    positions=positions if last else "last",  # type: ignore[arg-type]
                    sampling=(sampling or {}) if last else {},
                    top_logprobs=top_logprobs if last else 0,
                    draft_probs=draft_probs if last else None,
                    **capture,
                )
                reply = await worker.call(frame)
                assert isinstance(reply, ForwardReply)
                advanced.append(worker)
                compute_us += reply.elapsed_us
                if reply.position != start + n:
                    raise WorkerError(
                        f"worker {worker.spec.group} is at position {reply.position}, "
                        f"expected {start + n}: the shards disagree"
                    )
        except BaseException:
            # Keep the shards agreeing: undo this forward where it already happened.
            for worker in advanced:
                with contextlib.suppress(Exception):
                    await worker.call(Truncate(position=start))
            raise
        self._position = start + n
        self.last_wall_us = int((time.perf_counter() - t0) * 1e6)
        self.last_compute_us = compute_us
        return reply

    def _boundary(self, k: int, n: int) -> Region:
        return self._regions[f"boundary-{k}"].rows(0, n)

    def _topk_region(self, name: str, n: int, k: int) -> Region:
        """n rows of k, packed (the region is max_batch_tokens * MAX_TOP_LOGPROBS long)."""
        base = self._regions[name]
        return Region(base.segment, base.offset, (n, k), base.dtype)

    async def project(self, hidden: np.ndarray, want: str = "logits") -> np.ndarray:
        """Final norm + LM head of the head's worker over hidden [n, hidden] (no KV change):
        a copy of the logits [n, vocab] (n <= logit_rows) or argmax ids [n] (n <= max_batch)."""
        worker = self._workers()[-1]
        n = hidden.shape[0]
        limit = self.placement.logit_rows if want == "logits" else self.placement.max_batch_tokens
        if hidden.ndim != 2 or hidden.shape[1] != self.hidden or not 0 < n <= limit:
            raise ValueError(f"project takes [1..{limit}, {self.hidden}], got {list(hidden.shape)}")
        region = self._regions["project"].rows(0, n)
        self._arrays["project"][:n] = hidden  # numpy casts to the region dtype
        name = "logits" if want == "logits" else "ids"
        out = {name: self._regions[name].rows(0, n)}
        frame = Project(n_tokens=n, hidden=region, want=want, outputs=out)  # type: ignore[arg-type]
        reply = await worker.call(frame)
        assert isinstance(reply, ProjectReply)
        return self._arrays[name][:n].copy()

    # -- status --------------------------------------------------------------------------

    async def stats(self) -> dict:
        """The first worker's stats, plus every worker's under "workers"."""
        replies = await asyncio.gather(*(w.call(Stats()) for w in self._workers()))
        per = [dict(r.stats) for r in replies if isinstance(r, StatsReply)]
        return {**per[0], "workers": per}

    def describe(self) -> list[dict]:
        """One entry per shard: group, devices, layer range, worker pid and state."""
        out = []
        for slot in self.slots:
            if slot.handle is None:
                continue
            assert slot.plan is not None
            info = slot.handle.describe()
            for device, layers in zip(slot.plan.devices, slot.plan.shard_ranges(), strict=True):
                shard = dict(info)
                shard["devices"] = [device]
                shard["layers"] = list(layers)
                shard["restarts"] = slot.restarts
                out.append(shard)
        d = self.draft_slot
        if d is not None and d.handle is not None:
            info = {**d.handle.describe(), "devices": list(d.spec.devices), "layers": "draft"}
            out.append({**info, "role": "draft", "restarts": d.restarts})
        return out

    # -- KV snapshots --------------------------------------------------------------------
    #
    # A snapshot of the target at n tokens (prefix cache, DESIGN §6) is one region per
    # TensorSpec of `kv_layout`, in a daemon-owned segment (the arena), n along the token
    # axis (or more: a longer snapshot restores any shorter prefix):
    #
    #   "k.{l}", "v.{l}"  [Hkv, >= n, D]  cache dtype   exported / imported by the worker
    #                                                   holding layer l (frames kv_export /
    #                                                   kv_import), all workers concurrently
    #   "ring"            [>= n, n_capture, hidden]     copied here with numpy, from / to
    #                                                   the feature ring (captures on only)
    #
    # Ring rows: the ring holds the last ring_cap positions, so a snapshot carries ring rows
    # only for its positions [max(0, n - ring_cap), n); rows before that are left as they
    # were (a restore of a prefix m must not trust ring rows below n - ring_cap). And slot
    # p % ring_cap holds position p only until a later position p + k * ring_cap is fed,
    # even one rolled back since: with h the highest position fed (exclusive) since p was,
    # ring row p is right iff p >= h - ring_cap. Export right after the forward that reached
    # n (h == n) and every exported ring row is right; exporting n < h copies stale rows.

    async def kv_layout(self) -> list[TensorSpec]:
        """Every tensor of a snapshot: each worker's K/V in layer order, then the ring."""
        per_worker = await self._kv_layouts()
        return [spec for specs in per_worker for spec in specs] + self._ring_spec()

    async def export_kv(self, n: int, regions: dict[str, Region]) -> None:
        """Copy the snapshot of positions [0, n) (n <= position) into `regions`, one per
        spec of `kv_layout`. Nothing is written before every region checked out; when a
        worker fails the others have finished too (the regions are free again) and the
        first error is raised. The KV is never changed."""
        if not self._in_sync:
            raise WorkerDied("a model worker was restarted; its KV is gone")
        if not 0 <= n <= self._position:
            raise ValueError(f"cannot export {n} positions: {self._position} are committed")
        per_worker = await self._kv_layouts()
        self._check_snapshot(per_worker, regions, n)
        frames = [
            KVExport(position=n, regions={s.name: regions[s.name] for s in specs})
            for specs in per_worker
        ]
        await self._kv_call(frames)
        if self.ring is not None:
            self._copy_ring(regions["ring"], n, into_ring=False)

    async def import_kv(self, n: int, regions: dict[str, Region], tokens: Region) -> None:
        """Restore positions [0, n) from a snapshot (its token axis may be longer than n);
        `tokens` (int32 [>= n]) are the ids at those positions (the workers' history for
        penalties). All or nothing: regions are checked first (a bad one changes nothing);
        if a worker fails after that, every worker is reset, position 0, and the first
        error is raised. Also restores the ring's slots of [max(0, n - ring_cap), n)."""
        if not 0 <= n <= self.placement.kv_capacity:
            cap = self.placement.kv_capacity
            raise ValueError(f"cannot import {n} positions into a KV of {cap}")
        if tokens.dtype != "int32" or len(tokens.shape) != 1 or tokens.shape[0] < n:
            raise ValueError(f"tokens must be int32 [>= {n}], got {tokens.dtype} {tokens.shape}")
        per_worker = await self._kv_layouts()
        self._check_snapshot(per_worker, regions, n)
        frames = [
            KVImport(position=n, regions={s.name: regions[s.name] for s in specs}, tokens=tokens)
            for specs in per_worker
        ]
        self._in_sync = False  # the shards may disagree until every one has imported
        try:
            await self._kv_call(frames)
            if self.ring is not None:
                self._copy_ring(regions["ring"], n, into_ring=True)
        except BaseException:
            self._position = 0
            with contextlib.suppress(Exception):
                await self.reset()  # in sync again (empty) unless a worker is gone
            raise
        self._position = n
        self._in_sync = True
        if self.ring is not None:
            # A snapshot of N positions holds valid ring rows only from N - ring_cap on.
            self._ring_floor = max(0, regions["ring"].shape[0] - self.ring.ring_cap)

    async def _kv_layouts(self) -> list[list[TensorSpec]]:
        """Each worker's K/V specs, in pipeline order (asked once: a worker restarted
        later serves the same layers in the same dtype)."""
        if self._kv_specs is None:
            replies = await asyncio.gather(*(w.call(KVLayout()) for w in self._workers()))
            out = []
            for reply in replies:
                assert isinstance(reply, KVLayoutReply)
                specs = [TensorSpec(nm, (h, 1, d), reply.dtype, 1) for nm, h, d in reply.tensors]
                out.append(specs)
            self._kv_specs = out
        return self._kv_specs

    def _ring_spec(self) -> list[TensorSpec]:
        if self.ring is None:
            return []
        shape = (1, len(self.ring.layers), self.ring.hidden)
        return [TensorSpec("ring", shape, self.ring.region.dtype, token_axis=0)]

    async def _kv_call(self, frames: list[KVExport] | list[KVImport]) -> None:
        """One frame per worker, concurrently; waits for all, then raises the first error."""
        calls = (w.call(f) for w, f in zip(self._workers(), frames, strict=True))
        results = await asyncio.gather(*calls, return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise r

    def _check_snapshot(
        self, per_worker: list[list[TensorSpec]], regions: Mapping[str, Region], n: int
    ) -> None:
        specs = [s for specs in per_worker for s in specs] + self._ring_spec()
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
            ok = len(r.shape) == len(spec.shape) and r.dtype == spec.dtype and r.shape[axis] >= n
            if not ok or spec.shape_for(r.shape[axis]) != r.shape:
                want = list(spec.shape_for(n))
                raise ValueError(
                    f"snapshot region {spec.name} must be {spec.dtype} {want} (or longer on "
                    f"axis {axis}), got {r.dtype} {list(r.shape)}"
                )
            if not r.segment.startswith(f"/luced-{self.owner.instance}-"):
                raise ValueError(f"snapshot region {spec.name} is not in this daemon's memory")

    def _copy_ring(self, region: Region, n: int, into_ring: bool) -> None:
        """Ring slots of positions [max(0, n - ring_cap), n) <-> the same rows of `region`."""
        assert self.ring is not None
        ring, cap = self.ring.array, self.ring.ring_cap
        rows = self._snapshot_maps.view(region)  # the arena: mapped on first use
        p = max(0, n - cap)
        while p < n:  # at most two runs: the slots wrap once
            slot = p % cap
            k = min(n - p, cap - slot)
            if into_ring:
                ring[slot : slot + k] = rows[p : p + k]
            else:
                rows[p : p + k] = ring[slot : slot + k]
            p += k
        del rows  # no view may outlive the mapping, which close() unmaps
