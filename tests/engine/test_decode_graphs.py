"""Decode steps through the captured fixed-shape step (`--decode-graphs`, a CUDA graph per
batch bucket on a GPU), here on the CPU, where the worker runs the same step eagerly: its
tokens follow the worker's own forward, alone and batched beside prompt chunks, greedy and
sampled. The step attends through SDPA over rows gathered by the block table where the
forward uses luced's decode kernel, so runs are compared with `cuda_support.agree` (equal
tokens, or a parting at a near-tie of the reference)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from cuda_support import Run, agree, run_length
from engine_harness import engine_for

from luced.engine.core import Engine
from luced.runtime.tiny import make_tiny_gguf
from luced.sampling_params import SamplingParams

PROMPTS = [
    [3, 17, 5, 42, 8, 99, 23, 4, 61, 7],
    [(7 * i + 3) % 300 + 2 for i in range(90)],  # two prefill chunks of 64, beside decodes
    [11, 12, 13] * 6,
    [200, 1, 200, 2],
]
N = 20
TOL = 1e-3  # nats: float32 everywhere, only the attention's summation order differs


async def runs(engine: Engine, sampling: SamplingParams) -> list[Run]:
    alone = [await run_length(engine, p, sampling, N) for p in PROMPTS]
    together = await asyncio.gather(*(run_length(engine, p, sampling, N) for p in PROMPTS))
    return [*alone, *together]


@pytest.mark.parametrize("family", ["llama", "gemma3"])
async def test_the_captured_step_follows_the_forward(tmp_path: Path, family: str) -> None:
    path = tmp_path / f"{family}.gguf"
    make_tiny_gguf(family, path, seed=11, layers=2, context=512)
    greedy = SamplingParams(temperature=0, logprobs=2)
    sampled = SamplingParams(temperature=0.8, seed=5, logprobs=2)
    results = {}
    for mode in ("off", "on"):
        async with engine_for(path, max_running=4, decode_graphs=mode) as engine:
            results[mode] = [*await runs(engine, greedy), *await runs(engine, sampled)]
            (worker,) = (await engine.target.stats())["workers"]
            steps = worker["decode_graph_steps"]
            batched = engine.stepped_sequences > engine.steps
        assert batched
        assert (steps > 0) == (mode == "on"), (mode, steps)
    for ref, got in zip(results["off"], results["on"], strict=True):
        agree(ref, got, TOL)


async def test_verify_windows_take_the_captured_step(tmp_path: Path) -> None:
    """n-gram drafts on repetitive prompts: the verify windows (greedy: a row after every
    token) run through the captured step, and the tokens follow `off`'s."""
    path = tmp_path / "llama.gguf"
    make_tiny_gguf("llama", path, seed=11, layers=2, context=512)
    greedy = SamplingParams(temperature=0, logprobs=2)
    prompts = [[11, 12, 13, 14] * 8, [5, 6] * 12]
    results, windows = {}, {}
    for mode in ("off", "on"):
        async with engine_for(
            path, max_running=2, decode_graphs=mode, lookup_drafts=True, block_size=8
        ) as engine:
            results[mode] = await asyncio.gather(
                *(run_length(engine, p, greedy, N) for p in prompts)
            )
            (worker,) = (await engine.target.stats())["workers"]
            windows[mode] = worker["decode_graph_windows"]
    assert windows["off"] == 0 and windows["on"] > 0, windows
    for ref, got in zip(results["off"], results["on"], strict=True):
        agree(ref, got, TOL)
