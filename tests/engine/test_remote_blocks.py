"""The prefix cache's K/V blocks on a split whose second stage is a worker on host B
(tests/remote_harness.py): each host keeps its layers' part of every block, in its host
records (host B: its mirror of them) and in its own block files, by the same prefix keys
(engine/kv/remote_blocks.py, runtime/kv_store.py). Oracle: a fresh unsplit engine's tokens
and logprobs, bit for bit, for a restore from memory, from both disks after a daemon and
worker restart, and after host B lost some or all of its files (every worker restores the
same blocks or none; the rest is prefilled). Under KV Flash too (host B pages to its own
memory and holds a paged-out block's record there), with a DFlash draft (its ring rows stay
the daemon's: tokens, logprobs, windows and the draft's contexts as a fresh engine's on the
same hosts); a hybrid across hosts keeps snapshots."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from pathlib import Path

import pytest
import test_block_rings as rings
import test_block_store_flash as flash
from engine_harness import engine_for, generate, stream
from remote_harness import WorkerProc, settings

from luced.cache.block_files import BLOCKS, SUFFIX, prompt_keys
from luced.engine.core import Engine, GenerationRequest
from luced.engine.kv.block_store import BlockStore
from luced.engine.kv.remote_blocks import RemotePart
from luced.runtime.tiny import make_tiny_draft, make_tiny_gguf
from luced.sampling_params import SamplingParams

PORTS = itertools.count(7270)
PROMPT = [(7 * i + 3) % 120 + 2 for i in range(100)]  # 6 whole blocks and 4 positions
OTHER = PROMPT[:60] + [(13 * i + 1) % 120 + 2 for i in range(20)]  # 3 of PROMPT's blocks
GREEDY = SamplingParams(temperature=0, logprobs=2)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("remote-blocks") / "llama.gguf"
    return make_tiny_gguf("llama", path, seed=5, layers=4, context=512).path


@pytest.fixture(scope="module")
def fresh(tiny: Path) -> dict[str, tuple[list[int], list]]:
    """Each prompt's greedy tokens and logprobs from one local engine without a cache."""

    async def answers() -> dict[str, tuple[list[int], list]]:
        async with engine_for(tiny, context=512) as plain:
            return {name: (await served(plain, p))[0] for name, p in (("p", PROMPT), ("o", OTHER))}

    return asyncio.run(answers())


def engine(path: Path, kv: Path, worker: WorkerProc, key: Path):
    """Two running requests (a block pool), the second half of the layers on host B; the
    blocks in host records and on disk, host A's part in `kv`."""
    return engine_for(
        path,
        ("cpu", worker.device()),
        context=512,
        max_running=2,
        prefix_cache_bytes=16 << 20,
        kv_cache_dir=kv,
        block_files=True,
        remote=settings(key, path),
    )


async def served(e: Engine, prompt: list[int]) -> tuple[tuple[list[int], list], int]:
    """(tokens and logprobs, cached tokens) of one request."""
    handle = e.submit(GenerationRequest("r", prompt, GREEDY, 8, ignore_eos=True))
    out = await stream(handle)
    return out, handle.cached_tokens


def block_files(kv: Path) -> list[Path]:
    """The block files under one host's --kv-cache-dir, of its one part."""
    return sorted(kv.rglob(f"{BLOCKS}/*/*{SUFFIX}"))


async def until(condition: Callable[[], bool], timeout: float = 60) -> None:
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.05)


async def written(e: Engine, b_dir: Path, n: int) -> None:
    """Both hosts hold `n` blocks on disk (host B writes in the background)."""
    cache = e.prefix_cache
    assert cache is not None
    await cache.save_all()
    assert cache.stats().disk_blocks == n
    await until(lambda: len(block_files(b_dir)) == n)


def remote_part(e: Engine) -> RemotePart:
    store = e.prefix_cache.blocks  # type: ignore[union-attr]
    assert isinstance(store, BlockStore)
    local, remote = store.parts
    assert not isinstance(local, RemotePart) and isinstance(remote, RemotePart)
    return remote


