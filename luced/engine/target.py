"""The daemon's handle on the target model: next tokens out of worker frames.

The engine asks for `prefill(prompt)` and `step(token)`; the target turns those into
`forward` frames to its workers (``executor.py`` keeps them alive). The target may be split
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
``feature_ring.py``). Every shard keeps the KV of its own layers; the target keeps all
of them at one committed position: a forward that fails part-way truncates the workers
that already advanced, `truncate` and `reset` go to every worker, and a worker restarted
after a crash starts empty, so the target demands a `reset` before the next forward.

Segments ``<name>-io``, ``<name>-act``, ``<name>-ring`` (name "target" by default; created
by the daemon, attached by the workers, unlinked by the daemon)::

    io   tokens         int32   [max_batch_tokens]        daemon writes ids to feed
         ids            int32   [max_batch_tokens]        last worker: sampled / argmax ids
         logprobs       float32 [max_batch_tokens]        last worker: chosen-token logprobs
         topk_ids       int32   [max_batch_tokens * 20]   last worker: top-k ids (k <= 20)
         topk_logprobs  float32 [max_batch_tokens * 20]   last worker: their logprobs
    act  boundary-k     dtype   [max_batch_tokens, hidden]  worker k writes, worker k+1 reads
         logits         float32 [logit_rows, vocab]         last worker writes
         allowed        int32   [MAX_BLOCK, ceil(vocab/32)] daemon writes a grammar's masks
                                                            (a bit per id, constraint.py)
    ring (optional)     see feature_ring.py

With KV Flash (`kv_flash`), the workers hold a fixed pool of K/V rows and the target's
pager (``kvflash/transport.py``: segments ``<name>-kvflash``, ``<name>-kvhost``) plans
every forward before its first frame; each frame names the same plan. A prompt longer
than the pool is prefilled in steps the pool can hold, evicting as it goes.

``act`` is sized from the first load reply (hidden, vocab) and kept across restarts.
Write ordering: a region's writer writes before the frame (daemon) or before its reply
(worker); its reader reads only after that. Frames are sent one at a time, in order,
so each region has one writer at any moment and no locks are needed.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from luced.cache.layout import TensorSpec
from luced.engine.executor import (
    Deadlines,
    Executor,
    Slot,
    WorkerDied,
    WorkerHandle,
    WorkerReplyError,
)
from luced.engine.experts import ExpertWorker
from luced.engine.feature_ring import FeatureRing
from luced.engine.kv_transfer import KVTransfer
from luced.engine.kvflash.pager import PagerConfig
from luced.engine.kvflash.transport import KVFlash
from luced.engine.placement import TargetPlacement, WorkerSpec, parse_device
from luced.ipc.frames import (
    DraftBlock,
    Forward,
    ForwardBatch,
    ForwardBatchReply,
    ForwardReply,
    KVShare,
    KVShareReply,
    Load,
    LoadDraft,
    LoadDraftReply,
    Reset,
    Stats,
    StatsReply,
    Truncate,
)
from luced.ipc.regions import Region, RegionAllocator, required_bytes, view
from luced.ipc.shm import Segment, ShmOwner

log = logging.getLogger(__name__)

# DFlash rollback of a recurrent state (a hybrid target): "select" keeps the state after
# each position of a verify block (the recurrent form) and a cut inside it picks the
# accepted one; "replay" rewinds to the block's start and re-feeds the accepted tokens (one
# more forward per rejected block). tools/bench_dflash.py --rollback measures both.
ROLLBACK = "select"

MAX_TOP_LOGPROBS = 20
MAX_BLOCK = 64  # longest DFlash block a request may use


@dataclass(frozen=True)
class Sampled:
    token: int
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] = ()  # (id, logprob), most likely first


# The lane (sequence) a task's single-sequence calls act on; `Target.bind_lane` sets it.
LANE: contextvars.ContextVar[int] = contextvars.ContextVar("luced_lane", default=0)

_M = TypeVar("_M", bound=Callable[..., Awaitable[Any]])


def _on_lane(method: _M) -> _M:
    """The method runs holding the io regions for the caller's lane (`Target.holding`)."""

    @functools.wraps(method)
    async def run(self: Target, *args: Any, **kwargs: Any) -> Any:
        async with self.holding():
            return await method(self, *args, **kwargs)

    return run  # type: ignore[return-value]


@dataclass
class _Lane:
    """One sequence's daemon-side state (see `Target.lane`)."""

    position: int = 0
    last_fed: tuple[int, list[int]] = field(default_factory=lambda: (0, []))  # its last forward
    last_block_states: bool = False
    ring_floor: int = 0


def _trimmed(sampled: Sampled, logprobs: int | None) -> Sampled:
    """A batch row as the sequence's own step reports it: logprobs only when asked, and its
    own top k (the batch computed the largest k any sequence asked)."""
    if logprobs is None:
        return Sampled(sampled.token)
    return dataclasses.replace(sampled, top=sampled.top[:logprobs])


@dataclass(frozen=True)
class BatchStep:
    """One sequence's decode step in `Target.step_batch`."""

    sequence: int
    token: int  # fed at the sequence's position
    sampling: dict = field(default_factory=dict)
    logprobs: int | None = None  # None, or k: the chosen token's and the top k
    # A grammar's mask writer (Constraint.fill): called with the step's row of
    # `token_masks` while the batch holds the workers.
    fill: Callable[[int], None] | None = None
    # A greedy verify block's proposals, fed after `token`: the step then samples a
    # token after every row of the block (`Target.verify`'s rows), not only the last.
    proposals: tuple[int, ...] = ()


