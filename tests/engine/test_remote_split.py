"""A layer split across two hosts: the second stage a ``luced worker --listen`` on host B (a
network namespace with its own /dev/shm, tests/remote_harness.py), the boundary rows over a
torch.distributed hop, token ids and sampled rows inline on the control connection.

Oracle: the unsplit model, as in test_target_split (bitwise logits and ring captures, token
for token greedy and seeded sampling); a hybrid's recurrent state through the engine's
own unsplit run; and a wire that adds 5 ms each way changes nothing.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from engine_harness import engine_for, generate
from remote_harness import WorkerProc, needs_wire, settings
from test_kept_prefixes import check_kept_prompt_pages_out_and_in
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
    make_tiny_gguf("qwen3", d / "qwen3-512.gguf", seed=7, layers=4, context=512)
    return {n: d / f"{n}.gguf" for n in ("llama", "qwen35", "qwen3", "qwen3-512")}


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


FIRST = [(7 * i + 3) % 120 + 2 for i in range(150)]
SECOND = FIRST + [(11 * i + 5) % 120 + 2 for i in range(40)]


async def until(condition, timeout: float = 120) -> None:
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.05)


async def snapshot_files(directory: Path, count: int) -> list[Path]:
    """The snapshot files under `directory` once there are `count` (host B writes and
    deletes them in the background)."""
    found: list[Path] = []

    def done() -> bool:
        nonlocal found
        found = sorted(directory.rglob("*.safetensors"))
        return len(found) == count

    await until(done, timeout=60)
    return found


@pytest.mark.parametrize("name", ["llama", "qwen35"])
async def test_a_remote_shard_keeps_its_snapshot_rows_on_its_host(
    host, key: Path, models: dict[str, Path], name: str, tmp_path: Path
) -> None:
    """Where the prefix cache keeps snapshots (one running request here; a hybrid
    always), host B keeps its layers' rows (a hybrid's recurrent states too) in its memory
    and on its disk; the daemon's arena and files hold only host A's, and no row crosses
    the wire. A hit restores both halves, == fresh; so does one after the daemon and the
    worker restart, from both disks. (K/V blocks on both hosts: test_remote_blocks.py.)"""
    path = models[name]
    async with engine_for(path) as engine:
        fresh = (await generate(engine, SECOND, 12))[0]
    remote = settings(key, path)
    b_dir, a_dir = tmp_path / "host-b", tmp_path / "host-a"
    w = WorkerProc(host, key, [path], next(PORTS), args=("--kv-cache-dir", str(b_dir))).start()
    devices = ("cpu", w.device())
    try:
        opts = dict(prefix_cache_bytes=64 << 20, kv_cache_dir=a_dir, remote=remote)
        async with engine_for(path, devices, **opts) as engine:  # type: ignore[arg-type]
            await generate(engine, FIRST, 4)
            tokens, handle, _ = await generate(engine, SECOND, 12)
            (hop,) = engine.target.hops.describe()
            cache = engine.prefix_cache
            assert cache is not None
            held = {s.name for s in cache.specs}
            (second,) = (e.id for e in cache.entries() if len(e.tokens) == len(SECOND))
            # Host B writes its part in the background (the first prompt's entry may be
            # dropped as redundant meanwhile, on both hosts).
            await until(lambda: second in {p.stem for p in b_dir.rglob("*.safetensors")})
        assert handle.cached_tokens >= 100 and tokens == fresh
        assert hop["bytes_per_token"] == engine.target.hidden * 4  # activations only
        layers = {int(n.split(".")[1]) for n in held if "." in n}
        first = engine.target.placement.workers[0][1].layers[1]
        assert layers and max(layers) < first  # host A's layers only
        w.stop()
        w.start()  # host B's memory is gone; its disk is not
        async with engine_for(path, devices, **opts) as engine:  # type: ignore[arg-type]
            tokens, handle, _ = await generate(engine, SECOND, 12)
        assert handle.cached_tokens >= 100 and tokens == fresh
        assert w.wait_log(r"snapshot store: [12] snapshot\(s\)")
    finally:
        w.stop()


async def test_a_snapshot_host_b_lost_is_prefilled_and_dropped(
    host, key: Path, models: dict[str, Path], tmp_path: Path
) -> None:
    """A snapshot entry whose remote half is gone (host B restarted without a disk tier)
    is refused there: the request is prefilled (== fresh) and the entry dropped. Dropping
    an entry in the daemon deletes host B's file."""
    path = models["llama"]
    async with engine_for(path) as engine:
        fresh = (await generate(engine, SECOND, 12))[0]
    remote = settings(key, path)
    w = WorkerProc(host, key, [path], next(PORTS)).start()
    devices = ("cpu", w.device())
    try:
        async with engine_for(path, devices, prefix_cache_bytes=64 << 20, remote=remote) as engine:
            await generate(engine, FIRST, 4)
            w.stop()
            await until(lambda: engine.state == "degraded")
            w.start()  # without a disk tier: its snapshots are gone
            await until(lambda: engine.state == "ready")
            cache = engine.prefix_cache
            assert cache is not None and len(cache.entries()) == 1
            tokens, handle, _ = await generate(engine, SECOND, 12)
            assert handle.cached_tokens == 0 and tokens == fresh
            assert w.wait_log("is not held on this host")
            assert [len(e.tokens) for e in cache.entries()] == [len(SECOND)]  # the new one
    finally:
        w.stop()
    w = WorkerProc(host, key, [path], next(PORTS), args=("--kv-cache-dir", str(tmp_path))).start()
    try:
        opts = dict(prefix_cache_bytes=64 << 20, remote=remote)
        async with engine_for(path, ("cpu", w.device()), **opts) as engine:  # type: ignore[arg-type]
            await generate(engine, FIRST, 4)
            (entry,) = engine.prefix_cache.entries()  # type: ignore[union-attr]
            (file,) = await snapshot_files(tmp_path, 1)
            assert file.stem == entry.id
            assert await engine.prefix_cache.drop(entry.id)  # type: ignore[union-attr]
            await snapshot_files(tmp_path, 0)
    finally:
        w.stop()


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


async def test_a_kept_prompt_pages_out_on_both_hosts_as_on_one(
    worker: WorkerProc, key: Path, models: dict[str, Path]
) -> None:
    """Without KV Flash, a kept prompt pages out under pressure (`kv_page`) on a split whose
    second stage is on host B, which pages to its own memory; the next turn pages it back
    in on both hosts and gives the fresh unsplit output (test_kept_prefixes)."""
    path = models["qwen3-512"]
    await check_kept_prompt_pages_out_and_in(
        path, ("cpu", worker.device()), remote=settings(key, path)
    )