async def test_blocks_restore_on_both_hosts_as_fresh(
    host, key: Path, tiny: Path, fresh, tmp_path: Path
) -> None:
    """A prompt sharing a saved one's first 3 blocks restores them from the host records
    of both hosts; after a restart of the daemon and of host B's worker, it and the saved
    one restore all their whole blocks but the last from both hosts' block files (host B's
    by the daemon's keys, in its own --kv-cache-dir); each with the fresh tokens and
    logprobs, bit for bit. No block row crosses the wire: the hop carries activations
    only."""
    a_dir, b_dir = tmp_path / "host-a", tmp_path / "host-b"
    w = WorkerProc(host, key, [tiny], next(PORTS), args=("--kv-cache-dir", str(b_dir))).start()
    try:
        async with engine(tiny, a_dir, w, key) as e:
            assert remote_part(e).part != ""
            assert await served(e, PROMPT) == (fresh["p"], 0)
            assert await served(e, OTHER) == (fresh["o"], 48)  # from memory, on both hosts
            await written(e, b_dir, 8)  # the prompt's 6 blocks, the other's 2 of its own
            (hop,) = e.target.hops.describe()
            assert hop["bytes_per_token"] == e.target.hidden * 4
        assert len(block_files(a_dir)) == 8
        assert {p.name for p in block_files(a_dir)} == {p.name for p in block_files(b_dir)}
        w.stop()
        since = len(w.lines)
        w.start()  # host B's memory is gone; its files are not
        async with engine(tiny, a_dir, w, key) as e:
            assert len(remote_part(e)) == 8  # listed by host B
            assert await served(e, OTHER) == (fresh["o"], 64)  # 4 of its 5: one to compute
            assert await served(e, PROMPT) == (fresh["p"], 96)
            stats = e.prefix_cache.stats()  # type: ignore[union-attr]
            assert (stats.hits, stats.entries) == (2, 0)  # blocks, no snapshot
        assert w.wait_log(r"block files: 8 blocks", since=since)
    finally:
        w.stop()


async def test_blocks_host_b_lost_are_prefilled_on_every_host(
    host, key: Path, tiny: Path, fresh, tmp_path: Path
) -> None:
    """Host B restarts without its files while the daemon runs: the daemon's index still
    names them, host B reads none, so no worker restores any block and the prompt is
    prefilled (== fresh); the blocks are written to host B again. Then a new daemon, host
    B having lost the prompt's last 3 blocks: every worker restores the first 3 only."""
    a_dir, b_dir = tmp_path / "host-a", tmp_path / "host-b"
    w = WorkerProc(host, key, [tiny], next(PORTS), args=("--kv-cache-dir", str(b_dir))).start()
    try:
        async with engine(tiny, a_dir, w, key) as e:
            assert await served(e, PROMPT) == (fresh["p"], 0)
            await written(e, b_dir, 6)
            w.stop()
            await until(lambda: e.state == "degraded")
            for path in block_files(b_dir):
                path.unlink()
            w.start()
            await until(lambda: e.state == "ready")
            assert len(remote_part(e)) == 6  # not listed again: the index is stale
            assert await served(e, PROMPT) == (fresh["p"], 0)
            await written(e, b_dir, 6)
        keys = prompt_keys(PROMPT, 16)
        for path in block_files(b_dir):
            if bytes.fromhex(path.stem) in keys[3:]:
                path.unlink()
        async with engine(tiny, a_dir, w, key) as e:
            assert await served(e, PROMPT) == (fresh["p"], 48)
            await written(e, b_dir, 6)  # the 3 lost ones again
    finally:
        w.stop()


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """KV Flash's model (test_block_store_flash's), a DFlash target and draft
    (test_block_rings'), a hybrid."""
    d = tmp_path_factory.mktemp("remote-blocks-more")
    qwen3 = make_tiny_gguf("qwen3", d / "qwen3.gguf", seed=7, layers=4, context=1024).path
    target = make_tiny_gguf("qwen3", d / "target.gguf", seed=7, layers=8, context=256).path
    draft = make_tiny_draft(target, d / "draft", seed=3, block_size=4)[1]
    hybrid = make_tiny_gguf("qwen35", d / "qwen35.gguf", seed=7).path
    return {"flash": qwen3, "target": target, "draft": draft, "hybrid": hybrid}


