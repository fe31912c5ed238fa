"""A state record: a hybrid's recurrent state at one position, every recurrent layer of one
worker, as raw bytes, so the daemon keeps it in shared memory and on disk (the prefix
cache's state records, the daemon's engine/kv/state_store.py) as it keeps K/V blocks.

One shard's part of a record (`StateLayout.nbytes`), for each recurrent layer ascending::

    conv   [kernel - 1, channels]       the state dtype   its last conv1d inputs
    delta  [heads, key_dim, value_dim]  float32           the delta-rule matrix

each the tensor's bytes in C order, starting at a multiple of `ALIGN` bytes (so is the
part's size). A worker's record is its shards' parts one after another
(`LoadReply.kv_state_bytes`), the daemon's `<name>-kvstate` row (`kv_page` ``states``).

`write` copies a kept state (`RecurrentState.at`) into a record's bytes, `read` views a
record as the layers' states (host tensors: `RecurrentState.load` copies them to the
cache's device). Bytes move as bytes: a record read back is the state written, bit for bit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from luced.runtime.kv_cache import LayerState, RecurrentSnapshot, RecurrentState

ALIGN = 16  # bytes: each tensor's offset in a record, and a shard's part


@dataclass(frozen=True)
class _Field:
    layer: int
    offset: int  # bytes into the shard's part
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


class StateLayout:
    """Where each recurrent layer's conv window and delta matrix sit in one shard's part of
    a state record (the module docstring)."""

    def __init__(self, state: RecurrentState) -> None:
        fields: list[tuple[_Field, _Field]] = []
        at = 0
        for layer in sorted(state.shapes):
            pair = []
            for t in state.reference(layer):  # the zero state: shapes and dtypes
                pair.append(_Field(layer, at, tuple(t.shape), t.dtype))
                at += -(-pair[-1].nbytes // ALIGN) * ALIGN
            fields.append((pair[0], pair[1]))
        self.fields = fields
        self.nbytes = at

    def write(self, snap: RecurrentSnapshot, row: torch.Tensor) -> None:
        """Copy `snap`'s states (any device) into `row`, uint8 [nbytes] (host memory)."""
        for conv, delta in self.fields:
            for f, t in zip((conv, delta), snap.states[conv.layer], strict=True):
                raw = t.contiguous().view(torch.uint8).reshape(-1)
                row[f.offset : f.offset + f.nbytes].copy_(raw)

    def read(self, row: torch.Tensor) -> dict[int, LayerState]:
        """The layers' states held in `row`, uint8 [nbytes], as copies (the row is the
        daemon's and may be reused once the frame is answered)."""
        out: dict[int, LayerState] = {}
        for conv, delta in self.fields:
            c, d = (
                row[f.offset : f.offset + f.nbytes].clone().view(f.dtype).reshape(f.shape)
                for f in (conv, delta)
            )
            out[conv.layer] = (c, d)
        return out


def record_bytes(states: list[RecurrentState | None]) -> int:
    """A worker's state record: its shards' parts one after another (0: no recurrent
    layer)."""
    return sum(StateLayout(s).nbytes for s in states if s is not None)


def shard_rows(records: torch.Tensor, states: list[RecurrentState | None]) -> list[torch.Tensor]:
    """Each shard's bytes of every record, uint8 [n, its part] (views of `records`, uint8
    [n, record_bytes]); an empty one for a shard without recurrent layers."""
    rows, at = [], 0
    for s in states:
        n = StateLayout(s).nbytes if s is not None else 0
        rows.append(records[:, at : at + n])
        at += n
    return rows


SAVE, LOAD = 0, 1  # a state move's kind (`frames.KVPage.states`)


@dataclass(frozen=True)
class StatePlan:
    """A frame's state moves, checked against one sequence's caches: per shard, the kept
    states to save and their records; the record to load, if any."""

    saves: list[list[tuple[RecurrentSnapshot, int]]]  # per shard
    load: int | None  # the record of the state at the adopted end


def plan_states(
    states: list[RecurrentState | None],
    moves: tuple[tuple[int, int, int], ...] | list[tuple[int, int, int]],
    end: int,
    adopts: bool,
) -> StatePlan:
    """Check a frame's state moves (kind, position, record) against a sequence's shards'
    recurrent states (None: a shard without recurrent layers), whose positions end at
    `end` after the frame's adopts (`adopts`: it has some): a save names a kept state, a
    load the adopted end, and a recurrent sequence adopts only with a load. ValueError
    naming the problem; nothing changes."""
    recurrent = [s for s in states if s is not None]
    if moves and not recurrent:
        raise ValueError("state moves for a sequence without recurrent layers")
    loads = [record for kind, _, record in moves if kind == LOAD]
    for kind, position, _ in moves:
        if kind == LOAD and position != end:
            raise ValueError(f"a state loaded at {position}: the adopted blocks end at {end}")
    if adopts and recurrent and not loads:
        raise ValueError("a sequence with recurrent layers adopts blocks only with their state")
    saves = [
        [(s.at(position), record) for kind, position, record in moves if kind == SAVE]
        if s is not None
        else []
        for s in states
    ]  # RecurrentRollback (a ValueError) where a state was not kept
    return StatePlan(saves, loads[0] if loads else None)
