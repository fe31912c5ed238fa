"""`--draft ngram` and adaptive block sizes through the real Engine and Target.

Oracles: plain greedy decoding of the same target (prompt-lookup speculation and any
block size must equal it token for token: unsplit, split, and on a hybrid whose
recurrent state is replayed after a rejection); the target's own distribution (a sampled
verify of a point-mass proposal must follow p, not the proposal).
The prompts repeat themselves, and a tiny random model soon loops, so lookups hit often
and both accepted and rejected proposals occur.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import pytest_asyncio
import torch
from engine_harness import engine_for
from test_speculative_loop import run_logprobs

from luced.engine.driver import Driver
from luced.runtime.sampler import probs
from luced.runtime.tiny import make_tiny_gguf
from luced.sampling_params import SamplingParams

pytestmark = pytest.mark.asyncio(loop_scope="module")

PROMPT = [3, 17, 5, 42, 8, 99, 23, 4, 61, 7] * 3 + [3, 17, 5]
N = 48


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lookup")
    out = {}
    # Seeds whose greedy output repeats some of itself, so that proposals get accepted.
    for family, seed in (("qwen3", 7), ("qwen35", 11)):
        out[family] = root / f"{family}.gguf"
        make_tiny_gguf(family, out[family], seed=seed, layers=4, context=512)
    return out


async def run(engine, max_tokens: int = N, **params) -> tuple[list[int], dict]:
    tokens, spec, _ = await run_logprobs(engine, max_tokens, PROMPT, **params)
    return tokens, spec


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def plain(models) -> dict[str, list[int]]:
    out = {}
    for family, path in models.items():
        async with engine_for(path) as engine:
            out[family] = (await run(engine))[0]
    return out


CASES = {
    "qwen3 unsplit": ("qwen3", ("cpu",)),
    "qwen3 split": ("qwen3", ("cpu", "cpu:1")),
    "qwen35 hybrid": ("qwen35", ("cpu",)),
}


@pytest.mark.parametrize("case", CASES)
async def test_greedy_lookup_equals_plain(models, plain, case: str) -> None:
    family, devices = CASES[case]
    async with engine_for(models[family], devices, lookup_drafts=True) as engine:
        if family == "qwen35":  # this tiny hybrid repeats single tokens, not pairs
            engine.speculation.lookup_ngrams = (4, 1)
        accepted = proposed = 0
        for block in (2, 5, 16):
            engine.speculation.block_size = block
            tokens, spec = await run(engine)
            assert tokens == plain[family], f"block {block}"
            accepted += spec["accepted_tokens"]
            proposed += spec["draft_tokens"]
        assert 0 < accepted < proposed  # accepted and rejected proposals both occurred
        assert (await run(engine, max_tokens=9))[0] == plain[family][:9]


async def test_adaptive_blocks_keep_greedy_output(models, plain) -> None:
    extras = {"repetition_penalty": 1.3, "logprobs": 2}
    async with engine_for(models["qwen3"]) as engine:
        expected = await run_logprobs(engine, N, PROMPT, **extras)
    async with engine_for(models["qwen3"], lookup_drafts=True, adaptive_blocks=True) as engine:
        costs = engine.speculation.step_costs.table()
        assert set(costs) == {1, 2, 4, 8, 16} and all(s > 0 for s in costs.values())
        tokens, _ = await run(engine)
        assert tokens == plain["qwen3"]
        used = engine.status()["block_sizes"]
        assert sum(used.values()) > 0
        assert all(1 <= int(b) <= 16 for b in used)
        # Greedy stays exact with penalties and logprobs, whatever sizes are chosen.
        got = await run_logprobs(engine, N, PROMPT, **extras)
    assert got[0] == expected[0]
    assert [top for _, top in got[2]] == [top for _, top in expected[2]]


async def test_sampled_lookup_is_seeded(models) -> None:
    async with engine_for(models["qwen35"], lookup_drafts=True, block_size=6) as engine:
        engine.speculation.lookup_ngrams = (4, 1)  # single-token repeats: drafts to verify
        a, spec = await run(engine, temperature=0.7, seed=5)
        b, _ = await run(engine, temperature=0.7, seed=5)
        c, _ = await run(engine, temperature=0.7, seed=6)
        assert a == b and a != c and len(a) == N
        assert spec["drafts"] > 0


async def test_point_mass_verify_follows_the_target(models) -> None:
    """A lookup's proposal is certain (q one-hot): over many seeds the step's first token
    still follows the target's processed distribution p after the anchor."""
    sampling = {"temperature": 2.0, "top_k": 4}
    params = SamplingParams(**sampling)
    async with engine_for(models["qwen3"], lookup_drafts=True) as engine:
        target = Driver(engine.target)
        anchor = (await target.prefill(PROMPT, {"temperature": 0})).token
        start = target.position()
        logits = torch.from_numpy(await target.logits([anchor]))
        p = probs(logits, params, [[*PROMPT, anchor]])[0].numpy()
        target.truncate(start)
        proposal = int(np.argsort(p)[-2])  # a likely token, not the likeliest
        trials = 500
        counts = np.zeros_like(p)
        for seed in range(trials):
            target.set_point_mass_q([proposal, proposal])
            block = [anchor, proposal, proposal]
            tokens, _ = await target.verify_sampled(block, {**sampling, "seed": seed})
            counts[tokens[0].token] += 1
            target.truncate(start)
    freq = counts / trials
    sigma = np.sqrt(p * (1 - p) / trials)
    assert set(np.flatnonzero(counts)) <= set(np.flatnonzero(p))
    assert np.all(np.abs(freq - p) <= 4.5 * sigma + 1e-9), (freq[p > 0], p[p > 0])
