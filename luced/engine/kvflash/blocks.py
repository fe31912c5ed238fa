"""The pool's blocks and one sequence's page table: pure integers, no policy.

```
 logical positions of one sequence      chunk c = pos // 64
 | chunk 0 | chunk 1 | chunk 2 | ... |
      │         │ (paged out:  host record 0)
      ▼         ▼
 PageTable.blocks {0: 2, 2: 0, ...}      chunk -> block, resident chunks only
 PageTable.host   {1: 0}                 chunk -> host record, paged-out chunks only
      │
      ▼
 pool rows (every pooled layer, K and V) slot = block * 64 + pos % 64
 | block 0 | block 1 | block 2 | ... | block n_blocks-1 |
```

A `BlockPool` is shared state (the free list of one pool); a `PageTable` belongs to one
sequence. Today one sequence owns the whole pool; continuous batching gives each running
sequence its own `PageTable` over the same `BlockPool`, and a step's attention for a
sequence reads only the blocks in its own table.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable


class PoolExhausted(RuntimeError):
    """A step needs more blocks than are free or evictable."""


class BlockPool:
    """`n_blocks` fixed blocks of `chunk` rows and their free list.

    Blocks are handed out in free-list order and a released block goes to the back
    (FIFO reuse), so a fresh pool maps chunk c to block c (the identity layout) and block
    ids in tests are predictable. `order` replaces the initial order (relocation tests).
    """

    def __init__(self, n_blocks: int, chunk: int = 64, order: Iterable[int] | None = None) -> None:
        if n_blocks <= 0 or chunk <= 0:
            raise ValueError(f"a pool needs blocks and rows: {n_blocks} blocks of {chunk}")
        self.n_blocks = n_blocks
        self.chunk = chunk
        self._order = list(range(n_blocks)) if order is None else list(order)
        if sorted(self._order) != list(range(n_blocks)):
            raise ValueError(f"block order must be a permutation of 0..{n_blocks - 1}")
        self._free: deque[int] = deque(self._order)
        self._is_free = [True] * n_blocks

    @property
    def rows(self) -> int:
        return self.n_blocks * self.chunk

    @property
    def n_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise PoolExhausted("no free block")
        block = self._free.popleft()
        self._is_free[block] = False
        return block

    def release(self, block: int) -> None:
        if self._is_free[block]:
            raise ValueError(f"block {block} is already free")
        self._is_free[block] = True
        self._free.append(block)

    def reset(self) -> None:
        """Every block free again, in the initial order."""
        self._free = deque(self._order)
        self._is_free = [True] * self.n_blocks


class PageTable:
    """One sequence's chunk -> block map, its paged-out chunks and their last use.

    Invariant: a chunk is in at most one of `blocks` (resident) and `host` (paged out);
    a chunk in neither was never written or has been dropped.
    """

    def __init__(self, chunk: int = 64) -> None:
        self.chunk = chunk
        self.blocks: dict[int, int] = {}  # resident chunk -> block
        self.host: dict[int, int] = {}  # paged-out chunk -> host record
        self.last_use: dict[int, int] = {}  # chunk -> value of the use clock when touched
        self._clock = 0

    def touch(self, chunk: int) -> None:
        self._clock += 1
        self.last_use[chunk] = self._clock

    def slot(self, pos: int) -> int:
        """Pool row of `pos`, whose chunk must be resident."""
        return self.blocks[pos // self.chunk] * self.chunk + pos % self.chunk

    def block_table(self, n_chunks: int) -> list[int]:
        """vLLM's `block_table` row: block of each chunk 0..n_chunks-1, -1 if not resident."""
        return [self.blocks.get(c, -1) for c in range(n_chunks)]

    def clear(self) -> None:
        self.blocks.clear()
        self.host.clear()
        self.last_use.clear()
        self._clock = 0
