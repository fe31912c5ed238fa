"""The daemon's prefix cache as operators see it: built from the config, served to lucectl.

    cache = await open_prefix_cache(cfg.kv, cfg.model.dtype, target, owner, model_path, template)
    handlers = snapshot_handlers(engine_of)   # admin verbs; engine_of(args) -> the Engine

A file of the disk tier is only restored by a daemon with the same identity: the same
model file (fingerprint: size + SHA-256 of its first and last MiB, which hold the GGUF
header, tensor table and the end of the weights, so that no multi-GB read is needed at
start), the same chat template (cut points depend on it), the same placement (devices and
layer ranges) and the same KV dtype.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from luced.api.status import snapshot_rows
from luced.cache.arena import SnapshotArena
from luced.cache.disk import (
    DiskIdentity,
    SnapshotDirBusy,
    SnapshotDirError,
    SnapshotDisk,
    lock_model_dir,
)
from luced.cache.prefix_cache import PrefixCache
from luced.engine.core import Engine
from luced.engine.kv.block_store import BlockStore
from luced.engine.target import Target
from luced.ipc.shm import SHM_DIR, ShmOwner, shm_room
from luced.serve.admin import CommandError, arg_bool, arg_str
from luced.serve.config import KVOptions

log = logging.getLogger(__name__)

_EDGE = 1 << 20  # bytes hashed at each end of the model file


def model_fingerprint(path: str | Path) -> str:
    p = Path(path)
    size = p.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with p.open("rb") as f:
        h.update(f.read(_EDGE))
        if size > _EDGE:
            f.seek(max(_EDGE, size - _EDGE))
            h.update(f.read(_EDGE))
    return h.hexdigest()[:32]


def placement_key(target: Target) -> str:
    """Shards in layer order: `cpu[0,15);cpu:1[15,30)`."""
    shards = []
    for _, plan in target.placement.workers:  # the pipeline (a draft's own worker is not one)
        for device, (a, b) in zip(plan.devices, plan.shard_ranges(), strict=True):
            shards.append(f"{device}[{a},{b})")
    return ";".join(shards)


def arena_bytes(wanted: int, shm_dir: Path = SHM_DIR) -> int:
    """The arena size to create: `wanted`, capped at half of the free space in /dev/shm
    (`shm_room`: a write past what tmpfs holds would kill the daemon with SIGBUS)."""
    room = shm_room(shm_dir)
    if wanted > room:
        log.warning(
            "prefix cache: --prefix-cache-bytes %d MiB exceeds half of the free space in %s; "
            "using %d MiB (enlarge %s to cache more)",
            wanted >> 20,
            shm_dir,
            room >> 20,
            shm_dir,
        )
        return room
    return wanted


class DiskReservation:
    """The disk tier's directory, locked before the slow model load so that a second daemon
    on the same directory and model is refused at once; or why it cannot be used."""

    def __init__(self, lock_fd: int | None = None, problem: str | None = None) -> None:
        self.lock_fd = lock_fd
        self.problem = problem

    def take(self) -> int | None:
        fd, self.lock_fd = self.lock_fd, None
        return fd

    def release(self) -> None:
        if (fd := self.take()) is not None:
            os.close(fd)


def reserve_disk_dir(kv: KVOptions, model_path: str) -> DiskReservation:
    """Lock DIR/<model fingerprint>/ of --kv-cache-dir. ValueError naming the option when
    another daemon holds it; any other failure is a warning and the memory tier only."""
    if kv.kv_cache_dir is None or kv.prefix_cache_bytes <= 0:
        return DiskReservation()
    try:
        return DiskReservation(lock_model_dir(kv.kv_cache_dir, model_fingerprint(model_path)))
    except SnapshotDirBusy as exc:
        raise ValueError(f"{kv.label('kv_cache_dir')}: {exc}") from exc
    except (OSError, SnapshotDirError) as exc:
        return _unusable(kv, exc)


def _unusable(kv: KVOptions, exc: Exception) -> DiskReservation:
    problem = f"{kv.kv_cache_dir}: {exc}"
    log.warning(
        "prefix cache: %s cannot be used (%s); serving with the memory tier only",
        kv.label("kv_cache_dir"),
        problem,
    )
    return DiskReservation(problem=problem)


async def open_prefix_cache(
    kv: KVOptions,
    dtype: str,
    target: Target,
    owner: ShmOwner,
    model_path: str,
    template: Any,
    reservation: DiskReservation | None = None,
    arena: str = "prefix-arena",
) -> PrefixCache | None:
    """The prefix cache the KV options ask for (None: --prefix-cache-bytes 0), for a model
    computed in ``dtype``: K/V blocks by prefix key where the target keeps them
    (`uses_blocks`: in its host records and --kv-cache-dir), else snapshots in the
    shared-memory segment named ``arena`` (and their files). A directory that cannot be
    used is a warning (memory tier only, `lucectl status` says why); one held by another
    daemon is a ValueError naming the option."""
    if kv.prefix_cache_bytes <= 0:
        return None
    if target.recurrent:
        log.info(
            "prefix cache: exact-cut mode for %s: its recurrent layers' state is saved at "
            "%s, and only there can a prompt be restored",
            Path(model_path).name,
            "block ends (turn starts, each prompt's last whole block)"
            if uses_blocks(target)
            else "each prompt's end and turn starts",
        )
    if reservation is None:
        reservation = reserve_disk_dir(kv, model_path)
    layout = await target.kv_layout()
    disk, blocks = None, None
    problem = reservation.problem
    t0 = time.monotonic()
    if uses_blocks(target):
        if kv.kv_cache_dir is not None and problem is None:
            try:
                blocks = await BlockStore.open(
                    target,
                    kv.kv_cache_dir,
                    model_fingerprint(model_path),
                    kv.kv_cache_budget,
                    reservation.take(),
                )
            except (OSError, SnapshotDirError) as exc:
                problem = _unusable(kv, exc).problem
        blocks = blocks or BlockStore(target)  # no disk: the memory tier only
    elif kv.kv_cache_dir is not None and problem is None:
        source = getattr(template, "source", "") or ""
        identity = DiskIdentity(
            fingerprint=model_fingerprint(model_path),
            template_hash=hashlib.sha256(source.encode()).hexdigest()[:32],
            placement=placement_key(target),
            dtype=dtype if kv.row_dtype(dtype) == dtype else f"{dtype}, kv {kv.row_dtype(dtype)}",
        )
        try:
            disk = SnapshotDisk(kv.kv_cache_dir, identity, layout, lock_fd=reservation.take())
        except SnapshotDirBusy as exc:
            raise ValueError(f"{kv.label('kv_cache_dir')}: {exc}") from exc
        except (OSError, SnapshotDirError) as exc:
            problem = _unusable(kv, exc).problem
    arena_segment = None
    if blocks is None:
        arena_segment = SnapshotArena(owner, arena_bytes(kv.prefix_cache_bytes), arena)
    exact = bool(target.recurrent)
    on_disk = disk is not None or (blocks is not None and blocks.on_disk)
    try:
        cache = PrefixCache(
            layout,
            arena_segment,
            disk,
            disk_budget=kv.kv_cache_budget if on_disk else None,
            exact_cuts=exact,
        )
    except OSError as exc:  # the scan could not list the directory
        assert disk is not None
        disk.close()
        disk, problem = None, _unusable(kv, exc).problem
        cache = PrefixCache(layout, arena_segment, None, exact_cuts=exact)
    cache.disk_problem = problem
    cache.blocks = blocks
    _log_opened(kv, cache, time.monotonic() - t0)
    return cache


def _log_opened(kv: KVOptions, cache: PrefixCache, took: float) -> None:
    stats = cache.stats()
    memory = f"{stats.memory_capacity >> 20} MiB arena"
    if cache.blocks is not None:
        memory = f"K/V blocks, {stats.memory_capacity >> 20} MiB of host records"
    on_disk = ""
    if cache.disk is not None:
        on_disk = f"; {stats.disk_entries} snapshot(s) ({stats.disk_bytes >> 20} MiB) on disk"
    elif cache.blocks is not None and cache.blocks.on_disk:
        on_disk = f"; {stats.disk_blocks} K/V blocks ({stats.disk_block_bytes >> 20} MiB) on disk"
    log.info(
        "prefix cache: %s%s",
        memory,
        f"{on_disk} in {kv.kv_cache_dir}, indexed in {took:.2f} s" if on_disk else "",
    )


def uses_blocks(target: Target) -> bool:
    """Whether the prefix cache keeps K/V blocks by prefix key (`BlockStore`: host records
    and block files; a hybrid's recurrent states and a draft's feature-ring rows beside
    them) rather than snapshots (the arena and snapshot files): the target was given
    records for it (`ModelSpec.block_store`)."""
    return target.store_records > 0 and target.host is not None


def snapshot_handlers(engine_of: Callable[[dict], Engine]) -> dict[str, Callable]:
    """Admin verbs: snapshot_list, snapshot_drop, snapshot_save, cache_clear, each on the
    prefix cache of the engine that ``engine_of(request)`` picks (its `model` argument)."""

    def cache(req: dict) -> PrefixCache:
        c = engine_of(req).prefix_cache
        if c is None:
            raise CommandError("the prefix cache is off (--prefix-cache-bytes 0) or not loaded")
        return c

    async def snapshot_list(req: dict) -> dict:
        engine = engine_of(req)
        c = engine.prefix_cache
        reply: dict[str, Any] = {"snapshots": snapshot_rows(c, engine.tokenizer)}
        if c is not None and c.blocks is not None:  # prompts kept as blocks, not snapshots
            counts = c.blocks.counts()
            reply["blocks"] = {"memory": counts.memory, "disk": counts.disk}
        return reply

    async def snapshot_drop(req: dict) -> dict:
        entry_id = arg_str(req, "id")
        if not await cache(req).drop(entry_id):
            raise CommandError(f"no snapshot {entry_id!r} (see `lucectl snapshot list`)")
        return {"dropped": entry_id}

    async def snapshot_save(req: dict) -> dict:
        c = cache(req)
        if c.disk is None and (c.blocks is None or not c.blocks.on_disk):
            raise CommandError("no disk tier: start luced with --kv-cache-dir DIR")
        return {"saved": await c.save_all()}

    async def cache_clear(req: dict) -> dict:
        cleared = await cache(req).clear(disk=arg_bool(req, "disk"))
        # Finished requests' blocks kept in the pool go too: nothing is reused after.
        return {"cleared": cleared, "kept_dropped": engine_of(req).drop_kept()}

    return {
        "snapshot_list": snapshot_list,
        "snapshot_drop": snapshot_drop,
        "snapshot_save": snapshot_save,
        "cache_clear": cache_clear,
    }
