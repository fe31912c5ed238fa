"""What the decoder families share: the config read from GGUF metadata, the tensor
name plan of a layer range, and the self-attention sub-block.

A family module provides::

    ARCH: str                                   GGUF general.architecture
    config_from_gguf(gguf) -> ModelConfig       typed config (a subclass per family)
    weight_plan(cfg, layers, owns_embed, owns_head) -> {key: (tensor, is_matrix)}
    prepare(cfg, weights) -> None               post-load fix-ups (e.g. un-permute Q/K)
    ropes(cfg, weights, device) -> {layer: Rope}
    embed(model, ids) -> [n, hidden]
    block(model, layer, x, start, cache, **inputs) -> [n, hidden]
    head(model, x) -> [n, vocab] float32 logits      final norm, then project
    project(model, h) -> [n, vocab] float32 logits   head matrix + logit scaling / softcap

and optionally::

    layer_inputs(model, ids) -> {name: value}   per-token inputs every block of a shard
                                                 reads besides the hidden state (Gemma 4's
                                                 per-layer embeddings), once per forward;
                                                 passed to `block` as keyword arguments

Keys of the weight dict are `tok_embd`, `out_norm`, `head` and `{layer}.{name}`
(e.g. `3.attn_q`); matrices are stored in `layers.linear`'s layout for their dtype.
The config says each layer's K/V shape and, for KV-sharing layers, which layer's K/V
it reads (`kv_shape`, `kv_source`); the model builds its cache from them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from luced.gguf_file import GGUFError, GGUFFile
from luced.runtime.layers import (
    Rope,
    apply_rope,
    attention,
    attention_mask,
    linear,
    matrix_rows,
    rms_norm,
)

if TYPE_CHECKING:
    from luced.runtime.kv_cache import KVCache


class ModelParts(Protocol):
    """What a family reads from a loaded model (``luced.runtime.model.Model``): the
    families take this, so they never import the module that imports them."""

    cfg: Any  # the family's ModelConfig subclass
    weights: dict[str, torch.Tensor]
    ropes: dict[int, Rope]
    dtype: torch.dtype
    device: torch.device


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    n_layers: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    rms_eps: float
    rope_base: float
    rope_dims: int
    context_length: int
    tied_head: bool

    def __post_init__(self) -> None:
        for field in ("n_layers", "hidden", "n_heads", "n_kv_heads", "head_dim", "ffn", "vocab"):
            if getattr(self, field) <= 0:
                raise ValueError(f"{self.arch} config: {field} must be positive")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"{self.arch} config: {self.n_heads} heads not divisible by kv heads")

    def kv_shape(self, layer: int) -> tuple[int, int]:
        """(kv heads, head dim) of a layer's K/V; the same for every layer unless overridden."""
        return self.n_kv_heads, self.head_dim

    def kv_source(self, layer: int) -> int:
        """The layer whose K/V `layer` attends to: itself unless it shares another's."""
        return layer


