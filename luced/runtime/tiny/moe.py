"""The tiny MoE families: `qwen3moe` and `laguna`.

What differs from the dense families, following llama.cpp's converter
(conversion/qwen.py Qwen2MoeModel / Qwen3MoeModel, conversion/laguna.py LagunaModel):

- transformers keeps a layer's experts fused, `mlp.experts.gate_up_proj` [E, 2·ff, hidden]
  (gate rows first) and `mlp.experts.down_proj` [E, hidden, ff]; the converter splits gate_up
  into `ffn_gate_exps` + `ffn_up_exps` and stores all three as 3-D [E, out, in] stacks. Here
  the random weights are drawn per half under the converter's intermediate names
  (`mlp.experts.gate_proj.weight`, ...) and `hf_state_dict` joins them back.
- The router `ffn_gate_inp` stays F32 whatever the file type (the converter's always-F32
  list); 3-D expert stacks are quantized like any matrix.
- laguna: gguf-py 0.19 has no LAGUNA, so `LAGUNA_NAMES` spells upstream gguf-py's table;
  `attention.head_count` is written twice, the scalar then the per-layer array (the converter
  calls the base writer first); no sliding_window_pattern is written, so layer types follow
  llama.cpp's default, full iff i % 4 == 0; the score bias is `exp_probs_b.bias`.

Laguna's tiny twin uses YaRN on full layers with original_max_position_embeddings chosen so
the rotary pairs are partly extrapolated, partly interpolated and partly blended.
"""

from __future__ import annotations

import re
from typing import Any

import gguf
import numpy as np
import torch

FAMILIES = ("qwen3moe", "laguna")
VOCAB = "qwen3"  # both borrow the tiny Qwen3 vocabulary (byte-level BPE, ChatML)
SWA_PERIOD = 4  # llama.cpp's laguna default: full attention at i % 4 == 0

_MOE = dict(experts=8, experts_used=2, expert_ffn=32, vocab_size=512, rms_eps=1e-6, tied=False)
_QWEN3MOE = dict(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=32, ffn=128, context=512)
# Laguna: 4 layers = full + 3 sliding; layer 0 dense, 1-3 MoE; 4 query heads full, 8 sliding.
_LAGUNA = dict(hidden=64, layers=4, heads=4, swa_heads=8, kv_heads=2, head_dim=32, ffn=128)
_LAGUNA |= dict(context=4096, sliding_window=8, shared_ffn=32, routed_scale=2.5, dense_layers=1)
_LAGUNA |= dict(partial_rotary=0.5, yarn_factor=32.0, yarn_original_context=128)
DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen3moe": _MOE | _QWEN3MOE | dict(rope_base=1e6),
    "laguna": _MOE | _LAGUNA | dict(rope_base=500000.0),
}
KQUANT_DEFAULTS = {"qwen3moe": dict(expert_ffn=256), "laguna": dict(expert_ffn=256, shared_ffn=256)}
GATINGS = ("per-head", "per-element")

# HF name (layer part, `.weight` implied unless given) -> GGUF suffix, as upstream gguf-py maps
# them for MODEL_ARCH.LAGUNA.
LAGUNA_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "self_attn.g_proj": "attn_gate",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",
    "mlp.gate.e_score_correction_bias": "exp_probs_b.bias",
    "mlp.experts.gate_proj": "ffn_gate_exps",
    "mlp.experts.up_proj": "ffn_up_exps",
    "mlp.experts.down_proj": "ffn_down_exps",
    "mlp.shared_experts.gate_proj": "ffn_gate_shexp",
    "mlp.shared_experts.up_proj": "ffn_up_shexp",
    "mlp.shared_experts.down_proj": "ffn_down_shexp",
}
LAGUNA_EDGES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm"}
LAGUNA_EDGES |= {"lm_head": "output"}


