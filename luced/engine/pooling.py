"""Embeddings: a sequence that feeds its input and pools the last layer's states instead of
sampling a token, then finishes.

An embedding request (`GenerationRequest.pooling`) is scheduled like a prompt that never
decodes: its chunks go into the steps beside the other sequences' work, each chunk's span
asking the last worker for one pooled row (`frames.Span.pool`), and the `Pooler` makes the
vector from those rows:

    mean   every row's state, averaged: each chunk's span gives its rows' sum ("sum"), the
           pooler adds them up and divides by the input's length
    cls    the first row's ([CLS] for BERT): the span from position 0 gives it ("first")
    last   the last row's: the input's last span gives it ("last")

States are the last layer's rows after the final norm (transformers' last_hidden_state). The
vector is not normalised here; the APIs make it unit length. An encoder (attention not
causal: BERT) sees its whole input in one span, so its input is never cut into chunks.

GGUF: `{arch}.pooling_type` (llama.cpp's enum: 0 none, 1 mean, 2 cls, 3 last, 4 rank) and
`{arch}.attention.causal` (false: an encoder).
"""

from __future__ import annotations

import numpy as np

from luced.gguf_file import GGUFFile

POOLINGS = ("mean", "cls", "last")
_GGUF_POOLING = {1: "mean", 2: "cls", 3: "last"}


def declared_pooling(gguf: GGUFFile) -> str | None:
    """The pooling the GGUF declares, when it is one of POOLINGS (none, rank: None)."""
    return _GGUF_POOLING.get(int(gguf.get(f"{gguf.arch}.pooling_type", 0)))


def is_encoder(gguf: GGUFFile) -> bool:
    """Whether the model's attention is bidirectional (it serves embeddings only)."""
    return not gguf.get(f"{gguf.arch}.attention.causal", True)


class Pooler:
    """One embedding sequence's vector, built from its spans' pooled rows."""

    def __init__(self, kind: str, n_tokens: int) -> None:
        if kind not in POOLINGS:
            raise ValueError(f"pooling must be one of {', '.join(POOLINGS)}, got {kind!r}")
        self.kind = kind
        self.n_tokens = n_tokens
        self.reset()

    def reset(self) -> None:
        """Start over (the sequence was preempted: its chunks run again)."""
        self._total: np.ndarray | None = None  # float64 sum of the rows so far ("mean")
        self._row: np.ndarray | None = None  # the first or last row

    def ask(self, start: int, end: int) -> str:
        """What the span [start, end) gives (`frames.Span.pool`): "" for nothing."""
        if self.kind == "mean":
            return "sum"
        if self.kind == "cls":
            return "first" if start == 0 else ""
        return "last" if end == self.n_tokens else ""

    def take(self, row: np.ndarray) -> None:
        """A span's pooled row (float32 [hidden]), in the order the spans ran."""
        if self.kind != "mean":
            self._row = row.copy()
        elif self._total is None:
            self._total = row.astype(np.float64)
        else:
            self._total += row

    def result(self) -> np.ndarray:
        """The pooled state, float32 [hidden], once every span has run."""
        if self.kind == "mean":
            assert self._total is not None, "no span was pooled"
            return (self._total / self.n_tokens).astype(np.float32)
        assert self._row is not None, "the pooled span has not run"
        return self._row
