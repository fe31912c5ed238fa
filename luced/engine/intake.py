"""Request intake: whether a request may be queued (the model, the context, the queue's
bounds), the Sequence the scheduler runs it as, and its grammar's matcher, built off the
event loop.

Every check raises the EngineError whose status the APIs answer with: 400 for a request
the model cannot serve (`ContextTooLong`, `EmbeddingsOnly`, `InvalidGrammar`), 429 for a
full queue (`QueueFull`, with a retry hint).
"""

from __future__ import annotations

import asyncio
import itertools

from luced.engine.config import ModelInfo, SchedulingLimits
from luced.engine.constraint import Constraint
from luced.engine.output import OutputBuilder
from luced.engine.pooling import Pooler
from luced.engine.request import (
    ContextTooLong,
    EmbeddingsOnly,
    GenerationRequest,
    InvalidGrammar,
    QueueFull,
    RequestHandle,
    Sequence,
)
from luced.engine.scheduler import Scheduler
from luced.engine.spec.windows import DraftWindows
from luced.engine.target import Target
from luced.text.grammar import GrammarError, GrammarTokenizer, check_grammar
from luced.text.tokenizer import Tokenizer


class Intake:
    def __init__(
        self,
        target: Target,
        tokenizer: Tokenizer,
        scheduler: Scheduler,
        windows: DraftWindows,
        model: ModelInfo,
        limits: SchedulingLimits,
    ) -> None:
        self.target = target
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.windows = windows
        self.model = model
        self.limits = limits  # the queue's bounds, the default max_tokens
        self._tickets = itertools.count(1)
        # Built once, on the first grammar (seconds on a large vocabulary): requests arriving
        # meanwhile await the same build.
        self._grammar_vocab: asyncio.Future[GrammarTokenizer] | None = None

    # -- bounds ---------------------------------------------------------------------------

    def queued_tokens(self) -> int:
        """Prompt tokens waiting; a sibling's (`share_prompt`) are its first's."""
        waiting = self.scheduler.waiting
        return sum(s.handle.prompt_tokens for s in waiting if not s.handle.request.share_prompt)

    def queue_takes(self, n: int) -> bool:
        """Whether a request of n prompt tokens finds room in the queue now."""
        waiting = self.scheduler.waiting
        if len(waiting) >= self.limits.max_queue:
            return False
        return not waiting or self.queued_tokens() + n <= self.limits.max_queued_tokens

    @property
    def embedding_limit(self) -> int:
        """The most tokens an embedding input may have: the context, and for an encoder,
        which sees its input in one step, the step's budget."""
        if self.model.encoder:
            return min(self.model.context_length, self.target.step_tokens)
        return self.model.context_length

    def check_generates(self) -> None:
        """EmbeddingsOnly (400) when the model cannot generate (an encoder). The APIs ask
        before they render a prompt; `check` asks again."""
        if self.model.encoder:
            raise EmbeddingsOnly(
                f"{self.model.name} is an embedding model (bidirectional attention): it "
                "cannot generate text; it serves POST /v1/embeddings"
            )

    # -- a request ------------------------------------------------------------------------

    def check(self, req: GenerationRequest) -> int:
        """Whether `req` may be queued now (EngineError when not) -> its max_tokens (0 for
        an embedding)."""
        n = len(req.prompt)
        if n == 0:
            raise ContextTooLong("the prompt is empty")
        if req.pooling is not None:
            self._check_embedding(n)
            max_tokens = 0
        else:
            max_tokens = self._generation_room(req, n)
        if req.grammar is not None:
            try:
                check_grammar(req.grammar)  # vocabulary-free: the matcher is built later
            except GrammarError as exc:
                raise InvalidGrammar(f"grammar: {exc}") from None
        waiting = self.scheduler.waiting
        if not self.queue_takes(0 if req.share_prompt else n):  # a sibling's is its first's
            full = len(waiting) >= self.limits.max_queue
            raise QueueFull(
                f"the queue is full ({len(waiting)} requests, {self.queued_tokens()} "
                "prompt tokens waiting)",
                retry_after=float(max(1, len(waiting))),
                reason="max_queue" if full else "max_queued_tokens",
            )
        return max_tokens

    def _check_embedding(self, n: int) -> None:
        limit = self.embedding_limit
        if n > limit:
            why = "the context length"
            if limit < self.model.context_length:
                why = "--max-step-tokens: an encoder sees a whole input in one step"
            raise ContextTooLong(f"the input has {n} tokens; at most {limit} fit ({why})")

    def _generation_room(self, req: GenerationRequest, n: int) -> int:
        """-> the request's max_tokens."""
        self.check_generates()
        if n >= self.model.context_length:
            raise ContextTooLong(
                f"the prompt has {n} tokens; the context holds {self.model.context_length} "
                "(prompt plus at least one generated token)"
            )
        room = self.model.context_length - n
        if req.max_tokens is not None and req.max_tokens > room:
            raise ContextTooLong(
                f"prompt ({n} tokens) + max_tokens ({req.max_tokens}) exceeds the context "
                f"length {self.model.context_length}"
            )
        return req.max_tokens or min(room, self.limits.default_max_tokens or room)

    def sequence(self, handle: RequestHandle) -> Sequence:
        """The Sequence that runs `handle`'s request: its stops, output, speculation."""
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
        else:
            self.windows.setup(seq, has_draft=self.target.draft is not None)
        return seq

    async def constrain(self, seq: Sequence) -> None:
        """Give `seq` its grammar's matcher over this model's vocabulary, built off the
        event loop: the vocabulary once (seconds for a large vocabulary), the matcher per
        request. GrammarError when the grammar is valid alone but not over this
        vocabulary."""
        grammar = seq.handle.request.grammar
        assert grammar is not None
        if self._grammar_vocab is None:
            build = asyncio.to_thread(GrammarTokenizer, self.tokenizer)
            self._grammar_vocab = asyncio.ensure_future(build)
        vocab = await asyncio.shield(self._grammar_vocab)
        matcher = await asyncio.to_thread(vocab.matcher, grammar)
        seq.constraint = Constraint(matcher, vocab, seq.stops, self.target.arrays["allowed"])
        seq.ready = True
