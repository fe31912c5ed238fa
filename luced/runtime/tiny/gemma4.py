"""The tiny `gemma4` model: a GGUF as llama.cpp's converter writes it (`Gemma4Model` in
conversion/gemma.py) and the `Gemma4ForCausalLM` twin holding the same weights.

    tiny = make_tiny_gguf("gemma4", path, seed=3, shared_layers=3, k_eq_v=False)

Default shape (6 layers, sliding window 8): layer i is full attention iff (i + 1) % swa_period
== 0 (period 3: S S F S S F; transformers forces the last layer full), the last `shared_layers`
(3) layers reuse the KV of the last non-shared layer of their kind (layers 3 and 4 read 1,
layer 5 reads 2), full layers have head dim `global_head_dim` and, with `k_eq_v`, K = V and
`global_kv_heads` KV heads; per-layer embeddings of width `ple_dim`; final softcap 30.
The KV-sharing cut falls after a whole period (a sliding then a full layer end the unshared
ones), as in the released E2B and E4B: llama.cpp's loader takes the last unshared layer as the
full layers' source and the one before it as the sliding layers', and asserts on any other cut.

What the converter does, and so this file: norms stored as they are (no + 1); the full
layers' head dim in `attention.key_length`, the sliding layers' in `key_length_swa`;
`head_count_kv` a per-layer array when num_global_key_value_heads is set (with k_eq_v),
`feed_forward_length` one when the shared layers' MLP is double wide; `sliding_window_pattern`
per-layer flags; `rope_freqs.weight` = 1 for the rotated pairs of proportional RoPE and 1e30
for the rest (full layers); `layer_scalar` becomes `layer_output_scale.weight`; no `attn_v`
where K = V, no K/V tensors in KV-shared layers (transformers has none). With `experts` > 0 the
MoE block is on (enable_moe_block): `router.scale` becomes `ffn_gate_inp.scale`,
`router.per_expert_scale` `ffn_down_exps.scale`, the experts stay fused (`ffn_gate_up_exps`),
the router `ffn_gate_inp` stays F32, and the expert_* keys are written. The vocabulary is
Gemma's SentencePiece one, as `tokenizer.ggml.model = gemma4` with merges.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from luced.runtime.tiny.spec import QTYPES, TinyModel, TinySpec, as_f32, check_rows, hf_common
from luced.runtime.tiny.vocab import Vocab, make_vocab, write_vocab
from luced.runtime.tiny.weights import add_tensor, random_hf, write_out

FAMILY = "gemma4"
_MOE_SCALES = {"scale": "ffn_gate_inp.scale", "per_expert_scale": "ffn_down_exps.scale"}
LOCAL_ROPE_BASE = 10000.0  # rope_parameters["sliding_attention"]


@dataclass(frozen=True)
class Gemma4Spec(TinySpec):
    """TinySpec's fields describe the sliding layers; these the rest of Gemma 4."""

    swa_period: int = 3  # layer i is full iff (i + 1) % swa_period == 0, and the last one
    global_head_dim: int = 32
    global_kv_heads: int = 1  # KV heads of full layers; only with k_eq_v
    k_eq_v: bool = True  # attention_k_eq_v: full layers have no v_proj
    shared_layers: int = 3  # num_kv_shared_layers
    ple_dim: int = 32  # hidden_size_per_layer_input; 0 = no per-layer embeddings
    double_wide: bool = False  # use_double_wide_mlp: KV-shared layers have 2 * ffn
    final_softcap: float | None = 30.0
    partial_rotary: float = 0.25  # of the full layers' proportional RoPE
    # experts / experts_used / expert_ffn (TinySpec's): experts > 0 turns the MoE block on

    @property
    def layer_types(self) -> list[str]:
        full = [(i + 1) % self.swa_period == 0 or i == self.layers - 1 for i in range(self.layers)]
        return ["full_attention" if f else "sliding_attention" for f in full]


DEFAULTS: dict[str, Any] = dict(
    hidden=64,
    layers=6,
    heads=4,
    kv_heads=2,
    head_dim=16,
    ffn=128,
    vocab_size=640,
    context=512,
    rope_base=1e6,
    rms_eps=1e-6,
    tied=True,
    sliding_window=8,
)
KQUANT_DEFAULTS = dict(hidden=256, ffn=512, head_dim=64, global_head_dim=128, ple_dim=256)


