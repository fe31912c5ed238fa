"""Block verification: the greedy acceptance rule (hand cases and spec == plain greedy on a toy
model), budget and EOS inside a block, and rejection sampling tested statistically against the
target distribution (and shown to reject the draft's), seeding and the degenerate drafts."""

from __future__ import annotations

import math
import random
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from luced.acceptance import VerifyResult, verify_greedy
from luced.runtime.dflash.verify import residual_distribution, verify_sampled
from luced.runtime.sampler import Sampler, probs, sample
from luced.sampling_params import SamplingParams

EOS = 99


def _chi2(counts: torch.Tensor, expected_p: torch.Tensor) -> tuple[float, int]:
    """Pearson statistic over the support of expected_p, and its degrees of freedom."""
    support = expected_p > 0
    n = counts.sum().item()
    exp = expected_p[support].double() * n
    stat = ((counts[support].double() - exp) ** 2 / exp).sum().item()
    return stat, int(support.sum()) - 1


def _chi2_crit(df: int) -> float:
    """Chi-square critical value at alpha = 0.001 by the Wilson-Hilferty approximation (no
    scipy here): within 2% above the exact value for df >= 3, e.g. 18.72 vs 18.47 at df 4,
    49.84 vs 49.73 at df 23."""
    z = 3.0902  # standard normal quantile at 1 - 0.001
    h = 2.0 / (9.0 * df)
    return df * (1.0 - h + z * math.sqrt(h)) ** 3


# ---------------------------------------------------------------- greedy rule


@pytest.mark.parametrize(
    ("target", "tokens", "accepted"),
    [
        ([5, 6, 7, 9], (5, 6, 7, 9), 3),  # all accepted; the bonus follows the whole block
        ([4, 6, 7, 9], (4,), 0),  # first proposal rejected: only the target's own token
        ([5, 8, 7, 9], (5, 8), 1),  # middle rejected; the later match t[2] == d[3] is ignored
        ([5, 6, 3, 9], (5, 6, 3), 2),  # last proposal rejected
    ],
)
def test_greedy_acceptance(target: list[int], tokens: tuple[int, ...], accepted: int) -> None:
    r = verify_greedy([1, 5, 6, 7], target, budget=100, eos_ids={EOS})
    assert r == VerifyResult(tokens, accepted, accepted + 1, None)
    assert r.has_bonus


def test_greedy_block_of_one_is_plain_decoding() -> None:
    assert verify_greedy([1], [8], budget=5) == VerifyResult((8,), 0, 1, None)


@pytest.mark.parametrize(
    ("budget", "tokens", "kept", "finish"),
    [
        (4, (5, 6, 7, 9), 4, "length"),  # exactly fits: the bonus is the last allowed token
        (3, (5, 6, 7), 4, "length"),  # clipped: the bonus is dropped first
        (2, (5, 6), 3, "length"),
        (1, (5,), 2, "length"),
    ],
)
def test_greedy_budget_clips(budget: int, tokens: tuple[int, ...], kept: int, finish: str) -> None:
    r = verify_greedy([1, 5, 6, 7], [5, 6, 7, 9], budget=budget)
    assert r == VerifyResult(tokens, 3, kept, finish)  # type: ignore[arg-type]
    assert r.has_bonus == (budget == 4)


def test_greedy_eos_inside_block() -> None:
    # An accepted EOS proposal ends the block: nothing after it, not even the bonus.
    r = verify_greedy([1, 5, EOS, 7], [5, EOS, 7, 9], budget=100, eos_ids={EOS})
    assert r == VerifyResult((5, EOS), 3, 3, "stop")  # num_accepted is counted before the cut
    # EOS as the bonus after all proposals, and as the target's token at a rejection.
    r = verify_greedy([1, 5, 6, 7], [5, 6, 7, EOS], budget=100, eos_ids={EOS, 98})
    assert r == VerifyResult((5, 6, 7, EOS), 3, 4, "stop")
    r = verify_greedy([1, 5, 6, 7], [5, 98, 7, 9], budget=100, eos_ids={EOS, 98})
    assert r == VerifyResult((5, 98), 1, 2, "stop")
    # EOS landing exactly on the budget: "stop", as plain decoding reports it.
    r = verify_greedy([1, 5, EOS, 7], [5, EOS, 7, 9], budget=2, eos_ids={EOS})
    assert r.finish == "stop"
    # A proposal equal to EOS that the target rejects is not emitted.
    r = verify_greedy([1, EOS, 6], [4, 6, 7], budget=100, eos_ids={EOS})
    assert r == VerifyResult((4,), 0, 1, None)


