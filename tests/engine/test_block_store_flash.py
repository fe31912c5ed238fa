"""The prefix cache's K/V blocks under KV Flash (engine/kv/block_store.py) through the real
Engine and Target: KV Flash is an eviction policy over the same block tables, so a prompt
longer than the pool is saved with its paged-out blocks held as their host records are,
and a later prompt adopts its blocks as paged-out entries, its pager paging in what a
lane that computed them would hold, within its quota.

Oracles: under lru with prompt chunks of a block, restored == fresh, tokens and logprobs
bit for bit, unsplit and split, from memory and after a restart from the block files;
batched == alone with prefix hits; under qk a restored prompt (its block keys from the
records) answers as one shared from a kept lane paged out to its sink."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest
from engine_harness import engine_for, stream

from luced.engine.core import Engine, GenerationRequest
from luced.engine.kv.block_store import BlockStore
from luced.engine.kvflash import PagerConfig
from luced.runtime.tiny import make_tiny_gguf
from luced.sampling_params import SamplingParams

POOL = 448  # 7 blocks of 64: a lane's quota
PROMPT = [(13 * i + 5) % 97 + 2 for i in range(560)]  # 8 whole blocks, past the pool
NEXT = [*PROMPT[:512], *((7 * i + 3) % 89 + 2 for i in range(40))]  # its 8 blocks, then its own
GREEDY = SamplingParams(temperature=0, logprobs=2)
SPLIT = ("cpu", "cpu:1")

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("flash-blocks") / "qwen3.gguf"
    return make_tiny_gguf("qwen3", path, seed=7, layers=4, context=1024).path


@pytest.fixture(scope="module")
def known() -> dict[str, tuple[list[int], list]]:
    return {}


def flash(path: Path, devices: tuple[str, ...] = ("cpu",), policy: str = "lru", pool=POOL, **kw):
    """KV Flash with the prefix cache's blocks in host records (and in `kv_cache_dir`)."""
    cfg = PagerConfig(pool_tokens=pool, policy=policy)  # type: ignore[arg-type]
    opts = dict(context=1024, kv_flash=cfg, prefix_cache_bytes=16 << 20, block_files=True)
    return engine_for(path, devices, **(opts | kw))


async def served(e: Engine, prompt: list[int], n: int = 12) -> tuple[tuple[list[int], list], int]:
    """(tokens and logprobs, cached tokens) of one greedy request of n tokens."""
    handle = e.submit(GenerationRequest("r", prompt, GREEDY, n, ignore_eos=True))
    out = await stream(handle)
    return out, handle.cached_tokens


async def fresh(tiny: Path, known: dict, *prompts: list[int]) -> list:
    """Each prompt's tokens and logprobs from a KV Flash engine without a cache (once)."""
    todo = [p for p in prompts if str(p) not in known]
    if todo:
        async with engine_for(tiny, context=1024, kv_flash=PagerConfig(POOL, policy="lru")) as e:
            for p in todo:
                known[str(p)] = (await served(e, p))[0]
    return [known[str(p)] for p in prompts]


@contextlib.contextmanager
def saves_seen(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[int, int]]:
    """The saving lanes' paged-out blocks -> their records, as each save finds them."""
    seen: dict[int, int] = {}
    save = BlockStore.save

    async def seeing(self: BlockStore, slot: int, prompt, *rest) -> int:
        seen.update(self.tables.host(slot))
        return await save(self, slot, prompt, *rest)

    monkeypatch.setattr(BlockStore, "save", seeing)
    yield seen


