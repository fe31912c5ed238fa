"""The transformers side of the tiny models (luced.runtime.tiny): the twin each GGUF
converts, built from its config.json and weights, the oracle of the parity tests."""

from __future__ import annotations

from typing import Any

import torch
import transformers

from luced.runtime.tiny import ENCODERS, TinyModel
from luced.runtime.tiny.bert import TinyEncoder

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
    """The transformers *ForCausalLM holding the tiny model's weights (an encoder's: its
    BertModel / NomicBertModel, no pooler): eval, float32, eager attention."""
    kwargs: dict[str, Any] = dict(attn_implementation="eager", dtype=torch.float32)
    if tiny.family in ENCODERS:
        auto = transformers.AutoModel
        kwargs["add_pooling_layer"] = False
    else:
        auto = transformers.AutoModelForCausalLM
    model = auto.from_config(hf_config(tiny), **kwargs)
    model.load_state_dict(tiny.state_dict, strict=True)
    return model.eval()


def hf_tokenizer(tiny: TinyEncoder) -> Any:
    """transformers' BERT tokenizer (uncased) over a tiny encoder's vocab.txt."""
    vocab = {p: i for i, p in enumerate(tiny.wordpieces)}
    return transformers.BertTokenizer(vocab=vocab, do_lower_case=True)


def gguf_loader_kwargs(tiny: TinyModel) -> dict[str, Any]:
    """Config fields transformers' GGUF loader misses, for from_pretrained(..., **kwargs)."""
    config = hf_config(tiny)
    return {k: getattr(config, k) for k in GGUF_LOADER_GAPS[tiny.family]}
