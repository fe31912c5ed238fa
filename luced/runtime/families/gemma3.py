"""Gemma 3 family: interleaved sliding-window and global attention with separate RoPE
bases, per-head Q/K RMSNorm, RMSNorms before and after both attention and FFN,
sqrt(hidden)-scaled embeddings, GELU-tanh gated MLP, head tied to the embedding.

GGUF conventions (llama.cpp): norm weights are stored as (1 + w), so they multiply
directly; layer i uses a sliding window unless (i + 1) % pattern == 0 (pattern 6
unless the file says otherwise); local layers use RoPE base 10000.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from luced.gguf_file import GGUFFile
from luced.runtime.families import common
from luced.runtime.families.common import ModelParts
from luced.runtime.layers import Rope, gated_ffn, gelu_tanh, linear, rms_norm, rope_inv_freq

if TYPE_CHECKING:
    from luced.runtime.kv_cache import KVStore
    from luced.runtime.ragged import Ragged

ARCH = "gemma3"
FUSED = common.FUSED  # `common.attend` and `ffn` read them fused or not

LAYER_TENSORS = {
    "attn_norm": "attn_norm.weight",
    "attn_q": "attn_q.weight",
    "attn_k": "attn_k.weight",
    "attn_v": "attn_v.weight",
    "attn_q_norm": "attn_q_norm.weight",
    "attn_k_norm": "attn_k_norm.weight",
    "attn_output": "attn_output.weight",
    "post_attn_norm": "post_attention_norm.weight",
    "ffn_norm": "ffn_norm.weight",
    "ffn_gate": "ffn_gate.weight",
    "ffn_up": "ffn_up.weight",
    "ffn_down": "ffn_down.weight",
    "post_ffn_norm": "post_ffw_norm.weight",
}
MATRICES = {"attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"}

DEFAULT_SWA_PATTERN = 6
DEFAULT_LOCAL_ROPE_BASE = 10000.0


@dataclass(frozen=True)
class Gemma3Config(common.ModelConfig):
    sliding_window: int = 512
    sliding_layers: tuple[bool, ...] = ()  # per layer: True = sliding window attention
    local_rope_base: float = DEFAULT_LOCAL_ROPE_BASE
    global_rope_scale: float = 1.0
    attn_scale: float = 0.0
    final_softcap: float | None = None


def config_from_gguf(gguf: GGUFFile) -> Gemma3Config:
    arch = gguf.arch
    base = common.base_fields(gguf)
    # llama.cpp scales queries by 1/sqrt(head_dim), except for the 62-layer 27B model,
    # trained with query_pre_attn_scalar = hidden / heads.
    attn_scale = (
        (base["hidden"] / base["n_heads"]) ** -0.5
        if base["n_layers"] == 62
        else base["head_dim"] ** -0.5
    )
    scale = 1.0
    if gguf.get(f"{arch}.rope.scaling.type") == "linear":
        scale = float(gguf.get(f"{arch}.rope.scaling.factor", 1.0))
    softcap = gguf.get(f"{arch}.final_logit_softcapping")
    return common.make_config(
        Gemma3Config,
        gguf,
        sliding_window=int(gguf.get(f"{arch}.attention.sliding_window", 512)),
        sliding_layers=gguf.sliding_layers(DEFAULT_SWA_PATTERN),
        local_rope_base=float(gguf.get(f"{arch}.rope.freq_base_swa", DEFAULT_LOCAL_ROPE_BASE)),
        global_rope_scale=scale,
        attn_scale=attn_scale,
        final_softcap=float(softcap) if softcap else None,
    )


def weight_plan(
    cfg: Gemma3Config, layers: range, owns_embed: bool, owns_head: bool
) -> dict[str, tuple[str, bool]]:
    plan = common.edge_plan(cfg, owns_embed, owns_head)
    return plan | common.layer_plan(layers, LAYER_TENSORS, MATRICES)


def prepare(cfg: Gemma3Config, weights: dict[str, torch.Tensor]) -> None:
    """Nothing to undo: Q/K rows are in Hugging Face order, norms already hold 1 + w."""


def ropes(cfg: Gemma3Config, weights: dict[str, torch.Tensor], device: torch.device) -> dict:
    local = Rope(rope_inv_freq(cfg.rope_dims, cfg.local_rope_base).to(device))
    global_ = Rope(
        rope_inv_freq(cfg.rope_dims, cfg.rope_base, linear_scale=cfg.global_rope_scale).to(device)
    )
    return {i: local if sliding else global_ for i, sliding in enumerate(cfg.sliding_layers)}


def embed(model: ModelParts, ids: torch.Tensor) -> torch.Tensor:
    rows = common.embed_rows(model, ids)
    # The scale is rounded to the compute dtype first, as the reference does.
    scale = torch.tensor(math.sqrt(model.cfg.hidden), dtype=rows.dtype)
    return rows * scale


def block(
    model: ModelParts, layer: int, x: torch.Tensor, start: int | Ragged, cache: KVStore | Ragged
) -> torch.Tensor:
    cfg: Gemma3Config = model.cfg
    w, eps = model.weights, cfg.rms_eps
    window = cfg.sliding_window if cfg.sliding_layers[layer] else None
    norm = (w[f"{layer}.attn_norm"], eps)
    h = common.self_attention(
        model, layer, x, start, cache, model.ropes[layer], window=window, scale=cfg.attn_scale,
        norm=norm,
    )  # fmt: skip
    x = x + rms_norm(h, w[f"{layer}.post_attn_norm"], eps)
    return ffn(model, layer, x)


def ffn(model: ModelParts, layer: int, x: torch.Tensor) -> torch.Tensor:
    """The FFN half of a Gemma block: x + post_norm(GeGLU(pre_norm(x)))."""
    w, eps = model.weights, model.cfg.rms_eps
    h = gated_ffn(x, w, f"{layer}.", gelu_tanh, norm=(w[f"{layer}.ffn_norm"], eps))
    return x + rms_norm(h, w[f"{layer}.post_ffn_norm"], eps)


def project(model: ModelParts, h: torch.Tensor) -> torch.Tensor:
    """Normed hidden -> float32 logits: the head matrix, then the final softcap if any."""
    cfg: Gemma3Config = model.cfg
    logits = linear(h, model.weights["head"]).float()
    if cfg.final_softcap:
        logits = torch.tanh(logits / cfg.final_softcap) * cfg.final_softcap
    return logits


def head(model: ModelParts, x: torch.Tensor) -> torch.Tensor:
    return project(model, rms_norm(x, model.weights["out_norm"], model.cfg.rms_eps))
