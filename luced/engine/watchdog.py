"""Time as the daemon's event loop saw it, for the deadlines of its workers.

A deadline on a worker measures the worker's silence. When the daemon itself stalls
(SIGSTOP, swapped out, a slow synchronous call on the loop), the worker's answer may sit
unread in the socket while the clock runs; on waking, the overdue deadline must not
kill a healthy worker. So a deadline counts in polls, every ``POLL`` seconds:

    on time     a poll due after ``step`` s that runs within ``step + STALL``: the time
                since the previous poll was the worker's silence, and counts
    late        one later than that: the loop itself stalled; only ``step`` counts, and
                the next poll is a whole ``POLL`` later (time for the worker to answer)
    spent       the deadline ends one turn of the loop after a poll finds it spent, so a
                reply that arrived meanwhile is read first

    Silence        one call's deadline, so counted; ``heard`` restarts the count (a slow
                   worker's progress notes)
    LoopWatchdog   the daemon's task that measures the loop's lag every ``TICK``: the
                   ``luced:event_loop_lag_seconds`` histogram and a warning per stall
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from types import TracebackType
from typing import Self

log = logging.getLogger(__name__)

STALL = 1.0  # a timer this much late: the loop itself stalled
POLL = 0.25  # how often a pending deadline counts
TURN = 0.001  # from a spent poll to the end: the loop reads its sockets in between
TICK = 0.25  # how often the watchdog measures the loop's lag


class Silence:
    """``async with Silence(limit)``: TimeoutError when the body has waited ``limit``
    seconds, as the loop saw them (see the module), since it began or since ``heard``."""

    def __init__(self, limit: float) -> None:
        self.limit = limit
        self.silent = 0.0  # seconds counted since the last word
        self.stage = ""  # what the last progress note said
        self._timeout = asyncio.timeout(None)
        self._poll: asyncio.TimerHandle | None = None
        self._last = 0.0  # loop time of the last count
        self._step = 0.0  # the interval the pending poll was scheduled for

    async def __aenter__(self) -> Self:
        await self._timeout.__aenter__()
        self._last = asyncio.get_running_loop().time()
        self._schedule(min(POLL, self.limit))
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        if self._poll is not None:
            self._poll.cancel()
        return await self._timeout.__aexit__(exc_type, exc, tb)

    def heard(self, stage: str) -> None:
        """The peer said it is alive (a progress note): count its silence from now."""
        self.stage = stage
        self.silent = 0.0
        self._last = asyncio.get_running_loop().time()

    def _schedule(self, step: float) -> None:
        self._step = step
        self._poll = asyncio.get_running_loop().call_later(step, self._count)

    def _count(self) -> None:
        loop = asyncio.get_running_loop()
        now = loop.time()
        elapsed, self._last = now - self._last, now
        if elapsed > self._step + STALL:  # late: the loop's absence is not the worker's
            self.silent += self._step
            self._schedule(POLL)
            return
        self.silent += elapsed
        if self.silent < self.limit:
            self._schedule(min(POLL, self.limit - self.silent))
        else:
            self._poll = loop.call_later(TURN, self._end)

    def _end(self) -> None:
        if self.silent < self.limit:  # heard meanwhile
            self._schedule(min(POLL, self.limit - self.silent))
        else:
            self._poll = None
            self._timeout.reschedule(asyncio.get_running_loop().time())


class LoopWatchdog:
    """Measures how late the event loop runs a task that sleeps ``TICK``: each lag to
    ``observe`` (the metric), and a warning when the loop stalled (over ``STALL``)."""

    def __init__(self, observe: Callable[[float], None]) -> None:
        self.observe = observe
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="loop-watchdog")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + TICK
            await asyncio.sleep(TICK)
            lag = max(0.0, loop.time() - due)
            self.observe(lag)
            if lag > STALL:
                log.warning(
                    "event loop stalled for %.1f s (the daemon was stopped, swapped out or "
                    "blocked); worker deadlines do not count that time",
                    lag,
                )
