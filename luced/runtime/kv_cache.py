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

Prefix snapshots: `export_rows` copies a layer's committed rows [0, n) out (into
shared memory, device -> host on a GPU); `import_rows` replaces the whole cache by
the first n rows of given tensors and commits n.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import torch

from luced.runtime.layers import attention_mask


class ContextOverflow(ValueError):
    """A forward would write past the cache's capacity."""


class KVStore(Protocol):
    """What the families and `Model.forward_layers` use of a cache: `KVCache` (context
    rows) and `kv_pool.PooledKVCache` (KV Flash pool rows) both provide it."""

    layers: range
    pos: int

    def reserve(self, start: int, n: int) -> None: ...

    def write(
        self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def mask(
        self, start: int, n: int, window: int | None, device: torch.device
    ) -> torch.Tensor | None: ...

    def commit(self, end: int) -> None: ...


class KVCache:
    def __init__(
        self,
        layers: range,
        n_kv_heads: int | Mapping[int, int],  # one count, or one per layer
        head_dim: int,
        capacity: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        initial: int = 256,
    ) -> None:
        self.layers = layers
        self.kv_heads = (
            dict.fromkeys(layers, n_kv_heads)
            if isinstance(n_kv_heads, int)
            else {i: n_kv_heads[i] for i in layers}
        )
        self.head_dim = head_dim
        self.capacity = capacity
        self.dtype = dtype
        self.device = torch.device(device)
        self.pos = 0
        self._allocated = 0
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}
        self._grow(min(capacity, initial))

    def _grow(self, size: int, keep: int | None = None) -> None:
        """Reallocate every layer to `size` rows, keeping rows [0, keep) (default: all)."""
        keep = self._allocated if keep is None else keep
        for i in self.layers:
            shape = (self.kv_heads[i], size, self.head_dim)
            k = torch.zeros(shape, dtype=self.dtype, device=self.device)
            v = torch.zeros(shape, dtype=self.dtype, device=self.device)
            if keep:
                k[:, :keep] = self.k[i][:, :keep]
                v[:, :keep] = self.v[i][:, :keep]
            self.k[i], self.v[i] = k, v
        self._allocated = size

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
        if end > self._allocated:
            self._grow(min(self.capacity, max(end, 2 * self._allocated)))

    def write(
        self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v ([n, Hkv, D]) at [start, start + n) and return the layer's K, V over
        [0, start + n) as [Hkv, L, D] views."""
        end = start + k.shape[0]
        self.k[layer][:, start:end] = k.transpose(0, 1)
        self.v[layer][:, start:end] = v.transpose(0, 1)
        return self.k[layer][:, :end], self.v[layer][:, :end]

    def mask(
        self, start: int, n: int, window: int | None, device: torch.device
    ) -> torch.Tensor | None:
        """The attention mask over the keys `write` returned ([0, start + n))."""
        return attention_mask(start, n, start + n, window, device)

    def commit(self, end: int) -> None:
        self.pos = end

    def truncate(self, pos: int) -> None:
        """Roll back to `pos` committed tokens (pos <= current fill position)."""
        if not 0 <= pos <= self.pos:
            raise ValueError(f"cannot truncate to {pos}: fill position is {self.pos}")
        self.pos = pos

    def reset(self) -> None:
        self.pos = 0

    def export_rows(self, layer: int, n: int, k_out: torch.Tensor, v_out: torch.Tensor) -> None:
        """Copy `layer`'s committed rows [0, n) into k_out / v_out ([Hkv, >= n, D], the cache
        dtype, any device: `copy_` crosses devices)."""
        if not 0 <= n <= self.pos:
            raise ValueError(f"cannot export {n} rows: fill position is {self.pos}")
        k_out[:, :n].copy_(self.k[layer][:, :n])
        v_out[:, :n].copy_(self.v[layer][:, :n])

    def import_rows(self, n: int, rows: Mapping[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Replace the cache by rows [0, n) of each layer's (k, v) ([Hkv, >= n, D], the cache
        dtype, any device) and commit n. Every layer must be given; the shapes are checked
        before anything changes. A copy failing part-way leaves the cache empty (pos 0)."""
        if n > self.capacity:
            raise ContextOverflow(f"{n} positions exceed the KV capacity {self.capacity}")
        if set(rows) != set(self.layers):
            raise ValueError(f"import needs layers {list(self.layers)}, got {sorted(rows)}")
        for layer, pair in rows.items():
            want = (self.kv_heads[layer], self.head_dim)
            for t in pair:
                if t.dim() != 3 or (t.shape[0], t.shape[2]) != want or t.shape[1] < n:
                    raise ValueError(
                        f"layer {layer}: rows must be [{want[0]}, >= {n}, {want[1]}], "
                        f"got {list(t.shape)}"
                    )
                if t.dtype != self.dtype:
                    raise ValueError(f"layer {layer}: rows are {t.dtype}, the cache {self.dtype}")
        self.pos = 0
        if n > self._allocated:  # nothing to keep: the old rows are being replaced
            self._grow(min(self.capacity, max(n, 2 * self._allocated)), keep=0)
        for layer, (k, v) in rows.items():
            self.k[layer][:, :n].copy_(k[:, :n])
            self.v[layer][:, :n].copy_(v[:, :n])
        self.pos = n

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k.values(), *self.v.values()))