def base_fields(gguf: GGUFFile, **known: Any) -> dict[str, Any]:
    """The fields every family reads, from `{arch}.*` keys (llama.cpp names). `known`
    fields are taken as given and their keys not read (e.g. a per-layer array the
    family resolves itself)."""
    arch = gguf.arch

    def key(name: str) -> str:
        return f"{arch}.{name}"

    n_heads = int(gguf.require(key("attention.head_count")))
    hidden = int(gguf.require(key("embedding_length")))
    n_kv = known.get("n_kv_heads", gguf.get(key("attention.head_count_kv"), n_heads))
    if not isinstance(n_kv, int | float):
        raise GGUFError(f"{gguf.path}: per-layer {key('attention.head_count_kv')} unsupported")
    head_dim = int(known.get("head_dim", gguf.get(key("attention.key_length"), hidden // n_heads)))
    vocab = gguf.get(key("vocab_size"))
    if vocab is None:
        vocab = gguf.info("token_embd.weight").shape[0]
    ffn = known["ffn"] if "ffn" in known else gguf.require(key("feed_forward_length"))
    return {
        "arch": arch,
        "n_layers": int(gguf.require(key("block_count"))),
        "hidden": hidden,
        "n_heads": n_heads,
        "n_kv_heads": int(n_kv),
        "head_dim": head_dim,
        "ffn": int(ffn),
        "vocab": int(vocab),
        "rms_eps": float(gguf.require(key("attention.layer_norm_rms_epsilon"))),
        "rope_base": float(gguf.get(key("rope.freq_base"), 10000.0)),
        "rope_dims": int(gguf.get(key("rope.dimension_count"), head_dim)),
        "context_length": int(gguf.get(key("context_length"), 2048)),
        "tied_head": "output.weight" not in gguf.tensors,
    }


def make_config(
    cls: type, gguf: GGUFFile, known: dict[str, Any] | None = None, **extra: Any
) -> Any:
    """cls(base fields, extra fields), errors named after the file; `known` as in base_fields."""
    try:
        return cls(**base_fields(gguf, **(known or {})), **extra)
    except (TypeError, ValueError) as exc:
        raise GGUFError(f"{gguf.path}: bad {gguf.arch} metadata: {exc}") from exc


def edge_plan(cfg: ModelConfig, owns_embed: bool, owns_head: bool) -> dict[str, tuple[str, bool]]:
    """Embedding, final norm and output head of a shard that owns either end.

    A tied model reads its embedding rows out of the head instead of holding a
    second copy of the (often largest) tensor."""
    plan: dict[str, tuple[str, bool]] = {}
    if owns_head:
        plan["out_norm"] = ("output_norm.weight", False)
        plan["head"] = ("token_embd.weight" if cfg.tied_head else "output.weight", True)
    if owns_embed and not (owns_head and cfg.tied_head):
        plan["tok_embd"] = ("token_embd.weight", False)
    return plan


def layer_plan(
    layers: range, names: dict[str, str], matrices: set[str]
) -> dict[str, tuple[str, bool]]:
    """names: our key -> GGUF suffix (`attn_q` -> `attn_q.weight`); `matrices` feed linear."""
    return {
        f"{i}.{key}": (f"blk.{i}.{suffix}", key in matrices)
        for i in layers
        for key, suffix in names.items()
    }


def embed_rows(model: ModelParts, ids: torch.Tensor) -> torch.Tensor:
    """Embedding rows for ids ([n] int64) -> [n, hidden] in the compute dtype."""
    w = model.weights
    if "tok_embd" in w:
        return w["tok_embd"][ids]
    return matrix_rows(w["head"])[ids]  # tied: rows of the head


def self_attention(
    model: ModelParts,
    layer: int,
    x: torch.Tensor,
    start: int,
    cache: KVCache,
    rope: Rope,
    *,
    window: int | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Q/K/V projections, optional per-head Q/K RMSNorm, RoPE, cached attention, output
    projection. x: [n, hidden] (already normed) -> [n, hidden]."""
    cfg: ModelConfig = model.cfg
    w = model.weights
    n = x.shape[0]
    q = linear(x, w[f"{layer}.attn_q"]).view(n, cfg.n_heads, cfg.head_dim)
    k = linear(x, w[f"{layer}.attn_k"]).view(n, cfg.n_kv_heads, cfg.head_dim)
    v = linear(x, w[f"{layer}.attn_v"]).view(n, cfg.n_kv_heads, cfg.head_dim)
    if f"{layer}.attn_q_norm" in w:
        q = rms_norm(q, w[f"{layer}.attn_q_norm"], cfg.rms_eps)
        k = rms_norm(k, w[f"{layer}.attn_k_norm"], cfg.rms_eps)
    cos, sin = rope.tables(start, n, q.dtype)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    scale = scale if scale is not None else cfg.head_dim**-0.5
    return attend(model, layer, q, start, cache, (k, v), window=window, scale=scale)


def attend(
    model: ModelParts,
    layer: int,
    q: torch.Tensor,
    start: int,
    cache: KVCache,
    kv: tuple[torch.Tensor, torch.Tensor] | None,
    *,
    window: int | None,
    scale: float,
) -> torch.Tensor:
    """Cached attention and output projection of one layer. q: [n, H, D] (roped); kv:
    this layer's new (k, v) [n, Hkv, D] to store, or None for a KV-sharing layer, which
    attends to its source layer's rows. -> [n, hidden]"""
    n = q.shape[0]
    if kv is None:
        keys, values = cache.read(layer, start + n)
    else:
        keys, values = cache.write(layer, start, *kv)
    mask = attention_mask(start, n, start + n, window, q.device)
    out = attention(q, keys, values, mask, scale)
    return linear(out, model.weights[f"{layer}.attn_output"])
