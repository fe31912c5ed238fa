"""The engine: a bounded request queue and one loop of steps, owned by the event loop.

    handle = engine.submit(GenerationRequest(...))   # raises EngineError (429/400/503)
    async for delta in handle: ...                    # text deltas, token ids, logprobs
    handle.finish_reason                              # "stop" | "length" | "abort" | "error"
    handle.embedding                                  # with `pooling`: the pooled vector

An embedding request (`GenerationRequest.pooling`, engine/pooling.py) feeds its input in
the steps beside everything else and ends with its vector; an encoder model (`encoder`:
bidirectional attention, BERT) serves nothing else.

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
import itertools
import logging
import time
from typing import Any

from luced.cache.prefix_cache import PrefixCache
from luced.engine.constraint import Constraint
from luced.engine.executor import WorkerDied, WorkerReplyError
from luced.engine.kv.budget import KVBudget
from luced.engine.kv.finished import FinishedPrefixes
from luced.engine.output import OutputBuilder
from luced.engine.pooling import Pooler
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
from luced.engine.spec.ngram import PromptLookup
from luced.engine.spec.sizer import BlockSizer, StepCosts
from luced.engine.status import engine_status
from luced.engine.target import MAX_BLOCK, Target
from luced.sampling_params import SamplingParams
from luced.text.grammar import GrammarError, GrammarTokenizer, check_grammar
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


class Engine:
    def __init__(
        self,
        target: Target,
        tokenizer: Tokenizer,
        chat_template: Any,
        *,
        model_name: str,
        context_length: int,
        max_queue: int = 16,
        max_queued_tokens: int = 32768,
        default_max_tokens: int | None = None,
        block_size: int = 16,
        lookup_drafts: bool = False,
        adaptive_blocks: bool = False,
        metrics: Any = None,
        prefix_cache: PrefixCache | None = None,
        max_running: int = 1,
        kv_pool_tokens: int | None = None,
        kv_keep_tokens: int = 0,
        encoder: bool = False,
        pooling: str = "mean",
    ) -> None:
        """kv_pool_tokens: the KV positions the running requests hold together (at least
        one context); None: max_running whole contexts, so nothing is ever preempted.
        kv_keep_tokens: the most positions finished requests' K/V may keep of that pool
        for later requests to share (engine/kv/finished.py); 0: none is kept.
        encoder: the model's attention is bidirectional, so it serves embeddings only;
        pooling: how the APIs pool embeddings (engine/pooling.py)."""
        self.target = target
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.model_name = model_name
        self.context_length = context_length
        self.max_queue = max_queue
        self.max_queued_tokens = max_queued_tokens
        self.default_max_tokens = default_max_tokens
        self.block_size = block_size
        self.lookup_drafts = lookup_drafts  # --draft ngram: prompt lookup, no draft model
        self.lookup_ngrams = (4, 2)  # its longest and shortest n-gram (spec/ngram.py)
        self.adaptive_blocks = adaptive_blocks
        self.step_costs = StepCosts()  # the adaptive window size's cost model
        self.metrics = metrics
        self.started_at = time.time()
        self.draining = False
        self.loaded_once = False
        self.max_running = max_running
        pool = kv_pool_tokens or max_running * context_length
        if pool < context_length:
            raise ValueError(
                f"the KV pool ({pool} positions) must hold one whole context "
                f"({context_length}): else a long request could never finish"
            )
        self.kv = KVBudget(pool)
        keep = min(kv_keep_tokens, pool)
        self.finished = FinishedPrefixes(self.kv, max_running, keep) if keep else None
        self.scheduler = Scheduler(
            max_running=max_running,
            max_step_tokens=target.step_tokens,
            chunk=self._chunk(target.placement.max_batch_tokens),
            kv=self.kv,
            observe=self._observe,
            drafted=self._drafted,
        )
        self.scheduler.window = self._window
        self.scheduler.room = self._room
        self.scheduler.keep = self._keep_lane
        self.scheduler.encoder = self.encoder = encoder
        self.pooling = pooling
        self.runner = ModelRunner(target)
        turns = TurnMarker.learn(chat_template, tokenizer)  # the prefix cache's cut points
        self.prefix = PrefixReuse(
            target, prefix_cache, turns, self.kv, self._observe, self.finished
        )
        self.rejected: dict[str, int] = {}  # refused submissions by reason
        self._tickets = itertools.count(1)
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
        # Built once, on the first grammar (seconds on a large vocabulary): requests arriving
        # meanwhile await the same build.
        self._grammar_vocab: asyncio.Future[GrammarTokenizer] | None = None
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

    def queued_tokens(self) -> int:
        """Prompt tokens waiting; a sibling's (`share_prompt`) are its first's."""
        waiting = self.scheduler.waiting
        return sum(s.handle.prompt_tokens for s in waiting if not s.handle.request.share_prompt)

    @property
    def embedding_limit(self) -> int:
        """The most tokens an embedding input may have: the context, and for an encoder,
        which sees its input in one step, the step's budget."""
        if self.encoder:
            return min(self.context_length, self.target.step_tokens)
        return self.context_length

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
        n = len(req.prompt)
        if n == 0:
            raise ContextTooLong("the prompt is empty")
        if req.pooling is not None:
            self._check_embedding(n)
            max_tokens = 0
        else:
            max_tokens = self._check_generation(req, n)
        if req.grammar is not None:
            try:
                check_grammar(req.grammar)  # vocabulary-free: the matcher is built later
            except GrammarError as exc:
                raise InvalidGrammar(f"grammar: {exc}") from None
        waiting = self.scheduler.waiting
        queued = 0 if req.share_prompt else n  # a sibling's prompt is its first's
        if not self.queue_takes(queued):
            full = len(waiting) >= self.max_queue
            raise QueueFull(
                f"the queue is full ({len(waiting)} requests, {self.queued_tokens()} "
                "prompt tokens waiting)",
                retry_after=float(max(1, len(waiting))),
                reason="max_queue" if full else "max_queued_tokens",
            )
        handle = RequestHandle(req, max_tokens)
        seq = self._sequence(handle)
        handle.on_cancel = lambda _: self._cancelled(seq)
        self.scheduler.add(seq)
        self.totals["requests"] += 1
        self._idle.clear()
        self._observe("queue", len(waiting))
        if req.grammar is not None:
            self._spawn(self._constrain(seq), f"grammar-{req.request_id}")
        self._wakeup.set()
        return handle

    def queue_takes(self, n: int) -> bool:
        """Whether a request of n prompt tokens finds room in the queue now."""
        waiting = self.scheduler.waiting
        if len(waiting) >= self.max_queue:
            return False
        return not waiting or self.queued_tokens() + n <= self.max_queued_tokens

    def _check_embedding(self, n: int) -> None:
        limit = self.embedding_limit
        if n > limit:
            why = "the context length"
            if limit < self.context_length:
                why = "--max-step-tokens: an encoder sees a whole input in one step"
            raise ContextTooLong(f"the input has {n} tokens; at most {limit} fit ({why})")

    def check_generates(self) -> None:
        """EmbeddingsOnly (400) when the model cannot generate (an encoder). The APIs ask
        before they render a prompt; `submit` asks again."""
        if self.encoder:
            raise EmbeddingsOnly(
                f"{self.model_name} is an embedding model (bidirectional attention): it "
                "cannot generate text; it serves POST /v1/embeddings"
            )

    def _check_generation(self, req: GenerationRequest, n: int) -> int:
        """-> the request's max_tokens."""
        self.check_generates()
        if n >= self.context_length:
            raise ContextTooLong(
                f"the prompt has {n} tokens; the context holds {self.context_length} "
                "(prompt plus at least one generated token)"
            )
        room = self.context_length - n
        if req.max_tokens is not None and req.max_tokens > room:
            raise ContextTooLong(
                f"prompt ({n} tokens) + max_tokens ({req.max_tokens}) exceeds the context "
                f"length {self.context_length}"
            )
        return req.max_tokens or min(room, self.default_max_tokens or room)

    def _sequence(self, handle: RequestHandle) -> Sequence:
        req = handle.request
        stops = set(req.stop_token_ids) | (set() if req.ignore_eos else self.tokenizer.eos_ids)
        out = OutputBuilder(self.tokenizer, req.stop, want_logprobs=req.params.logprobs is not None)
        seq = Sequence(
            handle,
            ticket=next(self._tickets),
            sampling=req.params.to_wire(),
            stops=frozenset(stops),
            out=out,
            tokens=list(req.prompt),
            ready=req.grammar is None,
            waits_to_share=req.share_prompt,  # `PrefixReuse.hold`: any prefix is worth it
        )
        if req.pooling is not None:
            seq.pooler = Pooler(req.pooling, len(req.prompt))
            return seq
        seq.speculates = self.target.draft is not None or self.lookup_drafts
        if self.lookup_drafts:
            seq.lookup = PromptLookup(*self.lookup_ngrams)
            seq.lookup.extend(req.prompt)
        # A seeded sampled request keeps the fixed window: which uniforms its generator
        # draws for what depends on the window sizes, and timing-driven sizes would make the
        # same seed give other tokens. Greedy output does not depend on them at all.
        if (
            seq.speculates
            and self.adaptive_blocks
            and (req.params.greedy or req.params.seed is None)
        ):
            # A lookup starts from its priors, not --block-size: its fresh matches are often
            # wrong, and a first window of 16 costs several plain steps.
            priors = PromptLookup.FIRST_ACCEPTANCE if self.lookup_drafts else None
            seq.sizer = BlockSizer(self.step_costs, self.block_size, priors=priors)
        return seq

    async def _constrain(self, seq: Sequence) -> None:
        """The request's grammar over this model's vocabulary, built off the event loop:
        the vocabulary once (seconds for a large vocabulary), the matcher per request."""
        grammar = seq.handle.request.grammar
        assert grammar is not None
        try:
            if self._grammar_vocab is None:
                build = asyncio.to_thread(GrammarTokenizer, self.tokenizer)
                self._grammar_vocab = asyncio.ensure_future(build)
            vocab = await asyncio.shield(self._grammar_vocab)
            matcher = await asyncio.to_thread(vocab.matcher, grammar)
        except GrammarError as exc:  # valid alone, but not over this vocabulary
            if self.scheduler.cancel_waiting(seq):
                self._end(seq, "error", f"grammar: {exc}")
            return
        seq.constraint = Constraint(matcher, vocab, seq.stops, self.target.arrays["allowed"])
        seq.ready = True
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
        fits = self.target.step_tokens - self.max_running
        if fits < 1:
            raise ValueError(
                f"a step of {self.target.step_tokens} tokens cannot feed {self.max_running} "
                "running requests and a prompt chunk: raise --max-step-tokens"
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
        """Free in the workers the kept lanes the budget gave up."""
        if self.finished is None:
            return
        for lane in self.finished.forget_evicted():
            with contextlib.suppress(Exception):  # a dead worker forgot it anyway
                await self.target.release(lane)

    def _keep_lane(self, seq: Sequence) -> int | None:
        """The kept lane a finished sequence's K/V moves to, or None (freed): kept when it
        ended well, the workers share blocks, and no feature ring would need its rows.
        Only its prompt's positions are kept, as only a running sequence's prompt is
        shared: decode steps computed the output's rows in other groupings than a fresh
        prefill would, and reused they would break restored == fresh."""
        if (
            self.finished is None
            or seq.pooler is not None
            or seq.handle.finish_reason == "error"
            or not self.target.ready
            or not self.target.shares_prefixes
            or self.target.capture is not None
        ):
            return None
        return self.finished.lane_for(seq.prompt[: seq.computed])

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

    def _window(self, seq: Sequence) -> tuple[int, str]:
        """The draft window `seq` asks for this step and what drafts it: (1, "") for a
        plain step."""
        if not seq.speculates:
            return 1, ""
        kind = seq.lookup.kind() if seq.lookup is not None else "draft"
        if kind is None:
            return 1, ""  # the lookup found nothing to propose
        want = seq.sizer.next_block(kind) if seq.sizer is not None else self.block_size
        return min(want, self.block_size, MAX_BLOCK), kind

    def _room(self, seq: Sequence, want: int) -> int:
        """How many positions a window may feed from `seq`'s committed ones: with KV Flash,
        no more than needs no eviction past the first chunk (`Pager.lookahead`)."""
        flash = self.target.flash(seq.slot)
        return want if flash is None else flash.pager.lookahead(seq.computed, want)

    def _drafted(self, proposed: int, accepted: int) -> None:
        self.totals["spec_drafts"] += 1
        self.totals["spec_accepted_tokens"] += accepted
        if self.metrics is not None:
            self.metrics.observe_spec_decode(proposed, [1] * accepted + [0] * (proposed - accepted))

    async def calibrate(self, sizes: tuple[int, ...] = (2, 4, 8, 16, 32)) -> dict[int, float]:
        """Measure the adaptive window size's cost model before the first request
        (``spec/calibrate.py``)."""
        sizes = tuple(sorted({b for b in sizes if b < self.block_size} | {self.block_size}))
        seq = self._sequence(
            RequestHandle(
                GenerationRequest("calibrate", [self.tokenizer.bos_id or 0] * 8, _GREEDY),
                1 << 20,
            )
        )
        return await calibrate(self.runner, self.step_costs, seq, sizes, self.lookup_drafts)

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
            self.step_costs.observe(len(only.tokens), seconds)  # a step of its own

    def _observe_finish(self, handle: RequestHandle) -> None:
        if self.metrics is not None and handle.finish_reason is not None:
            self.metrics.request_finished(handle)

    def status(self) -> dict:
        return engine_status(self)

    def workers(self) -> list[dict]:
        return self.target.describe()
