"""A grammar's bitmask in the worker: its logit bias bit for bit (numpy's unpackbits as
the oracle), and the sampler never draws, nor gives probability to, a masked token."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from luced.runtime import token_mask
from luced.runtime.sampler import Sampler, probs, sample, token_logprobs
from luced.sampling_params import SamplingParams

VOCAB = 70  # not a multiple of 32: the last word is partly padding


def random_mask(rows: int, seed: int) -> tuple[torch.Tensor, np.ndarray]:
    """(int32 words [rows, 3], the same mask as bool [rows, VOCAB])."""
    rng = np.random.default_rng(seed)
    words = rng.integers(-(2**31), 2**31, size=(rows, 3), dtype=np.int64).astype(np.int32)
    bits = np.unpackbits(words.view(np.uint8), bitorder="little").reshape(rows, -1)
    return torch.from_numpy(words), bits[:, :VOCAB].astype(bool)


def test_bias_matches_numpy() -> None:
    words, expected = random_mask(5, seed=0)
    bias = token_mask.bias(words, VOCAB).numpy()
    assert bias.shape == (5, VOCAB) and np.array_equal(bias == 0, expected)
    assert np.all(bias[~expected] == -np.inf)


def test_sampling_stays_inside_the_mask() -> None:
    words, _ = random_mask(4, seed=1)
    bias = token_mask.bias(words, VOCAB)
    allowed = bias == 0
    logits = torch.randn(4, VOCAB) * 5
    greedy = sample(logits, SamplingParams(temperature=0), bias=bias).tokens
    expected = logits.masked_fill(~allowed, -torch.inf).argmax(-1)
    assert torch.equal(greedy, expected)
    params = SamplingParams(temperature=1.5, top_k=20, repetition_penalty=1.2, seed=3)
    history = [[1, 2, 3]] * 4
    p = probs(logits, params, history, bias)
    assert float(p[~allowed].abs().sum()) == 0 and torch.allclose(p.sum(-1), torch.ones(4))
    sampler = Sampler(dataclasses.replace(params, logprobs=2))
    for _ in range(50):
        out = sampler.sample(logits, history, bias)
        assert bool(allowed[torch.arange(4), out.tokens].all())
        # Logprobs of the masked distribution: the allowed tokens hold all the mass.
        assert out.top_ids is not None and bool(allowed.gather(1, out.top_ids).all())
    again = token_logprobs(logits, sampler.params, out.tokens, history, bias)
    assert torch.equal(again.logprobs, out.logprobs)
