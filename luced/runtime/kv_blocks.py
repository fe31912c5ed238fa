"""Paged K/V: one block pool per shard, and per-sequence caches that hold their rows in it
through a block table, so sequences with a common prompt prefix share its rows.

Layout: the pool holds each stored layer's K and V as `[Hkv, (n_blocks + 1) * block, D]`,
cut into blocks of `block` rows (the last one the decode graphs' scratch, in no table). A
sequence's `table` maps its logical block i (positions `[i * block, (i + 1) * block)`) to
a pool block, and its `rows` map each position to its pool row,
`table[p // block] * block + p % block`: the native decode kernel reads and writes
through that map, as it reads a KV Flash pool's::

    pool rows of one layer's K (V alike), block = 4

        block 0       block 1       block 2       block 3
      [ a0 a1 a2 a3 | b4 b5 b6 .. | a4 a5 .. .. | .. .. .. .. ]
        refcount 2    refcount 1    refcount 1    free

    A.table = [0, 2]    A.rows = [0 1 2 3  8  9 ...]
    B.table = [0, 1]    B.rows = [0 1 2 3  4  5  6 ...]

The daemon owns the tables (`luced/engine/kv/blocks.py` `BlockTables`, whose docstring
states the rules): it picks every block, and the worker follows. A forward span brings
what its table gained (`follow`: copy-on-write copies, each a copy of a shared block's
rows of every stored layer into a fresh block, then new blocks) and the length the table
must have after them; `share` takes a source's first blocks (kv_share); `release_past`
drops the blocks wholly past a position (the `truncate` verb); `reset` / `free` all of
them; an import places its rows in the blocks it is given. A roll back (`truncate`: a
span below the committed length, a failure undone, a step ahead dropped) moves the
position only. `reserve` checks, and changes nothing: a write must land in blocks the
table covers and holds alone. Each block keeps a reference count here too (the tables
holding it), so a block named twice, or released too often, is refused: a worker out of
step with the daemon says so instead of mixing two sequences' rows.

The pool's tensors grow as the daemon names higher blocks (doubling, keeping every row;
up to the load's `max_blocks`, then `KVPoolFull`), so a small run stays small; it never
shrinks. Reallocation bumps `generation`: the caches' `decode_storage` objects, which
name the tensors, are rebuilt on the next call.

Attention over a sequence reads its rows in position order: a view of the pool when its
blocks lie in consecutive pool blocks, a gather (`index_select`) otherwise. The values are
the same either way, so the logits are `KVCache`'s bit for bit. Recurrent layers keep
their state beside the pool exactly as in `KVCache` (`kv_cache.BaseKVCache`); a cache
with recurrent layers cannot share, because a state sums up its whole prefix and exists
only where a forward stopped.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch

from luced.runtime.kv_cache import (
    BaseKVCache,
    ContextOverflow,
    LayerState,
    RecurrentShape,
    RecurrentState,
    layer_roles,
)
from luced.runtime.layers import attention_mask
from luced.runtime.native_attention import Storage


class KVPoolFull(ContextOverflow):
    """The pool cannot grow to hold the block the daemon named (memory ran out)."""


class BlockPool:
    """One shard's K/V rows for every sequence: each stored layer's K and V [Hkv, rows, D],
    in blocks of `block` rows that the daemon hands out (module docstring), each with a
    reference count."""

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
        """shapes: stored layer -> (Hkv, D); max_blocks: the daemon's pool (Load.kv_blocks,
        None: no bound but memory); the tensors start with room for initial_blocks."""
        if block < 1 or initial_blocks < 1:
            raise ValueError(f"blocks of {block} rows, {initial_blocks} of them: both must be >= 1")
        if max_blocks is not None:
            initial_blocks = min(initial_blocks, max_blocks)
        self.shapes = dict(shapes)
        self.dtype = dtype
        self.device = torch.device(device)
        self.block = block
        self.max_blocks = max_blocks
        self.k: dict[int, torch.Tensor] = {}  # layer -> [Hkv, (n_blocks + 1) * block, D]
        self.v: dict[int, torch.Tensor] = {}
        self.generation = 0  # bumped whenever the tensors are reallocated
        self._refs: list[int] = []  # block -> the number of tables holding it
        self._grow(initial_blocks)

    @property
    def n_blocks(self) -> int:
        """Blocks the tensors hold now (the scratch block past them aside)."""
        return len(self._refs)

    @property
    def scratch(self) -> int:
        """A block no table holds: the decode graphs' padding rows (it moves as the pool
        grows, which bumps `generation`)."""
        return self.n_blocks

    @property
    def used_blocks(self) -> int:
        return sum(1 for r in self._refs if r)

    @property
    def free_blocks(self) -> int:
        return self.n_blocks - self.used_blocks

    @property
    def mapped_blocks(self) -> int:
        """Blocks the sequences' tables map, a shared one once per table: what they would
        hold without sharing."""
        return sum(self._refs)

    def _grow(self, n_blocks: int) -> None:
        keep, rows = self.n_blocks * self.block, (n_blocks + 1) * self.block
        # Normal tensors, not inference ones: writable inside inference mode (a forward) and
        # outside it (an import, a test) alike.
        with torch.inference_mode(False):
            for layer, (heads, dim) in self.shapes.items():
                for kv in (self.k, self.v):
                    t = torch.zeros((heads, rows, dim), dtype=self.dtype, device=self.device)
                    if keep:
                        t[:, :keep] = kv[layer][:, :keep]
                    kv[layer] = t
        self._refs.extend([0] * (n_blocks - self.n_blocks))
        self.generation += 1

    def check_free(self, blocks: Iterable[int]) -> None:
        """Whether the daemon may hand these blocks to a table: free here and inside the
        pool (raises ValueError naming the first that is not)."""
        cap = self.max_blocks
        for block in blocks:
            if block < 0 or (cap is not None and block >= cap):
                raise ValueError(f"block {block} is outside the pool of {cap} blocks")
            if block < self.n_blocks and self._refs[block]:
                raise ValueError(f"block {block} is held already ({self._refs[block]} tables)")

    def take(self, block: int) -> None:
        """The daemon handed out `block` (checked free): refcount 1, the tensors grown
        (doubling, up to max_blocks) to hold it."""
        self.check_free((block,))
        if block >= self.n_blocks:
            want = max(block + 1, 2 * self.n_blocks)
            cap = self.max_blocks
            try:
                self._grow(want if cap is None else min(cap, want))
            except torch.OutOfMemoryError as exc:  # the daemon's pool is larger than memory
                raise KVPoolFull(f"the K/V block pool cannot grow to {want} blocks: {exc}") from exc
        self._refs[block] = 1

    def retain(self, block: int) -> None:
        self._held(block)
        self._refs[block] += 1

    def release(self, block: int) -> None:
        """Drop one reference; at 0 the block is free again."""
        self._held(block)
        self._refs[block] -= 1

    def refs(self, block: int) -> int:
        return self._refs[block] if 0 <= block < self.n_blocks else 0

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
        return (self.n_blocks + 1) * self.block_nbytes()


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
        self._incoming: tuple[int, ...] = ()  # an import's blocks (`import_rows`)

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

    def follow(self, copies: Sequence[tuple[int, int, int]], blocks: Sequence[int]) -> None:
        """Apply what the daemon's table of this sequence gained (`frames.Span`): each copy
        (logical block, src, dst) moves that block onto dst with src's rows, then `blocks`
        are appended. Checked against the pool first (`check_follow`)."""
        self.check_follow(copies, blocks, len(self.table) + len(blocks))
        pool = self.pool
        for i, src, dst in copies:  # copy-on-write
            pool.take(dst)
            pool.copy(src, dst)
            pool.release(src)
            self._assign(i, dst)
        for block in blocks:
            pool.take(block)
            self._assign(len(self.table), block)
        self._relink()

    def check_follow(
        self, copies: Sequence[tuple[int, int, int]], blocks: Sequence[int], length: int
    ) -> None:
        """ValueError unless `follow(copies, blocks)` leaves a table of `length` blocks
        within the capacity, each copy moving a block this table holds onto a free one."""
        after = len(self.table) + len(blocks)
        if after != length:
            raise ValueError(
                f"its table holds {len(self.table)} blocks, + {len(blocks)} new makes "
                f"{after}; the daemon's holds {length}"
            )
        if (after - 1) * self.pool.block >= self.capacity:
            raise ContextOverflow(f"{after} blocks exceed the KV capacity {self.capacity}")
        for i, src, _ in copies:
            if i >= len(self.table) or self.table[i] != src:
                held = self.table[i] if i < len(self.table) else None
                raise ValueError(f"copy of logical block {i} from {src}: the table has {held}")
        self.pool.check_free([*blocks, *(dst for _, _, dst in copies)])

    def reserve(self, start: int, n: int) -> None:
        """Check that positions [start, start + n) may be written: no gap, within the
        capacity, in blocks the table covers and holds alone (the daemon's growth came
        first). With recurrent layers, roll back to start first."""
        if start > self.pos:
            raise ValueError(f"KV write at {start} would leave a gap after position {self.pos}")
        end, b = start + n, self.pool.block
        if end > self.capacity:
            raise ContextOverflow(
                f"context of {end} tokens exceeds the KV capacity {self.capacity}"
            )
        if end > len(self.table) * b:
            raise ValueError(
                f"positions [{start}, {end}) are past the {len(self.table)} blocks of its table"
            )
        shared = [i for i in range(start // b, -(-end // b)) if self.pool.refs(self.table[i]) > 1]
        if n and shared:
            raise ValueError(f"positions [{start}, {end}) would write shared blocks {shared}")
        if self.recurrent is not None:
            self.truncate(start)  # the recurrent layers continue from the state at start

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
        """Roll back to `pos` committed tokens; the blocks stay (the daemon's table keeps
        them, to be written again). With recurrent layers only to a position whose state
        is kept (else RecurrentRollback, no change)."""
        super().truncate(pos)

    def release_past(self, pos: int) -> None:
        """The blocks wholly past position `pos` go back to the pool (the truncate verb,
        after its roll back to pos)."""
        if pos < self.pos:
            raise ValueError(f"release past {pos}: positions up to {self.pos} are committed")
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
        it, by either cache, is the daemon's copy-on-write (`follow`). Returns n,
        committed."""
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

    def check_import(self, n: int, blocks: Sequence[int]) -> None:
        """ValueError unless `blocks` can hold an import of n positions: ceil(n / block)
        of them, each free once this cache's own blocks are released."""
        if len(blocks) != -(-n // self.pool.block):
            raise ValueError(f"{n} positions need {-(-n // self.pool.block)} blocks, got {blocks}")
        mine = set(self.table)
        self.pool.check_free(
            b for b in blocks if not (b in mine and self.pool.refs(b) == self.table.count(b))
        )

    def import_rows(
        self,
        n: int,
        rows: Mapping[int, tuple[torch.Tensor, torch.Tensor]],
        states: Mapping[int, LayerState] | None = None,
        blocks: Sequence[int] = (),
    ) -> None:
        """`BaseKVCache.import_rows` into `blocks`, the daemon's for [0, n) (its table after
        the import; the old one is released first)."""
        self.check_import(n, blocks)
        self._incoming = tuple(blocks)
        try:
            super().import_rows(n, rows, states)
        finally:
            self._incoming = ()

    def _load_rows(self, n: int, rows: Mapping[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Into the blocks `import_rows` was given (the old ones were released by `reset`)."""
        self.follow((), self._incoming)
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
