"""KV Flash across processes: the pager's plan and the host tier in daemon-owned shared memory.

The daemon's `Pager` decides; every worker of the target (every shard of a split) runs
the same plan. Per forward the daemon writes the plan into its `kvflash` segment and
names the regions in the `forward` frame (`kv_slots`, `kv_map`, `kv_moves`, `kv_host`);
nothing of the plan travels as msgpack arrays. Segments (created by the daemon, attached
by the workers, unlinked by the daemon):

    <name>-kvflash  slots   int64 [max_step]        pool row of position start + i
                    map     int64 [pool]            position each row holds, -1 = none
                    moves   int64 [max_moves, 4]    (0 out | 1 in, chunk, block, record)
                    scores  float32 [2·workers, chunks]  worker k's qk scores in rows 2k, 2k+1:
                                                      per chunk the sum over its layers of
                                                      the best cosine, and the layer count
    <name>-kvhost   host-k  uint8 [records, bytes_k]  worker k's host tier: record r at
                                                      row r (the pager's record id), in
                                                      `kv_pool.chunk_nbytes` layout, one
                                                      shard after another

Scores (policy `qk`): when a plan makes a reselection due, every worker's frame names
its rows of `scores` (`kv_scores`); each writes them after its layers ran, and after the
last reply the daemon takes the mean over all layers (`mean_scores`) and reselects: the
copies ride with the next plan.

Write ordering: the daemon writes slots, map and moves before the first worker's frame and
does not touch them until the last worker replied (frames go one at a time). A worker runs
the moves in order (`out` copies a block's rows into its host record, `in` copies a
record back into a block) before its K/V writes, then attends through the map. The host
records are written only by the worker whose layers they hold, read only by it, and live
in the daemon: a worker that dies leaves them intact (a restarted worker starts empty,
so the target resets the sequence anyway; the records outlive the process).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from luced.engine.kvflash.pager import Pager, PagerConfig, StepPlan
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
    chunk: int = 64,
) -> int:
    """Pool rows: `auto` = min(half the free memory / bytes per token, context, max_pool);
    then rounded up to a multiple of 256 and clamped to the context (rounded up to a chunk)."""
    if settings.pool == "auto":
        free = available_memory() if free_bytes is None else free_bytes
        tokens = min(free // 2 // max(1, bytes_per_token), context, settings.max_pool)
    else:
        tokens = int(settings.pool)
    tokens = max(POOL_ROUND, math.ceil(tokens / POOL_ROUND) * POOL_ROUND)
    return min(tokens, math.ceil(context / chunk) * chunk)


def available_memory() -> int:
    """MemAvailable from /proc/meminfo (bytes); 1 GiB when unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 1 << 30


