"""A ragged batch: one forward over the tokens of several sequences at once.

Continuous batching runs every running sequence's next tokens (a decode token, a prefill
chunk, a verify block) through the model in one pass. Each linear layer then multiplies
the step's T tokens as one [T, H] matrix, reading the weights once for all sequences,
which is what decode is bound by. What mixes tokens along a sequence runs per sequence,
over that sequence's own cache: attention and the recurrent layers' state.

The families are written for one sequence (`start`, `cache`). A `Ragged` batch is passed
as both: `Rope.tables` gives each token its own position, and the places that touch a
sequence's cache (`common.cached_attention`, the recurrent mixers) hand each sequence its
rows through `per_sequence`. Every other op is row-wise, so a sequence's logits in a batch
are the ones it gets alone (exactly so where the kernels are batch-invariant: the packed
weights up to 64 rows; float32 dense matmuls may differ in the last bits).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch


class SequenceCache(Protocol):
    """What a batch does with a sequence's cache itself (a `kv_cache.KVStore`); the layers
    use the rest."""

    def reserve(self, start: int, n: int) -> None: ...

    def commit(self, end: int) -> None: ...


@dataclass(frozen=True)
class Span:
    """One sequence's tokens in a batch: `n` positions from `start`, in its own `cache`."""

    cache: SequenceCache
    start: int
    n: int


class Ragged:
    """The sequences of one step, their tokens one after another in the batch's rows."""

    def __init__(self, spans: Sequence[Span]) -> None:
        if not spans:
            raise ValueError("a ragged batch needs at least one sequence")
        if any(s.n < 1 or s.start < 0 for s in spans):
            raise ValueError("every sequence of a batch feeds at least one token at start >= 0")
        if len({id(s.cache) for s in spans}) != len(spans):
            raise ValueError("a cache appears twice in one batch")
        self.spans = tuple(spans)
        self.sizes = [s.n for s in spans]
        self.n = sum(self.sizes)
        self.end = max(s.start + s.n for s in spans)
        # each row's position, as a tensor (RoPE tables) and a list (the native attention's
        # per-query entries, every layer)
        self.position_list = [s.start + i for s in spans for i in range(s.n)]
        self.positions = torch.tensor(self.position_list)

    def per_sequence(
        self, fn: Callable[..., torch.Tensor], *rows: torch.Tensor | None
    ) -> torch.Tensor:
        """fn(span, *its rows of each tensor) for every sequence, concatenated in batch
        order; a None stays None for every sequence."""
        parts = [(None,) * len(self.spans) if t is None else t.split(self.sizes) for t in rows]
        return torch.cat([fn(span, *(p[i] for p in parts)) for i, span in enumerate(self.spans)])

    def reserve(self) -> None:
        for s in self.spans:
            s.cache.reserve(s.start, s.n)

    def commit(self) -> None:
        for s in self.spans:
            s.cache.commit(s.start + s.n)
