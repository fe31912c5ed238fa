"""Tiny random-weight GGUF models, written as llama.cpp's converter would, plus the HF twin.

`build(family, path)` writes a deterministic (seeded) GGUF for `llama`, `qwen3`, `gemma3`,
the hybrids `qwen35` and `qwen35moe` (their pieces live in tools/tiny_qwen35.py), the MoE
families `qwen3moe` and `laguna` (tools/tiny_moe.py), `gemma4` (built whole by
tools/tiny_gemma4.py, see `MODULE_FAMILIES`) or the encoders `bert` and `nomic-bert`
(tools/tiny_bert.py: their twin is an encoder, not a *ForCausalLM) and returns a `TinyModel`
with the matching transformers config and state dict, so parity tests run luced and
transformers on the same weights:

    tiny = build("gemma3", tmp_path / "g.gguf", seed=1, qtype="Q8_0")
    ref = tiny.hf_model()                      # Gemma3ForCausalLM, eval, float32, eager attention

The file follows llama.cpp's `convert_hf_to_gguf.py` for the same HF model: gguf-py's tensor
names, the metadata keys its TextModel / family classes write, and its tensor conventions:
llama Q/K rows permuted per head to the interleaved RoPE layout, `rope_freqs.weight` for Llama-3
rope scaling (and no other key), no `output.weight` when tied; gemma3 `*norm.weight` stored as
1 + w; 1-D tensors in F32, every 2-D weight (embeddings and head too) in `qtype`. The state dict
is derived from the stored bytes (dequantize, undo the conventions), so it is exactly what a GGUF
reader gets, for every qtype.

Row sizes (hidden, ffn, heads * head_dim) must be multiples of 32 for Q8_0/Q4_0/Q4_1/Q5_0 and of
256 for Q4_K/Q5_K/Q6_K; with a K-quant the defaults become hidden 256, ffn 512, head_dim 64
(qwen3: 128). gguf-py cannot quantize K-quants, so their blocks are random but valid (small
finite f16 scales) and the weight is defined as their dequantization.

Vocabularies hold BPE merges learned from a small fixed corpus: llama and qwen3 a `gpt2`
byte-level vocab with a ChatML template (llama laid out like SmolLM2, pre `smollm`; qwen3 like
Qwen3, pre `qwen2`, <think> user-defined, [PAD] fill); gemma3 a SentencePiece `llama` vocab
(Gemma's control tokens and ids, user-defined newlines, <0x00>..<0xFF> byte fallback, "▁word"
pieces with scores falling in merge order, so score order and file order agree).

transformers' GGUF loader misses some of llama.cpp's semantics: see `GGUF_LOADER_GAPS`. For
gemma3, llama.cpp scales scores by 1/sqrt(head_dim), so query_pre_attn_scalar = head_dim here,
and the local RoPE base is 10000 (hard-coded in llama.cpp).

CLI: python tools/make_tiny_gguf.py FAMILY OUT.gguf [--seed S] [--qtype T] [--hf-dir DIR]
                                    [--set KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import ast
import copy
import functools
import importlib
import itertools
import math
import re
import zlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import tiny_moe
import tiny_qwen35
import torch
from gguf import GGMLQuantizationType as Q
from gguf import LlamaFileType as FT
from gguf import TokenType as TT

FAMILIES = (
    "llama",
    "qwen3",
    "gemma3",
    *tiny_qwen35.FAMILIES,
    *tiny_moe.FAMILIES,
    "gemma4",
    "bert",
    "nomic-bert",
)
ENCODERS = ("bert", "nomic-bert")  # no LM head: they serve embeddings only
DECODERS = tuple(f for f in FAMILIES if f not in ENCODERS)
# Families whose builder is a module beside this one: (module, its function taking
# (path, seed=, qtype=, **overrides)).
MODULE_FAMILIES = {
    "gemma4": ("tiny_gemma4", "build"),
    "bert": ("tiny_bert", "build_bert"),
    "nomic-bert": ("tiny_bert", "build_nomic_bert"),
}
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
GEMMA3_LOCAL_ROPE_BASE = 10000.0  # llama.cpp hard-codes it for gemma3's sliding layers
LLAMA3_ORIGINAL_CONTEXT = 8192  # the converter's default; it never reads the rope dict's value
# Config fields transformers' GGUF loader does not recover; pass them as from_pretrained kwargs.
GGUF_LOADER_GAPS = {
    "llama": ("rope_parameters",),  # rope_freqs.weight / Llama-3 scaling is ignored
    "qwen3": ("head_dim",),  # qwen3.attention.key_length is not mapped
    "gemma3": ("query_pre_attn_scalar",),  # not stored; HF defaults to 256
    "qwen3moe": ("moe_intermediate_size",),  # qwen3moe.expert_feed_forward_length is not mapped
    "qwen35": (),  # transformers has no qwen35 GGUF loader at all
    "qwen35moe": (),
}  # (nor any laguna)
# The converter keeps routers (FFN_GATE_INP, FFN_GATE_INP_SHEXP) and SSM_CONV1D in F32
# whatever the file type.
ALWAYS_F32 = (
    ".mlp.gate.weight",
    ".mlp.shared_expert_gate.weight",
    ".router.proj.weight",
    "conv1d.weight",
)

_TURNS = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
)
_PROMPT = "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{THINK}{%- endif -%}"
# Qwen3-style: an empty think block when the caller turns thinking off.
_NO_THINK = (
    "{%- if enable_thinking is defined and enable_thinking is false -%}"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}"
)
# Gemma's turns, for the tiny gemma4 vocabulary (which has Gemma 3's turn tokens).
GEMMA_TURNS = (
    "{{- bos_token -}}{%- for message in messages -%}"
    "{{- '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role'])"
    " + '\n' + message['content'] + '<end_of_turn>\n' -}}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<start_of_turn>model\n' -}}{%- endif -%}"
)
CHAT_TEMPLATES = {
    "llama": _TURNS + _PROMPT.replace("{THINK}", ""),
    "qwen3": _TURNS + _PROMPT.replace("{THINK}", _NO_THINK),
    "qwen35": _TURNS + _PROMPT.replace("{THINK}", _NO_THINK),
    "qwen35moe": _TURNS + _PROMPT.replace("{THINK}", _NO_THINK),
}

# Training text for the merges (ours); enough pairs for a few hundred merges.
CORPUS = """\
The small model reads the prompt, one token at a time, and writes the next token.
A token is a piece of text: a word, part of a word, a space and a word, or a single byte.
When the cache holds the keys and values of every earlier position, the next step is cheap.
Hello world! How are you today? I am fine, thank you. The weather is nice and the sun is warm.
We tested the sampler with a fixed seed: the same seed gave the same text, every single time.
There are three families here: llama, qwen and gemma. Each one has its own names for weights.
Numbers like 1, 22, 333 and 2024 are split into digits; so are 3.14 and 0.5 and 100%.
def forward(self, tokens, positions):
    hidden = self.embed(tokens)
    for layer in self.layers:
        hidden = layer(hidden, positions)
    return self.norm(hidden)

