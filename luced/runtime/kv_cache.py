"""Per-layer K/V storage with a fill position, for the layers one shard owns.

Layout per layer: K and V are `[Hkv, capacity, D]` so a prefix `[:, :end]` is a
view SDPA reads directly; Hkv may differ between layers (per-layer head counts).
Positions `[0, pos)` are committed; `truncate(pos)` rolls back (a rejected draft)
by moving the fill position: stale rows past it are overwritten by the next write
and never attended, because attention only reads `[0, start + n)`.

Sliding-window layers keep every position too. Their attention masks keys
outside the window, so results equal full attention within the window; keeping
the rows makes truncation and prefix snapshots uniform across layer kinds.
Storage grows by doubling up to `capacity`, so short chats stay small.

Layers may differ in shape (`shapes`: Gemma 4's full layers have other head counts
and dims than its sliding ones), and a KV-sharing layer (`sources`: layer -> the
earlier layer whose K/V it attends to) has no storage of its own: it reads its
source's rows with `read`. The source must live in the same cache (the same shard);
`stored` lists the layers that own storage, the ones snapshots copy.

Prefix snapshots: `export_rows` copies a layer's committed rows [0, n) out (into
shared memory, device -> host on a GPU); `import_rows` replaces the whole cache by
the first n rows of given tensors and commits n.

Recurrent layers (Gated DeltaNet): such a layer keeps no rows, only a state that sums
up every committed position, held by the cache's `RecurrentState`::

    conv   [kernel - 1, channels]      the layer's last kernel-1 conv1d inputs, oldest first
    delta  [heads, key_dim, value_dim]  float32: the delta-rule matrix (keys -> values)

`is_recurrent(layer)` tells them apart; attention layers keep K/V as above. A forward
reads a layer's committed state (`recurrent_state`, the state at `start`) and stages its
successor (`stage_state`); `commit` swaps every staged state in at once, so a forward
that fails before its commit leaves the committed state untouched. States are never
written in place: a snapshot is a set of references and costs nothing.

A recurrence cannot be rewound. `truncate(p)` (and a `reserve` that starts before the
fill position) therefore needs the state *at* p, one of:

    position 0              the zero state, always;
    the previous commit     each commit keeps the state it replaced, so the last forward
                            can be undone (a failed step, a rejected draft re-fed);
    a saved state           `save_state()` keeps the state at the fill position until
                            `release_state`, `reset` or a rewind below it;
    inside the last forward when that forward tracked positions (`track_positions`, a
                            DFlash verify block): the recurrent form emitted the state
                            after each token, so a cut inside the block selects one.

Anything else raises `RecurrentRollback` and changes nothing. `restore_state(snap)`
rewinds to a saved snapshot. Rewinding to p drops the kept states past p: the rows they
summarise are about to be rewritten.

A speculative verify that accepts k of n tokens rewinds to its start (the previous
commit) and re-feeds the k (the daemon's `Target.truncate`). A prefix snapshot copies the
committed state out beside the rows [0, pos) (`kv_snapshot.export`); `import_rows` takes
the states back with the rows and makes them the state at n (nothing else kept).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import torch

from luced.runtime.layers import attention_mask
from luced.runtime.native_attention import Storage


class ContextOverflow(ValueError):
    """A forward would write past the cache's capacity."""


class RecurrentRollback(ValueError):
    """A truncation would rewind a recurrent layer to a position whose state was not kept."""


@dataclass(frozen=True)
class RecurrentShape:
    """The state sizes of one recurrent (Gated DeltaNet) layer."""

    conv_channels: int
    conv_kernel: int
    heads: int
    key_dim: int
    value_dim: int


LayerState = tuple[torch.Tensor, torch.Tensor]  # (conv window, delta matrix)


@dataclass(frozen=True)
class RecurrentSnapshot:
    """Every recurrent layer's state after `pos` committed positions (references)."""

    pos: int
    states: Mapping[int, LayerState]


