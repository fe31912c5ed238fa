"""Sampler: hand-computed penalties and masks, HF warpers as the oracle, a chi-square test of
the draws, seeding, logprobs and parameter validation."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from luced.runtime import sampler as sampler_module
from luced.runtime.sampler import Sampler, apply_penalties, probs, sample, token_logprobs
from luced.sampling_params import SamplingParams

# Chi-square critical values at alpha = 0.001, by degrees of freedom.
_CHI2_CRIT_001 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}


def _random_logits(n: int, vocab: int, seed: int, scale: float = 3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, vocab, generator=g) * scale


def _chi2(counts: torch.Tensor, expected_p: torch.Tensor) -> tuple[float, int]:
    support = expected_p > 0
    n = counts.sum().item()
    exp = expected_p[support].double() * n
    stat = ((counts[support].double() - exp) ** 2 / exp).sum().item()
    return stat, int(support.sum()) - 1


# ---------------------------------------------------------------- greedy


def test_greedy_is_argmax_and_probs_one_hot() -> None:
    logits = _random_logits(16, 1000, seed=0)
    params = SamplingParams(temperature=0.0, top_k=5, top_p=0.5, min_p=0.2)
    out = Sampler(params).sample(logits)
    assert torch.equal(out.tokens, logits.argmax(dim=-1))
    p = probs(logits, params)
    assert torch.equal(p, torch.nn.functional.one_hot(logits.argmax(-1), 1000).float())


def test_greedy_draws_no_randomness() -> None:
    state = torch.get_rng_state()
    s = Sampler(SamplingParams(temperature=0.0))
    for _ in range(3):
        s.sample(_random_logits(2, 50, seed=1))
    assert s._generator is None
    assert torch.equal(torch.get_rng_state(), state)


# ---------------------------------------------------------------- penalties


def test_penalties_hand_example() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 0.0]] * 2)
    before = logits.clone()
    params = SamplingParams(
        temperature=0.0,
        repetition_penalty=2.0,
        frequency_penalty=0.5,
        presence_penalty=0.25,
        penalty_window=4,
    )
    # Row 0: token 2 is older than the window of 4; row 1 saw only token 4, three times.
    history = [[2, 3, 1, 3, 5], torch.tensor([4, 4, 4])]
    out = apply_penalties(logits, params, history)
    expected = torch.tensor(
        [
            # 3: 3.0/2 - 0.5*2 - 0.25; 1: -1.0*2 - 0.5 - 0.25; 5: 0.0 stays 0, - 0.5 - 0.25
            [2.0, -2.75, 0.5, 0.25, -2.0, -0.75],
            # 4: -2.0*2 - 0.5*3 - 0.25
            [2.0, -1.0, 0.5, 3.0, -5.75, 0.0],
        ]
    )
    assert torch.equal(out, expected)
    assert torch.equal(logits, before), "the caller's logits must not be modified"
    # Greedy picks from the penalized logits: token 3 (3.0) drops to 0.25, so 0 wins.
    assert sample(logits, params, history).tokens.tolist() == [0, 3]

    # Window -1 counts the whole history, so token 2 is penalized too: 0.5/2 - 0.5 - 0.25.
    all_tokens = SamplingParams(
        repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25, penalty_window=-1
    )
    assert apply_penalties(logits, all_tokens, history)[0, 2].item() == -0.5
    # Window 0 or no history: untouched.
    for p, h in (
        (SamplingParams(repetition_penalty=2.0, penalty_window=0), history),
        (params, None),
    ):
        assert torch.equal(apply_penalties(logits, p, h), logits)


def test_repetition_penalty_matches_hf() -> None:
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    logits = _random_logits(3, 300, seed=2)
    g = torch.Generator().manual_seed(3)
    history = torch.randint(0, 300, (3, 100), generator=g)
    params = SamplingParams(repetition_penalty=1.7, penalty_window=40)
    ours = apply_penalties(logits, params, list(history))
    hf = RepetitionPenaltyLogitsProcessor(penalty=1.7)(history[:, -40:], logits.clone())
    assert torch.equal(ours, hf)


def test_history_validation() -> None:
    params = SamplingParams(repetition_penalty=1.5)
    logits = torch.zeros(2, 10)
    with pytest.raises(ValueError, match="history has 1 rows"):
        apply_penalties(logits, params, [[1]])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        apply_penalties(logits, params, [[1], [10]])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        apply_penalties(logits, params, [[-1], [2]])


# ---------------------------------------------------------------- truncation masks

# Probabilities of ids 0..5, most likely first: 4, 1, 5, 0, 2, 3.
_P = torch.tensor([0.10, 0.25, 0.06, 0.04, 0.40, 0.15])
_ORDER = [4, 1, 5, 0, 2, 3]


def _expected(keep: list[int], temperature: float = 1.0) -> torch.Tensor:
    w = torch.zeros(6, dtype=torch.float64)
    w[keep] = _P[keep].double() ** (1.0 / temperature)
    return (w / w.sum()).float()


@pytest.mark.parametrize(
    ("kwargs", "keep"),
    [
        ({"top_k": 3}, _ORDER[:3]),
        ({"top_k": 6}, _ORDER),
        ({"top_p": 0.6}, _ORDER[:2]),  # mass before each: 0, .40, .65
        ({"top_p": 0.7}, _ORDER[:3]),
        ({"top_p": 0.3}, _ORDER[:1]),
        ({"min_p": 0.3}, _ORDER[:3]),  # threshold .12
        ({"min_p": 0.5}, _ORDER[:2]),  # threshold .20
        ({"min_p": 1.0}, _ORDER[:1]),
        # top_p sees the top_k survivors renormalized (.615, .385): only the first stays.
        ({"top_k": 2, "top_p": 0.6}, _ORDER[:1]),
        # top_p keeps 4 (mass before the 5th is .90), min_p then drops .10 < .3 * .40.
        ({"top_p": 0.95, "min_p": 0.3}, _ORDER[:3]),
        ({"top_k": 5, "top_p": 0.99, "min_p": 0.2}, _ORDER[:4]),
    ],
)
def test_truncation_masks(kwargs: dict, keep: list[int]) -> None:
    logits = _P.log()[None].repeat(2, 1)
    p = probs(logits, SamplingParams(**kwargs))
    assert torch.equal(p > 0, (_expected(keep) > 0)[None].repeat(2, 1))
    torch.testing.assert_close(p[0], _expected(keep), atol=1e-6, rtol=0)


def test_temperature_applies_before_top_p() -> None:
    # At T=2 the distribution is sqrt(p) renormalized: .277 .219 .170 .139 ...; mass before the
    # 3rd is .496 < .6, so top_p=0.6 keeps 3 tokens where it keeps 2 at T=1.
    logits = _P.log()[None]
    p = probs(logits, SamplingParams(temperature=2.0, top_p=0.6))
    torch.testing.assert_close(p[0], _expected(_ORDER[:3], temperature=2.0), atol=1e-6, rtol=0)


_HF_CASES = [
    {"temperature": 0.7},
    {"temperature": 1.3, "top_k": 40},
    {"temperature": 0.9, "top_p": 0.8},
    {"temperature": 1.0, "min_p": 0.05},
    {"temperature": 0.8, "top_k": 50, "top_p": 0.9, "min_p": 0.02, "repetition_penalty": 1.3},
    {"temperature": 1.5, "top_p": 0.5, "min_p": 0.1, "repetition_penalty": 0.8},
]


@pytest.mark.parametrize("kwargs", _HF_CASES)
def test_probs_match_hf_warpers(kwargs: dict) -> None:
    from transformers.generation.logits_process import (
        MinPLogitsWarper,
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    vocab = 2000
    params = SamplingParams(penalty_window=-1, **kwargs)
    logits = _random_logits(4, vocab, seed=4)
    history = torch.randint(0, vocab, (4, 30), generator=torch.Generator().manual_seed(5))
    chain = [
        RepetitionPenaltyLogitsProcessor(params.repetition_penalty),
        TemperatureLogitsWarper(params.temperature),
    ]
    if params.top_k:
        chain.append(TopKLogitsWarper(params.top_k))
    if params.top_p < 1.0:
        chain.append(TopPLogitsWarper(params.top_p))
    if params.min_p:
        chain.append(MinPLogitsWarper(params.min_p))
    scores = logits.clone()
    for proc in chain:
        scores = proc(history, scores)
    hf = torch.softmax(scores, dim=-1)
    ours = probs(logits, params, list(history))
    assert torch.equal(ours > 0, hf > 0)
    torch.testing.assert_close(ours, hf, atol=1e-6, rtol=1e-4)


def test_top_p_prefix_shortcut_equals_full_sort(monkeypatch: pytest.MonkeyPatch) -> None:
    vocab = 262144
    params = SamplingParams(temperature=0.9, top_p=0.9)
    # Nucleus sizes: inside the first prefix, inside the second, beyond both (full sort).
    cases = [(4.0, 1, 1024), (3.0, 1024, 16384), (0.5, 16384, vocab)]
    logits = [_random_logits(1, vocab, seed=6, scale=scale) for scale, _, _ in cases]
    fast = [probs(x, params) for x in logits]
    for p, (_, lo, hi) in zip(fast, cases, strict=True):
        kept = (p > 0).sum(dim=-1)
        assert bool(((kept > lo) & (kept < hi)).all()), kept.tolist()
    monkeypatch.setattr(sampler_module, "_TOP_P_PREFIXES", ())  # always the full sort
    for got, x in zip(fast, logits, strict=True):
        full = probs(x, params)
        assert torch.equal(got > 0, full > 0)
        torch.testing.assert_close(got, full, atol=1e-7, rtol=1e-5)


# ---------------------------------------------------------------- the draws


def _stat_setup() -> tuple[torch.Tensor, SamplingParams, list[list[int]]]:
    logits = torch.tensor([[1.0, 2.2, 0.3, 1.8, -0.5, 2.0, 0.9, -3.0]])
    params = SamplingParams(
        temperature=0.8,
        top_k=7,
        top_p=0.97,
        min_p=0.03,
        repetition_penalty=1.3,
        frequency_penalty=0.2,
        presence_penalty=0.1,
    )
    return logits, params, [[1, 5, 5, 6]]


def test_draws_follow_processed_distribution() -> None:
    logits, params, history = _stat_setup()
    expected = probs(logits, params, history)[0]
    support = int((expected > 0).sum())
    assert 3 <= support < 8, "the setup should truncate some tokens but keep several"
    raw = torch.softmax(logits[0] / params.temperature, dim=-1)
    draws = 20000
    for seed in (0, 1, 2):
        s = Sampler(replace(params, seed=seed))
        tokens = s.sample(logits.expand(draws, -1), history * draws).tokens
        counts = torch.bincount(tokens, minlength=8)
        assert counts[expected == 0].sum() == 0, "a truncated token was drawn"
        stat, df = _chi2(counts, expected)
        assert stat < _CHI2_CRIT_001[df], (seed, stat, counts.tolist(), expected.tolist())
        # The same test rejects the unprocessed distribution: it has power.
        assert _chi2(counts, raw)[0] > 100 * _CHI2_CRIT_001[7]

    # One row per call, as in decoding: the generator's stream across calls is also right.
    s = Sampler(replace(params, seed=3))
    tokens = torch.cat([s.sample(logits, history).tokens for _ in range(2000)])
    stat, df = _chi2(torch.bincount(tokens, minlength=8), expected)
    assert stat < _CHI2_CRIT_001[df]


def test_draws_keep_the_mass_of_a_long_tail() -> None:
    # Two heavy tokens and 4998 light ones (~1e-4 each): the tail's total share must come out
    # right, and a min_p-dropped token must never be drawn.
    vocab = 5000
    g = torch.Generator().manual_seed(10)
    logits = torch.log(torch.rand(1, vocab, generator=g) + 0.5)
    logits[0, 7], logits[0, 4000] = 7.5, 7.2
    logits[0, 4999] = -30.0  # below min_p
    params = SamplingParams(min_p=1e-6, seed=11)
    expected = probs(logits, params)[0]
    assert expected[4999] == 0 and 0.3 < expected[[7, 4000]].sum() < 0.9
    s = Sampler(params)
    tokens = torch.cat([s.sample(logits.expand(500, -1)).tokens for _ in range(16)])
    assert not bool((tokens == 4999).any())
    buckets = torch.stack(
        [(tokens == 7).sum(), (tokens == 4000).sum(), ((tokens != 7) & (tokens != 4000)).sum()]
    )
    p3 = torch.stack([expected[7], expected[4000], 1 - expected[7] - expected[4000]])
    stat, df = _chi2(buckets, p3)
    assert stat < _CHI2_CRIT_001[df], (buckets.tolist(), p3.tolist())


def test_same_seed_same_tokens_different_seed_differs() -> None:
    steps = [_random_logits(1, 1000, seed=100 + i, scale=1.0) for i in range(40)]

    def run(seed: int | None, interleave: bool = False) -> list[int]:
        s = Sampler(SamplingParams(temperature=1.0, top_p=0.95, seed=seed))
        other = Sampler(SamplingParams(temperature=1.0, seed=seed))
        out = []
        for logits in steps:
            if interleave:  # another request sharing the worker must not disturb this one
                other.sample(logits)
            out.append(int(s.sample(logits).tokens[0]))
        return out

    a = run(1234)
    assert a == run(1234) == run(1234, interleave=True)
    assert a != run(1235)
    assert run(None) != run(None)


def test_generator_follows_logits_device() -> None:
    s = Sampler(SamplingParams(seed=1))
    s.sample(torch.zeros(1, 10))
    assert s._generator is not None and s._generator.device.type == "cpu"
    with pytest.raises(ValueError, match="generator lives on"):
        s.generator(torch.device("meta"))


# ---------------------------------------------------------------- logprobs


def test_logprobs_are_log_softmax_of_processed_logits() -> None:
    logits = _random_logits(5, 500, seed=8)
    history = [[1, 2, 3, 3]] * 5
    params = SamplingParams(
        temperature=0.7, top_k=20, repetition_penalty=1.2, presence_penalty=0.3, logprobs=5, seed=9
    )
    out = sample(logits, params, history, torch.Generator().manual_seed(9))
    ref = torch.log_softmax(apply_penalties(logits, params, history) / 0.7, dim=-1)
    assert out.logprobs is not None and out.top_ids is not None and out.top_logprobs is not None
    torch.testing.assert_close(out.logprobs, ref.gather(1, out.tokens[:, None])[:, 0])
    top = ref.topk(5, dim=-1)
    assert torch.equal(out.top_ids, top.indices)
    torch.testing.assert_close(out.top_logprobs, top.values)

    # Greedy: temperature counts as 1, so these are the model's own log-probabilities.
    greedy = sample(logits, SamplingParams(temperature=0.0, logprobs=3))
    ref = torch.log_softmax(logits, dim=-1)
    torch.testing.assert_close(greedy.logprobs, ref.max(dim=-1).values)
    torch.testing.assert_close(greedy.top_logprobs, ref.topk(3, dim=-1).values)

    # The same numbers for tokens chosen elsewhere (speculative verification).
    again = token_logprobs(logits, params, out.tokens, history)
    torch.testing.assert_close(again.logprobs, out.logprobs)
    assert torch.equal(again.top_ids, out.top_ids)

    # 0 = chosen token only; None = nothing.
    only = sample(logits, SamplingParams(temperature=0.0, logprobs=0))
    assert only.logprobs is not None and only.top_ids is not None and only.top_ids.shape == (5, 0)
    none = sample(logits, SamplingParams(temperature=0.0))
    assert none.logprobs is None and none.top_ids is None and none.top_logprobs is None


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": "1"}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 2.0}, "top_k"),
        ({"top_k": True}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"min_p": -0.01}, "min_p"),
        ({"min_p": 1.5}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"frequency_penalty": math.inf}, "frequency_penalty"),
        ({"presence_penalty": None}, "presence_penalty"),
        ({"penalty_window": -2}, "penalty_window"),
        ({"seed": 2**64}, "seed"),
        ({"seed": 1.0}, "seed"),
        ({"logprobs": -1}, "logprobs"),
        ({"logit_bias": {5: 100.5}}, "logit_bias"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logit_bias": {"x": 1.0}}, "logit_bias"),
        ({"logit_bias": {"5": 1.0, 5: 2.0}}, "logit_bias"),
        ({"logit_bias": {3: math.nan}}, "logit_bias"),
        ({"logit_bias": dict.fromkeys(range(301), 1.0)}, "logit_bias"),
        ({"logit_bias": [1.0]}, "logit_bias"),
    ],
)
def test_validation_names_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field} "):
        SamplingParams(**kwargs)


def test_valid_params_and_frozen() -> None:
    p = SamplingParams(temperature=0, top_k=1, top_p=1, min_p=1, seed=-(2**63), logprobs=20)
    assert p.greedy and not p.has_penalties
    with pytest.raises(AttributeError):
        p.temperature = 1.0  # type: ignore[misc]


def test_bad_logits_shape() -> None:
    with pytest.raises(ValueError, match=r"logits must be \[n, vocab\]"):
        sample(torch.zeros(10), SamplingParams(temperature=0.0))


# --- extreme values (issue 19 item 2) ----------------------------------------------------

# Floats SamplingParams accepts, weighted to the edges: subnormals, float32 under/overflow,
# the ends of float64.
_EXTREME = [5e-324, 1e-300, 1e-45, 1e-38, 1e-30, 1e-8, 0.5, 1.0, 2.0, 1e30, 1e38, 1e39, 1e308]


def _positive() -> st.SearchStrategy[float]:
    return st.one_of(st.sampled_from(_EXTREME), st.floats(5e-324, 1.7e308, allow_nan=False))


def _signed() -> st.SearchStrategy[float]:
    return st.one_of(
        st.sampled_from([0.0, *_EXTREME, *(-x for x in _EXTREME)]),
        st.floats(-1.7e308, 1.7e308, allow_nan=False, allow_infinity=False),
    )


_params = st.builds(
    SamplingParams,
    temperature=st.one_of(st.just(0.0), _positive()),
    top_k=st.one_of(st.just(0), st.integers(1, 2**63)),
    top_p=st.one_of(
        st.just(1.0), st.sampled_from([5e-324, 1e-300, 1e-8, 0.5]), st.floats(5e-324, 1.0)
    ),
    min_p=st.one_of(st.just(0.0), st.sampled_from([5e-324, 1e-300, 1.0]), st.floats(0.0, 1.0)),
    repetition_penalty=_positive(),
    frequency_penalty=_signed(),
    presence_penalty=_signed(),
    penalty_window=st.sampled_from([-1, 0, 4, 64]),
    seed=st.integers(-(2**63), 2**64 - 1),
    logprobs=st.one_of(st.none(), st.integers(0, 20)),
    logit_bias=st.dictionaries(st.integers(0, 7), st.floats(-100.0, 100.0), max_size=8),
)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    params=_params,
    scale=st.sampled_from([0.0, 1.0, 30.0, 1e4, 1e30, 1e37]),
    history=st.lists(st.integers(0, 7), max_size=12),
)
def test_sampler_is_safe_for_every_valid_value(
    params: SamplingParams, scale: float, history: list[int]
) -> None:
    """No value SamplingParams accepts gives a NaN probability or a token outside the
    vocabulary (temperature 1e-300, repetition_penalty 5e-324 and temperature 1e308 with
    logprobs 20 once did)."""
    vocab = 8
    logits = _random_logits(2, vocab, seed=3) * scale
    hist = [history, history[:3]]
    out = Sampler(params).sample(logits, hist)
    assert out.tokens.shape == (2,)
    assert bool(((out.tokens >= 0) & (out.tokens < vocab)).all()), out.tokens
    p = probs(logits, params, hist)
    assert bool(torch.isfinite(p).all()) and bool((p >= 0).all())
    torch.testing.assert_close(p.sum(dim=-1), torch.ones(2), atol=1e-5, rtol=0)
    if params.logprobs is not None:
        assert out.logprobs is not None and out.top_logprobs is not None
        assert not bool(out.logprobs.isnan().any()) and not bool(out.top_logprobs.isnan().any())
        assert bool(((out.top_ids >= 0) & (out.top_ids < vocab)).all())


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": 1e-300},
        {"repetition_penalty": 5e-324},
        {"temperature": 1e308, "logprobs": 20},
        {"temperature": 1e308},
        {"frequency_penalty": 1e308, "penalty_window": -1},
    ],
)
def test_issue_extremes(kwargs: dict) -> None:
    logits = _random_logits(1, 16, seed=1)
    out = Sampler(SamplingParams(**kwargs)).sample(logits, [list(range(16))])
    assert 0 <= int(out.tokens[0]) < 16
    assert bool(torch.isfinite(probs(logits, SamplingParams(**kwargs), [list(range(16))])).all())


# --- logit_bias (OpenAI) -----------------------------------------------------------------


def test_logit_bias_is_added_before_everything_else_greedy_too() -> None:
    logits = _random_logits(4, 50, seed=21)
    top = logits.argmax(dim=-1)
    # +100 on one token forces it, greedy or sampled, whatever the row.
    for temperature in (0.0, 1.0):
        forced = SamplingParams(temperature=temperature, seed=1, logit_bias={17: 100})
        assert Sampler(forced).sample(logits).tokens.tolist() == [17] * 4
    # -100 on every row's argmax forbids it: greedy takes the runner-up.
    runner_up = logits.topk(2, dim=-1).indices[:, 1]
    for row in range(4):
        banned = SamplingParams(temperature=0.0, logit_bias={int(top[row]): -100})
        assert int(sample(logits[row : row + 1], banned).tokens[0]) == int(runner_up[row])
    # The bias is an addition to the logit: probs equal those of biased logits.
    params = SamplingParams(top_k=10, logit_bias={3: 2.5, 40: -1.25})
    biased = logits.clone()
    biased[:, 3] += 2.5
    biased[:, 40] -= 1.25
    no_bias = replace(params, logit_bias=())
    torch.testing.assert_close(probs(logits, params), probs(biased, no_bias), rtol=0, atol=0)
    # Logprobs describe the biased distribution the token was drawn from.
    lp = token_logprobs(logits, replace(params, logprobs=2), top)
    want = token_logprobs(biased, replace(no_bias, logprobs=2), top)
    torch.testing.assert_close(lp.logprobs, want.logprobs, rtol=0, atol=0)


def test_a_banned_token_is_never_drawn() -> None:
    logits = torch.zeros(1, 4)
    logits[0, 2] = 5.0  # the favourite, ~95 % without the bias
    params = SamplingParams(seed=4, logit_bias={2: -100})
    tokens = Sampler(params).sample(logits.expand(20000, -1)).tokens
    assert not bool((tokens == 2).any())
    stat, df = _chi2(torch.bincount(tokens, minlength=4), probs(logits, params)[0])
    assert stat < _CHI2_CRIT_001[df]


def test_logit_bias_rows_do_not_depend_on_the_batch() -> None:
    """A row's result is the same alone as among others (continuous batching): its
    distribution, its greedy token and its logprobs."""
    logits = _random_logits(6, 300, seed=22, scale=2.0)
    params = SamplingParams(temperature=0.7, top_p=0.9, logprobs=3, logit_bias={7: 4.0, 99: -50})
    rows = [logits[i : i + 1] for i in range(6)]
    assert torch.equal(probs(logits, params), torch.cat([probs(r, params) for r in rows]))
    greedy = replace(params, temperature=0.0)
    together = sample(logits, greedy)
    alone = [sample(r, greedy) for r in rows]
    for name in ("tokens", "logprobs", "top_ids", "top_logprobs"):
        joined = torch.cat([getattr(a, name) for a in alone])
        assert torch.equal(getattr(together, name), joined), name


def test_logit_bias_wire_form_and_vocabulary() -> None:
    params = SamplingParams(temperature=0, logit_bias={"12": 5, 3: -100.0})
    assert params.logit_bias == ((3, -100.0), (12, 5.0))
    wire = params.to_wire()
    assert wire == {"temperature": 0, "logit_bias": {"3": -100.0, "12": 5.0}}
    assert SamplingParams.from_wire(wire) == params
    assert SamplingParams().to_wire() == {}
    with pytest.raises(ValueError, match=r"logit_bias names token 50, outside \[0, 50\)"):
        sample(torch.zeros(1, 50), SamplingParams(logit_bias={50: 1.0}))