for i in range(10):
    print(i, i * i)  # the squares
if x > 0 and y < 0: return {"key": [1, 2, 3], 'other': None}
The quick brown fox jumps over the lazy dog. The dog was not amused, and the fox ran away.
Sliding window attention looks only at the last few tokens, while global layers see them all.
Please answer the question in one short sentence, and then stop writing any more words.
"""


@dataclass(frozen=True)
class TinySpec:
    """Every hyperparameter of one tiny model (validated by `_make_spec`)."""

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
    # MoE families (tools/tiny_moe.py)
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
    # qwen35 only (tiny_qwen35.py): DeltaNet heads and sizes, layer pattern
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
    "qwen35": _BASE | tiny_qwen35.DEFAULTS,
    "qwen35moe": _BASE | tiny_qwen35.DEFAULTS | tiny_qwen35.MOE_DEFAULTS,
} | tiny_moe.DEFAULTS
KQUANT_DEFAULTS = {"hidden": 256, "ffn": 512, "head_dim": 64}


def _make_spec(family: str, qtype: str, seed: int, overrides: dict[str, Any]) -> TinySpec:
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose one of {FAMILIES}")
    if qtype not in QTYPES:
        raise ValueError(f"unknown qtype {qtype!r}; choose one of {tuple(QTYPES)}")
    values = dict(DEFAULTS[family])
    if QTYPES[qtype][2] == 256:
        values.update(KQUANT_DEFAULTS, head_dim=128 if family == "qwen3" else 64)
        values.update(tiny_moe.KQUANT_DEFAULTS.get(family, {}))
        if family in tiny_qwen35.FAMILIES:
            values.update(tiny_qwen35.KQUANT_DEFAULTS)
        if family == "qwen35moe":
            values.update(tiny_qwen35.MOE_KQUANT_DEFAULTS)
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
    if family in tiny_moe.FAMILIES:
        rows |= tiny_moe.row_sizes(spec)
        tiny_moe.validate(spec)
    for what, n in rows.items():
        if n % block:
            raise ValueError(f"{qtype} needs rows that are multiples of {block}: {what} = {n}")
    if spec.heads % spec.kv_heads or spec.head_dim % 2:
        raise ValueError("heads must be a multiple of kv_heads and head_dim even")
    if spec.rope_scaling not in (None, "llama3") or (spec.rope_scaling and family != "llama"):
        raise ValueError("rope_scaling='llama3' exists for the llama family only")
    if family == "gemma3" and spec.hidden % spec.heads:
        raise ValueError("Gemma3TextConfig needs hidden to be a multiple of heads")
    if family in tiny_qwen35.FAMILIES:
        tiny_qwen35.check(spec, block)
    return spec


# ---------------------------------------------------------------- vocabulary


@dataclass
class Vocab:
    model: str  # tokenizer.ggml.model: "gpt2", "llama" or "gemma4"
    pre: str | None
    tokens: list[str]
    types: list[int]
    scores: list[float] | None
    merges: list[str] | None
    ids: dict[str, int]  # bos / eos / unk / pad -> token id
    add_bos: bool
    chat_template: str | None = None
    extra: dict[str, bool] = field(default_factory=dict)  # other tokenizer.ggml.* flags


@functools.cache
def _byte_chars() -> tuple[str, ...]:
    """GPT-2's printable stand-in for every byte value, indexed by the byte."""
    keep = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    others = iter(range(256, 512))  # the rest, in byte order, shifted past Latin-1
    return tuple(chr(b) if b in keep else chr(next(others)) for b in range(256))


