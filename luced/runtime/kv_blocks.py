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

Paging (KV Flash over the pool): the daemon may move a block a sequence holds alone out
to a host record (`MOVE_OUT`: its rows of every stored layer copied in `kv_host`'s record
layout, the block released, the table entry `PAGED`) and a paged-out block back in, into
any free block (`MOVE_IN`), byte for byte. The positions of a paged-out block are
invisible: attention gathers the resident positions' rows in position order and masks by
those positions (`positions_mask`), and the native decode kernel reads them as a list
with their positions (`Storage.positions`), computed once per step (`reserve`). While
every block of [0, end) is resident nothing of this runs: the logits stay `KVCache`'s.
A write into a paged-out block or an export of one is refused; a share takes PAGED
entries as they are (the daemon's record, shared, pages each back in for its lane).
The prefix cache's block store (the daemon's engine/kv/block_store.py) copies a block
to a record and keeps it (`MOVE_SAVE`), and appends a record it holds as the table's
next entry, PAGED, its positions committed (`MOVE_ADOPT`; scored, its block keys sealed
from the record's K rows): a span pages it in when the daemon says; a cache with
recurrent layers adopts only once their state at the adopted end is loaded (a hybrid's
state record, `kv_state`). A frame's moves come together (`apply_moves`): all checked
first, then copied in runs of one kind, each run a copy or two per stored layer, not one
per block (`kv_host`).

Scoring (`scored`, KV Flash's `qk` policy): the cache keeps each block's mean key per
stored layer (`kv_qk.BlockKeys`), sealed by the step that writes
the block's last position (an import, a share, an adopt: when its rows come in whole),
and each full-attention layer's last query; `write_scores`
gives each block's score from them (the daemon ranks the blocks by it).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from luced.runtime import kv_qk
from luced.runtime.kv_cache import (
    BaseKVCache,
    ContextOverflow,
    LayerState,
    RecurrentShape,
    RecurrentState,
    layer_roles,
)
from luced.runtime.kv_host import Move, RecordLayout, runs
from luced.runtime.layers import attention_mask, positions_mask
from luced.runtime.native_attention import Storage

PAGED = -1  # a table entry: the logical block's rows are in a host record
# A move's kind: pool block -> host record (the entry PAGED), host record -> pool block,
# pool block -> host record (the entry stays), a host record -> a new PAGED entry.
MOVE_OUT, MOVE_IN, MOVE_SAVE, MOVE_ADOPT = 0, 1, 2, 3


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

    def check_free(self, blocks: Iterable[int], refs: Mapping[int, int] | None = None) -> None:
        """Whether the daemon may hand these blocks to a table: free here and inside the
        pool (raises ValueError naming the first that is not). `refs`: block -> count
        where a step's earlier changes, checked but not made yet, leave it otherwise."""
        cap = self.max_blocks
        for block in blocks:
            if block < 0 or (cap is not None and block >= cap):
                raise ValueError(f"block {block} is outside the pool of {cap} blocks")
            held = self.refs(block) if refs is None else refs.get(block, self.refs(block))
            if held:
                raise ValueError(f"block {block} is held already ({held} tables)")

    def take(self, block: int) -> None:
        """The daemon handed out `block` (checked free): refcount 1, the tensors grown
        (doubling, up to max_blocks) to hold it."""
        self.take_all((block,))

    def take_all(self, blocks: Sequence[int]) -> None:
        """`take` each of `blocks` (checked free, each once), the tensors grown once, as far
        as taking them one by one would: KVPoolFull takes none."""
        self.check_free(blocks)
        if len(set(blocks)) != len(blocks):
            raise ValueError(f"blocks {list(blocks)} name a block twice")
        want, cap = self.n_blocks, self.max_blocks
        for block in blocks:
            if block >= want:  # as `take` grows for it: doubling, up to the cap
                want = max(block + 1, 2 * want)
                want = want if cap is None else min(cap, want)
        if want > self.n_blocks:
            try:
                self._grow(want)
            except torch.OutOfMemoryError as exc:  # the daemon's pool is larger than memory
                raise KVPoolFull(f"the K/V block pool cannot grow to {want} blocks: {exc}") from exc
        for block in blocks:
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
        """One block's bytes over every layer, K and V (one host record's)."""
        return RecordLayout(self.shapes, self.block, self.dtype).nbytes

    def nbytes(self) -> int:
        return (self.n_blocks + 1) * self.block_nbytes()


@dataclass
class _Gaps:
    """The resident positions below `end` of a cache with paged-out blocks there: what
    attention reads for one step (`PagedKVCache._gaps`)."""

    end: int
    rows: torch.Tensor  # [L] int64: their pool rows, in position order
    positions: torch.Tensor  # [L] int64: ascending
    masks: dict[tuple, torch.Tensor | None] = field(default_factory=dict)
    storage: dict[int, Storage] = field(default_factory=dict)  # until the pool reallocates


class PagedKVCache(BaseKVCache):
    """The KVStore surface (see KVCache) over a BlockPool: position p lives in pool row
    table[p // block] * block + p % block; a `PAGED` entry's positions are invisible."""

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
        scored: bool = False,
    ) -> None:
        """sources, recurrent, row_exact, state_dtype: as for `KVCache`; the stored layers'
        shapes, the dtype and the device are the pool's. scored: keep the `qk` scorer's
        block keys (module docstring)."""
        self.pool = pool
        self.layers = layers
        self.capacity = capacity
        self._row_exact = row_exact
        self.dtype = pool.dtype
        self.device = pool.device
        states = state_dtype or self.dtype
        self.recurrent = RecurrentState(recurrent, states, self.device) if recurrent else None
        self.sources, self.stored = layer_roles(layers, sources, recurrent)
        if set(self.stored) != set(pool.shapes):
            raise ValueError(f"the pool stores layers {sorted(pool.shapes)}, not {self.stored}")
        self.shapes = {i: pool.shapes[i] for i in self.stored}
        self.record = RecordLayout(self.shapes, pool.block, self.dtype)  # one host record
        # The pool's K and V per layer, [Hkv, pool rows, D]: heads and dim as a KVCache's k
        # (what snapshots read them for); the dicts stay the pool's as it grows.
        self.k, self.v = pool.k, pool.v
        self.pos = 0
        self.table: list[int] = []  # logical block -> pool block, or PAGED
        self.paged_blocks = 0  # PAGED entries of the table
        # Rewritten outside a forward too (share, import; reset and truncate verbs): normal
        # tensors, even when the cache is made inside one.
        with torch.inference_mode(False):
            self.rows = torch.zeros(capacity, dtype=torch.int64, device=self.device)
            blocks = -(-capacity // pool.block)
            self.qk = (
                kv_qk.BlockKeys(self.shapes, blocks, pool.block, self.device) if scored else None
            )
        self._base: int | None = None  # row of position 0 while the blocks are consecutive
        self._storage: dict[int, Storage] = {}  # decode_storage's, for `_generation`
        self._generation = pool.generation
        self._incoming: tuple[int, ...] = ()  # an import's blocks (`import_rows`)
        self._end: int | None = None  # the reserved step's end
        self._view: tuple[int, _Gaps | None] | None = None  # `_gaps`' last answer, by end
        self._seal: tuple[torch.Tensor, torch.Tensor] | None = None  # the step's (logical, pool)
        # Scored: queries are observed, and `store` seals block keys from the rows it
        # wrote, so the native decode kernel must not store rows itself.
        self.observes_queries = scored
        self.writes_in_place = not scored

    @property
    def scored(self) -> bool:
        return self.qk is not None

    @property
    def row_exact(self) -> bool:
        """Attention row by row (batch-invariant) while no block is paged out: with gaps the
        keys are fewer than the positions, and one SDPA over them is the KV Flash path."""
        return self._row_exact and not self.paged_blocks

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
        self.paged_blocks = t.count(PAGED)
        consecutive = not self.paged_blocks and all(b == t[0] + i for i, b in enumerate(t))
        self._base = t[0] * self.pool.block if t and consecutive else None
        self._view = None

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
        self,
        copies: Sequence[tuple[int, int, int]],
        blocks: Sequence[int],
        length: int,
        moves: Sequence[tuple[int, int, int, int]] = (),
        refs: dict[int, int] | None = None,
    ) -> None:
        """ValueError unless `moves` (kind, logical block, pool block, record; see
        `apply_moves`), then `follow(copies, blocks)`, leave a table of `length`
        blocks within the capacity, each move and copy as its checks say. `refs`: what a
        step's earlier spans leave of the pool's counts (`BlockPool.check_free`), updated
        with what these would change; nothing else changes."""
        refs = {} if refs is None else refs
        table = list(self.table)
        for kind, j, block, _ in moves:
            self._check_move(table, refs, kind, j, block)
        after = len(table) + len(blocks)
        if after != length:
            raise ValueError(
                f"its table holds {len(table)} blocks, + {len(blocks)} new makes "
                f"{after}; the daemon's holds {length}"
            )
        if (after - 1) * self.pool.block >= self.capacity:
            raise ContextOverflow(f"{after} blocks exceed the KV capacity {self.capacity}")
        for i, src, _ in copies:
            if i >= len(table) or table[i] != src:
                held = table[i] if i < len(table) else None
                raise ValueError(f"copy of logical block {i} from {src}: the table has {held}")
        self.pool.check_free([*blocks, *(dst for _, _, dst in copies)], refs)
        for _, src, dst in copies:  # for the spans after this one
            refs[src] = refs.get(src, self.pool.refs(src)) - 1
            refs[dst] = 1
        refs.update(dict.fromkeys(blocks, 1))

    def _check_move(
        self, table: list[int], refs: dict[int, int], kind: int, j: int, block: int
    ) -> None:
        """One move against `table` and `refs` (as `check_follow`), both updated."""
        held = table[j] if 0 <= j < len(table) else None
        if kind == MOVE_OUT:
            if held != block:
                has = "a paged-out block" if held == PAGED else held
                raise ValueError(
                    f"move out of logical block {j} from block {block}: the table has {has}"
                )
            refs[block] = refs.get(block, self.pool.refs(block)) - 1  # shared: the others keep it
            table[j] = PAGED
        elif kind == MOVE_IN:
            if held != PAGED:
                raise ValueError(
                    f"move into logical block {j}: the table has {held}, not a paged-out block"
                )
            self.pool.check_free((block,), refs)
            refs[block] = 1
            table[j] = block
        elif kind == MOVE_SAVE:
            if held != block or block == PAGED:
                has = "a paged-out block" if held == PAGED else held
                raise ValueError(
                    f"save of logical block {j} from block {block}: the table has {has}"
                )
        elif kind == MOVE_ADOPT:
            if j != len(table) or (j + 1) * self.pool.block > self.capacity:
                raise ValueError(
                    f"adopt as logical block {j}: the table holds {len(table)} blocks "
                    f"(a KV capacity of {self.capacity})"
                )
            if self.pos != len(self.table) * self.pool.block:
                raise ValueError(
                    f"adopt after position {self.pos}: only a cache of whole blocks adopts"
                )
            table.append(PAGED)
        else:
            raise ValueError(f"unknown move kind {kind} (0 out, 1 in, 2 save, 3 adopt)")

    def move(self, kind: int, j: int, block: int, record: torch.Tensor) -> None:
        """One move (`apply_moves`) out to or in from `record`, uint8 [record bytes]."""
        self.apply_moves(((kind, j, block, 0),), record.unsqueeze(0))

    def apply_moves(self, moves: Sequence[Move], records: torch.Tensor) -> None:
        """The moves of `frames.Span` or `frames.KVPage`, (kind, logical block j, pool
        block, record) each, in order: OUT copies the block to the record and releases
        it (table[j] = PAGED); IN takes the free block and copies the record in, byte for
        byte; SAVE copies out, the table keeps the block; ADOPT appends table[j] = PAGED,
        its positions committed (recurrent layers' state loaded there first: a hybrid's
        restore, `kv_state`). `records`: uint8 [n, record bytes], record r at row r.
        All checked first (ValueError, no change); copied run by run (`kv_host.runs`)."""
        table: list[int] = list(self.table)
        refs: dict[int, int] = {}
        for kind, j, block, _ in moves:
            self._check_move(table, refs, kind, j, block)
        end = len(table) * self.pool.block  # adopts lengthen the table
        rec = self.recurrent
        if rec is not None and len(table) > len(self.table) and rec.current.pos != end:
            raise ValueError(f"adopting up to {end} needs the recurrent layers' state there")
        self.record.check(records, (record for *_, record in moves))
        pool = self.pool
        for run in runs(moves):
            kinds, js, blocks, ids = zip(*run, strict=True)
            kind = kinds[0]
            if kind in (MOVE_OUT, MOVE_SAVE):
                self.record.copy_out(pool.k, pool.v, blocks, records, ids)
            if kind == MOVE_OUT:
                for j, block in zip(js, blocks, strict=True):
                    pool.release(block)
                    self.table[j] = PAGED
            elif kind == MOVE_IN:
                pool.take_all(blocks)
                self.record.copy_in(records, ids, pool.k, pool.v, blocks)
                for j, block in zip(js, blocks, strict=True):
                    self._assign(j, block)
            elif kind == MOVE_ADOPT:
                adopted = self._ints(list(range(len(self.table), len(self.table) + len(run))))
                self.table.extend([PAGED] * len(run))
                self.commit(len(self.table) * pool.block)
                if self.qk is not None:  # keyed as the computing cache keyed them
                    self.qk.seal_records(self.record, records, ids, adopted)
            self._relink()

    def reserve(self, start: int, n: int) -> None:
        """Check that positions [start, start + n) may be written: no gap, within the
        capacity, in blocks the table covers, holds alone and has not paged out (the
        daemon's growth and moves came first). With recurrent layers, roll back to start
        first. Then what the step reads and seals is worked out, once for every layer."""
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
        written = range(start // b, -(-end // b)) if n else range(0)
        paged = [i for i in written if self.table[i] == PAGED]
        if paged:
            raise ValueError(f"positions [{start}, {end}) would write paged-out blocks {paged}")
        shared = [i for i in written if self.pool.refs(self.table[i]) > 1]
        if shared:
            raise ValueError(f"positions [{start}, {end}) would write shared blocks {shared}")
        if self.recurrent is not None:
            self.truncate(start)  # the recurrent layers continue from the state at start
        self._end = end
        self._gaps(end)
        self._seal = None
        if self.qk is not None:  # the blocks whose last position this step writes
            logical = [p // b for p in range(-(-(start + 1) // b) * b - 1, end, b)]
            if logical:
                pool_blocks = [self.table[i] for i in logical]
                self._seal = (self._ints(logical), self._ints(pool_blocks))

    def _ints(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.device)

    def store(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v ([n, Hkv, D]) at positions [start, start + n) (reserved); scored,
        seal the blocks the step completes."""
        at = self.rows[start : start + k.shape[0]]
        self.pool.k[layer].index_copy_(1, at, k.transpose(0, 1).to(self.dtype))
        self.pool.v[layer].index_copy_(1, at, v.transpose(0, 1).to(self.dtype))
        if self._seal is not None:
            self._seal_blocks(layer, *self._seal)

    def _seal_blocks(self, layer: int, logical: torch.Tensor, blocks: torch.Tensor) -> None:
        """The scorer's keys of logical blocks `logical`, from their pool `blocks`' K rows."""
        assert self.qk is not None
        h, d = self.shapes[layer]
        rows = self.pool.k[layer].view(h, -1, self.pool.block, d)[:, blocks]
        self.qk.seal(layer, logical, rows)

    def _seal_complete(self, n: int, source: PagedKVCache | None = None) -> None:
        """Scored: seal the blocks wholly below position n (rows that came in whole); a
        paged-out one takes its key from `source` (a share), which sealed the same rows."""
        count = n // self.pool.block
        if self.qk is None or not count:
            return
        resident = [i for i in range(count) if self.table[i] != PAGED]
        if resident:
            logical = self._ints(resident)
            blocks = self._ints([self.table[i] for i in resident])
            for layer in self.stored:
                self._seal_blocks(layer, logical, blocks)
        paged = [i for i in range(count) if self.table[i] == PAGED]
        if paged and source is not None and source.qk is not None:
            self.qk.copy_from(source.qk, self._ints(paged))

    def write(
        self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`store`, then the layer's K, V over [0, start + n) as [Hkv, L, D] (the
        resident positions' only, with blocks paged out)."""
        self.store(layer, start, k, v)
        return self._rows(layer, start + k.shape[0])

    def read(self, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V over [0, end) of the layer `layer` reads: its source's for a KV-sharing
        layer, which must have written them earlier in the forward."""
        return self._rows(self.sources.get(layer, layer), end)

    def _gaps(self, end: int) -> _Gaps | None:
        """The resident positions below `end` when some block there is paged out, else
        None (kept for the step: `reserve` asks first, each layer again)."""
        if not self.paged_blocks:
            return None
        if self._view is not None and self._view[0] == end:
            return self._view[1]
        gaps = None
        blocks = self.table[: -(-end // self.pool.block)]
        if PAGED in blocks:
            resident = torch.tensor([blk != PAGED for blk in blocks], device=self.device)
            positions = resident.repeat_interleave(self.pool.block)[:end].nonzero().squeeze(1)
            gaps = _Gaps(end, self.rows[positions], positions)
        self._view = (end, gaps)
        return gaps

    def _rows(self, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[Hkv, L, D] in position order: a view while the blocks are consecutive, the
        resident positions' rows only while some are paged out."""
        k, v = self.pool.k[layer], self.pool.v[layer]
        if self._base is not None:
            return k[:, self._base : self._base + end], v[:, self._base : self._base + end]
        gaps = self._gaps(end)
        at = self.rows[:end] if gaps is None else gaps.rows
        return k.index_select(1, at), v.index_select(1, at)

    def mask(
        self, start: int, n: int, window: int | None, device: torch.device
    ) -> torch.Tensor | None:
        """The attention mask over the keys `write` returned ([0, start + n), or the
        resident positions of it)."""
        gaps = self._gaps(start + n)
        if gaps is None:
            return attention_mask(start, n, start + n, window, device)
        key = (start, n, window, device)
        if key not in gaps.masks:
            gaps.masks[key] = positions_mask(start, n, gaps.positions, window, device)
        return gaps.masks[key]

    def observe_query(self, layer: int, q: torch.Tensor, window: int | None) -> None:
        """Scored: a full-attention layer's queries [n, H, D] after RoPE (the last one
        scores the blocks); sliding layers are not scored."""
        if self.qk is not None and window is None:
            self.qk.observe(layer, q)

    def decode_storage(self, layer: int) -> Storage | None:
        """The pool's K and V of `layer` (its source's for a KV-sharing layer) with this
        sequence's row map: one Storage per layer until the pool reallocates. With blocks
        paged out, the reserved step's resident rows and their positions instead (None
        outside a step: the row map does not say which rows are gone)."""
        if self._generation != self.pool.generation:
            self._storage.clear()
            self._view = None  # its storage too
            self._generation = self.pool.generation
        source = self.sources.get(layer, layer)
        pool = self.pool
        if self.paged_blocks and self._end is None:
            return None
        gaps = self._gaps(self._end) if self._end is not None else None
        if gaps is not None:
            if source not in gaps.storage:
                gaps.storage[source] = Storage(
                    pool.k[source], pool.v[source], gaps.rows, gaps.positions
                )
            return gaps.storage[source]
        storage = self._storage.get(source)
        if storage is None:
            storage = Storage(pool.k[source], pool.v[source], rows=self.rows)
            self._storage[source] = storage
        return storage

    def commit(self, end: int) -> None:
        super().commit(end)
        self._end = self._seal = None

    def truncate(self, pos: int) -> None:
        """Roll back to `pos` committed tokens; the blocks stay (the daemon's table keeps
        them, to be written again). With recurrent layers only to a position whose state
        is kept (else RecurrentRollback, no change)."""
        super().truncate(pos)
        if self.qk is not None:
            self.qk.forget(pos)

    def release_past(self, pos: int) -> None:
        """The blocks wholly past position `pos` go back to the pool (the truncate verb,
        after its roll back to pos); paged-out ones are dropped (the daemon frees their
        records)."""
        if pos < self.pos:
            raise ValueError(f"release past {pos}: positions up to {self.pos} are committed")
        self._release_from(-(-pos // self.pool.block))

    def _release_from(self, i: int) -> None:
        for block in self.table[i:]:
            if block != PAGED:
                self.pool.release(block)
        del self.table[i:]
        self._relink()

    def reset(self) -> None:
        """Empty the cache and release every block (paged-out ones are dropped)."""
        super().reset()
        self._release_from(0)
        self._end = self._seal = None
        if self.qk is not None:
            self.qk.reset()

    def free(self) -> None:
        """The sequence is dropped: its blocks go back to the pool (the same as `reset`)."""
        self.reset()

    def check_resident(self, n: int, what: str = "export") -> None:
        """ValueError unless every block of positions [0, n) is resident (to `what` them)."""
        paged = [i for i, b in enumerate(self.table[: -(-n // self.pool.block)]) if b == PAGED]
        if paged:
            raise ValueError(
                f"cannot {what} positions [0, {n}): logical blocks {paged} are paged out"
            )

    def share(self, source: PagedKVCache, n: int) -> int:
        """Make this (empty, pos 0) cache's first n positions the source's, without copying:
        it takes the source's table entries that hold them (n <= source.pos, committed
        there): its blocks, retained, and its PAGED entries, whose host records the daemon
        keeps for both (a move names the record). A last block that holds positions past
        n too is shared as well; the first write into it, by either cache, is the daemon's
        copy-on-write (`follow`). Returns n, committed."""
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
            if block == PAGED:
                self.table.append(PAGED)  # its rows map is written when it comes back in
            else:
                self.pool.retain(block)
                self._assign(i, block)
        self._relink()
        self.commit(n)
        self._seal_complete(n, source)
        return n

    def _committed_rows(self, layer: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.check_resident(n, "export")
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
        self._seal = None
        self._seal_complete(n)

    def nbytes(self) -> int:
        """This sequence's share of the pool: each resident block it holds divided among
        its holders (the sequences' shares add up to the pool's used bytes, to rounding),
        plus its recurrent state."""
        size = self.pool.block_nbytes()
        kv = sum(size // self.pool.refs(block) for block in self.table if block != PAGED)
        return kv + (self.recurrent.nbytes() if self.recurrent is not None else 0)


def write_scores(caches: Iterable[PagedKVCache], out: torch.Tensor) -> None:
    """The `qk` scores of one sequence's scored caches into `out` (`frames.Span.kv_scores`,
    float32 [2, blocks]: `kv_qk.write_scores`)."""
    keys = []
    for cache in caches:
        if cache.qk is None:
            raise ValueError("block scores of a cache that keeps no block keys (load kv_scored)")
        keys.append(cache.qk)
    kv_qk.write_scores(keys, out)
