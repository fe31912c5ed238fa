"""The engine: a bounded request queue and the generation loop, owned by the event loop.

    handle = engine.submit(GenerationRequest(...))   # raises EngineError (429/400/503)
    async for delta in handle: ...                    # text deltas, token ids, logprobs
    handle.finish_reason                              # "stop" | "length" | "abort" | "error"

Up to max_running generations run at once, each in its own lane (sequence) of the
target, their decode steps batched (``batcher.py``). Each step is one small command to
the target (a frame round trip); between steps the loop checks cancellation, so a client
that disconnects stops its work within one step (prefill: within one chunk). Text is
detokenized incrementally and matched against stop strings in the daemon
(``output.py``). A request with a grammar is constrained by it (``constraint.py``).

The running requests' KV shares one pool of positions (``kv_budget.py``): a request is
admitted when its prompt fits, and when a running one cannot grow, the request that
arrived last is preempted: its KV is freed (its sampler kept), it waits at the head of the
queue, and it resumes by recomputing its prompt and output so far, exactly where it was.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import statistics
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from luced.acceptance import clip, verify_greedy
from luced.cache.prefix_cache import Hit, PrefixCache
from luced.engine.batcher import StepBatcher
from luced.engine.block_size import BlockSizer, StepCosts
from luced.engine.constraint import Constraint
from luced.engine.executor import WorkerDied, WorkerReplyError, kernels_summary
from luced.engine.kv_budget import KVBudget
from luced.engine.lookup import PromptLookup
from luced.engine.output import Delta, OutputBuilder
from luced.engine.target import BatchStep, Sampled, Target
from luced.sampling_params import SamplingParams
from luced.text.grammar import GrammarError, GrammarTokenizer, check_grammar
from luced.text.tokenizer import Tokenizer
from luced.text.turns import TurnMarker

log = logging.getLogger(__name__)

# Chat-turn boundaries whose recurrent state a hybrid's snapshot keeps besides its end (the
# latest ones: a conversation that branches does so near its end). Each costs one state.
MAX_STATE_CUTS = 4


class EngineError(Exception):
    status = 500
    code = "internal_error"

    def __init__(
        self, message: str, retry_after: float | None = None, reason: str | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after = retry_after
        self.reason = reason or self.code  # what the rejection counters call it


class QueueFull(EngineError):
    status = 429
    code = "queue_full"


class ContextTooLong(EngineError):
    status = 400
    code = "context_length_exceeded"


class Unavailable(EngineError):
    status = 503
    code = "unavailable"


class InvalidGrammar(EngineError):
    status = 400
    code = "invalid_grammar"


# Why a preempted request ends when a worker dies: what it had streamed cannot be continued.
RESUME_LOST = "the model worker failed: it died while this request waited to resume"

# Prompt positions worth waiting for another request's prefill to share: fewer cost about
# as much to compute as to wait for.
WAIT_TO_SHARE = 64


def _request_row(h: RequestHandle, now: float) -> dict:
    return {
        "id": h.request_id,
        "prompt_tokens": h.prompt_tokens,
        "completion_tokens": h.completion_tokens,
        "age_s": round(now - h.submitted_at, 1),
    }


def _common_prefix(a: list[int], b: list[int]) -> int:
    """The length of the longest common prefix of two token lists (compared in numpy:
    waiting requests compare whole prompts after every prefill chunk)."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(differ[0]) if differ.size else n


async def _first_row(rows: Awaitable[list[Sampled]]) -> Sampled:
    """A batched decode step's one row."""
    return (await rows)[0]


class Preempted(Exception):
    """The running request gives its KV up to an older one and waits to be recomputed."""


@dataclass
class Resume:
    """Where a preempted request stopped: the ids its KV held (recomputed on resume), the
    token sampled next (not fed yet; `emitted` when the client has it already), and its
    detokenizer."""

    fed: list[int]
    pending: Sampled
    emitted: bool
    out: OutputBuilder


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # llguidance Lark grammar (luced.text.grammar): every token is constrained by it, and
    # the request stops ("stop") once the grammar is complete.
    grammar: str | None = None


_END = object()


