"""Continuous batching's decode step: the running requests' next tokens in one forward.

Each running request decodes in its own task and lane (`Target.bind_lane`) and asks for
its next token with `step`. Decode is bound by reading the weights, so one forward over
every sequence's token costs little more than over one: the batcher holds each request's
step until every sequence that is decoding has asked (or has left), then runs them all
as one `Target.step_batch` and hands each its token. A request prefilling its prompt is
not decoding yet: its chunks run between batches, holding the workers for one chunk at a
time, so a long prompt delays the others' streams by a chunk, not by the prompt.

A request streams its token while the next batch computes: `submit` hands the step in
and returns once the batch holding it is on its way to the workers (every decoding lane
submits before any of them detokenizes and streams), and the result comes later.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from luced.engine.target import BatchStep, Sampled, Target


class StepBatcher:
    def __init__(self, target: Target, observe: Callable[[str, float], None]) -> None:
        self.target = target
        self.observe = observe  # the engine's metrics: "batch_size" per batched step
        self.decoding: set[int] = set()  # lanes whose next step comes through here
        self._pending: dict[int, tuple[BatchStep, asyncio.Future[list[Sampled]]]] = {}
        self._flush: asyncio.Task | None = None
        self._launched = asyncio.Event()  # set when the pending batch is sent; then renewed
        self.batches = 0  # batched forwards run, and the steps in them (mean batch size)
        self.steps = 0

    def join(self, lane: int) -> None:
        self.decoding.add(lane)

    def leave(self, lane: int) -> None:
        """The lane asks no more (finished, cancelled, failed): the others need not wait."""
        self.decoding.discard(lane)
        self._maybe_flush()

    async def step(self, lane: int, token: int, sampling: dict, logprobs: int | None) -> Sampled:
        """Feed `token` to the lane's sequence and sample its next, in the next batch."""
        future = await self.submit(BatchStep(lane, token, sampling, logprobs))
        return (await future)[0]

    async def submit(self, step: BatchStep) -> asyncio.Future[list[Sampled]]:
        """Hand in the lane's next step (a token, or a greedy verify block; with a grammar's
        mask writer); returns when its batch has been sent, with the future of the step's
        sampled rows (one, or one per block row)."""
        lane = step.sequence
        if lane not in self.decoding:
            raise ValueError(f"lane {lane} steps without having joined")
        future: asyncio.Future[list[Sampled]] = asyncio.get_running_loop().create_future()
        self._pending[lane] = (step, future)
        launched = self._launched
        self._maybe_flush()
        await launched.wait()
        return future

    def _maybe_flush(self) -> None:
        ready = self._pending and self.decoding <= self._pending.keys()
        if ready and self._flush is None:
            self._flush = asyncio.create_task(self._run(), name="step-batch")

    async def _run(self) -> None:
        batch, self._pending = self._pending, {}
        launched, self._launched = self._launched, asyncio.Event()
        # Set before the frame is written: the submitters resume after this task yields,
        # which it first does once the frame is sent (the workers' lock is free here).
        launched.set()
        try:
            rows = await self.target.step_batch([step for step, _ in batch.values()])
        except BaseException as exc:
            for _, future in batch.values():
                if not future.done():
                    future.set_exception(exc)
            if isinstance(exc, asyncio.CancelledError):
                raise
        else:
            self.batches += 1
            self.steps += len(batch)
            self.observe("batch_size", len(batch))  # sequences, whatever their rows
            for (_, future), row in zip(batch.values(), rows, strict=True):
                if not future.done():  # its request may have been cancelled meanwhile
                    future.set_result(row)
        finally:
            self._flush = None
            self._maybe_flush()

    async def close(self) -> None:
        if self._flush is not None:
            self._flush.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._flush