def test_greedy_validation() -> None:
    with pytest.raises(ValueError, match="block has 3 tokens and target 2"):
        verify_greedy([1, 2, 3], [2, 3], budget=5)
    with pytest.raises(ValueError, match="B >= 1"):
        verify_greedy([], [], budget=5)
    with pytest.raises(ValueError, match="budget"):
        verify_greedy([1, 2], [2, 3], budget=0)


def _toy_greedy_model(prefix: list[int]) -> int:
    """A deterministic next-token function with structure (not a constant)."""
    return (prefix[-1] * 7 + len(prefix) * 3 + (prefix[-2] if len(prefix) > 1 else 0)) % 13


def test_greedy_speculative_equals_plain_greedy() -> None:
    # The loop the daemon runs, over a toy target and drafts that are right part of the time;
    # with EOS = 0 and random budgets the output must equal plain greedy decoding exactly.
    rng = random.Random(0)
    for _ in range(300):
        prompt = [rng.randrange(13) for _ in range(rng.randrange(1, 4))]
        max_tokens, block_size = rng.randrange(1, 30), rng.choice([2, 3, 4, 16])
        plain = list(prompt)
        while len(plain) - len(prompt) < max_tokens:
            plain.append(_toy_greedy_model(plain))
            if plain[-1] == 0:
                break

        seq = list(prompt)
        anchor = _toy_greedy_model(seq)  # decided by the prefill, fed by the first verify
        out = [anchor]
        finished = anchor == 0 or max_tokens == 1
        while not finished:
            block = [anchor]
            for _ in range(block_size - 1):  # right with probability 0.7, else a random token
                right = _toy_greedy_model(seq + block)
                block.append(right if rng.random() < 0.7 else rng.randrange(13))
            target = [_toy_greedy_model(seq + block[: i + 1]) for i in range(block_size)]
            r = verify_greedy(block, target, budget=max_tokens - len(out), eos_ids={0})
            assert r.num_kept == 1 + min(len(r.tokens), r.num_accepted)
            seq += block[: r.num_kept]
            out += r.tokens
            anchor, finished = out[-1], r.finish is not None
        assert out == plain[len(prompt) :]


# ---------------------------------------------------------------- rejection sampling

V = 6
B = 4
PARAMS = SamplingParams(temperature=0.9, top_k=5)


def _rows(seed: int, n: int, scale: float = 2.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, V, generator=g) * scale


