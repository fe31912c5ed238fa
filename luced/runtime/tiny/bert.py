"""The tiny encoders `bert` and `nomic-bert`: GGUFs as llama.cpp's converter writes them
(`BertModel` / `NomicBertModel` in convert_hf_to_gguf.py), and the transformers twin
(`BertModel` / `NomicBertModel`, no pooler) holding the same weights:

    tiny = make_tiny_gguf("bert", path, seed=1)
    tiny.wordpieces                        # the vocabulary as BERT's vocab.txt spells it

What the converter does, and so this file: `attention.causal` false, `pooling_type` from the
sentence-transformers Pooling module (`pooling`: 1 mean, 2 cls, 3 last; None writes none),
`attention.layer_norm_epsilon` (no RMS key), `token_type_count`; `position_embd` and
`token_types` kept in F32 whatever the file type (weights.ALWAYS_F32); BERT's Q, K, V apart,
each with its bias; nomic-bert's `Wqkv` fused into `attn_qkv` (no biases anywhere), its
SwiGLU `fc12` the gate and `fc11` the up projection, RoPE base `rope.freq_base`, no position
embeddings. The vocabulary is a WordPiece one learnt from vocab.CORPUS, written in llama.cpp's
"phantom space" form ("▁word" starts a word, a bare piece continues one: "##piece" in BERT's
vocab.txt), with [CLS] as BOS and [SEP] as EOS, both added (the TemplateProcessing of a BERT
tokenizer.json). An encoder has no LM head: it serves embeddings only.
"""

from __future__ import annotations

import re
import zlib
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf import TokenType as TT

from luced.runtime.tiny.spec import ENCODERS, QTYPES, TinyModel, TinySpec, as_f32, check_rows
from luced.runtime.tiny.vocab import CORPUS
from luced.runtime.tiny.weights import add_tensor, write_out

SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")


@dataclass(frozen=True)
class EncoderSpec(TinySpec):
    """TinySpec's sizes (`rms_eps` is the LayerNorm epsilon), and what an encoder adds."""

    pooling: int | None = 1  # gguf.PoolingType: 1 mean, 2 cls, 3 last; None: not written
    type_vocab: int = 2


@dataclass
class TinyEncoder(TinyModel):
    wordpieces: tuple[str, ...] = ()  # the vocabulary as BERT's vocab.txt spells it


_DEFAULTS = dict(hidden=64, layers=2, heads=4, kv_heads=4, head_dim=16, ffn=128, vocab_size=320)
DEFAULTS: dict[str, dict[str, Any]] = {
    "bert": _DEFAULTS | dict(context=128, rope_base=10000.0, rms_eps=1e-12, tied=True),
    "nomic-bert": _DEFAULTS | dict(context=256, rope_base=1000.0, rms_eps=1e-12, tied=True),
}


def make_spec(family: str, qtype: str, seed: int, overrides: dict[str, Any]) -> EncoderSpec:
    values = DEFAULTS[family] | {"name": f"tiny-{family}"} | overrides
    values["kv_heads"] = values["heads"]  # no grouped-query attention in these encoders
    values["head_dim"] = values["hidden"] // values["heads"]
    unknown = set(values) - {f for f in EncoderSpec.__dataclass_fields__ if f != "family"}
    if unknown:
        raise ValueError(f"unknown overrides {sorted(unknown)}")
    spec = EncoderSpec(family=family, qtype=qtype, seed=seed, **values)
    check_rows(qtype, {"hidden": spec.hidden, "ffn": spec.ffn})
    if spec.hidden % spec.heads:
        raise ValueError("hidden must be a multiple of heads")
    return spec


# --- vocabulary ----------------------------------------------------------------------------


