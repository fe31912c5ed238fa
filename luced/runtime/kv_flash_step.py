"""A worker's side of a KV Flash step: run the daemon pager's plan on one sequence's pooled
caches (host-tier copies first, then the step's write slots and slot map), and report its
qk scores afterwards. `forward` runs it on each span's sequence with that span's own plan
(`Span.kv_plan`, keys `frames.KV_PLAN`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from luced.ipc.regions import Region
from luced.runtime import kv_qk
from luced.runtime.kv_cache import KVCache
from luced.runtime.kv_pool import PooledKVCache, SharedHostTier, apply_moves, chunk_nbytes
from luced.runtime.state import Loaded, WorkerError, WorkerState

MOVE_KINDS = {0: "out", 1: "in"}  # kv_moves column 0


def pooled(caches: Sequence[KVCache | PooledKVCache]) -> list[PooledKVCache]:
    """The caches of a worker loaded with kv_pool (every one is pooled)."""
    out = []
    for cache in caches:
        if not isinstance(cache, PooledKVCache):
            raise WorkerError("a KV Flash plan for a sequence without a pooled cache")
        out.append(cache)
    return out


def apply_plan(
    worker: WorkerState,
    m: Loaded,
    caches: Sequence[KVCache | PooledKVCache],
    start: int,
    n: int,
    plan: Mapping[str, Region | None],
) -> None:
    """Run `plan`'s host-tier moves, in order, on every shard's cache of one sequence, then
    give each the step's write slots and slot map (the same table for all of them)."""
    if not m.reply.kv_pool:
        if plan.get("kv_slots") is not None:
            raise WorkerError("kv_slots sent to a worker loaded without kv_pool")
        return
    slots_region, map_region = plan.get("kv_slots"), plan.get("kv_map")
    if slots_region is None or map_region is None:
        raise WorkerError("a KV Flash worker needs the pager's plan (kv_slots, kv_map)")
    if map_region.shape[0] != m.reply.kv_pool:
        got, pool = map_region.shape[0], m.reply.kv_pool
        raise WorkerError(f"kv_map of {got} rows for a pool of {pool}")
    if slots_region.shape[0] < n:
        raise WorkerError(f"kv_slots of {slots_region.shape[0]} rows for a step of {n}")
    caches = pooled(caches)
    slots = worker.tensor(slots_region)[:n]
    table = worker.tensor(map_region)
    moves_region, host_region = plan.get("kv_moves"), plan.get("kv_host")
    moves = worker.tensor(moves_region).tolist() if moves_region is not None else []
    if moves:
        assert host_region is not None  # the frame checks it
        if host_region.shape[1] != m.reply.kv_chunk_bytes:
            got, want = host_region.shape[1], m.reply.kv_chunk_bytes
            raise WorkerError(f"host records of {got} bytes, this worker's are {want}")
        records = worker.tensor(host_region)
        offset = 0
        for cache in caches:
            host = SharedHostTier(records, offset, chunk_nbytes(cache))
            apply_moves(cache, [(MOVE_KINDS[k], c, b, r) for k, c, b, r in moves], host)
            offset += host.record_bytes
    for cache in caches:
        cache.set_step(start, slots, table)


def write_scores(caches: Sequence[KVCache | PooledKVCache], out: torch.Tensor) -> None:
    """KV Flash qk: per chunk, the sum over this worker's scored layers of the chunk's best
    cosine with the step's last query (row 0) and how many layers scored it (row 1)."""
    kv_qk.write_scores([cache.qk for cache in pooled(caches)], out)
