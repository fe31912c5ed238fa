"""A loaded model (or one shard of it): config, weights for a layer range, RoPE tables.

    model = Model.load(path, layers=(0, 15), dtype="float32")
    cache = model.new_cache(capacity=4096)
    h = model.embed(ids)                                  # first shard only
    h, caps = model.forward_layers(h, cache, start, capture={3, 9}, ids=ids)
    logits = model.logits(h[-1:])                         # last shard only
    rows = model.final_hidden(h)                          # last shard: what embeddings pool

A shard owns layers [a, b); the first shard owns the embedding, the last the final
norm and head. `forward_layers` writes K/V at [start, start + n) and then commits
the cache's fill position to start + n. Families with per-token layer inputs (Gemma 4's
per-layer embeddings) need the token ids in every shard, not only the first.

A KV-sharing layer must sit in the same shard as the layer whose K/V it reads
(`cfg.kv_source`); `load` refuses a range that separates them.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from types import ModuleType

import torch

from luced.gguf_file import GGUFError, GGUFFile
from luced.runtime import moe
from luced.runtime.families import family_for
from luced.runtime.families.common import ModelConfig
from luced.runtime.kv_blocks import BlockPool, PagedKVCache
from luced.runtime.kv_cache import KVCache, KVStore, RecurrentShape, layer_roles
from luced.runtime.layers import fuse_rows, rms_norm
from luced.runtime.qlinear import PackedLinear, pack_weights
from luced.runtime.ragged import Ragged, Span
from luced.runtime.weights import WeightLoader, parse_dtype

log = logging.getLogger(__name__)


class Model:
    def __init__(
        self,
        family: ModuleType,
        cfg: ModelConfig,
        weights: dict[str, torch.Tensor],
        layers: range,
        dtype: torch.dtype,
        device: torch.device,
        path: Path,
    ) -> None:
        self.family = family
        self.cfg = cfg
        self.weights = weights
        self.layers = layers
        self.dtype = dtype
        self.device = device
        self.path = path
        self.weights_mode = "dequant"  # qlinear.WEIGHT_MODES; `load` sets it
        self.batch_invariant = False  # `load` sets it: row-exact caches, packed calls only
        self.kv_dtype = dtype  # the K/V rows' (`load` sets it; recurrent states keep `dtype`)
        self.owns_embed = layers.start == 0
        self.owns_head = layers.stop == cfg.n_layers
        self.ropes = family.ropes(cfg, weights, device)

    @classmethod
    def load(
        cls,
        path: str | os.PathLike[str],
        *,
        layers: tuple[int, int] | None = None,
        dtype: str | torch.dtype = "float32",
        device: str | torch.device = "cpu",
        weights: str = "dequant",
        batch_invariant: bool = False,
        experts: Mapping[int, Sequence[int]] | None = None,
        kv_dtype: str | torch.dtype | None = None,
    ) -> Model:
        """`weights`: how matrices are held (qlinear.WEIGHT_MODES); "dequant" is the exact
        float path, the others pack them for the weight-only kernels. `batch_invariant`: a
        token's logits do not depend on the call it came in (a verify block, a prefill
        chunk, a ragged batch) for the packed matrices and attention: every packed call
        takes the kernel 64 rows at a time and attention runs row by row, at a cost
        (docs/features.md, "Batch-invariant mode"). `experts`: MoE layer -> the global ids of the
        routed experts to hold (a placement's hot ones; the stacks then have only those,
        in that order); other layers hold all. `kv_dtype`: the K/V rows' dtype (default
        `dtype`); attention then runs in it."""
        t0 = time.monotonic()
        gguf = GGUFFile(path)
        family = family_for(gguf)
        cfg = family.config_from_gguf(gguf)
        a, b = layers if layers is not None else (0, cfg.n_layers)
        if not 0 <= a < b <= cfg.n_layers:
            raise ValueError(f"layer range [{a}, {b}) outside the model's {cfg.n_layers} layers")
        span = range(a, b)
        for layer in span:
            source = cfg.kv_source(layer)
            if source not in span:
                raise ValueError(
                    f"layer range [{a}, {b}) separates layer {layer} from layer {source}, "
                    "whose KV it reads; they must share a shard"
                )
        torch_dtype, torch_device = parse_dtype(dtype), torch.device(device)
        plan = family.weight_plan(cfg, span, a == 0, b == cfg.n_layers)
        held = moe.stack_experts(experts or {}, span)
        tensors = WeightLoader(gguf, torch_dtype, torch_device, weights, held).load_all(plan)
        try:
            family.prepare(cfg, tensors)
        except ValueError as exc:  # a tensor that contradicts the metadata
            raise GGUFError(f"{gguf.path}: {exc}") from exc
        groups = getattr(family, "FUSED", ())
        fuse_rows(tensors, ([f"{i}.{name}" for name in group] for i in span for group in groups))
        pack_weights(tensors, torch_dtype, torch_device)  # after prepare, which may reorder rows
        model = cls(family, cfg, tensors, span, torch_dtype, torch_device, gguf.path)  # type: ignore[arg-type]
        model.weights_mode = weights
        model.batch_invariant = batch_invariant
        model.kv_dtype = parse_dtype(kv_dtype) if kv_dtype is not None else torch_dtype
        for w in tensors.values():
            if isinstance(w, PackedLinear):
                w.invariant = batch_invariant
        log.info(
            "loaded %s (%s, layers [%d, %d) of %d, %s, weights %s%s) in %.1f s",
            gguf.path.name,
            cfg.arch,
            a,
            b,
            cfg.n_layers,
            str(torch_dtype).removeprefix("torch."),
            weights,
            ", batch-invariant" if batch_invariant else "",
            time.monotonic() - t0,
        )
        return model

    def new_cache(self, capacity: int | None = None) -> KVCache:
        """K/V for the attention layers (each in its own shape; a KV-sharing layer reads its
        source's), and a recurrent state for the layers the family's optional
        `recurrent_shapes(cfg, layers)` names."""
        cfg = self.cfg
        return KVCache(
            self.layers,
            cfg.n_kv_heads,
            cfg.head_dim,
            capacity or cfg.context_length,
            self.kv_dtype,
            self.device,
            shapes={i: cfg.kv_shape(i) for i in self.layers},
            sources=self._kv_sources(),
            recurrent=self._recurrent_shapes(),
            state_dtype=self.dtype,
            row_exact=self.batch_invariant,
        )

    def new_block_pool(
        self, block: int, initial_blocks: int = 64, max_blocks: int | None = None
    ) -> BlockPool:
        """One K/V pool for every sequence of this shard, in blocks of `block` rows (each
        stored layer in its own shape; it grows as the daemon hands out blocks, up to
        max_blocks)."""
        cfg = self.cfg
        _, stored = layer_roles(self.layers, self._kv_sources(), self._recurrent_shapes())
        shapes = {i: cfg.kv_shape(i) for i in stored}
        return BlockPool(
            shapes,
            self.kv_dtype,
            self.device,
            block=block,
            initial_blocks=initial_blocks,
            max_blocks=max_blocks,
        )

    def new_paged_cache(
        self, pool: BlockPool, capacity: int | None = None, *, scored: bool = False
    ) -> PagedKVCache:
        """A sequence's K/V as blocks of `pool` (`new_cache`'s layers, sources, recurrent
        state and row exactness): sequences of one pool may share a prefix's blocks.
        scored: it keeps the `qk` scorer's block keys (KV Flash over the pool)."""
        cfg = self.cfg
        return PagedKVCache(
            pool,
            self.layers,
            capacity or cfg.context_length,
            sources=self._kv_sources(),
            recurrent=self._recurrent_shapes(),
            row_exact=self.batch_invariant,
            state_dtype=self.dtype,
            scored=scored,
        )

    def _kv_sources(self) -> dict[int, int]:
        """The KV-sharing layers of this shard -> the layer whose rows each reads."""
        return {i: s for i in self.layers if (s := self.cfg.kv_source(i)) != i}

    def _recurrent_shapes(self) -> dict[int, RecurrentShape] | None:
        """The layers that keep a recurrent state (the family's optional `recurrent_shapes`)."""
        recurrent = getattr(self.family, "recurrent_shapes", None)
        return recurrent(self.cfg, self.layers) if recurrent is not None else None

    # `embed`, `forward_layers` and `logits` each run in an inference_mode of their own;
    # `embed_rows`, `run_layers` and `head_logits` are the same in the caller's mode, for a
    # compiled step (torch.compile cannot trace into a mode switch; the step holds one).

    def embed_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The token embeddings of ids (first shard only)."""
        if not self.owns_embed:
            raise RuntimeError("this shard does not own the embedding")
        return self.family.embed(self, ids.to(self.device))

    embed = torch.inference_mode()(embed_rows)

    def run_layers(
        self,
        hidden: torch.Tensor,
        cache: KVStore | Ragged,
        start: int | Ragged,
        capture: Iterable[int] = (),
        ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Run this shard's layers over hidden ([n, hidden]) at positions start..start+n-1,
        or over a ragged batch of sequences (the same `Ragged` as `cache` and `start`).
        `ids` ([n] token ids of those positions) feed families with per-token layer inputs.

        Returns the output and, for each requested layer in range, that layer's output
        (the residual stream after its FFN; HF's hidden_states[layer + 1])."""
        wanted = set(capture)
        n = hidden.shape[0]
        layer_inputs = getattr(self.family, "layer_inputs", None)
        inputs = {}
        if layer_inputs is not None and self.layers:
            inputs = layer_inputs(self, None if ids is None else ids.to(self.device, torch.int64))
        if isinstance(cache, Ragged):
            if start is not cache or cache.n != n:
                raise ValueError("a ragged batch is both the cache and the start of its rows")
            cache.reserve()
        else:
            assert isinstance(start, int)
            cache.reserve(start, n)
        captures: dict[int, torch.Tensor] = {}
        x = hidden.to(self.dtype)
        for layer in self.layers:
            x = self.family.block(self, layer, x, start, cache, **inputs)
            if layer in wanted:
                captures[layer] = x
        if isinstance(cache, Ragged):
            cache.commit()
        else:
            cache.commit(start + n)
        return x, captures

    forward_layers = torch.inference_mode()(run_layers)

    @torch.inference_mode()
    def final_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """The last layer's rows as the head reads them (after the final norm): what an
        embedding pools (HF's last_hidden_state). Last shard only."""
        if not self.owns_head:
            raise RuntimeError("this shard does not hold the last layer")
        final_norm = getattr(self.family, "final_norm", None)
        if final_norm is not None:
            return final_norm(self, hidden)
        return rms_norm(hidden, self.weights["out_norm"], self.cfg.rms_eps)

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The output head's logits of hidden rows (last shard only)."""
        if not self.owns_head:
            raise RuntimeError("this shard does not own the output head")
        return self.family.head(self, hidden)

    logits = torch.inference_mode()(head_logits)

    def forward(self, ids: torch.Tensor, cache: KVStore, start: int) -> torch.Tensor:
        """Whole-model convenience: token ids -> float32 logits for every position."""
        h, _ = self.forward_layers(self.embed(ids), cache, start, ids=ids)
        return self.logits(h)

    def forward_batch(
        self, ids: Sequence[torch.Tensor], caches: Sequence[KVStore], starts: Sequence[int]
    ) -> list[torch.Tensor]:
        """Whole-model ragged batch: sequence i feeds ids[i] at starts[i] into caches[i], all
        in one pass; -> each sequence's float32 logits for every position it fed."""
        batch = Ragged([Span(c, s, len(t)) for t, c, s in zip(ids, caches, starts, strict=True)])
        flat = torch.cat(list(ids))
        h, _ = self.forward_layers(self.embed(flat), batch, batch, ids=flat)
        return list(self.logits(h).split(batch.sizes))
