"""The encoder families (`bert`, `nomic-bert`) on tiny random models against transformers'
BertModel / NomicBertModel holding the very same weights: every position's last-layer state
(`Model.final_hidden`, what embeddings pool), alone and in a ragged batch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_hf import hf_model

from luced.runtime.model import Model
from luced.runtime.ragged import Ragged, Span
from luced.runtime.tiny import ENCODERS, TinyModel, make_tiny_gguf

INPUTS = [[2, 40, 41, 42, 3], [2, *range(10, 90), 3], [2, 7, 3]]


def states(model: Model, ids: list[int]) -> torch.Tensor:
    h, _ = model.forward_layers(model.embed(torch.tensor(ids)), model.new_cache(128), 0)
    return model.final_hidden(h)


def reference(tiny: TinyModel, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(tiny)(torch.tensor([ids])).last_hidden_state[0]


@pytest.mark.parametrize("family", ENCODERS)
@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
def test_states_equal_transformers(tmp_path: Path, family: str, qtype: str) -> None:
    tiny = make_tiny_gguf(family, tmp_path / "m.gguf", seed=4, qtype=qtype)
    model = Model.load(tiny.path)
    assert model.cfg.vocab == tiny.spec.vocab_size
    for ids in INPUTS:
        torch.testing.assert_close(states(model, ids), reference(tiny, ids), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", ENCODERS)
def test_a_ragged_batch_gives_each_input_its_states_alone(tmp_path: Path, family: str) -> None:
    model = Model.load(make_tiny_gguf(family, tmp_path / "m.gguf", seed=5).path)
    caches = [model.new_cache(128) for _ in INPUTS]
    batch = Ragged([Span(c, 0, len(ids)) for c, ids in zip(caches, INPUTS, strict=True)])
    flat = torch.tensor([t for ids in INPUTS for t in ids])
    h, _ = model.forward_layers(model.embed(flat), batch, batch)
    for got, ids in zip(model.final_hidden(h).split(batch.sizes), INPUTS, strict=True):
        torch.testing.assert_close(got, states(model, ids), rtol=1e-5, atol=1e-5)
    assert [c.pos for c in caches] == [len(ids) for ids in INPUTS]


def test_packed_weights_stay_close(tmp_path: Path) -> None:
    path = make_tiny_gguf("bert", tmp_path / "m.gguf", seed=6, qtype="Q8_0").path
    exact, packed = Model.load(path), Model.load(path, weights="int8")
    want, got = states(exact, INPUTS[1]), states(packed, INPUTS[1])
    assert (got - want).norm() / want.norm() < 0.05


def test_an_input_is_encoded_whole_and_there_is_no_head(tmp_path: Path) -> None:
    """Attention sees the whole input, so a span past position 0 (a chunk of a longer
    input) cannot be right: it is refused. And an encoder has no logits to give."""
    model = Model.load(make_tiny_gguf("bert", tmp_path / "m.gguf", seed=7).path)
    cache = model.new_cache(64)
    ids = torch.tensor(INPUTS[0])
    model.forward_layers(model.embed(ids), cache, 0)
    with pytest.raises(ValueError, match="in one span from position 0"):
        model.forward_layers(model.embed(ids), cache, len(ids))
    with pytest.raises(ValueError, match="without an LM head"):
        model.logits(torch.zeros(1, model.cfg.hidden))
