"""Continuous batching on KV Flash, through the real Engine and Target: each running
request keeps at most its pool resident (its own pager over its block table in the
daemon; every request's blocks in the workers' one pool), and the batch carries each
sequence's moves.

Oracles: each request's output batched equals its output served alone on the same pool,
eviction for eviction; a pool covering the context gives plain decoding's output."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from engine_harness import engine_for

from luced.engine.core import Engine, GenerationRequest
from luced.engine.kvflash import PagerConfig
from luced.runtime.tiny import make_tiny_gguf
from luced.sampling_params import SamplingParams

pytestmark = pytest.mark.asyncio(loop_scope="module")

# Three prompts past a 448-token pool (so each request evicts and, under qk, recalls) and
# one short one; different lengths, so they reach decode at different steps.
PROMPTS = [
    [(13 * i + 5) % 97 + 2 for i in range(560)],
    [(7 * i + 3) % 120 + 2 for i in range(500)],
    [(5 * i + 11) % 89 + 2 for i in range(610)],
    [3, 17, 5, 42, 8, 99, 23, 4, 61, 7],
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("cb-flash") / "qwen3.gguf"
    return make_tiny_gguf("qwen3", path, seed=7, layers=4, context=1024).path


def requests() -> list[GenerationRequest]:
    greedy = SamplingParams(temperature=0, logprobs=1)
    reqs = [
        GenerationRequest(f"f{i}", p, greedy, 40, ignore_eos=True) for i, p in enumerate(PROMPTS)
    ]
    seeded = SamplingParams(temperature=0.8, seed=5)
    reqs.append(GenerationRequest("s", PROMPTS[1][:300], seeded, 40, ignore_eos=True))
    return reqs


async def drain(engine: Engine, req: GenerationRequest) -> tuple[list[int], list[float]]:
    handle = engine.submit(req)
    tokens, lps = [], []
    async for delta in handle:
        tokens += delta.token_ids
        lps += [lp.logprob for lp in delta.logprobs or []]
    assert handle.finish_reason == "length", handle.error
    return tokens, lps


@pytest.mark.parametrize(
    ("policy", "devices"),
    [("lru", ("cpu",)), ("qk", ("cpu",)), ("lru", ("cpu", "cpu:1"))],
    ids=["lru", "qk", "lru-split"],
)
async def test_batched_requests_page_their_own_pools(tiny: Path, policy: str, devices) -> None:
    """Each request pages its own blocks, also split over two workers (each holding its
    layers' share of the pool, the same moves applied by both)."""
    pool = PagerConfig(pool_tokens=448, policy=policy)  # type: ignore[arg-type]
    async with engine_for(tiny, context=1024, kv_flash=pool) as engine:
        alone = [await drain(engine, r) for r in requests()]
        alone_status = engine.target.flash_status()
    async with engine_for(tiny, devices, context=1024, kv_flash=pool, max_running=4) as engine:
        together = await asyncio.gather(*(drain(engine, r) for r in requests()))
        status = engine.target.flash_status()
        assert engine.stepped_sequences > engine.steps  # really batched
    assert alone_status is not None and status is not None
    assert status["sequences"] > 1 and status["pool_tokens"] == 448
    assert status["evictions"] == alone_status["evictions"] > 0
    if policy == "qk":
        assert status["recalls"] == alone_status["recalls"]
    for (got, got_lps), (want, want_lps) in zip(together, alone, strict=True):
        assert got == want
        assert got_lps == pytest.approx(want_lps, abs=1e-4)


async def test_batched_on_a_pool_covering_the_context_equals_plain(tiny: Path) -> None:
    async with engine_for(tiny, context=1024) as engine:
        plain = [await drain(engine, r) for r in requests()]
    pool = PagerConfig(pool_tokens=1024, policy="qk")
    async with engine_for(tiny, context=1024, kv_flash=pool, max_running=4) as engine:
        together = await asyncio.gather(*(drain(engine, r) for r in requests()))
        status = engine.target.flash_status()
    assert status is not None and status["evictions"] == 0
    for (got, got_lps), (want, want_lps) in zip(together, plain, strict=True):
        assert got == want
        assert got_lps == pytest.approx(want_lps, abs=1e-4)


async def test_preempted_requests_start_their_pool_over_and_finish_as_alone(tiny: Path) -> None:
    """Three requests of 380 prompt tokens fit a KV budget of 1200 positions, their 100
    tokens each do not: the newest give their KV (their pool and host records) up and
    recompute into a fresh pool later, each past the 448-token pool (evicting), with the
    output they get alone on the same pool."""
    pool = PagerConfig(pool_tokens=448, policy="lru")
    greedy = SamplingParams(temperature=0, logprobs=1)
    reqs = [
        GenerationRequest(f"e{i}", p[:380], greedy, 100, ignore_eos=True)
        for i, p in enumerate(PROMPTS[:3])
    ]
    async with engine_for(tiny, context=1024, kv_flash=pool) as engine:
        alone = [await drain(engine, r) for r in reqs]
        assert (engine.target.flash_status() or {}).get("evictions", 0) > 0
    async with engine_for(
        tiny, context=1024, kv_flash=pool, max_running=3, kv_pool_tokens=1200
    ) as engine:
        together = await asyncio.gather(*(drain(engine, r) for r in reqs))
        assert engine.totals["preemptions"] > 0
    for (got, got_lps), (want, want_lps) in zip(together, alone, strict=True):
        assert got == want
        assert got_lps == pytest.approx(want_lps, abs=1e-4)


async def test_prompts_within_the_pool_restore_from_the_prefix_cache_as_fresh(tiny: Path) -> None:
    """KV Flash with the prefix cache's snapshots (where the daemon keeps them under KV
    Flash: a hybrid, remote workers, a draft's ring; its blocks otherwise:
    test_block_store_flash.py): a prompt the pool holds whole (every block resident) is
    snapshotted and a later request restores it, with the output a fresh prefill gives;
    a prompt past the pool pages blocks out and is not snapshotted."""
    pool = PagerConfig(pool_tokens=448, policy="lru")
    greedy = SamplingParams(temperature=0, logprobs=1)
    short = PROMPTS[1][:300]
    reqs = [
        GenerationRequest("a", short, greedy, 20, ignore_eos=True),
        GenerationRequest("b", [*short[:250], 7, 9, 11], greedy, 20, ignore_eos=True),
        GenerationRequest("long", PROMPTS[0], greedy, 20, ignore_eos=True),
    ]
    async with engine_for(tiny, context=1024, kv_flash=pool) as engine:
        fresh = [await drain(engine, r) for r in reqs]
    async with engine_for(
        tiny, context=1024, kv_flash=pool, max_running=2, prefix_cache_bytes=32 << 20
    ) as engine:
        got = [await drain(engine, r) for r in reqs[:1]]
        got += await asyncio.gather(*(drain(engine, r) for r in reqs[1:]))
        assert engine.prefix_cache is not None
        assert engine.totals["cached_prompt_tokens"] == 250  # b restored a's first 250
        assert engine.prefix_cache.stats().entries == 2  # a and b; not the long one
    for (tokens, lps), (want, want_lps) in zip(got, fresh, strict=True):
        assert tokens == want
        assert lps == pytest.approx(want_lps, abs=1e-4)


async def test_requests_share_a_prompt_prefix_and_page_it_out_as_alone(tiny: Path) -> None:
    """KV Flash with prefix sharing: requests whose prompts start alike share the prefix's
    blocks (it fits the 448-token pool), then decode past the pool, paging blocks out,
    shared ones included (a shared block paged out stays for the others), and a later
    request starts on what a finished one kept; each output is the one it gets alone on
    the same pool."""
    pool = PagerConfig(pool_tokens=448, policy="lru")
    greedy = SamplingParams(temperature=0, logprobs=1)
    base = [(11 * i + 7) % 101 + 2 for i in range(320)]
    reqs = [
        GenerationRequest(f"p{i}", [*base, 5 + i, 9, 13 + i], greedy, 200, ignore_eos=True)
        for i in range(3)
    ]
    later = GenerationRequest("later", [*base[:300], 44, 45], greedy, 30, ignore_eos=True)
    async with engine_for(tiny, context=1024, kv_flash=pool) as engine:
        alone = [await drain(engine, r) for r in [*reqs, later]]
        assert engine.totals["shared_prompt_tokens"] == 0  # one at a time, nothing kept
    async with engine_for(
        tiny, context=1024, kv_flash=pool, max_running=3, kv_keep_tokens=1024
    ) as engine:
        together = list(await asyncio.gather(*(drain(engine, r) for r in reqs)))
        shared = engine.totals["shared_prompt_tokens"]
        status = engine.target.flash_status()
        together.append(await drain(engine, later))
        kept = engine.totals["shared_prompt_tokens"] - shared
    assert status is not None and status["evictions"] > 0
    assert shared >= 2 * 256  # the two later starters share at least 4 blocks each
    # A kept lane keeps its whole prompt, the blocks decoding past the pool paged out too.
    assert kept == 300
    for (got, got_lps), (want, want_lps) in zip(together, alone, strict=True):
        assert got == want
        assert got_lps == pytest.approx(want_lps, abs=1e-4)


@pytest.mark.parametrize(("policy", "running"), [("lru", 1), ("qk", 2)], ids=["lru", "qk"])
async def test_a_chat_longer_than_the_pool_continues_on_its_kept_prompt(
    tiny: Path, policy: str, running: int
) -> None:
    """Turn 1's prompt (560 tokens) passes the 448-token pool, and decoding pages more of
    it out; its lane keeps the whole prompt, paged-out blocks included (their host
    records), and turn 2 (turn 1's prompt, its answer, a new message) starts on all of
    it, paging back in what it needs. Under lru, with prompt chunks of a block (as here),
    turn 2 plans the residency a fresh prefill plans, so its output is a fresh engine's
    bit for bit; under qk the reselections come at other steps. With one running request
    and the default pool (one context) too: the kept lane is charged its resident blocks,
    not its 560 positions, so turn 2's admission leaves it to be shared."""
    pool = PagerConfig(pool_tokens=448, policy=policy)  # type: ignore[arg-type]
    greedy = SamplingParams(temperature=0, logprobs=1)
    first = GenerationRequest("t1", PROMPTS[0], greedy, 40, ignore_eos=True)
    async with engine_for(
        tiny, context=1024, kv_flash=pool, max_running=running, kv_keep_tokens=1024
    ) as engine:
        answer, _ = await drain(engine, first)
        second = GenerationRequest(
            "t2", [*PROMPTS[0], *answer, 5, 9, 13, 21, 33, 8, 2, 71], greedy, 30, ignore_eos=True
        )
        handle = engine.submit(second)
        got, got_lps = [], []
        async for delta in handle:
            got += delta.token_ids
            got_lps += [lp.logprob for lp in delta.logprobs or []]
        status = engine.target.flash_status()
        assert engine.target.blocks is not None
        kept_records = engine.target.blocks.used_records
    assert handle.cached_tokens == len(PROMPTS[0])  # the whole turn-1 prompt, none computed
    assert status is not None and status["recalls"] > 0  # paged-out blocks came back
    assert kept_records > 0
    if policy == "lru":
        async with engine_for(tiny, context=1024, kv_flash=pool) as engine:
            fresh, fresh_lps = await drain(engine, second)
        assert got == fresh and got_lps == fresh_lps


async def test_a_kept_prompt_over_the_kept_limit_is_paged_out_and_shared_whole(
    tiny: Path,
) -> None:
    """A kept limit of 256 positions below turn 1's resident blocks (448): its kept lane
    pages them out but the sink (into host records, shown by the status) instead of
    being given up, and turn 2 still starts on the whole prompt, paging back in what it
    needs: its output is the one it gives when the kept lane stayed resident, which
    under lru with block-aligned chunks is a fresh engine's, bit for bit."""
    pool = PagerConfig(pool_tokens=448, policy="lru")
    greedy = SamplingParams(temperature=0, logprobs=1)
    first = GenerationRequest("t1", PROMPTS[0], greedy, 40, ignore_eos=True)
    async with engine_for(
        tiny, context=1024, kv_flash=pool, max_running=1, kv_keep_tokens=256
    ) as engine:
        answer, _ = await drain(engine, first)
        await engine._idle.wait()  # its prompt kept, its slot released
        kept = engine.target.flash_status()
        assert kept is not None and engine.finished is not None
        (lane,) = engine.kv.kept
        blocks = engine.target.blocks
        assert blocks is not None and blocks.resident(lane) == [0]  # its sink
        assert blocks.paged(lane) == 8 and engine.kv.charge(lane) == 64
        second = GenerationRequest(
            "t2", [*PROMPTS[0], *answer, 5, 9, 13, 21, 33, 8, 2, 71], greedy, 30, ignore_eos=True
        )
        got, got_lps = await drain(engine, second)
        assert engine.prefix.shared_tokens == len(PROMPTS[0])
    assert kept["kept_lanes"] == 1 and kept["sequences"] == 1
    assert kept["paged_out_blocks"] >= 8 and kept["host_bytes"] >= 8 * kept["block"]
    async with engine_for(tiny, context=1024, kv_flash=pool) as engine:
        fresh, fresh_lps = await drain(engine, second)
    assert got == fresh and got_lps == fresh_lps
