"""What one prefix-cache snapshot holds: a list of named tensors with a token axis.

The target describes its snapshot layout (``Target.kv_layout``) as ``TensorSpec``s;
the snapshot store sizes arena regions and disk tensors from them. A spec's ``shape`` is
per token: the token axis is sized 1, and a snapshot of n tokens has n there::

    "k.{layer}" / "v.{layer}"   (n_kv_heads, 1, head_dim)   token_axis 1   cache dtype
    "ring"                      (1, n_capture, hidden)      token_axis 0   the ring's dtype
    "conv.{layer}"              (kernel - 1, channels)      None           cache dtype
    "delta.{layer}"             (heads, key_dim, value_dim) None           float32

A spec without a token axis is a recurrent layer's state. A hybrid's snapshot holds it at
each of its cut points (the recurrent state exists only where the prefill stopped), so
its tensor has a leading cut axis: ``shape_for(n, n_cuts)`` is ``(n_cuts, *shape)``,
slot i the state at the entry's i-th cut (ascending, the last one n).

Daemon side: no torch here (``tests/test_layering.py``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from luced.ipc.regions import numpy_dtype


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]  # per token: shape[token_axis] == 1 (else the whole tensor)
    dtype: str  # a wire dtype name (luced.ipc.regions.DTYPES), e.g. "bfloat16"
    token_axis: int | None  # None: a fixed-size tensor (a recurrent state)

    def __post_init__(self) -> None:
        axis = self.token_axis
        if axis is not None and (not 0 <= axis < len(self.shape) or self.shape[axis] != 1):
            raise ValueError(f"{self.name}: shape {self.shape} needs size 1 at {self.token_axis}")
        numpy_dtype(self.dtype)  # raises on an unknown name

    def shape_for(self, n_tokens: int, n_cuts: int = 1) -> tuple[int, ...]:
        """The tensor's shape holding ``n_tokens`` positions (a state: ``n_cuts`` slots)."""
        if self.token_axis is None:
            return (n_cuts, *self.shape)
        shape = list(self.shape)
        shape[self.token_axis] = n_tokens
        return tuple(shape)

    @property
    def bytes_per_token(self) -> int:
        return math.prod(self.shape) * numpy_dtype(self.dtype).itemsize

    def nbytes(self, n_tokens: int, n_cuts: int = 1) -> int:
        """Bytes of the tensor holding ``n_tokens`` positions (a state: ``n_cuts`` slots)."""
        if self.token_axis is None:
            return self.bytes_per_token * n_cuts  # one whole state per cut, whatever n
        return self.bytes_per_token * n_tokens


def tensor_specs(
    tensors: Sequence[tuple[str, int, int]],
    dtype: str,
    states: Sequence[tuple[str, Sequence[int], str]] = (),
) -> list[TensorSpec]:
    """A worker's snapshot tensors from its ``kv_layout`` reply: K/V as (name, n_kv_heads,
    head_dim) in the cache dtype, recurrent states as (name, shape, dtype)."""
    specs = [TensorSpec(name, (heads, 1, dim), dtype, 1) for name, heads, dim in tensors]
    return specs + [TensorSpec(name, tuple(shape), dt, None) for name, shape, dt in states]
