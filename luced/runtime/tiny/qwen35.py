"""The tiny `qwen35` family: Qwen3.5's hybrid stack (Gated DeltaNet + gated full attention),
the tensors and keys llama.cpp's converter writes for it, and the transformers twin's config
(`Qwen3_5TextConfig`, model_type `qwen3_5_text` -> `Qwen3_5ForCausalLM`).

Converter conventions (llama.cpp `conversion/qwen.py`, Qwen3NextModel and its Qwen3.5 subclasses),
applied by `to_gguf` and undone by `from_gguf`:

    *norm.weight (not linear_attn.norm)   stored as 1 + w (zero-centred RMSNorms)
    linear_attn.A_log                     ssm_a = -exp(A_log), no .weight suffix
    linear_attn.dt_bias                   ssm_dt.bias
    linear_attn.conv1d.weight             squeezed to [channels, K], always F32
    Hk != Hv                              value heads reordered from grouped by key head to tiled
                                          in in_proj_qkv (V rows), in_proj_z, in_proj_a/b, A_log,
                                          dt_bias, the conv1d V channels and out_proj's columns

The state dict's A_log is the float32 neighbour of log(-ssm_a) whose torch exp gives back
ssm_a exactly (found for every value so far), so both sides decay by the same numbers.

Keys besides the common ones (Qwen3NextModel.set_gguf_parameters and the M-RoPE mixin):
ssm.{conv_kernel, state_size, group_count, time_step_rank, inner_size}, full_attention_interval,
rope.dimension_count (head_dim * partial_rotary) and rope.dimension_sections ([t, h, w, 0]).
`qwen35moe` (Qwen3.5-MoE, `Qwen3_5MoeTextConfig` -> `Qwen3_5MoeForCausalLM`) is the same stack
with an expert FFN in every layer: router `mlp.gate`, experts, `mlp.shared_expert` and its
`mlp.shared_expert_gate` [1, hidden]. The converter (Qwen2MoeModel.modify_tensors) splits
`mlp.experts.gate_up_proj` into ffn_gate_exps + ffn_up_exps, so the random weights are drawn
under the split names and moe.hf_state_dict joins them back; it writes the expert_* keys
and no feed_forward_length (the HF config has no intermediate_size).

This module imports nothing from the rest of the package; build.py calls it.
"""

from __future__ import annotations

from typing import Any

import gguf
import numpy as np
import torch

# Spec fields of this family (spec.TinySpec) and their defaults: 4 layers, so layers
# 0-2 are DeltaNet and layer 3 full attention.
DEFAULTS: dict[str, Any] = dict(
    layers=4,
    head_dim=32,
    rope_base=1e7,
    rms_eps=1e-6,
    tied=False,
    linear_k_heads=2,
    linear_v_heads=2,
    linear_k_dim=16,
    linear_v_dim=16,
    conv_kernel=4,
    full_attention_interval=4,
    partial_rotary=0.25,
)
KQUANT_DEFAULTS: dict[str, Any] = dict(head_dim=64, linear_v_dim=128)  # 256-wide rows
FAMILIES = ("qwen35", "qwen35moe")
MOE_DEFAULTS: dict[str, Any] = dict(experts=8, experts_used=2, expert_ffn=32, shared_ffn=32)
MOE_KQUANT_DEFAULTS: dict[str, Any] = dict(expert_ffn=256, shared_ffn=256)