class Target:
    """The target model behind its workers: the shared regions, the forward pipeline,
    the committed position, the draft; the engine's only handle on the model.

    Sequences (continuous batching): the workers hold several, by id. The methods that act
    on one sequence (reset, prefill, step, truncate, the KV transfers...) act on the lane
    selected by `lane(sequence)`, sequence 0 outside one; `step_batch` steps several in
    one pass."""

    def __init__(
        self,
        owner: ShmOwner,
        placement: TargetPlacement,
        on_state_change: Callable[[], None] | None = None,
        name: str = "target",  # segment name prefix: several targets may share one owner
        kv_flash: PagerConfig | None = None,  # pool rows and policy; chunk_bytes filled in
        deadlines: Deadlines | None = None,  # of worker calls and starts (default: Deadlines())
    ) -> None:
        self.owner = owner
        self.flash_cfg = kv_flash
        # The selected lane's KV Flash pager (each lane pages its own pool; made on the
        # lane's first use once the target has started).
        self.flash: KVFlash | None = None
        self._flashes: dict[int, KVFlash] = {}
        self._flash_make: Callable[[str], KVFlash] | None = None
        self._record_bytes: dict[tuple[int, int], int] = {}  # worker layers -> host record
        self.name = name
        self.placement = placement
        self.executor = Executor(
            owner.instance,
            placement.workers,
            self._load,
            on_state_change,
            deadlines or Deadlines(),
            inboxes=placement.moe_expert is not None,
        )
        self.experts = (
            ExpertWorker(owner, name, placement, self.executor) if placement.moe_expert else None
        )
        self.kv = KVTransfer(self.executor, owner.instance)
        self.load_s = 0.0
        self.n_layers = 0
        self.hidden = 0
        self.vocab = 0
        # The selected lane's feature ring (DFlash captures): each lane has its own, made
        # when the lane is first selected once captures are on (`enable_capture`).
        self.ring: FeatureRing | None = None
        self._rings: dict[int, FeatureRing] = {}
        self._capture: tuple[tuple[int, ...], int, str] | None = None  # layers, cap, dtype
        # Wall time of the last forward and the workers' compute time in it (µs): their
        # difference is the orchestration cost (frames, wakeups, waits).
        self.last_wall_us = 0
        self.last_compute_us = 0
        self._regions: dict[str, Region] = {}
        self._arrays: dict[str, np.ndarray] = {}
        self._position = 0
        # Recurrent layers of each pipeline worker's load, by its layer range: a model with
        # any is rolled back by rewinding to the last forward's start and replaying.
        self._recurrent: dict[tuple[int, int], tuple[int, ...]] = {}
        self._last_fed: tuple[int, list[int]] = (0, [])  # (start, ids) of the last forward
        self._last_block_states = False  # it kept a recurrent state per position
        # How a DFlash verify's rejected suffix leaves a recurrent state (see `truncate`).
        self.rollback: str = ROLLBACK
        self._ring_floor = 0  # no ring row below this position is valid (after a restore)
        self.draft: LoadDraftReply | None = None  # the DFlash draft, when one is loaded
        self._draft_path: str | None = None
        self._draft_device = ""
        self._point_mass_rows = 0  # q rows set_point_mass_q last wrote
        self.lane_id = 0  # the lane whose state the fields below hold
        self._lanes: dict[int, _Lane] = {}  # the other sequences' state, while not selected
        self._lane_lock = asyncio.Lock()
        self._holder: asyncio.Task | None = None  # the task holding `_lane_lock`

    # -- lifecycle -----------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return self.executor.ready

    @property
    def restart_error(self) -> str | None:
        """Why a dead worker could not be started again (it is retried with backoff)."""
        return self.executor.restart_error

    def watch(self, callback: Callable[[], None]) -> None:
        """Call `callback` (in place of the constructor's) whenever a worker starts, is
        loaded, dies or fails to restart."""
        self.executor.on_state_change = callback

    @property
    def position(self) -> int:
        """The calling task's lane's committed position."""
        return self.lane_position(LANE.get())

    async def start(self) -> None:
        """Start and load every worker (concurrently), then carve the shared regions."""
        self._make_io()
        if self.experts is not None:
            self.experts.carve()
            await self.experts.start()  # first: the pipeline workers link as they load
        await self.executor.start()
        self._make_act()
        if self.flash_cfg is not None:
            self._make_flash(self.flash_cfg)

    def _make_flash(self, cfg: PagerConfig) -> None:
        records = [
            self._record_bytes[s.plan.layers] for s in self.executor.slots if s.plan is not None
        ]
        cfg = dataclasses.replace(cfg, chunk_bytes=sum(records))
        p = self.placement
        max_step = max(p.max_batch_tokens, p.logit_rows, MAX_BLOCK)
        self._flash_make = functools.partial(
            KVFlash, self.owner, cfg=cfg, capacity=p.kv_capacity, max_step=max_step,
            record_bytes=records,
        )  # fmt: skip
        self.flash = self._lane_flash(self.lane_id)

    def _lane_flash(self, sequence: int) -> KVFlash | None:
        """`sequence`'s KV Flash pager and plan segments, made on first use (None without
        KV Flash). A lane keeps them for the requests that follow in it (reset between)."""
        if self._flash_make is None:
            return None
        flash = self._flashes.get(sequence)
        if flash is None:
            name = self.name + (f"-lane{sequence}" if sequence else "")
            flash = self._flashes[sequence] = self._flash_make(name=name)
        return flash

    async def close(self) -> None:
        await self.executor.close()
        self.kv.close()

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
                "batch": ([n, 4], "int32"),  # forward_batch: (sequence, start, n, n_out) rows
                "ids": ([n], "int32"),
                "logprobs": ([n], "float32"),
                "topk_ids": ([n * MAX_TOP_LOGPROBS], "int32"),
                "topk_logprobs": ([n * MAX_TOP_LOGPROBS], "float32"),
            },
        )

    def _make_act(self) -> None:
        n, dt = self.placement.max_batch_tokens, self.placement.dtype
        n_boundaries = len(self.executor.slots) - 1
        specs = {f"boundary-{k}": ([n, self.hidden], dt) for k in range(n_boundaries)}
        specs["logits"] = ([self.placement.logit_rows, self.vocab], "float32")
        specs["allowed"] = ([MAX_BLOCK, (self.vocab + 31) // 32], "int32")
        self._carve("act", specs)

    async def _load(self, slot: Slot, worker: WorkerHandle) -> LoadDraftReply | None:
        """The executor's loader: a pipeline slot gets its layers (and the draft back after
        a restart); the draft's own worker its draft and the target's edges."""
        p, plan = self.placement, slot.plan
        if slot.role == "experts":
            assert self.experts is not None
            await self.experts.load(slot, worker)
            return None
        if plan is None:
            return await self._load_draft_into(worker, target=p.model)
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
                kv_pool=self.flash_cfg.pool_tokens if self.flash_cfg else 0,
                moe_hot=-1 if p.moe_hot is None else p.moe_hot,
                moe_profile=p.moe_profile,
                **(self.experts.load_fields(slot) if self.experts else {}),
                weights=p.weights_mode,
                batch_invariant=p.batch_invariant,
                kv_dtype=p.kv_dtype,
                kv_block=0 if self.flash_cfg else p.kv_block,
            )
        )
        if self.experts is not None:
            await self.experts.pipeline_loaded(worker, reply)
        if self.flash_cfg is not None:
            if reply.kv_pool != self.flash_cfg.pool_tokens:
                raise WorkerReplyError(
                    f"worker {slot.spec.group} pooled {reply.kv_pool} rows, "
                    f"not {self.flash_cfg.pool_tokens}"
                )
            self._record_bytes[plan.layers] = reply.kv_chunk_bytes
        self.load_s = max(self.load_s, reply.load_s)
        self._recurrent[plan.layers] = reply.recurrent
        self.n_layers, self.hidden, self.vocab = reply.n_layers, reply.hidden, reply.vocab
        if self._draft_path is not None and self.executor.draft_slot is None:
            await self._load_draft_into(worker)  # a restarted worker gets its draft back
        return None

    # -- sequences (continuous batching) ---------------------------------------------------

    @staticmethod
    def bind_lane(sequence: int) -> None:
        """Make the calling task's single-sequence calls act on `sequence` (a task started
        from this one inherits it): a request served beside others binds its own."""
        LANE.set(sequence)

    @contextlib.asynccontextmanager
    async def lane(self, sequence: int) -> AsyncIterator[None]:
        """Act on `sequence` (a new one starts empty) for the body, holding the io regions
        throughout (see `holding`)."""
        token = LANE.set(sequence)
        try:
            async with self.holding():
                yield
        finally:
            LANE.reset(token)

    @contextlib.asynccontextmanager
    async def holding(self) -> AsyncIterator[None]:
        """The io regions and the workers for the calling task's lane, until the body ends:
        lanes take turns (each method that talks to the workers holds them; a caller that
        writes a region itself, such as a grammar's masks, holds them across its call).
        Re-entrant within a task."""
        task = asyncio.current_task()
        if self._holder is task:
            yield
            return
        async with self._lane_lock:
            self._holder = task
            try:
                if LANE.get() != self.lane_id:
                    self._select(LANE.get())
                yield
            finally:
                self._holder = None

    def lane_position(self, sequence: int) -> int:
        """A lane's committed position (0 for one never used)."""
        if sequence == self.lane_id:
            return self._position
        return self._lanes[sequence].position if sequence in self._lanes else 0

    async def release(self, sequence: int, keep_sampler: bool = False) -> None:
        """Forget `sequence` in every worker (its caches are freed) and here; with
        `keep_sampler` the workers keep its sampler (a preempted request resumes there)."""
        if sequence == 0:
            raise ValueError("sequence 0 is the default lane: reset it instead")
        async with self._lane_lock:
            reset = Reset(sequence=sequence, release=True, keep_sampler=keep_sampler)
            await asyncio.gather(*(w.call(reset) for w in self.executor.workers()))
            if self.lane_id == sequence:
                self._unpark(0)  # its state is dropped, not parked
            self._lanes.pop(sequence, None)
            if sequence in self._flashes:
                self._flashes[sequence].reset()

    def _select(self, sequence: int) -> None:
        self._park()
        self._unpark(sequence)

    def _park(self) -> None:
        """The selected lane's state into `_lanes`, beside the others'."""
        self._lanes[self.lane_id] = _Lane(
            self._position, self._last_fed, self._last_block_states, self._ring_floor
        )

    def _unpark(self, sequence: int) -> None:
        lane = self._lanes.pop(sequence, None) or _Lane()
        self._position, self._last_fed = lane.position, lane.last_fed
        self._last_block_states, self._ring_floor = lane.last_block_states, lane.ring_floor
        self.lane_id = sequence
        self.ring = self._lane_ring(sequence)
        self.flash = self._lane_flash(sequence)

    def _lane_ring(self, sequence: int) -> FeatureRing | None:
        """`sequence`'s feature ring, made on first use (None while captures are off). A
        lane keeps its ring for the requests that follow in it: a new one starts at
        position 0 and reads only rows it wrote."""
        if self._capture is None:
            return None
        ring = self._rings.get(sequence)
        if ring is None:
            layers, cap, dtype = self._capture
            name = f"{self.name}-ring" + (str(sequence) if sequence else "")
            ring = self._rings[sequence] = FeatureRing(
                self.owner, layers, cap, self.hidden, dtype, name
            )
        return ring

    async def step_batch(self, steps: Sequence[BatchStep]) -> list[list[Sampled]]:
        """One decode step of several sequences in one pass through the workers: each
        feeds its token (and its proposals) at its position and samples its next with its
        own sampling (the workers keep each sequence's sampler, as `step` does); a step
        with proposals gets a greedy token after each of its rows, as `verify`. -> each
        step's rows. All or nothing: a failure leaves every sequence where it was."""
        seqs = [s.sequence for s in steps]
        if not 0 < len(seqs) <= self.placement.max_batch_tokens or len(set(seqs)) != len(seqs):
            raise ValueError(f"a batch steps 1..max_batch_tokens distinct sequences, got {seqs}")
        if len(steps) == 1 and not steps[0].proposals and steps[0].fill is None:
            return [[await self._step_alone(steps[0])]]
        async with self.holding():
            if not self.executor.in_sync:
                raise WorkerDied("a model worker was restarted; the request must start over")
            selected = self.lane_id
            self._park()  # the selected lane beside the others: all are stepped alike
            try:
                lanes = [self._lanes.setdefault(s, _Lane()) for s in seqs]
                feeds = [[s.token, *s.proposals] for s in steps]
                total = sum(len(f) for f in feeds)
                if total > self.placement.max_batch_tokens:
                    raise ValueError(f"a batch of {total} tokens exceeds max_batch_tokens")
                places = zip(seqs, lanes, feeds, strict=True)
                rows = [(q, lane.position, len(f)) for q, lane, f in places]
                outs = [len(f) if s.proposals else 1 for s, f in zip(steps, feeds, strict=True)]
                table = [(*row, out) for row, out in zip(rows, outs, strict=True)]
                self._arrays["batch"][: len(steps)] = table
                self._arrays["tokens"][:total] = [t for f in feeds for t in f]
                asked = [s.logprobs for s in steps if s.logprobs is not None]
                k = min(max(asked, default=0), MAX_TOP_LOGPROBS)
                outputs = self._row_outputs(sum(outs), k if asked else None)
                masks = self._fill_masks(steps, outs)
                await self._batch_pipeline(steps, rows, outs, outputs, k, masks)
                for feed, lane in zip(feeds, lanes, strict=True):
                    lane.last_fed = (lane.position, feed)
                    lane.position += len(feed)
                    lane.last_block_states = False
                sampled = self._read_rows(sum(outs), outputs)
            finally:
                self._unpark(selected)
        per_step, at = [], 0
        for s, n in zip(steps, outs, strict=True):
            per_step.append([_trimmed(r, s.logprobs) for r in sampled[at : at + n]])
            at += n
        return per_step

    async def _step_alone(self, step: BatchStep) -> Sampled:
        """A batch of one plain step as the sequence's own `step`: the same forward and
        sampler, through the workers' single-sequence verb, which costs less per token
        than a batch of one (~0.3 ms a SmolLM2 step on 2 CPU threads, between the two
        processes), so one client of a batching daemon decodes as fast as alone."""
        lane = LANE.set(step.sequence)
        try:
            return await self.step(step.token, step.sampling, step.logprobs)
        finally:
            LANE.reset(lane)

    def _fill_masks(self, steps: Sequence[BatchStep], outs: list[int]) -> Region | None:
        """The batch's grammar masks, a row per output row (every token allowed where a
        step has no grammar), or None when no step has one."""
        if all(s.fill is None for s in steps):
            return None
        masks, rows = self._arrays["allowed"], sum(outs)
        if rows > masks.shape[0]:
            raise ValueError(f"masks for {rows} rows: the region holds {masks.shape[0]}")
        at = 0
        for step, n in zip(steps, outs, strict=True):
            if step.fill is None:
                masks[at : at + n] = -1  # all 32 bits of every word
            elif step.proposals:
                raise ValueError("a grammar step is one token: its proposals go unbatched")
            else:
                step.fill(at)
            at += n
        return self._regions["allowed"].rows(0, rows)

    async def _batch_pipeline(
        self,
        steps: Sequence[BatchStep],
        rows: list[tuple[int, int, int]],
        outs: list[int],
        outputs: dict,
        k: int,
        allowed: Region | None,
    ) -> None:
        n, tokens = len(steps), sum(size for _, _, size in rows)
        flashes = [f for seq, _, _ in rows if (f := self._lane_flash(seq)) is not None]
        plans = []  # each sequence's KV Flash plan: its fields for each worker
        try:
            for flash, (_, start, size) in zip(flashes, rows, strict=False):
                plans.append(flash.plan(start, size))
        except BaseException:  # PoolExhausted: the plans made so far are undone
            for flash, (_, start, _) in zip(flashes, rows[: len(plans)], strict=False):
                flash.truncate(start)
            raise
        capture: dict = {}
        if self._capture is not None:  # each sequence's features into its own lane's ring
            rings = [self._lane_ring(seq) for seq, _, _ in rows]
            capture = {"capture": self._capture[0], "rings": tuple(r.region for r in rings if r)}

        def frame(i: int, last: bool) -> ForwardBatch:
            return ForwardBatch(
                n_sequences=n,
                n_tokens=tokens,
                n_rows_out=sum(outs),
                batch=self._regions["batch"].rows(0, n),
                want="sample" if last else "hidden",
                outputs=outputs if last else {"hidden": self._boundary(i, tokens)},
                tokens=self._regions["tokens"].rows(0, tokens),
                hidden_in=self._boundary(i - 1, tokens) if i else None,
                # A verify block's rows are greedy (`verify`'s map): sampled requests
                # verify by rejection sampling, on their own.
                sampling=tuple(
                    {**s.sampling, "temperature": 0.0} if s.proposals else s.sampling for s in steps
                )
                if last
                else (),
                top_logprobs=k if last else 0,
                allowed=allowed if last else None,
                kv_plans=tuple(plan[i] for plan in plans),
                **capture,
            )

        starts = {seq: start for seq, start, _ in rows}
        try:
            await self._pipeline(frame, starts, tuple(start + size for _, start, size in rows))
        except BaseException:
            if flashes:  # as `_forward`: the pools may disagree now, so every sequence restarts
                for flash, (_, start, _) in zip(flashes, rows, strict=True):
                    flash.truncate(start)
                self.executor.in_sync = False
            raise
        for flash in flashes:
            flash.after_step()  # qk: reselect; the copies ride with the lane's next plan

    async def _pipeline(
        self,
        frame_for: Callable[[int, bool], Forward | ForwardBatch],
        starts: dict[int, int],
        ends: tuple[int, ...],
    ) -> list[ForwardReply | ForwardBatchReply]:
        """One pass through every worker, frame_for(k, last) to the k-th; all or nothing: a
        failure, or a worker not at `ends` after it (each sequence's position), truncates
        every sequence back to its start in `starts` on the workers that advanced."""
        workers = self.executor.workers()
        advanced: list[WorkerHandle] = []
        replies: list[ForwardReply | ForwardBatchReply] = []
        try:
            for k, worker in enumerate(workers):
                reply = await worker.call(frame_for(k, k == len(workers) - 1))
                assert isinstance(reply, ForwardReply | ForwardBatchReply)
                advanced.append(worker)
                replies.append(reply)
                if self.experts is not None:
                    self.experts.account(reply)
                at = reply.positions if isinstance(reply, ForwardBatchReply) else (reply.position,)
                if at != ends:
                    raise WorkerReplyError(
                        f"worker {worker.spec.group} is at position(s) {list(at)}, expected "
                        f"{list(ends)}: the shards disagree"
                    )
        except BaseException:
            for worker in advanced:  # keep the shards agreeing: undo where it happened
                for seq, start in starts.items():
                    with contextlib.suppress(Exception):
                        await worker.call(Truncate(position=start, sequence=seq))
            raise
        return replies

    # -- KV position ---------------------------------------------------------------------

    @_on_lane
    async def reset(self) -> None:
        reset = Reset(sequence=self.lane_id)
        await asyncio.gather(*(w.call(reset) for w in self.executor.workers()))
        self._position = 0
        self._last_fed = (0, [])
        self._last_block_states = False
        self._ring_floor = 0
        if self.flash is not None:
            self.flash.reset()
        self.executor.in_sync = True

    @property
    def shares_prefixes(self) -> bool:
        """Whether a lane may start on another's prefix blocks (`share`): the workers hold
        every lane's K/V in one block pool, and no per-lane state outside the K/V and the
        feature ring (a recurrent state, a KV Flash pager) would need the prefix too."""
        return self.placement.kv_block > 0 and self.flash_cfg is None and not self.recurrent

    @_on_lane
    async def share(self, source: int, n: int) -> int:
        """Start this (reset) lane on lane `source`'s first n committed positions (at most
        what it holds), sharing their K/V blocks in every worker instead of computing or
        copying them. Returns the positions committed here. If a worker refuses, every
        worker's copy of this lane is reset and the error raised."""
        if not self.shares_prefixes:
            raise ValueError("this target does not share prefixes (shares_prefixes)")
        if self._position:
            raise ValueError(f"share into a lane holding {self._position} positions: reset it")
        n = min(n, self.lane_position(source))
        if n == 0:
            return 0
        frame = KVShare(sequence=self.lane_id, source=source, position=n)
        try:
            replies = await asyncio.gather(*(w.call(frame) for w in self.executor.workers()))
        except BaseException:
            with contextlib.suppress(Exception):
                await self.reset()  # in sync again (empty) unless a worker is gone
            raise
        shared = {r.position for r in replies if isinstance(r, KVShareReply)}
        if shared != {n}:
            await self.reset()
            raise WorkerReplyError(f"the workers shared {sorted(shared)} positions, not {n}")
        self._position = n
        self._last_fed = (n, [])
        self._last_block_states = False
        if self.ring is not None:
            self._share_ring(source, n)
        return n

    def _share_ring(self, source: int, n: int) -> None:
        """Copy the source lane's captures of positions below n into this lane's ring (the
        draft reads them as the prefix's context). The source's ring holds a position only
        from its floor on and within ring_cap of what it has fed, rejected verify rows
        included (at most MAX_BLOCK past its position); this lane's floor is set to match."""
        assert self.ring is not None
        theirs = self._lane_ring(source)
        lane = self._lanes[source]  # parked: this lane is the selected one
        assert theirs is not None
        cap = self.ring.ring_cap
        lo = max(lane.ring_floor, lane.position + MAX_BLOCK - cap, 0)
        if lo < n:
            slots = np.arange(lo, n) % cap
            self.ring.array[slots] = theirs.array[slots]
        self._ring_floor = min(lo, n)

    @property
    def recurrent(self) -> bool:
        """Whether some layer keeps a recurrent state (a hybrid such as qwen35): its KV
        cannot be cut at any position, and a prefix snapshot does not cover it."""
        return any(self._recurrent.values())

    @property
    def _select_rollback(self) -> bool:
        return self.recurrent and self.rollback == "select"

    @_on_lane
    async def truncate(self, position: int) -> None:
        """Roll every shard's KV back to `position` committed tokens.

        A recurrent state cannot be cut: it is kept at the last forward's start (the state
        that forward replaced), so a cut inside the last forward (a verify that accepted
        part of its block) rewinds there and replays the kept tokens through the pipeline,
        asking the head for one row of logits, which touches no sampler state. A verify
        that kept a state per position (`rollback` "select") is cut like attention KV:
        each worker selects the state at `position`."""
        if not 0 <= position <= self._position:
            raise ValueError(f"cannot truncate to {position}: {self._position} are committed")
        start, fed = self._last_fed
        replayed = self.recurrent and position > start and not self._last_block_states
        replay = fed[: position - start] if replayed else []
        if self.recurrent and position < start:
            raise ValueError(
                f"cannot truncate a recurrent model to {position}: its state is kept only at "
                f"{start}, the start of the last forward"
            )
        if position == self._position:
            return
        cut = start if replay else position
        truncate = Truncate(position=cut, sequence=self.lane_id)
        await asyncio.gather(*(w.call(truncate) for w in self.executor.workers()))
        self._position = cut
        if self.flash is not None:
            self.flash.truncate(cut)  # the plan hides the rest anyway; tidy
        if replay:
            await self._forward(replay, "logits", {"logits": self._regions["logits"].rows(0, 1)})

    # -- captures ------------------------------------------------------------------------

    def enable_capture(
        self, layers: Sequence[int], ring_cap: int, dtype: str = "float32"
    ) -> FeatureRing:
        """Create the feature ring; from now on every forward captures `layers` into it."""
        if self.ring is not None:
            raise RuntimeError("captures are already enabled")
        if not self.hidden:
            raise RuntimeError("start the target first (the ring width is the model's)")
        bad = [layer for layer in layers if not 0 <= layer < self.n_layers]
        if bad:
            raise ValueError(f"capture layers {bad} outside the model's {self.n_layers} layers")
        self._capture = (tuple(layers), ring_cap, dtype)
        ring = self._lane_ring(self.lane_id)
        assert ring is not None
        self.ring = ring
        return ring

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
        slots = self.executor.slots
        first = slots[0]
        assert first.plan is not None
        if device is None and len(slots) == 1:
            device = first.plan.devices[0]
        device = device or slots[-1].plan.devices[-1]  # type: ignore[union-attr]
        group = parse_device(device)[1]
        self._draft_device = device
        if len(slots) == 1 and device in first.plan.devices and group == first.spec.group:
            reply = await self._load_draft_into(self.executor.workers()[0])
        else:
            spec = WorkerSpec(
                group, (device,), python=python or first.spec.python, threads=first.spec.threads
            )
            started = await self.executor.add_draft_slot(spec)
            assert isinstance(started, LoadDraftReply)
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

    def enable_lookup_drafts(self, block_size: int) -> None:
        """Room for a model-free drafter's blocks (``--draft ngram``): its proposals are
        point masses, whose q rows ``set_point_mass_q`` writes for ``verify_sampled``."""
        if not 2 <= block_size <= MAX_BLOCK:
            raise ValueError(f"block size {block_size} outside [2, {MAX_BLOCK}]")
        self._carve("draft", {"draft_probs": ([block_size - 1, self.vocab], "float32")})
        self._point_mass_rows = 0

    def set_point_mass_q(self, proposals: list[int]) -> None:
        """q row i = one-hot at proposal i: rejection sampling against a drafter that
        proposes one token with certainty (exact: accept with probability p(x), else draw
        from p without x)."""
        q = self._arrays["draft_probs"]
        q[: self._point_mass_rows] = 0.0  # only the rows the last block set are non-zero
        q[np.arange(len(proposals)), proposals] = 1.0
        self._point_mass_rows = len(proposals)

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

    @_on_lane
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
        await self.executor.draft_worker().call(
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

    def draft_room(self, want: int) -> int:
        """How many positions a DFlash block may feed from here (at most `want`): with KV
        Flash, no more than needs no eviction past the first chunk (`Pager.lookahead`)."""
        lane = LANE.get()  # read outside `holding` (a batched lane): not the selected lane's
        flash = self._lane_flash(lane)
        return want if flash is None else flash.pager.lookahead(self.lane_position(lane), want)

    @property
    def token_masks(self) -> np.ndarray:
        """The ``allowed`` region: the daemon writes row i's mask before a forward that
        samples row i with ``masked=True`` (``luced.engine.constraint``)."""
        return self._arrays["allowed"]

    def _allowed(self, masked: bool, rows: int) -> Region | None:
        return self._regions["allowed"].rows(0, rows) if masked else None

    @_on_lane
    async def verify(
        self,
        block: list[int],
        sampling: dict | None = None,
        logprobs: int | None = None,
        masked: bool = False,
    ) -> list[Sampled]:
        """Feed the block; the target's greedy next token after each of its positions (row i
        penalized with its own history when `sampling` has penalties, and restricted to
        `token_masks` row i when `masked`), with logprobs."""
        n, k = len(block), min(logprobs or 0, MAX_TOP_LOGPROBS)
        greedy = {**(sampling or {}), "temperature": 0.0}
        outputs = self._row_outputs(n, logprobs)
        await self._forward(
            block,
            "sample",
            outputs,
            positions="all",
            sampling=greedy,
            top_logprobs=k,
            keep_block_states=self._select_rollback,
            allowed=self._allowed(masked, n),
        )
        return self._read_rows(n, outputs)

    @_on_lane
    async def verify_sampled(
        self, block: list[int], sampling: dict, logprobs: int | None = None, masked: bool = False
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
            keep_block_states=self._select_rollback,
            allowed=self._allowed(masked, n),
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
        keep_at: Sequence[int] = (),
        masked: bool = False,
        sample: bool = True,
    ) -> Sampled | None:
        """Feed the prompt in chunks of max_batch_tokens; sample after the last one (not
        with `sample` False: a preempted request's recompute, whose next token is known).
        Returns None when `cancelled()` turned true between chunks, or nothing was sampled.
        Only the sampled chunk draws from the request's generator, so a seed gives the same
        tokens however the prompt was chunked or restored.

        `keep_at`: absolute positions inside the prompt where a recurrent model keeps its
        state (prefix-cache cut points, `export_kv` `cuts`): a chunk ends at each, so the
        state exists there."""
        chunk = self.placement.max_batch_tokens
        sampled = None
        if self.flash is not None:
            chunk = min(chunk, self.flash.step_limit)  # each step's chunks fit the pool
        base = self.position
        end = base + len(prompt)
        marks = {p for p in keep_at if base < p < end} if self.recurrent else set()
        stops = sorted(set(range(base + chunk, end, chunk)) | marks | {end})  # gaps <= chunk
        a = base
        for b in stops:
            if cancelled():
                return None
            piece = prompt[a - base : b - base]
            last = b == end
            # Each chunk holds the workers alone: other lanes' steps run between chunks.
            async with self.holding():
                if last and self.flash is not None and len(prompt) > self.flash.pool:
                    self.flash.pager.ask_reselect()  # qk: select by the prompt's last query
                if last and sample:
                    sampled = await self._sample(piece, sampling, logprobs, b in marks, masked)
                else:
                    await self._feed(piece, keep_state=b in marks)
            a = b
        return sampled

    @_on_lane
    async def step(
        self, token: int, sampling: dict, logprobs: int | None, masked: bool = False
    ) -> Sampled:
        """Feed one token, sample the next (among `token_masks` row 0's when `masked`).
        logprobs: None, or k = chosen + top k."""
        return await self._sample([token], sampling, logprobs, masked=masked)

    @_on_lane
    async def logits(self, ids: list[int]) -> np.ndarray:
        """Feed ids (at most logit_rows); a copy of every position's logits [n, vocab]."""
        n = len(ids)
        if not 0 < n <= self.placement.logit_rows:
            raise ValueError(f"logits for 1..{self.placement.logit_rows} tokens, got {n}")
        out = {"logits": self._regions["logits"].rows(0, n)}
        await self._forward(ids, "logits", out, positions="all")
        return self._arrays["logits"][:n].copy()

    async def _sample(
        self,
        ids: list[int],
        sampling: dict,
        logprobs: int | None,
        keep_state: bool = False,
        masked: bool = False,
    ) -> Sampled:
        """Feed ids and sample the token after the last (the request's generator draws)."""
        outputs = self._row_outputs(1, logprobs)
        k = min(logprobs or 0, MAX_TOP_LOGPROBS)
        await self._forward(
            ids,
            "sample",
            outputs,
            sampling=sampling,
            top_logprobs=k,
            keep_state=keep_state,
            allowed=self._allowed(masked, 1),
        )
        return self._read_rows(1, outputs)[0]

    async def _feed(self, ids: list[int], keep_state: bool = False) -> None:
        """Feed ids into the KV, sampling nothing (the head's worker writes the last row's
        logits, which nobody reads: no generator draws)."""
        outputs = {"logits": self._regions["logits"].rows(0, 1)}
        await self._forward(ids, "logits", outputs, keep_state=keep_state)

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
        keep_state: bool = False,
        keep_block_states: bool = False,
        allowed: Region | None = None,
    ) -> ForwardReply:
        """One pipeline pass of `ids` through every worker; outputs from the last one.
        `keep_state`: each worker keeps the recurrent state this pass reaches."""
        workers = self.executor.workers()
        if not self.executor.in_sync:
            raise WorkerDied("a model worker was restarted; the request must start over")
        t0 = time.perf_counter()
        start, n = self._position, len(ids)
        self._arrays["tokens"][:n] = ids
        tokens = self._regions["tokens"].rows(0, n)
        capture = {}
        if self.ring is not None:
            capture = {"capture": self.ring.layers, "ring": self.ring.region}
        # KV Flash: one plan, written once, applied by every worker (raises before any frame
        # when the step cannot be resident: nothing changed).
        flash = self.flash.plan(start, n) if self.flash is not None else [{}] * len(workers)

        def frame(k: int, last: bool) -> Forward:
            return Forward(
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
                allowed=allowed if last else None,
                keep_state=keep_state,
                keep_block_states=keep_block_states,
                sequence=self.lane_id,
                **capture,
                **flash[k],
            )

        try:
            replies = await self._pipeline(frame, {self.lane_id: start}, (start + n,))
        except BaseException:
            if self.flash is not None:
                # Some workers may have run this plan's host-tier moves and others not: the
                # pool contents disagree, so the sequence must start over.
                self.flash.truncate(start)
                self.executor.in_sync = False
            raise
        reply = replies[-1]
        assert isinstance(reply, ForwardReply)
        compute_us = sum(r.elapsed_us for r in replies)
        if self.flash is not None:
            self.flash.after_step()  # qk: reselect; the copies ride with the next plan
        self._position = start + n
        self._last_fed = (start, list(ids))
        self._last_block_states = keep_block_states
        self.last_wall_us = int((time.perf_counter() - t0) * 1e6)
        self.last_compute_us = compute_us
        return reply

    def _boundary(self, k: int, n: int) -> Region:
        return self._regions[f"boundary-{k}"].rows(0, n)

    def _topk_region(self, name: str, n: int, k: int) -> Region:
        """n rows of k, packed (the region is max_batch_tokens * MAX_TOP_LOGPROBS long)."""
        base = self._regions[name]
        return Region(base.segment, base.offset, (n, k), base.dtype)

    # -- status --------------------------------------------------------------------------

    @property
    def identity_layout(self) -> bool:
        """Whether position p sits in row p of every layer (always, without KV Flash): the
        only layout a prefix snapshot may copy."""
        return self.flash is None or self.flash.is_identity

    def flash_status(self) -> dict | None:
        """KV Flash counters (pool, resident / paged-out chunks, evictions, recalls, host
        bytes) summed over the lanes' pools, or None when the target has no pool."""
        if not self._flashes:
            return None
        total: dict = {}
        for flash in self._flashes.values():
            for key, value in flash.status().items():
                total[key] = (
                    total.get(key, 0) + value if key not in ("pool_tokens", "policy") else value
                )
        return {**total, "sequences": len(self._flashes)}

    async def stats(self) -> dict:
        """The first worker's stats, plus every worker's under "workers"."""
        replies = await asyncio.gather(*(w.call(Stats()) for w in self.executor.workers()))
        per = [dict(r.stats) for r in replies if isinstance(r, StatsReply)]
        return {**per[0], "workers": per}

    def describe(self) -> list[dict]:
        return self.executor.describe()

    def moe_status(self) -> dict | None:
        """Expert-worker counters (remote calls, in-process fallbacks, bytes), or None."""
        return dict(self.experts.totals) if self.experts is not None else None

    # -- KV snapshots (the copies: kv_transfer.py) ---------------------------------------

    async def kv_layout(self) -> list[TensorSpec]:
        """Every tensor of a snapshot: each worker's K/V in layer order, then the ring."""
        return await self.kv.layout(self.ring)

    @_on_lane
    async def export_kv(self, n: int, regions: dict[str, Region], cuts: Sequence[int] = ()) -> None:
        """Copy the snapshot of positions [0, n) (n <= position) into `regions`, one per
        spec of `kv_layout`; all or nothing. The KV is never changed. A recurrent model's
        state regions get one slot per cut (ascending to n; the workers kept those states:
        `prefill` `keep_at`, or the position a restore reached)."""
        if not self.executor.in_sync:
            raise WorkerDied("a model worker was restarted; its KV is gone")
        if not 0 <= n <= self._position:
            raise ValueError(f"cannot export {n} positions: {self._position} are committed")
        if self.flash is not None and not self.flash.is_identity:
            raise ValueError("KV Flash: a snapshot needs the identity layout (prompt <= pool)")
        cuts = tuple(cuts) if self.recurrent else ()
        await self.kv.export(n, regions, self.ring, cuts, self.lane_id)

    @_on_lane
    async def import_kv(self, n: int, regions: dict[str, Region], tokens: Region) -> None:
        """Restore positions [0, n) from a snapshot (its token axis may be longer than n);
        `tokens` (int32 [>= n]) are the ids at those positions (the workers' history for
        penalties). All or nothing: regions are checked first (a bad one changes nothing);
        if a worker fails after that, every worker is reset, position 0, and the first
        error is raised."""
        if not 0 <= n <= self.placement.kv_capacity:
            cap = self.placement.kv_capacity
            raise ValueError(f"cannot import {n} positions into a KV of {cap}")
        if self.flash is not None and n > self.flash.pool:
            raise WorkerReplyError(f"a snapshot of {n} positions exceeds the KV Flash pool")
        if tokens.dtype != "int32" or len(tokens.shape) != 1 or tokens.shape[0] < n:
            raise ValueError(f"tokens must be int32 [>= {n}], got {tokens.dtype} {tokens.shape}")
        frames = await self.kv.import_frames(n, regions, tokens, self.ring, self.lane_id)
        self.executor.in_sync = False  # the shards may disagree until every one has imported
        try:
            await self.kv.import_(frames, regions.get("ring"), self.ring)
        except BaseException:
            self._position = 0
            with contextlib.suppress(Exception):
                await self.reset()  # in sync again (empty) unless a worker is gone
            raise
        self._position = n
        self._last_fed = (n, [])
        self._last_block_states = False
        self.executor.in_sync = True
        if self.flash is not None:
            self.flash.sync_identity(n)  # the workers hold rows [0, n) in rows [0, n)
        if self.ring is not None:
            # A snapshot of N positions holds valid ring rows only from N - ring_cap on.
            self._ring_floor = max(0, regions["ring"].shape[0] - self.ring.ring_cap)
