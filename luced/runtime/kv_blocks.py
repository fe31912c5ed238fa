"""Paged K/V: one block pool per shard, and per-sequence caches that hold their rows in it
through a block table, so sequences with a common prompt prefix share its rows.

Layout: the pool holds each stored layer's K and V as `[Hkv, n_blocks * block, D]`, cut
into blocks of `block` rows. A sequence's `table` maps its logical block i (positions
`[i * block, (i + 1) * block)`) to a pool block, and its `rows` map each position to its
pool row, `table[p // block] * block + p % block`: the native decode kernel reads and
writes through that map, as it reads a KV Flash pool's::

    pool rows of one layer's K (V alike), block = 4

        block 0       block 1       block 2       block 3
      [ a0 a1 a2 a3 | b4 b5 b6 .. | a4 a5 .. .. | .. .. .. .. ]
        refcount 2    refcount 1    refcount 1    free

    A.table = [0, 2]    A.rows = [0 1 2 3  8  9 ...]
    B.table = [0, 1]    B.rows = [0 1 2 3  4  5  6 ...]

Each block has a reference count: the number of tables that hold it. `share` makes an
empty cache's first blocks another's, retaining each; sharing costs a table entry per
block and nothing else, no copy. Copy-on-write keeps a block's rows from changing while
it is shared: a `reserve` whose range touches a block with refcount > 1 first moves the
writer onto a fresh block holding a copy of that block's rows (every stored layer),
releasing the old one. So a prefix that ends inside a block is shared with that block,
and whichever cache writes into it next (the sharer its first own position, or the
source its next one) copies that one block; a source that truncates into the shared
prefix and rewrites it copies the blocks it rewrites. A block whose
count falls to 0 is free again; `truncate` releases the blocks wholly past the new end,
`reset` (and `free`, when the worker drops a sequence) all of them.

The pool allocates the lowest free block first and, when none is free, doubles (keeping
every row; up to `max_blocks`, then `KVPoolFull`); it never shrinks, so a worker keeps
the most K/V its sequences ever held at once until its next load (freed blocks are reused,
not returned). Reallocation bumps `generation`: the
caches' `decode_storage` objects, which name the tensors, are rebuilt on the next call.

Attention over a sequence reads its rows in position order: a view of the pool when its
blocks lie in consecutive pool blocks (as `KVCache` hands out), a gather (`index_select`)
otherwise. The values are the same either way, so the logits are `KVCache`'s bit for bit.
Recurrent layers keep their state beside the pool exactly as in `KVCache`
(`kv_cache.BaseKVCache`); a cache with recurrent layers cannot share, because a state
sums up its whole prefix and exists only where a forward stopped.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping

import torch

from luced.runtime.kv_cache import (
    BaseKVCache,
    ContextOverflow,
    RecurrentShape,
    RecurrentState,
    layer_roles,
)
from luced.runtime.layers import attention_mask
from luced.runtime.native_attention import Storage


class KVPoolFull(ContextOverflow):
    """The pool has no free block and may not grow."""


class BlockPool:
    """One shard's K/V rows for every sequence: each stored layer's K and V [Hkv, rows, D],
    handed out in blocks of `block` rows, each with a reference count."""

    def __init__(
        self,
        shapes: Mapping[int, tuple[int, int]],
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        *,
        block: int = 16,
        initial_blocks: int = 64,
        max_blocks: int | None = None,
    ) -> None:
        """shapes: stored layer -> (Hkv, D); max_blocks: the most the pool grows to (None:
        no bound but memory)."""
        if block < 1 or initial_blocks < 1:
            raise ValueError(f"blocks of {block} rows, {initial_blocks} of them: both must be >= 1")
        if max_blocks is not None and max_blocks < initial_blocks:
            raise ValueError(f"max_blocks {max_blocks} is below initial_blocks {initial_blocks}")
        self.shapes = dict(shapes)
        self.dtype = dtype
        self.device = torch.device(device)
        self.block = block
        self.max_blocks = max_blocks
        self.k: dict[int, torch.Tensor] = {}  # layer -> [Hkv, n_blocks * block, D]
        self.v: dict[int, torch.Tensor] = {}
        self.generation = 0  # bumped whenever the tensors are reallocated
        self._refs: list[int] = []  # block -> the number of tables holding it
        self._free: list[int] = []  # a heap: the lowest free block goes first
        self._grow(initial_blocks)

    @property
    def n_blocks(self) -> int:
        return len(self._refs)

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def used_blocks(self) -> int:
        return self.n_blocks - self.free_blocks

    @property
    def mapped_blocks(self) -> int:
        """Blocks the sequences' tables map, a shared one once per table: what they would
        hold without sharing."""
        return sum(self._refs)

    def available(self) -> int | float:
        """How many more blocks `allocate` can give: the free ones and the growth left."""
        room = float("inf") if self.max_blocks is None else self.max_blocks - self.n_blocks
        return self.free_blocks + room

    def _grow(self, n_blocks: int) -> None:
        keep, rows = self.n_blocks * self.block, n_blocks * self.block
        # Normal tensors, not inference ones: writable inside inference mode (a forward) and
        # outside it (an import, a test) alike.
        with torch.inference_mode(False):
            for layer, (heads, dim) in self.shapes.items():
                for kv in (self.k, self.v):
                    t = torch.zeros((heads, rows, dim), dtype=self.dtype, device=self.device)
                    if keep:
                        t[:, :keep] = kv[layer][:, :keep]
                    kv[layer] = t
        for block in range(self.n_blocks, n_blocks):
            heapq.heappush(self._free, block)
        self._refs.extend([0] * (n_blocks - self.n_blocks))
        self.generation += 1

    def allocate(self) -> int:
        """A free block with refcount 1; the pool doubles (up to max_blocks) when none is."""
        if not self._free:
            cap = self.max_blocks
            if cap is not None and self.n_blocks >= cap:
                raise KVPoolFull(f"the KV block pool is full: all {cap} blocks are in use")
            self._grow(2 * self.n_blocks if cap is None else min(cap, 2 * self.n_blocks))
        block = heapq.heappop(self._free)
        self._refs[block] = 1
        return block

    def retain(self, block: int) -> None:
        self._held(block)
        self._refs[block] += 1

    def release(self, block: int) -> None:
        """Drop one reference; at 0 the block is free again."""
        self._held(block)
        self._refs[block] -= 1
        if not self._refs[block]:
            heapq.heappush(self._free, block)

    def refs(self, block: int) -> int:
        return self._refs[block]

    def _held(self, block: int) -> None:
        if not 0 <= block < self.n_blocks or not self._refs[block]:
            raise ValueError(f"block {block} is not held by anyone")

    def copy(self, src: int, dst: int) -> None:
        """Copy block src's rows of every layer, K and V, into block dst."""
        b = self.block
        for kv in (self.k, self.v):
            for t in kv.values():
                t[:, dst * b : (dst + 1) * b] = t[:, src * b : (src + 1) * b]

    def block_nbytes(self) -> int:
        """One block's bytes over every layer, K and V."""
        item = self.dtype.itemsize
        return sum(2 * h * self.block * d * item for h, d in self.shapes.values())

    def nbytes(self) -> int:
        return self.n_blocks * self.block_nbytes()


