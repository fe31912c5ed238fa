"""Llama family (SmolLM2, Llama 2/3): RMSNorm, RoPE with optional Llama-3 frequency
factors or linear scaling, grouped-query attention, SwiGLU MLP.

llama.cpp's converter permutes the rows of Q and K so ggml's interleaved RoPE
applies; `prepare` undoes that so every family shares one rotate-half RoPE.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from luced.gguf_file import GGUFFile
from luced.runtime.families import common
from luced.runtime.families.common import ModelParts
from luced.runtime.layers import (
    Rope,
    gated_ffn,
    linear,
    matrix_rows,
    rms_norm,
    rope_inv_freq,
    take_rows,
)
from luced.runtime.qlinear import QuantRows

if TYPE_CHECKING:
    from luced.runtime.kv_cache import KVStore
    from luced.runtime.ragged import Ragged

ARCH = "llama"

LAYER_TENSORS = {
    "attn_norm": "attn_norm.weight",
    "attn_q": "attn_q.weight",
    "attn_k": "attn_k.weight",
    "attn_v": "attn_v.weight",
    "attn_output": "attn_output.weight",
    "ffn_norm": "ffn_norm.weight",
    "ffn_gate": "ffn_gate.weight",
    "ffn_up": "ffn_up.weight",
    "ffn_down": "ffn_down.weight",
}
MATRICES = {"attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"}
FUSED = common.FUSED  # `attend` and `dense_ffn` read them fused or not


@dataclass(frozen=True)
class LlamaConfig(common.ModelConfig):
    rope_linear_scale: float = 1.0
    has_rope_factors: bool = False


def config_from_gguf(gguf: GGUFFile, cls: type[LlamaConfig] = LlamaConfig, **extra: Any) -> Any:
    """The Llama fields; families built on the Llama block pass their subclass and fields."""
    arch = gguf.arch
    scale = 1.0
    if gguf.get(f"{arch}.rope.scaling.type") == "linear":
        scale = float(gguf.get(f"{arch}.rope.scaling.factor", 1.0))
    return common.make_config(
        cls,
        gguf,
        rope_linear_scale=scale,
        has_rope_factors="rope_freqs.weight" in gguf.tensors,
        **extra,
    )


def weight_plan(
    cfg: LlamaConfig, layers: range, owns_embed: bool, owns_head: bool
) -> dict[str, tuple[str, bool]]:
    plan = common.edge_plan(cfg, owns_embed, owns_head)
    plan |= common.layer_plan(layers, LAYER_TENSORS, MATRICES)
    if cfg.has_rope_factors:
        plan["rope_freqs"] = ("rope_freqs.weight", False)
    return plan


def _unpermute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation on a loaded matrix: within each head, the rows
    stored interleaved (pairs) go back to two halves."""
    out_dim = w.shape[0] if isinstance(w, QuantRows) else matrix_rows(w).shape[0]
    head_dim = out_dim // n_heads
    index = torch.arange(out_dim).view(n_heads, head_dim // 2, 2).transpose(1, 2)
    return take_rows(w, index.reshape(-1))


def prepare(cfg: LlamaConfig, weights: dict[str, torch.Tensor]) -> None:
    for key in list(weights):
        if key.endswith(".attn_q"):
            weights[key] = _unpermute(weights[key], cfg.n_heads)
        elif key.endswith(".attn_k"):
            weights[key] = _unpermute(weights[key], cfg.n_kv_heads)


def ropes(cfg: LlamaConfig, weights: dict[str, torch.Tensor], device: torch.device) -> dict:
    inv = rope_inv_freq(
        cfg.rope_dims,
        cfg.rope_base,
        factors=weights.get("rope_freqs"),
        linear_scale=cfg.rope_linear_scale,
    )
    rope = Rope(inv.to(device))
    return dict.fromkeys(range(cfg.n_layers), rope)


def embed(model: ModelParts, ids: torch.Tensor) -> torch.Tensor:
    return common.embed_rows(model, ids)


def dense_ffn(model: ModelParts, layer: int, h: torch.Tensor) -> torch.Tensor:
    return gated_ffn(h, model.weights, f"{layer}.")


FFN = Callable[[ModelParts, int, torch.Tensor], torch.Tensor]


def block(
    model: ModelParts,
    layer: int,
    x: torch.Tensor,
    start: int | Ragged,
    cache: KVStore | Ragged,
    ffn: FFN | None = None,
) -> torch.Tensor:
    """Pre-norm attention, then pre-norm `ffn` (families swap in an MoE FFN), residuals.
    The dense FFN hands its norm and residual add to the kernels (`layers.linear`)."""
    w, eps = model.weights, model.cfg.rms_eps
    rope = model.ropes[layer]
    norm = (w[f"{layer}.attn_norm"], eps)
    x = common.self_attention(model, layer, x, start, cache, rope, norm=norm, residual=x)
    if ffn is None:
        return gated_ffn(x, w, f"{layer}.", norm=(w[f"{layer}.ffn_norm"], eps), residual=x)
    return x + ffn(model, layer, rms_norm(x, w[f"{layer}.ffn_norm"], eps))


def project(model: ModelParts, h: torch.Tensor) -> torch.Tensor:
    """Normed hidden -> float32 logits: the head matrix alone (no logit scaling)."""
    return linear(h, model.weights["head"]).float()


def head(model: ModelParts, x: torch.Tensor) -> torch.Tensor:
    return project(model, rms_norm(x, model.weights["out_norm"], model.cfg.rms_eps))
