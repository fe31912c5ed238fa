"""luced.runtime.tiny's qwen35 family: the GGUF holds what llama.cpp's converter writes (keys,
tensor names, types, the stored forms of A_log, the norms, the conv and the value heads), and
the transformers twin holds what those bytes mean. transformers cannot read qwen35 GGUF files,
so the stored forms are checked here one by one; the logits in tests/runtime."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from luced.runtime.tiny import QTYPES, TinyModel, make_tiny_gguf
from luced.runtime.tiny.cli import gguf_main

KV_DIFFER = {"linear_v_heads": 4}  # 2 key heads, 4 value heads: llama.cpp reorders V heads
FFN = "attn_norm post_attention_norm ffn_gate ffn_up ffn_down"
DELTA_NET = "attn_qkv attn_gate ssm_beta ssm_alpha ssm_conv1d ssm_norm ssm_out"
ATTENTION = "attn_q attn_k attn_v attn_output attn_q_norm attn_k_norm"
KEYS = """general.architecture general.type general.name general.file_type
    general.quantization_version {a}.block_count {a}.context_length {a}.embedding_length
    {a}.feed_forward_length {a}.attention.head_count {a}.attention.head_count_kv
    {a}.rope.freq_base {a}.attention.layer_norm_rms_epsilon {a}.attention.key_length
    {a}.attention.value_length {a}.rope.dimension_count {a}.rope.dimension_sections
    {a}.ssm.conv_kernel {a}.ssm.state_size {a}.ssm.group_count {a}.ssm.time_step_rank
    {a}.ssm.inner_size {a}.full_attention_interval tokenizer.ggml.model tokenizer.ggml.pre
    tokenizer.ggml.tokens tokenizer.ggml.token_type tokenizer.ggml.merges
    tokenizer.ggml.bos_token_id tokenizer.ggml.eos_token_id tokenizer.ggml.padding_token_id
    tokenizer.ggml.add_bos_token tokenizer.chat_template"""


def _stored(reader: gguf.GGUFReader) -> dict[str, tuple[np.ndarray, Q]]:
    """name -> (dequantized array in torch shape order, ggml type)."""
    out = {}
    for t in reader.tensors:
        shape = tuple(reversed(t.shape.tolist()))
        out[t.name] = (gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape), t.tensor_type)
    return out


def _tiled(w: np.ndarray, axis: int, hk: int, hv: int, size: int) -> np.ndarray:
    """HF's value heads (grouped: head k * r + j reads key head k) in llama.cpp's tiled order
    (head j * hk + k), written out head by head."""
    r, heads = hv // hk, np.split(np.asarray(w), hv, axis=axis)
    assert heads[0].shape[axis] == size
    return np.concatenate([heads[k * r + j] for j in range(r) for k in range(hk)], axis=axis)


@pytest.fixture(scope="module")
def kv_differ(tmp_path_factory) -> TinyModel:
    return make_tiny_gguf("qwen35", tmp_path_factory.mktemp("q35") / "q.gguf", seed=4, **KV_DIFFER)


def test_keys_tensor_names_and_types(kv_differ) -> None:
    reader = gguf.GGUFReader(kv_differ.path)
    spec = kv_differ.spec
    keys = {k for k in reader.fields if not k.startswith("GGUF.")}
    assert keys == {k.format(a="qwen35") for k in KEYS.split()}

    def value(key: str):
        return reader.fields[f"qwen35.{key}"].contents()

    assert value("full_attention_interval") == 4
    assert (value("ssm.conv_kernel"), value("ssm.state_size"), value("ssm.group_count")) == (
        4,
        16,
        2,
    )
    assert (value("ssm.time_step_rank"), value("ssm.inner_size")) == (4, 4 * 16)
    assert value("rope.dimension_count") == spec.head_dim // 4  # partial_rotary_factor 0.25
    assert value("rope.dimension_sections") == [2, 1, 1, 0]  # the 4 rotary pairs
    names = {t.name for t in reader.tensors}
    want = {"token_embd.weight", "output_norm.weight", "output.weight"}
    for i in range(4):
        kinds = f"{FFN} {DELTA_NET if i < 3 else ATTENTION}".split()
        want |= {f"blk.{i}.{kind}.weight" for kind in kinds}
        if i < 3:
            want |= {f"blk.{i}.ssm_a", f"blk.{i}.ssm_dt.bias"}
    assert names == want
    known = {gguf.TENSOR_NAMES[t] for t in gguf.MODEL_TENSORS[gguf.MODEL_ARCH.QWEN35]}
    bases = {n.split(".")[2] if n.startswith("blk.") else n.split(".")[0] for n in names}
    assert bases <= {k.removeprefix("blk.{bid}.") for k in known}  # gguf-py's qwen35 names
    stored = _stored(reader)
    assert stored["blk.3.attn_q.weight"][0].shape == (2 * spec.heads * spec.head_dim, 64)
    assert stored["blk.0.ssm_conv1d.weight"][0].shape == (2 * 2 * 16 + 4 * 16, 4)


def test_converter_conventions(kv_differ) -> None:
    stored, sd = _stored(gguf.GGUFReader(kv_differ.path)), kv_differ.state_dict
    hk, hv, dv, kd = 2, 4, 16, 2 * 2 * 16  # kd: the Q and K channels before V

    def s(name: str) -> np.ndarray:
        return stored[name][0]

    def hf(name: str) -> np.ndarray:
        return sd[f"model.layers.1.{name}"].numpy()

    # Zero-centred norms are stored as 1 + w; the gated norm (ssm_norm) as it is.
    np.testing.assert_array_equal(s("output_norm.weight"), sd["model.norm.weight"].numpy() + 1)
    np.testing.assert_array_equal(s("blk.1.attn_norm.weight"), hf("input_layernorm.weight") + 1)
    np.testing.assert_array_equal(
        s("blk.3.attn_q_norm.weight"), sd["model.layers.3.self_attn.q_norm.weight"].numpy() + 1
    )
    np.testing.assert_array_equal(s("blk.1.ssm_norm.weight"), hf("linear_attn.norm.weight"))
    # A_log -> -exp(A_log), exactly in torch's float32 (as transformers computes it).
    a_log = torch.from_numpy(hf("linear_attn.A_log"))
    np.testing.assert_array_equal(
        s("blk.1.ssm_a"), _tiled((-torch.exp(a_log)).numpy(), 0, hk, hv, 1)
    )
    np.testing.assert_array_equal(
        s("blk.1.ssm_dt.bias"), _tiled(hf("linear_attn.dt_bias"), 0, hk, hv, 1)
    )
    # The conv is squeezed and F32; Q/K channels stay, V channels are tiled.
    conv, conv_type = stored["blk.1.ssm_conv1d.weight"]
    assert conv_type == Q.F32
    hf_conv = hf("linear_attn.conv1d.weight")[:, 0]
    np.testing.assert_array_equal(conv[:kd], hf_conv[:kd])
    np.testing.assert_array_equal(conv[kd:], _tiled(hf_conv[kd:], 0, hk, hv, dv))
    qkv = hf("linear_attn.in_proj_qkv.weight")
    np.testing.assert_array_equal(s("blk.1.attn_qkv.weight")[:kd], qkv[:kd])
    np.testing.assert_array_equal(s("blk.1.attn_qkv.weight")[kd:], _tiled(qkv[kd:], 0, hk, hv, dv))
    pairs = {
        "attn_gate": ("in_proj_z", 0, dv),
        "ssm_beta": ("in_proj_b", 0, 1),
        "ssm_alpha": ("in_proj_a", 0, 1),
        "ssm_out": ("out_proj", 1, dv),  # its columns
    }
    for ours, (theirs, axis, size) in pairs.items():
        np.testing.assert_array_equal(
            s(f"blk.1.{ours}.weight"),
            _tiled(hf(f"linear_attn.{theirs}.weight"), axis, hk, hv, size),
            err_msg=ours,
        )
    # Gated attention: Q and its gate interleaved per head, stored as they are.
    np.testing.assert_array_equal(
        s("blk.3.attn_q.weight"), sd["model.layers.3.self_attn.q_proj.weight"].numpy()
    )


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K"])
def test_qtypes_store_matrices_and_keep_f32_where_llama_cpp_does(tmp_path, qtype) -> None:
    tiny = make_tiny_gguf("qwen35", tmp_path / "q.gguf", qtype=qtype, **KV_DIFFER)
    ggml_type = QTYPES[qtype][0]
    for name, (_, t) in _stored(gguf.GGUFReader(tiny.path)).items():
        f32 = name.endswith(("_norm.weight", "ssm_a", ".bias", "ssm_conv1d.weight"))
        assert t == (Q.F32 if f32 else ggml_type), name
    for name, w in tiny.state_dict.items():
        assert torch.isfinite(w).all(), name


def test_cli_writes_gguf_and_a_transformers_dir(tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    out, hf_dir = tmp_path / "cli.gguf", tmp_path / "hf"
    overrides = ["layers=6", "full_attention_interval=3", "linear_v_heads=4", "tied=true"]
    args = ["qwen35", str(out), "--seed", "5", "--qtype", "Q8_0", "--hf-dir", str(hf_dir)]
    gguf_main(args + [arg for o in overrides for arg in ("--set", o)])
    again = make_tiny_gguf(
        "qwen35",
        tmp_path / "again.gguf",
        seed=5,
        qtype="Q8_0",
        layers=6,
        full_attention_interval=3,
        linear_v_heads=4,
        tied=True,
    )
    assert out.read_bytes() == again.path.read_bytes()
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    assert type(model).__name__ == "Qwen3_5ForCausalLM"
    assert model.config.model_type == "qwen3_5_text"
    assert model.config.layer_types == ["linear_attention"] * 2 + ["full_attention"] + [
        "linear_attention"
    ] * 2 + ["full_attention"]
    for name, w in model.state_dict().items():
        assert torch.equal(w, again.state_dict[name]), name


def test_bad_specs(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="multiple of linear_k_heads"):
        make_tiny_gguf("qwen35", tmp_path / "a.gguf", linear_v_heads=3)
    with pytest.raises(ValueError, match=r"multiples of 256: linear_v_heads \* linear_v_dim"):
        make_tiny_gguf("qwen35", tmp_path / "b.gguf", qtype="Q4_K", linear_v_dim=16)


# -- qwen35moe: the same stack, experts in every layer ----------------------------------------

MOE_FFN = """attn_norm post_attention_norm ffn_gate_inp ffn_gate_exps ffn_up_exps ffn_down_exps
    ffn_gate_shexp ffn_up_shexp ffn_down_shexp ffn_gate_inp_shexp"""
MOE_KEYS = """{a}.expert_count {a}.expert_used_count {a}.expert_feed_forward_length
    {a}.expert_shared_feed_forward_length"""


def test_qwen35moe_file_follows_the_converter(tmp_path) -> None:
    tiny = make_tiny_gguf("qwen35moe", tmp_path / "m.gguf", qtype="Q8_0", seed=4, **KV_DIFFER)
    reader = gguf.GGUFReader(tiny.path)
    keys = set((KEYS + " " + MOE_KEYS).format(a="qwen35moe").split())
    keys.remove("qwen35moe.feed_forward_length")  # no dense FFN, no intermediate_size
    assert set(reader.fields) - {f for f in reader.fields if f.startswith("GGUF.")} == keys
    stored, sd, f = _stored(reader), tiny.state_dict, tiny.spec.expert_ffn
    for i, kind in enumerate(["DN", "DN", "DN", "FULL"]):
        mixer = DELTA_NET if kind == "DN" else ATTENTION
        want = {f"blk.{i}.{n}.weight" for n in (MOE_FFN + " " + mixer).split()}
        want |= {f"blk.{i}.ssm_a", f"blk.{i}.ssm_dt.bias"} if kind == "DN" else set()
        assert {n for n in stored if n.startswith(f"blk.{i}.")} == want
    gate_up = sd["model.layers.1.mlp.experts.gate_up_proj"]  # [E, 2 ff, hidden], gate first
    assert gate_up.shape == (8, 2 * f, 64)
    w, t = stored["blk.1.ffn_gate_exps.weight"]
    assert t == Q.Q8_0 and np.array_equal(w, gate_up[:, :f])
    assert np.array_equal(stored["blk.1.ffn_up_exps.weight"][0], gate_up[:, f:])
    for name in ("ffn_gate_inp", "ffn_gate_inp_shexp"):  # routers stay F32
        assert stored[f"blk.1.{name}.weight"][1] == Q.F32
    shexp_gate = sd["model.layers.1.mlp.shared_expert_gate.weight"]
    assert shexp_gate.shape == (1, 64)
    assert np.array_equal(stored["blk.1.ffn_gate_inp_shexp.weight"][0], shexp_gate)


def test_qwen35moe_cli_hf_dir_loads_with_from_pretrained(tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    out, hf_dir = tmp_path / "cli.gguf", tmp_path / "hf"
    gguf_main(["qwen35moe", str(out), "--seed", "5", "--hf-dir", str(hf_dir), "--set", "experts=4"])
    again = make_tiny_gguf("qwen35moe", tmp_path / "again.gguf", seed=5, experts=4)
    assert out.read_bytes() == again.path.read_bytes()
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    assert type(model).__name__ == "Qwen3_5MoeForCausalLM"
    assert model.config.model_type == "qwen3_5_moe_text" and model.config.num_experts == 4
    state = model.state_dict()
    assert sorted(state) == sorted(again.state_dict)
    for name, w in again.state_dict.items():
        assert torch.equal(state[name], w), name