def _learn_merges(words: Counter[tuple[str, ...]], count: int) -> list[tuple[str, str]]:
    """Plain BPE: repeatedly merge the most frequent adjacent pair (ties broken by the pair),
    down to pairs seen once, until `count` distinct tokens or every word is one token."""
    words = Counter(words)
    merges: list[tuple[str, str]] = []
    made: set[str] = set()  # two merges can spell the same token; it is one token
    while len(made) < count:
        pairs: Counter[tuple[str, str]] = Counter()
        for word, n in words.items():
            for pair in itertools.pairwise(word):
                pairs[pair] += n
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merges.append(best)
        made.add(best[0] + best[1])
        merged: Counter[tuple[str, ...]] = Counter()
        for word, n in words.items():
            out, i = [], 0
            while i < len(word):
                if i + 1 < len(word) and (word[i], word[i + 1]) == best:
                    out.append(word[i] + word[i + 1])
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            merged[tuple(out)] += n
        words = merged
    return merges


@functools.cache
def _vocab(family: str, size: int) -> Vocab:
    if family in ("gemma3", "gemma4"):
        return _spm_vocab(size, "gemma4" if family == "gemma4" else "llama")
    return _bpe_vocab(family, size)


def _bpe_vocab(family: str, size: int) -> Vocab:
    bc = _byte_chars()
    # Digits alone, without a leading space, as the `smollm` and `qwen2` pre-tokenizers cut them
    # (transformers reads `smollm` as plain GPT-2 splitting; no digit merges keeps them agreeing).
    chunks = re.findall(r"'(?:[sdmt]|ll|ve|re)| ?[A-Za-z]+|[0-9]| ?[^\sA-Za-z0-9]+|\s+", CORPUS)
    words = Counter(tuple(bc[b] for b in c.encode()) for c in chunks)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    head: list[tuple[str, TT]] = [(t, TT.CONTROL) for t in specials]
    tail: list[tuple[str, TT]] = [(t, TT.USER_DEFINED) for t in ("<think>", "</think>")]
    if family == "llama":  # SmolLM2 layout: specials first
        tail, pads = [], 0
    else:  # Qwen layout: specials after the merges, then [PAD] fill up to the embedding size
        head, tail, pads = [], head + tail, 8
    n_merges = size - len(head) - 256 - len(tail) - pads
    if n_merges < 16:
        raise ValueError(f"vocab_size {size} is too small for the {family} vocabulary")
    merges = _learn_merges(words, n_merges)
    merged = list(dict.fromkeys(a + b for a, b in merges))
    pads += n_merges - len(merged)  # a corpus that runs out of pairs pads instead
    tokens = head + [(c, TT.NORMAL) for c in bc] + [(t, TT.NORMAL) for t in merged] + tail
    tokens += [(f"[PAD{len(tokens) + i}]", TT.UNUSED) for i in range(pads)]
    index = {t: i for i, (t, _) in enumerate(tokens)}
    if family == "llama":  # as SmolLM2's GGUF: bos <|im_start|>, eos = pad <|im_end|>
        roles = dict(bos="<|im_start|>", eos="<|im_end|>", unk="<|endoftext|>", pad="<|im_end|>")
        pre, extra = "smollm", {"add_space_prefix": False}
    else:  # as Qwen3's: bos = pad <|endoftext|>, eos <|im_end|>, no unk
        roles = dict(bos="<|endoftext|>", eos="<|im_end|>", pad="<|endoftext|>")
        pre, extra = "qwen2", {}
    ids = {role: index[token] for role, token in roles.items()}
    return Vocab(
        model="gpt2",
        pre=pre,
        tokens=[t for t, _ in tokens],
        types=[int(k) for _, k in tokens],
        scores=None,
        merges=[f"{a} {b}" for a, b in merges],
        ids=ids,
        add_bos=False,
        chat_template=CHAT_TEMPLATES[family],
        extra=extra,
    )


