"""A worker killed under a real Engine: the requests that have streamed tokens end with an
error, the ones that have not wait for the restart (the daemon-level test with a full
queue: tests/e2e/test_worker_crash_daemon.py)."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest
from engine_harness import engine_for

from luced.engine.core import RESUME_LOST, Engine, GenerationRequest, RequestHandle
from luced.runtime.tiny import make_tiny_gguf
from luced.sampling_params import SamplingParams

OLDER = [(7 * i + 3) % 120 + 2 for i in range(90)]
YOUNGER = [11, 12, 13, 14, 15, 16, 17, 18]
FRESH = [3, 17, 5, 42, 8, 99, 23, 4, 61, 7]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("crash") / "qwen3.gguf"
    return make_tiny_gguf("qwen3", path, seed=7, layers=4, context=512).path


def request(name: str, prompt: list[int], max_tokens: int, **params) -> GenerationRequest:
    sampling = SamplingParams(**{"temperature": 0, **params})
    return GenerationRequest(name, prompt, sampling, max_tokens, ignore_eos=True)


async def tokens(handle: RequestHandle) -> list[int]:
    return [t async for delta in handle for t in delta.token_ids]


async def test_a_preempted_request_fails_and_a_queued_one_waits(tiny: Path) -> None:
    """A pool of one context: the younger of two requests gives its KV up mid-stream and
    waits, a fresh one waits behind it, and the worker is killed. The running request and
    the preempted one (its seeded generator was in the worker) end with an error; the
    fresh one runs once the worker is back, with the tokens it gets alone."""
    fresh = request("fresh", FRESH, 24)
    async with engine_for(tiny, context=256) as engine:
        alone = await tokens(engine.submit(fresh))
    async with engine_for(tiny, context=256, max_running=3, kv_pool_tokens=256) as engine:
        older = engine.submit(request("older", OLDER, 150))
        first = aiter(older)
        await anext(first)
        younger = engine.submit(request("younger", YOUNGER, 150, temperature=0.8, seed=3))
        while not engine.preempted:  # the pool fills: the younger one gives way
            await asyncio.sleep(0.01)
        assert younger in engine.waiting and younger in engine.preempted.values()
        queued = engine.submit(fresh)
        assert list(engine.waiting) == [younger, queued]
        os.kill(worker_pid(engine), signal.SIGKILL)
        async for _ in first:
            pass
        assert older.finish_reason == "error"
        await tokens(younger)
        assert (younger.finish_reason, younger.error) == ("error", RESUME_LOST)
        assert not engine.preempted
        assert await tokens(queued) == alone and queued.finish_reason == "length"
        assert engine.totals["errors"] == 2
        assert await engine.drain(10) and engine.kv is not None and engine.kv.used == 0


def worker_pid(engine: Engine) -> int:
    handle = engine.target.executor.slots[0].handle
    assert handle is not None and handle.pid is not None
    return handle.pid
