"""Gemma 4 family (text model, dense): Gemma 3's sliding / full interleave and norm
sandwich, plus:

- full layers with their own head dim and KV head count, "proportional" partial RoPE
  (only the first pairs of the head rotate, at frequencies of the whole head) and,
  where the file has no `attn_v`, K = V (the raw K projection is the value);
- a scale-free RMSNorm on V, RMSNorm on Q and K, attention scale 1;
- KV sharing: the last `shared_kv_layers` layers compute no K/V and attend to the K/V
  of the last non-shared layer of their kind (`GGUFFile.kv_sources`);
- per-layer embeddings (PLE): a second table, [vocab, layers * P], plus a projection of
  the scaled token embedding, give every layer a P-wide input per token; after the FFN
  a layer adds post_norm(proj(gelu(gate(x)) * input)) to its residual;
- a learned scalar on each layer's output, final logit softcapping.

- the optional MoE block (`enable_moe_block`), in parallel with the dense MLP in every
  layer; with x the residual after attention::

      mlp = post_ffw_norm_1(GeGLU(ffn_norm(x)))
      ids, w = top-k of softmax(ffn_gate_inp(rms_norm(x) * ffn_gate_inp.scale / sqrt(hidden))),
               renormalised, times ffn_down_exps.scale[ids]        (per-expert scale)
      moe = post_ffw_norm_2(Σ w · expert(pre_ffw_norm_2(x)))      GeGLU experts (tanh GELU)
      x  += post_ffw_norm(mlp + moe)

  on `luced.runtime.moe`'s `route` and `expert_mix`; the file stores the experts' gate and
  up stacks fused (ffn_gate_up_exps), as transformers holds them.

transformers' `Gemma4TextModel` is the reference.

GGUF conventions (llama.cpp's converter): norms are stored as they are (Gemma 4's RMSNorm
multiplies by w, not 1 + w); `attention.key_length` is the full layers' head dim,
`key_length_swa` the sliding layers'; `head_count_kv` and `feed_forward_length` may be
per-layer arrays (num_global_key_value_heads, the double-wide MLP of shared layers);
`sliding_window_pattern` is per-layer flags; proportional RoPE is `rope_freqs` holding 1
for rotated pairs and 1e30 for the rest, so their frequencies vanish (full layers only).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from luced.gguf_file import GGUFFile
from luced.runtime import moe
from luced.runtime.families import common, gemma3
from luced.runtime.families.common import ModelParts
from luced.runtime.layers import Rope, apply_rope, geglu_tanh, linear, rms_norm, rope_inv_freq

if TYPE_CHECKING:
    from luced.runtime.kv_cache import KVCache
    from luced.runtime.ragged import Ragged

ARCH = "gemma4"

LAYER_TENSORS = {
    "attn_norm": "attn_norm.weight",
    "attn_q": "attn_q.weight",
    "attn_q_norm": "attn_q_norm.weight",
    "attn_output": "attn_output.weight",
    "post_attn_norm": "post_attention_norm.weight",
    "ffn_norm": "ffn_norm.weight",
    "ffn_gate": "ffn_gate.weight",
    "ffn_up": "ffn_up.weight",
    "ffn_down": "ffn_down.weight",
    "post_ffn_norm": "post_ffw_norm.weight",
    "out_scale": "layer_output_scale.weight",
}
KV_TENSORS = {"attn_k": "attn_k.weight", "attn_k_norm": "attn_k_norm.weight"}
PLE_TENSORS = {
    "ple_gate": "inp_gate.weight",
    "ple_proj": "proj.weight",
    "ple_post_norm": "post_norm.weight",
}
MATRICES = {
    "attn_q",
    "attn_k",
    "attn_v",
    "attn_output",
    "ffn_gate",
    "ffn_up",
    "ffn_down",
    "ple_gate",
    "ple_proj",
}

# The MoE block's tensors besides moe.layer_tensors' (router, experts): vectors.
MOE_TENSORS = {
    "moe_router_scale": "ffn_gate_inp.scale",  # [hidden]
    "moe_expert_scale": "ffn_down_exps.scale",  # [E]: per_expert_scale
    "moe_pre_norm": "pre_ffw_norm_2.weight",
    "mlp_post_norm": "post_ffw_norm_1.weight",
    "moe_post_norm": "post_ffw_norm_2.weight",
}

DEFAULT_LOCAL_ROPE_BASE = 10000.0


@dataclass(frozen=True)
class Gemma4Config(common.ModelConfig):
    # Base fields describe the sliding layers (head_dim and ffn of layer 0; per-layer KV
    # heads as common reads them);
    # rope_base / rope_dims the full layers'. Tuples hold one entry per layer.
    sliding_window: int = 512
    sliding_layers: tuple[bool, ...] = ()
    local_rope_base: float = DEFAULT_LOCAL_ROPE_BASE
    local_rope_dims: int = 0
    layer_head_dims: tuple[int, ...] = ()
    layer_ffn: tuple[int, ...] = ()
    kv_sources: tuple[int, ...] = ()  # the layer whose K/V each layer reads (itself if own)
    k_eq_v: tuple[bool, ...] = ()  # V is the K projection (no attn_v)
    ple_dim: int = 0  # per-layer embedding width P; 0 = no PLE
    has_rope_factors: bool = False
    final_softcap: float | None = None
    moe: moe.MoeConfig = field(default_factory=moe.MoeConfig)  # n_experts 0: no MoE block

    def __post_init__(self) -> None:
        super().__post_init__()
        per_layer = ("sliding_layers", "layer_head_dims", "layer_ffn")
        for name in (*per_layer, "kv_sources", "k_eq_v"):
            if len(getattr(self, name)) != self.n_layers:
                raise ValueError(f"{name} has {len(getattr(self, name))} entries")

    def kv_shape(self, layer: int) -> tuple[int, int]:
        return self.kv_heads(layer), self.layer_head_dims[layer]

    def kv_source(self, layer: int) -> int:
        return self.kv_sources[layer]


def config_from_gguf(gguf: GGUFFile) -> Gemma4Config:
    arch = gguf.arch

    def get(name: str, default: Any = None) -> Any:
        return gguf.get(f"{arch}.{name}", default)

    experts = moe.MoeConfig()
    if get("expert_count") or any(n.endswith("ffn_gate_inp.weight") for n in gguf.tensors):
        experts = moe.config_from_gguf(
            gguf, gating="softmax", normalize=True, fused_gate_up=True, act="gelu_tanh"
        )
    n_layers = int(gguf.require(f"{arch}.block_count"))
    sliding = gguf.sliding_layers()
    full_dim = int(gguf.require(f"{arch}.attention.key_length"))
    swa_dim = int(get("attention.key_length_swa", full_dim))
    head_dims = tuple(swa_dim if s else full_dim for s in sliding)
    ffn = gguf.layer_counts("feed_forward_length")
    sources = gguf.kv_sources()
    kv_sources = tuple(sources.get(i, i) for i in range(n_layers))
    # The converter writes no attn_v where attention_k_eq_v holds (full layers only).
    k_eq_v = tuple(
        kv_sources[i] == i and not sliding[i] and f"blk.{i}.attn_v.weight" not in gguf.tensors
        for i in range(n_layers)
    )
    softcap = get("final_logit_softcapping")
    cfg = common.make_config(
        Gemma4Config,
        gguf,
        known={"head_dim": head_dims[0], "ffn": ffn[0]},
        sliding_window=int(get("attention.sliding_window", 512)),
        sliding_layers=sliding,
        local_rope_base=float(get("rope.freq_base_swa", DEFAULT_LOCAL_ROPE_BASE)),
        local_rope_dims=int(get("rope.dimension_count_swa", swa_dim)),
        layer_head_dims=head_dims,
        layer_ffn=ffn,
        kv_sources=kv_sources,
        k_eq_v=k_eq_v,
        ple_dim=int(get("embedding_length_per_layer_input", 0)),
        has_rope_factors="rope_freqs.weight" in gguf.tensors,
        final_softcap=float(softcap) if softcap else None,
        moe=experts,
    )
    if experts.n_experts:
        moe.check_tensors(gguf, experts, cfg.hidden, range(n_layers))
    return cfg


def weight_plan(
    cfg: Gemma4Config, layers: range, owns_embed: bool, owns_head: bool
) -> dict[str, tuple[str, bool]]:
    # Every shard with PLE layers embeds the tokens itself: the per-layer inputs project
    # the scaled token embedding.
    ple = cfg.ple_dim > 0 and len(layers) > 0
    plan = common.edge_plan(cfg, owns_embed or ple, owns_head)
    for i in layers:
        names = dict(LAYER_TENSORS)
        if cfg.kv_sources[i] == i:
            names |= KV_TENSORS
            if not cfg.k_eq_v[i]:
                names["attn_v"] = "attn_v.weight"
        if cfg.ple_dim:
            names |= PLE_TENSORS
        matrices = MATRICES
        if cfg.moe.n_experts:
            moe_names, moe_matrices = moe.layer_tensors(cfg.moe)
            names |= moe_names | MOE_TENSORS
            matrices = MATRICES | moe_matrices
        plan |= common.layer_plan(range(i, i + 1), names, matrices)
    if ple:
        plan["ple_tok"] = ("per_layer_token_embd.weight", False)  # gathered rows, like tok_embd
        plan["ple_model_proj"] = ("per_layer_model_proj.weight", True)
        plan["ple_proj_norm"] = ("per_layer_proj_norm.weight", False)
    if cfg.has_rope_factors and layers:
        plan["rope_freqs"] = ("rope_freqs.weight", False)
    return plan


def prepare(cfg: Gemma4Config, weights: dict[str, torch.Tensor]) -> None:
    """Nothing to undo: Q/K rows are in Hugging Face order, norms are stored as they act."""


def ropes(cfg: Gemma4Config, weights: dict[str, torch.Tensor], device: torch.device) -> dict:
    local = Rope(rope_inv_freq(cfg.local_rope_dims, cfg.local_rope_base).to(device))
    # rope_freqs (1e30 past the rotated pairs) turns the full layers' RoPE proportional.
    factors = weights.get("rope_freqs")
    full = Rope(rope_inv_freq(cfg.rope_dims, cfg.rope_base, factors=factors).to(device))
    return {i: local if sliding else full for i, sliding in enumerate(cfg.sliding_layers)}


embed = gemma3.embed
project = gemma3.project
head = gemma3.head


def layer_inputs(model: ModelParts, ids: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """The per-layer inputs of every layer, {"ple": [n, n_layers, P]}:
    (norm(embed(ids) @ W_proj / sqrt(hidden)) + table[ids] * sqrt(P)) / sqrt(2).

    Every shard computes all layers' columns (the same ops whatever the split, so split
    and unsplit agree bit for bit) and reads its own."""
    cfg: Gemma4Config = model.cfg
    if not cfg.ple_dim:
        return {}
    if ids is None:
        raise ValueError("gemma4's per-layer embeddings need the token ids in every shard")
    w, p = model.weights, cfg.ple_dim
    x = embed(model, ids)
    n = x.shape[0]
    proj = linear(x, w["ple_model_proj"]) * cfg.hidden**-0.5
    proj = rms_norm(proj.view(n, cfg.n_layers, p), w["ple_proj_norm"], cfg.rms_eps)
    rows = w["ple_tok"][ids]
    tok = rows * torch.tensor(math.sqrt(p), dtype=rows.dtype)  # scale rounded like HF's
    return {"ple": (proj + tok.view(n, cfg.n_layers, p)) * 2**-0.5}


def _attention(
    model: ModelParts, layer: int, x: torch.Tensor, start: int | Ragged, cache: KVCache | Ragged
) -> torch.Tensor:
    cfg: Gemma4Config = model.cfg
    w, eps, n = model.weights, cfg.rms_eps, x.shape[0]
    heads, dim = cfg.kv_shape(layer)
    cos, sin = model.ropes[layer].tables(start, n, x.dtype)
    q = linear(x, w[f"{layer}.attn_q"]).view(n, cfg.n_heads, dim)
    q = apply_rope(rms_norm(q, w[f"{layer}.attn_q_norm"], eps), cos, sin)
    kv = None
    if cfg.kv_sources[layer] == layer:  # else attend to the source layer's cached K/V
        k = linear(x, w[f"{layer}.attn_k"]).view(n, heads, dim)
        v = k if cfg.k_eq_v[layer] else linear(x, w[f"{layer}.attn_v"]).view(n, heads, dim)
        k = apply_rope(rms_norm(k, w[f"{layer}.attn_k_norm"], eps), cos, sin)
        kv = (k, rms_norm(v, None, eps))
    window = cfg.sliding_window if cfg.sliding_layers[layer] else None
    # Q and K are RMS-normed, so scores are not scaled by 1/sqrt(D).
    out = common.cached_attention(layer, q, start, cache, kv, window=window, scale=1.0)
    return linear(out, w[f"{layer}.attn_output"])


def block(
    model: ModelParts,
    layer: int,
    x: torch.Tensor,
    start: int | Ragged,
    cache: KVCache | Ragged,
    ple: torch.Tensor | None = None,
) -> torch.Tensor:
    w, eps = model.weights, model.cfg.rms_eps
    h = _attention(model, layer, rms_norm(x, w[f"{layer}.attn_norm"], eps), start, cache)
    x = x + rms_norm(h, w[f"{layer}.post_attn_norm"], eps)
    x = _moe_ffn(model, layer, x) if model.cfg.moe.n_experts else gemma3.ffn(model, layer, x)
    if ple is not None:
        g = F.gelu(linear(x, w[f"{layer}.ple_gate"]), approximate="tanh") * ple[:, layer]
        x = x + rms_norm(linear(g, w[f"{layer}.ple_proj"]), w[f"{layer}.ple_post_norm"], eps)
    return x * w[f"{layer}.out_scale"]


def _moe_ffn(model: ModelParts, layer: int, x: torch.Tensor) -> torch.Tensor:
    """The FFN half with the MoE block beside the dense MLP (module docstring)."""
    cfg: Gemma4Config = model.cfg
    w, eps, p = model.weights, cfg.rms_eps, f"{layer}."
    h = rms_norm(x, w[p + "ffn_norm"], eps)
    mlp = geglu_tanh(h, w[p + "ffn_gate"], w[p + "ffn_up"], w[p + "ffn_down"])
    router_in = rms_norm(x, None, eps) * w[p + "moe_router_scale"] * cfg.hidden**-0.5
    ids, mix = moe.route(linear(router_in, w[p + "ffn_gate_inp"]), cfg.moe)
    mix = mix * w[p + "moe_expert_scale"].float()[ids]
    routed_in = rms_norm(x, w[p + "moe_pre_norm"], eps)
    routed = moe.routed_mix(routed_in, ids, mix, w, layer, cfg.moe, moe.model_split(model))
    h = rms_norm(mlp, w[p + "mlp_post_norm"], eps) + rms_norm(routed, w[p + "moe_post_norm"], eps)
    return x + rms_norm(h, w[p + "post_ffn_norm"], eps)