def wordpieces(size: int) -> list[str]:
    """A BERT vocab.txt learnt from the corpus: specials, every character alone and as a
    continuation, the most frequent words, then word endings; [unusedN] fill."""
    words = re.findall(r"[a-z]+|[0-9]|[^\sa-z0-9]", CORPUS.lower())
    chars = sorted(set("".join(words)))
    pieces = list(SPECIALS) + chars + ["##" + c for c in chars if c.isalnum()]
    counts = Counter(w for w in words if len(w) > 1)
    endings = Counter(w[k:] for w in counts for k in range(1, len(w) - 1))
    room = size - len(pieces)
    common = [w for w, _ in counts.most_common(room // 2)]
    pieces += common + ["##" + e for e, _ in endings.most_common(room - len(common))]
    pieces = list(dict.fromkeys(pieces))
    if len(pieces) > size:
        raise ValueError(f"vocab_size {size} is too small for the WordPiece vocabulary")
    return pieces + [f"[unused{i}]" for i in range(size - len(pieces))]


def phantom(piece: str) -> str:
    """BertModel.set_vocab's spelling of a vocab.txt piece in the GGUF."""
    if piece.startswith("[") and piece.endswith("]"):
        return piece
    return piece[2:] if piece.startswith("##") else "\u2581" + piece


def _write_vocab(w: gguf.GGUFWriter, pieces: list[str], spec: EncoderSpec) -> None:
    ids = {p: i for i, p in enumerate(pieces)}
    w.add_token_type_count(spec.type_vocab)
    w.add_tokenizer_model("bert")
    w.add_tokenizer_pre("default")
    w.add_token_list([phantom(p) for p in pieces])
    w.add_token_types([int(TT.CONTROL if p in SPECIALS else TT.NORMAL) for p in pieces])
    w.add_bos_token_id(ids["[CLS]"])
    w.add_eos_token_id(ids["[SEP]"])
    w.add_unk_token_id(ids["[UNK]"])
    w.add_sep_token_id(ids["[SEP]"])
    w.add_pad_token_id(ids["[PAD]"])
    w.add_mask_token_id(ids["[MASK]"])
    w.add_add_bos_token(True)
    w.add_add_eos_token(True)


# --- weights -------------------------------------------------------------------------------


def _hf_shapes(spec: EncoderSpec) -> dict[str, tuple[int, ...]]:
    h, f, v = spec.hidden, spec.ffn, spec.vocab_size
    shapes = {
        "embeddings.word_embeddings.weight": (v, h),
        "embeddings.token_type_embeddings.weight": (spec.type_vocab, h),
        "embeddings.LayerNorm.weight": (h,),
        "embeddings.LayerNorm.bias": (h,),
    }
    if spec.family == "bert":
        shapes["embeddings.position_embeddings.weight"] = (spec.context, h)
        layer = {
            "attention.self.query": (h, h),
            "attention.self.key": (h, h),
            "attention.self.value": (h, h),
            "attention.output.dense": (h, h),
            "attention.output.LayerNorm": (h,),
            "intermediate.dense": (f, h),
            "output.dense": (h, f),
            "output.LayerNorm": (h,),
        }
        for i in range(spec.layers):
            for name, shape in layer.items():
                shapes[f"encoder.layer.{i}.{name}.weight"] = shape
                shapes[f"encoder.layer.{i}.{name}.bias"] = shape[:1]
        return shapes
    layer = {
        "self_attn.q_proj.weight": (h, h),
        "self_attn.k_proj.weight": (h, h),
        "self_attn.v_proj.weight": (h, h),
        "self_attn.o_proj.weight": (h, h),
        "post_attention_layernorm.weight": (h,),
        "post_attention_layernorm.bias": (h,),
        "mlp.gate_proj.weight": (f, h),
        "mlp.up_proj.weight": (f, h),
        "mlp.down_proj.weight": (h, f),
        "post_mlp_layernorm.weight": (h,),
        "post_mlp_layernorm.bias": (h,),
    }
    for i in range(spec.layers):
        shapes |= {f"layers.{i}.{name}": shape for name, shape in layer.items()}
    return shapes


# nomic-bert: transformers' names -> the GGUF's (llama.cpp maps the original Wqkv, fc11, fc12).
_NOMIC = {
    "embeddings.word_embeddings.weight": "token_embd.weight",
    "embeddings.token_type_embeddings.weight": "token_types.weight",
    "embeddings.LayerNorm.weight": "token_embd_norm.weight",
    "embeddings.LayerNorm.bias": "token_embd_norm.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "attn_output_norm.weight",
    "post_attention_layernorm.bias": "attn_output_norm.bias",
    "mlp.gate_proj.weight": "ffn_gate.weight",  # fc12, through SiLU
    "mlp.up_proj.weight": "ffn_up.weight",  # fc11
    "mlp.down_proj.weight": "ffn_down.weight",
    "post_mlp_layernorm.weight": "layer_output_norm.weight",
    "post_mlp_layernorm.bias": "layer_output_norm.bias",
}
_QKV = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")


def _gguf_groups(spec: EncoderSpec) -> dict[str, list[str]]:
    """GGUF tensor name -> the HF tensors it stores (rows stacked in this order)."""
    names = sorted(_hf_shapes(spec))
    if spec.family == "bert":
        tensor_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.BERT, spec.layers)
        out: dict[str, list[str]] = {}
        for name in names:
            mapped = tensor_map.get_name(name, try_suffixes=(".weight", ".bias"))
            if mapped is None:
                raise AssertionError(f"gguf-py has no name for {name}")
            out[mapped] = [name]
        return out
    out = {}
    for name in names:
        m = re.fullmatch(r"layers\.(\d+)\.(.*)", name)
        if m is None:
            out[_NOMIC[name]] = [name]
        elif m[2] in _QKV:
            out.setdefault(f"blk.{m[1]}.attn_qkv.weight", []).append(name)
        else:
            out[f"blk.{m[1]}.{_NOMIC[m[2]]}"] = [name]
    for key, parts in out.items():
        if key.endswith("attn_qkv.weight"):
            parts.sort(key=lambda n: _QKV.index(n.split(".", 2)[2]))
    return out


def _random(spec: EncoderSpec, name: str, shape: tuple[int, ...]) -> np.ndarray:
    rng = np.random.default_rng([spec.seed, zlib.crc32(name.encode())])
    if name.lower().endswith("layernorm.weight"):  # near the identity scale
        return (1.0 + rng.uniform(-0.3, 0.3, shape)).astype(np.float32)
    if len(shape) == 1:  # biases
        return (rng.standard_normal(shape) * 0.1).astype(np.float32)
    std = 1.0 if "embeddings" in name else shape[-1] ** -0.5
    return (rng.standard_normal(shape) * std).astype(np.float32)


def _write_metadata(w: gguf.GGUFWriter, spec: EncoderSpec) -> None:
    w.add_type(gguf.GGUFType.MODEL)
    w.add_name(spec.name)
    w.add_block_count(spec.layers)
    w.add_context_length(spec.context)
    w.add_embedding_length(spec.hidden)
    w.add_feed_forward_length(spec.ffn)
    w.add_head_count(spec.heads)
    w.add_layer_norm_eps(spec.rms_eps)
    w.add_file_type(QTYPES[spec.qtype][1])
    w.add_causal_attention(False)
    if spec.pooling is not None:
        w.add_pooling_type(gguf.PoolingType(spec.pooling))
    if spec.family == "nomic-bert":
        w.add_rope_freq_base(spec.rope_base)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)


