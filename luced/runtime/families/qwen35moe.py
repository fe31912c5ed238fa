"""Qwen3.5-MoE family: the Qwen3.5 hybrid stack (`qwen35`: Gated DeltaNet in three of every
four layers, gated full attention in the fourth) with a routed-experts FFN in every layer
(`luced.runtime.moe`): softmax router, top-k renormalised, plus a shared expert scaled by
sigmoid(x . ffn_gate_inp_shexp).

GGUF (llama.cpp's converter, Qwen3NextModel / Qwen2MoeModel): transformers' fused
`gate_up_proj` is split into ffn_gate_exps + ffn_up_exps; no feed_forward_length is written
(there is no dense FFN), so the config's `ffn` is the expert width. llama.cpp's qwen35moe
graph renormalises the top-k weights unconditionally, as transformers does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from luced.gguf_file import GGUFFile
from luced.runtime import moe
from luced.runtime.families import common, qwen35
from luced.runtime.families.common import ModelParts

if TYPE_CHECKING:
    from luced.runtime.kv_cache import KVCache
    from luced.runtime.ragged import Ragged

ARCH = "qwen35moe"


@dataclass(frozen=True)
class Qwen35MoeConfig(qwen35.Qwen35Config):
    moe: moe.MoeConfig = field(default_factory=moe.MoeConfig)  # from the expert_* keys


def config_from_gguf(gguf: GGUFFile) -> Qwen35MoeConfig:
    experts = moe.config_from_gguf(gguf, gating="softmax", normalize=True, shared_gate=True)
    cfg = qwen35.config_from_gguf(gguf, Qwen35MoeConfig, {"ffn": experts.expert_ffn}, moe=experts)
    moe.check_tensors(gguf, experts, cfg.hidden, range(cfg.n_layers))
    return cfg


def weight_plan(
    cfg: Qwen35MoeConfig, layers: range, owns_embed: bool, owns_head: bool
) -> dict[str, tuple[str, bool]]:
    names, matrices = moe.layer_tensors(cfg.moe)
    plan = common.edge_plan(cfg, owns_embed, owns_head) | qwen35.mixer_plan(cfg, layers)
    return plan | common.layer_plan(layers, names, matrices)


def prepare(cfg: Qwen35MoeConfig, weights: dict[str, torch.Tensor]) -> None:
    qwen35.prepare(cfg, weights)
    moe.prepare_layers(weights, range(cfg.n_layers))


def block(
    model: ModelParts, layer: int, x: torch.Tensor, start: int | Ragged, cache: KVCache | Ragged
) -> torch.Tensor:
    return qwen35.block(model, layer, x, start, cache, ffn=moe.model_ffn)


recurrent_shapes = qwen35.recurrent_shapes
ropes = qwen35.ropes
embed = qwen35.embed
head = qwen35.head
project = qwen35.project
