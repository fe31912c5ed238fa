"""`make_tiny_gguf`: a family's tiny GGUF, written as llama.cpp's converter would write the
Hugging Face model it returns (see the package docstring); gemma4 is built by gemma4.py,
the encoders by bert.py."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from luced.runtime.tiny import bert, gemma4, moe, qwen35
from luced.runtime.tiny.spec import (
    ENCODERS,
    LLAMA3_ORIGINAL_CONTEXT,
    QTYPES,
    TinyModel,
    TinySpec,
    as_f32,
    check_qtype,
    hf_common,
    make_spec,
)
from luced.runtime.tiny.vocab import Vocab, make_vocab, write_vocab
from luced.runtime.tiny.weights import add_tensor, random_hf, write_out

GEMMA3_LOCAL_ROPE_BASE = 10000.0  # llama.cpp hard-codes it for gemma3's sliding layers


def make_tiny_gguf(
    family: str, path: str | Path, *, seed: int = 0, qtype: str = "F32", **overrides: Any
) -> TinyModel:
    """Write the tiny GGUF of `family` to `path` (deterministic in the seed); return it with
    its Hugging Face twin's config and weights. ValueError for a bad family, qtype or
    override (the spec's fields)."""
    path = Path(path)
    if family == gemma4.FAMILY:
        check_qtype(qtype)
        return gemma4.build(path, seed=seed, qtype=qtype, **overrides)
    if family in ENCODERS:
        check_qtype(qtype)
        return bert.build(path, family=family, seed=seed, qtype=qtype, **overrides)
    spec = make_spec(family, qtype, seed, overrides)
    vocab = make_vocab(moe.VOCAB if family in moe.FAMILIES else family, spec.vocab_size)
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(path, family)
    _write_metadata(writer, spec, vocab)

    state_dict: dict[str, torch.Tensor] = {}
    if spec.rope_scaling == "llama3":  # generate_extra_tensors runs before the model's tensors
        writer.add_tensor("rope_freqs.weight", _llama3_rope_factors(spec))
    # Sorted like safetensors stores them, so blk.10 follows blk.1 as in converted files.
    for hf_name, shape in sorted(_hf_shapes(spec).items()):
        gguf_name = _gguf_name(spec, hf_name)
        if gguf_name is None:
            raise AssertionError(f"gguf-py has no name for {hf_name}")
        # HF -> GGUF as the converter does it. With random sources this only fixes value ranges
        # (norms near 1); the inverse below is what ties the state dict to the file.
        kind, arg = _convention(spec, hf_name)
        w = random_hf(spec, hf_name, shape)
        if kind == "permute":
            w = _permute_qk(w, arg)
        elif kind == "shift":
            w = w + np.float32(arg)
        elif kind == "qwen35":
            w = qwen35.to_gguf(spec, hf_name, w)
        # The HF weight is what the stored bytes mean, with llama.cpp's conventions undone.
        back = add_tensor(writer, spec, gguf_name, hf_name, w).reshape(shape)
        if kind == "permute":
            back = _permute_qk(back, arg, inverse=True)
        elif kind == "shift":
            back = back - np.float32(arg)  # exact: stored values lie in [0.5, 2] (Sterbenz)
        elif kind == "qwen35":
            back = qwen35.from_gguf(spec, hf_name, back)
        state_dict[hf_name] = torch.from_numpy(np.ascontiguousarray(back))
    if spec.family in (*moe.FAMILIES, "qwen35moe"):  # join the split expert stacks
        state_dict = moe.hf_state_dict(spec, state_dict)
    if spec.tied:
        state_dict["lm_head.weight"] = state_dict["model.embed_tokens.weight"]
    write_out(writer)
    return TinyModel(path, family, spec, _hf_config(spec, vocab), state_dict)


# ---------------------------------------------------------------- weights


def _hf_shapes(spec: TinySpec) -> dict[str, tuple[int, ...]]:
    """HF parameter name -> shape, for the family's *ForCausalLM (MoE: the converter's names)."""
    if spec.family in moe.FAMILIES:
        return moe.hf_shapes(spec)
    if spec.family in qwen35.FAMILIES:
        return qwen35.hf_shapes(spec)
    h, f, d, v = spec.hidden, spec.ffn, spec.head_dim, spec.vocab_size
    q, kv = spec.heads * d, spec.kv_heads * d
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if not spec.tied:
        shapes["lm_head.weight"] = (v, h)
    layer = dict(input_layernorm=(h,), post_attention_layernorm=(h,))
    layer |= {"self_attn.q_proj": (q, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h)}
    layer |= {"self_attn.o_proj": (h, q), "mlp.gate_proj": (f, h), "mlp.up_proj": (f, h)}
    layer |= {"mlp.down_proj": (h, f)}
    if spec.family in ("qwen3", "gemma3"):
        layer |= {"self_attn.q_norm": (d,), "self_attn.k_norm": (d,)}
    if spec.family == "gemma3":
        layer |= dict(pre_feedforward_layernorm=(h,), post_feedforward_layernorm=(h,))
    for i in range(spec.layers):
        shapes |= {f"model.layers.{i}.{name}.weight": shape for name, shape in layer.items()}
    return shapes


def _permute_qk(w: np.ndarray, n_head: int, inverse: bool = False) -> np.ndarray:
    """llama.cpp's per-head Q/K row order: HF [x0..x(d/2-1), y0..y(d/2-1)] <-> [x0, y0, x1..]."""
    d = w.shape[0] // n_head
    if inverse:
        return w.reshape(n_head, d // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    return w.reshape(n_head, 2, d // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _convention(spec: TinySpec, hf_name: str) -> tuple[str, int]:
    """What llama.cpp does to this tensor: ("permute", n_head), ("shift", 1) or ("", 0)."""
    if spec.family == "llama" and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
        return "permute", spec.heads if "q_proj" in hf_name else spec.kv_heads
    if spec.family == "gemma3" and hf_name.endswith("norm.weight"):
        return "shift", 1
    if spec.family in qwen35.FAMILIES:
        return "qwen35", 0  # qwen35.to_gguf / from_gguf
    return "", 0


def _llama3_rope_factors(spec: TinySpec) -> np.ndarray:
    """`rope_freqs.weight` exactly as LlamaModel.generate_extra_tensors computes it."""
    dim = spec.head_dim
    freqs = 1.0 / (spec.rope_base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    low_wavelen = LLAMA3_ORIGINAL_CONTEXT / spec.low_freq_factor
    high_wavelen = LLAMA3_ORIGINAL_CONTEXT / spec.high_freq_factor
    factors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(spec.rope_factor)
        else:
            smooth = (LLAMA3_ORIGINAL_CONTEXT / wavelen - spec.low_freq_factor) / (
                spec.high_freq_factor - spec.low_freq_factor
            )
            factors.append(1 / ((1 - smooth) / spec.rope_factor + smooth))
    return np.array(factors, dtype=np.float32)


def _gguf_name(spec: TinySpec, hf_name: str) -> str | None:
    if spec.family in moe.FAMILIES:
        return moe.gguf_name(spec, hf_name)
    tensor_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH[spec.family.upper()], spec.layers)
    source = qwen35.source_name(hf_name) if spec.family in qwen35.FAMILIES else hf_name
    return tensor_map.get_name(source, try_suffixes=(".weight", ".bias"))


# ---------------------------------------------------------------- metadata


def _write_metadata(w: gguf.GGUFWriter, spec: TinySpec, vocab: Vocab) -> None:
    # general.* as ModelBase.prepare_metadata writes them, then TextModel.set_gguf_parameters.
    w.add_type(gguf.GGUFType.MODEL)
    w.add_name(spec.name)
    w.add_block_count(spec.layers)
    w.add_context_length(spec.context)
    w.add_embedding_length(spec.hidden)
    if spec.family != "qwen35moe":  # no dense FFN, no intermediate_size to write
        w.add_feed_forward_length(spec.ffn)
    w.add_head_count(spec.heads)
    w.add_head_count_kv(spec.kv_heads)
    w.add_rope_freq_base(spec.rope_base)
    if spec.family == "gemma3":  # from rope_parameters["sliding_attention"]
        w.add_rope_freq_base_swa(GEMMA3_LOCAL_ROPE_BASE)
    w.add_layer_norm_rms_eps(spec.rms_eps)
    w.add_key_length(spec.head_dim)  # every HF config of these families has head_dim
    w.add_value_length(spec.head_dim)
    w.add_file_type(QTYPES[spec.qtype][1])
    if spec.family == "llama":  # LlamaModel.set_gguf_parameters
        w.add_vocab_size(spec.vocab_size)
        w.add_rope_dimension_count(spec.head_dim)
    if spec.family == "gemma3":  # Gemma3Model.set_gguf_parameters (no final softcap in Gemma 3)
        w.add_sliding_window(spec.sliding_window)
    if spec.family in moe.FAMILIES:
        moe.write_metadata(w, spec)
    if spec.family in qwen35.FAMILIES:  # Qwen3NextModel.set_gguf_parameters, M-RoPE
        qwen35.write_metadata(w, spec)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    write_vocab(w, vocab)


# ---------------------------------------------------------------- the Hugging Face twin


def _hf_config(spec: TinySpec, vocab: Vocab) -> dict[str, Any]:
    """The config.json of the model this file converts (see `TinyModel`)."""
    common = hf_common(spec, vocab)
    rope = {"rope_type": "default", "rope_theta": as_f32(spec.rope_base)}
    if spec.family in moe.FAMILIES:
        return moe.hf_config(spec, common, rope)
    if spec.family == "llama":
        if spec.rope_scaling == "llama3":
            rope = dict(
                rope_type="llama3",
                rope_theta=as_f32(spec.rope_base),
                factor=spec.rope_factor,
                low_freq_factor=spec.low_freq_factor,
                high_freq_factor=spec.high_freq_factor,
                original_max_position_embeddings=LLAMA3_ORIGINAL_CONTEXT,
            )
        head = dict(model_type="llama", architectures=["LlamaForCausalLM"])
        return head | common | dict(rope_parameters=rope)
    if spec.family == "qwen3":
        head = dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"])
        return head | common | dict(rope_parameters=rope)
    if spec.family in qwen35.FAMILIES:
        return qwen35.hf_config(spec, common, rope)
    local = {"rope_type": "default", "rope_theta": GEMMA3_LOCAL_ROPE_BASE}
    return dict(
        model_type="gemma3_text",
        architectures=["Gemma3ForCausalLM"],
        **common,
        rope_parameters={"full_attention": rope, "sliding_attention": local},
        sliding_window=spec.sliding_window,
        hidden_activation="gelu_pytorch_tanh",
        query_pre_attn_scalar=spec.head_dim,  # llama.cpp scales scores by 1/sqrt(head_dim)
    )
