"""A tiny model's hyperparameters (`TinySpec`), their defaults per family and their checks,
and what a build returns (`TinyModel`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf import LlamaFileType as FT

from luced.runtime.tiny import moe, qwen35
from luced.runtime.tiny.vocab import Vocab

ENCODERS = ("bert", "nomic-bert")  # bert.py: no LM head, they serve embeddings only
FAMILIES = ("llama", "qwen3", "gemma3", *qwen35.FAMILIES, *moe.FAMILIES, "gemma4", *ENCODERS)
DECODERS = tuple(f for f in FAMILIES if f not in ENCODERS)
# qtype -> (ggml type, general.file_type, block size in elements)
QTYPES: dict[str, tuple[Q, FT, int]] = {
    "F32": (Q.F32, FT.ALL_F32, 1),
    "F16": (Q.F16, FT.MOSTLY_F16, 1),
    "BF16": (Q.BF16, FT.MOSTLY_BF16, 1),
    "Q8_0": (Q.Q8_0, FT.MOSTLY_Q8_0, 32),
    "Q4_0": (Q.Q4_0, FT.MOSTLY_Q4_0, 32),
    "Q4_1": (Q.Q4_1, FT.MOSTLY_Q4_1, 32),
    "Q5_0": (Q.Q5_0, FT.MOSTLY_Q5_0, 32),
    "Q4_K": (Q.Q4_K, FT.MOSTLY_Q4_K_S, 256),
    "Q5_K": (Q.Q5_K, FT.MOSTLY_Q5_K_S, 256),
    "Q6_K": (Q.Q6_K, FT.MOSTLY_Q6_K, 256),
}
LLAMA3_ORIGINAL_CONTEXT = 8192  # the converter's default; it never reads the rope dict's value


@dataclass(frozen=True)
class TinySpec:
    """Every hyperparameter of one tiny model (validated by `make_spec`)."""

    family: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab_size: int
    context: int
    rope_base: float
    rms_eps: float
    tied: bool
    qtype: str = "F32"
    seed: int = 0
    rope_scaling: str | None = None  # llama only: None or "llama3"
    rope_factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    sliding_window: int = 8  # gemma3, laguna (0: every layer full)
    name: str = ""
    # MoE families (moe.py)
    experts: int = 0
    experts_used: int = 0
    expert_ffn: int = 0
    shared_ffn: int = 0  # laguna's shared expert
    routed_scale: float = 1.0
    dense_layers: int = 0  # laguna: leading dense layers
    swa_heads: int = 0  # laguna: query heads of sliding layers
    gating: str = "per-head"  # laguna's attention gate: or "per-element"
    partial_rotary: float = 1.0  # laguna (full layers), qwen35: rotary fraction
    yarn_factor: float = 1.0
    yarn_original_context: int = 0
    swa_rope_base: float = 10000.0
    # qwen35 only (qwen35.py): DeltaNet heads and sizes, layer pattern
    linear_k_heads: int = 2
    linear_v_heads: int = 2
    linear_k_dim: int = 16
    linear_v_dim: int = 16
    conv_kernel: int = 4
    full_attention_interval: int = 4


_BASE = dict(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, ffn=128, vocab_size=512)
_BASE |= dict(context=512)
# gemma3 has 6 layers: llama.cpp's pattern is 5 sliding + 1 global (layer i global iff i % 6 == 5)
_GEMMA3 = dict(layers=6, kv_heads=1, head_dim=32, vocab_size=640, rope_base=1e6, rms_eps=1e-6)
DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": _BASE | dict(rope_base=10000.0, rms_eps=1e-5, tied=True),
    "qwen3": _BASE | dict(head_dim=32, rope_base=1e6, rms_eps=1e-6, tied=False),
    "gemma3": _BASE | _GEMMA3 | dict(tied=True),
    "qwen35": _BASE | qwen35.DEFAULTS,
    "qwen35moe": _BASE | qwen35.DEFAULTS | qwen35.MOE_DEFAULTS,
} | moe.DEFAULTS
KQUANT_DEFAULTS = {"hidden": 256, "ffn": 512, "head_dim": 64}


def make_spec(family: str, qtype: str, seed: int, overrides: dict[str, Any]) -> TinySpec:
    """The spec of a family other than gemma4 and the encoders (gemma4.make_spec,
    bert.make_spec), or ValueError."""
    if family not in DEFAULTS:
        raise ValueError(f"unknown family {family!r}; choose one of {FAMILIES}")
    check_qtype(qtype)
    values = dict(DEFAULTS[family])
    if QTYPES[qtype][2] == 256:
        values.update(KQUANT_DEFAULTS, head_dim=128 if family == "qwen3" else 64)
        values.update(moe.KQUANT_DEFAULTS.get(family, {}))
        if family in qwen35.FAMILIES:
            values.update(qwen35.KQUANT_DEFAULTS)
        if family == "qwen35moe":
            values.update(qwen35.MOE_KQUANT_DEFAULTS)
    values.update(overrides)
    if values.get("rope_scaling") == "llama3" and "context" not in overrides:
        values["context"] = 2 * LLAMA3_ORIGINAL_CONTEXT  # HF wants it above the original context
    values.setdefault("name", f"tiny-{family}")
    unknown = set(values) - {f for f in TinySpec.__dataclass_fields__ if f not in ("family",)}
    if unknown:
        raise ValueError(f"unknown overrides {sorted(unknown)}")
    spec = TinySpec(family=family, qtype=qtype, seed=seed, **values)
    block = QTYPES[qtype][2]
    rows = {"hidden": spec.hidden, "ffn": spec.ffn, "heads * head_dim": spec.heads * spec.head_dim}
    if family in moe.FAMILIES:
        rows |= moe.row_sizes(spec)
        moe.validate(spec)
    check_rows(qtype, rows)
    if spec.heads % spec.kv_heads or spec.head_dim % 2:
        raise ValueError("heads must be a multiple of kv_heads and head_dim even")
    if spec.rope_scaling not in (None, "llama3") or (spec.rope_scaling and family != "llama"):
        raise ValueError("rope_scaling='llama3' exists for the llama family only")
    if family == "gemma3" and spec.hidden % spec.heads:
        raise ValueError("Gemma3TextConfig needs hidden to be a multiple of heads")
    if family in qwen35.FAMILIES:
        qwen35.check(spec, block)
    return spec


def check_qtype(qtype: str) -> None:
    if qtype not in QTYPES:
        raise ValueError(f"unknown qtype {qtype!r}; choose one of {tuple(QTYPES)}")


def check_rows(qtype: str, rows: dict[str, int]) -> None:
    """ValueError unless every matrix row length fits the qtype's block."""
    block = QTYPES[qtype][2]
    for what, n in rows.items():
        if n % block:
            raise ValueError(f"{qtype} needs rows that are multiples of {block}: {what} = {n}")


