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
import torch
from cuda_support import Run, agree, run_length
from engine_harness import engine_for

from luced.engine.core import Engine, GenerationRequest, RequestHandle
from luced.runtime.model import Model
from luced.runtime.tiny import make_tiny_draft, make_tiny_gguf
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


async def _tokens(handle: RequestHandle) -> list[int]:
    tokens = [t async for delta in handle for t in delta.token_ids]
    assert handle.finish_reason == "length", handle.error
    return tokens


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


async def test_dflash_windows_take_the_captured_step_with_their_captures(tmp_path: Path) -> None:
    """A DFlash draft: its target's verify windows run through the captured step, and the
    layer outputs the step captures fill each sequence's feature ring as the eager forward
    would (the model's own captures over the fed tokens); the tokens follow `off`'s."""
    target = make_tiny_gguf("qwen3", tmp_path / "qwen3.gguf", seed=7, layers=8, context=512)
    draft = make_tiny_draft(target.path, tmp_path / "draft", seed=3, block_size=4)[1]
    greedy = SamplingParams(temperature=0, logprobs=2)
    prompts = [PROMPTS[0], PROMPTS[2]]
    results, windows = {}, {}
    for mode in ("off", "on"):
        async with engine_for(
            target.path, max_running=2, decode_graphs=mode, draft=draft, block_size=4
        ) as engine:
            reqs = [GenerationRequest(f"d{i}", p, greedy, N, ignore_eos=True)
                    for i, p in enumerate(prompts)]  # fmt: skip
            handles = [engine.submit(r) for r in reqs]
            results[mode] = [await _tokens(h) for h in handles]
            (worker,) = (await engine.target.stats())["workers"]
            windows[mode] = worker["decode_graph_windows"]
            layers = engine.target.capture[0] if engine.target.capture else ()
            rings = [engine.target.ring(h.slot).array.copy() for h in handles]  # type: ignore[union-attr]
    assert windows["off"] == 0 and windows["on"] > 0, windows
    assert results["on"] == results["off"]
    model = Model.load(target.path, weights="dequant")
    for req, tokens, ring in zip(reqs, results["on"], rings, strict=True):
        fed = torch.tensor([*req.prompt, *tokens[:-1]])  # the last token is never fed
        _, caps = model.forward_layers(model.embed(fed), model.new_cache(len(fed)), 0, layers)
        want = torch.stack([caps[layer] for layer in layers], 1)
        torch.testing.assert_close(torch.from_numpy(ring[: len(fed)]), want, atol=1e-4, rtol=1e-4)
