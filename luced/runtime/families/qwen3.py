"""Qwen3 family (dense): the Llama block with per-head RMSNorm on Q and K before RoPE,
grouped-query attention and a head dimension independent of hidden / heads.

llama.cpp keeps Qwen3's Q/K rows as Hugging Face has them (NEOX RoPE), so nothing is
un-permuted; everything else is the Llama block.
"""

from __future__ import annotations

import torch

from luced.gguf_file import GGUFFile
from luced.runtime.families import common, llama

ARCH = "qwen3"
FUSED = llama.FUSED

LAYER_TENSORS = llama.LAYER_TENSORS | {
    "attn_q_norm": "attn_q_norm.weight",
    "attn_k_norm": "attn_k_norm.weight",
}


def config_from_gguf(gguf: GGUFFile) -> llama.LlamaConfig:
    return llama.config_from_gguf(gguf)


def weight_plan(
    cfg: llama.LlamaConfig, layers: range, owns_embed: bool, owns_head: bool
) -> dict[str, tuple[str, bool]]:
    plan = common.edge_plan(cfg, owns_embed, owns_head)
    return plan | common.layer_plan(layers, LAYER_TENSORS, llama.MATRICES)


def prepare(cfg: llama.LlamaConfig, weights: dict[str, torch.Tensor]) -> None:
    """Nothing to undo: Qwen3's GGUF keeps Hugging Face's Q/K layout."""


ropes = llama.ropes
embed = llama.embed
block = llama.block
head = llama.head
project = llama.project
