"""Every family on tiny random models vs transformers holding the very same weights.

luced.runtime.tiny writes the GGUF as llama.cpp would and returns the transformers twin's
config and exactly the dequantized weights (tests/tiny_hf.py builds the model), so the
comparison is like for like in float32.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_hf import hf_config, hf_model

from luced.engine.placement import layer_ranges
from luced.gguf_file import GGUFFile
from luced.runtime.model import Model
from luced.runtime.tiny import TinyModel, make_tiny_gguf

VARIANTS = {
    "llama": ("llama", {}),
    "llama-untied": ("llama", {"tied": False}),
    "llama3-rope": ("llama", {"rope_scaling": "llama3", "tied": False}),
    "qwen3": ("qwen3", {}),
    "gemma3": ("gemma3", {}),
    "qwen3moe": ("qwen3moe", {}),
    # 4 layers: full (YaRN, dense FFN), then 3 sliding (plain RoPE, experts + shared expert)
    "laguna": ("laguna", {}),
    # Laguna-M.1's shape: no sliding window, one gate per element, more leading dense layers
    "laguna-m1": ("laguna", {"sliding_window": 0, "gating": "per-element", "dense_layers": 2}),
    "qwen35": ("qwen35", {}),  # 3 DeltaNet layers, then full attention
    "qwen35-kv": ("qwen35", {"linear_v_heads": 4, "tied": True}),  # V heads reordered
    # The same hybrid stack, experts + gated shared expert in every layer (8 experts, top 2)
    "qwen35moe": ("qwen35moe", {}),
    "qwen35moe-kv": ("qwen35moe", {"linear_v_heads": 4, "experts_used": 3, "layers": 5}),
    # S S F S S F; the second period shares (3 and 4 read 1's KV, 5 reads 2's); K = V on full
    # layers, PLE.
    "gemma4": ("gemma4", {}),
    # The same sharing with double-wide MLPs in the shared layers, V projected, untied.
    "gemma4-kv": ("gemma4", {"k_eq_v": False, "double_wide": True, "tied": False}),
    # The MoE block beside every dense MLP: 8 GeGLU experts, top 2, per-expert scales
    "gemma4-moe": ("gemma4", {"experts": 8, "experts_used": 2, "expert_ffn": 32}),
    # Nothing shared, no per-layer embeddings, no softcap. (transformers' generate fails on
    # KV sharing without PLE: _maybe_slice_kv_shared_inputs slices per_layer_inputs = None.)
    "gemma4-plain": (
        "gemma4",
        {"swa_period": 2, "layers": 5, "shared_layers": 0, "ple_dim": 0, "final_softcap": None},
    ),
}
# Gemma's and Laguna's tiny windows are 8: the 24-token prompt runs well past them.
PROMPTS = [[1, 5, 9, 200, 300], list(range(40, 64)), [7] * 3 + list(range(100, 112))]


def max_rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours - ref).abs().max() / ref.abs().max())


def greedy_hf(hf, ids: list[int], n: int) -> list[int]:
    out = hf.generate(
        torch.tensor([ids]),
        max_new_tokens=n,
        min_new_tokens=n,
        do_sample=False,
        pad_token_id=0,
    )
    return out[0, len(ids) :].tolist()


def greedy_ours(model: Model, ids: list[int], n: int) -> list[int]:
    cache = model.new_cache(len(ids) + n)
    logits = model.forward(torch.tensor(ids), cache, 0)
    out = []
    for _ in range(n):
        out.append(int(logits[-1].argmax()))
        logits = model.forward(torch.tensor(out[-1:]), cache, len(ids) + len(out) - 1)
    return out


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def tiny(request, tmp_path_factory) -> TinyModel:
    family, overrides = VARIANTS[request.param]
    path = tmp_path_factory.mktemp("tiny") / f"{request.param}.gguf"
    return make_tiny_gguf(family, path, seed=3, **overrides)


def test_logits_match_transformers(tiny) -> None:
    hf = hf_model(tiny)
    ours = Model.load(tiny.path)
    for ids in PROMPTS:
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0].float()
        got = ours.forward(torch.tensor(ids), ours.new_cache(64), 0)
        assert max_rel_err(got, ref) <= 1e-4, ids


def test_greedy_matches_transformers(tiny) -> None:
    hf = hf_model(tiny)
    ours = Model.load(tiny.path)
    for ids in PROMPTS[:2]:
        assert greedy_ours(ours, ids, 32) == greedy_hf(hf, ids, 32)


def test_layer_ranges_chain_to_the_whole_model(tiny) -> None:
    """Shards loaded by range hold only their tensors and chain to the unsplit result. The
    cut is the planner's for two equal shards: it keeps KV-sharing layers with their sources."""
    whole = Model.load(tiny.path)
    n = whole.cfg.n_layers
    (_, cut), _ = layer_ranges(n, 2, kv_sources=GGUFFile(tiny.path).kv_sources())
    first, second = Model.load(tiny.path, layers=(0, cut)), Model.load(tiny.path, layers=(cut, n))
    assert first.owns_embed and not first.owns_head
    assert not second.owns_embed and second.owns_head
    assert all(k.split(".")[0] not in {str(i) for i in range(cut, n)} for k in first.weights)
    assert "head" not in first.weights
    if not getattr(whole.cfg, "ple_dim", 0):  # per-layer embeddings read the token embedding
        assert "tok_embd" not in second.weights
    ids = torch.tensor(PROMPTS[1])
    c1, c2 = first.new_cache(64), second.new_cache(64)
    h, _ = first.forward_layers(first.embed(ids), c1, 0, ids=ids)
    h, _ = second.forward_layers(h, c2, 0, ids=ids)
    torch.testing.assert_close(
        second.logits(h), whole.forward(ids, whole.new_cache(64), 0), rtol=0, atol=0
    )


