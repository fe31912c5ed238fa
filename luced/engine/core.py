"""The engine: a bounded request queue and one loop of steps, owned by the event loop.

    handle = engine.submit(GenerationRequest(...))   # raises EngineError (429/400/503)
    async for delta in handle: ...                    # text deltas, token ids, logprobs
    handle.finish_reason                              # "stop" | "length" | "abort" | "error"
    handle.embedding                                  # with `pooling`: the pooled vector

An embedding request (`GenerationRequest.pooling`, engine/pooling.py) feeds its input in
the steps beside everything else and ends with its vector; an encoder model
(`ModelInfo.encoder`: bidirectional attention, BERT) serves nothing else.

The engine's settings come in groups (engine/config.py): what it serves (`model`), how
many requests wait and run (`limits`), its KV pool (`kv`), its draft windows (`speculation`).

The loop runs `step()` while there is work:

    admit      waiting sequences start (`Scheduler.admit`), each on the longest prefix of
               its prompt held elsewhere (`PrefixReuse`: a running sequence's blocks, or a
               prefix-cache snapshot)
    schedule   one batch: every running sequence's decode token or draft window, and
               prompt chunks, under the step's token budget (`Scheduler.schedule`)
    execute    draft windows filled, then one forward of the whole batch through the
               workers (`ModelRunner.execute`)
    update     tokens emitted (detokenized, stop strings matched: ``output.py``), windows
               accepted, finished sequences released, new prompts snapshotted

A request's coroutine only waits for its deltas: admission, KV growth, preemption and
fairness are the scheduler's. A client that disconnects leaves the queue at once, or the
batch at the next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from luced.cache.prefix_cache import PrefixCache
from luced.engine.config import KVConfig, ModelInfo, SchedulingLimits, SpeculationConfig
from luced.engine.executor import WorkerDied, WorkerReplyError
from luced.engine.intake import Intake
from luced.engine.kv.budget import KVBudget
from luced.engine.kv.finished import KEPT_LANES, FinishedPrefixes
from luced.engine.prefix import PrefixReuse
from luced.engine.request import (
    ContextTooLong,
    EmbeddingsOnly,
    EngineError,
    GenerationRequest,
    InvalidGrammar,
    QueueFull,
    RequestHandle,
    Sequence,
    Status,
    Unavailable,
)
from luced.engine.runner import ModelRunner
from luced.engine.scheduler import Batch, Scheduler, StepResult
from luced.engine.spec.calibrate import calibrate
from luced.engine.spec.windows import DraftWindows
from luced.engine.status import engine_status
from luced.engine.target import Target
from luced.sampling_params import SamplingParams
from luced.text.grammar import GrammarError
from luced.text.tokenizer import Tokenizer
from luced.text.turns import TurnMarker

__all__ = [
    "ContextTooLong",
    "EmbeddingsOnly",
    "Engine",
    "EngineError",
    "GenerationRequest",
    "InvalidGrammar",
    "QueueFull",
    "RequestHandle",
    "Unavailable",
]

log = logging.getLogger(__name__)


# Why a preempted request ends when a worker dies: what it had streamed cannot be continued.
RESUME_LOST = "the model worker failed: it died while this request waited to resume"
_GREEDY = SamplingParams(temperature=0)
_ONE_RUNNING, _NOTHING_KEPT, _FIXED_WINDOW = SchedulingLimits(), KVConfig(), SpeculationConfig()


class Engine:
    def __init__(
        self,
        target: Target,
        tokenizer: Tokenizer,
        chat_template: Any,
        *,
        model: ModelInfo,
        limits: SchedulingLimits = _ONE_RUNNING,
        kv: KVConfig = _NOTHING_KEPT,
        speculation: SpeculationConfig = _FIXED_WINDOW,
        metrics: Any = None,
        prefix_cache: PrefixCache | None = None,
    ) -> None:
        """The groups (engine/config.py) default to one running request, nothing kept, a
        fixed window of 16."""
        self.target = target
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.model = model
        self.limits = limits
        self.speculation = DraftWindows(speculation)
        self.metrics = metrics
        self.started_at = time.time()
        self.draining = False
        self.loaded_once = False
        running, context = limits.max_running, model.context_length
        pool = kv.pool_tokens or running * context
        if pool < context:
            raise ValueError(
                f"the KV pool ({pool} positions) must hold one whole context "
                f"({context}): else a long request could never finish"
            )
        keep = min(kv.keep_tokens, pool)
        lanes = running + (KEPT_LANES if keep else 0)
        holdings = target.size_blocks(pool, lanes, keep, kv.block_store)
        self.kv = KVBudget(pool, holdings)  # under KV Flash: what lanes hold in the pool
        self.finished = FinishedPrefixes(self.kv, running, keep) if keep else None
        self.scheduler = Scheduler(
            max_running=running,
            max_step_tokens=target.step_tokens,
            chunk=self._chunk(target.placement.max_batch_tokens),
            kv=self.kv,
            observe=self._observe,
            drafted=self._drafted,
        )
        self.scheduler.window = self.speculation.window
        self.scheduler.room = self._room
        self.scheduler.keep = self._keep_lane
        self.scheduler.encoder = model.encoder
        self.intake = Intake(target, tokenizer, self.scheduler, self.speculation, model, limits)
        self.runner = ModelRunner(target)
        turns = TurnMarker.learn(chat_template, tokenizer)  # the prefix cache's cut points
        self.prefix = PrefixReuse(
            target, prefix_cache, turns, self.kv, self._observe, self.finished
        )
        self.rejected: dict[str, int] = {}  # refused submissions by reason
        self.steps = 0  # forwards run, and the sequences in them (mean batch size)
        self.stepped_sequences = 0
        self.totals = {
            "requests": 0,
            "prompt_tokens": 0,
            "cached_prompt_tokens": 0,
            "shared_prompt_tokens": 0,
            "generation_tokens": 0,
            "errors": 0,
            "spec_drafts": 0,
            "spec_accepted_tokens": 0,
            "preemptions": 0,
        }
        self._releases: list[tuple[int, bool]] = []  # (slot, keep sampler) to free first
        self._wakeup = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._loop_task: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()
        target.watch(self._workers_changed)

    # -- state ----------------------------------------------------------------------------

    @property
    def prefix_cache(self) -> PrefixCache | None:
        return self.prefix.cache

    @prefix_cache.setter
    def prefix_cache(self, cache: PrefixCache | None) -> None:
        self.prefix.cache = cache

    @property
    def turns(self) -> TurnMarker | None:
        """Where a prompt's snapshot may be restored besides its end (chat-turn starts)."""
        return self.prefix.turns

    @turns.setter
    def turns(self, turns: TurnMarker | None) -> None:
        self.prefix.turns = turns

    @property
    def state(self) -> str:
        if self.draining:
            return "draining"
        # Ready once the daemon has started the loop (after the draft and the prefix cache
        # are set up), not as soon as the workers have loaded.
        if self.target.ready and self._loop_task is not None:
            self.loaded_once = True
            return "ready"
        return "degraded" if self.loaded_once else "loading"

    @property
    def waiting(self) -> list[RequestHandle]:
        return [s.handle for s in self.scheduler.waiting]

    @property
    def running(self) -> dict[int, RequestHandle]:
        """Slot -> its running request."""
        return {s.slot: s.handle for s in self.scheduler.running}

    @property
    def preempted(self) -> dict[int, RequestHandle]:
        """Slot -> a preempted request that keeps it (the workers hold its sampler)."""
        return {s.slot: s.handle for s in self.scheduler.waiting if s.slot >= 0}

    @property
    def active(self) -> RequestHandle | None:
        """A running request (the one, when one runs at a time)."""
        return next(iter(self.running.values()), None)

    @property
    def block_sizes(self) -> dict[int, int]:
        return self.scheduler.block_sizes

    @property
    def embedding_length(self) -> int:
        """An embedding's dimensions (the model's hidden size; 0 until loaded)."""
        return self.target.hidden

    # -- submission -----------------------------------------------------------------------

    def submit(self, req: GenerationRequest) -> RequestHandle:
        """Queue a request; EngineError (429 / 400 / 503) when it cannot be, counted by
        reason (`rejected` in the status, luced:request_rejected_total)."""
        try:
            return self._admit(req)
        except EngineError as exc:
            self.rejected[exc.reason] = self.rejected.get(exc.reason, 0) + 1
            if self.metrics is not None:
                self.metrics.rejected(exc.reason)
            raise

    def _admit(self, req: GenerationRequest) -> RequestHandle:
        state = self.state
        if state != "ready":
            raise Unavailable(f"luced is {state}; try again later", retry_after=1.0, reason=state)
        handle = RequestHandle(req, self.intake.check(req))
        seq = self.intake.sequence(handle)
        handle.on_cancel = lambda _: self._cancelled(seq)
        self.scheduler.add(seq)
        self.totals["requests"] += 1
        self._idle.clear()
        self._observe("queue", len(self.scheduler.waiting))
        if req.grammar is not None:
            self._spawn(self._constrain(seq), f"grammar-{req.request_id}")
        self._wakeup.set()
        return handle

    async def _constrain(self, seq: Sequence) -> None:
        try:
            await self.intake.constrain(seq)
        except GrammarError as exc:  # valid alone, but not over this vocabulary
            if self.scheduler.cancel_waiting(seq):
                self._end(seq, "error", f"grammar: {exc}")
            return
        self._wakeup.set()

    def _cancelled(self, seq: Sequence) -> None:
        """A client left: a queued request frees its place at once; a running one leaves
        the batch at the next step."""
        if seq.status is Status.WAITING and self.scheduler.cancel_waiting(seq):
            if seq.slot >= 0:  # a preempted one: the workers keep its sampler
                self._releases.append((seq.slot, False))
            self._end(seq, "abort")
        self._wakeup.set()

    def _end(self, seq: Sequence, reason: str, error: str | None = None) -> None:
        seq.handle._finish(reason, error)
        self._observe_finish(seq.handle)
        if not self.scheduler.waiting and not self.scheduler.running:
            self._idle.set()

    def _workers_changed(self) -> None:
        """A worker started, was loaded, died or failed to restart (`Target.watch`).

        While a worker is down the queue waits for its restart (the loop admits nothing),
        and only the requests whose state was in the workers fail: the running ones at
        their step, the preempted ones here (a seeded generator lived in the dead worker,
        and they have streamed tokens). A failed restart ends the queue with a 503: the
        worker is retried with backoff, and may not come back soon."""
        if not self.target.ready:
            if self.finished is not None:  # gone with the worker; the others free theirs
                self.finished.forget_all()
            for seq in [s for s in self.scheduler.waiting if s.slot >= 0]:
                self.totals["errors"] += 1
                self.scheduler.cancel_waiting(seq)
                self._end(seq, "error", RESUME_LOST)
            if (error := self.target.restart_error) is not None:
                message = f"the model worker could not be restarted ({error}); try again later"
                for seq in list(self.scheduler.waiting):
                    self.scheduler.cancel_waiting(seq)
                    self._end(seq, "abort", message)
        self._wakeup.set()

    # -- the loop -------------------------------------------------------------------------

    def start(self) -> None:
        self.loaded_once = True  # a worker that dies from here on is restarted: "degraded"
        self.scheduler.chunk = self._chunk(self.target.prompt_chunk)  # known once loaded
        self._loop_task = asyncio.get_running_loop().create_task(self._run(), name="engine")

    async def stop(self, reason: str = "luced is shutting down") -> None:
        """End everything still queued or running with an error (`reason`), then stop the
        loop."""
        unfinished = [*self.scheduler.waiting, *self.scheduler.running]
        for task in [self._loop_task, *self._tasks]:
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        for seq in unfinished:
            seq.handle._finish("error", reason)
            self._observe_finish(seq.handle)
        self.scheduler.waiting.clear()
        self.scheduler.running.clear()

    async def drain(self, timeout: float | None = None) -> bool:
        """Stop accepting; wait (up to timeout) until queued and running work is done."""
        self.draining = True
        try:
            async with asyncio.timeout(timeout):
                while self.scheduler.waiting or self.scheduler.running:
                    self._idle.clear()
                    await self._idle.wait()
            return True
        except TimeoutError:
            return False

    def _spawn(self, work: Any, name: str) -> None:
        task = asyncio.create_task(work, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self) -> None:
        task = asyncio.current_task()
        while True:
            # stop() waits for this loop to end: a cancel that awaited code swallowed (as
            # wait_for can on 3.11) must still end it, not leave it to take the next request.
            if task is not None and task.cancelling():
                raise asyncio.CancelledError
            if not self._has_work():
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            self._wakeup.clear()
            try:
                worked = await self.step()
            except Exception as exc:  # never let one step kill the loop
                self._fail_running(exc)
                worked = True
            if not worked:  # what waits cannot start yet: until something changes
                await self._wakeup.wait()
            # No yield here: the next step's frames go out at once, and the clients' streams
            # write the deltas just emitted while the workers compute it.

    def _chunk(self, chunk: int) -> int:
        """A prompt chunk that fits one step beside a token of every running sequence."""
        step, running = self.target.step_tokens, self.limits.max_running
        fits = step - running
        if fits < 1:
            raise ValueError(
                f"a step of {step} tokens cannot feed {running} running requests and a "
                "prompt chunk: raise --max-step-tokens"
            )
        return min(chunk, fits)

    def _has_work(self) -> bool:
        s = self.scheduler
        if self._releases or self.kv.evicted or any(q.handle.cancelled for q in s.running):
            return True
        if not self.target.ready:
            return bool(s.running)  # they fail; the queue waits for the restart
        return bool(s.running) or any(q.ready and not q.handle.cancelled for q in s.waiting)

    async def step(self) -> bool:
        """One step: admit, schedule, execute, update (the module docstring). False when
        there was nothing to run."""
        await self._release_slots()
        # How a recurrent target rolls a window back (settable on the target at run time).
        self.scheduler.recurrent = self.target.recurrent
        self.scheduler.select_rollback = self.target.rollback == "select"
        if self.target.ready:
            started = self.scheduler.admit(self._hold)
            await self._free_evicted()  # kept lanes admission gave up
            for seq in started:
                await self._reuse_prefix(seq)
        batch = self.scheduler.schedule()
        await self._free_evicted()  # and those growth gave up
        began = time.perf_counter()
        outputs = await self.runner.execute(batch)
        self._observe_step(batch, time.perf_counter() - began)
        result = self.scheduler.update(batch, outputs)
        await self._retire(result)
        return bool(batch.works or batch.preempted or result.finished)

    def _hold(self, seq: Sequence) -> bool:
        return self.prefix.hold(seq, self.scheduler.running)

    async def _reuse_prefix(self, seq: Sequence) -> None:
        """A just-admitted sequence starts on a prefix held elsewhere (none after a
        preemption: it recomputes in its slot, where its sampler lives on)."""
        if not seq.generated:
            await self.target.reset(seq.slot)
        reused = await self.prefix.reuse(seq, self.scheduler.running)
        if reused:
            self.totals["shared_prompt_tokens"] = self.prefix.shared_tokens
            self._wakeup.set()

    def drop_kept(self) -> int:
        """Give up every finished sequence's kept blocks (`lucectl cache clear`, a
        benchmark's cold start); the loop frees them in the workers. -> how many."""
        if self.finished is None:
            return 0
        n = len(self.kv.kept)
        self.finished.forget_all()
        self._wakeup.set()
        return n

    async def _free_evicted(self) -> None:
        """Free in the workers the kept lanes the budget gave up, page out those it paged."""
        if self.finished is not None:
            await self.finished.settle(self.target)

    def _keep_lane(self, seq: Sequence) -> int | None:
        """The kept lane a finished sequence's K/V moves to, or None (freed): kept when it
        ended well, the workers share blocks, and no feature ring would need its rows.
        Only its prompt's positions are kept (under KV Flash its paged-out blocks too), as
        only a running sequence's prompt is shared: decode steps computed the output's
        rows in other groupings than a fresh prefill would, and reused they would break
        restored == fresh."""
        if (
            self.finished is None
            or seq.pooler is not None
            or seq.handle.finish_reason == "error"
            or not self.target.ready
            or not self.target.shares_prefixes
            or self.target.capture is not None
        ):
            return None
        return self.finished.lane_for(seq.prompt[: seq.computed], seq.slot)

    async def _keep(self, seq: Sequence, lane: int) -> None:
        """Move a finished sequence's blocks to its kept lane (shared, not copied; its slot
        is released after)."""
        if self.finished is None or lane not in self.kv.kept:  # given up meanwhile
            return
        try:
            await self.target.share(lane, seq.slot, len(self.finished.tokens(lane)))
        except Exception as exc:  # the lane is reset in the workers: nothing is kept
            log.warning("keeping the K/V of %s failed: %s", seq.handle.request_id, exc)
            if lane in self.kv.kept:
                self.kv.evict(lane)

    async def _release_slots(self) -> None:
        releases, self._releases = self._releases, []
        for slot, keep in releases:
            with contextlib.suppress(Exception):  # a dead worker forgot it anyway
                await self.target.release(slot, keep_sampler=keep)

    async def _retire(self, result: StepResult) -> None:
        """After a step: snapshot the prompts it completed, release the finished."""
        for seq in result.prefilled:
            self.totals["prompt_tokens"] += seq.handle.prompt_tokens
            self.totals["cached_prompt_tokens"] += seq.handle.cached_tokens
            self._observe("prompt_tokens", seq.handle.prompt_tokens)
            await self.prefix.save(seq)
        await self._free_evicted()  # lanes first: a kept one may take a freed id
        for seq, lane in result.kept:
            await self._keep(seq, lane)
        for seq in result.finished:
            self._releases.append((seq.slot, False))
            self._observe_finish(seq.handle)
        self.totals["preemptions"] = self.scheduler.preemptions
        if result.finished:
            await self._release_slots()
        if not self.scheduler.waiting and not self.scheduler.running:
            self._idle.set()

    def _fail_running(self, exc: Exception) -> None:
        """A step failed: every running sequence ends with the error (a dead worker took
        their state; a refused frame may have left it anywhere). The queue waits."""
        if isinstance(exc, WorkerDied | WorkerReplyError):
            message = f"the model worker failed: {exc}"
        else:
            log.exception("engine step failed", exc_info=exc)
            message = f"internal error: {exc}"
        result = StepResult()
        for seq in list(self.scheduler.running):
            self.totals["errors"] += 1
            seq.handle._finish("error", message)
            self.scheduler.finish(seq, result)
        for seq in result.finished:
            self._releases.append((seq.slot, False))
            self._observe_finish(seq.handle)
        if not self.scheduler.waiting:
            self._idle.set()

    # -- speculation ----------------------------------------------------------------------

    def _room(self, seq: Sequence, want: int) -> int:
        """How many positions a window may feed from `seq`'s committed ones: with KV Flash,
        no more than needs no eviction past the first block (`Pager.lookahead`)."""
        pager = self.target.pager(seq.slot)
        return want if pager is None else pager.lookahead(seq.computed, want)

    def _drafted(self, proposed: int, accepted: int) -> None:
        self.totals["spec_drafts"] += 1
        self.totals["spec_accepted_tokens"] += accepted
        if self.metrics is not None:
            self.metrics.observe_spec_decode(proposed, [1] * accepted + [0] * (proposed - accepted))

    async def calibrate(self, sizes: tuple[int, ...] = (2, 4, 8, 16, 32)) -> dict[int, float]:
        """Measure the adaptive window size's cost model before the first request
        (``spec/calibrate.py``)."""
        block = self.speculation.block_size
        sizes = tuple(sorted({b for b in sizes if b < block} | {block}))
        seq = self.intake.sequence(
            RequestHandle(
                GenerationRequest("calibrate", [self.tokenizer.bos_id or 0] * 8, _GREEDY),
                1 << 20,
            )
        )
        spec = self.speculation
        return await calibrate(self.runner, spec.step_costs, seq, sizes, spec.lookup_drafts)

    # -- observability --------------------------------------------------------------------

    def _observe(self, what: str, value: float) -> None:
        if what == "generation_tokens":
            self.totals["generation_tokens"] += int(value)
        if self.metrics is not None:
            self.metrics.observe(what, value)

    def _observe_step(self, batch: Batch, seconds: float) -> None:
        if not batch.works:
            return
        self.steps += 1
        self.stepped_sequences += len(batch.works)
        self._observe("batch_size", len(batch.works))
        (only,) = batch.works if len(batch.works) == 1 else (None,)
        if only is not None and not only.seq.prefilling and only.start >= len(only.seq.prompt):
            self.speculation.step_costs.observe(len(only.tokens), seconds)  # a step of its own

    def _observe_finish(self, handle: RequestHandle) -> None:
        if self.metrics is not None and handle.finish_reason is not None:
            self.metrics.request_finished(handle)

    def status(self) -> dict:
        return engine_status(self)

    def workers(self) -> list[dict]:
        return self.target.describe()
