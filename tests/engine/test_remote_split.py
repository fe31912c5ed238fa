"""A layer split across two hosts: the second stage a ``luced worker --listen`` on host B (a
network namespace with its own /dev/shm, tests/remote_harness.py), the boundary rows over a
torch.distributed hop, token ids and sampled rows inline on the control connection.

Oracle: the unsplit model, as in test_target_split (bitwise logits and ring captures, token
for token greedy and seeded sampling); a hybrid's recurrent state through the engine's
own unsplit run; and a wire that adds 5 ms each way changes nothing.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from engine_harness import engine_for, generate
from remote_harness import WorkerProc, needs_wire, settings
from test_target_split import check_split_equals_unsplit

from luced.engine.kvflash import PagerConfig
from luced.runtime.tiny import make_tiny_gguf

PORTS = itertools.count(7170)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("remote-split")
    make_tiny_gguf("llama", d / "llama.gguf", seed=3, layers=4)
    make_tiny_gguf("qwen35", d / "qwen35.gguf", seed=7)
    make_tiny_gguf("qwen3", d / "qwen3.gguf", seed=7, layers=4, context=1024)
    return {n: d / f"{n}.gguf" for n in ("llama", "qwen35", "qwen3")}


@pytest.fixture(scope="module")
def worker(host, key: Path, models: dict[str, Path], smollm2_gguf: Path) -> Iterator[WorkerProc]:
    """One worker on host B holding every model of the module, as in the float math of
    this process (same thread count)."""
    files = [*models.values(), smollm2_gguf]
    w = WorkerProc(host, key, files, next(PORTS), threads=torch.get_num_threads()).start()
    yield w
    assert w.stop() == 0


@pytest.mark.parametrize("remote_first", [False, True], ids=["local-remote", "remote-local"])
async def test_split_across_hosts_equals_unsplit(
    worker: WorkerProc, key: Path, models: dict[str, Path], remote_first: bool
) -> None:
    path = models["llama"]
    devices = (worker.device(), "cpu") if remote_first else ("cpu", worker.device())
    await check_split_equals_unsplit(path, devices, remote=settings(key, path))
    # The remote worker kept its weights for the next daemon's identical load.
    assert worker.wait_log("daemon disconnected")


async def test_three_stages_one_remote_in_the_middle(
    worker: WorkerProc, key: Path, models: dict[str, Path]
) -> None:
    path = models["llama"]
    devices = ("cpu", worker.device(), "cpu:1")
    await check_split_equals_unsplit(path, devices, remote=settings(key, path))


@pytest.mark.parametrize("name", ["qwen35", "smollm2"])
async def test_engine_split_across_hosts_equals_unsplit(
    worker: WorkerProc, key: Path, models: dict[str, Path], smollm2_gguf: Path, name: str
) -> None:
    path = smollm2_gguf if name == "smollm2" else models[name]
    prompts = [[3, 17, 5, 42, 8, 99, 23, 4, 61, 7] * 8, [11, 12, 13, 14]]
    async with engine_for(path, max_running=2) as engine:
        want = [(await generate(engine, p, 12))[0] for p in prompts]
    remote = settings(key, path)
    async with engine_for(path, ("cpu", worker.device()), max_running=2, remote=remote) as engine:
        got = [(await generate(engine, p, 12))[0] for p in prompts]
        hops = engine.target.hops.describe()
    assert got == want
    (hop,) = hops
    hidden = engine.target.hidden
    assert hop["bytes_per_token"] == hidden * 4  # float32 rows, one per token fed


async def test_a_slow_wire_changes_nothing(
    host, worker: WorkerProc, key: Path, models: dict[str, Path]
) -> None:
    needs_wire(host)
    path = models["llama"]
    host.wire("delay 5")
    try:
        await check_split_equals_unsplit(path, ("cpu", worker.device()), remote=settings(key, path))
    finally:
        host.wire("delay 0")


@pytest.mark.parametrize("name", ["llama", "qwen35"])
async def test_prefix_cache_snapshots_of_a_remote_shard_restore_exactly(
    worker: WorkerProc, key: Path, models: dict[str, Path], name: str
) -> None:
    """The remote shard's K/V rows (a hybrid's recurrent states too) reach the snapshot arena
    through its local neighbour over the hop, and come back on a hit: a restored request
    equals the fresh one, token for token."""
    path = models[name]
    first = [(7 * i + 3) % 120 + 2 for i in range(150)]
    second = first + [(11 * i + 5) % 120 + 2 for i in range(40)]
    async with engine_for(path) as engine:
        fresh = (await generate(engine, second, 12))[0]
    remote = settings(key, path)
    async with engine_for(
        path, ("cpu", worker.device()), prefix_cache_bytes=64 << 20, remote=remote
    ) as engine:
        await generate(engine, first, 4)
        saved = engine.target.hops.describe()[0]["snapshot_bytes"]
        tokens, handle, _ = await generate(engine, second, 12)
        restored = engine.target.hops.describe()[0]["snapshot_bytes"] - saved
    assert handle.cached_tokens >= 100
    assert tokens == fresh
    assert saved > 0 and restored > 0  # the snapshot's rows went over the hop, both ways


async def test_kv_flash_pages_on_both_hosts_as_on_one(
    worker: WorkerProc, key: Path, models: dict[str, Path]
) -> None:
    """KV Flash (qk) over a split whose second stage is on host B: both shards run every
    plan, host B paging to its own memory (its host tier never crosses the wire) and
    sending its qk scores back; evictions, recalls, logprobs and tokens are the unsplit
    run's."""
    path = models["qwen3"]
    prompt = [(13 * i + 5) % 97 + 2 for i in range(560)]  # past the 448-token pool
    pool = PagerConfig(pool_tokens=448, policy="qk")
    async with engine_for(path, context=1024, kv_flash=pool) as engine:
        want, _, want_lps = await generate(engine, prompt, 24, logprobs=1)
        want_status = engine.target.flash_status()
    remote = settings(key, path)
    devices = ("cpu", worker.device())
    async with engine_for(path, devices, context=1024, kv_flash=pool, remote=remote) as engine:
        got, _, got_lps = await generate(engine, prompt, 24, logprobs=1)
        status = engine.target.flash_status()
    assert want_status is not None and status is not None
    assert want_status["evictions"] > 0 and want_status["recalls"] > 0
    assert (status["evictions"], status["recalls"]) == (
        want_status["evictions"],
        want_status["recalls"],
    )
    assert got == want
    for (lp, top), (want_lp, want_top) in zip(got_lps, want_lps, strict=True):
        assert top == want_top and abs(lp - want_lp) < 1e-4