def test_captures_are_layer_outputs(tiny) -> None:
    """A capture of layer L is HF's hidden_states[L + 1] (the residual after L's FFN)."""
    model = Model.load(tiny.path)
    last = model.cfg.n_layers - 1
    ids = torch.tensor(PROMPTS[0])
    cache = model.new_cache(64)
    _, caps = model.forward_layers(model.embed(ids), cache, 0, capture={0, last}, ids=ids)
    with torch.no_grad():
        states = hf_model(tiny)(ids[None], output_hidden_states=True).hidden_states
    torch.testing.assert_close(caps[0], states[1][0], rtol=1e-4, atol=1e-5)
    assert set(caps) == {0, last}


@pytest.mark.parametrize(
    "qtype", ["F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q4_K", "Q5_K", "Q6_K"]
)
def test_quant_types_dequantize_like_transformers(qtype: str, tmp_path: Path) -> None:
    tiny = make_tiny_gguf("llama", tmp_path / f"{qtype}.gguf", seed=1, qtype=qtype)
    ids = PROMPTS[0]
    with torch.no_grad():
        ref = hf_model(tiny)(torch.tensor([ids])).logits[0].float()
    ours = Model.load(tiny.path)
    got = ours.forward(torch.tensor(ids), ours.new_cache(16), 0)
    assert max_rel_err(got, ref) <= 1e-4


@pytest.mark.parametrize(
    ("family", "qtype"),
    [
        ("qwen3moe", "Q8_0"),
        ("qwen3moe", "Q5_K"),
        ("laguna", "Q4_1"),
        ("laguna", "Q4_K"),
        ("qwen35moe", "Q8_0"),
        ("qwen35moe", "Q4_K"),
    ],
)
def test_quantized_experts_dequantize_like_transformers(family, qtype, tmp_path: Path) -> None:
    """3-D expert stacks load from quantized blocks as the twin holds them."""
    tiny = make_tiny_gguf(family, tmp_path / f"{qtype}.gguf", seed=1, qtype=qtype)
    ids = PROMPTS[1]
    with torch.no_grad():
        ref = hf_model(tiny)(torch.tensor([ids])).logits[0].float()
    ours = Model.load(tiny.path)
    got = ours.forward(torch.tensor(ids), ours.new_cache(32), 0)
    assert max_rel_err(got, ref) <= 1e-4


