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

    recurrent_shapes(cfg, layers) -> {layer: RecurrentShape}   the layers that keep a
                                                recurrent state instead of K/V (kv_cache)
    layer_inputs(model, ids) -> {name: value}   per-token inputs every block of a shard
                                                 reads besides the hidden state (Gemma 4's
                                                 per-layer embeddings), once per forward;
                                                 passed to `block` as keyword arguments
    final_norm(model, x) -> [n, hidden]         the last layer's rows as the head reads
                                                 them, what embeddings pool (default: the
                                                 RMSNorm by `out_norm`; an encoder's blocks
                                                 end normed)

Keys of the weight dict are `tok_embd` (or `tied_embd`), `out_norm`, `head` and `{layer}.{name}`
(e.g. `3.attn_q`); matrices are stored in `layers.linear`'s layout for their dtype.
The config says each layer's K/V shape and, for KV-sharing layers, which layer's K/V
it reads (`kv_shape`, `kv_source`); the model builds its cache from them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from luced.gguf_file import GGUFError, GGUFFile
from luced.runtime import native_attention
from luced.runtime.decode_graph import StepBatch
from luced.runtime.layers import (
    Norm,
    Rope,
    apply_rope,
    attention,
    linear,
    linears,
    matrix_row_select,
    rms_norm,
)
from luced.runtime.ragged import Ragged, Span

if TYPE_CHECKING:
    from luced.runtime.kv_cache import KVStore


