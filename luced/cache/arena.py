"""The prefix cache's memory tier: one daemon-owned shared-memory segment carved into blocks.

Workers export K/V rows straight into a block and import them back from it, so a snapshot
is never serialized and survives a worker restart (the daemon owns the segment).

Segment layout (``/luced-<instance>-prefix-arena``; offsets absolute, all 64-byte aligned)::

    0        64                                                                 64 + capacity
    +--------+--------------------+-----------+--------------------+-----------+
    | header | block A            | free      | block B            | free      |
    |        | k.0 | v.0 | ... |  |           | k.0 | v.0 | ... |  |           |
    |        | tokens             |           | tokens             |           |
    +--------+--------------------+-----------+--------------------+-----------+

A block holds one snapshot of n tokens: each ``TensorSpec`` of the layout in order, with
its token axis sized n, each tensor starting 64-byte aligned (``regions``), then (added by
the prefix cache) the int32 token ids. Allocation is first-fit over a free list sorted by
offset; a freed block coalesces with free neighbours. Pages of tmpfs are only backed by RAM
once written, so a large, mostly empty arena costs little.

Who writes, who reads: the daemon allocates a block and names its regions in a
``kv_export`` frame; each worker writes its own tensors (disjoint regions) and replies;
only then does anyone read them (``kv_import``, a disk write). While a block is in use
(pinned by the cache) it is neither freed nor reused. Who unlinks: the daemon (``close`` or
``ShmOwner.unlink_all``); workers attach by ``segment_name`` and only unmap.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from luced.cache.layout import TensorSpec
from luced.ipc.regions import ALIGN, Region, align_up, view
from luced.ipc.shm import HEADER_SIZE, Segment, ShmOwner

TOKENS = "tokens"
# The token ids of a snapshot travel with it: one int32 per token.
TOKENS_SPEC = TensorSpec(TOKENS, (1,), "int32", 0)


def check_layout(specs: Iterable[TensorSpec]) -> None:
    """Names unique (``TensorSpec`` checks its own token axis and dtype)."""
    names: set[str] = set()
    for s in specs:
        if s.name in names:
            raise ValueError(f"snapshot layout names {s.name!r} twice")
        names.add(s.name)


def layout_bytes(specs: Iterable[TensorSpec], n: int, n_cuts: int = 1) -> int:
    """Bytes of a block holding ``specs`` for ``n`` tokens and ``n_cuts`` recurrent-state
    slots (each tensor 64-byte aligned)."""
    return sum(align_up(s.nbytes(n, n_cuts)) for s in specs)


@dataclass(frozen=True)
class Block:
    offset: int  # absolute byte offset in the arena segment, 64-byte aligned
    nbytes: int  # a multiple of 64


class SnapshotArena:
    """First-fit allocator over one shared-memory segment (see the module docstring)."""

    def __init__(self, owner: ShmOwner, nbytes: int, name: str = "prefix-arena") -> None:
        if nbytes < ALIGN:
            raise ValueError(f"arena of {nbytes} bytes is smaller than one {ALIGN}-byte block")
        self.capacity = nbytes // ALIGN * ALIGN
        self._owner = owner
        self.segment: Segment = owner.create(name, self.capacity)
        # Free spans (offset, size), sorted by offset, never adjacent (always coalesced).
        self._free: list[tuple[int, int]] = [(HEADER_SIZE, self.capacity)]
        self._used: dict[int, int] = {}  # offset -> size of the live blocks
        self._used_bytes = 0

    @property
    def segment_name(self) -> str:
        """The POSIX name workers attach by."""
        return self.segment.name

    @property
    def used(self) -> int:
        return self._used_bytes

    @property
    def free_bytes(self) -> int:
        return self.capacity - self.used

    @property
    def largest_free(self) -> int:
        return max((size for _, size in self._free), default=0)

    @property
    def n_blocks(self) -> int:
        return len(self._used)

    def alloc(self, nbytes: int) -> Block | None:
        """A block of at least ``nbytes`` (rounded up to 64), or None if no free span fits."""
        if nbytes <= 0:
            raise ValueError(f"block size must be positive, got {nbytes}")
        size = align_up(nbytes)
        for i, (off, span) in enumerate(self._free):
            if span >= size:
                if span == size:
                    del self._free[i]
                else:
                    self._free[i] = (off + size, span - size)
                self._used[off] = size
                self._used_bytes += size
                return Block(off, size)
        return None

    def free(self, block: Block) -> None:
        """Return a block; it merges with the free spans around it."""
        if self._used.get(block.offset) != block.nbytes:
            raise ValueError(f"{block} is not a live block of this arena (double free?)")
        del self._used[block.offset]
        self._used_bytes -= block.nbytes
        off, size = block.offset, block.nbytes
        i = bisect.bisect_left(self._free, (off, 0))
        if i < len(self._free) and off + size == self._free[i][0]:  # merge with the next
            size += self._free.pop(i)[1]
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == off:  # and the previous
            prev_off, prev_size = self._free[i - 1]
            self._free[i - 1] = (prev_off, prev_size + size)
        else:
            self._free.insert(i, (off, size))

    def free_spans(self) -> list[tuple[int, int]]:
        """(offset, size) of every free span, by offset (tests, stats)."""
        return list(self._free)

    def regions(
        self, block: Block, specs: Sequence[TensorSpec], n: int, n_cuts: int = 1
    ) -> dict[str, Region]:
        """Each spec laid out in ``block`` with its token axis sized ``n`` (a state's cut
        axis ``n_cuts``), in order."""
        if self._used.get(block.offset) != block.nbytes:
            raise ValueError(f"{block} is not a live block of this arena")
        need = layout_bytes(specs, n, n_cuts)
        if need > block.nbytes:
            raise ValueError(f"{n} tokens of this layout need {need} bytes, {block} is smaller")
        out: dict[str, Region] = {}
        off = block.offset
        for s in specs:
            out[s.name] = Region(self.segment.name, off, s.shape_for(n, n_cuts), s.dtype)
            off += align_up(s.nbytes(n, n_cuts))
        return out

    def views(
        self, block: Block, specs: Sequence[TensorSpec], n: int, n_cuts: int = 1
    ) -> dict[str, np.ndarray]:
        """Numpy views (no copy) of ``regions``; bfloat16 tensors are uint16 bits."""
        regions = self.regions(block, specs, n, n_cuts)
        return {k: view(self.segment, r) for k, r in regions.items()}

    def close(self) -> None:
        """Unlink and unmap the segment (attached workers keep their mapping until they unmap)."""
        self._owner.unlink(self.segment)
        self.segment.close()
