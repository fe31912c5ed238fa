"""luced.runtime.tiny: the GGUF says what llama.cpp's converter would, and transformers' GGUF
loader (which undoes llama.cpp's conventions on its own) reads back exactly our state dict; the
command (tools/make_tiny_gguf.py) needs nothing beyond the runtime's dependencies."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as Q
from tiny_hf import GGUF_LOADER_GAPS, gguf_loader_kwargs, hf_config, hf_model

from luced.runtime.tiny import FAMILIES, QTYPES, TinyModel, TinySpec, gemma4, make_tiny_gguf, moe
from luced.runtime.tiny.cli import gguf_main
from luced.runtime.tiny.vocab import make_vocab

ROOT = Path(__file__).resolve().parents[3]

VARIANTS = {
    "llama": ("llama", {}),
    "llama3-untied": ("llama", {"rope_scaling": "llama3", "tied": False}),
    "qwen3": ("qwen3", {}),
    "gemma3": ("gemma3", {}),
    "qwen3moe": ("qwen3moe", {}),
    "laguna": ("laguna", {}),
    "laguna-m1": ("laguna", {"sliding_window": 0, "gating": "per-element", "dense_layers": 2}),
}
# transformers' GGUF loader has no laguna: its twin is checked against the file directly.
TRANSFORMERS_READS = [f for f in FAMILIES if f in GGUF_LOADER_GAPS]
# 16 positions: longer than gemma3's sliding window of 8.
IDS = torch.tensor([[2, 5, 17, 200, 33, 9, 100, 250, 7, 8, 44, 300, 12, 13, 400, 3]])


def _build(tmp: Path, family: str, **kw) -> TinyModel:
    return make_tiny_gguf(family, tmp / f"{family}.gguf", **kw)


def _from_gguf(tiny: TinyModel):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        tiny.path.parent,
        gguf_file=tiny.path.name,
        dtype=torch.float32,
        attn_implementation="eager",
        **gguf_loader_kwargs(tiny),
    )
    return model.eval()


def _reader(tiny: TinyModel) -> gguf.GGUFReader:
    return gguf.GGUFReader(tiny.path)


def _needs_transformers_gguf(tiny: TinyModel) -> None:
    if tiny.family not in TRANSFORMERS_READS:
        pytest.skip(f"transformers cannot read {tiny.family} GGUF files")


def _tensor(reader: gguf.GGUFReader, name: str) -> np.ndarray:
    t = next(t for t in reader.tensors if t.name == name)
    return gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape.tolist())))


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request, tmp_path_factory) -> TinyModel:
    family, overrides = VARIANTS[request.param]
    return _build(tmp_path_factory.mktemp(request.param), family, seed=3, **overrides)


def test_transformers_reads_our_weights_and_logits(variant):
    _needs_transformers_gguf(variant)
    loaded = _from_gguf(variant)
    theirs = loaded.state_dict()
    assert sorted(theirs) == sorted(variant.state_dict)
    for name, ours in variant.state_dict.items():
        assert torch.equal(theirs[name], ours), name
    with torch.no_grad():
        expected = hf_model(variant)(IDS).logits
        got = loaded(IDS).logits
    assert expected.std() > 1.0  # logits spread out, so greedy tests are not decided by noise
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


CONFIG_FIELDS = """vocab_size hidden_size intermediate_size num_hidden_layers num_attention_heads
    num_key_value_heads max_position_embeddings rms_norm_eps tie_word_embeddings
    bos_token_id eos_token_id pad_token_id"""


def test_transformers_reads_our_config_from_metadata(variant):
    from transformers import AutoConfig

    _needs_transformers_gguf(variant)
    read = AutoConfig.from_pretrained(variant.path.parent, gguf_file=variant.path.name)
    ours = hf_config(variant)
    fields = CONFIG_FIELDS.split()
    if variant.family == "gemma3":
        fields += ["sliding_window", "layer_types", "rope_parameters", "head_dim"]
    if variant.family == "llama":
        fields += ["head_dim"]
    if variant.family == "qwen3moe":
        fields += ["head_dim", "num_experts", "num_experts_per_tok", "norm_topk_prob"]
    for name in fields:
        assert getattr(read, name) == getattr(ours, name), name
    if variant.family != "gemma3":
        assert read.rope_parameters["rope_theta"] == ours.rope_parameters["rope_theta"]
    # The loader's known gaps; if one closes, drop it from GGUF_LOADER_GAPS.
    gaps = GGUF_LOADER_GAPS[variant.family]
    if variant.family == "llama" and variant.spec.rope_scaling is None:
        gaps = ()  # default rope: nothing lost
    for name in gaps:
        assert getattr(read, name) != getattr(ours, name), f"transformers now reads {name}"


# Keys as convert_hf_to_gguf.py writes them ({a} = the architecture).
EXPECTED_KEYS = {
    "common": """general.architecture general.type general.name general.file_type
        general.quantization_version {a}.block_count {a}.context_length {a}.embedding_length
        {a}.feed_forward_length {a}.attention.head_count {a}.attention.head_count_kv
        {a}.rope.freq_base {a}.attention.layer_norm_rms_epsilon {a}.attention.key_length
        {a}.attention.value_length tokenizer.ggml.model tokenizer.ggml.pre tokenizer.ggml.tokens
        tokenizer.ggml.token_type tokenizer.ggml.bos_token_id tokenizer.ggml.eos_token_id
        tokenizer.ggml.padding_token_id tokenizer.ggml.add_bos_token""",
    "llama": """llama.vocab_size llama.rope.dimension_count tokenizer.ggml.merges
        tokenizer.ggml.unknown_token_id tokenizer.ggml.add_space_prefix tokenizer.chat_template""",
    "qwen3": "tokenizer.ggml.merges tokenizer.chat_template",
    "gemma3": """gemma3.attention.sliding_window gemma3.rope.freq_base_swa tokenizer.ggml.scores
        tokenizer.ggml.unknown_token_id tokenizer.ggml.add_eos_token
        tokenizer.ggml.add_space_prefix""",
    "qwen3moe": """qwen3moe.expert_count qwen3moe.expert_used_count
        qwen3moe.expert_feed_forward_length tokenizer.ggml.merges tokenizer.chat_template""",
    "laguna": """laguna.expert_count laguna.expert_used_count laguna.rope.scaling.type
        laguna.rope.scaling.factor laguna.rope.scaling.original_context_length laguna.vocab_size
        laguna.expert_feed_forward_length laguna.expert_shared_feed_forward_length
        laguna.expert_weights_norm laguna.expert_weights_scale laguna.expert_gating_func
        laguna.leading_dense_block_count laguna.rope.dimension_count tokenizer.ggml.merges
        tokenizer.chat_template""",
}
LAGUNA_SWA_KEYS = """laguna.rope.freq_base_swa laguna.attention.sliding_window
    laguna.rope.dimension_count_swa"""
_LLAMA_LAYER = "attn_norm attn_q attn_k attn_v attn_output ffn_norm ffn_gate ffn_up ffn_down"
_EXPERTS = "ffn_gate_inp ffn_gate_exps ffn_up_exps ffn_down_exps"
_LAGUNA_ATTN = (
    "attn_norm attn_q attn_k attn_v attn_output attn_q_norm attn_k_norm attn_gate ffn_norm"
)
LAYER_TENSORS = {
    "llama": _LLAMA_LAYER,
    "qwen3": _LLAMA_LAYER + " attn_q_norm attn_k_norm",
    "gemma3": _LLAMA_LAYER + " attn_q_norm attn_k_norm post_attention_norm post_ffw_norm",
    "qwen3moe": "attn_norm attn_q attn_k attn_v attn_output attn_q_norm attn_k_norm ffn_norm "
    + _EXPERTS,
}


def _layer_tensors(spec: TinySpec, layer: int) -> set[str]:
    if spec.family != "laguna":
        return {f"{t}.weight" for t in LAYER_TENSORS[spec.family].split()}
    if layer < spec.dense_layers:
        names = f"{_LAGUNA_ATTN} ffn_gate ffn_up ffn_down"
    else:
        names = f"{_LAGUNA_ATTN} {_EXPERTS} ffn_gate_shexp ffn_up_shexp ffn_down_shexp"
    tensors = {f"{t}.weight" for t in names.split()}
    return tensors if layer < spec.dense_layers else tensors | {"exp_probs_b.bias"}


def test_metadata_keys_and_tensor_names(variant):
    reader = _reader(variant)
    fam = variant.family
    keys = {k for k in reader.fields if not k.startswith("GGUF.")}
    expected = {k.format(a=fam) for k in f"{EXPECTED_KEYS['common']} {EXPECTED_KEYS[fam]}".split()}
    if fam == "laguna" and variant.spec.sliding_window:
        expected |= set(LAGUNA_SWA_KEYS.split())
    assert keys == expected
    names = {t.name for t in reader.tensors}
    want = {"token_embd.weight", "output_norm.weight"}
    want |= {
        f"blk.{i}.{t}" for i in range(variant.spec.layers) for t in _layer_tensors(variant.spec, i)
    }
    if not variant.spec.tied:
        want.add("output.weight")  # llama.cpp omits it when the head is tied
    if variant.spec.rope_scaling == "llama3":
        want.add("rope_freqs.weight")
    assert names == want
    for t in reader.tensors:  # 1-D tensors (norms, rope factors) stay F32 whatever the qtype
        assert t.tensor_type == Q.F32 or len(t.shape) >= 2, t.name


def test_llama_qk_rows_are_permuted_like_llama_cpp(tmp_path):
    tiny = _build(tmp_path, "llama")
    reader, d = _reader(tiny), tiny.spec.head_dim
    for name, heads in (("q", tiny.spec.heads), ("k", tiny.spec.kv_heads)):
        stored = _tensor(reader, f"blk.1.attn_{name}.weight")
        hf = tiny.state_dict[f"model.layers.1.self_attn.{name}_proj.weight"].numpy()
        for h in range(heads):  # GGUF row 2i / 2i+1 of a head = HF row i / i + d/2
            np.testing.assert_array_equal(
                stored[h * d : (h + 1) * d : 2], hf[h * d : h * d + d // 2]
            )
            np.testing.assert_array_equal(
                stored[h * d + 1 : (h + 1) * d : 2], hf[h * d + d // 2 : (h + 1) * d]
            )
    v = _tensor(reader, "blk.1.attn_v.weight")  # V is not permuted
    np.testing.assert_array_equal(
        v, tiny.state_dict["model.layers.1.self_attn.v_proj.weight"].numpy()
    )


def test_gemma3_norms_stored_as_one_plus_w(tmp_path):
    tiny = _build(tmp_path, "gemma3")
    reader = _reader(tiny)
    pairs = {
        "output_norm": "model.norm",
        "blk.5.attn_q_norm": "model.layers.5.self_attn.q_norm",
        "blk.0.post_ffw_norm": "model.layers.0.post_feedforward_layernorm",
    }
    for gguf_name, hf_name in pairs.items():
        stored = _tensor(reader, f"{gguf_name}.weight")
        np.testing.assert_array_equal(stored, tiny.state_dict[f"{hf_name}.weight"].numpy() + 1)
    layer_types = hf_config(tiny).layer_types  # llama.cpp: global iff i % 6 == 5
    assert layer_types == ["sliding_attention"] * 5 + ["full_attention"]
    assert hf_config(tiny).sliding_window == 8 < IDS.shape[1]
    assert hf_config(tiny).query_pre_attn_scalar == tiny.spec.head_dim


def test_llama3_rope_freqs_match_transformers_scaling(tmp_path):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    tiny = _build(tmp_path, "llama", rope_scaling="llama3")
    factors = _tensor(_reader(tiny), "rope_freqs.weight")
    assert factors.shape == (tiny.spec.head_dim // 2,)
    # All three regimes of Llama-3 scaling occur: unscaled, fully scaled, and smoothed.
    assert 1.0 in factors and 8.0 in factors and ((factors > 1) & (factors < 8)).any()
    d = tiny.spec.head_dim
    base = 1.0 / (tiny.spec.rope_base ** (np.arange(0, d, 2, dtype=np.float32) / d))
    inv_freq, scale = ROPE_INIT_FUNCTIONS["llama3"](hf_config(tiny), "cpu")
    assert scale == 1.0
    # llama.cpp divides each pair's angle by its factor; transformers scales inv_freq.
    np.testing.assert_allclose(base / factors, inv_freq.numpy(), rtol=1e-6)


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path):
    a = _build(tmp_path / "a", "qwen3", seed=7)
    b = _build(tmp_path / "b", "qwen3", seed=7)
    c = _build(tmp_path / "c", "qwen3", seed=8)
    digest = lambda t: hashlib.sha256(t.path.read_bytes()).hexdigest()  # noqa: E731
    assert digest(a) == digest(b)
    assert digest(a) != digest(c)
    for name, w in a.state_dict.items():
        assert torch.equal(w, b.state_dict[name])
        assert not torch.equal(w, c.state_dict[name]), name
    assert a.path.stat().st_size == c.path.stat().st_size  # same layout, other numbers


@pytest.mark.parametrize(
    ("qtype", "family"),
    [
        ("F16", "llama"),
        ("BF16", "gemma3"),
        ("Q8_0", "llama"),
        ("Q4_0", "qwen3"),
        ("Q4_1", "llama"),
        ("Q5_0", "gemma3"),
        ("Q4_K", "llama"),
        ("Q5_K", "qwen3"),
        ("Q6_K", "gemma3"),
    ],
)
def test_qtype_stores_every_matrix_and_state_dict_is_its_dequantization(tmp_path, qtype, family):
    tiny = _build(tmp_path, family, qtype=qtype)
    reader = _reader(tiny)
    ggml_type, file_type, block = QTYPES[qtype]
    assert reader.fields["general.file_type"].contents() == int(file_type)
    matrices = [t for t in reader.tensors if len(t.shape) == 2]
    assert len(matrices) >= 7 * tiny.spec.layers + 1
    for t in reader.tensors:
        assert t.tensor_type == (ggml_type if len(t.shape) == 2 else Q.F32), t.name
    if block == 256:
        assert tiny.spec.hidden == 256 and tiny.spec.ffn % 256 == 0
    theirs = _from_gguf(tiny).state_dict()
    for name, ours in tiny.state_dict.items():
        assert torch.isfinite(ours).all(), name
        assert torch.equal(theirs[name], ours), name
    w = tiny.state_dict["model.layers.0.mlp.up_proj.weight"]
    assert 0.3 < w.std().item() * tiny.spec.hidden**0.5 < 3  # sensible scale, also for K-quants


def test_kquant_rows_must_be_multiples_of_256(tmp_path):
    with pytest.raises(ValueError, match="multiples of 256"):
        _build(tmp_path, "llama", qtype="Q4_K", hidden=64)
    with pytest.raises(ValueError, match="multiples of 32"):
        _build(tmp_path, "qwen3", qtype="Q8_0", ffn=100)


@pytest.mark.parametrize("family", TRANSFORMERS_READS)
def test_transformers_tokenizer_from_gguf(tmp_path, family):
    from transformers import AutoTokenizer

    # transformers' GGUF config reader takes no per-layer head_count_kv (gemma4 with K = V).
    tiny = _build(tmp_path, family, **({"k_eq_v": False} if family == "gemma4" else {}))
    tok = AutoTokenizer.from_pretrained(tmp_path, gguf_file=tiny.path.name)
    text = "Hello world! The quick brown fox, 42 tokens.\n  def f(x): return x * 2"
    ids = tok.encode(text)
    assert len(tok) == tiny.spec.vocab_size
    assert 0 < len(ids) < len(text.encode())  # merges fire
    assert tok.decode(ids, skip_special_tokens=True) == text
    # add_bos only there: gemma4 files say add_bos too, but transformers follows the reference
    # tokenizer (the chat template writes <bos>), while llama.cpp forces BOS on.
    assert (ids[0] == hf_config(tiny).bos_token_id) == (family == "gemma3")
    gemma = family in ("gemma3", "gemma4")
    if gemma:
        assert tok.convert_tokens_to_ids(["<start_of_turn>", "<end_of_turn>"]) == [5, 6]
        assert tok.encode("é", add_special_tokens=False) == [9 + 0xC3, 9 + 0xA9]  # byte fallback
    else:
        assert tok.encode("<|im_end|>", add_special_tokens=False) == [hf_config(tiny).eos_token_id]
        chat = tok.apply_chat_template(
            [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
        )
        assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_cli_writes_gguf_and_hf_dir(tmp_path):
    from transformers import AutoModelForCausalLM

    out, hf_dir = tmp_path / "cli.gguf", tmp_path / "hf"
    gguf_main(
        [
            "gemma3",
            str(out),
            "--seed",
            "5",
            "--qtype",
            "Q8_0",
            "--hf-dir",
            str(hf_dir),
            "--set",
            "layers=7",
            "--set",
            "sliding_window=4",
        ]
    )
    again = _build(tmp_path / "again", "gemma3", seed=5, qtype="Q8_0", layers=7, sliding_window=4)
    assert out.read_bytes() == again.path.read_bytes()
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    assert model.config.layer_types[5:] == ["full_attention", "sliding_attention"]
    for name, w in model.state_dict().items():
        assert torch.equal(w, again.state_dict[name]), name


# ---------------------------------------------------------------- MoE families


def _file_state_dict(tiny: TinyModel) -> dict[str, torch.Tensor]:
    """The twin's state dict rebuilt from the file alone: every tensor dequantized under its
    converter name, then experts joined as transformers keeps them."""
    reader = _reader(tiny)
    converted = {}
    for hf_name in moe.hf_shapes(tiny.spec):
        stored = _tensor(reader, moe.gguf_name(tiny.spec, hf_name))
        converted[hf_name] = torch.from_numpy(np.array(stored, dtype=np.float32))
    out = moe.hf_state_dict(tiny.spec, converted)
    if tiny.spec.tied:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


@pytest.mark.parametrize("family", moe.FAMILIES)
@pytest.mark.parametrize("qtype", [q for q in QTYPES if q != "F32"])
def test_moe_qtypes_store_experts_and_state_dict_is_the_file(tmp_path, family, qtype):
    tiny = _build(tmp_path, family, qtype=qtype, seed=2)
    reader = _reader(tiny)
    ggml_type, file_type, _ = QTYPES[qtype]
    assert reader.fields["general.file_type"].contents() == int(file_type)
    for t in reader.tensors:
        router = t.name.endswith("ffn_gate_inp.weight")  # the converter keeps routers in F32
        want = Q.F32 if len(t.shape) == 1 or router else ggml_type
        assert t.tensor_type == want, t.name
        assert len(t.shape) == (3 if "_exps." in t.name else len(t.shape)), t.name
    ours = tiny.state_dict
    theirs = _file_state_dict(tiny)
    assert sorted(theirs) == sorted(ours)
    for name, w in ours.items():
        assert torch.isfinite(w).all(), name
        assert torch.equal(theirs[name], w), name
    assert sorted(ours) == sorted(hf_model(tiny).state_dict())  # the twin takes them all
    if family in TRANSFORMERS_READS:
        loaded = _from_gguf(tiny).state_dict()
        for name, w in ours.items():
            assert torch.equal(loaded[name], w), name


def test_moe_experts_are_split_like_the_converter(tmp_path):
    tiny = _build(tmp_path, "qwen3moe")
    reader, sd, f = _reader(tiny), tiny.state_dict, tiny.spec.expert_ffn
    gate_up = sd["model.layers.1.mlp.experts.gate_up_proj"]  # [E, 2 ff, hidden], gate first
    assert gate_up.shape == (8, 2 * f, 64)
    np.testing.assert_array_equal(_tensor(reader, "blk.1.ffn_gate_exps.weight"), gate_up[:, :f])
    np.testing.assert_array_equal(_tensor(reader, "blk.1.ffn_up_exps.weight"), gate_up[:, f:])
    np.testing.assert_array_equal(
        _tensor(reader, "blk.1.ffn_down_exps.weight"), sd["model.layers.1.mlp.experts.down_proj"]
    )
    np.testing.assert_array_equal(
        _tensor(reader, "blk.1.ffn_gate_inp.weight"), sd["model.layers.1.mlp.gate.weight"]
    )


def test_laguna_layout(tmp_path):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    tiny = _build(tmp_path, "laguna")
    reader, cfg = _reader(tiny), hf_config(tiny)
    assert list(reader.fields["laguna.attention.head_count"].contents()) == [4, 8, 8, 8]
    assert cfg.num_attention_heads_per_layer == [4, 8, 8, 8]
    # llama.cpp's default pattern (no key is written): full attention iff i % 4 == 0
    assert cfg.layer_types == ["full_attention"] + ["sliding_attention"] * 3
    assert cfg.mlp_layer_types == ["dense", "sparse", "sparse", "sparse"]
    assert cfg.sliding_window == 8 < IDS.shape[1]
    assert _tensor(reader, "blk.1.attn_gate.weight").shape == (8, 64)  # one gate per head
    bias = _tensor(reader, "blk.2.exp_probs_b.bias")
    np.testing.assert_array_equal(
        bias, tiny.state_dict["model.layers.2.mlp.gate.e_score_correction_bias"]
    )
    assert bias.std() > 0.02  # large enough to change some choices
    # YaRN on the full layers: pairs extrapolated (kept), blended and interpolated (/ factor)
    inv, scale = ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu", layer_type="full_attention")
    d = reader.fields["laguna.rope.dimension_count"].contents()
    assert d == 16 == len(inv) * 2
    base = 1.0 / (500000.0 ** (np.arange(0, d, 2, dtype=np.float32) / d))
    ratio = inv.numpy() / base
    assert np.isclose(ratio, 1).any() and np.isclose(ratio, 1 / 32).any()
    assert ((ratio > 1 / 32 + 1e-3) & (ratio < 1 - 1e-3)).any()
    assert scale == pytest.approx(0.1 * np.log(32) + 1)


def test_cli_writes_moe_gguf_and_hf_dir(tmp_path):
    from transformers import AutoModelForCausalLM

    out, hf_dir = tmp_path / "cli.gguf", tmp_path / "hf"
    gguf_main(["laguna", str(out), "--seed", "4", "--hf-dir", str(hf_dir), "--set", "experts=4"])
    again = _build(tmp_path / "again", "laguna", seed=4, experts=4)
    assert out.read_bytes() == again.path.read_bytes()
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    assert type(model).__name__ == "LagunaForCausalLM"
    assert model.config.num_experts == 4
    state = model.state_dict()
    assert sorted(state) == sorted(again.state_dict)
    for name, w in again.state_dict.items():
        assert torch.equal(state[name], w), name


# -- gemma4 (gemma4.py) ------------------------------------------------------------------
# transformers' GGUF loader reads too little of a gemma4 file (layer types, shared layers, PLE
# width, head dims) to load it back; the twin is built from the state dict instead.

GEMMA4_KEYS = """general.architecture general.type general.name general.file_type
    general.quantization_version gemma4.block_count gemma4.context_length
    gemma4.embedding_length gemma4.feed_forward_length gemma4.attention.head_count
    gemma4.attention.head_count_kv gemma4.rope.freq_base gemma4.rope.freq_base_swa
    gemma4.attention.layer_norm_rms_epsilon gemma4.attention.key_length
    gemma4.attention.value_length gemma4.attention.key_length_swa
    gemma4.attention.value_length_swa gemma4.final_logit_softcapping
    gemma4.attention.sliding_window gemma4.attention.shared_kv_layers
    gemma4.embedding_length_per_layer_input gemma4.attention.sliding_window_pattern
    gemma4.rope.dimension_count gemma4.rope.dimension_count_swa tokenizer.ggml.model
    tokenizer.ggml.tokens tokenizer.ggml.scores tokenizer.ggml.token_type tokenizer.ggml.merges
    tokenizer.ggml.bos_token_id tokenizer.ggml.eos_token_id tokenizer.ggml.unknown_token_id
    tokenizer.ggml.padding_token_id tokenizer.ggml.add_bos_token tokenizer.ggml.add_eos_token
    tokenizer.ggml.add_space_prefix tokenizer.chat_template"""
GEMMA4_LAYER = """attn_norm attn_q attn_q_norm attn_output post_attention_norm ffn_norm ffn_gate
    ffn_up ffn_down post_ffw_norm layer_output_scale inp_gate proj post_norm"""


def test_gemma4_file_follows_the_converter(tmp_path):
    tiny = _build(tmp_path, "gemma4")
    reader = _reader(tiny)
    assert {k for k in reader.fields if not k.startswith("GGUF.")} == set(GEMMA4_KEYS.split())
    field = lambda k: reader.fields[f"gemma4.{k}"].contents()  # noqa: E731
    assert field("attention.head_count_kv") == [2, 2, 1, 2, 2, 1]  # num_global_key_value_heads
    assert field("attention.sliding_window_pattern") == [True, True, False, True, True, False]
    assert (field("attention.key_length"), field("attention.key_length_swa")) == (32, 16)
    assert field("attention.shared_kv_layers") == 3
    assert reader.fields["tokenizer.ggml.model"].contents() == "gemma4"

    names = {t.name for t in reader.tensors}
    want = {"rope_freqs.weight", "token_embd.weight", "output_norm.weight"}
    want |= {f"per_layer_{n}.weight" for n in ("token_embd", "model_proj", "proj_norm")}
    want |= {f"blk.{i}.{t}.weight" for i in range(6) for t in GEMMA4_LAYER.split()}
    want |= {f"blk.{i}.attn_{t}.weight" for i in range(3) for t in ("k", "k_norm")}
    want |= {f"blk.{i}.attn_v.weight" for i in (0, 1)}  # full layer 2: K = V; 3 to 5 share
    assert names == want  # tied: no output.weight

    freqs = _tensor(reader, "rope_freqs.weight")  # proportional RoPE, partial 0.25 of 32
    np.testing.assert_array_equal(freqs, np.float32([1.0] * 4 + [1e30] * 12))
    np.testing.assert_array_equal(  # norms stored as they act: no + 1 in Gemma 4
        _tensor(reader, "blk.0.post_norm.weight"),
        tiny.state_dict["model.layers.0.post_per_layer_input_norm.weight"].numpy(),
    )
    np.testing.assert_array_equal(
        _tensor(reader, "blk.3.layer_output_scale.weight"),
        tiny.state_dict["model.layers.3.layer_scalar"].numpy(),
    )
    assert _tensor(reader, "per_layer_token_embd.weight").shape == (640, 6 * 32)


def test_gemma4_overrides_reach_file_and_twin(tmp_path):
    overrides = dict(k_eq_v=False, double_wide=True, tied=False, layers=7, shared_layers=4)
    tiny = _build(tmp_path, "gemma4", **overrides)
    reader = _reader(tiny)
    assert reader.fields["gemma4.attention.head_count_kv"].contents() == 2  # one value again
    assert reader.fields["gemma4.feed_forward_length"].contents() == [128] * 3 + [256] * 4
    assert hf_config(tiny).layer_types == [
        "sliding_attention",
        "sliding_attention",
        "full_attention",
    ] * 2 + [
        "full_attention"  # transformers forces the last layer full
    ]
    assert tiny.state_dict["model.layers.6.mlp.up_proj.weight"].shape == (256, 64)
    assert "output.weight" in {t.name for t in reader.tensors}
    with pytest.raises(ValueError, match="every kind of KV-shared layer needs"):
        _build(tmp_path, "gemma4", swa_period=6, layers=6, shared_layers=1)
    with pytest.raises(ValueError, match="must follow a sliding then a full layer"):
        _build(tmp_path, "gemma4", shared_layers=2)  # S S F S | S F: llama.cpp refuses it
    with pytest.raises(ValueError, match="multiples of 32: ple_dim = 16"):
        _build(tmp_path, "gemma4", qtype="Q8_0", ple_dim=16)


@pytest.mark.parametrize("qtype", list(QTYPES))
def test_gemma4_every_qtype(tmp_path, qtype):
    tiny = _build(tmp_path, "gemma4", qtype=qtype)
    reader = _reader(tiny)
    ggml_type = QTYPES[qtype][0]
    for t in reader.tensors:
        assert t.tensor_type == (ggml_type if len(t.shape) == 2 else Q.F32), t.name
    for name, ours in tiny.state_dict.items():
        assert torch.isfinite(ours).all(), name
    model = hf_model(tiny)  # strict: every parameter and buffer of transformers' model
    assert sum(p.numel() for p in model.parameters()) > 0


def test_gemma4_cli_hf_dir_loads_with_from_pretrained(tmp_path):
    from transformers import AutoModelForCausalLM

    out, hf_dir = tmp_path / "cli.gguf", tmp_path / "hf"
    gguf_main(
        ["gemma4", str(out), "--seed", "5", "--hf-dir", str(hf_dir), "--set", "shared_layers=3"]
    )
    again = _build(tmp_path / "again", "gemma4", seed=5, shared_layers=3)
    assert out.read_bytes() == again.path.read_bytes()
    model = AutoModelForCausalLM.from_pretrained(
        hf_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    assert model.config.kv_sharing_modes == [None, "store", "store", "reuse", "reuse", "reuse"]
    for name, w in model.state_dict().items():
        assert torch.equal(w, again.state_dict[name]), name
    with torch.no_grad():
        torch.testing.assert_close(model(IDS).logits, hf_model(again)(IDS).logits, rtol=0, atol=0)


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"k_eq_v": False, "double_wide": True, "tied": False, "layers": 7, "shared_layers": 4},
        {"experts": 4, "experts_used": 2, "expert_ffn": 32, "ple_dim": 0, "shared_layers": 0},
    ],
)
def test_gemma4_tensors_are_transformers_own(overrides):
    """gemma4.hf_shapes, written out by hand, names what transformers' model holds."""
    spec = gemma4.make_spec("F32", 0, overrides)
    vocab = make_vocab(gemma4.FAMILY, spec.vocab_size)
    config = transformers.AutoConfig.for_model(**gemma4.hf_config(spec, vocab))
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    theirs = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if spec.tied:
        del theirs["lm_head.weight"]
    assert gemma4.hf_shapes(spec) == theirs