def validate(spec: Any) -> None:
    if not 0 < spec.experts_used <= spec.experts:
        raise ValueError(f"experts_used must lie in [1, experts], got {spec.experts_used}")
    if spec.family == "laguna":
        if not 0 <= spec.dense_layers < spec.layers:
            raise ValueError("laguna needs 0 <= dense_layers < layers (some MoE layers)")
        if spec.swa_heads % spec.kv_heads:
            raise ValueError("swa_heads must be a multiple of kv_heads")
        if spec.gating not in GATINGS:
            raise ValueError(f"gating must be one of {GATINGS}")
        if int(spec.head_dim * spec.partial_rotary) % 2:
            raise ValueError("head_dim * partial_rotary must be even")


def row_sizes(spec: Any) -> dict[str, int]:
    """Matrix row lengths that must fit the quant block, beyond the dense families' ones."""
    rows = {"expert_ffn": spec.expert_ffn}
    if spec.family == "laguna":
        rows |= {"shared_ffn": spec.shared_ffn, "swa_heads * head_dim": spec.swa_heads}
        rows["swa_heads * head_dim"] *= spec.head_dim
    return rows


def _full_layers(spec: Any) -> list[bool]:
    if spec.family != "laguna" or not spec.sliding_window:
        return [True] * spec.layers
    return [i % SWA_PERIOD == 0 for i in range(spec.layers)]


def _layer_heads(spec: Any) -> list[int]:
    return [spec.heads if full else spec.swa_heads for full in _full_layers(spec)]


def layer_shapes(spec: Any, layer: int) -> dict[str, tuple[int, ...]]:
    """One layer's tensors under the converter's (split-expert) names, `.weight` implied."""
    h, d, kv = spec.hidden, spec.head_dim, spec.kv_heads * spec.head_dim
    q = _layer_heads(spec)[layer] * d
    e, f = spec.experts, spec.expert_ffn
    shapes = dict(input_layernorm=(h,), post_attention_layernorm=(h,))
    shapes |= {"self_attn.q_proj": (q, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h)}
    shapes |= {"self_attn.o_proj": (h, q), "self_attn.q_norm": (d,), "self_attn.k_norm": (d,)}
    dense = spec.family == "laguna" and layer < spec.dense_layers
    if dense:
        s = spec.ffn
        shapes |= {"mlp.gate_proj": (s, h), "mlp.up_proj": (s, h), "mlp.down_proj": (h, s)}
    else:
        shapes |= {"mlp.gate": (e, h), "mlp.experts.gate_proj": (e, f, h)}
        shapes |= {"mlp.experts.up_proj": (e, f, h), "mlp.experts.down_proj": (e, h, f)}
    if spec.family == "laguna":
        heads = _layer_heads(spec)[layer]
        shapes["self_attn.g_proj"] = (heads if spec.gating == "per-head" else heads * d, h)
        if not dense:
            s = spec.shared_ffn
            shapes["mlp.gate.e_score_correction_bias"] = (e,)
            shapes |= {"mlp.shared_experts.gate_proj": (s, h), "mlp.shared_experts.up_proj": (s, h)}
            shapes["mlp.shared_experts.down_proj"] = (h, s)
    return shapes


def hf_shapes(spec: Any) -> dict[str, tuple[int, ...]]:
    h, v = spec.hidden, spec.vocab_size
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if not spec.tied:
        shapes["lm_head.weight"] = (v, h)
    for i in range(spec.layers):
        for name, shape in layer_shapes(spec, i).items():
            full = name if name.endswith("_bias") else f"{name}.weight"
            shapes[f"model.layers.{i}.{full}"] = shape
    return shapes


def gguf_name(spec: Any, hf_name: str) -> str | None:
    """The GGUF tensor name of a (converter-named) HF tensor."""
    if spec.family == "qwen3moe":
        tensor_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3MOE, spec.layers)
        return tensor_map.get_name(hf_name, try_suffixes=(".weight",))
    stem = hf_name.removesuffix(".weight")
    if stem in LAGUNA_EDGES:
        return f"{LAGUNA_EDGES[stem]}.weight"
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", stem)
    if m is None or m[2] not in LAGUNA_NAMES:
        return None
    suffix = LAGUNA_NAMES[m[2]]
    return f"blk.{m[1]}.{suffix}" + ("" if suffix.endswith(".bias") else ".weight")


