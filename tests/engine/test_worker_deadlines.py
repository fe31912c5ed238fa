"""Worker deadlines against real worker processes: a start takes as long as it needs while
the worker reports progress, a silent one ends with a message naming the option, a
stalled daemon kills nobody, and a failed restart says why.

The slow starts are injected with the worker's test-only ``LUCED_TEST_WORKER_SLOW_START``
(``silent:S`` sleeps before it reads anything, ``import:S`` while it imports, with
progress notes), against limits of a few seconds."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time

import pytest

from luced.engine.executor import Deadlines, Executor, Slot, WorkerDied, WorkerHandle
from luced.engine.placement import WorkerSpec
from luced.ipc.frames import Stats, StatsReply

SPEC = WorkerSpec("cpu", ("cpu",), threads=1)
SLOW_START = "LUCED_TEST_WORKER_SLOW_START"


def gone(pid: int) -> bool:
    """The process has exited (a zombie not yet reaped counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


async def test_a_start_that_reports_progress_outlasts_the_limit(monkeypatch) -> None:
    # 7 s of importing against a 3 s limit: the progress notes keep it alive.
    monkeypatch.setenv(SLOW_START, "import:7")
    worker = WorkerHandle(SPEC, "t", deadlines=Deadlines(start=3.0))
    try:
        await worker.start()
        assert worker.state == "idle" and worker.hello is not None
        assert isinstance(await worker.call(Stats()), StatsReply)
    finally:
        await worker.stop()


async def test_a_silent_start_ends_with_the_option_to_raise(monkeypatch) -> None:
    monkeypatch.setenv(SLOW_START, "silent:60")
    exits: list[int] = []
    worker = WorkerHandle(SPEC, "t", lambda _, code: exits.append(code), Deadlines(start=2.0))
    try:
        with pytest.raises(WorkerDied) as err:
            await worker.start()
        message = str(err.value)
        assert "did not start" in message and "since it was sent hello" in message
        assert "raise --worker-start-timeout (now 2 s)" in message
        await asyncio.wait_for(worker.proc.wait(), 10)  # killed, not left sleeping
        await asyncio.sleep(0.1)
        assert exits == []  # a start's failure is its caller's: no restart by the watcher
    finally:
        await worker.stop()


async def test_a_stalled_loop_kills_no_worker_and_a_silent_worker_dies() -> None:
    """The loop blocks for 3 s right after a call went out, far past its 0.5 s deadline,
    while the worker answers: the answer is read, and the worker lives on. A stopped
    worker, silent while the loop runs, still misses the deadline and is killed."""
    worker = WorkerHandle(SPEC, "t", deadlines=Deadlines(call=0.05))  # 10 floors: 0.5 s
    try:
        await worker.start()
        assert worker.deadline(Stats()) == pytest.approx(0.5)
        call = asyncio.create_task(worker.call(Stats()))
        asyncio.get_running_loop().call_soon(time.sleep, 3.0)  # after the call's first step
        assert isinstance(await call, StatsReply)
        assert worker.state == "idle" and worker.proc.returncode is None
        os.kill(worker.pid, signal.SIGSTOP)
        with pytest.raises(WorkerDied, match=r"did not answer stats within 0.5 s"):
            await worker.call(Stats())
        await asyncio.wait_for(worker.proc.wait(), 10)
    finally:
        await worker.stop()


async def test_a_failed_expert_worker_restart_says_why(monkeypatch, caplog) -> None:
    async def loader(slot: Slot, worker: WorkerHandle) -> None:
        return None  # the restart fails before any load

    executor = Executor("t", (), loader, deadlines=Deadlines(start=2.0))
    pids = []
    try:
        await executor.add_expert_slot(SPEC)
        first = executor.expert_slot.handle
        pids.append(first.pid)
        monkeypatch.setenv(SLOW_START, "silent:60")  # the replacement will not start
        with caplog.at_level(logging.ERROR, logger="luced.engine.executor"):
            os.kill(first.pid, signal.SIGKILL)
            for _ in range(600):
                failed = [r for r in caplog.records if "restart #1 failed" in r.getMessage()]
                if failed:
                    break
                await asyncio.sleep(0.1)
        [record] = failed
        message = record.getMessage()
        assert message.startswith("worker cpu (the cold experts) restart #1 failed: worker cpu")
        assert "did not start" in message and "raise --worker-start-timeout" in message
        assert message.endswith("trying again in 0.5 s")
        pids.append(executor.expert_slot.handle.pid)
    finally:
        await executor.close()
    for pid in pids:
        assert gone(pid), pid