def _spm_vocab(size: int, model: str = "llama") -> Vocab:
    """Gemma's SentencePiece vocabulary. `model` "gemma4" is how llama.cpp's converter writes
    Gemma 4's (the same pieces from tokenizer.json): with its merges, and no pre-tokenizer."""
    control = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
    user = ["\n", "\n\n"]  # Gemma stores newline runs as user-defined tokens, matched whole
    chars = ["▁", *(chr(c) for c in range(0x21, 0x7F))]
    text = CORPUS.replace(" ", "▁")
    words = Counter(tuple(w) for line in text.splitlines() for w in re.findall(r"▁*[^▁]+|▁+", line))
    n_merges = size - len(control) - len(user) - 256 - len(chars)
    if n_merges < 16:
        raise ValueError(f"vocab_size {size} is too small for the gemma3 vocabulary")
    merges = _learn_merges(words, n_merges)
    tokens = [(t, TT.CONTROL, -1000.0) for t in control]
    tokens += [(t, TT.USER_DEFINED, -1000.0) for t in user]
    tokens += [(f"<0x{b:02X}>", TT.BYTE, 0.0) for b in range(256)]
    # Scores fall with merge order: llama.cpp merges by score, transformers by file position.
    pieces = chars + list(dict.fromkeys(a + b for a, b in merges))
    tokens += [(p, TT.NORMAL, -float(i)) for i, p in enumerate(pieces)]
    tokens += [(f"[PAD{len(tokens) + i}]", TT.UNUSED, -1000.0) for i in range(size - len(tokens))]
    return Vocab(
        model=model,
        pre="default" if model == "llama" else None,
        tokens=[t[0] for t in tokens],
        types=[int(t[1]) for t in tokens],
        scores=[t[2] for t in tokens],
        merges=[f"{a} {b}" for a, b in merges] if model == "gemma4" else None,
        ids=dict(bos=2, eos=1, unk=3, pad=0),
        add_bos=True,
        chat_template=GEMMA_TURNS if model == "gemma4" else None,
        extra={"add_space_prefix": False},
    )


# ---------------------------------------------------------------- weights


