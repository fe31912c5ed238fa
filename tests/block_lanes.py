"""Paged caches driven as a worker drives them: by the daemon's block tables
(engine/kv/blocks.py), whose growth every write follows first, as a forward span brings it."""

from __future__ import annotations

import torch

from luced.engine.kv.blocks import BlockTables
from luced.runtime.kv_blocks import PagedKVCache
from luced.runtime.model import Model


class Lanes:
    """The daemon's tables over one worker pool: each cache made here is a lane, and its
    writes, shares, truncations, imports and frees change both sides alike."""

    def __init__(self, model: Model, block: int, initial_blocks: int = 64, n_blocks: int = 64):
        self.model = model
        self.tables = BlockTables(n_blocks, block)
        self.pool = model.new_block_pool(block, initial_blocks, max_blocks=n_blocks)
        self.lanes: dict[int, int] = {}

    def cache(self, capacity: int = 256) -> PagedKVCache:
        c = self.model.new_paged_cache(self.pool, capacity)
        self.lanes[id(c)] = len(self.lanes)
        DRIVERS[id(c)] = self
        return c

    def lane(self, c: PagedKVCache) -> int:
        return self.lanes[id(c)]

    def write(self, c: PagedKVCache, start: int, n: int) -> None:
        grown = self.tables.write(self.lane(c), start, start + n)
        c.follow(grown.copies, grown.blocks)
        assert c.table == list(self.tables.table(self.lane(c)))

    def share(self, c: PagedKVCache, source: PagedKVCache, n: int) -> int:
        self.tables.share(self.lane(c), self.lane(source), n)
        return c.share(source, n)

    def truncate(self, c: PagedKVCache, n: int) -> None:
        self.tables.truncate(self.lane(c), n)
        c.truncate(n)
        c.release_past(n)

    def free(self, c: PagedKVCache) -> None:
        self.tables.free(self.lane(c))
        c.free()

    def step(self, caches: list[PagedKVCache], sizes: list[int] | None = None) -> None:
        """Each cache's next position (or its next sizes[i], a window): a step's growth."""
        for i, c in enumerate(caches):
            self.write(c, c.pos, 1 if sizes is None else sizes[i])

    def import_rows(self, c: PagedKVCache, n: int, rows: dict) -> None:
        self.tables.free(self.lane(c))
        c.import_rows(n, rows, None, self.tables.grow(self.lane(c), n))


DRIVERS: dict[int, Lanes] = {}  # a paged cache's id -> the tables it follows


def forward(model: Model, tokens: torch.Tensor, cache, start: int) -> torch.Tensor:
    """`model.forward`, a paged cache following its tables' growth first."""
    if isinstance(cache, PagedKVCache):
        DRIVERS[id(cache)].write(cache, start, len(tokens))
    return model.forward(tokens, cache, start)


def forward_batch(model: Model, feeds: list, caches: list, starts: list) -> list:
    for f, c, p in zip(feeds, caches, starts, strict=True):
        if isinstance(c, PagedKVCache):
            DRIVERS[id(c)].write(c, p, len(f))
    return model.forward_batch(feeds, caches, starts)