def check(spec: Any, block: int) -> None:
    """ValueError unless the spec makes a Qwen3.5 model llama.cpp and transformers accept."""
    if spec.linear_v_heads % spec.linear_k_heads:
        raise ValueError("linear_v_heads must be a multiple of linear_k_heads")
    if spec.linear_v_heads * spec.linear_v_dim % block:
        raise ValueError(
            f"{spec.qtype} needs rows that are multiples of {block}: "
            f"linear_v_heads * linear_v_dim = {spec.linear_v_heads * spec.linear_v_dim}"
        )
    if spec.family == "qwen35moe":
        if not 0 < spec.experts_used <= spec.experts or spec.shared_ffn <= 0:
            raise ValueError("qwen35moe needs 0 < experts_used <= experts and a shared_ffn")
        for what in ("expert_ffn", "shared_ffn"):
            if getattr(spec, what) % block:
                raise ValueError(f"{spec.qtype} needs rows that are multiples of {block}: {what}")
    dims = rope_dims(spec)
    if dims < 2 or dims % 2:
        raise ValueError(f"head_dim * partial_rotary = {dims} rotary dims: want an even number")
    if spec.conv_kernel < 1 or spec.full_attention_interval < 1:
        raise ValueError("conv_kernel and full_attention_interval must be positive")


def rope_dims(spec: Any) -> int:
    return int(spec.head_dim * spec.partial_rotary)


def rope_sections(spec: Any) -> list[int]:
    """M-RoPE [t, h, w] sections over the rotary pairs, shaped like Qwen3.5's [11, 11, 10]."""
    pairs = rope_dims(spec) // 2
    w = pairs // 3
    h = (pairs - w) // 2
    return [pairs - h - w, h, w]


def layer_types(spec: Any) -> list[str]:
    return [
        "linear_attention" if (i + 1) % spec.full_attention_interval else "full_attention"
        for i in range(spec.layers)
    ]


