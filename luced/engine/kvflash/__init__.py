"""KV Flash: bounded KV residency. The daemon's pager decides which 64-token chunks of a
sequence sit in the workers' fixed pool of K/V rows; the rest wait in a host tier.

    blocks.py  BlockPool (free list of one pool), PageTable (one sequence's chunk -> block)
    pager.py   Pager: protection, eviction, host tier bookkeeping, reselection, StepPlan
"""

from luced.engine.kvflash.blocks import BlockPool, PageTable, PoolExhausted
from luced.engine.kvflash.pager import (
    Move,
    Pager,
    PagerConfig,
    PagerStats,
    PoolTooSmall,
    StepPlan,
)

__all__ = [
    "BlockPool",
    "Move",
    "PageTable",
    "Pager",
    "PagerConfig",
    "PagerStats",
    "PoolExhausted",
    "PoolTooSmall",
    "StepPlan",
]
