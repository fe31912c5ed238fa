"""KV Flash across processes: the `qk` scores in daemon-owned shared memory, and the
pool's sizing.

KV Flash is an eviction policy over the daemon's block tables (`engine/kv/pager.py`):
each lane's pager pages its blocks out to host records and back in, and a forward span
carries those moves (`Span.moves`) beside its table's growth; every worker of the target
(every shard of a split) runs them on its own pool, through its host records
(engine/kv/host.py, `<name>-kvhost`). Segment (created by the daemon, attached by the
workers, unlinked by the daemon):

    <name>-kvflash  scores  float32 [lanes·2·workers, keys]  lane l, worker k: rows
                                                      2(l·workers + k) and the next: per
                                                      block the sum over the worker's
                                                      layers of its best cosine, and the
                                                      layer count

Scores (policy `qk`): when a lane's reselection is due, its span names the worker's rows
of `scores` (`Span.kv_scores`); each worker writes them after its layers ran, and after
the last reply the daemon gives the lane's pager their mean over all layers
(`FlashRegions.mean_scores`): the reselection runs at the start of its next plan, so its
moves ride with that span.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from luced.engine.kv.pager import PagerConfig
from luced.gguf_file import GGUFFile
from luced.ipc.regions import Region, RegionAllocator, required_bytes, view
from luced.ipc.shm import ShmOwner

POOL_ROUND = 256  # a pool is rounded up to a multiple of this many tokens
MOVE_KIND = {"out": 0, "in": 1}


@dataclass(frozen=True)
class KVFlashSettings:
    """What the operator asked for (`--kv-flash`, `--kv-flash-policy`, `--kv-flash-tau`,
    `--kv-flash-max-pool`); `resolve_pool` turns `pool` into rows."""

    pool: int | str  # tokens, or "auto"
    policy: str = "qk"
    tau: int = 64
    max_pool: int = 16384

    def __post_init__(self) -> None:
        if self.pool != "auto" and not (isinstance(self.pool, int) and self.pool > 0):
            raise ValueError(f"KV Flash pool must be a positive token count or auto: {self.pool!r}")


def resolve_pool(
    settings: KVFlashSettings,
    context: int,
    bytes_per_token: int,
    free_bytes: int | None = None,
    block: int = 64,
) -> int:
    """Pool rows: `auto` = min(half the free memory / bytes per token, context, max_pool);
    then rounded up to a multiple of 256 and clamped to the context (rounded up to a block)."""
    if settings.pool == "auto":
        free = available_memory() if free_bytes is None else free_bytes
        tokens = min(free // 2 // max(1, bytes_per_token), context, settings.max_pool)
    else:
        tokens = int(settings.pool)
    tokens = max(POOL_ROUND, math.ceil(tokens / POOL_ROUND) * POOL_ROUND)
    return min(tokens, math.ceil(context / block) * block)


def available_memory() -> int:
    """MemAvailable from /proc/meminfo (bytes); 1 GiB when unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 1 << 30


class FlashRegions:
    """The `qk` scores of every running lane, in daemon-owned shared memory (the module
    docstring's segment)."""

    def __init__(
        self,
        owner: ShmOwner,
        name: str,
        lanes: int,  # the running slots: only they are paged
        keys: int,  # blocks of a context: the scores' width
        workers: int,
    ) -> None:
        self.workers = workers
        self.lanes = lanes
        specs = {"scores": ([lanes * 2 * self.workers, keys], "float32")}
        self.regions, self.arrays = _carve(owner, f"{name}-kvflash", specs)

    def scores(self, lane: int, worker: int) -> Region:
        """Where `worker` writes `lane`'s scores: float32 [2, keys] (sums, layer counts)."""
        row = (lane * self.workers + worker) * 2
        return self.regions["scores"].rows(row, row + 2)

    def mean_scores(self, lane: int) -> dict[int, float]:
        """`lane`'s scores over every layer of every worker, as the pager takes them."""
        rows = self.arrays["scores"][lane * 2 * self.workers : (lane + 1) * 2 * self.workers]
        return mean_scores(rows[0::2], rows[1::2])


def mean_scores(sums: np.ndarray, counts: np.ndarray) -> dict[int, float]:
    """The `qk` scores of `Pager.score` from the workers' replies: sums and counts
    [workers, blocks] (each worker's sum over its layers of a block's best cosine, and how
    many layers scored it) -> block -> mean over every layer; blocks no layer scored are
    left out (the pager counts them unscored)."""
    total, n = np.asarray(sums).sum(0), np.asarray(counts).sum(0)
    return {int(c): float(total[c] / n[c]) for c in np.flatnonzero(n > 0)}


def _carve(
    owner: ShmOwner, name: str, specs: dict[str, tuple[list[int], str]]
) -> tuple[dict[str, Region], dict[str, np.ndarray]]:
    segment = owner.create(name, required_bytes(specs.values()))
    alloc = RegionAllocator.for_segment(segment)
    regions, arrays = {}, {}
    for key, (shape, dtype) in specs.items():
        regions[key] = alloc.alloc(key, shape, dtype)
        arrays[key] = view(segment, regions[key])
    return regions, arrays


def pager_config(settings: KVFlashSettings, pool: int, gguf: GGUFFile) -> PagerConfig:
    """The pager for a model: its widest sliding window widens the protected tail."""
    window = int(gguf.get(f"{gguf.arch}.attention.sliding_window", 0) or 0)
    return PagerConfig(
        pool_tokens=pool,
        sliding_window=window,
        policy=settings.policy,  # type: ignore[arg-type]
        tau=settings.tau,
    )


def model_bytes_per_token(gguf: GGUFFile, dtype_bytes: int) -> int:
    """K and V of one position over the pooled layers, from the GGUF header."""
    return 2 * dtype_bytes * sum(heads * dim for heads, dim in kv_layer_shapes(gguf).values())


def kv_layer_shapes(gguf: GGUFFile) -> dict[int, tuple[int, int]]:
    """(KV heads, head dim) of each layer that keeps K/V rows of its own, as the workers
    allocate them: not a KV-sharing layer (it reads its source's) nor a recurrent one
    (qwen35's DeltaNet: every layer but each `full_attention_interval`th). Head counts
    may be per layer (laguna's query heads, Gemma 4's KV heads); a sliding layer's head
    dim is `key_length_swa` where the file has one (Gemma 4)."""
    arch = gguf.arch
    heads = gguf.layer_counts("attention.head_count")
    kv_heads = gguf.layer_counts("attention.head_count_kv", heads)
    dim = gguf.get(f"{arch}.attention.key_length")
    dim = int(dim) if dim else int(gguf.require(f"{arch}.embedding_length")) // heads[0]
    swa_dim = int(gguf.get(f"{arch}.attention.key_length_swa", dim))
    sliding = gguf.sliding_layers() if swa_dim != dim else (False,) * len(heads)
    interval = int(gguf.get(f"{arch}.full_attention_interval", 1))
    shared = gguf.kv_sources()
    return {
        i: (kv_heads[i], swa_dim if sliding[i] else dim)
        for i in range(len(heads))
        if (i + 1) % interval == 0 and i not in shared
    }


def bytes_per_token(n_layers: int, n_kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """K and V of one position over every layer (for sizing `auto`)."""
    return 2 * n_layers * n_kv_heads * head_dim * dtype_bytes


__all__ = [
    "FlashRegions",
    "KVFlashSettings",
    "available_memory",
    "bytes_per_token",
    "kv_layer_shapes",
    "mean_scores",
    "model_bytes_per_token",
    "pager_config",
    "resolve_pool",
]
