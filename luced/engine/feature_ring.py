"""The DFlash feature ring: captured target hidden states by absolute position.

A daemon-owned shared segment ``ring`` holding one region::

    ring  [ring_cap, n_capture, hidden]  (float32 unless configured; row-major)

    slot s = position % ring_cap          capture j = j-th layer of `layers`
    byte offset of [s, j, :] = region.offset + (s * n_capture + j) * hidden * itemsize

    slot 0  | cap 0: h_L0(p) | cap 1: h_L1(p) | ... |     p = 0, ring_cap, 2 ring_cap, ...
    slot 1  | cap 0          | cap 1          | ... |     p = 1, ring_cap + 1, ...
    ...

``h_L(p)`` is the output of layer L at position p (the residual stream after its FFN,
HF's ``hidden_states[L + 1]``). Slots are overwritten as positions wrap, so the ring
holds the last ``ring_cap`` positions fed.

Writers and ordering: every forward of the target carries the capture list and this
region to *every* shard; a shard writes column j of the slots of its positions only
when it holds layer ``layers[j]``, so each (slot, j) cell has exactly one writer, the
worker computing that layer, wherever it runs. A shard writes its cells before it
replies to the forward; the daemon sends the next shard's forward only after that
reply, and reads the ring (or lets the draft read it) only after the last shard's
reply. A rolled-back forward (truncate) leaves stale cells for positions past the
committed length; the next forward of those positions overwrites them. The daemon
creates and unlinks the segment; workers only attach.
"""

from __future__ import annotations

import numpy as np

from luced.ipc.regions import Region, RegionAllocator, required_bytes, view
from luced.ipc.shm import Segment, ShmOwner


class FeatureRing:
    def __init__(
        self,
        owner: ShmOwner,
        layers: tuple[int, ...],
        ring_cap: int,
        hidden: int,
        dtype: str = "float32",
        name: str = "ring",
    ) -> None:
        if not layers or len(set(layers)) != len(layers) or min(layers) < 0:
            raise ValueError(f"capture layers must be distinct and >= 0, got {list(layers)}")
        if ring_cap < 1:
            raise ValueError(f"ring_cap must be >= 1, got {ring_cap}")
        self.layers = tuple(layers)
        self.ring_cap = ring_cap
        self.hidden = hidden
        shape = (ring_cap, len(layers), hidden)
        self.segment: Segment = owner.create(name, required_bytes([(shape, dtype)]))
        self.region: Region = RegionAllocator.for_segment(self.segment).alloc(name, shape, dtype)
        self.array = view(self.segment, self.region)  # [ring_cap, n_capture, hidden]

    def rows(self, start: int, stop: int) -> np.ndarray:
        """A copy of positions [start, stop) (at most ring_cap of them): [n, n_capture, hidden]."""
        if not 0 <= start <= stop or stop - start > self.ring_cap:
            raise ValueError(f"positions [{start}, {stop}) do not fit a ring of {self.ring_cap}")
        return self.array[np.arange(start, stop) % self.ring_cap].copy()

    def put(self, start: int, rows: np.ndarray) -> None:
        """Write `rows` ([n, n_capture, hidden], n <= ring_cap) as positions [start, start + n)."""
        if start < 0 or len(rows) > self.ring_cap:
            raise ValueError(f"{len(rows)} rows at {start} do not fit a ring of {self.ring_cap}")
        self.array[np.arange(start, start + len(rows)) % self.ring_cap] = rows


def cells(ring: Region, start: int, n: int, columns: tuple[int, int]) -> list[Region]:
    """The cells of positions [start, start + n) and captures [j0, j1) as regions (for a
    worker on another host, which writes or reads them in its mirror): whole rows make
    one region per run of slots up to the ring's end; some columns, one per slot."""
    cap, n_capture, hidden = ring.shape
    j0, j1 = columns
    row = n_capture * hidden * ring.itemsize
    out: list[Region] = []
    if (j0, j1) == (0, n_capture):
        pos = start
        while pos < start + n:
            slot = pos % cap
            run = min(start + n - pos, cap - slot)
            out.append(
                Region(ring.segment, ring.offset + slot * row, (run, n_capture, hidden), ring.dtype)
            )
            pos += run
        return out
    for pos in range(start, start + n):
        offset = ring.offset + (pos % cap) * row + j0 * hidden * ring.itemsize
        out.append(Region(ring.segment, offset, (j1 - j0, hidden), ring.dtype))
    return out