async def test_kv_flash_blocks_restore_on_both_hosts_as_fresh(
    host, key: Path, models: dict[str, Path], tmp_path: Path
) -> None:
    """KV Flash (lru) with host B holding the second half: the prompt pages blocks out on
    both hosts, its save holds their records as they are (host B's in its own memory) and
    writes every block on both hosts; the next prompt restores all 8 blocks, from memory
    and, in a new daemon, from both hosts' files, == the unsplit fresh run."""
    path = models["flash"]
    want_p, want_n = await flash.fresh(path, {}, flash.PROMPT, flash.NEXT)
    a_dir, b_dir = tmp_path / "host-a", tmp_path / "host-b"
    w = WorkerProc(host, key, [path], next(PORTS), args=("--kv-cache-dir", str(b_dir))).start()
    opts = dict(kv_cache_dir=a_dir, remote=settings(key, path))
    try:
        async with flash.flash(path, ("cpu", w.device()), **opts) as e:
            assert isinstance(remote_part(e), RemotePart)
            assert await flash.served(e, flash.PROMPT) == (want_p, 0)
            assert await flash.served(e, flash.NEXT) == (want_n, 512)
            await written(e, b_dir, 8)
        async with flash.flash(path, ("cpu", w.device()), **opts) as e:
            assert len(remote_part(e)) == 8
            assert await flash.served(e, flash.NEXT) == (want_n, 512)
    finally:
        w.stop()


async def test_a_draft_restores_blocks_and_ring_rows_across_hosts(
    host, key: Path, models: dict[str, Path]
) -> None:
    """A DFlash draft with the target's second half and the draft on host B: the blocks
    on both hosts, their ring rows in the daemon's memory (the rings are its shared
    memory, relayed to the draft); a second turn restores the first prompt's 6 blocks and
    answers as a fresh engine on the same hosts does: tokens, logprobs, windows, and the
    contexts its draft read, bit for bit."""
    tiny = (models["target"], models["draft"])
    w = WorkerProc(host, key, list(tiny), next(PORTS)).start()
    try:

        def engine(cache: bool):
            return engine_for(
                tiny[0], ("cpu", w.device()), draft=tiny[1], proposer_cls=rings.Recording,
                context=256, block_size=4, max_running=2, remote=settings(key, *tiny),
                prefix_cache_bytes=(16 << 20) if cache else 0, block_files=cache,
            )  # fmt: skip

        prompts = {"p": rings.PROMPT, "t": rings.TURN2}
        async with engine(cache=False) as e:
            want = {k: (await rings.served(e, p))[0] for k, p in prompts.items()}
        async with engine(cache=True) as e:
            got = {k: await rings.served(e, p) for k, p in prompts.items()}
            store = e.prefix_cache.blocks  # type: ignore[union-attr]
            assert isinstance(store, BlockStore) and store.rings is not None
    finally:
        w.stop()
    assert {k: n for k, (_, n) in got.items()} == {"p": 0, "t": 96}
    for k, (answer, _) in got.items():
        rings.check(answer, want[k])


async def test_a_hybrid_across_hosts_keeps_snapshots(
    host, key: Path, models: dict[str, Path]
) -> None:
    """A hybrid with host B holding the second half keeps snapshots, though requests
    share a block pool: its recurrent states' records and files are kept only on the
    daemon's host, so the target gives the block store no records (`Target.start`), and
    a second prompt restores from the snapshot (host B's rows on host B) == fresh."""
    path = models["hybrid"]
    first = [(7 * i + 3) % 120 + 2 for i in range(40)]
    second = [*first, *((11 * i + 5) % 120 + 2 for i in range(12))]
    async with engine_for(path) as e:
        fresh_tokens = (await generate(e, second, 8))[0]
    w = WorkerProc(host, key, [path], next(PORTS)).start()
    try:
        async with engine_for(
            path, ("cpu", w.device()), max_running=2, prefix_cache_bytes=16 << 20,
            block_files=True, remote=settings(key, path),
        ) as e:  # fmt: skip
            assert e.target.store_records == 0 and e.target.states is None
            assert e.prefix_cache is not None and e.prefix_cache.blocks is None
            await generate(e, first, 4)
            tokens, handle, _ = await generate(e, second, 8)
    finally:
        w.stop()
    assert handle.cached_tokens > 0 and tokens == fresh_tokens
