"""MoE cold experts across hosts: the expert worker on host B (its calls over the hops
"experts-k", runtime/expert_link.HopExperts), or a pipeline stage on host B calling a local
expert worker. Remote experts == all local, token for token; an expert worker killed
mid-stream leaves the stream exact (the layers fall back in process) and is used again once
it is back."""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path

import pytest
from engine_harness import engine_for, generate
from remote_harness import WorkerProc, settings

from luced.engine.core import Engine
from luced.engine.executor import Deadlines
from luced.runtime.tiny import make_tiny_gguf

PORTS = itertools.count(7570)
PROMPTS = [[3, 17, 5, 42, 8, 99, 23, 4, 61, 7], [(7 * i + 3) % 120 + 2 for i in range(70)]]
HOT = 4  # of 8 experts per layer


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("rx") / "qwen3moe.gguf"
    return make_tiny_gguf("qwen3moe", path, seed=7, context=512, layers=4).path


@pytest.fixture(scope="module")
def local(moe: Path) -> list[list[int]]:
    async def run() -> list[list[int]]:
        async with engine_for(moe, context=256) as engine:
            return await run_all(engine)

    return asyncio.run(run())


async def run_all(engine: Engine) -> list[list[int]]:
    return [(await generate(engine, p, 20))[0] for p in PROMPTS]


async def test_an_expert_worker_on_another_host_equals_all_local(
    host, key: Path, moe: Path, local: list[list[int]]
) -> None:
    worker = WorkerProc(host, key, [moe], next(PORTS)).start()
    try:
        remote = dict(moe_hot=HOT, moe_expert_device=worker.device(), remote=settings(key, moe))
        async with engine_for(moe, context=256, max_running=2, **remote) as engine:
            assert await run_all(engine) == local
            totals = engine.target.moe_status()
            hops = {h["hop"] for h in engine.target.hops.describe()}
        assert totals is not None and totals["remote_calls"] > 0 and totals["fallbacks"] == 0
        assert hops == {"experts-0"}
    finally:
        assert worker.stop() == 0


async def test_a_remote_stage_calls_a_local_expert_worker(
    host, key: Path, moe: Path, local: list[list[int]]
) -> None:
    worker = WorkerProc(host, key, [moe], next(PORTS)).start()
    try:
        remote = dict(moe_hot=HOT, moe_expert_device="cpu:2", remote=settings(key, moe))
        async with engine_for(moe, ("cpu", worker.device()), context=256, **remote) as engine:
            assert await run_all(engine) == local
            totals = engine.target.moe_status()
            hops = {h["hop"] for h in engine.target.hops.describe()}
        assert totals is not None and totals["remote_calls"] > 0 and totals["fallbacks"] == 0
        assert hops == {"act-0", "experts-1"}  # stage 0 calls the expert worker by its link
    finally:
        assert worker.stop() == 0


async def test_a_killed_expert_host_falls_back_exactly_and_is_used_again(
    host, key: Path, moe: Path, local: list[list[int]]
) -> None:
    worker = WorkerProc(host, key, [moe], next(PORTS)).start()
    try:
        remote = dict(moe_hot=HOT, moe_expert_device=worker.device(), remote=settings(key, moe))
        quick = Deadlines(call=3.0, start=20.0)  # a dead peer's calls end within seconds
        async with engine_for(moe, context=256, deadlines=quick, **remote) as engine:
            assert await run_all(engine) == local
            worker.kill()
            assert await run_all(engine) == local  # in process meanwhile: the same tokens
            fell_back = engine.target.moe_status()["fallbacks"]
            assert fell_back > 0 and engine.state == "ready"  # not needed to serve
            worker.start()
            slot = engine.target.executor.expert_slot
            async with asyncio.timeout(120):
                while slot.handle is None or slot.handle.state != "ready":
                    await asyncio.sleep(0.1)
            calls = engine.target.moe_status()["remote_calls"]
            assert await run_all(engine) == local
            totals = engine.target.moe_status()
        assert totals["remote_calls"] > calls  # the expert worker answers again
    finally:
        worker.stop()
