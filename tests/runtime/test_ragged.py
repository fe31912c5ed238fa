"""A ragged batch (several sequences in one forward) against each sequence run alone."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from luced.runtime.model import Model
from luced.runtime.ragged import Ragged, Span
from luced.runtime.tiny import DECODERS, make_tiny_gguf

# Three sequences at different points: a prefill chunk after a short history, one decode
# token deep into its context, and a verify-sized block; their histories differ too.
HISTORIES = [4, 37, 12]
FEEDS = [9, 1, 6]


def _prompts(vocab: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [
        torch.randint(3, vocab, (h + f,), generator=g)
        for h, f in zip(HISTORIES, FEEDS, strict=True)
    ]


def _primed(model: Model, prompts: list[torch.Tensor]) -> list:
    caches = [model.new_cache(64) for _ in prompts]
    for c, p, h in zip(caches, prompts, HISTORIES, strict=True):
        model.forward(p[:h], c, 0)
    return caches


def _alone_and_batched(model: Model, prompts: list[torch.Tensor]):
    alone_caches, batch_caches = _primed(model, prompts), _primed(model, prompts)
    alone = [
        model.forward(p[h:], c, h) for p, c, h in zip(prompts, alone_caches, HISTORIES, strict=True)
    ]
    feeds = [p[h:] for p, h in zip(prompts, HISTORIES, strict=True)]
    batched = model.forward_batch(feeds, batch_caches, HISTORIES)
    return alone, batched, alone_caches, batch_caches


@pytest.mark.parametrize("family", sorted(DECODERS))
def test_batched_equals_alone_for_every_family(tmp_path: Path, family: str) -> None:
    """Each sequence's logits in the batch are its logits alone (float32: within the dense
    matmuls' rounding, 1e-4 as against transformers), and each cache comes out as if it ran
    alone: the next decode step from it gives the same logits."""
    tiny = make_tiny_gguf(family, tmp_path / "m.gguf", seed=5)
    model = Model.load(tiny.path)
    prompts = _prompts(model.cfg.vocab)
    alone, batched, alone_caches, batch_caches = _alone_and_batched(model, prompts)
    for a, b in zip(alone, batched, strict=True):
        assert a.shape == b.shape
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
        assert torch.equal(a.argmax(-1), b.argmax(-1))
    for c_alone, c_batch, p in zip(alone_caches, batch_caches, prompts, strict=True):
        assert c_alone.pos == c_batch.pos == len(p)
        nxt = torch.tensor([5])
        torch.testing.assert_close(
            model.forward(nxt, c_batch, len(p)),
            model.forward(nxt, c_alone, len(p)),
            rtol=1e-4,
            atol=1e-4,
        )


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_batched_equals_alone_exactly_under_packed_weights(tmp_path: Path, family: str) -> None:
    """The packed kernels are batch-invariant up to 64 rows and attention runs per sequence,
    so under int4 weights a batch gives every sequence its very logits alone."""
    tiny = make_tiny_gguf(family, tmp_path / "m.gguf", seed=5, qtype="Q4_0")
    model = Model.load(tiny.path, weights="int4")
    alone, batched, *_ = _alone_and_batched(model, _prompts(model.cfg.vocab))
    for a, b in zip(alone, batched, strict=True):
        assert torch.equal(a, b)


def test_a_batch_is_refused_when_malformed(tmp_path: Path) -> None:
    tiny = make_tiny_gguf("llama", tmp_path / "m.gguf", seed=5)
    model = Model.load(tiny.path)
    cache = model.new_cache(64)
    with pytest.raises(ValueError, match="at least one sequence"):
        Ragged([])
    with pytest.raises(ValueError, match="twice"):
        Ragged([Span(cache, 0, 1), Span(cache, 1, 1)])
    with pytest.raises(ValueError, match="at least one token"):
        Ragged([Span(cache, 0, 0)])
    assert cache.pos == 0