def hf_shapes(spec: Any) -> dict[str, tuple[int, ...]]:
    """HF parameter name -> shape for Qwen3_5ForCausalLM."""
    h, f, d, v = spec.hidden, spec.ffn, spec.head_dim, spec.vocab_size
    key_dim = spec.linear_k_heads * spec.linear_k_dim
    value_dim = spec.linear_v_heads * spec.linear_v_dim
    channels = 2 * key_dim + value_dim
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if not spec.tied:
        shapes["lm_head.weight"] = (v, h)
    ffn = {"input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,)}
    if spec.family == "qwen35moe":
        ffn |= _moe_shapes(spec)
    else:
        ffn |= {"mlp.gate_proj.weight": (f, h), "mlp.up_proj.weight": (f, h)}
        ffn["mlp.down_proj.weight"] = (h, f)
    attention = {
        "self_attn.q_proj.weight": (2 * spec.heads * d, h),  # query and gate per head
        "self_attn.k_proj.weight": (spec.kv_heads * d, h),
        "self_attn.v_proj.weight": (spec.kv_heads * d, h),
        "self_attn.o_proj.weight": (h, spec.heads * d),
        "self_attn.q_norm.weight": (d,),
        "self_attn.k_norm.weight": (d,),
    }
    delta_net = {
        "linear_attn.in_proj_qkv.weight": (channels, h),
        "linear_attn.in_proj_z.weight": (value_dim, h),
        "linear_attn.in_proj_b.weight": (spec.linear_v_heads, h),
        "linear_attn.in_proj_a.weight": (spec.linear_v_heads, h),
        "linear_attn.A_log": (spec.linear_v_heads,),
        "linear_attn.dt_bias": (spec.linear_v_heads,),
        "linear_attn.conv1d.weight": (channels, 1, spec.conv_kernel),
        "linear_attn.norm.weight": (spec.linear_v_dim,),
        "linear_attn.out_proj.weight": (h, value_dim),
    }
    for i, kind in enumerate(layer_types(spec)):
        mixer = attention if kind == "full_attention" else delta_net
        shapes |= {f"model.layers.{i}.{name}": shape for name, shape in (ffn | mixer).items()}
    return shapes


def _moe_shapes(spec: Any) -> dict[str, tuple[int, ...]]:
    """One qwen35moe layer's FFN under the converter's names (experts split, see module doc)."""
    h, e, f, s = spec.hidden, spec.experts, spec.expert_ffn, spec.shared_ffn
    return {
        "mlp.gate.weight": (e, h),
        "mlp.experts.gate_proj.weight": (e, f, h),
        "mlp.experts.up_proj.weight": (e, f, h),
        "mlp.experts.down_proj.weight": (e, h, f),
        "mlp.shared_expert.gate_proj.weight": (s, h),
        "mlp.shared_expert.up_proj.weight": (s, h),
        "mlp.shared_expert.down_proj.weight": (h, s),
        "mlp.shared_expert_gate.weight": (1, h),
    }


def random_hf(
    spec: Any, hf_name: str, shape: tuple[int, ...], rng: np.random.Generator
) -> np.ndarray | None:
    """Values for the tensors whose scale is not a plain projection's; None for the rest."""
    if hf_name.endswith("A_log"):  # A in [0.02, 2]: decays from ~1 (long memory) to fast
        return np.log(rng.uniform(0.02, 2.0, shape)).astype(np.float32)
    if hf_name.endswith("dt_bias"):
        return rng.uniform(-1.0, 1.0, shape).astype(np.float32)
    if hf_name.endswith("conv1d.weight"):
        return (rng.standard_normal(shape) * spec.conv_kernel**-0.5).astype(np.float32)
    if hf_name.endswith("norm.weight"):  # zero-centred (1 + w) except the gated norm's
        base = 1.0 if hf_name.endswith("linear_attn.norm.weight") else 0.0
        return (base + rng.uniform(-0.3, 0.3, shape)).astype(np.float32)
    return None


def source_name(hf_name: str) -> str:
    """The name the converter looks up in gguf-py's tensor map (dt_bias is renamed first)."""
    if hf_name.endswith(".dt_bias"):
        return hf_name.removesuffix(".dt_bias") + ".dt_proj.bias"
    return hf_name


def to_gguf(spec: Any, hf_name: str, w: np.ndarray) -> np.ndarray:
    """The converter's modify_tensors for one HF tensor: the array it writes."""
    w = _reorder_v_heads(spec, hf_name, w, inverse=False)
    if hf_name.endswith(".A_log"):
        return (-torch.exp(torch.from_numpy(w))).numpy()
    if hf_name.endswith("conv1d.weight"):
        return w.squeeze(1)
    if _shifted(hf_name):
        return w + np.float32(1)
    return w


def from_gguf(spec: Any, hf_name: str, stored: np.ndarray) -> np.ndarray:
    """The HF tensor whose conversion is `stored` (dequantized, in HF shape)."""
    if hf_name.endswith(".A_log"):
        stored = _a_log_of(stored)
    elif _shifted(hf_name):
        stored = stored - np.float32(1)  # exact: stored values lie in [0.5, 2] (Sterbenz)
    return _reorder_v_heads(spec, hf_name, stored, inverse=True)


def write_metadata(w: gguf.GGUFWriter, spec: Any) -> None:
    if spec.family == "qwen35moe":  # TextModel, then Qwen2MoeModel.set_gguf_parameters
        w.add_expert_count(spec.experts)
        w.add_expert_used_count(spec.experts_used)
        w.add_expert_feed_forward_length(spec.expert_ffn)
        w.add_expert_shared_feed_forward_length(spec.shared_ffn)
    w.add_rope_dimension_sections([*rope_sections(spec), 0])
    w.add_ssm_conv_kernel(spec.conv_kernel)
    w.add_ssm_state_size(spec.linear_k_dim)
    w.add_ssm_group_count(spec.linear_k_heads)
    w.add_ssm_time_step_rank(spec.linear_v_heads)
    w.add_ssm_inner_size(spec.linear_v_heads * spec.linear_v_dim)
    w.add_full_attention_interval(spec.full_attention_interval)
    w.add_rope_dimension_count(rope_dims(spec))


def hf_config(spec: Any, common: dict[str, Any], rope: dict[str, Any]) -> dict[str, Any]:
    """The transformers twin's config.json: Qwen3_5TextConfig or Qwen3_5MoeTextConfig fields."""
    head = dict(model_type="qwen3_5_text", architectures=["Qwen3_5ForCausalLM"])
    if spec.family == "qwen35moe":
        head = dict(model_type="qwen3_5_moe_text", architectures=["Qwen3_5MoeForCausalLM"])
        common = {k: v for k, v in common.items() if k != "intermediate_size"}
        common |= dict(
            num_experts=spec.experts,
            num_experts_per_tok=spec.experts_used,
            moe_intermediate_size=spec.expert_ffn,
            shared_expert_intermediate_size=spec.shared_ffn,
        )
    return dict(
        **head,
        **common,
        linear_conv_kernel_dim=spec.conv_kernel,
        linear_key_head_dim=spec.linear_k_dim,
        linear_value_head_dim=spec.linear_v_dim,
        linear_num_key_heads=spec.linear_k_heads,
        linear_num_value_heads=spec.linear_v_heads,
        layer_types=layer_types(spec),
        rope_parameters=rope
        | {
            "partial_rotary_factor": spec.partial_rotary,
            "mrope_section": rope_sections(spec),
            "mrope_interleaved": True,
        },
    )


def _shifted(hf_name: str) -> bool:
    return hf_name.endswith("norm.weight") and not hf_name.endswith("linear_attn.norm.weight")


def _reorder_v_heads(spec: Any, hf_name: str, w: np.ndarray, *, inverse: bool) -> np.ndarray:
    """Value heads grouped by key head (HF) <-> tiled (llama.cpp), where the tensor has them."""
    hk, hv = spec.linear_k_heads, spec.linear_v_heads
    if hk == hv or ".linear_attn." not in hf_name:
        return w
    dv, v_start = spec.linear_v_dim, 2 * hk * spec.linear_k_dim
    part = hf_name.rsplit(".linear_attn.", 1)[1]
    if part in ("in_proj_qkv.weight", "conv1d.weight"):  # only the V rows / channels
        return np.concatenate([w[:v_start], _tile(w[v_start:], 0, hk, hv, dv, inverse)])
    if part == "in_proj_z.weight":
        return _tile(w, 0, hk, hv, dv, inverse)
    if part in ("in_proj_a.weight", "in_proj_b.weight", "A_log", "dt_bias"):
        return _tile(w, 0, hk, hv, 1, inverse)
    if part == "out_proj.weight":
        return _tile(w, 1, hk, hv, dv, inverse)
    return w  # norm.weight: one [Dv] vector shared by every head


def _tile(w: np.ndarray, axis: int, hk: int, hv: int, size: int, inverse: bool) -> np.ndarray:
    """Along `axis` ([hv * size]): [key head, group, size] -> [group, key head, size]."""
    a = np.moveaxis(w, axis, 0)
    outer = (hv // hk, hk) if inverse else (hk, hv // hk)
    a = a.reshape(*outer, size, *a.shape[1:]).swapaxes(0, 1).reshape(a.shape)
    return np.ascontiguousarray(np.moveaxis(a, 0, axis))


def _a_log_of(ssm_a: np.ndarray) -> np.ndarray:
    """A float32 A_log with -exp(A_log) == ssm_a under torch's float32 exp, searched among
    the neighbours of log(-ssm_a); the nearest value where none is exact."""
    nearest = np.log(-ssm_a.astype(np.float64)).astype(np.float32)
    out, found = nearest.copy(), np.zeros(ssm_a.shape, dtype=bool)
    candidates, lo, hi = [nearest], nearest, nearest
    for _ in range(4):
        lo, hi = np.nextafter(lo, np.float32(-np.inf)), np.nextafter(hi, np.float32(np.inf))
        candidates += [lo, hi]
    for c in candidates:
        exact = ~found & ((-torch.exp(torch.from_numpy(c))).numpy() == ssm_a)
        out[exact], found = c[exact], found | exact
    return out
