"""The prefix cache's memory tier as host records held by prefix key
(engine/kv/block_store.py) through the real Engine and Target: a second prompt restores its
blocks from memory, with no disk read, and answers as a fresh engine does, tokens and
logprobs bit for bit, unsplit and split over two local workers; a small memory gives up
its least recently used blocks, a prompt's deepest first; a kept lane paging out takes
records the cache gives up; a refused save loses only itself."""

from __future__ import annotations

from pathlib import Path

import pytest
from engine_harness import engine_for, stream

from luced.cache.block_files import BlockFiles, prompt_keys
from luced.engine.core import Engine, GenerationRequest
from luced.engine.kv.block_store import BlockStore
from luced.runtime.tiny import make_tiny_gguf
from luced.sampling_params import SamplingParams

BLOCK = 16
PROMPT = [(7 * i + 3) % 120 + 2 for i in range(100)]  # 6 whole blocks and 4 positions
OTHER = PROMPT[:60] + [(13 * i + 1) % 120 + 2 for i in range(20)]  # 3 of PROMPT's blocks
QUERY = [(11 * i + 5) % 120 + 2 for i in range(100)]  # none of them
SYSTEM = [(7 * i + 3) % 120 + 2 for i in range(120)]  # 7 whole blocks and 8 positions
GREEDY = SamplingParams(temperature=0, logprobs=2)
SPLIT = ("cpu", "cpu:1")

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("records") / "llama.gguf"
    return make_tiny_gguf("llama", path, seed=5, layers=4, context=512).path


@pytest.fixture(scope="module")
def known() -> dict[tuple[int, str], tuple[list[int], list]]:
    return {}


async def served(e: Engine, prompt: list[int], n: int = 8) -> tuple[tuple[list[int], list], int]:
    """(tokens and logprobs, cached tokens) of one greedy request of n tokens."""
    handle = e.submit(GenerationRequest("r", prompt, GREEDY, n, ignore_eos=True))
    out = await stream(handle)
    return out, handle.cached_tokens


async def fresh(tiny: Path, known: dict, context: int, *prompts: list[int], n: int = 8) -> list:
    """Each prompt's n tokens and logprobs from an engine without a cache (once each)."""
    todo = [p for p in prompts if (context, n, str(p)) not in known]
    if todo:
        async with engine_for(tiny, context=context) as plain:
            for p in todo:
                known[context, n, str(p)] = (await served(plain, p, n))[0]
    return [known[context, n, str(p)] for p in prompts]


def store_of(e: Engine) -> BlockStore:
    assert e.prefix.store is not None and e.prefix_cache is not None
    assert e.prefix_cache.arena is None  # the blocks are the tiers
    return e.prefix.store


def records(path: Path, devices=("cpu",), **kw):
    """Two running requests (a block pool), the prefix cache's blocks in host records only
    (no --kv-cache-dir) unless `kw` says otherwise."""
    opts = dict(context=512, max_running=2, prefix_cache_bytes=16 << 20, block_files=True)
    return engine_for(path, devices, **(opts | kw))


@pytest.mark.parametrize("devices", [("cpu",), SPLIT], ids=["unsplit", "split"])
async def test_a_second_prompt_restores_its_blocks_from_memory_as_fresh(
    tiny: Path, known, devices
) -> None:
    """No disk at all: the prompt's 6 whole blocks stay in host records after its prefill;
    the same prompt again adopts them (96 cached tokens, one a block of its own to compute)
    and a prompt sharing its first 60 tokens adopts 3 (48); every answer is the fresh one,
    tokens and logprobs bit for bit. The status counts the blocks in memory."""
    want_p, want_o = await fresh(tiny, known, 512, PROMPT, OTHER)
    async with records(tiny, devices) as e:
        store = store_of(e)
        assert await served(e, PROMPT) == (want_p, 0)
        assert await served(e, PROMPT) == (want_p, 96)
        assert await served(e, OTHER) == (want_o, 48)
        status = e.status()["prefix_cache"]
        assert (status["memory_blocks"], status["entries"], status["disk_blocks"]) == (8, 0, 0)
        assert status["memory_bytes"] == status["memory_block_bytes"] == 8 * store.record_bytes
        assert store.capacity == (16 << 20) // store.record_bytes  # more than a context's
        assert status["memory_capacity"] == store.capacity * store.record_bytes
        assert status["disk_budget"] is None
        assert (status["hits"], status["hit_tokens"]) == (2, 96 + 48)
        assert e.target.blocks.used_records == 8  # the memory's, none left behind
        assert await e.prefix_cache.clear() == 8
        assert e.target.blocks.used_records == 0