def make_spec(qtype: str, seed: int, overrides: dict[str, Any]) -> Gemma4Spec:
    """The spec (qtype already checked), or ValueError."""
    values = dict(DEFAULTS, name=f"tiny-{FAMILY}")
    if QTYPES[qtype][2] == 256:
        values.update(KQUANT_DEFAULTS)
    values.update(overrides)
    unknown = set(values) - {f.name for f in fields(Gemma4Spec)} - {"family", "qtype", "seed"}
    if unknown:
        raise ValueError(f"unknown overrides {sorted(unknown)}")
    spec = Gemma4Spec(family=FAMILY, qtype=qtype, seed=seed, **values)
    rows = {
        "hidden": spec.hidden,
        "ffn": spec.ffn,
        "heads * head_dim": spec.heads * spec.head_dim,
        "heads * global_head_dim": spec.heads * spec.global_head_dim,
        "ple_dim": spec.ple_dim,
        "expert_ffn": spec.expert_ffn,
    }
    check_rows(qtype, rows)
    kv = (spec.kv_heads, spec.global_kv_heads if spec.k_eq_v else spec.kv_heads)
    if any(spec.heads % k for k in kv) or spec.head_dim % 2 or spec.global_head_dim % 2:
        raise ValueError("heads must be a multiple of the kv heads, head dims even")
    if not 0 <= spec.shared_layers < spec.layers:
        raise ValueError(f"shared_layers must lie in [0, {spec.layers})")
    first_shared = spec.layers - spec.shared_layers
    if spec.shared_layers and set(spec.layer_types[first_shared:]) - set(
        spec.layer_types[:first_shared]
    ):
        raise ValueError("every kind of KV-shared layer needs a non-shared layer of its kind")
    if spec.shared_layers and spec.layer_types[first_shared - 2 : first_shared] != [
        "sliding_attention",
        "full_attention",
    ]:
        raise ValueError(
            "the KV-shared layers must follow a sliding then a full layer (a whole period), "
            "as llama.cpp reads them"
        )
    return spec


def hf_config(spec: Gemma4Spec, vocab: Vocab) -> dict[str, Any]:
    """The transformers twin's config.json: Gemma4TextConfig fields."""
    extra = {"num_global_key_value_heads": spec.global_kv_heads} if spec.k_eq_v else {}
    if spec.experts:
        extra |= dict(
            enable_moe_block=True,
            num_experts=spec.experts,
            top_k_experts=spec.experts_used,
            moe_intermediate_size=spec.expert_ffn,
        )
    return dict(
        model_type="gemma4_text",
        architectures=["Gemma4ForCausalLM"],
        **hf_common(spec, vocab),
        global_head_dim=spec.global_head_dim,
        attention_k_eq_v=spec.k_eq_v,
        hidden_activation="gelu_pytorch_tanh",
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": LOCAL_ROPE_BASE},
            "full_attention": {
                "rope_type": "proportional",
                "partial_rotary_factor": spec.partial_rotary,
                "rope_theta": as_f32(spec.rope_base),
            },
        },
        sliding_window=spec.sliding_window,
        layer_types=spec.layer_types,
        final_logit_softcapping=spec.final_softcap,
        num_kv_shared_layers=spec.shared_layers,
        hidden_size_per_layer_input=spec.ple_dim,
        vocab_size_per_layer_input=spec.vocab_size,
        use_double_wide_mlp=spec.double_wide,
        **extra,
    )


def hf_shapes(spec: Gemma4Spec) -> dict[str, tuple[int, ...]]:
    """Parameter (and persistent buffer) name -> shape of the transformers model."""
    h, v, p, e = spec.hidden, spec.vocab_size, spec.ple_dim, spec.experts
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if not spec.tied:
        shapes["lm_head.weight"] = (v, h)
    if p:  # per-layer embeddings: one p-wide slice per layer
        shapes["model.embed_tokens_per_layer.weight"] = (v, spec.layers * p)
        shapes["model.per_layer_model_projection.weight"] = (spec.layers * p, h)
        shapes["model.per_layer_projection_norm.weight"] = (p,)
    first_shared = spec.layers - spec.shared_layers
    for i, kind in enumerate(spec.layer_types):
        full = kind == "full_attention"
        d = spec.global_head_dim if full else spec.head_dim
        kv = (spec.global_kv_heads if spec.k_eq_v else spec.kv_heads) if full else spec.kv_heads
        f = 2 * spec.ffn if spec.double_wide and i >= first_shared else spec.ffn
        layer = {"layer_scalar": (1,), "self_attn.q_proj.weight": (spec.heads * d, h)}
        layer |= {"self_attn.q_norm.weight": (d,), "self_attn.o_proj.weight": (h, spec.heads * d)}
        if i < first_shared:  # a KV-shared layer has no K/V of its own
            layer |= {"self_attn.k_proj.weight": (kv * d, h), "self_attn.k_norm.weight": (d,)}
            if not (full and spec.k_eq_v):
                layer["self_attn.v_proj.weight"] = (kv * d, h)
        layer |= {"mlp.gate_proj.weight": (f, h), "mlp.up_proj.weight": (f, h)}
        layer["mlp.down_proj.weight"] = (h, f)
        norms = ["input_layernorm", "post_attention_layernorm"]
        norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
        if p:
            layer |= {"per_layer_input_gate.weight": (p, h), "per_layer_projection.weight": (h, p)}
            norms.append("post_per_layer_input_norm")
        if e:
            g = spec.expert_ffn
            layer |= {"router.scale": (h,), "router.per_expert_scale": (e,)}
            layer |= {"router.proj.weight": (e, h), "experts.gate_up_proj": (e, 2 * g, h)}
            layer["experts.down_proj"] = (e, h, g)
            norms += ["post_feedforward_layernorm_1", "post_feedforward_layernorm_2"]
            norms.append("pre_feedforward_layernorm_2")
        layer |= {f"{norm}.weight": (h,) for norm in norms}
        shapes |= {f"model.layers.{i}.{name}": shape for name, shape in layer.items()}
    return shapes