class RequestHandle:
    def __init__(self, req: GenerationRequest, max_tokens: int) -> None:
        self.request = req
        self.request_id = req.request_id
        self.prompt_tokens = len(req.prompt)
        self.max_tokens = max_tokens
        self.completion_tokens = 0
        self.finish_reason: str | None = None
        self.stop_string: str | None = None  # the stop string that ended it, if one did
        self.error: str | None = None
        self.cancelled = False
        self.on_cancel: Callable[[RequestHandle], None] | None = None
        self.submitted_at = time.monotonic()
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        # DFlash counts for this request (reported in usage).
        self.spec = {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0}
        self.cached_tokens = 0  # prompt tokens restored from the prefix cache
        self.constraint: Constraint | None = None  # while generating under a grammar
        # Preemption (kv_budget.py): arrival order, the tokens emitted so far, whether an
        # older request asked this one to give its KV up, and where it stopped if it did.
        self.ticket = 0
        self.generated: list[int] = []
        self.preempt = False
        self.resume: Resume | None = None
        self.lane = 0  # kept while preempted: the workers hold its sampler there
        # While its prompt (or recompute) is being prefilled: the ids its lane will hold,
        # so a request arriving with the same beginning can wait to share them.
        self.prefilling: list[int] | None = None
        self._events: asyncio.Queue[Any] = asyncio.Queue()

    def cancel(self) -> None:
        """The client went away: leave the queue now, or stop at the next step."""
        if not self.cancelled:
            self.cancelled = True
            if self.on_cancel is not None:
                self.on_cancel(self)

    def _emit_if(self, delta: Delta | None) -> None:
        if delta is not None:
            self._events.put_nowait(delta)

    def _finish(self, reason: str, error: str | None = None) -> None:
        if self.finish_reason is None:
            self.finish_reason, self.error = reason, error
            self._events.put_nowait(_END)

    async def __aiter__(self) -> AsyncIterator[Delta]:
        while True:
            item = await self._events.get()
            if item is _END:
                return
            yield item


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
    ) -> None:
        """kv_pool_tokens: the KV positions the running requests hold together (at least
        one context); None: max_running whole contexts, so nothing is ever preempted."""
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
        self.lookup_ngrams = (4, 2)  # its longest and shortest n-gram (lookup.py)
        self.adaptive_blocks = adaptive_blocks
        self.step_costs = StepCosts()  # the adaptive block size's cost model
        self.block_sizes: Counter[int] = Counter()  # speculative steps by block (1: plain)
        self.metrics = metrics
        self.prefix_cache = prefix_cache
        self.turns = TurnMarker.learn(chat_template, tokenizer)  # the cache's cut points
        self.started_at = time.time()
        self.draining = False
        self.loaded_once = False
        self.waiting: deque[RequestHandle] = deque()
        self.rejected: Counter[str] = Counter()  # refused submissions by reason
        # Continuous batching: up to max_running requests at once, each in its own task and
        # lane (sequence) of the target, their decode steps batched (batcher.py). With 1,
        # the loop serves one request at a time in lane 0, as it always did.
        self.max_running = max_running
        self.running: dict[int, RequestHandle] = {}  # lane -> its request
        self.batcher = StepBatcher(target, self._observe) if max_running > 1 else None
        pool = kv_pool_tokens or max_running * context_length
        if pool < context_length:
            raise ValueError(
                f"the KV pool ({pool} positions) must hold one whole context "
                f"({context_length}): else a long request could never finish"
            )
        self.kv = KVBudget(pool) if max_running > 1 else None
        self.preempted: dict[int, RequestHandle] = {}  # lane -> its preempted request
        self._kv_freed = asyncio.Event()  # replaced by a new one each time KV is freed
        self._prefilled = asyncio.Event()  # renewed each time a prefill chunk ends
        self._tickets = itertools.count(1)
        self._tasks: set[asyncio.Task] = set()
        self._cache_lock = asyncio.Lock()  # one prefix-cache restore or save at a time
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
        self._wakeup = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._loop_task: asyncio.Task | None = None
        self._grammar_vocab: GrammarTokenizer | None = None  # built on the first grammar
        target.watch(self._workers_changed)

    # -- state ----------------------------------------------------------------------------

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

    def queued_tokens(self) -> int:
        return sum(h.prompt_tokens for h in self.waiting)

    # -- submission -----------------------------------------------------------------------

    def submit(self, req: GenerationRequest) -> RequestHandle:
        """Queue a request; EngineError (429 / 400 / 503) when it cannot be, counted by
        reason (`rejected` in the status, luced:request_rejected_total)."""
        try:
            return self._admit(req)
        except EngineError as exc:
            self.rejected[exc.reason] += 1
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
        max_tokens = req.max_tokens or min(room, self.default_max_tokens or room)
        if req.grammar is not None:
            try:
                check_grammar(req.grammar)  # vocabulary-free: the matcher is built later
            except GrammarError as exc:
                raise InvalidGrammar(f"grammar: {exc}") from None
        full = len(self.waiting) >= self.max_queue
        if full or (self.waiting and self.queued_tokens() + n > self.max_queued_tokens):
            raise QueueFull(
                f"the queue is full ({len(self.waiting)} requests, {self.queued_tokens()} "
                "prompt tokens waiting)",
                retry_after=self._retry_after(),
                reason="max_queue" if full else "max_queued_tokens",
            )
        handle = RequestHandle(req, max_tokens)
        handle.ticket = next(self._tickets)
        handle.on_cancel = self._drop_if_queued
        self.waiting.append(handle)
        self.totals["requests"] += 1
        self._observe("queue", len(self.waiting))
        self._wakeup.set()
        return handle

    async def _constrain(self, handle: RequestHandle, stops: set[int]) -> None:
        """The request's grammar over this model's vocabulary, built off the event loop:
        the vocabulary once (0.24 s for SmolLM2's 49k tokens, 2.9 s for Gemma's 262k),
        the matcher per request (milliseconds for a JSON schema)."""
        grammar = handle.request.grammar
        if grammar is None:
            return
        if self._grammar_vocab is None:
            self._grammar_vocab = await asyncio.to_thread(GrammarTokenizer, self.tokenizer)
        vocab = self._grammar_vocab
        matcher = await asyncio.to_thread(vocab.matcher, grammar)
        handle.constraint = Constraint(matcher, vocab, stops, self.target.token_masks)

    def _drop_if_queued(self, handle: RequestHandle) -> None:
        """A queued request whose client left frees its place at once."""
        if handle in self.waiting:
            self._leave_queue(handle, "abort")

    def _leave_queue(self, handle: RequestHandle, reason: str, error: str | None = None) -> None:
        """End a queued request without running it."""
        self.waiting.remove(handle)
        if self.preempted.get(handle.lane) is handle:  # the workers keep its sampler
            del self.preempted[handle.lane]
            self._spawn(self._release(handle.lane), f"release-{handle.lane}")
        self._observe("queue", len(self.waiting))
        handle._finish(reason, error)
        self._observe_finish(handle)
        if not self.waiting and not self.running:
            self._idle.set()

    def _workers_changed(self) -> None:
        """A worker started, was loaded, died or failed to restart (`Target.watch`).

        While a worker is down the queue waits for its restart (`_next_lane`), and only
        the requests whose state was in the workers fail: the running ones at their next
        call, the preempted ones here (a seeded generator lived in the dead worker, and
        they have streamed tokens). A failed restart ends the queue with a 503: the
        worker is retried with backoff, and may not come back soon."""
        if not self.target.ready:
            for handle in [h for h in self.waiting if h.resume is not None]:
                self.totals["errors"] += 1
                self._leave_queue(handle, "error", RESUME_LOST)
            if (error := self.target.restart_error) is not None:
                message = f"the model worker could not be restarted ({error}); try again later"
                for handle in list(self.waiting):
                    self._leave_queue(handle, "abort", message)
        self._wakeup.set()

    def _retry_after(self) -> float:
        return float(max(1, len(self.waiting)))

    # -- the loop -------------------------------------------------------------------------

    def start(self) -> None:
        self.loaded_once = True  # a worker that dies from here on is restarted: "degraded"
        self._loop_task = asyncio.get_running_loop().create_task(self._run(), name="engine")

    @property
    def active(self) -> RequestHandle | None:
        """A running request (the one, when one runs at a time)."""
        return next(iter(self.running.values()), None)

    async def stop(self) -> None:
        """End everything still queued or running with an error, then stop the loop."""
        unfinished = [*self.waiting, *self.running.values()]
        for task in [self._loop_task, *self._tasks]:
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self.batcher is not None:
            await self.batcher.close()
        for handle in unfinished:
            handle._finish("error", "luced is shutting down")
            self._observe_finish(handle)
        self.waiting.clear()

    async def drain(self, timeout: float | None = None) -> bool:
        """Stop accepting; wait (up to timeout) until queued and running work is done."""
        self.draining = True
        try:
            async with asyncio.timeout(timeout):
                while self.waiting or self.running:
                    self._idle.clear()
                    await self._idle.wait()
            return True
        except TimeoutError:
            return False

    async def _run(self) -> None:
        task = asyncio.current_task()
        while True:
            # stop() waits for this loop to end: a cancel that awaited code swallowed (as
            # wait_for can on 3.11) must still end it, not leave it to take the next request.
            if task is not None and task.cancelling():
                raise asyncio.CancelledError
            while (lane := self._next_lane()) is None:
                self._wakeup.clear()
                await self._wakeup.wait()
            handle = self.waiting.popleft()
            self._observe("queue", len(self.waiting))
            if self.max_running == 1:
                await self._serve(handle, 0)
                continue
            # First come, first served: each admitted request runs beside the others from
            # here, its KV reserved in the pool (_next_lane checked that it fits).
            self.preempted.pop(lane, None)
            handle.lane = lane
            assert self.kv is not None
            self.kv.admit(lane, handle.ticket, self._kv_need(handle))
            self.running[lane] = handle
            self._spawn(self._serve(handle, lane), f"lane-{lane}")

    def _spawn(self, work: Any, name: str) -> None:
        task = asyncio.create_task(work, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _next_lane(self) -> int | None:
        """The lane the queue's first request runs in, if it can start now: every worker is
        ready (a dead one is restarting), a lane is free (a preempted request has its own)
        and its KV fits in the pool."""
        if not self.waiting or len(self.running) >= self.max_running or not self.target.ready:
            return None
        if self.max_running == 1:
            return 0
        handle = self.waiting[0]
        assert self.kv is not None
        if not self.kv.fits(self._kv_need(handle)):
            return None
        if handle.resume is not None:
            return handle.lane
        # Lanes 1..max_running (lane 0 is the target's default sequence).
        free = set(range(1, self.max_running + 1)) - self.running.keys() - self.preempted.keys()
        return min(free, default=None)

    @staticmethod
    def _kv_need(handle: RequestHandle) -> int:
        """The positions a request's prefill (or recompute) feeds."""
        return len(handle.resume.fed) if handle.resume else handle.prompt_tokens

    async def _room(self, handle: RequestHandle, lane: int, end: int) -> None:
        """Reserve the lane's KV up to `end` positions before feeding them. When the pool is
        full, the request that arrived last gives way: this one (Preempted), or a younger
        one, which is asked to and waited for. A lane that waits leaves the step batch, so
        the others (the younger one among them) keep stepping meanwhile."""
        kv = self.kv
        if kv is None:
            return
        while True:
            if handle.preempt:
                raise Preempted
            if kv.grow(lane, end):
                return
            victim = kv.newest()
            if victim == lane:
                raise Preempted
            self.running[victim].preempt = True
            self._notify_kv()  # wakes the victim if it waits here too
            freed = self._kv_freed
            if self.batcher is not None and lane in self.batcher.decoding:
                self.batcher.leave(lane)
                try:
                    await freed.wait()
                finally:
                    self.batcher.join(lane)
            else:
                await freed.wait()

    def _notify_kv(self) -> None:
        self._kv_freed.set()
        self._kv_freed = asyncio.Event()

    def _requeue(self, handle: RequestHandle, lane: int) -> None:
        """A preempted request back in the queue, in its place by arrival (before every
        request that came after it), its lane kept for it."""
        handle.preempt = False
        if handle.resume is not None:  # else it starts over: nothing was drawn yet
            self.preempted[lane] = handle
        self.totals["preemptions"] += 1
        self._observe("preemptions", 1)
        after = next((i for i, h in enumerate(self.waiting) if h.ticket > handle.ticket), None)
        self.waiting.insert(len(self.waiting) if after is None else after, handle)
        self._observe("queue", len(self.waiting))
        log.info(
            "request %s preempted after %d tokens: its KV is freed; it resumes by recomputing %d",
            handle.request_id,
            handle.completion_tokens,
            self._kv_need(handle),
        )

    async def _serve(self, handle: RequestHandle, lane: int) -> None:
        self.running[lane] = handle
        self._observe("running", len(self.running))
        preempted = False
        try:
            self.target.bind_lane(lane)
            await self._generate(handle, lane)
        except Preempted:
            preempted = True
        except Exception as exc:  # never let one request kill the loop
            log.exception("request %s failed", handle.request_id)
            handle._finish("error", f"internal error: {exc}")
        finally:
            if lane:  # its KV is freed in the workers (a long request's is large)
                await self._release(lane, keep_sampler=preempted and handle.resume is not None)
            del self.running[lane]
            if preempted:
                self._requeue(handle, lane)
            else:
                self._observe_finish(handle)
            self._observe("running", len(self.running))
            if not self.running and not self.waiting:
                self._idle.set()
            self._wakeup.set()  # a lane is free

    async def _release(self, lane: int, keep_sampler: bool = False) -> None:
        """Free a lane's KV in the workers and in the pool."""
        with contextlib.suppress(Exception):
            await self.target.release(lane, keep_sampler)
        if self.kv is not None:
            self.kv.release(lane)
            self._notify_kv()

    async def _generate(self, handle: RequestHandle, lane: int = 0) -> None:
        req = handle.request
        sampling = req.params.to_wire()
        k = req.params.logprobs  # None: no logprobs; k: chosen token's + top k
        stops = set(req.stop_token_ids) | (set() if req.ignore_eos else self.tokenizer.eos_ids)
        speculate = self.target.draft is not None or self.lookup_drafts
        try:
            if (resume := handle.resume) is not None:
                if not await self._recompute(handle, resume):
                    handle._finish("abort")
                    return
                handle.resume = None
                sampled, out, emitted = resume.pending, resume.out, resume.emitted
            else:
                out = OutputBuilder(
                    self.tokenizer, req.stop, want_logprobs=req.params.logprobs is not None
                )
                emitted = False
                await self.target.reset()
                await self._await_shared_prefix(handle, lane)
                # From here until its prefill ends, requests arriving with the same beginning
                # may wait to share it (set before any await: they look at once).
                handle.prefilling = req.prompt
                try:
                    async with self._cache_lock:  # an entry must not be evicted while restored
                        handle.cached_tokens = cached = await self._reuse_prefix(req.prompt, lane)
                    cuts = self._cut_points(req.prompt, cached)
                    await self._constrain(handle, stops)
                    sampled = await self._prefill(handle, req.prompt[cached:], sampling, k, cuts)
                finally:
                    self._prefill_ended(handle)
                if handle.preempt:  # an older request needs the KV: start over later
                    raise Preempted
                if sampled is None:  # cancelled during the prefill
                    handle._finish("abort")
                    return
                self.totals["prompt_tokens"] += handle.prompt_tokens
                self.totals["cached_prompt_tokens"] += cached  # restored or shared, not computed
                self._observe("prompt_tokens", handle.prompt_tokens)
                async with self._cache_lock:
                    await self._save_prefix(req.prompt, cuts)
            if speculate:
                await self._decode_speculative(
                    handle, out, stops, sampled, sampling, k, lane, emitted
                )
            else:
                await self._decode_plain(handle, out, stops, sampled, sampling, k, lane)
        except (WorkerDied, WorkerReplyError) as exc:
            self.totals["errors"] += 1
            handle._finish("error", f"the model worker failed: {exc}")
        except GrammarError as exc:  # valid alone, but not over this vocabulary
            handle._finish("error", f"grammar: {exc}")

    async def _recompute(self, handle: RequestHandle, resume: Resume) -> bool:
        """A preempted request's KV again: its prompt and output so far, fed without
        sampling (the workers kept its sampler, whose generator draws on from where it
        stopped; a prefix-cache import would start it over, so none is made). False when
        the client left meanwhile."""
        handle.prefilling = resume.fed
        try:
            stop = lambda: self._between_chunks(handle)  # noqa: E731
            await self.target.prefill(resume.fed, {}, None, stop, sample=False)
        finally:
            self._prefill_ended(handle)
        if handle.preempt:
            raise Preempted
        return not handle.cancelled

    async def _prefill(
        self, handle: RequestHandle, ids: list[int], sampling: dict, k: int | None, cuts: list
    ) -> Sampled | None:
        """The prompt's uncached ids, chunk by chunk (other lanes step between chunks),
        and its first token. Under a grammar the first token's mask is written first, and
        the workers stay held until the prefill has read it."""
        prefill = self.target.prefill(
            ids,
            sampling,
            k,
            lambda: self._between_chunks(handle),
            keep_at=cuts,
            masked=handle.constraint is not None,
        )
        if handle.constraint is None:
            return await prefill
        async with self.target.holding():
            handle.constraint.fill(0)
            return await prefill

    def _between_chunks(self, handle: RequestHandle) -> bool:
        """`Target.prefill`'s question before each chunk: whether to stop. A chunk has just
        ended (the lane holds more of its prompt), so requests waiting to share it look."""
        self._notify_prefilled()
        return handle.cancelled or handle.preempt

    def _prefill_ended(self, handle: RequestHandle) -> None:
        handle.prefilling = None
        self._notify_prefilled()

    def _notify_prefilled(self) -> None:
        self._prefilled.set()
        self._prefilled = asyncio.Event()

    async def _await_shared_prefix(self, handle: RequestHandle, lane: int) -> None:
        """Hold a new request back while another running request prefills a prefix of its
        prompt at least WAIT_TO_SHARE positions longer than any lane holds now: requests
        sent together with one system prompt then compute it once and share its blocks,
        instead of each computing it beside the others. Returns when that prefill has
        passed the prefix, stopped, or this request is cancelled or preempted."""
        if self.max_running == 1 or not self.target.shares_prefixes:
            return
        prompt = handle.request.prompt
        waiting = False
        while not (handle.cancelled or handle.preempt):
            _, held = self._sharing_source(prompt, lane)
            coming = max(
                (
                    _common_prefix(prompt[:-1], other.prefilling)
                    for other_lane, other in self.running.items()
                    if other_lane != lane and other.prefilling is not None
                ),
                default=0,
            )
            if coming <= held or (not waiting and coming - held < WAIT_TO_SHARE):
                return
            waiting = True
            await self._prefilled.wait()

    async def _reuse_prefix(self, prompt: list[int], lane: int) -> int:
        """Put the prompt's longest prefix held elsewhere into the (reset) lane: a running
        request's K/V blocks, shared, or the prefix cache's snapshot, restored (a copy);
        sharing wins a tie. Returns the positions that need no computing."""
        cache = self.prefix_cache
        hit = None
        if cache is not None:
            self._observe("prefix_queries", len(prompt))
            hit = cache.lookup(prompt)
        source, common = self._sharing_source(prompt, lane)
        if common and common >= (hit.n if hit is not None else 0):
            try:
                shared = await self.target.share(source, common)
            except WorkerReplyError as exc:  # the lane is reset: restore or compute instead
                log.warning("sharing %d prompt tokens of lane %d failed: %s", common, source, exc)
                shared = 0
            if shared:
                self.totals["shared_prompt_tokens"] += shared
                self._observe("prefix_shared", shared)
                if self.kv is not None:  # charged once, to the source: room for others
                    self.kv.share(lane, source, shared)
                    self._notify_kv()
                    self._wakeup.set()
                return shared
        return await self._restore_prefix(hit) if hit is not None else 0

    def _sharing_source(self, prompt: list[int], lane: int) -> tuple[int, int]:
        """(lane, n): the running request whose committed K/V holds the longest prefix of
        `prompt`, at most all but its last token (the last one is fed to sample from); n is
        0 when there is none."""
        if self.max_running == 1 or not self.target.shares_prefixes:
            return 0, 0
        best = (0, 0)
        for other, handle in self.running.items():
            if other == lane or handle.preempt:
                continue
            # Its first positions hold its prompt (after a preemption its prompt and output).
            common = min(
                _common_prefix(prompt[:-1], handle.request.prompt),
                self.target.lane_position(other),
            )
            if common > best[1]:
                best = (other, common)
        return best

    async def _restore_prefix(self, hit: Hit) -> int:
        """Restore a prefix-cache hit into the (reset) target; tokens restored."""
        cache = self.prefix_cache
        assert cache is not None
        try:
            restored = await cache.restore(hit, self.target)
        except WorkerReplyError as exc:  # a refused import changes nothing: prefill it all
            log.warning("prefix cache: restoring %s failed (%s); prefilling", hit.entry_id, exc)
            await self.target.reset()
            return 0
        self._observe("prefix_hits", restored)
        return restored

    def _cut_points(self, prompt: list[int], cached: int) -> list[int]:
        """Where the prompt's snapshot may be restored besides its end: the chat-turn
        boundaries. A recurrent model's state exists only where its prefill stopped, so for
        it these are the restored position and the latest MAX_STATE_CUTS boundaries past
        it (the prefill stops and keeps the state at each: exact-cut mode)."""
        if self.prefix_cache is None:
            return []
        cuts = self.turns.cuts(prompt) if self.turns is not None else []
        if not self.target.recurrent:
            return cuts
        later = [c for c in cuts if cached < c < len(prompt)][-MAX_STATE_CUTS:]
        return [cached, *later] if cached else later

    async def _save_prefix(self, prompt: list[int], cuts: list[int]) -> None:
        """Snapshot the prompt's KV (the target holds exactly the prompt now), restorable
        at `cuts` (`_cut_points`) and the end. The disk copy is written in the background."""
        if self.prefix_cache is None:
            return
        if not self.target.identity_layout:
            log.debug(
                "prefix cache: no snapshot of %d tokens: KV Flash paged chunks out "
                "(snapshots need the identity layout; page-table serialization is not done)",
                len(prompt),
            )
            return
        try:
            await self.prefix_cache.save(prompt, len(prompt), self.target, cuts)
        except WorkerReplyError as exc:  # the request goes on; only the snapshot is lost
            log.warning("prefix cache: snapshot of %d tokens failed: %s", len(prompt), exc)

    def _emit(
        self, handle: RequestHandle, out: OutputBuilder, sampled: Sampled, stops: set
    ) -> bool:
        """Emit one generated token; True when it ended the request (EOS, stop string,
        max_tokens)."""
        now = time.monotonic()
        if handle.first_token_at is None:
            handle.first_token_at = now
            self._observe("ttft", now - handle.submitted_at)
        elif handle.last_token_at is not None:
            self._observe("itl", now - handle.last_token_at)
        handle.last_token_at = now
        if sampled.token in stops:
            handle._emit_if(out.flush())
            handle._finish("stop")
            return True
        if handle.constraint is not None:
            handle.constraint.advance(sampled.token)
        handle.completion_tokens += 1
        handle.generated.append(sampled.token)
        self.totals["generation_tokens"] += 1
        self._observe("generation_tokens", 1)
        delta, hit = out.push(sampled)
        handle._emit_if(delta)
        if hit:
            handle.stop_string = out.stops.matched
            handle._finish("stop")
            return True
        if handle.constraint is not None and handle.constraint.done:  # the grammar is complete
            handle._emit_if(out.flush())
            handle._finish("stop")
            return True
        if handle.completion_tokens >= handle.max_tokens:
            handle._emit_if(out.flush())
            handle._finish("length")
            return True
        return False

    async def _decode_plain(
        self,
        handle: RequestHandle,
        out: OutputBuilder,
        stops: set,
        sampled: Sampled,
        sampling: dict,
        k: int | None,
        lane: int = 0,
    ) -> None:
        ahead: asyncio.Future | None = None
        constraint = handle.constraint
        batcher = self.batcher
        if batcher is not None:
            batcher.join(lane)
        try:
            while not handle.cancelled:
                try:  # the KV holds the prompt and every emitted token; `sampled` is next
                    await self._room(handle, lane, self.target.lane_position(lane) + 1)
                except Preempted:
                    fed = [*handle.request.prompt, *handle.generated]
                    handle.resume = Resume(fed, sampled, emitted=False, out=out)
                    raise
                # Send the next step before detokenizing and streaming this token, so the
                # worker computes while the daemon formats (if this token ends the request,
                # that one step is wasted). Under a grammar the token is consumed first
                # (in _emit): the next step's mask depends on it.
                last = sampled.token in stops or handle.completion_tokens + 1 >= handle.max_tokens
                if constraint is None and not last:
                    if batcher is not None:  # returns once the batch is sent
                        step = BatchStep(lane, sampled.token, sampling, k)
                        ahead = asyncio.ensure_future(_first_row(await batcher.submit(step)))
                    else:
                        ahead = asyncio.ensure_future(self.target.step(sampled.token, sampling, k))
                        await asyncio.sleep(0)  # the step's task runs up to its frame's send
                if self._emit(handle, out, sampled, stops):
                    return
                if constraint is not None and batcher is not None:  # its mask written in the batch
                    step = BatchStep(lane, sampled.token, sampling, k, fill=constraint.fill)
                    ahead = asyncio.ensure_future(_first_row(await batcher.submit(step)))
                elif constraint is not None:
                    step = self._masked_step(constraint, sampled, sampling, k)
                    ahead = asyncio.ensure_future(step)
                assert ahead is not None
                sampled = await ahead
                ahead = None
            handle._finish("abort")
        finally:
            if ahead is not None:  # let a step that ran past the end land first
                with contextlib.suppress(Exception):
                    await ahead
            if batcher is not None:
                batcher.leave(lane)

    async def _masked_step(
        self, constraint: Constraint, sampled: Sampled, sampling: dict, k: int | None
    ) -> Sampled:
        """A step under a grammar: its mask written and read with the workers held (the
        masks' region is shared by the lanes)."""
        async with self.target.holding():
            constraint.fill(0)
            return await self.target.step(sampled.token, sampling, k, masked=True)

    async def _decode_speculative(
        self,
        handle: RequestHandle,
        out: OutputBuilder,
        stops: set,
        first: Sampled,
        sampling: dict,
        k: int | None,
        lane: int = 0,
        emitted: bool = False,
    ) -> None:
        """DFlash: draft a block after the anchor, verify it in one target forward, emit the
        accepted proposals and the target's own next token, roll the KV back to what was
        accepted; that last token is the next anchor (emitted, not yet fed).

        Greedy requests accept by comparing with the target's argmax (here); sampled ones
        by rejection sampling in the head's worker, which holds the target's distributions
        and the request's generator (the draft's q rows wait there in shared memory). Either
        way the target's rows carry the request's penalties (each row its own history) and
        logprobs, so the output is exactly what plain decoding would produce.

        The drafter is the DFlash model, or with ``--draft ngram`` a prompt lookup in the
        daemon (point-mass q). The block size adapts to the request's acceptance
        (``block_size.py``); a block of 1, or a lookup that finds nothing, is a plain step.
        `emitted`: `first` was streamed already (a preempted request resuming).
        """
        greedy = handle.request.params.greedy
        lookup = PromptLookup(*self.lookup_ngrams) if self.lookup_drafts else None
        if lookup is not None:
            lookup.extend([*handle.request.prompt, *handle.generated])
            if not emitted:
                lookup.extend([first.token])
        # A seeded sampled request keeps the fixed block: which uniforms its generator
        # draws for what depends on the block sizes, and timing-driven sizes would make
        # the same seed give other tokens. Greedy output does not depend on them at all.
        params = handle.request.params
        adapt = self.adaptive_blocks and (greedy or params.seed is None)
        # A lookup starts from its priors, not --block-size: its fresh matches are often
        # wrong, and a first block of 16 cost ~3 plain steps per open-chat request.
        priors = PromptLookup.FIRST_ACCEPTANCE if lookup is not None else None
        sizer = BlockSizer(self.step_costs, self.block_size, priors=priors) if adapt else None
        # Continuous batching: a greedy request's steps and verify blocks go in the batch
        # with the others' (a verify block needs no shared q rows nor masks then; a
        # hybrid's verify keeps per-position states, so it runs on its own). A model draft
        # runs on its own between batches, from the lane's own feature ring.
        batcher = self.batcher
        if not greedy or handle.constraint is not None or self.target.recurrent:
            batcher = None
        if not emitted and self._emit(handle, out, first, stops):
            return
        if batcher is not None:
            batcher.join(lane)
        try:
            await self._speculate(
                handle, out, stops, first.token, sampling, k, lane, batcher, lookup, sizer
            )
        finally:
            if batcher is not None:
                batcher.leave(lane)

    async def _speculate(
        self,
        handle: RequestHandle,
        out: OutputBuilder,
        stops: set,
        anchor: int,
        sampling: dict,
        k: int | None,
        lane: int,
        batcher: StepBatcher | None,
        lookup: PromptLookup | None,
        sizer: BlockSizer | None,
    ) -> None:
        """_decode_speculative's loop from `anchor` (emitted, not fed); with `batcher`, the
        steps and verify blocks go in the step batch."""
        greedy = handle.request.params.greedy
        while not handle.cancelled:
            budget = handle.max_tokens - handle.completion_tokens
            # A lookup's draft has a kind (a copy under way, a fresh match of order n, or
            # none: a plain step), and the sizer learns each kind's acceptance.
            kind = lookup.kind() if lookup is not None else "draft"
            wanted = self.block_size
            if kind is None:
                wanted = 1
            elif sizer is not None:
                wanted = sizer.next_block(kind)
            # A step emits at most `wanted` tokens: drafting past the budget is wasted work
            # (and could run the KV past the context the request was admitted with).
            wanted = min(wanted, budget)
            try:  # the KV holds the prompt and the output but the anchor (emitted)
                await self._room(handle, lane, self.target.lane_position(lane) + wanted)
            except Preempted:
                fed = [*handle.request.prompt, *handle.generated[:-1]]
                handle.resume = Resume(fed, Sampled(anchor), emitted=True, out=out)
                raise
            # Lanes share the masks and q regions: one step holds the workers throughout
            # (a batched one writes neither, and its batch takes the workers itself).
            hold = self.target.holding() if batcher is None else contextlib.nullcontext()
            async with hold:
                size = self.target.draft_room(wanted)  # KV Flash: see there
                began = time.perf_counter()
                block = await self._draft(lookup, anchor, size, None if greedy else sampling)
                constraint = handle.constraint
                if constraint is not None:  # fills every kept row's mask (constraint.py)
                    block = block[: constraint.walk(block)]
                masked = constraint is not None
                if len(block) < 2:  # a plain step (block 1, no lookup match, a KV Flash edge)
                    if batcher is not None:
                        step = BatchStep(lane, anchor, sampling, k)
                        (sampled,) = await (await batcher.submit(step))
                    else:
                        sampled = await self.target.step(anchor, sampling, k, masked=masked)
                        self.step_costs.observe(1, time.perf_counter() - began)
                    self._count_block(1)
                    if sizer is not None:
                        sizer.plain_step()
                    if lookup is not None:
                        lookup.extend([sampled.token])
                    if self._emit(handle, out, sampled, stops):
                        return
                    anchor = sampled.token
                    continue
                start = self.target.position
                if batcher is not None:  # the batch's rows after each of the block's
                    step = BatchStep(lane, anchor, sampling, k, proposals=tuple(block[1:]))
                    rows = await (await batcher.submit(step))
                    chosen = [r.token for r in rows]
                    result = verify_greedy(block, chosen, budget=budget, eos_ids=stops)
                elif greedy:
                    rows = await self.target.verify(block, sampling, k, masked)
                    chosen = [r.token for r in rows]
                    result = verify_greedy(block, chosen, budget=budget, eos_ids=stops)
                else:
                    rows, accepted = await self.target.verify_sampled(block, sampling, k, masked)
                    result = clip([r.token for r in rows], accepted, budget, stops)
                if constraint is not None:  # the walk's proposals; _emit consumes what is kept
                    constraint.rollback(len(block) - 1)
                await self.target.truncate(start + result.num_kept)
                if batcher is None:  # a batch's time is not this block's alone
                    self.step_costs.observe(len(block), time.perf_counter() - began)
                self._count_block(len(block))
                if sizer is not None:
                    sizer.observe(len(block) - 1, result.num_accepted, kind or "draft")
                self._count_draft(handle, len(block) - 1, result.num_accepted)
                if lookup is not None:
                    lookup.extend(result.tokens)
                # Emitted token j follows block[0..j]: it is row j's (an accepted proposal
                # equals that row's choice; the last is the target's own).
                for row in rows[: len(result.tokens)]:
                    if self._emit(handle, out, row, stops):
                        return
                anchor = result.tokens[-1]
        handle._finish("abort")

    async def _draft(
        self, lookup: PromptLookup | None, anchor: int, size: int, sampling: dict | None
    ) -> list[int]:
        """[anchor, proposals...]: size - 1 proposals from the model draft, up to that many
        from the lookup (none when size < 2 or nothing matched)."""
        if size < 2:
            return [anchor]
        if lookup is None:
            return await self.target.draft_block(anchor, size, sampling)
        proposals = lookup.propose(size - 1)
        if proposals and sampling is not None:
            self.target.set_point_mass_q(proposals)
        return [anchor, *proposals]

    def _count_block(self, size: int) -> None:
        self.block_sizes[size] += 1
        self._observe("block_size", size)

    async def calibrate(self, sizes: tuple[int, ...] = (2, 4, 8, 16, 32)) -> dict[int, float]:
        """Measure the adaptive block size's cost model on the loaded target before the
        first request: plain steps against speculative steps of each block size (the
        draft's work included), on a throwaway sequence; the target is reset after."""
        target, costs = self.target, self.step_costs
        sizes = tuple(sorted({b for b in sizes if b < self.block_size} | {self.block_size}))
        greedy = {"temperature": 0.0}
        await target.reset()
        prompt = [self.tokenizer.bos_id or 0] * 8
        anchor = (await target.prefill(prompt, greedy, None)).token
        seconds: dict[int, list[float]] = {}
        # A warm-up round first (first-call costs), then the median of three interleaved
        # rounds: one round on a shared machine put c(2) at 1.46 plain steps, 1.18 in a
        # repeated measurement.
        for measured in (False, True, True, True):
            for size in (1, *sizes):
                start, began = target.position, time.perf_counter()
                if size == 1:
                    await target.step(anchor, greedy, None)
                else:
                    # A lookup drafts in microseconds: its step is the verify alone.
                    block = (
                        [anchor] * size
                        if self.lookup_drafts
                        else await target.draft_block(anchor, size, None)
                    )
                    await target.verify(block, greedy, None)
                await target.truncate(start)
                if measured:
                    seconds.setdefault(size, []).append(time.perf_counter() - began)
        for size, measurements in seconds.items():
            costs.observe(size, statistics.median(measurements))
        await target.reset()
        return costs.table()

    def _count_draft(self, handle: RequestHandle, proposed: int, accepted: int) -> None:
        handle.spec["drafts"] += 1
        handle.spec["draft_tokens"] += proposed
        handle.spec["accepted_tokens"] += accepted
        self.totals["spec_drafts"] += 1
        self.totals["spec_accepted_tokens"] += accepted
        if self.metrics is not None:
            per_pos = [1] * accepted + [0] * (proposed - accepted)
            self.metrics.observe_spec_decode(proposed, per_pos)

    # -- observability --------------------------------------------------------------------

    def _observe(self, what: str, value: float) -> None:
        if self.metrics is not None:
            self.metrics.observe(what, value)

    def _observe_finish(self, handle: RequestHandle) -> None:
        if self.metrics is not None and handle.finish_reason is not None:
            self.metrics.observe("e2e", time.monotonic() - handle.submitted_at)
            self.metrics.finished(handle.finish_reason)

    def status(self) -> dict:
        placement = self.workers()
        now = time.monotonic()
        return {
            "model": self.model_name,
            "state": self.state,
            "context_length": self.context_length,
            "uptime_s": round(time.time() - self.started_at, 1),
            "queue": {
                "waiting": len(self.waiting),
                "queued_tokens": self.queued_tokens(),
                "running": len(self.running),
                "max_running": self.max_running,
                # Each running and each waiting request with its tokens so far (a
                # preempted one waits with what it had generated).
                "requests": [_request_row(h, now) for h in self.running.values()],
                "waiting_requests": [_request_row(h, now) for h in self.waiting],
                # KV positions the running requests hold, over the pool (--kv-pool-tokens).
                "kv_usage": sum(self.target.lane_position(lane) for lane in self.running)
                / (self.kv.positions if self.kv else self.context_length),
                "kv_pool_tokens": self.kv.positions if self.kv else self.context_length,
                "preempted": len(self.preempted),
                # Batched decode steps so far and their mean size (continuous batching).
                "batched_steps": self.batcher.batches if self.batcher else 0,
                "mean_batch": (
                    round(self.batcher.steps / self.batcher.batches, 2)
                    if self.batcher and self.batcher.batches
                    else None
                ),
                "max_queue": self.max_queue,
                "max_queued_tokens": self.max_queued_tokens,
            },
            "totals": dict(self.totals),
            "rejected": dict(self.rejected),
            # DFlash: tokens committed per verify step (1 + accepted / drafts).
            "mean_acceptance_length": (
                round(1 + self.totals["spec_accepted_tokens"] / self.totals["spec_drafts"], 3)
                if self.totals["spec_drafts"]
                else None
            ),
            # Speculative steps by block size ("1": plain steps taken while speculating).
            "block_sizes": {str(b): n for b, n in sorted(self.block_sizes.items())},
            "placement": placement,
            # A "torch fallback" here decodes several times slower than native kernels.
            "kernels": kernels_summary(placement),
            "prefix_cache": self._cache_status(),
            "kv_flash": self.target.flash_status(),
            "moe_experts": self.target.moe_status(),
        }

    def _cache_status(self) -> dict | None:
        if self.prefix_cache is None:
            return None
        return dataclasses.asdict(self.prefix_cache.stats())

    def workers(self) -> list[dict]:
        return self.target.describe()