def _hf_shapes(spec: TinySpec) -> dict[str, tuple[int, ...]]:
    """HF parameter name -> shape, for the family's *ForCausalLM (MoE: the converter's names)."""
    if spec.family in tiny_moe.FAMILIES:
        return tiny_moe.hf_shapes(spec)
    if spec.family in tiny_qwen35.FAMILIES:
        return tiny_qwen35.hf_shapes(spec)
    h, f, d, v = spec.hidden, spec.ffn, spec.head_dim, spec.vocab_size
    q, kv = spec.heads * d, spec.kv_heads * d
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if not spec.tied:
        shapes["lm_head.weight"] = (v, h)
    layer = dict(input_layernorm=(h,), post_attention_layernorm=(h,))
    layer |= {"self_attn.q_proj": (q, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h)}
    layer |= {"self_attn.o_proj": (h, q), "mlp.gate_proj": (f, h), "mlp.up_proj": (f, h)}
    layer |= {"mlp.down_proj": (h, f)}
    if spec.family in ("qwen3", "gemma3"):
        layer |= {"self_attn.q_norm": (d,), "self_attn.k_norm": (d,)}
    if spec.family == "gemma3":
        layer |= dict(pre_feedforward_layernorm=(h,), post_feedforward_layernorm=(h,))
    for i in range(spec.layers):
        shapes |= {f"model.layers.{i}.{name}.weight": shape for name, shape in layer.items()}
    return shapes


def _permute_qk(w: np.ndarray, n_head: int, inverse: bool = False) -> np.ndarray:
    """llama.cpp's per-head Q/K row order: HF [x0..x(d/2-1), y0..y(d/2-1)] <-> [x0, y0, x1..]."""
    d = w.shape[0] // n_head
    if inverse:
        return w.reshape(n_head, d // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    return w.reshape(n_head, 2, d // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _convention(spec: TinySpec, hf_name: str) -> tuple[str, int]:
    """What llama.cpp does to this tensor: ("permute", n_head), ("shift", 1) or ("", 0)."""
    if spec.family == "llama" and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
        return "permute", spec.heads if "q_proj" in hf_name else spec.kv_heads
    if spec.family == "gemma3" and hf_name.endswith("norm.weight"):
        return "shift", 1
    if spec.family in tiny_qwen35.FAMILIES:
        return "qwen35", 0  # tiny_qwen35.to_gguf / from_gguf
    return "", 0


def _random_hf(spec: TinySpec, hf_name: str, shape: tuple[int, ...]) -> np.ndarray:
    # One stream per tensor, so a tensor's values depend only on (seed, name, shape).
    rng = np.random.default_rng([spec.seed, zlib.crc32(hf_name.encode())])
    if len(shape) == 1 and "norm" not in hf_name and spec.family in tiny_moe.FAMILIES:
        return tiny_moe.random_bias(rng, shape)  # MoE score biases
    if (
        spec.family in tiny_qwen35.FAMILIES
        and (w := tiny_qwen35.random_hf(spec, hf_name, shape, rng)) is not None
    ):
        return w
    if len(shape) == 1:  # norm weights near their identity value (1, or 0 in Gemma's 1 + w form)
        base = 0.0 if spec.family == "gemma3" else 1.0
        return (base + rng.uniform(-0.3, 0.3, shape)).astype(np.float32)
    # Unit-scale embeddings and 1/sqrt(fan_in) projections keep activations O(1) and logits
    # well separated, so greedy continuations are not decided by rounding.
    std = 1.0 if "embed_tokens" in hf_name or "lm_head" in hf_name else shape[-1] ** -0.5
    return (rng.standard_normal(shape) * std).astype(np.float32)


def _kquant_blocks(
    qtype: Q, shape: tuple[int, ...], std: float, rng: np.random.Generator
) -> np.ndarray:
    """Random but valid K-quant blocks whose dequantized values have roughly `std`."""
    n = math.prod(shape) // 256
    f16 = lambda x: np.full((n, 1), x, np.float16).view(np.uint8)  # noqa: E731
    u8 = lambda lo, hi, k: rng.integers(lo, hi, (n, k), dtype=np.uint8)  # noqa: E731
    if qtype == Q.Q6_K:  # ql[128] qh[64] scales:int8[16] d:f16 -> d * sc * (q - 32)
        blocks = [u8(0, 256, 128), u8(0, 256, 64), u8(1, 9, 16), f16(std / (4.5 * 18.5))]
    else:  # Q4_K / Q5_K: d dmin scales[12] [qh[32]] qs[128] -> d * sc * q - dmin * m
        q_max = 15 if qtype == Q.Q4_K else 31
        sc = rng.integers(4, 9, (n, 8)) if qtype == Q.Q4_K else rng.integers(2, 5, (n, 8))
        m = np.rint(sc * q_max / 2).astype(np.int64)  # centre each sub-block on zero
        scales = np.concatenate(
            [
                sc[:, :4] | (sc[:, 4:] >> 4) << 6,
                m[:, :4] | (m[:, 4:] >> 4) << 6,
                (sc[:, 4:] & 0xF) | (m[:, 4:] & 0xF) << 4,
            ],
            axis=1,
        )
        d = std / (sc.mean() * q_max * 0.3)
        blocks = [f16(d), f16(d), scales.astype(np.uint8)]
        blocks += [u8(0, 256, 32)] if qtype == Q.Q5_K else []
        blocks += [u8(0, 256, 128)]
    return np.concatenate(blocks, axis=1).reshape(*shape[:-1], -1)


def _encode(spec: TinySpec, hf_name: str, w: np.ndarray) -> tuple[np.ndarray, Q]:
    """GGUF-layout float tensor -> (stored array, ggml type), as the converter would store it."""
    qtype = QTYPES[spec.qtype][0]
    if w.ndim == 1 or qtype == Q.F32 or hf_name.endswith(ALWAYS_F32):
        return w, Q.F32
    if qtype == Q.F16:
        return w.astype(np.float16), Q.F16
    if qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K):
        rng = np.random.default_rng([spec.seed, zlib.crc32(hf_name.encode()), int(qtype)])
        return _kquant_blocks(qtype, w.shape, float(w.std()), rng), qtype
    return gguf.quants.quantize(w, qtype), qtype