def _fixed_block_setup() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Target rows p [B, V], draft logits [B-1, V] and their q: deliberately different."""
    target_logits = _rows(1, B)
    q_logits = target_logits[: B - 1] + _rows(2, B - 1, scale=1.5)
    p, q = probs(target_logits, PARAMS), probs(q_logits, PARAMS)
    # Different enough that a test of the same data against q must fail, close enough that
    # the deeper positions are reached often.
    tv = 0.5 * (p[: B - 1] - q).abs().sum(-1)
    assert bool((tv > 0.25).all()) and bool((tv < 0.7).all()), tv
    return p, q_logits, q


def test_sampled_tokens_follow_target_per_position() -> None:
    # One block per seed. With fixed target rows, the token a step emits at position j (when it
    # gets that far) must follow p[j]: accepted proposals, residual draws and the bonus alike.
    p, q_logits, q = _fixed_block_setup()
    n = 15000
    # The draft proposes all positions at once from q, as a DFlash draft does.
    gd = torch.Generator().manual_seed(12345)
    proposals = sample(q_logits.repeat(n, 1), PARAMS, generator=gd).tokens.view(n, B - 1)
    at = [[] for _ in range(B)]
    first_accepted = 0
    for seed in range(n):
        g = Sampler(SamplingParams(seed=seed)).generator(torch.device("cpu"))
        block = [0, *proposals[seed].tolist()]
        r = verify_sampled(block, p, q, g, budget=B)
        assert len(r.tokens) == r.num_accepted + 1
        assert r.finish == ("length" if r.num_accepted == B - 1 else None)
        first_accepted += r.num_accepted > 0
        for j, tok in enumerate(r.tokens):
            at[j].append(tok)

    for j in range(B):
        counts = torch.bincount(torch.tensor(at[j]), minlength=V)
        assert len(at[j]) > 1000, (j, len(at[j]))
        assert counts[p[j] == 0].sum() == 0, f"position {j}: a token outside p's support"
        stat, df = _chi2(counts, p[j])
        assert stat < _chi2_crit(df), (j, stat, counts.tolist(), p[j].tolist())
        if j < B - 1:  # the same data rejects the draft's distribution: the test has power
            off_support = int(counts[q[j] == 0].sum())
            assert off_support > 0 or _chi2(counts, q[j])[0] > 10 * _chi2_crit(V - 1)
    # The first proposal is accepted with probability sum(min(p, q)) (4 sigma).
    rate = float(torch.minimum(p[0], q[0]).sum())
    assert abs(first_accepted / n - rate) < 4 * math.sqrt(rate * (1 - rate) / n)


def test_sampled_joint_of_two_tokens_follows_target_across_steps() -> None:
    # A toy target whose next-token distribution depends on the previous token (a bigram
    # table, through the real sampler), a draft that ignores its own proposals, and the loop
    # run until two tokens are out. The joint of (y1, y2) must be p(y1 | a) * p(y2 | y1).
    params = SamplingParams(temperature=0.8, top_k=4)
    target_logits = torch.randn(V, V, generator=torch.Generator().manual_seed(3)) * 2
    target = probs(target_logits, params)
    # The draft guesses every position from the anchor alone: a noisy copy of the target's
    # row for the first, so some proposals are accepted and some rejected.
    noise = torch.randn(V, B - 1, V, generator=torch.Generator().manual_seed(4)) * 1.5
    draft_logits = target_logits[:, None, :] + noise
    q_of = [probs(draft_logits[a], params) for a in range(V)]
    anchor = 2
    n = 10000
    # The draft's proposals, drawn ahead per anchor (each block takes the next row): one
    # sampler call per anchor instead of one per step keeps the test fast. A run takes at
    # most two blocks, so 2n rows per anchor suffice.
    gd = torch.Generator().manual_seed(777)
    pool = [sample(draft_logits[a].repeat(2 * n, 1), params, generator=gd).tokens for a in range(V)]
    pool = [t.view(2 * n, B - 1).tolist() for t in pool]
    used = [0] * V
    counts = torch.zeros(V, V, dtype=torch.int64)
    steps = 0
    for seed in range(n):
        g = Sampler(replace(params, seed=seed)).generator(torch.device("cpu"))
        out: list[int] = []
        a = anchor
        while len(out) < 2:
            block = [a, *pool[a][used[a]]]
            used[a] += 1
            p = target[torch.tensor(block)]  # row i: the target after d[0..i]
            r = verify_sampled(block, p, q_of[a], g, budget=2 - len(out))
            out += r.tokens
            a = out[-1]
            steps += 1
        counts[out[0], out[1]] += 1

    expected = target[anchor][:, None] * target  # [y1, y2]
    stat, df = _chi2(counts.flatten(), expected.flatten())
    assert stat < _chi2_crit(df), (stat, df)
    assert 1.2 * n < steps < 1.9 * n, "the draft should get some proposals accepted, not all"
    # What a sampler that kept the draft's proposals would give: rejected by the same data.
    wrong = q_of[anchor][0][:, None] * q_of[anchor][1][None, :]
    off = int(counts.flatten()[wrong.flatten() == 0].sum())
    assert off > 0 or _chi2(counts.flatten(), wrong.flatten())[0] > 10 * _chi2_crit(df)


def test_same_seed_same_output_different_seeds_differ() -> None:
    p, q_logits, q = _fixed_block_setup()
    gd = torch.Generator().manual_seed(5)
    blocks = [[0, *sample(q_logits, PARAMS, generator=gd).tokens.tolist()] for _ in range(30)]

    def run(seed: int) -> list[tuple[int, ...]]:
        g = Sampler(SamplingParams(seed=seed)).generator(torch.device("cpu"))
        return [verify_sampled(b, p, q, g, budget=10).tokens for b in blocks]

    a = run(42)
    assert a == run(42)
    g = Sampler(SamplingParams(seed=42)).generator(torch.device("cpu"))  # blocks as tensors
    assert a == [verify_sampled(torch.tensor(b), p, q, g, budget=10).tokens for b in blocks]
    assert a != run(43)


def test_one_hot_draft_accepts_with_target_probability() -> None:
    # A draft proposing its argmax: q is one-hot, acceptance is p(x), and the output is still p.
    p, q_logits, _ = _fixed_block_setup()
    proposals = q_logits.argmax(-1)
    q = torch.nn.functional.one_hot(proposals, V).float()
    assert torch.equal(q, probs(q_logits, SamplingParams(temperature=0.0)))
    n = 6000
    first, accepted = [], 0
    for seed in range(n):
        g = Sampler(SamplingParams(seed=seed)).generator(torch.device("cpu"))
        r = verify_sampled([0, *proposals.tolist()], p, q, g, budget=B)
        first.append(r.tokens[0])
        accepted += r.num_accepted > 0
    rate = float(p[0, proposals[0]])
    assert 0.05 < rate < 0.95
    assert abs(accepted / n - rate) < 4 * math.sqrt(rate * (1 - rate) / n)
    stat, df = _chi2(torch.bincount(torch.tensor(first), minlength=V), p[0])
    assert stat < _chi2_crit(df)


def test_one_hot_draft_extremes() -> None:
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.0, 0.5, 0.5, 0.0], [0.1, 0.2, 0.3, 0.4]])
    q = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    for _ in range(50):  # p(x) = 0: never accepted, the residual is p itself here
        r = verify_sampled([3, 0], p, q, g, budget=5)
        assert r.num_accepted == 0 and r.tokens[0] in (1, 2)
    p = torch.tensor([[0.0, 1.0, 0.0, 0.0], [0.1, 0.2, 0.3, 0.4]])
    q = torch.tensor([[0.0, 1.0, 0.0, 0.0]])
    for _ in range(50):  # p(x) = 1: always accepted, then the bonus from the last row
        r = verify_sampled([3, 1], p, q, g, budget=5)
        assert r.num_accepted == 1 and r.tokens[0] == 1 and len(r.tokens) == 2


def test_p_equal_q_always_accepts() -> None:
    p, _, _ = _fixed_block_setup()
    q = p[: B - 1].clone()
    gd = torch.Generator().manual_seed(6)
    for seed in range(300):
        # Any token q can propose is accepted, since p(x) / q(x) = 1.
        block = [0, *torch.multinomial(q, 1, generator=gd).squeeze(1).tolist()]
        g = Sampler(SamplingParams(seed=seed)).generator(torch.device("cpu"))
        r = verify_sampled(block, p, q, g, budget=10)
        assert r.num_accepted == B - 1 and list(r.tokens[:-1]) == block[1:]


def test_residual_distribution() -> None:
    p = torch.tensor([0.5, 0.3, 0.2, 0.0])
    q = torch.tensor([0.2, 0.5, 0.1, 0.2])
    assert torch.allclose(residual_distribution(p, q), torch.tensor([0.75, 0.0, 0.25, 0.0]))
    assert torch.equal(residual_distribution(p, p.clone()), p)  # all zero: sample from p


def test_sampled_budget_and_eos() -> None:
    p = torch.full((4, 5), 0.2)
    g = torch.Generator().manual_seed(1)
    # p == q: everything is accepted, so the cuts are deterministic.
    r = verify_sampled([0, 1, 2, 3], p, p[:3], g, budget=2)
    assert r == VerifyResult((1, 2), 3, 3, "length")
    r = verify_sampled([0, 1, 4, 3], p, p[:3], g, budget=10, eos_ids={4})
    assert r == VerifyResult((1, 4), 3, 3, "stop")


def test_sampled_matches_greedy_when_both_are_one_hot() -> None:
    rng = random.Random(1)
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        block = [rng.randrange(V) for _ in range(B)]
        target = [rng.choice([block[i + 1], rng.randrange(V)]) for i in range(B - 1)]
        target.append(rng.randrange(V))
        p = torch.nn.functional.one_hot(torch.tensor(target), V).float()
        q = torch.nn.functional.one_hot(torch.tensor(block[1:]), V).float()
        budget = rng.randrange(1, 6)
        want = verify_greedy(block, target, budget=budget, eos_ids={5})
        assert verify_sampled(block, p, q, g, budget=budget, eos_ids={5}) == want


def test_sampled_validation() -> None:
    g = torch.Generator()
    p, q = torch.full((3, 4), 0.25), torch.full((2, 4), 0.25)
    with pytest.raises(ValueError, match="p must be"):
        verify_sampled([0, 1], p, q, g, budget=3)
    with pytest.raises(ValueError, match="q must be"):
        verify_sampled([0, 1, 2], p, q[:1], g, budget=3)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        verify_sampled([0, 1, 4], p, q, g, budget=3)
    q0 = q.clone()
    q0[1, 2] = 0.0
    with pytest.raises(ValueError, match="zero draft probability"):
        verify_sampled([0, 1, 2], p, q0, g, budget=3)


# ---------------------------------------------------------------- layering


def test_greedy_rule_imports_without_torch() -> None:
    # The daemon never imports torch; it runs the greedy rule and the clipping.
    code = (
        "import sys\n"
        "from luced.acceptance import clip, verify_greedy\n"
        "assert verify_greedy([1, 2], [2, 3], budget=5).tokens == (2, 3)\n"
        "assert 'torch' not in sys.modules\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