@pytest.mark.parametrize("devices", [("cpu",), SPLIT], ids=["unsplit", "split"])
async def test_a_prompt_past_the_pool_restores_from_memory_as_fresh(
    tiny: Path, known, devices, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The prompt's prefill pages blocks 1 and 2 out; its save keeps their records as
    they are (held by the store once the request is gone, no copy made) and copies the
    resident 6. The next prompt adopts all 8 (512 cached tokens), its pager pages in the
    7 a lane that computed them holds (the sink and the newest), and both answers are
    the fresh ones, tokens and logprobs bit for bit."""
    want_p, want_n = await fresh(tiny, known, PROMPT, NEXT)
    with saves_seen(monkeypatch) as seen:
        async with flash(tiny, devices) as e:
            tables = e.target.blocks
            assert await served(e, PROMPT) == (want_p, 0)
            assert sorted(seen) == [1, 2]
            assert [tables.record_refs(r) for r in seen.values()] == [1, 1]  # the store's
            assert tables.used_records == len(e.prefix.store.memory()) == 8
            before = e.target.flash_status()
            assert await served(e, NEXT) == (want_n, 512)
            after = e.target.flash_status()
            stats = e.prefix_cache.stats()
    assert before["recalls"] == 0 and after["recalls"] == POOL // 64
    assert (stats.hits, stats.hit_tokens, stats.memory_blocks) == (1, 512, 8)


async def test_a_restart_restores_the_blocks_from_disk_as_fresh(
    tiny: Path, known, tmp_path: Path
) -> None:
    """The block files of a KV Flash engine (its pool, policy and chunks name their
    part) restore after a restart as a page-in: the next prompt answers as fresh. An
    engine with another pool finds none of them (its rows would attend otherwise)."""
    want_p, want_n = await fresh(tiny, known, PROMPT, NEXT)
    kv = tmp_path / "kv"
    async with flash(tiny, kv_cache_dir=kv) as e:
        assert await served(e, PROMPT) == (want_p, 0)
        await e.prefix_cache.save_all()
        assert e.prefix_cache.stats().disk_blocks == 8
    async with flash(tiny, kv_cache_dir=kv) as e:
        assert e.prefix_cache.stats().disk_blocks == 8
        assert await served(e, NEXT) == (want_n, 512)
    async with flash(tiny, kv_cache_dir=kv, pool=512) as e:
        assert e.prefix_cache.stats().disk_blocks == 0
        assert (await served(e, NEXT))[1] == 0


async def test_under_qk_a_restored_prompt_answers_as_a_kept_one(tiny: Path) -> None:
    """Under qk the reselections rank blocks by their keys: the next prompt restored from
    the cache's records (keyed by the workers from the records' K rows) answers as the
    same prompt sharing the first one's kept lane, paged out to its sink (its keys those
    the computing lane sealed), tokens and logprobs bit for bit, and recalls blocks."""
    pool = PagerConfig(pool_tokens=POOL, policy="qk")
    async with engine_for(tiny, context=1024, kv_flash=pool, kv_keep_tokens=256) as e:
        await served(e, PROMPT)
        await e._idle.wait()
        (lane,) = e.kv.kept
        assert e.target.blocks.resident(lane) == [0]
        kept = await served(e, NEXT)
    async with flash(tiny, policy="qk") as e:
        await served(e, PROMPT)
        restored = await served(e, NEXT)
        assert e.target.flash_status()["recalls"] > POOL // 64  # reselected by score
    assert kept[1] == restored[1] == 512
    assert restored[0] == kept[0]


async def test_batched_requests_with_prefix_hits_answer_as_alone(tiny: Path, known) -> None:
    """Three running requests: after the prompt, three more start on its blocks (512,
    448 and 512 positions: restored from the cache's records, or shared from one that
    restored them first, paged-out entries and all) and run together, each past the pool;
    each answers as it does alone without a cache (batched, logprobs to 1e-4)."""
    prompts = [
        NEXT,
        [*PROMPT[:448], *((5 * i + 1) % 83 + 2 for i in range(100))],
        [*PROMPT[:512], *((11 * i + 7) % 79 + 2 for i in range(20))],
    ]
    want = await fresh(tiny, known, *prompts)
    async with flash(tiny, max_running=3) as e:
        await served(e, PROMPT)
        handles = [
            e.submit(GenerationRequest(f"b{i}", p, GREEDY, 12, ignore_eos=True))
            for i, p in enumerate(prompts)
        ]
        got = await asyncio.gather(*(stream(h) for h in handles))
        assert e.stepped_sequences > e.steps  # really batched
    assert [h.cached_tokens for h in handles] == [512, 448, 512]
    for (tokens, lps), (want_tokens, want_lps) in zip(got, want, strict=True):
        assert tokens == want_tokens
        for (lp, top), (want_lp, want_top) in zip(lps, want_lps, strict=True):
            assert lp == pytest.approx(want_lp, abs=1e-4)
            assert [t[0] for t in top] == [t[0] for t in want_top]  # (text, logprob, bytes)