# Matrices that read one input, which the loader may stack into one (`layers.fuse_rows`):
# a family whose code reads them through `layers.linears` / `gated_ffn` (as `attend` does)
# names these as its FUSED groups; a layer without a group's matrices keeps what it has.
FUSED = (("attn_q", "attn_k", "attn_v"), ("ffn_gate", "ffn_up"))


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
    n_heads: int  # the largest per-layer count when they vary
    n_kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    rms_eps: float
    rope_base: float
    rope_dims: int
    context_length: int
    tied_head: bool
    # Per-layer head counts when the GGUF stores arrays (e.g. laguna); empty = uniform.
    layer_heads: tuple[int, ...] = ()
    layer_kv_heads: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for field in ("n_layers", "hidden", "n_heads", "n_kv_heads", "head_dim", "ffn", "vocab"):
            if getattr(self, field) <= 0:
                raise ValueError(f"{self.arch} config: {field} must be positive")
        for name, counts in (("head", self.layer_heads), ("kv head", self.layer_kv_heads)):
            if counts and (len(counts) != self.n_layers or min(counts) <= 0):
                raise ValueError(f"{self.arch} config: bad per-layer {name} counts {counts}")
        for layer in range(self.n_layers):
            if self.heads(layer) % self.kv_heads(layer):
                raise ValueError(
                    f"{self.arch} config: layer {layer}: {self.heads(layer)} heads not "
                    f"divisible by {self.kv_heads(layer)} kv heads"
                )

    def heads(self, layer: int) -> int:
        return self.layer_heads[layer] if self.layer_heads else self.n_heads

    def kv_heads(self, layer: int) -> int:
        return self.layer_kv_heads[layer] if self.layer_kv_heads else self.n_kv_heads

    def kv_shape(self, layer: int) -> tuple[int, int]:
        """(kv heads, head dim) of a layer's K/V."""
        return self.kv_heads(layer), self.head_dim

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

    n_layers = int(gguf.require(key("block_count")))
    heads = gguf.layer_counts("attention.head_count")
    kv_heads = gguf.layer_counts("attention.head_count_kv", heads)
    hidden = int(gguf.require(key("embedding_length")))
    head_dim = int(known.get("head_dim", gguf.get(key("attention.key_length"), hidden // heads[0])))
    ffn = known["ffn"] if "ffn" in known else gguf.require(key("feed_forward_length"))
    vocab = gguf.get(key("vocab_size"))
    if vocab is None:
        vocab = gguf.info("token_embd.weight").shape[0]
    eps = (
        known["rms_eps"]
        if "rms_eps" in known
        else gguf.require(key("attention.layer_norm_rms_epsilon"))
    )
    return {
        "arch": arch,
        "n_layers": n_layers,
        "hidden": hidden,
        "n_heads": max(heads),
        "n_kv_heads": max(kv_heads),
        "layer_heads": heads if len(set(heads)) > 1 else (),
        "layer_kv_heads": kv_heads if len(set(kv_heads)) > 1 else (),
        "head_dim": head_dim,
        "ffn": int(ffn),
        "vocab": int(vocab),
        "rms_eps": float(eps),
        "rope_base": float(gguf.get(key("rope.freq_base"), 10000.0)),
        "rope_dims": int(gguf.get(key("rope.dimension_count"), head_dim)),
        "context_length": int(gguf.get(key("context_length"), 2048)),
        "tied_head": "output.weight" not in gguf.tensors,
    } | known


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
    if owns_embed and cfg.tied_head and not owns_head:
        # The head's matrix, held as a head would hold it (packed under --weights), so a
        # split model embeds exactly as the whole one does.
        plan["tied_embd"] = ("token_embd.weight", True)
    elif owns_embed and not cfg.tied_head:
        plan["tok_embd"] = ("token_embd.weight", False)
    return plan


def layer_plan(
    layers: Iterable[int], names: dict[str, str], matrices: set[str]
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
    # Tied: rows of the head's matrix (a shard without the head holds it as "tied_embd").
    return matrix_row_select(w["head"] if "head" in w else w["tied_embd"], ids)


def attend(
    model: ModelParts,
    layer: int,
    x: torch.Tensor,
    start: int | Ragged,
    cache: KVStore | Ragged,
    rope: Rope,
    *,
    window: int | None = None,
    scale: float | None = None,
    norm: Norm | None = None,
) -> torch.Tensor:
    """Q/K/V projections, optional per-head Q/K RMSNorm, RoPE, cached attention.
    x: [n, hidden], normed already or by `norm` here (fused into the projection's kernel where
    it can be) -> the heads' outputs [n, H*D], before the output projection (gated families
    scale them first). Head counts come from the weights, so layers may differ in them."""
    cfg: ModelConfig = model.cfg
    w = model.weights
    n, d = x.shape[0], cfg.head_dim
    keys = (f"{layer}.attn_q", f"{layer}.attn_k", f"{layer}.attn_v")
    q, k, v = linears(x, w, keys, norm=norm)
    q, k, v = q.view(n, -1, d), k.view(n, -1, d), v.view(n, -1, d)  # [n, H | Hkv, D]
    scale = scale if scale is not None else d**-0.5
    if f"{layer}.attn_q_norm" in w:
        q = rms_norm(q, w[f"{layer}.attn_q_norm"], cfg.rms_eps)
        k = rms_norm(k, w[f"{layer}.attn_k_norm"], cfg.rms_eps)
    # RoPE is left to the attention, where a decode kernel applies it as it stores the row
    return cached_attention(layer, q, start, cache, (k, v), window=window, scale=scale, rope=rope)


def rotate(
    q: torch.Tensor,
    kv: tuple[torch.Tensor, torch.Tensor] | None,
    start: int | Ragged,
    rope: Rope,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """RoPE on the queries [n, H, D] and, when given, the new keys."""
    cos, sin = rope.tables(start, q.shape[0], q.dtype)
    if kv is None:
        return apply_rope(q, cos, sin), None
    return apply_rope(q, cos, sin), (apply_rope(kv[0], cos, sin), kv[1])


def self_attention(
    model: ModelParts,
    layer: int,
    x: torch.Tensor,
    start: int | Ragged,
    cache: KVStore | Ragged,
    rope: Rope,
    *,
    window: int | None = None,
    scale: float | None = None,
    norm: Norm | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """`attend`, then the output projection: x [n, hidden] (normed, or by `norm`) ->
    [n, hidden], plus `residual` when given (added in the projection's kernel where it can)."""
    out = attend(model, layer, x, start, cache, rope, window=window, scale=scale, norm=norm)
    return linear(out, model.weights[f"{layer}.attn_output"], residual=residual)


def cached_attention(
    layer: int,
    q: torch.Tensor,
    start: int | Ragged,
    cache: KVStore | Ragged,
    kv: tuple[torch.Tensor, torch.Tensor] | None,
    *,
    window: int | None,
    scale: float,
    rope: Rope | None = None,
) -> torch.Tensor:
    """Attention of one layer over its cache. q: [n, H, D]; kv: this layer's new (k, v)
    [n, Hkv, D] to store, or None for a KV-sharing layer, which reads its source layer's
    rows; rope: the rotation q and the new k still need (None: they are roped), which the
    native decode kernel applies as it stores the row. -> the heads' outputs [n, H*D],
    before the output projection. A ragged batch (as `start` and `cache`) attends each
    sequence over its own cache; a captured decode step's batch attends in fixed shapes."""
    if isinstance(cache, StepBatch):
        return cache.attend(layer, q, kv, window=window, scale=scale, rope=rope)
    fused = _native_decode(layer, q, start, cache, kv, window, scale, rope)
    if fused is not None:
        return fused
    if rope is not None:
        q, kv = rotate(q, kv, start, rope)
    if isinstance(cache, Ragged):  # each sequence attends over its own cache

        def one(s: Span, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None):
            own = None if k is None or v is None else (k, v)
            return cached_attention(layer, q, s.start, s.cache, own, window=window, scale=scale)

        return cache.per_sequence(one, q, *(kv or (None, None)))
    assert isinstance(start, int)
    n = q.shape[0]
    if kv is not None:
        cache.store(layer, start, *kv)
        cache.observe_query(layer, q, window)  # KV Flash qk scores chunks by it
    dtype = q.dtype
    if n > 1:
        # Each query attends exactly as a decode step at its position would. One SDPA call
        # over n queries differs from n calls in the last float bits (and with the number
        # of keys it is given), and the packed kernels' activations grow that into
        # different logits (0.66 on SmolLM2 under --weights auto); so a verify block gives
        # decode's very logits, and a prompt's rows are the same wherever its prefill was
        # cut (a prefix-cache restore, a chunk boundary).
        storage = cache.decode_storage(layer)
        in_order = storage is not None and storage.positions is None  # no evicted gaps
        if in_order and native_attention.supported(q, [storage]):  # type: ignore[list-item]
            each = range(start, start + n)  # n queries, each as its own decode step
            out = native_attention.decode_attention(q, None, [storage] * n, each, window, scale)  # type: ignore[list-item]
            return out if out.dtype == dtype else out.to(dtype)
    # The rows in position order: a paged or pooled cache gathers them unless they are
    # consecutive, so only the SDPA paths ask.
    keys, values = cache.read(layer, start + n)
    if keys.dtype != dtype:  # --kv-dtype: SDPA runs in the cache's dtype
        q = q.to(keys.dtype)
    if n > 1 and cache.row_exact:
        out = torch.cat([
            attention(
                q[i : i + 1],
                keys[:, : start + i + 1],
                values[:, : start + i + 1],
                cache.mask(start + i, 1, window, q.device),
                scale,
            )
            for i in range(n)
        ])  # fmt: skip
    else:
        out = attention(q, keys, values, cache.mask(start, n, window, q.device), scale)
    return out if out.dtype == dtype else out.to(dtype)


def _native_decode(
    layer: int,
    q: torch.Tensor,
    start: int | Ragged,
    cache: KVStore | Ragged,
    kv: tuple[torch.Tensor, torch.Tensor] | None,
    window: int | None,
    scale: float,
    rope: Rope | None,
) -> torch.Tensor | None:
    """A decode step's attention (one query per sequence, alone or a whole batch) as one
    native call that also stores the new K/V rows (and ropes q and k on the way, when
    `rope` is given); None where it does not apply."""
    if isinstance(cache, Ragged):
        if cache.n != len(cache.spans):  # some sequence feeds more than one token
            return _native_blocks(layer, q, cache, kv, window, scale, rope)
        caches, positions = [s.cache for s in cache.spans], [s.start for s in cache.spans]
    elif q.shape[0] == 1:
        caches, positions = [cache], [start]
    else:
        return None
    stores: list[KVStore] = caches  # type: ignore[assignment]
    storage = [c.decode_storage(layer) for c in stores]
    if any(rows is None for rows in storage) or not native_attention.supported(q, storage):  # type: ignore[arg-type]
        return None
    in_place = all(c.writes_in_place for c in stores)
    # as on the SDPA path, a KV-sharing layer's queries are not observed
    observed = [i for i, c in enumerate(stores) if c.observes_queries and kv is not None]
    if rope is not None and (observed or (kv is not None and not in_place)):
        q, kv = rotate(q, kv, start, rope)  # the cache sees roped queries or keys
        rope = None
    for i in observed:
        stores[i].observe_query(layer, q[i : i + 1], window)
    if kv is not None and not in_place:
        for i, (c, pos) in enumerate(zip(stores, positions, strict=True)):
            # a write that does more than store rows (KV Flash seals chunk keys) comes first
            c.store(layer, pos, kv[0][i : i + 1], kv[1][i : i + 1])
        kv = None  # the kernel only reads
    tables = None if rope is None else rope.table(max(positions) + 1)
    return native_attention.decode_attention(q, kv, storage, positions, window, scale, tables)  # type: ignore[arg-type]


def _native_blocks(
    layer: int,
    q: torch.Tensor,
    batch: Ragged,
    kv: tuple[torch.Tensor, torch.Tensor] | None,
    window: int | None,
    scale: float,
    rope: Rope | None,
) -> torch.Tensor | None:
    """A step whose sequences feed several tokens (verify blocks, prefill chunks beside
    decode tokens) in one native call: the rows are stored first, then every query attends
    as its own decode step, as each sequence's queries do alone. None where it does not
    apply (a cache that seals or scores what it stores, or whose rows are out of order)."""
    stores: list[KVStore] = [s.cache for s in batch.spans]  # type: ignore[misc]
    if any(c.observes_queries or not c.writes_in_place for c in stores):
        return None
    storage = [c.decode_storage(layer) for c in stores]
    if any(rows is None or rows.positions is not None for rows in storage):
        return None
    if not native_attention.supported(q, storage):  # type: ignore[arg-type]
        return None
    if rope is not None:
        q, kv = rotate(q, kv, batch, rope)
    if kv is not None:
        keys, values = kv[0].split(batch.sizes), kv[1].split(batch.sizes)
        for span, k, v in zip(batch.spans, keys, values, strict=True):
            span.cache.store(layer, span.start, k, v)  # type: ignore[attr-defined]
    each = [rows for rows, n in zip(storage, batch.sizes, strict=True) for _ in range(n)]
    positions = batch.position_list
    return native_attention.decode_attention(q, None, each, positions, window, scale)  # type: ignore[arg-type]