class KVFlash:
    """The target's pager plus the two segments that carry its decisions to the workers."""

    def __init__(
        self,
        owner: ShmOwner,
        name: str,
        cfg: PagerConfig,
        capacity: int,
        max_step: int,
        record_bytes: Sequence[int],  # one host record of each worker, in pipeline order
    ) -> None:
        self.pager = Pager(cfg)
        n_blocks, chunk = cfg.n_blocks, cfg.chunk
        # Moves between two plans: reselection (every block out and in) + one step's chunks.
        self.max_moves = 2 * n_blocks + max_step // chunk + 2
        self.max_step = max_step
        n_records = math.ceil(capacity / chunk)
        specs = {
            "slots": ([max_step], "int64"),
            "map": ([cfg.pool_tokens], "int64"),
            "moves": ([self.max_moves, 4], "int64"),
            "scores": ([2 * len(record_bytes), n_records], "float32"),
        }
        self.regions, self.arrays = _carve(owner, f"{name}-kvflash", specs)
        host = {f"host-{k}": ([n_records, b], "uint8") for k, b in enumerate(record_bytes)}
        self.host_regions, _ = _carve(owner, f"{name}-kvhost", host)
        self.last: StepPlan | None = None
        self.scoring = False  # the last plan asked the workers for qk scores

    @property
    def pool(self) -> int:
        return self.pager.cfg.pool_tokens

    @property
    def step_limit(self) -> int:
        """The longest step that always fits: the sink plus the step's own chunks (which
        cover the tail) in the pool, the step possibly straddling one more chunk."""
        cfg = self.pager.cfg
        return min(self.max_step, (cfg.n_blocks - cfg.sink_chunks - 1) * cfg.chunk)

    def plan(self, start: int, n: int) -> list[dict[str, Region]]:
        """Plan positions [start, start + n), write the plan to shared memory, and return the
        `forward` fields of each worker (same table, its own host records)."""
        if n > self.max_step:
            raise ValueError(f"a KV Flash step of {n} tokens exceeds {self.max_step}")
        plan = self.pager.plan(start, n)  # PoolExhausted changes nothing
        if len(plan.moves) > self.max_moves:
            raise RuntimeError(f"{len(plan.moves)} host-tier moves exceed {self.max_moves}")
        self.last = plan
        self.arrays["slots"][:n] = plan.write_slots
        self.arrays["map"][:] = np.frombuffer(plan.slot_positions, dtype=np.int64)
        m = len(plan.moves)
        fields = {
            "kv_slots": self.regions["slots"].rows(0, n),
            "kv_map": self.regions["map"],
        }
        if m:
            rows = [(MOVE_KIND[mv.kind], mv.chunk, mv.block, mv.record) for mv in plan.moves]
            self.arrays["moves"][:m] = rows
            fields["kv_moves"] = self.regions["moves"].rows(0, m)
        self.scoring = self.pager.reselect_due()
        out = []
        for k, host in enumerate(self.host_regions.values()):
            mine = {**fields, "kv_host": host} if m else dict(fields)
            if self.scoring:
                mine["kv_scores"] = self.regions["scores"].rows(2 * k, 2 * k + 2)
            out.append(mine)
        return out

    def after_step(self) -> None:
        """Every worker ran the last plan: reselect by their scores if it asked for them."""
        if self.scoring:
            self.scoring = False
            scores = self.arrays["scores"]
            self.pager.reselect(mean_scores(scores[0::2], scores[1::2]))

    def truncate(self, position: int) -> None:
        self.pager.truncate(min(position, self.pager.end))

    def reset(self) -> None:
        self.pager.reset()
        self.scoring = False

    def sync_identity(self, n: int) -> None:
        """After a snapshot restore of positions [0, n) into rows [0, n): a fresh pager that
        planned them, i.e. chunk c in block c (n <= pool)."""
        if n > self.pool:
            raise ValueError(f"cannot restore {n} positions into a pool of {self.pool}")
        self.pager.reset()
        for start in range(0, n, self.step_limit):
            self.pager.plan(start, min(self.step_limit, n - start))

    @property
    def is_identity(self) -> bool:
        return self.pager.is_identity and self.pager.end <= self.pool

    def status(self) -> dict:
        s = self.pager.stats()
        return {
            "pool_tokens": s.pool_tokens,
            "policy": self.pager.cfg.policy,
            "resident_chunks": s.resident,
            "paged_out_chunks": s.paged_out,
            "evictions": s.evictions,
            "recalls": s.recalls,
            "host_bytes": s.host_bytes,
        }


def mean_scores(sums: np.ndarray, counts: np.ndarray) -> dict[int, float]:
    """The `qk` scores of `Pager.reselect` from the workers' replies: sums and counts
    [workers, chunks] (each worker's sum over its layers of a chunk's best cosine, and how
    many layers scored it) -> chunk -> mean over every layer; chunks no layer scored are
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
    "KVFlash",
    "KVFlashSettings",
    "available_memory",
    "bytes_per_token",
    "kv_layer_shapes",
    "mean_scores",
    "model_bytes_per_token",
    "pager_config",
    "resolve_pool",
]
