"""The transformers side of the tiny models (luced.runtime.tiny): the twin each GGUF
converts, built from its config.json and weights, the oracle of the parity tests."""

from __future__ import annotations

from typing import Any

import torch
import transformers

from luced.runtime.tiny import TinyModel

# Config fields transformers' GGUF loader does not recover; pass them as from_pretrained kwargs.
GGUF_LOADER_GAPS = {
    "llama": ("rope_parameters",),  # rope_freqs.weight / Llama-3 scaling is ignored
    "qwen3": ("head_dim",),  # qwen3.attention.key_length is not mapped
    "gemma3": ("query_pre_attn_scalar",),  # not stored; HF defaults to 256
    "qwen3moe": ("moe_intermediate_size",),  # qwen3moe.expert_feed_forward_length is not mapped
    "qwen35": (),  # transformers has no qwen35 GGUF loader at all
    "qwen35moe": (),
}  # (nor any laguna)


def hf_config(tiny: TinyModel) -> Any:
    """The twin's transformers config (a new one per call)."""
    return transformers.AutoConfig.for_model(**tiny.hf_config)


def hf_model(tiny: TinyModel) -> Any:
    """The transformers *ForCausalLM holding the tiny model's weights: eval, float32, eager
    attention."""
    model = transformers.AutoModelForCausalLM.from_config(
        hf_config(tiny), attn_implementation="eager", dtype=torch.float32
    )
    model.load_state_dict(tiny.state_dict, strict=True)
    return model.eval()


def gguf_loader_kwargs(tiny: TinyModel) -> dict[str, Any]:
    """Config fields transformers' GGUF loader misses, for from_pretrained(..., **kwargs)."""
    config = hf_config(tiny)
    return {k: getattr(config, k) for k in GGUF_LOADER_GAPS[tiny.family]}