class RecurrentState:
    """The recurrent layers' committed states, the staged ones of a running forward, and
    the states kept for rewinding (see the module docstring)."""

    def __init__(
        self, shapes: Mapping[int, RecurrentShape], dtype: torch.dtype, device: torch.device
    ) -> None:
        self.shapes = dict(shapes)
        self._zero = RecurrentSnapshot(
            0,
            {
                layer: (
                    torch.zeros(s.conv_kernel - 1, s.conv_channels, dtype=dtype, device=device),
                    torch.zeros(s.heads, s.key_dim, s.value_dim, device=device),
                )
                for layer, s in self.shapes.items()
            },
        )
        self.current = self._zero
        self._staged: dict[int, LayerState] = {}
        self._undo: RecurrentSnapshot | None = None  # the state the last commit replaced
        self._saved: dict[int, RecurrentSnapshot] = {}
        # Per-position states of the last forward (a verify block, `track_positions`):
        # position -> the state after it, so a cut inside the block selects one.
        self.track_positions = False  # set by the worker around a forward that wants them
        self._staged_steps: dict[int, list[LayerState]] = {}
        self._inside: dict[int, RecurrentSnapshot] = {}

    def stage(
        self,
        layer: int,
        conv: torch.Tensor,
        delta: torch.Tensor,
        steps: list[LayerState] | None = None,
    ) -> None:
        """`steps`: the state after each token of the forward (the last == (conv, delta))."""
        if layer not in self.shapes:
            raise KeyError(f"layer {layer} is not a recurrent layer of this cache")
        self._staged[layer] = (conv, delta)
        if steps is not None:
            self._staged_steps[layer] = steps

    def commit(self, end: int) -> None:
        if end == self.current.pos and not self._staged:
            return
        missing = self.shapes.keys() - self._staged.keys()
        if missing:
            raise RuntimeError(f"commit to {end} without a new state for layers {sorted(missing)}")
        start = self.current.pos
        self._inside = {}
        if self._staged_steps.keys() == self.shapes.keys():
            for i in range(end - start - 1):  # the last step is the committed state itself
                states = {layer: steps[i] for layer, steps in self._staged_steps.items()}
                self._inside[start + i + 1] = RecurrentSnapshot(start + i + 1, states)
        self._undo = self.current
        self.current = RecurrentSnapshot(end, self._staged)
        self._staged, self._staged_steps = {}, {}

    def kept_positions(self) -> list[int]:
        kept = {0, self.current.pos, *self._saved, *self._inside}
        if self._undo is not None:
            kept.add(self._undo.pos)
        return sorted(kept)

    def rewind(self, pos: int) -> None:
        """Make the state at `pos` (<= the committed position) current, or raise and change
        nothing. Drops any staged state: its forward did not commit."""
        if pos == self.current.pos:
            self._staged, self._staged_steps = {}, {}
            return
        if pos == 0:
            target = self._zero
        elif self._undo is not None and self._undo.pos == pos:
            target = self._undo
        elif pos in self._saved:
            target = self._saved[pos]
        elif pos in self._inside:
            target = self._inside[pos]
        else:
            raise RecurrentRollback(
                f"cannot rewind the recurrent layers {sorted(self.shapes)} from position "
                f"{self.current.pos} to {pos}: their state is kept only at positions "
                f"{self.kept_positions()} (save_state() keeps more)"
            )
        self.current, self._staged, self._staged_steps = target, {}, {}
        if self._undo is not None and self._undo.pos >= pos:
            self._undo = None
        self._saved = {p: snap for p, snap in self._saved.items() if p <= pos}
        self._inside = {p: snap for p, snap in self._inside.items() if p < pos}

    def save(self) -> RecurrentSnapshot:
        self._saved[self.current.pos] = self.current
        return self.current

    def at(self, pos: int) -> RecurrentSnapshot:
        """The kept state at `pos` (current, saved, the previous commit or zero), or raise."""
        if pos == self.current.pos:
            return self.current
        if pos in self._saved:
            return self._saved[pos]
        if pos in self._inside:
            return self._inside[pos]
        if self._undo is not None and self._undo.pos == pos:
            return self._undo
        if pos == 0:
            return self._zero
        raise RecurrentRollback(
            f"no recurrent state kept at position {pos} (kept: {self.kept_positions()})"
        )

    def is_kept(self, snap: RecurrentSnapshot) -> bool:
        return (
            snap is self._zero
            or snap is self.current
            or snap is self._undo
            or self._saved.get(snap.pos) is snap
        )

    def release(self, snap: RecurrentSnapshot) -> None:
        if self._saved.get(snap.pos) is snap:
            del self._saved[snap.pos]

    def reset(self) -> None:
        self.current, self._staged, self._undo, self._saved = self._zero, {}, None, {}
        self._staged_steps, self._inside = {}, {}

    def load(self, pos: int, states: Mapping[int, LayerState]) -> None:
        """Make copies of `states` (every layer's (conv, delta), any device) the state at
        `pos`, keeping nothing else. Shapes are checked before anything changes."""
        if set(states) != set(self.shapes):
            raise ValueError(
                f"states needed for layers {sorted(self.shapes)}, got {sorted(states)}"
            )
        for layer, (conv, delta) in states.items():
            zc, zd = self._zero.states[layer]
            if conv.shape != zc.shape or delta.shape != zd.shape:
                raise ValueError(
                    f"layer {layer}: state must be conv {list(zc.shape)}, delta "
                    f"{list(zd.shape)}; got {list(conv.shape)}, {list(delta.shape)}"
                )
        copied = {
            layer: (
                conv.to(zc.device, zc.dtype, copy=True),
                delta.to(zd.device, zd.dtype, copy=True),
            )
            for layer, (conv, delta) in states.items()
            for zc, zd in (self._zero.states[layer],)
        }
        self.reset()
        self.current = RecurrentSnapshot(pos, copied) if pos else self._zero

    def reference(self, layer: int) -> LayerState:
        """The zero state of `layer`: the shapes, dtypes and device of its state."""
        return self._zero.states[layer]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for s in self.current.states.values() for t in s)


