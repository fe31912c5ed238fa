"""A cancelled worker call stays cancelled, even when its reply lands in the same turn of
the event loop: the daemon's shutdown cancels the decode loop mid-call, and a call that
returned its reply instead would let the loop decode on to max_tokens."""

from __future__ import annotations

import asyncio

from luced.engine.executor import WorkerHandle
from luced.engine.placement import WorkerSpec
from luced.ipc.frames import Reply, Request, Shutdown, ShutdownReply


class AnsweringChannel:
    """A channel whose reply is ready one turn of the loop after the request went out."""

    async def exchange(
        self, req: Request, carry: object = None, on_progress: object = None
    ) -> tuple[Reply, tuple[bytes, ...]]:
        await asyncio.sleep(0)
        return ShutdownReply(), ()


def test_a_cancel_at_any_turn_of_the_call_is_not_lost() -> None:
    async def cancel_after(turns: int) -> bool:
        """Cancel the call after `turns` loop turns; False when it had already finished."""
        handle = WorkerHandle(WorkerSpec("cpu", ("cpu",)), "test")
        handle.channel, handle.state = AnsweringChannel(), "ready"
        call = asyncio.create_task(handle.call(Shutdown()))
        for _ in range(turns):
            await asyncio.sleep(0)
        if call.done():
            return False
        call.cancel()
        try:
            await call
        except asyncio.CancelledError:
            return True
        raise AssertionError(f"a cancel after {turns} turns was lost: the call returned")

    async def run() -> int:
        turns = 0
        while await cancel_after(turns):
            turns += 1
        return turns

    assert asyncio.run(run()) >= 2  # the cancel landed before and while the reply was ready