def hf_config(spec: EncoderSpec) -> dict[str, Any]:
    """The twin's config.json: BertConfig's or NomicBertConfig's fields."""
    common = dict(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        intermediate_size=spec.ffn,
        max_position_embeddings=spec.context,
        type_vocab_size=spec.type_vocab,
        layer_norm_eps=as_f32(spec.rms_eps),
        pad_token_id=0,
    )
    if spec.family == "bert":
        return dict(model_type="bert", **common, hidden_act="gelu")
    rope = {"rope_type": "default", "rope_theta": as_f32(spec.rope_base)}
    return dict(model_type="nomic_bert", **common, hidden_act="silu", rope_parameters=rope)


def build(
    path: Path, *, family: str = "bert", seed: int = 0, qtype: str = "F32", **overrides: Any
) -> TinyEncoder:
    if family not in ENCODERS:
        raise ValueError(f"{family!r} is not an encoder family; choose one of {ENCODERS}")
    spec = make_spec(family, qtype, seed, overrides)
    pieces = wordpieces(spec.vocab_size)
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(path, family)
    _write_metadata(writer, spec)
    _write_vocab(writer, pieces, spec)
    shapes = _hf_shapes(spec)
    state_dict: dict[str, torch.Tensor] = {}
    for gguf_name, parts in sorted(_gguf_groups(spec).items()):
        w = np.concatenate([_random(spec, p, shapes[p]) for p in parts])
        back = add_tensor(writer, spec, gguf_name, gguf_name, w)
        rows = np.split(back, np.cumsum([shapes[p][0] for p in parts])[:-1])
        for p, r in zip(parts, rows, strict=True):
            state_dict[p] = torch.from_numpy(np.ascontiguousarray(r))
    write_out(writer)
    return TinyEncoder(path, family, spec, hf_config(spec), state_dict, tuple(pieces))
