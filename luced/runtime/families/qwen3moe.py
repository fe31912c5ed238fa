"""Qwen3-MoE family: the Qwen3 attention block (per-head Q/K RMSNorm, NEOX RoPE, GQA) with a
routed-experts FFN in every layer (`luced.runtime.moe`): softmax router, top-k renormalised,
no shared expert.

llama.cpp's qwen3moe graph hard-codes the renormalisation (transformers' GGUF loader sets
norm_topk_prob accordingly), so expert_weights_norm is not read; expert_weights_scale is.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from luced.gguf_file import GGUFFile
from luced.runtime import moe
from luced.runtime.families import common, llama, qwen3
from luced.runtime.families.common import ModelParts

if TYPE_CHECKING:
    from luced.runtime.kv_cache import KVStore
    from luced.runtime.ragged import Ragged

ARCH = "qwen3moe"
FUSED = llama.FUSED  # the Llama block's attention; the FFN is the experts'

ATTENTION_TENSORS = {
    k: v for k, v in qwen3.LAYER_TENSORS.items() if k not in ("ffn_gate", "ffn_up", "ffn_down")
}
ATTENTION_MATRICES = {"attn_q", "attn_k", "attn_v", "attn_output"}


@dataclass(frozen=True)
class Qwen3MoeConfig(llama.LlamaConfig):
    moe: moe.MoeConfig = field(default_factory=moe.MoeConfig)  # from the expert_* keys


def config_from_gguf(gguf: GGUFFile) -> Qwen3MoeConfig:
    experts = moe.config_from_gguf(gguf, gating="softmax", normalize=True)
    cfg = llama.config_from_gguf(gguf, Qwen3MoeConfig, moe=experts)
    moe.check_tensors(gguf, experts, cfg.hidden, range(cfg.n_layers))
    return cfg


def weight_plan(
    cfg: Qwen3MoeConfig, layers: range, owns_embed: bool, owns_head: bool
) -> dict[str, tuple[str, bool]]:
    names, matrices = moe.layer_tensors(cfg.moe)
    plan = common.edge_plan(cfg, owns_embed, owns_head)
    plan |= common.layer_plan(layers, ATTENTION_TENSORS, ATTENTION_MATRICES)
    return plan | common.layer_plan(layers, names, matrices)


def prepare(cfg: Qwen3MoeConfig, weights: dict[str, torch.Tensor]) -> None:
    moe.prepare_layers(weights, range(cfg.n_layers))


def block(
    model: ModelParts, layer: int, x: torch.Tensor, start: int | Ragged, cache: KVStore | Ragged
) -> torch.Tensor:
    return llama.block(model, layer, x, start, cache, ffn=moe.model_ffn)


ropes = llama.ropes
embed = llama.embed
head = llama.head
project = llama.project
