"""The scheduler: which sequences run, and what each one feeds, one step at a time.

Torch-free and worker-free: it reads and changes `Sequence` objects and integers only, so
it is tested without a model (tests/engine/test_scheduler.py). Each engine step:

    admit()      waiting sequences start, first come first served, while a slot is free and
                 their KV fits the pool, finished sequences' kept KV given up as needed
                 (engine/kv/finished.py; a preempted one keeps its slot: the workers hold its
                 sampler there; it comes back once the running ones, grown to their limits,
                 leave it room: a second recompute would cost more than the wait)
    schedule()   one batch under the step's token budget:
                 1. every decoding sequence's next token, or its draft window when it
                    speculates; its KV grows first, and when the pool is full the newest
                    running sequence is preempted (its KV freed, its tokens kept)
                 2. prompt chunks of the prefilling sequences, oldest first, while the budget
                    lasts. A chunk ends at the next multiple of `chunk` positions (or a
                    recurrent model's cut point, or the prompt's end): how a prompt is cut
                    never depends on the budget, nor on where a restored prefix ended. An
                    embedding sequence's chunks ask for pooled rows instead of a token
                    (engine/pooling.py); an encoder's input is one span, never cut
    update()     each work's outputs: positions advance, tokens are emitted (text, stop
                 strings, logprobs), draft windows accepted or rejected, pooled rows
                 gathered (an embedding ends with its input), finished sequences leave

The budget counts tokens fed. A chunk and one token of every running sequence fit in it,
and while a prompt waits a chunk's worth is kept from the decodes' windows: decodes and
prompts both always move on.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np

from luced.acceptance import clip, verify_greedy
from luced.engine.kv.budget import KVBudget
from luced.engine.output import Sampled
from luced.engine.request import Sequence, Status

log = logging.getLogger(__name__)

Observe = Callable[[str, float], None]


@dataclass
class Work:
    """One sequence's span in a step: `tokens` fed at positions `start ..`."""

    seq: Sequence
    start: int
    tokens: list[int]
    # 0: feed only (a prompt chunk before the last, a recompute); 1: sample the token after
    # the last; len(tokens): a draft window, a token after every row.
    n_out: int
    window: int = 1  # the draft window asked for (the proposer fills tokens[1:])
    keep_state: bool = False  # a recurrent model keeps its state at the span's end
    draft_kind: str = ""  # what drafted the window (the sizer learns per kind)
    pool: str = ""  # an embedding's span: the pooled row it gives (frames.Span.pool)

    @property
    def verifies(self) -> bool:
        return self.window > 1 and len(self.tokens) > 1


@dataclass
class Batch:
    works: list[Work] = field(default_factory=list)
    # Preempted before the forward: their slots' KV is freed first (their samplers kept).
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def n_tokens(self) -> int:
        return sum(len(w.tokens) for w in self.works)


@dataclass
class WorkOutput:
    """A work's rows: the token after each output row, with logprobs when asked; for a
    rejection-sampled window, `accepted` proposals (rows: accepted + 1)."""

    rows: list[Sampled]
    accepted: int | None = None
    pooled: np.ndarray | None = None  # a pooling work's row, float32 [hidden]


@dataclass
class StepResult:
    finished: list[Sequence] = field(default_factory=list)
    prefilled: list[Sequence] = field(default_factory=list)  # prompts now in the KV
    # Finished sequences whose KV moves to a kept lane (engine/kv/finished.py), with it.
    kept: list[tuple[Sequence, int]] = field(default_factory=list)


