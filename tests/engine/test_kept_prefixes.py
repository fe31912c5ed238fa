"""Finished requests' K/V kept in the block pool (engine/kv/finished.py): the account of
kept lanes (torch-free), and end to end over real workers (test_prefix_sharing's
helpers), where a later request that
starts with a finished one's tokens shares its blocks and gives its fresh output."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from engine_harness import engine_for
from test_prefix_sharing import kv_blocks_used, request, tokens

from luced.engine.core import GenerationRequest, RequestHandle
from luced.engine.kv.budget import KVBudget
from luced.engine.kv.finished import KEPT_LANES, MIN_KEPT, FinishedPrefixes
from luced.engine.remote import RemoteSettings
from luced.runtime.tiny import make_tiny_gguf
from luced.sampling_params import SamplingParams

SYSTEM = [(7 * i + 3) % 120 + 2 for i in range(120)]


# -- the account ----------------------------------------------------------------------------


def test_a_kept_lane_takes_the_finished_lanes_charge_and_its_sharers() -> None:
    kv = KVBudget(1000)
    kv.admit(0, 1, 200)
    kv.admit(1, 2, 150)
    kv.share(1, 0, 100)  # lane 1 shares lane 0's first 100 positions
    kv.keep(0, 70, 180)  # lane 0 finished with 180 positions computed
    assert 0 not in kv.held and kv.held[70] == 180 and list(kv.kept) == [70]
    assert kv.credits[1] == (70, 100) and kv.used == 180 + 150 - 100
    assert kv.newest() == 1  # a kept lane is never preempted
    # Given up, lane 1 pays for the positions it shared: nothing is charged twice or lost.
    assert kv.evict() == 70 and kv.evicted == [70]
    assert kv.used == 150 and not kv.kept


def test_admission_and_growth_reclaim_kept_lanes_least_recently_used_first() -> None:
    kv = KVBudget(500)
    for lane in (64, 65, 66):
        kv.admit(lane, 0, 100)
        kv.keep(lane, lane + 10, 100)
    kv.touch(74)  # reused just now: the last to go
    assert kv.reclaim(250) and kv.evicted == [75]
    kv.admit(0, 1, 250)
    assert kv.grow(0, 340) and kv.evicted == [75, 76]
    assert list(kv.kept) == [74] and kv.used == 100 + kv.held[0]


def test_finished_prefixes_drop_what_a_newer_one_extends_and_keep_within_the_limit() -> None:
    kv = KVBudget(10_000)
    kept = FinishedPrefixes(kv, 8, limit=300)

    def finish(slot: int, tokens: list[int]) -> int | None:
        kv.admit(slot, slot, len(tokens) + 16)
        lane = kept.lane_for(tokens)
        if lane is None:
            kv.release(slot)
        else:
            kv.keep(slot, lane, len(tokens))
        return lane

    turn1 = SYSTEM[:100]
    first = finish(0, turn1)
    assert first == 8 and kept.match([*turn1, 5]) == (8, 100)
    assert finish(1, SYSTEM[: MIN_KEPT - 1]) is None  # too short to keep
    second = finish(1, SYSTEM)  # the next turn extends the first: the first goes
    assert second == 9 and kv.evicted == [8] and kept.forget_evicted() == [8]
    assert finish(2, SYSTEM[:50]) is None  # the second holds all of it already
    assert kept.match([*SYSTEM[:110], 1, 2]) == (9, 110)
    other = finish(2, [9] * 200)  # the limit (300) takes the older one out
    assert other is not None and list(kv.kept) == [other] and kv.evicted == [9]
    assert finish(3, [4] * 301) is None  # longer than the limit
    assert kept.positions == 200 and kept.match([*SYSTEM, 1]) == (-1, 0)


def test_a_lane_is_handed_out_again_only_once_the_workers_freed_it() -> None:
    """All KEPT_LANES lanes kept: the next finished sequence makes the oldest give way,
    but that lane is still held in the workers until the engine frees it, so this one is
    not kept; once freed, the lane is the next one's."""
    kv = KVBudget(10**7)
    kept = FinishedPrefixes(kv, 8, limit=10**6)

    def finish(i: int) -> int | None:
        kv.admit(0, i, 20)
        lane = kept.lane_for([i + 1000] * 20)
        if lane is None:
            kv.release(0)
        else:
            kv.keep(0, lane, 20)
        return lane

    assert [finish(i) for i in range(KEPT_LANES)] == list(kept.lanes)
    assert finish(KEPT_LANES) is None and kv.evicted == [8]
    assert kept.forget_evicted() == [8] and 8 not in kept.blocks.lanes
    assert finish(KEPT_LANES + 1) == 8


# -- end to end ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("kept") / "qwen3.gguf"
    return make_tiny_gguf("qwen3", path, seed=7, layers=4, context=512).path


