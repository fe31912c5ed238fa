"""The loop's own sense of time: a Silence ends on a peer's silence, is restarted by what
it hears, and does not count a stall of the loop; the watchdog measures that stall."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from luced.engine.watchdog import LoopWatchdog, Silence


async def test_silence_ends_on_silence_and_heard_restarts_it() -> None:
    async with Silence(0.6) as silence:
        for _ in range(8):  # 1.6 s in all, never 0.6 s without a word
            await asyncio.sleep(0.2)
            silence.heard("loading")
    assert silence.stage == "loading"
    with pytest.raises(TimeoutError):
        async with Silence(0.6) as silence:
            await asyncio.sleep(30)
    assert silence.silent >= 0.6


async def test_a_stall_is_not_silence() -> None:
    """The loop blocks for 2 s, more than the whole limit, and the awaited answer comes
    during the stall: it is taken (where `asyncio.timeout(0.5)` would have expired)."""
    loop = asyncio.get_running_loop()
    async with Silence(0.5) as silence:
        loop.call_soon(time.sleep, 2.0)
        await asyncio.sleep(1.0)  # due during the stall: it returns right after
    assert silence.silent < 0.5


async def test_the_watchdog_measures_a_stall(caplog) -> None:
    lags: list[float] = []
    watchdog = LoopWatchdog(lags.append)
    watchdog.start()
    try:
        with caplog.at_level(logging.WARNING, logger="luced.engine.watchdog"):
            await asyncio.sleep(0.3)
            time.sleep(1.5)  # the loop stalls
            await asyncio.sleep(0.3)
    finally:
        await watchdog.stop()
    assert max(lags) > 1.0 and len(lags) >= 2
    assert any("event loop stalled for 1." in r.getMessage() for r in caplog.records)