class Scheduler:
    def __init__(
        self,
        *,
        max_running: int,
        max_step_tokens: int,
        chunk: int,
        kv: KVBudget,
        observe: Observe = lambda what, value: None,
        drafted: Callable[[int, int], None] = lambda proposed, accepted: None,
    ) -> None:
        if not 0 < chunk <= max_step_tokens - max_running:
            raise ValueError(
                f"a prompt chunk ({chunk}) and a token of every running sequence "
                f"({max_running}) must fit the step ({max_step_tokens})"
            )
        self.max_running = max_running
        self.max_step_tokens = max_step_tokens
        self.chunk = chunk
        self.kv = kv
        self.observe = observe
        self.drafted = drafted  # (proposals, accepted) of each verified window
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        # Window sizes and where they may feed, set by the engine: the draft window a
        # decoding sequence asks for this step (1: a plain step), and how many positions
        # past its committed ones its KV may take (KV Flash: no eviction past one chunk).
        self.window: Callable[[Sequence], tuple[int, str]] = lambda seq: (1, "")
        self.room: Callable[[Sequence, int], int] = lambda seq, want: want
        # The kept lane a finished sequence's KV moves to, or None: it is freed.
        self.keep: Callable[[Sequence], int | None] = lambda seq: None
        # Whether a recurrent model's verify keeps a state per position (rollback "select")
        # or rewinds to the window's start and feeds the kept tokens again ("replay").
        self.select_rollback = True
        self.recurrent = False
        self.encoder = False  # bidirectional attention: an input is fed in one span
        self.block_sizes: Counter[int] = Counter()  # draft windows by size (1: plain steps)
        self.preemptions = 0

    # -- queue ----------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def slots_held(self) -> set[int]:
        """Running sequences' slots and those kept by preempted ones."""
        return {s.slot for s in self.running} | {s.slot for s in self.waiting if s.slot >= 0}

    def admit(self, hold: Callable[[Sequence], bool] = lambda seq: False) -> list[Sequence]:
        """Start waiting sequences in arrival order while a slot is free and their KV fits
        the pool; one whose grammar is still being built, or that `hold` keeps back (it
        waits to share a prefix being prefilled), lets the later ones pass. -> the started
        ones."""
        started = []
        for seq in list(self.waiting):
            if len(self.running) >= self.max_running:
                break
            if seq.handle.cancelled:
                continue  # the engine's cancel hook removes it
            if not seq.ready or hold(seq):
                continue
            slot = seq.slot if seq.slot >= 0 else self._free_slot()
            if slot is None:
                break
            # A preempted sequence comes back only when the running ones cannot push it out
            # again: recomputing it twice would cost more than waiting.
            margin = self._growth() if seq.generated else 0
            if not self.kv.reclaim(seq.feed_end + margin):  # kept lanes give way first
                break  # in order: a later request never overtakes one waiting for room
            self.kv.admit(slot, seq.ticket, seq.feed_end)
            self.waiting.remove(seq)
            seq.slot = seq.handle.slot = slot
            seq.status = Status.RUNNING
            if seq.handle.admitted_at is None:  # a preempted one keeps its first admission
                seq.handle.admitted_at = time.monotonic()
            self.running.append(seq)
            started.append(seq)
        if started:
            self.observe("queue", len(self.waiting))
            self.observe("running", len(self.running))
        return started

    def _growth(self) -> int:
        """Positions the running sequences may still grow into (to their max_end)."""
        return sum(max(0, s.max_end - self.kv.held.get(s.slot, 0)) for s in self.running)

    def _free_slot(self) -> int | None:
        free = set(range(self.max_running)) - self.slots_held()
        return min(free, default=None)

    # -- the batch ------------------------------------------------------------------------

    def schedule(self) -> Batch:
        batch = Batch()
        # While a prompt waits, a chunk's worth of the budget is kept for it: windows
        # shrink, every decode still gets its token (the engine keeps chunk + max_running
        # within the budget), and no prompt waits behind decodes for ever.
        prefilling = any(s.prefilling for s in self.running if s.status is Status.RUNNING)
        budget = self.max_step_tokens - (self.chunk if prefilling else 0)
        for seq in sorted(self.running, key=lambda s: s.ticket):  # oldest first
            if seq.status is not Status.RUNNING or seq.prefilling:
                continue
            want, kind = self.window(seq)
            want = max(1, self.room(seq, min(want, seq.budget, budget)))
            if not self._grow(seq, seq.computed + want, batch):
                continue
            work = Work(seq, seq.computed, [seq.tokens[-1]], 1, window=want, draft_kind=kind)
            batch.works.append(work)
            budget -= want
        budget += self.chunk if prefilling else 0
        for seq in sorted(self.running, key=lambda s: s.ticket):
            if seq.status is not Status.RUNNING or not seq.prefilling:
                continue
            start = seq.computed
            end = seq.feed_end if self.encoder else min(self.chunk_end(seq, start), seq.feed_end)
            if end - start > budget:
                break  # whole chunks, oldest first
            tokens = seq.tokens[start:end]
            if seq.pooler is not None:
                work = Work(seq, start, tokens, 0, pool=seq.pooler.ask(start, end))
            else:
                last = end == seq.feed_end and not seq.generated
                work = Work(seq, start, tokens, int(last), keep_state=end in seq.cuts)
            batch.works.append(work)
            budget -= end - start
        return batch

    def chunk_end(self, seq: Sequence, start: int) -> int:
        """Where a chunk from `start` ends: the next multiple of `chunk`, or an earlier cut
        point where a recurrent state is kept."""
        end = (start // self.chunk + 1) * self.chunk
        cut = min((c for c in seq.cuts if start < c < end), default=end)
        return min(end, cut)

    def _grow(self, seq: Sequence, end: int, batch: Batch) -> bool:
        """Reserve `seq`'s KV up to `end` positions; when the pool is full the newest
        running sequence gives way (False when that is `seq` itself)."""
        while not self.kv.grow(seq.slot, end):
            victim_slot = self.kv.newest()
            victim = next(s for s in self.running if s.slot == victim_slot)
            self.preempt(victim, batch)
            if victim is seq:
                return False
        return True

    def preempt(self, seq: Sequence, batch: Batch) -> None:
        """`seq` gives its KV up and waits, in its place by arrival, to be recomputed: its
        prompt and output so far are fed again without sampling (the workers keep its
        sampler in its slot, whose generator draws on from where it stopped). One that has
        generated nothing starts over, its slot freed."""
        self.kv.release(seq.slot)
        self.running.remove(seq)
        batch.preempted.append(seq)
        seq.status, seq.computed = Status.WAITING, 0
        seq.last_start, seq.last_block_states = 0, False
        seq.ring_floor = 0
        if seq.pooler is not None:
            seq.pooler.reset()  # its chunks run again
        kept_slot = seq.slot if seq.generated else -1
        seq.slot = kept_slot
        after = next((i for i, s in enumerate(self.waiting) if s.ticket > seq.ticket), None)
        self.waiting.insert(len(self.waiting) if after is None else after, seq)
        self.preemptions += 1
        self.observe("preemptions", 1)
        self.observe("queue", len(self.waiting))
        log.info(
            "request %s preempted after %d tokens: its KV is freed; it resumes by recomputing %d",
            seq.handle.request_id,
            seq.handle.completion_tokens,
            seq.feed_end,
        )

    # -- results --------------------------------------------------------------------------

    def update(self, batch: Batch, outputs: Iterable[WorkOutput | None]) -> StepResult:
        """Apply each work's outputs (None: the work did not run); the sequences that
        ended leave. A running sequence whose client left is finished here too."""
        result = StepResult()
        for work, out in zip(batch.works, outputs, strict=True):
            seq = work.seq
            if out is None or seq.status is not Status.RUNNING:
                continue
            if work.verifies:
                self._accept(work, out)
            else:
                seq.computed = work.start + len(work.tokens)
                seq.last_start, seq.last_block_states = work.start, False
                if work.start + len(work.tokens) == len(seq.prompt) and not seq.generated:
                    result.prefilled.append(seq)  # snapshot it before it moves on
                if seq.pooler is not None:
                    self._pooled(seq, work, out)
                if work.n_out:
                    token = out.rows[0].token
                    self.emit(seq, out.rows[0])
                    if seq.speculates:  # a plain step of a speculating sequence
                        self._plain_step(seq, token, counted=work.start >= len(seq.prompt))
            if seq.handle.finished:
                self.finish(seq, result)
        for seq in list(self.running):
            if seq.handle.cancelled:
                seq.handle._finish("abort")
                self.finish(seq, result)
        return result

    @staticmethod
    def _pooled(seq: Sequence, work: Work, out: WorkOutput) -> None:
        """An embedding's span ran: its row is gathered; after the input's last, the
        vector is the request's answer."""
        assert seq.pooler is not None
        if work.pool:
            assert out.pooled is not None, "a pooling work came back without its row"
            seq.pooler.take(out.pooled)
        if seq.computed == seq.feed_end:
            seq.handle.embedding = seq.pooler.result()
            seq.handle._finish("stop")

    def _plain_step(self, seq: Sequence, token: int, counted: bool) -> None:
        """A speculating sequence fed one token (no draft, or a window of 1): its drafter
        learns the token; after its first token, the step counts as a window of 1."""
        if seq.lookup is not None:
            seq.lookup.extend([token])
        if counted:
            self.block_sizes[1] += 1
            self.observe("block_size", 1)
            if seq.sizer is not None:
                seq.sizer.plain_step()

    def _accept(self, work: Work, out: WorkOutput) -> None:
        """A draft window's outcome: the accepted proposals and the target's own next
        token are emitted; the KV keeps the anchor and the accepted proposals (the next
        span rolls the rest back), or, rewinding a recurrent state by replay, only what it
        held before the window, the kept tokens fed again next."""
        seq, window = work.seq, work.tokens
        if out.accepted is None:  # greedy: the target's argmax after each row
            chosen = [r.token for r in out.rows]
            result = verify_greedy(window, chosen, budget=seq.budget, eos_ids=seq.stops)
        else:  # rejection-sampled in the head's worker
            tokens = [r.token for r in out.rows]
            result = clip(tokens, out.accepted, seq.budget, seq.stops)
        if seq.constraint is not None:  # the walk's proposals; emitting consumes the kept
            seq.constraint.rollback(len(window) - 1)
        replay = self.recurrent and not self.select_rollback and result.num_kept < len(window)
        seq.computed = work.start if replay else work.start + result.num_kept
        seq.last_start, seq.last_block_states = work.start, not replay and self.recurrent
        proposed = len(window) - 1
        self.block_sizes[len(window)] += 1
        self.observe("block_size", len(window))
        if seq.sizer is not None:
            seq.sizer.observe(proposed, result.num_accepted, work.draft_kind or "draft")
        seq.handle.spec["drafts"] += 1
        seq.handle.spec["draft_tokens"] += proposed
        seq.handle.spec["accepted_tokens"] += result.num_accepted
        self.drafted(proposed, result.num_accepted)
        if seq.lookup is not None:
            seq.lookup.extend(result.tokens)
        # Emitted token j follows window[0..j]: it is row j's (an accepted proposal equals
        # that row's choice; the last is the target's own).
        for row in out.rows[: len(result.tokens)]:
            if self.emit(seq, row):
                return

    def emit(self, seq: Sequence, sampled: Sampled) -> bool:
        """One generated token to the client; True when it ended the request (EOS, a stop
        string, max_tokens, a complete grammar)."""
        handle, out = seq.handle, seq.out
        now = time.monotonic()
        if handle.first_token_at is None:
            handle.first_token_at = now
            self.observe("ttft", now - handle.submitted_at)
        elif handle.last_token_at is not None:
            self.observe("itl", now - handle.last_token_at)
        handle.last_token_at = now
        if sampled.token in seq.stops:
            handle._emit_if(out.flush())
            handle._finish("stop")
            return True
        if seq.constraint is not None:
            seq.constraint.advance(sampled.token)
        handle.completion_tokens += 1
        seq.tokens.append(sampled.token)
        self.observe("generation_tokens", 1)
        delta, hit = out.push(sampled)
        handle._emit_if(delta)
        if hit:
            handle.stop_string = out.stops.matched
            handle._finish("stop")
            return True
        if seq.constraint is not None and seq.constraint.done:  # the grammar is complete
            handle._emit_if(out.flush())
            handle._finish("stop")
            return True
        if handle.completion_tokens >= handle.max_tokens:
            handle._emit_if(out.flush())
            handle._finish("length")
            return True
        return False

    def finish(self, seq: Sequence, result: StepResult) -> None:
        """`seq` leaves: its slot and KV are free (the engine releases them in the
        workers before the next step)."""
        if seq in self.running:
            self.running.remove(seq)
            lane = self.keep(seq)
            if lane is None:
                self.kv.release(seq.slot)
            else:
                self.kv.keep(seq.slot, lane, min(seq.computed, len(seq.prompt)))
                result.kept.append((seq, lane))
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = Status.FINISHED
        result.finished.append(seq)
        self.observe("running", len(self.running))

    def cancel_waiting(self, seq: Sequence) -> bool:
        """A queued (or preempted) sequence whose client left: out of the queue now."""
        if seq not in self.waiting:
            return False
        self.waiting.remove(seq)
        seq.status = Status.FINISHED
        self.observe("queue", len(self.waiting))
        return True