@pytest.mark.parametrize("devices", [("cpu",), ("cpu", "cpu:1")], ids=["unsplit", "split"])
async def test_a_chats_next_turn_shares_the_finished_turns_blocks(tiny: Path, devices) -> None:
    """Turn 1 finishes; turn 2's prompt is turn 1's, its answer and a new message: it
    starts on turn 1's prompt positions (in every shard), taken from the pool, not computed
    or copied, and gives the output it gives fresh."""
    async with engine_for(tiny, devices, context=512) as plain:
        answer = await tokens(plain.submit(request("t1", SYSTEM)))
        turn2 = [*SYSTEM, *answer, 40, 41, 42, 43]
        want = await tokens(plain.submit(request("t2", turn2)))
    async with engine_for(tiny, devices, context=512, max_running=2, kv_keep_tokens=512) as engine:
        assert await tokens(engine.submit(request("t1", SYSTEM))) == answer
        assert engine.status()["queue"]["kv_kept_requests"] == 1
        held = await kv_blocks_used(engine)
        second = engine.submit(request("t2", turn2))
        assert await tokens(second) == want
        # Turn 2's prompt extends turn 1's, so turn 1's lane is dropped and turn 2's kept:
        # its blocks are turn 1's plus its own.
        assert second.cached_tokens == len(SYSTEM)
        assert engine.totals["shared_prompt_tokens"] == second.cached_tokens
        assert engine.status()["queue"]["kv_kept_tokens"] == len(turn2)
        now = await kv_blocks_used(engine)
        assert all(n - h <= 2 for h, n in zip(held, now, strict=True))


async def test_kept_blocks_give_way_to_running_requests(tiny: Path) -> None:
    """A pool of one context: three finished requests keep their blocks; a request that
    needs most of the pool takes the room (the kept lanes page out to host records, least
    recently used first, and the kept limit then gives the older ones up) and gives its
    fresh output; nothing is preempted."""
    prompts = [[(11 * i + j) % 120 + 2 for j in range(100)] for i in range(3)]
    long = [(5 * j + 1) % 120 + 2 for j in range(400)]
    async with engine_for(tiny, context=512) as plain:
        want = await tokens(plain.submit(request("long", long, max_tokens=40)))
    async with engine_for(
        tiny, context=512, max_running=2, kv_pool_tokens=512, kv_keep_tokens=512
    ) as engine:
        for i, p in enumerate(prompts):
            await tokens(engine.submit(request(f"p{i}", p)))
        assert len(engine.kv.kept) == 3
        kept_blocks = await kv_blocks_used(engine)
        assert kept_blocks[0] >= 3 * 115 // 16
        await engine._idle.wait()  # the last slot released
        tables = engine.target.blocks  # the daemon's, in step with the worker's
        assert tables is not None and [tables.used_blocks] == await kv_blocks_used(engine)
        assert sorted(tables.lanes) == sorted(engine.kv.kept)
        got = await tokens(engine.submit(request("long", long, max_tokens=40)))
        assert got == want and engine.totals["preemptions"] == 0
        assert len(engine.kv.kept) <= 2  # the long one's own is kept after it
        await asyncio.sleep(0)
        assert engine.kv.used <= 512


async def answer(handle: RequestHandle) -> tuple[list[int], list[float]]:
    ids, lps = [], []
    async for delta in handle:
        ids += delta.token_ids
        lps += [lp.logprob for lp in delta.logprobs or []]
    return ids, lps


@pytest.mark.parametrize("devices", [("cpu",), ("cpu", "cpu:1")], ids=["unsplit", "split"])
async def test_a_kept_prompt_pages_out_under_pressure_and_its_next_turn_pages_it_in(
    tiny: Path, devices
) -> None:
    """Without KV Flash, a pool of one context: a long request's growth makes the kept turn
    page its blocks but the first out to host records (not given up); the next turn shares
    the whole prompt, pages those blocks in before its first forward and gives the
    fresh output and logprobs bit for bit."""
    await check_kept_prompt_pages_out_and_in(tiny, devices)


async def check_kept_prompt_pages_out_and_in(
    path: Path, devices: tuple[str, ...], remote: RemoteSettings | None = None
) -> None:
    """The test above on `path` (a 512-token context) over `devices` (a worker on another
    host with `remote`)."""
    greedy = SamplingParams(temperature=0, logprobs=1)
    turn1 = GenerationRequest("t1", SYSTEM, greedy, 8, ignore_eos=True)
    long = [(5 * j + 1) % 120 + 2 for j in range(380)]  # past the kept limit: not kept
    async with engine_for(path, context=512) as plain:
        first = await answer(plain.submit(turn1))
        turn2 = [*SYSTEM, *first[0], 40, 41, 42, 43]
        want = await answer(plain.submit(GenerationRequest("t2", turn2, greedy, 16)))
    async with engine_for(
        path,
        devices,
        context=512,
        max_running=2,
        kv_pool_tokens=512,
        kv_keep_tokens=256,
        remote=remote,
    ) as engine:
        assert await answer(engine.submit(turn1)) == first
        (lane,) = engine.kv.kept
        await tokens(engine.submit(request("long", long, max_tokens=60)))
        tables = engine.target.blocks
        assert tables is not None and list(engine.kv.kept) == [lane] and not engine.kv.evicted
        paged = len(SYSTEM) // 16  # every block but the first
        assert tables.paged(lane) == paged and len(tables.resident(lane)) == 1
        queue = engine.status()["queue"]
        assert queue["kv_kept_tokens"] == len(SYSTEM)
        assert queue["kv_kept_paged_tokens"] == paged * 16
        if remote is None:  # a worker on another host does not report its pool here
            assert [tables.used_blocks] * len(devices) == await kv_blocks_used(engine)
        second = engine.submit(GenerationRequest("t2", turn2, greedy, 16))
        assert await answer(second) == want
        assert second.cached_tokens == len(SYSTEM) and engine.totals["preemptions"] == 0
