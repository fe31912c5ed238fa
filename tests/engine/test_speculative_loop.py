"""The DFlash loop through the real Engine and Target (worker subprocesses, shared
memory, frames) on a tiny qwen3 target with a random draft.

Oracles: plain greedy decoding of the same target (speculative greedy must equal it token
for token, for every block size and placement); the target's own distribution computed
from its logits (sampled speculative decoding must follow it, not the draft's); the
target's own greedy continuation as an oracle draft (every proposal accepted).
A random draft accepts almost nothing, which keeps the equality tests sharp: nearly
every block is rejected and rolled back.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import pytest_asyncio
import torch
from engine_harness import engine_for, generate

from luced.engine.core import Engine
from luced.engine.driver import Driver
from luced.runtime.sampler import probs
from luced.runtime.tiny import make_tiny_draft, make_tiny_gguf
from luced.sampling_params import SamplingParams
from tools.bench_dflash import OracleProposer

pytestmark = pytest.mark.asyncio(loop_scope="module")

THREADS = 1  # 2 cores: the workers of a split share them with the test
PROMPT = [3, 17, 5, 42, 8, 99, 23, 4, 61, 7]
N = 40


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("spec")
    target = root / "qwen3.gguf"
    make_tiny_gguf("qwen3", target, seed=7, layers=8, context=512)
    _, draft, _ = make_tiny_draft(target, root / "draft", seed=3, block_size=4)
    return target, draft


async def run(engine: Engine, max_tokens: int = N, **params) -> tuple[list[int], dict]:
    tokens, spec, _ = await run_logprobs(engine, max_tokens, **params)
    return tokens, spec


async def run_logprobs(
    engine: Engine, max_tokens: int = N, prompt: list[int] = PROMPT, **params
) -> tuple[list[int], dict, list]:
    """(tokens, spec counts, [(logprob, top ids)] per token when logprobs were asked)."""
    tokens, handle, lps = await generate(engine, prompt, max_tokens, **params)
    return tokens, dict(handle.spec), lps


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def plain(tiny: tuple[Path, Path]) -> list[int]:
    async with engine_for(tiny[0]) as engine:
        return (await run(engine))[0]


PLACEMENTS = {
    "in the target's worker": (("cpu",), None),
    "in its own worker": (("cpu",), "cpu:1"),
    "2-worker split target": (("cpu", "cpu:1"), None),
}


@pytest.mark.parametrize("placement", PLACEMENTS)
async def test_greedy_speculative_equals_plain(tiny, plain, placement: str) -> None:
    devices, draft_device = PLACEMENTS[placement]
    async with engine_for(tiny[0], devices, draft=tiny[1], draft_device=draft_device) as engine:
        if draft_device is not None or len(devices) > 1:
            roles = [w.get("role") for w in engine.workers()]
            assert roles.count("draft") == 1  # the draft runs in a worker of its own
        for block in (2, 4, 16):
            engine.speculation.block_size = block
            tokens, spec = await run(engine)
            assert tokens == plain, f"block {block}"
            # Full blocks, but near the end a block shrinks to the tokens still wanted.
            assert 0 < spec["drafts"] <= spec["draft_tokens"] <= spec["drafts"] * (block - 1)
            # max_tokens landing inside a block: exactly that many, a prefix of plain.
            assert (await run(engine, max_tokens=7))[0] == plain[:7]


LONG_PROMPT = [(7 * i + 3) % 120 + 2 for i in range(40)]  # prefill in one chunk


@pytest.fixture(scope="module")
def tiny_q4(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A Q4_0 target (float32 matrices stay exact in every weights mode)."""
    root = tmp_path_factory.mktemp("spec-q4")
    target = root / "qwen3.gguf"
    make_tiny_gguf("qwen3", target, seed=7, layers=8, context=512, qtype="Q4_0")
    _, draft, _ = make_tiny_draft(target, root / "draft", seed=3, block_size=4)
    return target, draft


@pytest.mark.parametrize("weights", ["int4", "int8", "auto", "dequant"])
async def test_greedy_speculative_equals_plain_in_every_weights_mode(tiny_q4, weights) -> None:
    """Compact weights: verify runs the same batch-invariant packed kernels as decode, so
    speculative greedy still equals plain greedy token for token."""
    async with engine_for(tiny_q4[0], weights=weights) as engine:
        want = (await run_logprobs(engine, prompt=LONG_PROMPT))[0]
    async with engine_for(tiny_q4[0], draft=tiny_q4[1], weights=weights) as engine:
        for block in (4, 16):
            engine.speculation.block_size = block
            assert (await run_logprobs(engine, prompt=LONG_PROMPT))[0] == want, f"block {block}"


