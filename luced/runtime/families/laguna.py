"""Laguna family (Poolside Laguna-XS.2 / M.1): per-layer query-head counts, per-head Q/K
RMSNorm, a softplus output gate on attention, full-attention layers with YaRN on a partial
rotary slice, sliding-window layers with plain RoPE, leading dense SwiGLU layers, then MoE
layers (`luced.runtime.moe`): sigmoid router whose score bias picks experts without weighting
them, sum-normalised weights times the routed scaling factor, plus one shared expert.

GGUF conventions (llama.cpp's conversion/laguna.py and src/models/laguna.cpp; gguf-py 0.19
has no `laguna` entry, so everything is matched by string):
- `laguna.attention.head_count` is a per-layer array (KV heads are uniform);
- layer i is full attention iff i % 4 == 0 (no sliding_window_pattern key is written; an
  explicit one is honoured) and every layer is full when there is no sliding_window;
- full layers: rope.freq_base, rope.dimension_count and the rope.scaling.* YaRN keys;
  sliding layers: rope.freq_base_swa and rope.dimension_count_swa, no scaling;
- the attention gate `attn_gate` has n_head rows (one gate per head) or n_head * head_dim
  (one per element); its width decides, as in llama.cpp;
- the first leading_dense_block_count layers have ffn_gate/up/down, the rest experts;
- RoPE is NEOX (no Q/K row permutation) and norms are stored as they are.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from luced.gguf_file import GGUFFile
from luced.runtime import moe
from luced.runtime.families import common, llama
from luced.runtime.families.common import ModelParts
from luced.runtime.layers import Rope, linear, rms_norm, rope_inv_freq, yarn_inv_freq, yarn_mscale

if TYPE_CHECKING:
    from luced.runtime.kv_cache import KVStore
    from luced.runtime.ragged import Ragged

ARCH = "laguna"
FUSED = llama.FUSED  # `common.attend`; the dense layers' FFN is `llama.dense_ffn`

ATTENTION_TENSORS = {
    "attn_norm": "attn_norm.weight",
    "attn_q": "attn_q.weight",
    "attn_k": "attn_k.weight",
    "attn_v": "attn_v.weight",
    "attn_q_norm": "attn_q_norm.weight",
    "attn_k_norm": "attn_k_norm.weight",
    "attn_gate": "attn_gate.weight",
    "attn_output": "attn_output.weight",
    "ffn_norm": "ffn_norm.weight",
}
ATTENTION_MATRICES = {"attn_q", "attn_k", "attn_v", "attn_gate", "attn_output"}
DENSE_TENSORS = {"ffn_gate": "ffn_gate.weight", "ffn_up": "ffn_up.weight"}
DENSE_TENSORS |= {"ffn_down": "ffn_down.weight"}

SWA_PERIOD = 4  # llama.cpp's default: full, sliding, sliding, sliding, ...
DEFAULT_SWA_ROPE_BASE = 10000.0


@dataclass(frozen=True)
class LagunaConfig(common.ModelConfig):
    sliding_window: int = 0  # 0: every layer is full attention
    sliding_layers: tuple[bool, ...] = ()
    swa_rope_base: float = DEFAULT_SWA_ROPE_BASE
    swa_rope_dims: int = 0
    yarn_factor: float = 1.0  # 1: plain RoPE on full layers
    yarn_original_context: int = 0
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_attn_factor: float = 0.0  # 0: YaRN's default 0.1 ln(factor) + 1
    dense_layers: int = 1  # leading dense FFN layers
    moe: moe.MoeConfig = field(default_factory=moe.MoeConfig)  # from the expert_* keys

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.yarn_factor > 1 and self.yarn_original_context <= 0:
            raise ValueError("YaRN needs rope.scaling.original_context_length")
        if len(self.sliding_layers) != self.n_layers:
            raise ValueError(f"{len(self.sliding_layers)} layer types for {self.n_layers} layers")


def config_from_gguf(gguf: GGUFFile) -> LagunaConfig:
    def get(name: str, default: Any = None) -> Any:
        return gguf.get(f"{ARCH}.{name}", default)

    base = common.base_fields(gguf)
    n_layers = base["n_layers"]
    window = int(get("attention.sliding_window", 0))
    sliding = gguf.sliding_layers(SWA_PERIOD, full_first=True) if window else (False,) * n_layers
    dense = int(get("leading_dense_block_count", 0))
    yarn = get("rope.scaling.type") == "yarn"
    experts = moe.config_from_gguf(gguf, gating="sigmoid", selection_bias=True)
    cfg = common.make_config(
        LagunaConfig,
        gguf,
        sliding_window=window,
        sliding_layers=sliding,
        swa_rope_base=float(get("rope.freq_base_swa", DEFAULT_SWA_ROPE_BASE)),
        swa_rope_dims=int(get("rope.dimension_count_swa", base["head_dim"])),
        yarn_factor=float(get("rope.scaling.factor", 1.0)) if yarn else 1.0,
        yarn_original_context=int(get("rope.scaling.original_context_length", 0)),
        yarn_beta_fast=float(get("rope.scaling.yarn_beta_fast", 32.0)),
        yarn_beta_slow=float(get("rope.scaling.yarn_beta_slow", 1.0)),
        yarn_attn_factor=float(get("rope.scaling.yarn_attn_factor", 0.0)),
        dense_layers=dense,
        moe=experts,
    )
    moe.check_tensors(gguf, experts, cfg.hidden, _moe_layers(cfg, range(n_layers)))
    return cfg


def _moe_layers(cfg: LagunaConfig, layers: range) -> range:
    return range(max(layers.start, cfg.dense_layers), layers.stop)


def weight_plan(
    cfg: LagunaConfig, layers: range, owns_embed: bool, owns_head: bool
) -> dict[str, tuple[str, bool]]:
    moe_layers = _moe_layers(cfg, layers)
    dense_layers = range(layers.start, moe_layers.start)
    names, matrices = moe.layer_tensors(cfg.moe)
    plan = common.edge_plan(cfg, owns_embed, owns_head)
    plan |= common.layer_plan(layers, ATTENTION_TENSORS, ATTENTION_MATRICES)
    plan |= common.layer_plan(dense_layers, DENSE_TENSORS, set(DENSE_TENSORS))
    return plan | common.layer_plan(moe_layers, names, matrices)


def prepare(cfg: LagunaConfig, weights: dict[str, torch.Tensor]) -> None:
    moe.prepare_layers(weights, range(cfg.dense_layers, cfg.n_layers))


def ropes(cfg: LagunaConfig, weights: dict[str, torch.Tensor], device: torch.device) -> dict:
    local = Rope(rope_inv_freq(cfg.swa_rope_dims, cfg.swa_rope_base).to(device))
    if cfg.yarn_factor > 1:
        inv = yarn_inv_freq(
            cfg.rope_dims,
            cfg.rope_base,
            cfg.yarn_factor,
            cfg.yarn_original_context,
            cfg.yarn_beta_fast,
            cfg.yarn_beta_slow,
        )
        scale = cfg.yarn_attn_factor or yarn_mscale(cfg.yarn_factor)
        full = Rope(inv.to(device), scale=scale)
    else:
        full = Rope(rope_inv_freq(cfg.rope_dims, cfg.rope_base).to(device))
    return {i: local if sliding else full for i, sliding in enumerate(cfg.sliding_layers)}


def _gated_attention(
    model: ModelParts, layer: int, h: torch.Tensor, start: int | Ragged, cache: KVStore | Ragged
) -> torch.Tensor:
    """Attention whose head outputs are scaled by softplus(h @ attn_gate) before the output
    projection: one gate per head, or one per element when the gate is that wide."""
    cfg: LagunaConfig = model.cfg
    w = model.weights
    window = cfg.sliding_window if cfg.sliding_layers[layer] else None
    out = common.attend(model, layer, h, start, cache, model.ropes[layer], window=window)
    gate = F.softplus(linear(h, w[f"{layer}.attn_gate"]).float()).to(out.dtype)
    if gate.shape[-1] != out.shape[-1]:  # [n, H]: per head, broadcast over head_dim
        n = out.shape[0]
        out = (out.view(n, gate.shape[-1], -1) * gate[..., None]).view(n, -1)
    else:
        out = out * gate
    return linear(out, w[f"{layer}.attn_output"])


def block(
    model: ModelParts, layer: int, x: torch.Tensor, start: int | Ragged, cache: KVStore | Ragged
) -> torch.Tensor:
    cfg: LagunaConfig = model.cfg
    w, eps = model.weights, cfg.rms_eps
    x = x + _gated_attention(model, layer, rms_norm(x, w[f"{layer}.attn_norm"], eps), start, cache)
    h = rms_norm(x, w[f"{layer}.ffn_norm"], eps)
    if layer < cfg.dense_layers:
        return x + llama.dense_ffn(model, layer, h)
    return x + moe.model_ffn(model, layer, h)


embed = llama.embed
head = llama.head
project = llama.project