def _write_metadata(w: gguf.GGUFWriter, spec: Gemma4Spec, vocab: Vocab) -> None:
    """The keys TextModel, Gemma3Model and Gemma4Model.set_gguf_parameters leave, in order."""
    sliding = [t == "sliding_attention" for t in spec.layer_types]
    first_shared = spec.layers - spec.shared_layers
    w.add_type(gguf.GGUFType.MODEL)
    w.add_name(spec.name)
    w.add_block_count(spec.layers)
    w.add_context_length(spec.context)
    w.add_embedding_length(spec.hidden)
    if spec.double_wide:
        w.add_feed_forward_length(
            [spec.ffn if i < first_shared else 2 * spec.ffn for i in range(spec.layers)]
        )
    else:
        w.add_feed_forward_length(spec.ffn)
    w.add_head_count(spec.heads)
    if spec.k_eq_v:  # num_global_key_value_heads is set
        w.add_head_count_kv([spec.kv_heads if s else spec.global_kv_heads for s in sliding])
    else:
        w.add_head_count_kv(spec.kv_heads)
    w.add_rope_freq_base(spec.rope_base)
    w.add_rope_freq_base_swa(LOCAL_ROPE_BASE)
    w.add_layer_norm_rms_eps(spec.rms_eps)
    w.add_key_length(spec.global_head_dim)
    w.add_value_length(spec.global_head_dim)
    w.add_file_type(QTYPES[spec.qtype][1])
    if spec.final_softcap:
        w.add_final_logit_softcapping(spec.final_softcap)
    w.add_sliding_window(spec.sliding_window)
    w.add_shared_kv_layers(spec.shared_layers)
    w.add_embedding_length_per_layer_input(spec.ple_dim)
    w.add_sliding_window_pattern(sliding)
    w.add_key_length_swa(spec.head_dim)
    w.add_value_length_swa(spec.head_dim)
    w.add_rope_dimension_count(spec.global_head_dim)  # proportional: rope_freqs does the rest
    w.add_rope_dimension_count_swa(spec.head_dim)
    if spec.experts:
        w.add_expert_count(spec.experts)
        w.add_expert_used_count(spec.experts_used)
        w.add_expert_feed_forward_length(spec.expert_ffn)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    write_vocab(w, vocab)


def rope_freqs(spec: Gemma4Spec) -> np.ndarray:
    """Gemma4Model.generate_extra_tensors: 1 for the rotated pairs, 1e30 for the others."""
    n_rot = int(spec.global_head_dim * spec.partial_rotary / 2)
    return np.array([1.0] * n_rot + [1e30] * (spec.global_head_dim // 2 - n_rot), np.float32)


def build(path: Path, *, seed: int = 0, qtype: str = "F32", **overrides: Any) -> TinyModel:
    spec = make_spec(qtype, seed, overrides)
    vocab = make_vocab(FAMILY, spec.vocab_size)
    tensor_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA4, spec.layers)
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(path, FAMILY)
    _write_metadata(writer, spec, vocab)
    writer.add_tensor("rope_freqs.weight", rope_freqs(spec))  # generate_extra_tensors: first

    state_dict: dict[str, torch.Tensor] = {}
    for hf_name, shape in sorted(hf_shapes(spec).items()):
        # filter_tensors: `layer_scalar` (a buffer) gets a ".weight" to map as layer_output_scale
        suffixed = hf_name if hf_name.endswith(".weight") else f"{hf_name}.weight"
        gguf_name = _MOE_SCALES.get(hf_name.rsplit(".", 1)[-1])  # modify_tensors' renames
        if gguf_name is not None:
            gguf_name = f"blk.{hf_name.split('.')[2]}.{gguf_name}"
        else:
            gguf_name = tensor_map.get_name(suffixed, try_suffixes=(".weight",))
        if gguf_name is None:
            raise AssertionError(f"gguf-py has no name for {hf_name}")
        back = add_tensor(writer, spec, gguf_name, hf_name, random_hf(spec, hf_name, shape))
        state_dict[hf_name] = torch.from_numpy(np.ascontiguousarray(back))
    if spec.tied:
        state_dict["lm_head.weight"] = state_dict["model.embed_tokens.weight"]
    write_out(writer)
    return TinyModel(path, FAMILY, spec, hf_config(spec, vocab), state_dict)