def as_f32(x: float) -> float:
    return float(np.float32(x))  # what a GGUF float32 key reads back as


def hf_common(spec: TinySpec, vocab: Vocab) -> dict[str, Any]:
    """The config.json fields every family's transformers twin shares."""
    return dict(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden,
        intermediate_size=spec.ffn,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.context,
        rms_norm_eps=as_f32(spec.rms_eps),
        tie_word_embeddings=spec.tied,
        bos_token_id=vocab.ids["bos"],
        eos_token_id=vocab.ids["eos"],
        pad_token_id=vocab.ids["pad"],
    )


@dataclass
class TinyModel:
    """A written tiny GGUF and the Hugging Face model it converts: `hf_config` is that
    model's config.json (model_type and fields; transformers' AutoConfig.for_model(**it)
    builds the config), `state_dict` its float32 weights, exactly the dequantized file."""

    path: Path
    family: str
    spec: TinySpec
    hf_config: dict[str, Any]
    state_dict: dict[str, torch.Tensor]

    def save_hf(self, directory: Path) -> None:
        """config.json + model.safetensors (the tied head is not stored twice)."""
        from safetensors.torch import save_file

        directory.mkdir(parents=True, exist_ok=True)
        (directory / "config.json").write_text(json.dumps(self.hf_config, indent=2) + "\n")
        tensors = {
            k: v.contiguous()
            for k, v in self.state_dict.items()
            if not (self.spec.tied and k == "lm_head.weight")
        }
        save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
