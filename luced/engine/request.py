"""Requests and sequences: what a client asked for, and where its generation stands.

    GenerationRequest   the parsed request (prompt ids, sampling, limits, stops, grammar),
                        or an embedding request (`pooling`: its input's pooled states)
    RequestHandle       the client's side: its stream of deltas, counts, finish reason,
                        an embedding request's vector
    Sequence            the engine's side (vLLM's Request): the workers' slot it runs in,
                        every token it knows, how many of them its KV holds, its output
                        builder, grammar and drafter

A sequence's tokens are its prompt and everything generated so far; its KV holds the first
`computed` of them. Every generated token is emitted as soon as it is sampled and fed in
the next step, so a decoding sequence holds all its tokens but the last
(`computed == len(tokens) - 1`); a sequence with more to feed is prefilling (its prompt,
or after a preemption its prompt and output so far). Nothing about a sequence lives
anywhere else: the scheduler reads and changes these objects, the runner turns them into
frames.
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from luced.engine.constraint import Constraint
from luced.engine.output import Delta, OutputBuilder
from luced.engine.pooling import Pooler
from luced.engine.spec.ngram import PromptLookup
from luced.engine.spec.sizer import BlockSizer
from luced.sampling_params import SamplingParams


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


class EmbeddingsOnly(EngineError):
    """A generation request to a model that serves embeddings only (an encoder)."""

    status = 400
    code = "model_not_supported"


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
    # A sibling of the request submitted before it, with the same prompt (one of OpenAI's
    # n choices): it waits for that prompt's prefill and shares its blocks, however short
    # the prompt, and its prompt is not counted again against the queue's token bound.
    share_prompt: bool = False
    # An embedding request ("mean", "cls" or "last", engine/pooling.py): the prompt is fed
    # and its last-layer states pooled into `RequestHandle.embedding`; nothing is generated.
    pooling: str | None = None


_END = object()


class RequestHandle:
    """A submitted request as its client sees it: `async for delta in handle`, then
    `finish_reason` ("stop", "length", "abort" or "error") and the counts."""

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
        self.admitted_at: float | None = None  # first taken from the queue to run
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        # Speculation counts for this request (reported in usage).
        self.spec = {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0}
        self.cached_tokens = 0  # prompt tokens restored or shared, not computed
        self.slot = -1  # the workers' sequence it runs in (kept after it ends: diagnostics)
        self.embedding: np.ndarray | None = None  # an embedding request's, float32 [hidden]
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

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    async def __aiter__(self) -> AsyncIterator[Delta]:
        while True:
            item = await self._events.get()
            if item is _END:
                return
            yield item


class Status(enum.Enum):
    WAITING = "waiting"  # queued, or preempted and waiting to be recomputed
    RUNNING = "running"  # admitted: holds a slot and KV
    FINISHED = "finished"


@dataclass
class Sequence:
    """One generation in the engine (see the module docstring)."""

    handle: RequestHandle
    ticket: int  # arrival order: the newest running sequence is the one preempted
    sampling: dict  # the SamplingParams wire map the workers sample with
    stops: frozenset[int]  # ids that end it (EOS unless ignored, stop_token_ids)
    out: OutputBuilder
    tokens: list[int] = field(default_factory=list)
    computed: int = 0  # positions its KV holds
    slot: int = -1  # the workers' sequence id while it holds one
    status: Status = Status.WAITING
    constraint: Constraint | None = None
    # Set once its grammar's matcher is built (off the event loop): only then is it admitted.
    ready: bool = True
    speculates: bool = False  # it drafts windows (a draft model or the n-gram lookup)
    lookup: PromptLookup | None = None  # --draft ngram: its own n-gram index
    sizer: BlockSizer | None = None  # adaptive draft windows
    # Prefix-cache cut points of a recurrent model: a prompt chunk ends at each and the
    # workers keep the state there (`keep_state`); exported with the prompt's snapshot.
    cuts: tuple[int, ...] = ()
    ring_floor: int = 0  # no feature-ring row below this position is valid
    # A recurrent state rolled back by a replay: the first position of its last forward
    # (the state kept there), and whether that forward kept a state per position.
    last_start: int = 0
    last_block_states: bool = False
    waits_to_share: bool = False  # held back for a running prefill of its prompt's start
    pooler: Pooler | None = None  # an embedding sequence's: it pools, never decodes

    @property
    def prompt(self) -> list[int]:
        return self.handle.request.prompt

    @property
    def generated(self) -> list[int]:
        return self.tokens[len(self.prompt) :]

    @property
    def params(self) -> SamplingParams:
        return self.handle.request.params

    @property
    def logprobs(self) -> int | None:
        """None: no logprobs; k: the chosen token's and the top k."""
        return self.params.logprobs

    @property
    def feed_end(self) -> int:
        """Where its KV must reach before it decodes: its prompt, or with generated tokens
        all of them but the last, which the next decode step feeds."""
        n = len(self.tokens)  # not `generated`: a copy of them, and this runs at every step
        return n - 1 if n > len(self.prompt) else n

    @property
    def prefilling(self) -> bool:
        return self.computed < self.feed_end

    @property
    def max_end(self) -> int:
        """The most positions it may come to hold: its prompt and every token it may
        generate."""
        return len(self.prompt) + self.handle.max_tokens

    @property
    def budget(self) -> int:
        """Tokens it may still generate."""
        return self.handle.max_tokens - self.handle.completion_tokens
