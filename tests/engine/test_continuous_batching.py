"""Continuous batching through a real Engine and Target: requests served together (their
decode steps batched, their prompts prefilled between the steps) give what each gives
served alone, one at a time."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest
import torch
from engine_harness import engine_for

from luced.engine.core import Engine, GenerationRequest, RequestHandle
from luced.engine.kv.budget import RESERVE_STEP, KVBudget, resolve_kv_pool
from luced.runtime.model import Model
from luced.runtime.tiny import make_tiny_draft, make_tiny_gguf
from luced.sampling_params import SamplingParams
from luced.serve.bundled import smollm2_path

# Prompts of different lengths (one spans two 64-token prefill chunks), so the requests
# reach decode at different times and join a running batch.
PROMPTS = [
    [3, 17, 5, 42, 8, 99, 23, 4, 61, 7],
    [(7 * i + 3) % 120 + 2 for i in range(90)],
    [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28],
    [50, 2, 9],
]
# Per-request sampling as the API passes it: greedy, seeded with penalties, with
# logprobs, and a stop on an id.
PARAMS = [
    ({"temperature": 0}, {}),
    ({"temperature": 0.9, "seed": 7, "repetition_penalty": 1.3}, {}),
    ({"temperature": 0, "logprobs": 3}, {}),
    ({"temperature": 0.7, "top_k": 20, "seed": 1}, {"max_tokens": 9}),
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("cb") / "qwen3.gguf"
    return make_tiny_gguf("qwen3", path, seed=7, layers=4, context=512).path


def request(i: int) -> GenerationRequest:
    params, extra = PARAMS[i]
    return GenerationRequest(
        f"r{i}",
        PROMPTS[i],
        SamplingParams(**params),
        extra.get("max_tokens", 24),
        ignore_eos=True,
    )


async def collect(engine: Engine, req: GenerationRequest) -> tuple[list[int], list, str | None]:
    return await drain(engine.submit(req))


async def drain(handle: RequestHandle) -> tuple[list[int], list, str | None]:
    """(tokens, [(logprob, top ids)], finish reason) of a submitted request."""
    tokens, lps = [], []
    async for delta in handle:
        tokens += delta.token_ids
        lps += [(lp.logprob, [t[0] for t in lp.top]) for lp in delta.logprobs or []]
    return tokens, lps, handle.finish_reason


Outputs = list[tuple[list[int], list, str | None]]


@pytest.fixture(scope="module")
def served_alone() -> dict[str, object]:
    """The references several tests compare with, each computed once for the module."""
    return {}


async def outputs_alone(known: dict, path: Path, reqs: list[GenerationRequest]) -> Outputs:
    """Each request served alone, one after another, by a plain unsplit engine (context
    256): the same requests (ids aside) give the same outputs, so they are run once."""
    key = repr([path, *(dataclasses.replace(r, request_id="") for r in reqs)])
    if key not in known:
        async with engine_for(path, context=256) as engine:
            known[key] = [await collect(engine, r) for r in reqs]
    return known[key]


@pytest.mark.parametrize("devices", [("cpu",), ("cpu", "cpu:1")], ids=["unsplit", "split"])
async def test_requests_served_together_equal_each_served_alone(
    tiny: Path, served_alone, devices
) -> None:
    """Split: the whole batch flows through the pipeline of shards."""
    wants = await outputs_alone(served_alone, tiny, [request(i) for i in range(len(PROMPTS))])
    async with engine_for(tiny, devices, context=256, max_running=4) as engine:
        together = await asyncio.gather(*(collect(engine, request(i)) for i in range(4)))
        assert engine.stepped_sequences > engine.steps > 0  # really batched
    for i, (got, want) in enumerate(zip(together, wants, strict=True)):
        # Tokens exactly; logprobs to float32 rounding (a dense matmul over a batch's rows
        # rounds apart from one over a single row; --batch-invariant makes them equal).
        assert (got[0], got[2]) == (want[0], "length"), f"request {i}"
        assert [top for _, top in got[1]] == [top for _, top in want[1]]
        assert [lp for lp, _ in got[1]] == pytest.approx([lp for lp, _ in want[1]], abs=1e-4)


async def test_more_requests_than_lanes_wait_their_turn(tiny: Path, served_alone) -> None:
    """Six requests on two lanes: all finish, each as alone, the queue first come first
    served; a cancelled one frees its lane and the others are untouched."""
    reqs = [request(i % 4) for i in range(6)]
    wants = await outputs_alone(served_alone, tiny, reqs[:4])
    async with engine_for(tiny, context=256, max_running=2) as engine:
        handles = [engine.submit(r) for r in reqs]
        assert len(engine.waiting) == 6
        results = await asyncio.gather(*(drain(h) for h in handles))
        assert await engine.drain(10) and not engine.running  # lanes released
        first = [h.first_token_at for h in handles]
        assert first[0] < first[2] and first[1] < first[3]  # admitted in order
    for i, got in enumerate(results):
        assert got[0] == wants[i % 4][0]


async def test_a_cancelled_request_leaves_the_batch(tiny: Path, served_alone) -> None:
    want = (await outputs_alone(served_alone, tiny, [request(i) for i in range(len(PROMPTS))]))[0]
    async with engine_for(tiny, context=256, max_running=3) as engine:
        doomed = engine.submit(request(2))
        kept = asyncio.ensure_future(collect(engine, request(0)))
        async for _ in doomed:
            doomed.cancel()  # after its first token, mid-batch
        assert doomed.finish_reason == "abort"
        assert await kept == want
        assert not engine.running


async def test_a_long_prompt_does_not_stall_the_running_streams(tmp_path: Path) -> None:
    """While a 1500-token prompt prefills (24 chunks of 64), a running stream keeps
    decoding: its steps run between the chunks, so it gains about a token per chunk
    instead of waiting for the whole prompt."""
    path = make_tiny_gguf("llama", tmp_path / "m.gguf", seed=3, context=2048).path
    async with engine_for(path, context=2048, max_running=2) as engine:
        greedy = SamplingParams(temperature=0)
        running = engine.submit(GenerationRequest("a", PROMPTS[0], greedy, 400, ignore_eos=True))
        stream = aiter(running)
        await anext(stream)
        long = GenerationRequest("b", [(5 * i) % 200 + 3 for i in range(1500)], greedy, 1)
        before = running.completion_tokens
        # The running stream's KV positions (its prompt and what it fed since) over 2 lanes.
        usage = engine.status()["queue"]["kv_usage"]
        assert len(PROMPTS[0]) / 4096 <= usage <= (len(PROMPTS[0]) + before + 1) / 4096
        await collect(engine, long)
        gained = running.completion_tokens - before
        running.cancel()
        async for _ in stream:
            pass
    chunks = 1500 // 64
    assert gained >= chunks - 2, f"{gained} tokens during a prefill of {chunks} chunks"


def long_request(i: int, max_tokens: int = 60) -> GenerationRequest:
    params, _ = PARAMS[i]
    return GenerationRequest(
        f"r{i}", PROMPTS[i], SamplingParams(**params), max_tokens, ignore_eos=True
    )


@pytest.mark.parametrize("devices", [("cpu",), ("cpu", "cpu:1")], ids=["unsplit", "split"])
async def test_a_pool_too_small_for_all_preempts_and_every_request_finishes_as_alone(
    tiny: Path, served_alone, devices
) -> None:
    """Four requests need ~360 KV positions; the pool holds 256 (one context). The newest
    ones give their KV up and are recomputed later, and each request's tokens (greedy, and
    seeded sampling with penalties: the workers keep its generator) and logprobs are the
    ones it gets alone."""
    wants = await outputs_alone(served_alone, tiny, [long_request(i) for i in range(len(PROMPTS))])
    async with engine_for(tiny, devices, context=256, max_running=4, kv_pool_tokens=256) as engine:
        together = await asyncio.gather(*(collect(engine, long_request(i)) for i in range(4)))
        assert engine.totals["preemptions"] > 0
        assert engine.status()["queue"]["kv_pool_tokens"] == 256
        assert await engine.drain(10) and not engine.running and not engine.preempted
        assert engine.kv is not None and engine.kv.used == 0
    for i, (got, want) in enumerate(zip(together, wants, strict=True)):
        assert (got[0], got[2]) == (want[0], "length"), f"request {i}"
        assert [lp for lp, _ in got[1]] == pytest.approx([lp for lp, _ in want[1]], abs=1e-4)


async def test_a_preempted_request_that_is_cancelled_frees_its_lane(
    tiny: Path, served_alone
) -> None:
    want = (
        await outputs_alone(served_alone, tiny, [long_request(i) for i in range(len(PROMPTS))])
    )[0]
    async with engine_for(tiny, context=256, max_running=3, kv_pool_tokens=256) as engine:
        older = asyncio.ensure_future(collect(engine, long_request(1, 150)))
        while not engine.running:
            await asyncio.sleep(0)
        younger = engine.submit(long_request(2, 150))
        while not engine.preempted:  # the pool fills: the younger one gives way
            await asyncio.sleep(0.01)
        assert younger in engine.waiting
        younger.cancel()
        assert younger.finish_reason == "abort" and not engine.preempted
        await older
        assert await collect(engine, long_request(0)) == want  # the lanes work on
        assert await engine.drain(10) and engine.kv is not None and engine.kv.used == 0


def test_kv_budget_reserves_grows_and_names_the_newest() -> None:
    kv = KVBudget(100)
    assert kv.admit(1, ticket=5, positions=40) and kv.admit(2, ticket=9, positions=30)
    assert not kv.admit(3, ticket=11, positions=31)  # 71 + 31 > 100: nothing changed
    assert kv.used == 70 and kv.newest() == 2
    assert kv.grow(1, 41) and kv.held[1] == 41 + RESERVE_STEP  # a spare step at once
    assert kv.grow(1, 50) and kv.held[1] == 57  # within the reservation
    assert kv.grow(2, 43) and kv.held[2] == 43  # the spare does not fit, the need does
    assert not kv.grow(2, 44) and kv.held[2] == 43
    kv.release(2)
    assert kv.used == 57 and kv.newest() == 1 and kv.fits(43) and not kv.fits(44)
    with pytest.raises(ValueError, match="already holds"):
        kv.admit(1, ticket=12, positions=1)


def test_kv_budget_charges_a_shared_prefix_once() -> None:
    """Lanes 2 and 3 share lane 1's first 50 and 30 positions, lane 4 shares lane 2's
    first 60 (50 of them lane 1's): each shared position is charged once, and releasing a
    source hands its positions to the sharer that shares the most, never charging more
    than the release frees."""
    kv = KVBudget(1000)
    for lane, held in ((1, 100), (2, 80), (3, 40), (4, 70)):
        assert kv.admit(lane, ticket=lane, positions=held)
    kv.share(2, 1, 50)
    kv.share(3, 1, 30)
    kv.share(4, 2, 60)
    assert kv.used == 100 + (80 - 50) + (40 - 30) + (70 - 60)
    kv.release(1)  # lane 2, sharing the most, pays for its 50 now; lane 3 shares lane 2's
    assert kv.credits == {3: (2, 30), 4: (2, 60)} and kv.used == 80 + 10 + 10
    kv.release(2)  # lane 4 (60) is the heir: it pays for all 70; lane 3 shares its 30
    assert kv.credits == {3: (4, 30)} and kv.used == 70 + 10
    kv.release(4)
    assert kv.credits == {} and kv.used == 40
    with pytest.raises(ValueError, match="must both hold"):
        kv.share(3, 9, 10)


def test_the_kv_pool_holds_a_context_and_auto_follows_the_free_memory() -> None:
    assert resolve_kv_pool(5000, 8, 4096, 1024) == 5000
    with pytest.raises(ValueError, match="one whole context"):
        resolve_kv_pool(4095, 8, 4096, 1024)
    gib = 1 << 30
    assert resolve_kv_pool(0, 8, 4096, 1024, free_bytes=gib) == 8 * 4096  # all fit
    assert resolve_kv_pool(0, 8, 4096, 65536, free_bytes=gib) == 8192  # half of 1 GiB
    assert resolve_kv_pool(0, 8, 4096, 1 << 20, free_bytes=gib) == 4096  # at least one


# Eight prompts of mixed lengths (a few tokens to a few hundred), plain text.
PASSAGE = (
    "The river rose slowly through the night, and by morning the low fields along its "
    "banks had become a single sheet of grey water. Farmers moved their animals to the "
    "ridge, and the old bridge, which had stood for two hundred years, groaned under the "
    "weight of the branches caught against its piers. "
)
MIXED = [
    "Hello",
    "The capital of France is",
    "List three primary colors:",
    PASSAGE,
    "Write a short poem about the sea.",
    PASSAGE * 3 + "Summarize the passage:",
    "def fibonacci(n):",
    PASSAGE * 2 + "What happened to the bridge?",
]


async def test_float32_greedy_batch_of_eight_mixed_lengths_equals_each_alone() -> None:
    """SmolLM2 in float32: eight mixed-length greedy requests decoded together give what
    each gives alone, for at least 7 of 8 whole and the first 32 tokens of every one. A
    batch's matmuls may round apart from one row's in the last bits, so a later token may
    flip, but only where it is a near-tie alone: its top two logprobs within 1e-3."""
    greedy = SamplingParams(temperature=0, logprobs=2)

    def reqs(engine: Engine) -> list[GenerationRequest]:
        return [
            GenerationRequest(f"m{i}", engine.tokenizer.encode(text), greedy, 40, ignore_eos=True)
            for i, text in enumerate(MIXED)
        ]

    async def run(engine: Engine, req: GenerationRequest) -> tuple[list[int], list, list[dict]]:
        tokens, chosen, tops = [], [], []
        async for delta in engine.submit(req):
            tokens += delta.token_ids
            for lp in delta.logprobs or []:
                chosen.append(lp.token)
                tops.append({text: logprob for text, logprob, _ in lp.top})  # the top 2
        return tokens, chosen, tops

    path = smollm2_path()
    async with engine_for(path, context=1024, weights="dequant") as engine:
        alone = [await run(engine, r) for r in reqs(engine)]
    async with engine_for(path, context=1024, weights="dequant", max_running=8) as engine:
        together = await asyncio.gather(*(run(engine, r) for r in reqs(engine)))
        assert engine.stepped_sequences / engine.steps > 4
    whole = 0
    for i, (got, want) in enumerate(zip(together, alone, strict=True)):
        assert got[0][:32] == want[0][:32], f"prompt {i}: the first 32 tokens differ"
        if got[0] == want[0]:
            whole += 1
            continue
        j = next(j for j, (a, b) in enumerate(zip(got[0], want[0], strict=True)) if a != b)
        top = want[2][j]
        assert got[1][j] in top, f"prompt {i}: token {j} is not alone's second choice"
        gap = top[want[1][j]] - top[got[1][j]]
        assert gap < 1e-3, f"prompt {i}: token {j} flipped without a near-tie ({gap})"
    assert whole >= 7


async def test_speculative_requests_are_preempted_and_resume_exactly(tiny: Path) -> None:
    """`--draft ngram` lanes in a pool of one context: a preempted speculative request
    (its anchor streamed, not fed) recomputes and goes on; greedy output == plain alone,
    logprobs too (they see the whole context: a token fed twice would show)."""
    await preempted_speculation_equals_plain(tiny, lookup_drafts=True)


async def preempted_speculation_equals_plain(target: Path, **drafter) -> None:
    """Three greedy speculative requests (the `drafter` options of `engine_for`) in a KV
    pool of one context, against plain decoding alone."""
    greedy = SamplingParams(temperature=0, logprobs=1)
    # ~60 + 100 positions each: any two outgrow the pool of 256 together.
    prompts = [PROMPTS[0] * 6, PROMPTS[2] * 3 + PROMPTS[3] * 2, PROMPTS[1][:30] * 2]
    reqs = [
        GenerationRequest(f"s{i}", p, greedy, 100, ignore_eos=True) for i, p in enumerate(prompts)
    ]
    async with engine_for(target, context=256) as engine:
        alone = [await collect(engine, r) for r in reqs]
    async with engine_for(
        target, context=256, max_running=3, kv_pool_tokens=256, block_size=4, **drafter
    ) as engine:
        together = await asyncio.gather(*(collect(engine, r) for r in reqs))
        assert engine.totals["preemptions"] > 0
        assert engine.totals["spec_drafts"] > 0
    for got, want in zip(together, alone, strict=True):
        assert got[0] == want[0]
        assert [lp for lp, _ in got[1]] == pytest.approx([lp for lp, _ in want[1]], abs=1e-4)


async def test_lookup_verify_blocks_batch_with_plain_steps(tiny: Path) -> None:
    """`--draft ngram` greedy requests put their verify blocks in the step batch beside
    other requests' tokens: each output (and its logprobs) is plain decoding's alone."""
    greedy = SamplingParams(temperature=0, logprobs=1)
    prompts = [PROMPTS[1][:30] * 3, PROMPTS[2] * 4, PROMPTS[0]]
    reqs = [
        GenerationRequest(f"b{i}", p, greedy, 50, ignore_eos=True) for i, p in enumerate(prompts)
    ]
    async with engine_for(tiny, context=256) as engine:
        alone = [await collect(engine, r) for r in reqs]
    async with engine_for(tiny, context=256, max_running=3, lookup_drafts=True) as engine:
        together = await asyncio.gather(*(collect(engine, r) for r in reqs))
        assert engine.stepped_sequences > engine.steps  # lanes shared batches
        assert engine.totals["spec_accepted_tokens"] > 0  # verify blocks went through them
    for got, want in zip(together, alone, strict=True):
        assert got[0] == want[0]
        assert [lp for lp, _ in got[1]] == pytest.approx([lp for lp, _ in want[1]], abs=1e-4)


@pytest.fixture(scope="module")
def drafted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """An 8-layer target (deep enough for the draft's captures) and a random draft."""
    root = tmp_path_factory.mktemp("cbd")
    target = make_tiny_gguf("qwen3", root / "qwen3.gguf", seed=7, layers=8, context=512)
    return target.path, make_tiny_draft(target.path, root / "draft", seed=3, block_size=4)[1]


async def dflash_references(
    known: dict, drafted: tuple[Path, Path], reqs: list[GenerationRequest]
) -> tuple[Outputs, Outputs, list[int]]:
    """(plain decoding of the greedy requests, every request alone with the draft in the
    target's worker, how many drafts each made alone), the same for every case."""
    if "dflash" not in known:
        tiny, tiny_draft = drafted
        plain = await outputs_alone(known, tiny, reqs[:3])
        async with engine_for(tiny, context=256, draft=tiny_draft, block_size=4) as engine:
            drafted_alone, drafts_alone = [], []
            for r in reqs:
                handle = engine.submit(r)
                drafted_alone.append(await drain(handle))
                drafts_alone.append(handle.spec["drafts"])
        known["dflash"] = plain, drafted_alone, drafts_alone
    return known["dflash"]


@pytest.mark.parametrize("draft_device", [None, "cpu:1"], ids=["draft-in-target", "draft-apart"])
async def test_dflash_requests_draft_and_verify_in_the_batch(
    drafted: tuple[Path, Path], served_alone, draft_device: str | None
) -> None:
    """A DFlash draft model with continuous batching: greedy requests draft from their own
    lane's feature ring and verify their blocks in the step batch beside each other, a
    seeded sampled one verifies by rejection sampling on its own between the batches. Each
    greedy output is plain decoding's alone, every output is what the request gives served
    alone with the draft, each request drafts as often as it does alone, and each lane's
    ring holds its own sequence's captured layer outputs."""
    tiny, tiny_draft = drafted
    greedy = SamplingParams(temperature=0, logprobs=1)
    prompts = [PROMPTS[1][:40], PROMPTS[2], PROMPTS[0]]
    reqs = [
        GenerationRequest(f"d{i}", p, greedy, 30, ignore_eos=True) for i, p in enumerate(prompts)
    ]
    sampled = SamplingParams(temperature=0.8, seed=11)
    reqs.append(GenerationRequest("s", PROMPTS[3], sampled, 30, ignore_eos=True))
    plain, drafted_alone, drafts_alone = await dflash_references(served_alone, drafted, reqs)
    async with engine_for(
        tiny, context=256, draft=tiny_draft, draft_device=draft_device, block_size=4, max_running=4
    ) as engine:
        handles = [engine.submit(r) for r in reqs]
        together = await asyncio.gather(*(drain(h) for h in handles))
        assert engine.stepped_sequences > engine.steps  # lanes shared batches
        target = engine.target
        layers = target.capture[0] if target.capture else ()
        rings = {h.request_id: target.ring(h.slot).array.copy() for h in handles}  # type: ignore[union-attr]
    assert [h.spec["drafts"] for h in handles] == drafts_alone and min(drafts_alone) > 0
    assert [t for t, _, _ in together] == [t for t, _, _ in drafted_alone]
    for got, want in zip(together, plain, strict=False):
        assert got[0] == want[0]
        assert [lp for lp, _ in got[1]] == pytest.approx([lp for lp, _ in want[1]], abs=1e-4)
    model = Model.load(tiny, weights="dequant")
    for req, (tokens, _, _) in zip(reqs, together, strict=True):
        fed = torch.tensor([*req.prompt, *tokens[:-1]])  # the last token is never fed
        _, caps = model.forward_layers(model.embed(fed), model.new_cache(len(fed)), 0, layers)
        want = torch.stack([caps[layer] for layer in layers], 1)
        got = torch.from_numpy(rings[req.request_id][: len(fed)])
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


async def test_prefix_cache_hits_restore_into_running_lanes(tiny: Path) -> None:
    """Requests that hit the prefix cache while others decode restore into their own lanes:
    each output equals the request's fresh output alone, and each restored its prefix."""
    first = [(7 * i + 3) % 120 + 2 for i in range(150)]
    later = [
        first + [(11 * i + 5) % 120 + 2 for i in range(40)],  # a second turn
        first[:100] + [(13 * i + 1) % 120 + 2 for i in range(30)],  # a branch
        first,  # the same prompt again
    ]
    greedy = SamplingParams(temperature=0)
    reqs = [GenerationRequest(f"p{i}", p, greedy, 16, ignore_eos=True) for i, p in enumerate(later)]
    async with engine_for(tiny, context=512) as engine:
        fresh = [await collect(engine, r) for r in reqs]
    # No block pool: the prefixes are restored, not shared (test_prefix_sharing.py).
    async with engine_for(
        tiny, context=512, prefix_cache_bytes=64 << 20, max_running=3, kv_block=0
    ) as engine:
        await collect(engine, GenerationRequest("seed", first, greedy, 4, ignore_eos=True))
        handles = [engine.submit(r) for r in reqs]
        together = await asyncio.gather(*(drain(h) for h in handles))
        assert engine.stepped_sequences > engine.steps
    assert [h.cached_tokens for h in handles] == [150, 100, 149]
    assert [t for t, _, _ in together] == [t for t, _, _ in fresh]


async def test_remote_experts_carry_the_whole_batch(tmp_path: Path) -> None:
    """MoE with cold experts in an expert worker: a batched step's expert calls carry every
    sequence's rows, and each output equals the all-local model's alone."""
    target = make_tiny_gguf("qwen3moe", tmp_path / "moe.gguf", seed=7, layers=4).path
    greedy = SamplingParams(temperature=0)
    reqs = [
        GenerationRequest(f"m{i}", p, greedy, 20, ignore_eos=True) for i, p in enumerate(PROMPTS)
    ]
    async with engine_for(target, context=256) as engine:
        local = [await collect(engine, r) for r in reqs]
    remote = {"moe_hot": 4, "moe_expert_device": "cpu:2"}
    async with engine_for(target, context=256, max_running=4, **remote) as engine:
        together = await asyncio.gather(*(collect(engine, r) for r in reqs))
        assert engine.stepped_sequences > engine.steps
        totals = engine.target.moe_status()
    assert totals is not None and totals["remote_calls"] > 0 and totals["fallbacks"] == 0
    assert [t for t, _, _ in together] == [t for t, _, _ in local]


async def test_dflash_requests_are_preempted_and_resume_exactly(
    drafted: tuple[Path, Path],
) -> None:
    """DFlash lanes in a pool of one context: a preempted request recomputes its prompt
    and output (its ring refilled by the recompute) and goes on as plain decoding alone."""
    tiny, tiny_draft = drafted
    await preempted_speculation_equals_plain(tiny, draft=tiny_draft)