GREEDY_EXTRAS = {"repetition_penalty": 1.3, "frequency_penalty": 0.4, "logprobs": 3}


async def test_greedy_with_penalties_and_logprobs_equals_plain(tiny) -> None:
    """Penalties inside a block: each verified row is penalized with its own history
    (including the proposals before it); logprobs come from the verified rows. The prompt
    fills the context to the last token, so the blocks shrink to fit at the end."""
    long_prompt = PROMPT * 10  # 100 tokens; with 412 generated = the whole 512 context
    async with engine_for(tiny[0]) as engine:
        expected = await run_logprobs(engine, 412, long_prompt, **GREEDY_EXTRAS)
    async with engine_for(tiny[0], ("cpu", "cpu:1"), draft=tiny[1], block_size=4) as engine:
        got = await run_logprobs(engine, 412, long_prompt, **GREEDY_EXTRAS)
    assert got[0] == expected[0]
    assert got[1]["drafts"] > 0
    assert [top for _, top in got[2]] == [top for _, top in expected[2]]
    lp_got, lp_exp = (np.array([lp for lp, _ in r[2]]) for r in (got, expected))
    np.testing.assert_allclose(lp_got, lp_exp, rtol=1e-4, atol=1e-4)


async def test_sampled_speculative_is_seeded(tiny) -> None:
    async with engine_for(tiny[0], ("cpu", "cpu:1"), draft=tiny[1], block_size=4) as engine:
        a, spec = await run(engine, temperature=0.8, top_k=20, seed=5)
        b, _ = await run(engine, temperature=0.8, top_k=20, seed=5)
        c, _ = await run(engine, temperature=0.8, top_k=20, seed=6)
        assert a == b and a != c and len(a) == N
        assert spec["drafts"] > 0
        # With penalties and logprobs too: still speculative, logprobs for every token.
        params = {"temperature": 0.8, "repetition_penalty": 1.2, "logprobs": 2, "seed": 3}
        tokens, spec, lps = await run_logprobs(engine, **params)
        assert spec["drafts"] > 0 and len(lps) == len(tokens) == N
        assert all(lp <= 0 and len(top) == 2 for lp, top in lps)


async def test_sampled_verify_follows_the_target_not_the_draft(tiny) -> None:
    """Many seeds, one verify step each: the step's first token follows the target's
    processed distribution p (after the anchor), even though the proposals come from the
    draft's q. Truncated support (top_k) keeps the categories few and well filled."""
    sampling = {"temperature": 2.0, "top_k": 4, "repetition_penalty": 1.5}
    params = SamplingParams(**sampling)
    async with engine_for(tiny[0], draft=tiny[1]) as engine:
        target = Driver(engine.target)
        anchor = (await target.prefill(PROMPT, {"temperature": 0})).token
        start = target.position()
        logits = torch.from_numpy(await target.logits([anchor]))
        # Penalized with the history of the verify's row 0: the prompt and the anchor.
        p = probs(logits, params, [[*PROMPT, anchor]])[0].numpy()
        target.truncate(start)
        trials = 600
        counts = np.zeros_like(p)
        q_first = np.zeros_like(p)
        for seed in range(trials):
            s = {**sampling, "seed": seed}  # a new map: new generators, here and the draft's
            block = await target.draft_block(anchor, 3, s)
            q_first[block[1]] += 1
            tokens, _ = await target.verify_sampled(block, s)
            counts[tokens[0].token] += 1
            target.truncate(start)
    support = np.flatnonzero(p)
    assert set(np.flatnonzero(counts)) <= set(support)  # never outside the target's top_k
    freq = counts / trials
    sigma = np.sqrt(p * (1 - p) / trials)
    assert np.all(np.abs(freq - p) <= 4.5 * sigma + 1e-9), (freq[support], p[support])
    # The draft proposed from a visibly different distribution: the check above is not
    # passing because p and q happen to agree.
    assert np.abs(q_first / trials - p).sum() > 0.3


async def test_oracle_draft_accepts_every_proposal(tiny, plain) -> None:
    """Proposals forced to the target's own greedy tokens: every step accepts B - 1 and
    commits B tokens, and the counters say so."""
    block = 4
    OracleProposer.script = PROMPT + plain
    async with engine_for(tiny[0], draft=tiny[1], proposer_cls=OracleProposer) as engine:
        engine.speculation.block_size = block
        # N - 1 tokens after the first (from the prefill) = whole blocks of B: no clipping.
        n = 1 + block * 6
        tokens, spec = await run(engine, max_tokens=n)
        assert tokens == plain[:n]
        assert spec["drafts"] == 6
        assert spec["accepted_tokens"] == spec["drafts"] * (block - 1)
        assert engine.status()["mean_acceptance_length"] == block