def hf_state_dict(spec: Any, converted: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Converter-named tensors -> transformers' names: each layer's gate and up stacks join
    into `mlp.experts.gate_up_proj`, `mlp.experts.down_proj` loses its `.weight`."""
    out = dict(converted)
    for i in range(spec.layers):
        p = f"model.layers.{i}.mlp.experts."
        if f"{p}gate_proj.weight" in out:
            gate, up = out.pop(f"{p}gate_proj.weight"), out.pop(f"{p}up_proj.weight")
            out[f"{p}gate_up_proj"] = torch.cat([gate, up], dim=1)
            out[f"{p}down_proj"] = out.pop(f"{p}down_proj.weight")
    return out


def write_metadata(w: gguf.GGUFWriter, spec: Any) -> None:
    """The keys the MoE converters add to the common ones, in their order."""
    w.add_expert_count(spec.experts)
    w.add_expert_used_count(spec.experts_used)
    if spec.family == "qwen3moe":
        w.add_expert_feed_forward_length(spec.expert_ffn)
        return
    rot = int(spec.head_dim * spec.partial_rotary)
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(spec.yarn_factor)
    w.add_rope_scaling_orig_ctx_len(spec.yarn_original_context)
    if spec.sliding_window:
        w.add_rope_freq_base_swa(spec.swa_rope_base)
    w.add_vocab_size(spec.vocab_size)
    w.add_head_count(_layer_heads(spec))  # overwrites the scalar, as the converter does
    if spec.sliding_window:
        w.add_sliding_window(spec.sliding_window)
    w.add_expert_feed_forward_length(spec.expert_ffn)
    w.add_expert_shared_feed_forward_length(spec.shared_ffn)
    w.add_expert_weights_norm(True)
    w.add_expert_weights_scale(spec.routed_scale)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_leading_dense_block_count(spec.dense_layers)
    w.add_rope_dimension_count(rot)
    if spec.sliding_window:
        w.add_rope_dimension_count_swa(spec.head_dim)


def hf_config(spec: Any, common: dict[str, Any], rope: dict[str, Any]) -> dict[str, Any]:
    """The transformers twin's config.json: Qwen3MoeConfig or LagunaConfig fields."""
    moe = dict(
        num_experts=spec.experts,
        num_experts_per_tok=spec.experts_used,
        moe_intermediate_size=spec.expert_ffn,
    )
    if spec.family == "qwen3moe":  # llama.cpp renormalises unconditionally
        return dict(
            model_type="qwen3_moe",
            architectures=["Qwen3MoeForCausalLM"],
            **common,
            **moe,
            rope_parameters=rope,
            norm_topk_prob=True,
            decoder_sparse_step=1,
        )
    full = rope | dict(
        rope_type="yarn",
        partial_rotary_factor=spec.partial_rotary,
        factor=spec.yarn_factor,
        original_max_position_embeddings=spec.yarn_original_context,
    )
    ropes = {"full_attention": full}
    if spec.sliding_window:
        ropes["sliding_attention"] = {"rope_type": "default", "rope_theta": spec.swa_rope_base}
    layer_types = ["full_attention" if f else "sliding_attention" for f in _full_layers(spec)]
    dense = spec.dense_layers
    return dict(
        model_type="laguna",
        architectures=["LagunaForCausalLM"],
        **common,
        **moe,
        num_attention_heads_per_layer=_layer_heads(spec),
        layer_types=layer_types,
        mlp_layer_types=["dense"] * dense + ["sparse"] * (spec.layers - dense),
        sliding_window=spec.sliding_window or 512,  # unused when every layer is full
        shared_expert_intermediate_size=spec.shared_ffn,
        moe_routed_scaling_factor=spec.routed_scale,
        gating=True if spec.gating == "per-head" else spec.gating,
        rope_parameters=ropes,
    )


def random_bias(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Score-correction biases of the size of sigmoid-score gaps, so they change choices."""
    return rng.uniform(-0.1, 0.1, shape).astype(np.float32)