def _llama3_rope_factors(spec: TinySpec) -> np.ndarray:
    """`rope_freqs.weight` exactly as LlamaModel.generate_extra_tensors computes it."""
    dim = spec.head_dim
    freqs = 1.0 / (spec.rope_base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    low_wavelen = LLAMA3_ORIGINAL_CONTEXT / spec.low_freq_factor
    high_wavelen = LLAMA3_ORIGINAL_CONTEXT / spec.high_freq_factor
    factors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(spec.rope_factor)
        else:
            smooth = (LLAMA3_ORIGINAL_CONTEXT / wavelen - spec.low_freq_factor) / (
                spec.high_freq_factor - spec.low_freq_factor
            )
            factors.append(1 / ((1 - smooth) / spec.rope_factor + smooth))
    return np.array(factors, dtype=np.float32)


# ---------------------------------------------------------------- metadata


def _f32(x: float) -> float:
    return float(np.float32(x))  # what a GGUF float32 key reads back as


def _write_metadata(w: gguf.GGUFWriter, spec: TinySpec, vocab: Vocab) -> None:
    # general.* as ModelBase.prepare_metadata writes them, then TextModel.set_gguf_parameters.
    w.add_type(gguf.GGUFType.MODEL)
    w.add_name(spec.name)
    w.add_block_count(spec.layers)
    w.add_context_length(spec.context)
    w.add_embedding_length(spec.hidden)
    if spec.family != "qwen35moe":  # no dense FFN, no intermediate_size to write
        w.add_feed_forward_length(spec.ffn)
    w.add_head_count(spec.heads)
    w.add_head_count_kv(spec.kv_heads)
    w.add_rope_freq_base(spec.rope_base)
    if spec.family == "gemma3":  # from rope_parameters["sliding_attention"]
        w.add_rope_freq_base_swa(GEMMA3_LOCAL_ROPE_BASE)
    w.add_layer_norm_rms_eps(spec.rms_eps)
    w.add_key_length(spec.head_dim)  # every HF config of these families has head_dim
    w.add_value_length(spec.head_dim)
    w.add_file_type(QTYPES[spec.qtype][1])
    if spec.family == "llama":  # LlamaModel.set_gguf_parameters
        w.add_vocab_size(spec.vocab_size)
        w.add_rope_dimension_count(spec.head_dim)
    if spec.family == "gemma3":  # Gemma3Model.set_gguf_parameters (no final softcap in Gemma 3)
        w.add_sliding_window(spec.sliding_window)
    if spec.family in tiny_moe.FAMILIES:
        tiny_moe.write_metadata(w, spec)
    if spec.family in tiny_qwen35.FAMILIES:  # Qwen3NextModel.set_gguf_parameters, M-RoPE
        tiny_qwen35.write_metadata(w, spec)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    _write_vocab(w, vocab)


def _write_vocab(w: gguf.GGUFWriter, vocab: Vocab) -> None:
    # TextModel._set_vocab_gpt2 / _set_vocab_sentencepiece (Gemma4Model.set_vocab) + SpecialVocab.
    w.add_tokenizer_model(vocab.model)
    if vocab.pre is not None:
        w.add_tokenizer_pre(vocab.pre)
    w.add_token_list(vocab.tokens)
    if vocab.scores is not None:
        w.add_token_scores(vocab.scores)
    w.add_token_types(vocab.types)
    if vocab.merges is not None:
        w.add_token_merges(vocab.merges)
    for role, token_id in vocab.ids.items():  # add_bos_token_id, add_eos_token_id, ...
        getattr(w, f"add_{role}_token_id")(token_id)
    w.add_add_bos_token(vocab.add_bos)
    if vocab.model in ("llama", "gemma4"):
        w.add_add_eos_token(False)
    if "add_space_prefix" in vocab.extra:
        w.add_add_space_prefix(vocab.extra["add_space_prefix"])
    if vocab.chat_template is not None:
        w.add_chat_template(vocab.chat_template)


# ---------------------------------------------------------------- HF side


def _hf_config(spec: TinySpec, vocab: Vocab) -> Any:
    import transformers

    common = dict(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden,
        intermediate_size=spec.ffn,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.context,
        rms_norm_eps=_f32(spec.rms_eps),
        tie_word_embeddings=spec.tied,
        bos_token_id=vocab.ids["bos"],
        eos_token_id=vocab.ids["eos"],
        pad_token_id=vocab.ids["pad"],
    )
    rope = {"rope_type": "default", "rope_theta": _f32(spec.rope_base)}
    if spec.family in tiny_moe.FAMILIES:
        return tiny_moe.hf_config(spec, common, rope)
    if spec.family == "llama":
        if spec.rope_scaling == "llama3":
            rope = dict(
                rope_type="llama3",
                rope_theta=_f32(spec.rope_base),
                factor=spec.rope_factor,
                low_freq_factor=spec.low_freq_factor,
                high_freq_factor=spec.high_freq_factor,
                original_max_position_embeddings=LLAMA3_ORIGINAL_CONTEXT,
            )
        return transformers.LlamaConfig(**common, rope_parameters=rope)
    if spec.family == "qwen3":
        return transformers.Qwen3Config(**common, rope_parameters=rope)
    if spec.family in tiny_qwen35.FAMILIES:
        return tiny_qwen35.hf_config(spec, common, rope)
    local = {"rope_type": "default", "rope_theta": GEMMA3_LOCAL_ROPE_BASE}
    return transformers.Gemma3TextConfig(
        **common,
        rope_parameters={"full_attention": rope, "sliding_attention": local},
        sliding_window=spec.sliding_window,
        hidden_activation="gelu_pytorch_tanh",
        query_pre_attn_scalar=spec.head_dim,  # llama.cpp scales scores by 1/sqrt(head_dim)
    )


@dataclass
class TinyModel:
    path: Path
    family: str
    spec: TinySpec
    hf_config: Any  # transformers PretrainedConfig
    state_dict: dict[str, torch.Tensor]  # float32, exactly the dequantized GGUF weights

    def hf_model(self) -> Any:
        """The transformers *ForCausalLM holding `state_dict`: eval, float32, eager attention."""
        import transformers

        config = copy.deepcopy(self.hf_config)
        model = transformers.AutoModelForCausalLM.from_config(
            config, attn_implementation="eager", dtype=torch.float32
        )
        model.load_state_dict(self.state_dict, strict=True)
        return model.eval()

    def gguf_loader_kwargs(self) -> dict[str, Any]:
        """Config fields transformers' GGUF loader misses, for from_pretrained(..., **kwargs)."""
        return {k: copy.deepcopy(getattr(self.hf_config, k)) for k in GGUF_LOADER_GAPS[self.family]}

    def save_hf(self, directory: Path) -> None:
        """config.json + model.safetensors (the tied head is not stored twice)."""
        from safetensors.torch import save_file

        directory.mkdir(parents=True, exist_ok=True)
        self.hf_config.save_pretrained(directory)
        tensors = {
            k: v.contiguous()
            for k, v in self.state_dict.items()
            if not (self.spec.tied and k == "lm_head.weight")
        }
        save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})


