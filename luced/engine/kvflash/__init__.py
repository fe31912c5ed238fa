"""KV Flash: bounded KV residency, as an eviction policy over the daemon's block tables.

../kv/pager.py  Pager: one running sequence's resident bound over its block table:
                protection, eviction, recall (reselection), the host records it pages
                out to (BlockTables.page_out / page_in)
transport.py    the host tier and the qk scores in shared memory; the pool's sizing
"""

from luced.engine.kv.pager import Pager, PagerConfig, PagerStats, PoolExhausted, PoolTooSmall

__all__ = ["Pager", "PagerConfig", "PagerStats", "PoolExhausted", "PoolTooSmall"]
