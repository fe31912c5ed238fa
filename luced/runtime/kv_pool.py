"""KV Flash in the worker: K/V over a fixed pool of rows, and the host-tier copies.

Each layer's K and V are `[Hkv, pool, D]` (pool rows, not context rows: this is where
the memory bound comes from). Rows are cut into blocks of `chunk` (64) rows; the
daemon's pager (`luced.engine.kvflash`) decides which chunk of the sequence sits in
which block and tells the worker, per step, with `set_step`:

    write_slots     [n]     int   pool row of position start + i
    slot_positions  [pool]  int   position each row holds, -1 = none

A query at position q sees row s iff 0 <= slot_positions[s] < start, or s is one of
the step's write slots and slot_positions[s] <= q; sliding layers also need
q - slot_positions[s] < window. K is stored after RoPE, so a row's slot carries no
meaning and a chunk may be paged back into any block.

Attention gathers the visible rows in logical (position) order and runs the same SDPA
as the plain `KVCache`. When every position [0, start + n) is visible the gathered
keys are exactly the plain cache's keys with the plain mask, so the logits are
bit-identical, whatever the block order; in the identity layout the gather is a view.
With rows hidden, the keys are the visible rows only (a shorter SDPA, equal to a
masked full-length one up to float rounding).

Host tier record of one chunk (`page_out` / `page_in`), `chunk_nbytes` bytes: the layout
of `kv_host.RecordLayout` with `chunk` rows. The copies are byte-exact. A paged-out block
is not zeroed: the mask hides it.

Recurrent layers (Gated DeltaNet, qwen35 / qwen35moe) keep no rows, only a state that
sums up every committed position; it is never paged. It lives beside the pool exactly as
in `KVCache` (`kv_cache.BaseKVCache`: recurrent_state, stage_state, commit, truncate
to a kept state, save_state, ...), so a hybrid pools its attention layers only and its
host records hold their rows only.

The `qk` scorer's state (`kv_qk.ChunkKeys`, `self.qk`) is kept here: a chunk is sealed
by the step that writes its last position (its rows are then all in its block), and
each full-attention layer's query is observed through `observe_query`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from luced.runtime.kv_cache import (
    BaseKVCache,
    ContextOverflow,
    RecurrentShape,
    RecurrentState,
    layer_roles,
)
from luced.runtime.kv_host import HostTier, RecordLayout, SharedHostTier
from luced.runtime.kv_qk import ChunkKeys
from luced.runtime.layers import attention_mask, positions_mask
from luced.runtime.native_attention import Storage


@dataclass
class _Step:
    start: int
    n: int
    slots: torch.Tensor  # [n] int64 write rows
    rows: torch.Tensor  # [L] int64 visible rows, in position order
    positions: torch.Tensor  # [L] int64 their positions
    complete: bool  # rows hold exactly positions 0..start+n-1
    seal_chunks: torch.Tensor  # [m] chunks whose last position this step writes
    seal_blocks: torch.Tensor  # [m] their blocks
    masks: dict[int | None, torch.Tensor | None] = field(default_factory=dict)


class PooledKVCache(BaseKVCache):
    """The `KVCache` surface (reserve, write, mask, commit, truncate, reset, and the
    recurrent layers' state) over pool rows.

    `capacity` is the logical bound (the context length); `pool` the rows allocated."""

    row_exact = False  # rows are pool slots: KV Flash is not batch-invariant

    def __init__(
        self,
        layers: range,
        n_kv_heads: int | Mapping[int, int],
        head_dim: int,
        pool: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        *,
        capacity: int,
        chunk: int = 64,
        shapes: Mapping[int, tuple[int, int]] | None = None,
        sources: Mapping[int, int] | None = None,
        recurrent: Mapping[int, RecurrentShape] | None = None,
        state_dtype: torch.dtype | None = None,
    ) -> None:
        """shapes: layer -> (Hkv, D) where it differs from (n_kv_heads, head_dim);
        sources: KV-sharing layer -> the layer of this cache whose rows it reads (Gemma 4);
        recurrent: the layers that keep a recurrent state instead of rows (qwen35);
        state_dtype: the recurrent conv windows' dtype (default `dtype`, the rows')."""
        if pool <= 0 or pool % chunk:
            raise ValueError(f"a pool of {pool} rows is not a positive multiple of {chunk}")
        self.layers = layers
        self.sources, self.stored = layer_roles(layers, sources, recurrent)
        self.device = torch.device(device)
        states = state_dtype or dtype
        self.recurrent = RecurrentState(recurrent, states, self.device) if recurrent else None
        heads = n_kv_heads if isinstance(n_kv_heads, Mapping) else dict.fromkeys(layers, n_kv_heads)
        self.shapes = {i: (heads[i], head_dim) for i in self.stored}
        self.shapes.update((i, s) for i, s in (shapes or {}).items() if i in self.shapes)
        self.kv_heads = {i: h for i, (h, _) in self.shapes.items()}
        self.head_dim = head_dim
        self.pool = pool
        self.chunk = chunk
        self.capacity = capacity
        self.dtype = dtype
        self.pos = 0
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}
        for i in self.stored:
            h, d = self.shapes[i]
            self.k[i] = torch.zeros((h, pool, d), dtype=dtype, device=self.device)
            self.v[i] = torch.zeros((h, pool, d), dtype=dtype, device=self.device)
        self._step: _Step | None = None
        self._arange = torch.arange(pool, device=self.device)
        self._held = torch.full((pool,), -1, dtype=torch.int64, device=self.device)  # last map
        self.qk = ChunkKeys(self.shapes, -(-capacity // chunk), chunk, self.device)

    def set_step(
        self,
        start: int,
        write_slots: Sequence[int] | torch.Tensor,
        slot_positions: Sequence[int] | torch.Tensor,
    ) -> None:
        """The next forward's rows (see the module doc); checked against each other."""
        slots = torch.as_tensor(write_slots, dtype=torch.int64, device=self.device)
        held = torch.as_tensor(slot_positions, dtype=torch.int64, device=self.device)
        n, end = slots.shape[0], start + slots.shape[0]
        if held.shape != (self.pool,):
            raise ValueError(f"slot map of shape {list(held.shape)} for a pool of {self.pool}")
        if n == 0 or not torch.equal(held[slots], self._arange[:n] + start):
            raise ValueError(f"write slots do not hold positions [{start}, {end}) in the map")
        own = torch.zeros(self.pool, dtype=torch.bool, device=self.device)
        own[slots] = True
        visible = ((held >= 0) & (held < start)) | own
        rows = visible.nonzero().squeeze(1)
        positions, order = held[rows].sort()
        rows = rows[order]
        complete = positions.shape[0] == end and torch.equal(positions, self._arange[:end])
        size = self.chunk
        first = -(-(start + 1) // size) * size - 1  # the first chunk end at or after start
        last = torch.arange(first, max(first, end), size, device=self.device)
        seal_blocks = slots[last - start] // size
        self._step = _Step(start, n, slots, rows, positions, complete, last // size, seal_blocks)
        self._held = held

    def reserve(self, start: int, n: int) -> None:
        step = self._step
        if step is None or (step.start, step.n) != (start, n):
            raise ValueError(f"no pool rows set for positions [{start}, {start + n})")
        if start > self.pos:
            raise ValueError(f"KV write at {start} would leave a gap after position {self.pos}")
        if start + n > self.capacity:
            raise ContextOverflow(
                f"context of {start + n} tokens exceeds the KV capacity {self.capacity}"
            )
        if self.recurrent is not None:
            self.truncate(start)  # the recurrent layers continue from the state at start

    def write(
        self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v ([n, Hkv, D]) at the step's slots; return the visible K, V in position
        order as [Hkv, L, D] (views when they are pool rows 0..L-1)."""
        self.store(layer, start, k, v)
        return self._visible(layer)

    def store(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v at the step's slots, and seal the chunks the step completes (their
        mean keys for qk)."""
        step = self._step
        assert step is not None, "reserve() checks the step first"
        self.k[layer].index_copy_(1, step.slots, k.transpose(0, 1))
        self.v[layer].index_copy_(1, step.slots, v.transpose(0, 1))
        if step.seal_chunks.numel():
            self.qk.seal(layer, step.seal_chunks, self._blocks(layer)[:, step.seal_blocks])

    def read(self, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A KV-sharing layer's keys and values: its source's visible rows, which the source
        wrote earlier in this forward."""
        assert self._step is not None and end == self._step.start + self._step.n
        return self._visible(self.sources.get(layer, layer))

    def _visible(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        step = self._step
        assert step is not None
        count = step.rows.shape[0]
        if step.complete and torch.equal(step.rows, self._arange[:count]):
            return self.k[layer][:, :count], self.v[layer][:, :count]
        return self.k[layer].index_select(1, step.rows), self.v[layer].index_select(1, step.rows)

    def _blocks(self, layer: int) -> torch.Tensor:
        """`layer`'s K rows as [Hkv, n_blocks, chunk, D]."""
        h, d = self.shapes[layer]
        return self.k[layer].view(h, -1, self.chunk, d)

    def mask(
        self, start: int, n: int, window: int | None, device: torch.device
    ) -> torch.Tensor | None:
        """[n, L] bool over the keys `write` returned: causal by position, and the window."""
        step = self._step
        assert step is not None
        if window not in step.masks:
            if step.complete:  # the plain cache's very mask: same numbers
                mask = attention_mask(start, n, start + n, window, device)
            else:
                mask = positions_mask(start, n, step.positions, window, device)
            step.masks[window] = mask
        return step.masks[window]

    # `write` also seals chunk keys for the scorer: the native decode kernel must not store
    # rows itself; the caller writes first and the kernel only reads.
    writes_in_place = False

    def decode_storage(self, layer: int) -> Storage | None:
        """The pool rows of `layer` (its source's for a KV-sharing layer) the step sees, in
        position order: the row of each position while the pool has not evicted, else the
        visible rows with their positions (gaps). The native decode kernel reads them in
        that order, as the plain cache reads its rows."""
        step = self._step
        if step is None:
            return None
        source = self.sources.get(layer, layer)
        positions = None if step.complete else step.positions
        return Storage(self.k[source], self.v[source], step.rows, positions)

    observes_queries = True

    def observe_query(self, layer: int, q: torch.Tensor, window: int | None) -> None:
        """The layer's queries [n, H, D] after RoPE: the last one scores chunks (qk);
        sliding layers are not scored."""
        if window is None:
            self.qk.observe(layer, q)

    def commit(self, end: int) -> None:
        super().commit(end)
        self._step = None

    def truncate(self, pos: int) -> None:
        """Roll back to `pos`; stale rows stay until overwritten (the slot map hides them).
        With recurrent layers only to a position whose state is kept (else
        RecurrentRollback, no change)."""
        super().truncate(pos)
        self.qk.forget(pos)

    def reset(self) -> None:
        super().reset()
        self._step = None
        self.qk.reset()

    # Prefix snapshots: only in the identity layout (position p in row p), which the daemon
    # checks with its pager; the rows' map is checked here too.

    def _committed_rows(self, layer: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        if n > self.pool:
            raise ValueError(f"cannot export {n} rows: the pool holds {self.pool}")
        if not torch.equal(self._held[:n], self._arange[:n]):
            raise ValueError("KV Flash: a snapshot needs the identity layout (row p holds p)")
        return super()._committed_rows(layer, n)

    def _check_fits(self, n: int) -> None:
        if n > self.pool:
            raise ContextOverflow(f"{n} positions exceed the KV Flash pool of {self.pool} rows")

    def _load_rows(self, n: int, rows: Mapping[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Into pool rows [0, n): the identity layout the daemon's pager then syncs to."""
        super()._load_rows(n, rows)
        self._held = torch.where(self._arange < n, self._arange, -1)
        sealed = torch.arange(n // self.chunk, device=self.device)  # chunk c in block c
        for layer in self.stored:
            self.qk.seal(layer, sealed, self._blocks(layer)[:, sealed])


# ---------------------------------------------------------------------- host tier


def _layout(cache: PooledKVCache) -> RecordLayout:
    return RecordLayout(cache.shapes, cache.chunk, cache.dtype)


def chunk_nbytes(cache: PooledKVCache) -> int:
    """Bytes of one chunk's rows over every layer, K and V: one host-tier record."""
    return _layout(cache).nbytes


def page_out(cache: PooledKVCache, block: int, record: torch.Tensor) -> None:
    """Copy block `block`'s rows of every layer into `record` (byte-exact)."""
    _layout(cache).copy_out(cache.k, cache.v, block * cache.chunk, record)


def page_in(cache: PooledKVCache, block: int, record: torch.Tensor) -> None:
    """Copy a record written by `page_out` into block `block` (any block)."""
    _layout(cache).copy_in(record, cache.k, cache.v, block * cache.chunk)


def apply_moves(
    cache: PooledKVCache,
    moves: Iterable[tuple[str, int, int, int]],
    host: HostTier | SharedHostTier,
) -> None:
    """Run a step's host-tier moves, in order: (kind "out"/"in", chunk, block, record)."""
    for kind, _chunk, block, record in moves:
        if kind == "out":
            page_out(cache, block, host.record(record))
        elif kind == "in":
            page_in(cache, block, host.record(record))
        else:
            raise ValueError(f"unknown move {kind!r}")