def _gguf_name(spec: TinySpec, hf_name: str) -> str | None:
    if spec.family in tiny_moe.FAMILIES:
        return tiny_moe.gguf_name(spec, hf_name)
    tensor_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH[spec.family.upper()], spec.layers)
    source = tiny_qwen35.source_name(hf_name) if spec.family in tiny_qwen35.FAMILIES else hf_name
    return tensor_map.get_name(source, try_suffixes=(".weight", ".bias"))


def build(
    family: str, path: Path, *, seed: int = 0, qtype: str = "F32", **overrides: Any
) -> TinyModel:
    """Write the tiny GGUF to `path`; return it with its transformers twin (see module doc)."""
    if family in MODULE_FAMILIES:
        module, function = MODULE_FAMILIES[family]
        builder = getattr(importlib.import_module(module), function)
        return builder(Path(path), seed=seed, qtype=qtype, **overrides)
    spec = _make_spec(family, qtype, seed, overrides)
    vocab = _vocab(tiny_moe.VOCAB if family in tiny_moe.FAMILIES else family, spec.vocab_size)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(path, family)
    _write_metadata(writer, spec, vocab)

    state_dict: dict[str, torch.Tensor] = {}
    if spec.rope_scaling == "llama3":  # generate_extra_tensors runs before the model's tensors
        writer.add_tensor("rope_freqs.weight", _llama3_rope_factors(spec))
    # Sorted like safetensors stores them, so blk.10 follows blk.1 as in converted files.
    for hf_name, shape in sorted(_hf_shapes(spec).items()):
        gguf_name = _gguf_name(spec, hf_name)
        if gguf_name is None:
            raise AssertionError(f"gguf-py has no name for {hf_name}")
        # HF -> GGUF as the converter does it. With random sources this only fixes value ranges
        # (norms near 1); the inverse below is what ties the state dict to the file.
        kind, arg = _convention(spec, hf_name)
        w = _random_hf(spec, hf_name, shape)
        if kind == "permute":
            w = _permute_qk(w, arg)
        elif kind == "shift":
            w = w + np.float32(arg)
        elif kind == "qwen35":
            w = tiny_qwen35.to_gguf(spec, hf_name, w)
        stored, ggml_type = _encode(spec, hf_name, w)
        writer.add_tensor(
            gguf_name, stored, raw_dtype=None if ggml_type in (Q.F32, Q.F16) else ggml_type
        )
        # The HF weight is what the stored bytes mean, with llama.cpp's conventions undone.
        back = gguf.quants.dequantize(stored, ggml_type).astype(np.float32).reshape(shape)
        if kind == "permute":
            back = _permute_qk(back, arg, inverse=True)
        elif kind == "shift":
            back = back - np.float32(arg)  # exact: stored values lie in [0.5, 2] (Sterbenz)
        elif kind == "qwen35":
            back = tiny_qwen35.from_gguf(spec, hf_name, back)
        state_dict[hf_name] = torch.from_numpy(np.ascontiguousarray(back))
    if spec.family in (*tiny_moe.FAMILIES, "qwen35moe"):  # join the split expert stacks
        state_dict = tiny_moe.hf_state_dict(spec, state_dict)
    if spec.tied:
        state_dict["lm_head.weight"] = state_dict["model.embed_tokens.weight"]
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return TinyModel(path, family, spec, _hf_config(spec, vocab), state_dict)


def _parse_value(text: str) -> Any:
    """`--set` values: Python literals (8, 1e6, None, True), true/false, else the bare string."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return {"true": True, "false": False}.get(text.lower(), text)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("family", choices=FAMILIES)
    parser.add_argument("out", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--qtype", default="F32", choices=tuple(QTYPES))
    parser.add_argument("--hf-dir", type=Path, help="also write config.json + model.safetensors")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a hyperparameter, e.g. --set layers=3 --set rope_scaling=llama3",
    )
    args = parser.parse_args(argv)
    overrides = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            parser.error(f"--set wants KEY=VALUE, got {item!r}")
        overrides[key.replace("-", "_")] = _parse_value(value)
    tiny = build(args.family, args.out, seed=args.seed, qtype=args.qtype, **overrides)
    if args.hf_dir is not None:
        tiny.save_hf(args.hf_dir)
    print(f"wrote {args.out} ({args.out.stat().st_size} bytes): {tiny.spec}")


if __name__ == "__main__":
    main()