# Seed 4: at seeds 2 and 3 some token's top experts tie to a few digits (qwen3moe, and laguna
# in bfloat16), so half precision routes it elsewhere and its logits move by up to 50%: a
# property of top-k routing, not an error.
@pytest.mark.parametrize("family", ["qwen3", "laguna"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_reduced_precision_stays_close(family: str, dtype: str, tmp_path: Path) -> None:
    tiny = make_tiny_gguf(family, tmp_path / "q.gguf", seed=4)
    ids = torch.tensor(PROMPTS[1])
    full = Model.load(tiny.path)
    half = Model.load(tiny.path, dtype=dtype)
    assert half.weights["0.attn_q"].dtype == getattr(torch, dtype)
    a = full.forward(ids, full.new_cache(32), 0)
    b = half.forward(ids, half.new_cache(32), 0)
    assert max_rel_err(b, a) < 0.05
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.8


# -- gemma4 ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gemma4(tmp_path_factory) -> TinyModel:
    return make_tiny_gguf("gemma4", tmp_path_factory.mktemp("g4") / "g4.gguf", seed=3)


def test_gemma4_tiny_has_every_layer_kind(gemma4) -> None:
    cfg = Model.load(gemma4.path).cfg
    assert cfg.sliding_layers == (True, True, False, True, True, False)
    assert [cfg.kv_source(i) for i in range(6)] == [0, 1, 2, 1, 1, 2]  # HF: store 1, 2; reuse 3-5
    assert hf_config(gemma4).kv_sharing_modes == [None, "store", "store", *["reuse"] * 3]
    assert [cfg.kv_shape(i) for i in (0, 2)] == [(2, 16), (1, 32)]
    assert cfg.k_eq_v == (False, False, True, False, False, False)
    assert cfg.ple_dim == 32 and cfg.final_softcap == 30.0
    cache = Model.load(gemma4.path).new_cache(16)
    assert cache.stored == (0, 1, 2) and cache.sources == {3: 1, 4: 1, 5: 2}


def test_gemma4_refuses_a_range_that_separates_sharing_layers(gemma4) -> None:
    with pytest.raises(ValueError, match=r"\[2, 6\) separates layer 3 from layer 1"):
        Model.load(gemma4.path, layers=(2, 6))
    shard = Model.load(gemma4.path, layers=(1, 6))  # legal: 1 and 2 come along
    assert "4.attn_k" not in shard.weights and "2.attn_v" not in shard.weights  # shared; K = V
    with pytest.raises(ValueError, match="need the token ids in every shard"):
        shard.forward_layers(torch.zeros(3, 64), shard.new_cache(8), 0)


def test_gemma4_decode_steps_match_one_prefill(gemma4) -> None:
    """Shared layers read rows their source wrote in the same forward, and older ones."""
    model, ids = Model.load(gemma4.path), torch.tensor(PROMPTS[1])
    whole = model.forward(ids, model.new_cache(32), 0)
    cache = model.new_cache(32)
    steps = [model.forward(ids[:16], cache, 0)]
    steps += [model.forward(ids[i : i + 1], cache, i) for i in range(16, len(ids))]
    torch.testing.assert_close(torch.cat(steps), whole, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "qtype", ["F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q4_K", "Q5_K", "Q6_K"]
)
def test_gemma4_quant_types(qtype: str, tmp_path: Path) -> None:
    tiny = make_tiny_gguf("gemma4", tmp_path / f"{qtype}.gguf", seed=1, qtype=qtype)
    ids = PROMPTS[1]
    with torch.no_grad():
        ref = hf_model(tiny)(torch.tensor([ids])).logits[0].float()
    ours = Model.load(tiny.path)
    got = ours.forward(torch.tensor(ids), ours.new_cache(32), 0)
    assert max_rel_err(got, ref) <= 1e-4
