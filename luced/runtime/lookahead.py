"""Decoding one step ahead (`frames.Forward.ahead`): after replying to a forward whose spans
each sampled one token, the worker feeds those tokens at once, as the daemon's next frame
will, and writes that step's rows into the `ahead` regions while the daemon reads the reply,
emits the tokens and writes the next frame. When the next frame asks for exactly that step
(the same sequences at the next positions, the tokens just sampled, the same sampling and
output regions), it is answered without computing; any other frame rolls the step back
first (`Lookahead.drop`): the K/V rows and tokens it added go, and each sampler's generator
returns to where it was, so a sequence continues exactly as if the step had never run.

The step computed ahead is the very step the next frame would run (each span's rows are
independent of what else shares the batch: `forward` keeps batched == alone), so answering
from it changes no output. What it saves is the round trip: the worker no longer waits
idle while the daemon turns one step's reply into the next frame.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from luced.ipc import frames as F
from luced.ipc.regions import Region
from luced.runtime.sampler import Sampler


class WorkerState(Protocol):
    """What this module uses of `state.WorkerState` (which holds a Lookahead: a protocol
    keeps the imports one way)."""

    loaded: Any  # state.Loaded | None

    def tensor(self, region: Region) -> torch.Tensor: ...


# computes a frame from the given fed ids (forward.compute)
Compute = Callable[[Any, F.Forward, torch.Tensor], F.ForwardReply]

log = logging.getLogger(__name__)


@dataclass
class _Ran:
    """A step computed ahead: the frame it stands for and what undoes it."""

    frame: F.Forward  # the next frame as the daemon will send it (outputs = the ahead regions)
    fed: list[int]  # the token each span fed
    reply: F.ForwardReply
    generators: list[tuple[Sampler, torch.Tensor | None]]  # each sampler's state before it


class Lookahead:
    """A worker's step ahead: `plan` after a forward that asked for one, `run` after its
    reply went out, `take` when the next forward comes, `drop` before any other frame."""

    def __init__(self) -> None:
        self._planned: tuple[F.Forward, list[int]] | None = None
        self._ran: _Ran | None = None
        self.served = 0  # forwards answered from a step computed ahead
        self.dropped = 0  # steps computed ahead and rolled back

    def plan(self, worker: WorkerState, req: F.Forward) -> None:
        """After `req` (computed or taken): the step that feeds what it sampled, when it
        asked for one and every span sampled one plain row."""
        self._planned = None
        if not req.ahead or req.outputs.keys() != req.ahead.keys():
            return
        if req.allowed is not None or req.capture or req.draft_probs is not None:
            return
        if any(
            s.n_out != 1 or s.verify or s.pool or s.ring or s.moves or s.kv_scores
            for s in req.spans
        ):
            return
        ids = worker.tensor(req.outputs["ids"])[: len(req.spans)].tolist()
        # The daemon's tables already cover the next position (it grew them one ahead):
        # the next frame's spans gain no copies, maybe blocks past it (`take`).
        spans = tuple(
            dataclasses.replace(s, start=s.start + s.n, n=1, keep_state=False, copies=(), blocks=())
            for s in req.spans
        )
        nxt = dataclasses.replace(req, spans=spans, outputs=dict(req.ahead), ahead={})
        self._planned = (nxt, ids)

    def run(self, worker: WorkerState, compute: Compute) -> None:
        """The planned step, if any (called after the reply went out)."""
        planned, self._planned = self._planned, None
        if planned is None or worker.loaded is None:
            return
        frame, fed = planned
        states = [worker.loaded.sequences.get(s.sequence) for s in frame.spans]
        if any(state is None or state.sampler is None for state in states):
            return
        generators = []
        for state in states:
            assert state is not None and state.sampler is not None
            generators.append((state.sampler, state.sampler.generator_state()))
        t0 = time.perf_counter()
        try:
            reply = compute(worker, frame, torch.tensor(fed, dtype=torch.int64))
        except Exception as exc:  # nothing stays (forward rolls back): the frame computes it
            log.warning("the step ahead failed, the next frame computes it: %s", exc)
            _restore(generators)
            return
        reply = dataclasses.replace(reply, elapsed_us=int((time.perf_counter() - t0) * 1e6))
        self._ran = _Ran(frame, fed, reply, generators)

    def take(self, worker: WorkerState, req: F.Forward) -> F.ForwardReply | None:
        """`req`'s reply when the step ahead is exactly `req`; else None, the step rolled
        back."""
        self._planned = None
        ran = self._ran
        if ran is None:
            return None
        if _same_step(ran.frame, req) and _fed(worker, req) == ran.fed and _follows(worker, req):
            for span in req.spans:  # blocks past the step it ran: its table's next growth
                worker.loaded.sequences[span.sequence].follow(span)
            self._ran = None
            self.served += 1
            return ran.reply
        self.drop(worker)
        return None

    def drop(self, worker: WorkerState) -> None:
        """Roll the step ahead back, if one ran: its rows, tokens and draws."""
        ran, self._ran = self._ran, None
        self._planned = None
        if ran is None or worker.loaded is None:
            return
        for span in ran.frame.spans:
            state = worker.loaded.sequences.get(span.sequence)
            if state is not None and state.position > span.start:
                state.truncate(span.start)
        _restore(ran.generators)
        self.dropped += 1


def _same_step(ran: F.Forward, req: F.Forward) -> bool:
    """Whether `req` asks for the step `ran` stands for: every field but where its ids are
    (compared by value), its own ahead regions and the blocks its spans' tables gained
    past that step (the daemon grows one position ahead)."""
    if len(req.spans) != len(ran.spans):
        return False
    for mine, theirs in zip(ran.spans, req.spans, strict=True):
        if theirs.copies or theirs.table < len(theirs.blocks):
            return False
        before = dataclasses.replace(theirs, blocks=(), table=theirs.table - len(theirs.blocks))
        if before != mine:
            return False
    return all(
        getattr(req, f.name) == getattr(ran, f.name)
        for f in dataclasses.fields(req)
        if f.name not in ("tokens", "ahead", "spans")
    )


def _follows(worker: WorkerState, req: F.Forward) -> bool:
    """Whether the sequences can take `req`'s table growth (else it is computed, and
    refused there)."""
    try:
        for span in req.spans:
            worker.loaded.sequences[span.sequence].check_table(span)
    except Exception:
        return False
    return True


def _fed(worker: WorkerState, req: F.Forward) -> list[int] | None:
    if req.tokens is None or req.hidden_in is not None:
        return None
    return worker.tensor(req.tokens)[: req.n_tokens].tolist()


def _restore(generators: list[tuple[Sampler, torch.Tensor | None]]) -> None:
    for sampler, state in generators:
        sampler.restore_generator(state)