class PagedKVCache(BaseKVCache):
    """The KVStore surface (see KVCache) over a BlockPool: position p lives in pool row
    table[p // block] * block + p % block."""

    observes_queries = False
    writes_in_place = True  # `write` only stores rows: the native kernel may do it instead

    def __init__(
        self,
        pool: BlockPool,
        layers: range,
        capacity: int,
        *,
        sources: Mapping[int, int] | None = None,
        recurrent: Mapping[int, RecurrentShape] | None = None,
        row_exact: bool = False,
        state_dtype: torch.dtype | None = None,
    ) -> None:
        """sources, recurrent, row_exact, state_dtype: as for `KVCache`; the stored layers'
        shapes, the dtype and the device are the pool's."""
        self.pool = pool
        self.layers = layers
        self.capacity = capacity
        self.row_exact = row_exact
        self.dtype = pool.dtype
        self.device = pool.device
        states = state_dtype or self.dtype
        self.recurrent = RecurrentState(recurrent, states, self.device) if recurrent else None
        self.sources, self.stored = layer_roles(layers, sources, recurrent)
        if set(self.stored) != set(pool.shapes):
            raise ValueError(f"the pool stores layers {sorted(pool.shapes)}, not {self.stored}")
        self.shapes = {i: pool.shapes[i] for i in self.stored}
        # The pool's K and V per layer, [Hkv, pool rows, D]: heads and dim as a KVCache's k
        # (what snapshots read them for); the dicts stay the pool's as it grows.
        self.k, self.v = pool.k, pool.v
        self.pos = 0
        self.table: list[int] = []  # logical block -> pool block
        with torch.inference_mode(False):  # rewritten outside a forward too (share, import)
            self.rows = torch.zeros(capacity, dtype=torch.int64, device=self.device)
        self._base: int | None = None  # row of position 0 while the blocks are consecutive
        self._storage: dict[int, Storage] = {}  # decode_storage's, for `_generation`
        self._generation = pool.generation

    def _assign(self, i: int, block: int) -> None:
        """Logical block i now lives in pool block `block` (held for this cache)."""
        if i == len(self.table):
            self.table.append(block)
        else:
            self.table[i] = block
        b = self.pool.block
        lo, hi = i * b, min((i + 1) * b, self.capacity)
        self.rows[lo:hi] = torch.arange(block * b, block * b + hi - lo, device=self.device)

    def _relink(self) -> None:
        t = self.table
        consecutive = all(block == t[0] + i for i, block in enumerate(t))
        self._base = t[0] * self.pool.block if t and consecutive else None

    def reserve(self, start: int, n: int) -> None:
        """Hold blocks for positions [start, start + n), copying any shared block the range
        touches first. Checked before anything changes: a gap, the capacity, the pool."""
        if start > self.pos:
            raise ValueError(f"KV write at {start} would leave a gap after position {self.pos}")
        end, b, pool = start + n, self.pool.block, self.pool
        if end > self.capacity:
            raise ContextOverflow(
                f"context of {end} tokens exceeds the KV capacity {self.capacity}"
            )
        # the table after the recurrent layers' truncate(start), and what that frees
        kept = -(-start // b) if self.recurrent is not None else len(self.table)
        freed = sum(pool.refs(block) == 1 for block in self.table[kept:])
        first, last = start // b, -(-end // b) if n else start // b
        shared = [i for i in range(first, min(last, kept)) if pool.refs(self.table[i]) > 1]
        need = max(0, last - kept) + len(shared)
        if need > pool.available() + freed:
            raise KVPoolFull(
                f"the KV block pool is full: positions [{start}, {end}) need {need} more "
                f"blocks of {b} rows, {pool.available() + freed} can be had"
            )
        if self.recurrent is not None:
            self.truncate(start)  # the recurrent layers continue from the state at start
        for i in shared:  # copy-on-write
            old, new = self.table[i], pool.allocate()
            pool.copy(old, new)
            pool.release(old)
            self._assign(i, new)
        while len(self.table) < last:
            self._assign(len(self.table), pool.allocate())
        self._relink()

    def store(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v ([n, Hkv, D]) at positions [start, start + n) (reserved)."""
        at = self.rows[start : start + k.shape[0]]
        self.pool.k[layer].index_copy_(1, at, k.transpose(0, 1).to(self.dtype))
        self.pool.v[layer].index_copy_(1, at, v.transpose(0, 1).to(self.dtype))

    def write(
        self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`store`, then the layer's K, V over [0, start + n) as [Hkv, L, D]."""
        self.store(layer, start, k, v)
        return self._rows(layer, start + k.shape[0])

    def read(self, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V over [0, end) of the layer `layer` reads: its source's for a KV-sharing
        layer, which must have written them earlier in the forward."""
        return self._rows(self.sources.get(layer, layer), end)

    def _rows(self, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[Hkv, end, D] in position order: a view while the blocks are consecutive."""
        k, v = self.pool.k[layer], self.pool.v[layer]
        if self._base is not None:
            return k[:, self._base : self._base + end], v[:, self._base : self._base + end]
        at = self.rows[:end]
        return k.index_select(1, at), v.index_select(1, at)

    def mask(
        self, start: int, n: int, window: int | None, device: torch.device
    ) -> torch.Tensor | None:
        """The attention mask over the keys `write` returned ([0, start + n))."""
        return attention_mask(start, n, start + n, window, device)

    def observe_query(self, layer: int, q: torch.Tensor, window: int | None) -> None:
        """Queries matter only to KV Flash's scorer."""

    def decode_storage(self, layer: int) -> Storage:
        """The pool's K and V of `layer` (its source's for a KV-sharing layer) with this
        sequence's row map: one Storage per layer until the pool reallocates."""
        if self._generation != self.pool.generation:
            self._storage.clear()
            self._generation = self.pool.generation
        source = self.sources.get(layer, layer)
        storage = self._storage.get(source)
        if storage is None:
            pool = self.pool
            storage = Storage(pool.k[source], pool.v[source], rows=self.rows)
            self._storage[source] = storage
        return storage

    def truncate(self, pos: int) -> None:
        """Roll back to `pos` committed tokens and release the blocks wholly past it. With
        recurrent layers only to a position whose state is kept (else RecurrentRollback,
        no change)."""
        super().truncate(pos)
        self._release_from(-(-pos // self.pool.block))

    def _release_from(self, i: int) -> None:
        for block in self.table[i:]:
            self.pool.release(block)
        del self.table[i:]
        self._relink()

    def reset(self) -> None:
        """Empty the cache and release every block."""
        super().reset()
        self._release_from(0)

    def free(self) -> None:
        """The sequence is dropped: its blocks go back to the pool (the same as `reset`)."""
        self.reset()

    def share(self, source: PagedKVCache, n: int) -> int:
        """Make this (empty, pos 0) cache's first n positions the source's, without copying:
        it takes the source's blocks that hold them (n <= source.pos, committed there). A
        last block that holds positions past n too is shared as well; the first write into
        it, by either cache, copies it (`reserve`). Returns n, committed."""
        if self.recurrent is not None or source.recurrent is not None:
            raise ValueError("a cache with recurrent layers cannot share rows: no state at n")
        if source.pool is not self.pool:
            raise ValueError("cannot share the blocks of another pool")
        if self.pos or self.table:
            raise ValueError(f"only an empty cache shares a prefix (this one holds {self.pos})")
        if (source.layers, source.sources) != (self.layers, self.sources):
            raise ValueError("cannot share the rows of a cache of other layers")
        if not 0 <= n <= source.pos:
            raise ValueError(f"cannot share {n} positions: the source holds {source.pos}")
        if n > self.capacity:
            raise ContextOverflow(f"{n} positions exceed the KV capacity {self.capacity}")
        for i, block in enumerate(source.table[: -(-n // self.pool.block)]):
            self.pool.retain(block)
            self._assign(i, block)
        self._relink()
        self.commit(n)
        return n

    def _committed_rows(self, layer: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._rows(layer, n)

    def _load_rows(self, n: int, rows: Mapping[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Into fresh blocks (the old ones were released by `reset`; the pool may be full)."""
        self.reserve(0, n)
        at = self.rows[:n]
        for layer, (k, v) in rows.items():
            self.pool.k[layer].index_copy_(1, at, k[:, :n].to(self.device))
            self.pool.v[layer].index_copy_(1, at, v[:, :n].to(self.device))

    def nbytes(self) -> int:
        """This sequence's share of the pool: each block it holds divided among its holders
        (the sequences' shares add up to the pool's used bytes, to rounding), plus its
        recurrent state."""
        size = self.pool.block_nbytes()
        kv = sum(size // self.pool.refs(block) for block in self.table)
        return kv + (self.recurrent.nbytes() if self.recurrent is not None else 0)