# ---------------------------------------------------------------- the command


def _run_without_transformers(*runs: tuple[str, ...]) -> subprocess.CompletedProcess:
    """Each run, (TOOL, *args), tools/TOOL.py as a user runs it, one after another in one
    interpreter where transformers (the test extra) cannot be imported."""
    code = "import runpy, sys\nsys.modules['transformers'] = None  # import raises ImportError\n"
    for tool, *args in runs:
        code += f"sys.argv = [{tool!r}, *{args!r}]\n"
        code += f"runpy.run_path({str(ROOT / 'tools' / tool)!r}, run_name='__main__')\n"
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300
    )


def test_tools_run_without_the_test_extra(tmp_path):
    """Every family and a draft, with the twin's folder, from the runtime's dependencies."""
    hf_dirs = {family: tmp_path / f"{family}-hf" for family in FAMILIES}
    seed = ("--seed", "2")
    runs = [
        ("make_tiny_gguf.py", family, str(tmp_path / f"{family}.gguf"), *seed, "--hf-dir", str(d))
        for family, d in hf_dirs.items()
    ]
    runs.append(("make_tiny_draft.py", str(tmp_path / "qwen3.gguf"), str(tmp_path / "draft")))
    proc = _run_without_transformers(*runs)
    assert proc.returncode == 0, proc.stderr[-2000:]
    for family, hf_dir in hf_dirs.items():
        again = make_tiny_gguf(family, tmp_path / "again.gguf", seed=2).path
        assert (tmp_path / f"{family}.gguf").read_bytes() == again.read_bytes(), family
        assert (hf_dir / "config.json").exists() and (hf_dir / "model.safetensors").exists()
    assert (tmp_path / "draft" / "draft.gguf").exists()
    assert (tmp_path / "draft" / "draft" / "config.json").exists()


def test_command_rejects_a_bad_override_in_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        gguf_main(["llama", str(tmp_path / "x.gguf"), "--set", "hidden=48", "--qtype", "Q8_0"])
    assert exc.value.code == 2
    assert "Q8_0 needs rows that are multiples of 32: hidden = 48" in capsys.readouterr().err
    assert not (tmp_path / "x.gguf").exists()