class KVStore(Protocol):
    """What the families and `Model.forward_layers` use of a cache: `KVCache` (context
    rows) and `kv_blocks.PagedKVCache` (blocks of a shared pool) both provide it."""

    layers: range
    pos: int
    # Attention runs row by row (batch-invariant mode); needs key row i to hold position i.
    row_exact: bool

    def reserve(self, start: int, n: int) -> None: ...

    def write(
        self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    # `write` without handing the rows back (the native decode path reads them in place).
    def store(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None: ...

    def mask(
        self, start: int, n: int, window: int | None, device: torch.device
    ) -> torch.Tensor | None: ...

    def observe_query(self, layer: int, q: torch.Tensor, window: int | None) -> None: ...

    # Whether `observe_query` does anything: the native decode path slices out and rotates
    # the queries in torch only for a cache that looks at them.
    observes_queries: bool

    # Whether `write` only stores rows (the native decode kernel may store them itself).
    writes_in_place: bool

    # The rows the native decode kernel may read in place (`native_attention.Storage`), or
    # None: it knows only the causal (and window) mask, so a cache whose `mask` hides more
    # rows, or whose rows are not in position order without a map, must return None.
    def decode_storage(self, layer: int) -> Storage | None: ...

    def commit(self, end: int) -> None: ...


def layer_roles(
    layers: range, sources: Mapping[int, int] | None, recurrent: Mapping[int, object] | None
) -> tuple[dict[int, int], tuple[int, ...]]:
    """(sources, stored) of a cache over `layers`: the KV-sharing layers' sources, checked
    (both in `layers`, the source storing its own rows), and the layers that hold K/V rows
    of their own (neither sharing nor recurrent), the ones snapshots copy."""
    shared = dict(sources or {})
    for layer, source in shared.items():
        if layer not in layers or source not in layers or source in shared:
            raise ValueError(
                f"layer {layer} cannot read the KV of layer {source}: both must be in "
                f"[{layers.start}, {layers.stop}) and the source must store its own"
            )
    stored = tuple(i for i in layers if i not in shared and i not in (recurrent or {}))
    return shared, stored


class BaseKVCache:
    """What every cache (`KVCache`, `kv_blocks.PagedKVCache`) does
    alike: its recurrent layers (see the module docstring; recurrent state is never pooled,
    so all keep it alike), the rollback of the fill position, and a prefix snapshot's rows
    out and in. A cache provides the attributes below and where its rows live:
    `_committed_rows` (a layer's rows [0, n) to copy out) and `_load_rows` (rows [0, n) in,
    after `reset`); `truncate` and `reset` it extends with its own bookkeeping."""

    recurrent: RecurrentState | None
    pos: int
    capacity: int  # the most positions the cache holds
    stored: tuple[int, ...]  # the layers with K/V rows of their own
    shapes: dict[int, tuple[int, int]]  # stored layer -> (Hkv, D)
    dtype: torch.dtype
    k: dict[int, torch.Tensor]  # stored layer -> its K rows [Hkv, rows, D] (V alike)
    v: dict[int, torch.Tensor]

    def truncate(self, pos: int) -> None:
        """Roll back to `pos` committed tokens (pos <= current fill position). With recurrent
        layers only to a position whose state is kept (else RecurrentRollback, no change)."""
        if not 0 <= pos <= self.pos:
            raise ValueError(f"cannot truncate to {pos}: fill position is {self.pos}")
        if self.recurrent is not None:
            self.recurrent.rewind(pos)
        self.pos = pos

    def reset(self) -> None:
        if self.recurrent is not None:
            self.recurrent.reset()
        self.pos = 0

    def nbytes(self) -> int:
        kv = sum(t.numel() * t.element_size() for t in (*self.k.values(), *self.v.values()))
        return kv + (self.recurrent.nbytes() if self.recurrent is not None else 0)

    def commit(self, end: int) -> None:
        """Positions [0, end) are committed (and the recurrent layers' staged states)."""
        if self.recurrent is not None:
            self.recurrent.commit(end)
        self.pos = end

    def is_recurrent(self, layer: int) -> bool:
        return self.recurrent is not None and layer in self.recurrent.shapes

    def recurrent_state(self, layer: int) -> LayerState:
        """`layer`'s committed (conv window, delta matrix): the state at the fill position."""
        return self._recurrent().current.states[layer]

    def stage_state(
        self,
        layer: int,
        conv: torch.Tensor,
        delta: torch.Tensor,
        steps: list[LayerState] | None = None,
    ) -> None:
        """`layer`'s state after the running forward; `commit` makes it current. `steps`
        (when `tracks_positions`): the state after each of its tokens."""
        self._recurrent().stage(layer, conv, delta, steps)

    def tracks_positions(self) -> bool:
        """Whether the running forward keeps a state per position (a verify block)."""
        return self.recurrent is not None and self.recurrent.track_positions

    def save_state(self) -> RecurrentSnapshot:
        """Keep the recurrent state at the fill position, so `truncate` can come back to it."""
        return self._recurrent().save()

    def state_at(self, pos: int) -> RecurrentSnapshot:
        """The kept recurrent state at `pos` (a prefix snapshot's cut), or RecurrentRollback."""
        return self._recurrent().at(pos)

    def restore_state(self, snap: RecurrentSnapshot) -> None:
        """Rewind to a kept snapshot (its rows [0, snap.pos) are still in the cache)."""
        rec = self._recurrent()
        if not rec.is_kept(snap) or snap.pos > self.pos:
            raise RecurrentRollback(
                f"the snapshot at position {snap.pos} is no longer kept "
                f"(fill position {self.pos}, kept {rec.kept_positions()})"
            )
        self.truncate(snap.pos)

    def release_state(self, snap: RecurrentSnapshot) -> None:
        """Stop keeping a snapshot of `save_state` (its tensors are freed with the last user)."""
        self._recurrent().release(snap)

    def _recurrent(self) -> RecurrentState:
        if self.recurrent is None:
            raise RuntimeError("this cache has no recurrent layers")
        return self.recurrent

    # Prefix snapshots (`kv_snapshot`): the same checks and order for every cache.

    def export_rows(self, layer: int, n: int, k_out: torch.Tensor, v_out: torch.Tensor) -> None:
        """Copy `layer`'s committed rows [0, n) into k_out / v_out ([Hkv, >= n, D], the cache
        dtype, any device: `copy_` crosses devices)."""
        if not 0 <= n <= self.pos:
            raise ValueError(f"cannot export {n} rows: fill position is {self.pos}")
        k, v = self._committed_rows(layer, n)
        k_out[:, :n].copy_(k)
        v_out[:, :n].copy_(v)

    def import_rows(
        self,
        n: int,
        rows: Mapping[int, tuple[torch.Tensor, torch.Tensor]],
        states: Mapping[int, LayerState] | None = None,
    ) -> None:
        """Replace the cache by rows [0, n) of each layer's (k, v) ([Hkv, >= n, D], the cache
        dtype, any device) and, for recurrent layers, `states` (each the layer's state at n),
        then commit n. Every stored and recurrent layer must be given; n and the rows are
        checked before anything changes. A failure after that (a state of the wrong shape, a
        full pool, a copy) leaves the cache empty (pos 0)."""
        self._check_import(n, rows, states)
        self.reset()
        try:
            self._load_rows(n, rows)
            if self.recurrent is not None:  # after the rows: placing them may rewind to 0
                assert states is not None
                self.recurrent.load(n, states)
        except BaseException:
            self.reset()
            raise
        self.pos = n

    def _committed_rows(self, layer: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`layer`'s K and V over positions [0, n) (committed), as [Hkv, n, D]; here row p
        holds position p."""
        return self.k[layer][:, :n], self.v[layer][:, :n]

    def _load_rows(self, n: int, rows: Mapping[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Store rows [0, n) of each stored layer's (k, v) at positions [0, n) (checked);
        here into rows [0, n)."""
        for layer, (k, v) in rows.items():
            self.k[layer][:, :n].copy_(k[:, :n])
            self.v[layer][:, :n].copy_(v[:, :n])

    def _check_fits(self, n: int) -> None:
        if n > self.capacity:
            raise ContextOverflow(f"{n} positions exceed the KV capacity {self.capacity}")

    def _check_import(
        self,
        n: int,
        rows: Mapping[int, tuple[torch.Tensor, torch.Tensor]],
        states: Mapping[int, LayerState] | None,
    ) -> None:
        """`import_rows`' checks, before anything changes: n fits, each stored layer's rows
        as [Hkv, >= n, D] in the cache dtype, and states exactly when some layer is
        recurrent."""
        self._check_fits(n)
        if self.recurrent is None and states:
            raise ValueError(f"states for layers {sorted(states)}: no layer here is recurrent")
        if self.recurrent is not None and states is None:
            raise ValueError(
                f"cannot import K/V rows alone: layers {sorted(self.recurrent.shapes)} keep a "
                "recurrent state, which rows do not restore"
            )
        if set(rows) != set(self.stored):
            raise ValueError(f"import needs layers {list(self.stored)}, got {sorted(rows)}")
        for layer, pair in rows.items():
            want = self.shapes[layer]
            for t in pair:
                if t.dim() != 3 or (t.shape[0], t.shape[2]) != want or t.shape[1] < n:
                    raise ValueError(
                        f"layer {layer}: rows must be [{want[0]}, >= {n}, {want[1]}], "
                        f"got {list(t.shape)}"
                    )
                if t.dtype != self.dtype:
                    raise ValueError(f"layer {layer}: rows are {t.dtype}, the cache {self.dtype}")


class KVCache(BaseKVCache):
    def __init__(
        self,
        layers: range,
        n_kv_heads: int,
        head_dim: int,
        capacity: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        initial: int = 256,
        *,
        shapes: Mapping[int, tuple[int, int]] | None = None,
        sources: Mapping[int, int] | None = None,
        recurrent: Mapping[int, RecurrentShape] | None = None,
        row_exact: bool = False,
        state_dtype: torch.dtype | None = None,
    ) -> None:
        """shapes: layer -> (Hkv, D) where it differs from (n_kv_heads, head_dim);
        sources: KV-sharing layer -> the layer of this cache whose K/V it reads;
        recurrent: the layers that keep a recurrent state instead of K/V;
        row_exact: attention row by row, as each position's decode step (batch-invariant);
        state_dtype: the recurrent conv windows' dtype (default `dtype`, the rows')."""
        self.row_exact = row_exact
        self.layers = layers
        self.head_dim = head_dim
        self.capacity = capacity
        self.dtype = dtype
        self.device = torch.device(device)
        states = state_dtype or dtype
        self.recurrent = RecurrentState(recurrent, states, self.device) if recurrent else None
        self.sources, self.stored = layer_roles(layers, sources, recurrent)
        self.shapes = {i: (n_kv_heads, head_dim) for i in self.stored}
        self.shapes.update((i, s) for i, s in (shapes or {}).items() if i in self.shapes)
        self.pos = 0
        self._allocated = 0
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}
        self._storage: dict[int, Storage] = {}  # decode_storage's, until the next _grow
        self._grow(min(capacity, initial))

    def _grow(self, size: int, keep: int | None = None) -> None:
        """Reallocate every stored layer to `size` rows, keeping rows [0, keep) (default: all)."""
        keep = self._allocated if keep is None else keep
        for i in self.stored:
            heads, dim = self.shapes[i]
            k = torch.zeros((heads, size, dim), dtype=self.dtype, device=self.device)
            v = torch.zeros((heads, size, dim), dtype=self.dtype, device=self.device)
            if keep:
                k[:, :keep] = self.k[i][:, :keep]
                v[:, :keep] = self.v[i][:, :keep]
            self.k[i], self.v[i] = k, v
        self._allocated = size
        self._storage.clear()

    def reserve(self, start: int, n: int) -> None:
        """Make room for positions [start, start + n); start may not skip past `pos`."""
        if start > self.pos:
            raise ValueError(
                f"KV write at {start} would leave a gap after fill position {self.pos}"
            )
        end = start + n
        if end > self.capacity:
            raise ContextOverflow(
                f"context of {end} tokens exceeds the KV capacity {self.capacity}"
            )
        if self.recurrent is not None:
            self.truncate(start)  # the recurrent layers continue from the state at start
        if end > self._allocated:
            self._grow(min(self.capacity, max(end, 2 * self._allocated)))

    def store(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.write(layer, start, k, v)

    def write(
        self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v ([n, Hkv, D]) at [start, start + n) and return the layer's K, V over
        [0, start + n) as [Hkv, L, D] views."""
        end = start + k.shape[0]
        self.k[layer][:, start:end] = k.transpose(0, 1)
        self.v[layer][:, start:end] = v.transpose(0, 1)
        return self.k[layer][:, :end], self.v[layer][:, :end]

    def read(self, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V over [0, end) of the layer `layer` reads ([Hkv, L, D] views): its source's
        for a KV-sharing layer, which must have written them earlier in the forward."""
        source = self.sources.get(layer, layer)
        return self.k[source][:, :end], self.v[source][:, :end]

    def mask(
        self, start: int, n: int, window: int | None, device: torch.device
    ) -> torch.Tensor | None:
        """The attention mask over the keys `write` returned ([0, start + n))."""
        return attention_mask(start, n, start + n, window, device)

    def observe_query(self, layer: int, q: torch.Tensor, window: int | None) -> None:
        """Queries matter only to KV Flash's scorer (a scored `PagedKVCache`)."""

    observes_queries = False

    writes_in_place = True  # `write` only stores rows: the native kernel may do it instead

    def decode_storage(self, layer: int) -> Storage:
        """The whole K and V storage [Hkv, allocated rows, D] that `layer` attends over (its
        source's for a KV-sharing layer): row i holds position i, so the native decode
        kernel (`native_attention`) writes and reads it in place."""
        source = self.sources.get(layer, layer)
        storage = self._storage.get(source)
        if storage is None:  # one per layer, so the kernel's checks of it run once
            storage = self._storage[source] = Storage(self.k[source], self.v[source])
        return storage

    def _load_rows(self, n: int, rows: Mapping[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        if n > self._allocated:  # nothing to keep: the old rows are being replaced
            self._grow(min(self.capacity, max(n, 2 * self._allocated)), keep=0)
        super()._load_rows(n, rows)
