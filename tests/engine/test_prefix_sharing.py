"""Running requests share a common prompt prefix's K/V blocks (one block pool per worker
shard): a request whose prompt starts like a running one's takes those blocks instead of
computing or copying them, and its output equals its fresh output alone."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest
import torch
from engine_harness import engine_for

from luced.engine.core import Engine, GenerationRequest, QueueFull, RequestHandle
from luced.runtime.model import Model
from luced.runtime.tiny import make_tiny_draft, make_tiny_gguf
from luced.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0)
FIRST = [(7 * i + 3) % 120 + 2 for i in range(150)]
LATER = [
    FIRST[:100] + [(13 * i + 1) % 120 + 2 for i in range(30)],  # a branch at 100
    FIRST + [(11 * i + 5) % 120 + 2 for i in range(40)],  # a second turn
    FIRST,  # the same prompt again: all but its last token are held
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("share") / "qwen3.gguf"
    return make_tiny_gguf("qwen3", path, seed=7, layers=4, context=512).path


def request(name: str, prompt: list[int], max_tokens: int = 16) -> GenerationRequest:
    return GenerationRequest(name, prompt, GREEDY, max_tokens, ignore_eos=True)


async def tokens(handle: RequestHandle) -> list[int]:
    out = []
    async for delta in handle:
        out += delta.token_ids
    return out


async def first_token(handle: RequestHandle) -> tuple[list[int], asyncio.Future]:
    """Wait for the request's first token (its prompt is in its K/V then); the rest of its
    tokens come from the returned future."""
    stream = aiter(handle)
    first = (await anext(stream)).token_ids

    async def rest() -> list[int]:
        return first + [t async for d in stream for t in d.token_ids]

    return first, asyncio.ensure_future(rest())


async def fresh(path: Path, prompts: list[list[int]], devices=("cpu",)) -> list[list[int]]:
    async with engine_for(path, devices, context=512) as engine:
        return [await tokens(engine.submit(request("f", p))) for p in prompts]


async def kv_blocks_used(engine: Engine) -> list[int]:
    stats = await engine.target.stats()
    return [w["kv_blocks_used"] for w in stats["workers"]]


@pytest.mark.parametrize("devices", [("cpu",), ("cpu", "cpu:1")], ids=["unsplit", "split"])
async def test_requests_share_a_running_requests_prefix_blocks(tiny: Path, devices) -> None:
    """Three requests arrive while the first decodes: each shares its common prefix with
    it (in every shard of a split), holds only its own blocks besides, and gives its fresh
    output."""
    want = await fresh(tiny, [FIRST, *LATER], devices)
    async with engine_for(tiny, devices, context=512, max_running=4) as engine:
        assert engine.target.shares_prefixes
        source = engine.submit(request("first", FIRST, max_tokens=48))
        _, first_rest = await first_token(source)
        alone = await kv_blocks_used(engine)
        handles = [engine.submit(request(f"later{i}", p)) for i, p in enumerate(LATER)]
        streams = [await first_token(h) for h in handles]
        during = await kv_blocks_used(engine)
        got = [await rest for _, rest in streams]
        assert (await first_rest)[:16] == want[0]
    assert got == want[1:]
    # The common prefix (all but the last prompt token of the same prompt).
    assert [h.cached_tokens for h in handles] == [100, 150, 149]
    assert engine.totals["shared_prompt_tokens"] == 100 + 150 + 149
    # Each later request holds only its own blocks past the shared ones, not a copy of the
    # prefix: at least its prompt's rest (3 + 3 + 1 blocks of 16, the first a copy of the
    # block it shared and wrote into), at most that and its 16 tokens plus the first
    # request's growth (10 + 3), where copies of the prompts would be >= 9 + 10 + 10.
    for before, now in zip(alone, during, strict=True):
        assert 3 + 3 + 1 <= now - before <= 13 < 9 + 10 + 10


async def test_a_sharer_outlives_its_source(tiny: Path) -> None:
    """The request whose blocks were shared is cancelled: the blocks stay with the request
    that shares them (reference counted), whose output is unchanged; when it ends too, no
    block is held."""
    want = await fresh(tiny, [LATER[1]])
    async with engine_for(tiny, context=512, max_running=2) as engine:
        source = engine.submit(request("first", FIRST, max_tokens=200))
        await first_token(source)
        sharer = engine.submit(request("later", LATER[1], max_tokens=16))
        _, rest = await first_token(sharer)
        source.cancel()
        assert await rest == want[0]
        assert sharer.cached_tokens == 150
        assert await engine.drain(10)
        assert await kv_blocks_used(engine) == [0]
        assert engine.target.blocks is not None and engine.target.blocks.used_blocks == 0


async def test_without_a_block_pool_nothing_is_shared(tiny: Path) -> None:
    """--kv-block-size 0: each request computes its own prompt (the same output)."""
    want = await fresh(tiny, [LATER[0]])
    async with engine_for(tiny, context=512, max_running=2, kv_block=0) as engine:
        assert not engine.target.shares_prefixes
        source = engine.submit(request("first", FIRST, max_tokens=48))
        await first_token(source)
        later = engine.submit(request("later", LATER[0]))
        assert await tokens(later) == want[0]
        assert later.cached_tokens == 0 and engine.totals["shared_prompt_tokens"] == 0


async def test_sharing_wins_a_tie_with_a_restore_and_a_longer_restore_wins(tiny: Path) -> None:
    """With the prefix cache on: a request that can share as much as the cache holds
    shares (no copy); one whose cached prefix is longer restores it. Both give their fresh
    outputs."""
    tail = [(3 * i + 7) % 120 + 2 for i in range(30)]
    held = FIRST[:100] + tail
    shares = FIRST[:100] + tail[:10] + [5, 6, 7, 8]  # cached 110 (the held one's), shares 110
    restores = [*FIRST, 9, 10, 11]  # cached 150 (the first one's), shares 100
    want = await fresh(tiny, [shares, restores])
    async with engine_for(tiny, context=512, max_running=3, prefix_cache_bytes=64 << 20) as engine:
        await tokens(engine.submit(request("first", FIRST, max_tokens=2)))
        holder = engine.submit(request("held", held, max_tokens=64))
        await first_token(holder)  # its prompt is prefilled and its snapshot saved
        handles = [engine.submit(request(f"r{i}", p)) for i, p in enumerate((shares, restores))]
        got = [await tokens(h) for h in handles]
        holder.cancel()
    assert got == want
    assert [h.cached_tokens for h in handles] == [110, 150]
    assert engine.totals["shared_prompt_tokens"] == 110


async def test_requests_sent_together_compute_their_common_prefix_once(tiny: Path) -> None:
    """Four requests with one 150-token beginning arrive at once: the first computes it,
    the others wait for its prefill and share its blocks, then give their fresh outputs."""
    prompts = [FIRST + [(17 * i + j) % 120 + 2 for j in range(8)] for i in range(4)]
    want = await fresh(tiny, prompts)
    async with engine_for(tiny, context=512, max_running=4) as engine:
        handles = [engine.submit(request(f"r{i}", p)) for i, p in enumerate(prompts)]
        got = await asyncio.gather(*(tokens(h) for h in handles))
    assert got == want
    assert sorted(h.cached_tokens for h in handles) == [0, 150, 150, 150]
    assert engine.totals["shared_prompt_tokens"] == 3 * 150


async def test_a_shared_prefix_is_charged_once_so_more_requests_run(tiny: Path) -> None:
    """A pool of one context (512 positions) and four requests of ~200 prompt tokens with
    one 190-token beginning: charged whole, only two would fit; charged once, all four
    run together (each one's first token comes before any finishes), without preemption,
    each with its fresh output."""
    prompts = [FIRST + FIRST[:40] + [(19 * i + j) % 120 + 2 for j in range(10)] for i in range(4)]
    want = await fresh(tiny, prompts)
    async with engine_for(tiny, context=512, max_running=4, kv_pool_tokens=512) as engine:
        handles = [engine.submit(request(f"r{i}", p, max_tokens=40)) for i, p in enumerate(prompts)]
        got = await asyncio.gather(*(tokens(h) for h in handles))
        assert await engine.drain(10)
        assert engine.kv is not None and engine.kv.used == 0 and not engine.kv.credits
    assert [g[:16] for g in got] == want
    assert max(h.first_token_at for h in handles) < min(h.last_token_at for h in handles)
    assert engine.totals["preemptions"] == 0 and engine.totals["shared_prompt_tokens"] == 3 * 190


async def test_a_dflash_request_shares_the_prefix_and_its_captures(tmp_path: Path) -> None:
    """With a DFlash draft model: the request that shares a running one's prefix also gets
    that prefix's captured layer outputs in its lane's feature ring (the draft's context),
    so its ring equals a fresh forward's captures, and its output is plain decoding's."""
    target = make_tiny_gguf("qwen3", tmp_path / "qwen3.gguf", seed=7, layers=8).path
    draft = make_tiny_draft(target, tmp_path / "draft", seed=3, block_size=4)[1]
    prompts = [FIRST[:100] + FIRST[:20], [*FIRST[:100], 99, 9, 14, 3, 22, 7, 40, 2]]
    want = await fresh(target, prompts)
    async with engine_for(target, context=256, draft=draft, block_size=4, max_running=2) as engine:
        assert engine.target.shares_prefixes
        handles = [engine.submit(request(f"d{i}", p)) for i, p in enumerate(prompts)]
        got = await asyncio.gather(*(tokens(h) for h in handles))
        ring = engine.target.ring(handles[1].slot)
        assert ring is not None
        layers, rows = ring.layers, ring.array.copy()
    assert got == want and handles[1].cached_tokens == 100
    model = Model.load(target)
    fed = torch.tensor([*prompts[1], *got[1][:-1]])  # the last token is never fed
    _, caps = model.forward_layers(model.embed(fed), model.new_cache(len(fed)), 0, layers)
    expected = torch.stack([caps[layer] for layer in layers], 1)
    torch.testing.assert_close(torch.from_numpy(rows[: len(fed)]), expected, atol=1e-4, rtol=1e-4)


async def test_the_choices_of_a_short_prompt_compute_it_once(tiny: Path) -> None:
    """OpenAI's n choices: three requests for one 20-token prompt (too short to wait for
    on its own), the later two its siblings (`share_prompt`): they wait for the first's
    prefill and share its blocks, and each gives its output alone, greedy or seeded."""
    prompt = FIRST[:20]
    seeded = [SamplingParams(temperature=0.9, seed=s) for s in (5, 6, 7)]
    choices = [[GREEDY] * 3, seeded]

    def group(params: list[SamplingParams], share: bool) -> list[GenerationRequest]:
        return [
            GenerationRequest(f"c{j}", prompt, p, 16, ignore_eos=True, share_prompt=share and j > 0)
            for j, p in enumerate(params)
        ]

    async with engine_for(tiny, context=512) as engine:  # one at a time: nothing shared
        want = [[await tokens(engine.submit(r)) for r in group(p, False)] for p in choices]
    assert want[0][0] == want[0][2] and len({tuple(w) for w in want[1]}) == 3
    async with engine_for(tiny, context=512, max_running=4) as engine:
        got, cached = [], []
        for params in choices:
            handles = [engine.submit(r) for r in group(params, share=True)]
            got.append(await asyncio.gather(*(tokens(h) for h in handles)))
            cached.append([h.cached_tokens for h in handles])
        assert engine.totals["shared_prompt_tokens"] == 4 * 19
        # Without `share_prompt`, requests sent together share no prompt this short.
        handles = [engine.submit(r) for r in group(seeded, share=False)]
        alone = await asyncio.gather(*(tokens(h) for h in handles))
        assert [h.cached_tokens for h in handles] == [0, 0, 0]
    assert got == want and alone == want[1]
    assert cached == [[0, 19, 19]] * 2  # all but the last prompt token, fed to sample


async def test_a_choices_prompt_counts_once_against_the_queued_tokens(tiny: Path) -> None:
    """A sibling's prompt is its first's: three choices of a 20-token prompt queue under a
    bound of 30 prompt tokens, where a third distinct request does not."""
    prompt = FIRST[:20]
    async with engine_for(tiny, context=512, max_running=4) as engine:
        engine.intake.limits = dataclasses.replace(engine.limits, max_queued_tokens=30)
        requests = [
            GenerationRequest(f"c{j}", prompt, GREEDY, 4, ignore_eos=True, share_prompt=j > 0)
            for j in range(3)
        ]
        handles = [engine.submit(r) for r in requests]
        assert engine.intake.queued_tokens() == 20
        with pytest.raises(QueueFull):
            engine.submit(GenerationRequest("other", FIRST[20:40], GREEDY, 4))
        outs = await asyncio.gather(*(tokens(h) for h in handles))
    assert outs[0] == outs[1] == outs[2] and len(outs[0]) == 4