async def test_a_memory_hit_reads_no_block_file(
    tiny: Path, known, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a disk tier too: the prompt's blocks are written and stay in memory, so its
    second run reads no file; once the memory is cleared the third reads all 6."""
    (want_p,) = await fresh(tiny, known, 512, PROMPT)
    reads: list[bytes] = []
    read_into = BlockFiles.read_into

    def counted(self: BlockFiles, key: bytes, dest: memoryview) -> None:
        reads.append(key)
        read_into(self, key, dest)

    monkeypatch.setattr(BlockFiles, "read_into", counted)
    async with records(tiny, kv_cache_dir=tmp_path / "kv") as e:
        assert await served(e, PROMPT) == (want_p, 0)
        await e.prefix_cache.save_all()
        assert e.prefix_cache.stats().disk_blocks == 6
        assert await served(e, PROMPT) == (want_p, 96)
        assert reads == []
        await e.prefix_cache.clear()
        assert await served(e, PROMPT) == (want_p, 96)
        assert reads == prompt_keys(PROMPT, BLOCK)


async def test_a_small_memory_gives_up_the_least_recently_used_blocks_deepest_first(
    tiny: Path, known
) -> None:
    """A 128-token context and --prefix-cache-bytes of almost nothing: the memory holds a
    context's 8 records. The second prompt's 6 blocks take the place of the first one's
    deepest 4, so the first comes back with its first 2 blocks (32 cached tokens), and its
    4 saved again push out the second one's deepest 4; every answer is the fresh one."""
    want_p, want_q = await fresh(tiny, known, 128, PROMPT, QUERY)
    p, q = prompt_keys(PROMPT, BLOCK), prompt_keys(QUERY, BLOCK)
    async with records(tiny, context=128, prefix_cache_bytes=1) as e:
        store = store_of(e)
        assert store.capacity == 8 and e.target.blocks.records == 8
        assert await served(e, PROMPT) == (want_p, 0)
        assert store.memory() == p[::-1]  # least recently used first: the deepest
        assert await served(e, QUERY) == (want_q, 0)
        assert store.memory() == [p[1], p[0], *q[::-1]]
        assert await served(e, PROMPT) == (want_p, 32)
        assert store.memory() == [q[1], q[0], *p[::-1]]
        assert await served(e, QUERY) == (want_q, 32)
        assert e.target.blocks.used_records == 8


async def test_a_kept_lane_pages_out_into_records_the_cache_gives_up(tiny: Path) -> None:
    """A pool of one context, finished prompts kept: the first turn's 7 whole blocks are
    in the cache's memory, and every other host record is taken. A long request's growth
    makes the kept turn page its blocks but the first out: the cache gives its 7 records
    up for them; the next turn shares the whole kept prompt, pages them in and answers as
    fresh, tokens and logprobs bit for bit."""
    turn1 = GenerationRequest("t1", SYSTEM, GREEDY, 8, ignore_eos=True)
    long = [(5 * j + 1) % 120 + 2 for j in range(380)]  # past the kept limit: not kept
    async with engine_for(tiny, context=512) as plain:
        first = await stream(plain.submit(turn1))
        turn2 = [*SYSTEM, *first[0], 40, 41, 42, 43]
        want = await stream(plain.submit(GenerationRequest("t2", turn2, GREEDY, 16)))
    async with records(tiny, kv_pool_tokens=512, kv_keep_tokens=256, prefix_cache_bytes=1) as e:
        store, tables = store_of(e), e.target.blocks
        assert await stream(e.submit(turn1)) == first
        (lane,) = e.kv.kept
        assert len(store.memory()) == 7 and tables.paged(lane) == 0
        taken = [tables.hold_record() for _ in range(tables.free_records)]
        await stream(e.submit(GenerationRequest("long", long, GREEDY, 60, ignore_eos=True)))
        assert list(e.kv.kept) == [lane] and not e.kv.evicted
        assert tables.paged(lane) == 7 and store.memory() == []
        second = e.submit(GenerationRequest("t2", turn2, GREEDY, 16))
        assert await stream(second) == want
        assert second.cached_tokens == len(SYSTEM) and e.totals["preemptions"] == 0
        for record in taken:
            tables.release_record(record)


async def test_a_refused_save_loses_only_itself(tiny: Path, known) -> None:
    """A save the workers refuse (the daemon's table of a lane they do not hold: an
    injected inconsistency) changes no table: a request decoding meanwhile goes on and
    answers as fresh, the save's records go back, and nothing is kept of it."""
    (want_p,) = await fresh(tiny, known, 512, PROMPT, n=40)
    async with records(tiny) as e:
        store, tables = store_of(e), e.target.blocks
        handle = e.submit(GenerationRequest("r", PROMPT, GREEDY, 40, ignore_eos=True))
        it = aiter(handle)
        first = await anext(it)  # its prompt is prefilled, its blocks saved
        held = tables.used_records
        stray = e.limits.max_running + 3  # a lane no worker holds
        tables.write(stray, 0, 2 * BLOCK)
        assert await store.save(stray, QUERY) == 0
        tables.free(stray)
        assert e.target.executor.in_sync and tables.used_records == held
        ids, lps = list(first.token_ids), [(lp.logprob, lp.top) for lp in first.logprobs or []]
        async for delta in it:
            ids += delta.token_ids
            lps += [(lp.logprob, lp.top) for lp in delta.logprobs or []]
        assert handle.finish_reason == "length", handle.error
        assert (ids, lps) == want_p
        assert len(store.memory()) == 6
