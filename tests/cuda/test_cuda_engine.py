"""The engine on a GPU worker group (real worker processes, shared memory, frames): greedy
output against the CPU, and the identities every feature keeps on the CPU, now on the GPU:
batched == alone, speculative == plain (DFlash, n-gram), split cuda + cpu == unsplit,
prefix-cache restored == fresh, a KV Flash pool covering the context == plain, MoE cold
experts on the CPU == all on the GPU.

Greedy runs are compared with `cuda_support.agree`: equal tokens, or a parting at a near-tie
of the reference (the kernels of the two runs may round differently). Each comparison is
recorded (identical or not, where they parted) so the GPU check's report says which modes
stay exact on the GPU and which only within a tolerance. Skipped without a GPU.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from cuda_support import Run, agree, device_under_test, record, run_length
from engine_harness import engine_for

from luced.engine.core import Engine, GenerationRequest
from luced.engine.kvflash import PagerConfig
from luced.runtime.tiny import make_tiny_draft, make_tiny_gguf
from luced.sampling_params import SamplingParams

pytestmark = [pytest.mark.cuda, pytest.mark.asyncio(loop_scope="module")]

PROMPTS = [
    [3, 17, 5, 42, 8, 99, 23, 4, 61, 7],
    [(7 * i + 3) % 300 + 2 for i in range(70)],  # two prefill chunks of 64
    [11, 12, 13] * 6,  # a loop the n-gram lookup proposes from
    [200, 1, 200, 2],
]
N = 24
# A near-tie: under this top-2 logprob margin (nats) two runs may pick differently.
TOL = {"dequant": 1e-3, "auto": 0.25}


@pytest.fixture(scope="module")
def gpu() -> str:
    return device_under_test() or "cpu"


@pytest.fixture(scope="module")
def other(gpu: str) -> str:
    """The CPU group beside the GPU one (on a dry run: a second CPU group)."""
    return "cpu:1" if gpu == "cpu" else "cpu"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, Path]:
    """A Q4_0 qwen3 (int4 block for block under auto) and a random DFlash draft for it."""
    root = tmp_path_factory.mktemp("cuda-engine")
    target = root / "qwen3.gguf"
    make_tiny_gguf("qwen3", target, seed=7, layers=6, context=1024, qtype="Q4_0")
    _, draft, _ = make_tiny_draft(target, root / "draft", seed=3, block_size=4)
    return target, draft


async def greedy(engine: Engine, prompt: list[int], n: int = N) -> Run:
    return await run_length(engine, prompt, SamplingParams(temperature=0, logprobs=2), n)


async def each(engine: Engine, prompts: list[list[int]] = PROMPTS) -> list[Run]:
    return [await greedy(engine, p) for p in prompts]


def compare(check: str, refs: list[Run], gots: list[Run], tol: float, **fields) -> None:
    agreements = [agree(r, g, tol) for r, g in zip(refs, gots, strict=True)]
    record(check, identical=all(a.identical for a in agreements), runs=agreements, **fields)


@pytest.mark.parametrize("weights", ["dequant", "auto"])
async def test_gpu_greedy_follows_the_cpu(tiny, gpu: str, weights: str) -> None:
    async with engine_for(tiny[0], ("cpu",)) as engine:
        ref = await each(engine)
    async with engine_for(tiny[0], (gpu,), weights=weights) as engine:
        got = await each(engine)
    compare("gpu_vs_cpu", ref, got, TOL[weights], weights=weights)


@pytest.mark.parametrize("weights", ["dequant", "auto"])
async def test_batched_equals_alone(tiny, gpu: str, weights: str) -> None:
    async with engine_for(tiny[0], (gpu,), weights=weights, max_running=4) as engine:
        alone = await each(engine)
        together = await asyncio.gather(*(greedy(engine, p) for p in PROMPTS))
        assert engine.stepped_sequences > engine.steps  # really batched
    compare("batched_vs_alone", alone, list(together), TOL[weights], weights=weights)


@pytest.mark.parametrize("weights", ["dequant", "auto"])
async def test_graph_decode_follows_the_eager_forward(tiny, gpu: str, weights: str) -> None:
    runs = {}
    for mode in ("off", "on"):  # on a GPU, "on" is the default (auto)
        async with engine_for(
            tiny[0], (gpu,), weights=weights, max_running=4, decode_graphs=mode
        ) as engine:
            alone = await each(engine)
            runs[mode] = [*alone, *await asyncio.gather(*(greedy(engine, p) for p in PROMPTS))]
            (worker,) = (await engine.target.stats())["workers"]
        assert (worker["decode_graph_steps"] > 0) == (mode == "on")
    compare("graph_vs_eager_decode", runs["off"], runs["on"], TOL[weights], weights=weights)


async def test_decoding_ahead_changes_no_output(tiny, gpu: str) -> None:
    runs = {}
    for mode in ("off", "on"):  # on a GPU, "on" is the default (auto)
        async with engine_for(
            tiny[0], (gpu,), weights="auto", max_running=4, decode_ahead=mode
        ) as engine:
            alone = await each(engine)
            runs[mode] = [*alone, *await asyncio.gather(*(greedy(engine, p) for p in PROMPTS))]
            (worker,) = (await engine.target.stats())["workers"]
        assert (worker["ahead_served"] > 0) == (mode == "on")
    compare("ahead_vs_plain", runs["off"], runs["on"], TOL["auto"], weights="auto")


@pytest.mark.parametrize(("drafter", "weights"), [("dflash", "dequant"), ("dflash", "auto"),
                                                  ("ngram", "dequant")])  # fmt: skip
async def test_speculative_equals_plain(tiny, gpu: str, drafter: str, weights: str) -> None:
    async with engine_for(tiny[0], (gpu,), weights=weights) as engine:
        plain = await each(engine)
    kind = {"draft": tiny[1]} if drafter == "dflash" else {"lookup_drafts": True}
    async with engine_for(tiny[0], (gpu,), weights=weights, **kind) as engine:
        for block in (4, 16):
            engine.speculation.block_size = block
            spec = await each(engine)
            compare("speculative_vs_plain", plain, spec, TOL[weights], drafter=drafter,
                    weights=weights, block=block)  # fmt: skip


async def test_split_gpu_and_cpu_equals_unsplit(tiny, gpu: str, other: str) -> None:
    async with engine_for(tiny[0], (gpu,)) as engine:
        whole = await each(engine)
    async with engine_for(tiny[0], (gpu, other)) as engine:
        workers = len(engine.workers())
        split = await each(engine)
    assert workers == 2
    compare("split_vs_unsplit", whole, split, TOL["dequant"], devices=[gpu, other])


async def test_prefix_cache_restored_equals_fresh(tiny, gpu: str) -> None:
    first = PROMPTS[1]
    turn2 = first + [(11 * i + 5) % 300 for i in range(20)]
    async with engine_for(tiny[0], (gpu,), prefix_cache_bytes=64 << 20) as engine:
        fresh = await greedy(engine, turn2)  # nothing cached yet
        await greedy(engine, first)  # cached, a prefix of the next
        req = GenerationRequest("r", turn2, SamplingParams(temperature=0), 1, ignore_eos=True)
        handle = engine.submit(req)
        [_ async for _ in handle]
        restored_tokens = handle.cached_tokens
        restored = await greedy(engine, turn2)
    assert restored_tokens > 0
    compare("prefix_restored_vs_fresh", [fresh], [restored], TOL["dequant"])


async def test_kv_flash_pool_covering_the_context_equals_plain(tiny, gpu: str) -> None:
    async with engine_for(tiny[0], (gpu,), context=1024) as engine:
        plain = await each(engine)
    pool = PagerConfig(pool_tokens=1024, policy="qk")
    async with engine_for(tiny[0], (gpu,), context=1024, kv_flash=pool) as engine:
        pooled = await each(engine)
    compare("kv_flash_vs_plain", plain, pooled, TOL["dequant"])


async def test_moe_cold_experts_on_the_cpu_equal_all_on_the_gpu(
    tmp_path_factory, gpu: str, other: str
) -> None:
    path = tmp_path_factory.mktemp("moe") / "qwen3moe.gguf"
    make_tiny_gguf("qwen3moe", path, seed=5, context=512)
    async with engine_for(path, (gpu,)) as engine:
        local = await each(engine, PROMPTS[:2])
    async with engine_for(path, (gpu,), moe_hot=4, moe_expert_device=other) as engine:
        roles = [w.get("role") for w in engine.workers()]
        split = await each(engine, PROMPTS[:2])
    assert "experts" in roles
    compare("moe_cold_on_cpu_vs_all_on_gpu", local, split, TOL["dequant"])
