"""Continuous batching's decode step: the running requests' next tokens in one forward.

Each running request decodes in its own task and lane (`Target.bind_lane`) and asks for
its next token with `step`. Decode is bound by reading the weights, so one forward over
every sequence's token costs little more than over one: the batcher holds each request's
step until every sequence that is decoding has asked (or has left), then runs them all
as one `Target.step_batch` and hands each its token. A request prefilling its prompt is
not decoding yet: its chunks run between batches, holding the workers for one chunk at a
time, so a long prompt delays the others' streams by a chunk, not by the prompt.
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
        self._pending: dict[int, tuple[BatchStep, asyncio.Future[Sampled]]] = {}
        self._flush: asyncio.Task | None = None
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
        if lane not in self.decoding:
            raise ValueError(f"lane {lane} steps without having joined")
        future = asyncio.get_running_loop().create_future()
        self._pending[lane] = (BatchStep(lane, token, sampling, logprobs), future)
        self._maybe_flush()
        return await future

    def _maybe_flush(self) -> None:
        ready = self._pending and self.decoding <= self._pending.keys()
        if ready and self._flush is None:
            self._flush = asyncio.create_task(self._run(), name="step-batch")

    async def _run(self) -> None:
        batch, self._pending = self._pending, {}
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
            self.observe("batch_size", len(batch))
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
