"""The prefix cache's disk tier as K/V blocks by prefix key (cache/block_files.py), for an
attention-only model whose workers are all local, without KV Flash: a prompt outlives the
daemon one pool block at a time, and comes back as a page-in, not an import of copies.

    save     after a prompt's prefill, its whole blocks not on disk in every worker's part
             yet: each copied from the lane's pool block into a free host record
             (`BlockTables.save`, one `kv_page` to the workers); then one background writer
             (a task, the blocking I/O in a thread, one block at a time, never in the way
             of the token stream) writes each worker's bytes of the record to its part
             (`HostRecords.arrays[k]` row r) and releases the record
    match    the keys of the prompt's whole blocks found in every part from its first one,
             leaving at least one prompt token to compute
    restore  free host records filled from the files (a thread), adopted by the new
             sequence's empty table as PAGED entries (`BlockTables.adopt`, one `kv_page`
             with their token ids): its first span pages them in (`ModelRunner._page_in`),
             so its rows are the saved ones, byte for byte, and restored == fresh

Parts: one `BlockFiles` per pipeline worker, named for what its record's bytes depend on
(`part_name`: the block, the K/V dtype, the worker's layers, and a hash of its devices,
shard split, compute dtype and weights), all under the model directory's lock, which the
first part holds. Each part keeps at most its share of `--kv-cache-budget`, by record size.

Records: the tables' host records, shared with the kept lanes (`store_records` were added
for the store). A save takes what is free, fewer blocks (in prefix order) or none when they
run short; a restore restores fewer blocks.

A file that fails its checks is quarantined by `BlockFiles`; a restore stops before it. A
write the OS refuses (a full disk) pauses writing (cache/backoff.py) with one warning; the
writes skipped meanwhile release their records.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from luced.cache.backoff import DiskBackoff
from luced.cache.block_files import ROOT_KEY, BlockFileError, BlockFiles, prompt_keys
from luced.cache.files import QUARANTINE, SnapshotDirError, model_dir_name, real_dir
from luced.engine.kv.blocks import PAGED
from luced.engine.placement import WorkerPlan
from luced.engine.target import Target

log = logging.getLogger(__name__)

_SHORT_DTYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}
OLD_SUFFIX = ".safetensors"  # snapshot files (cache/disk.py), which blocks replace


@dataclass(frozen=True)
class _Write:
    key: bytes
    parent: bytes
    tokens: tuple[int, ...]
    record: int  # held by the store until written


class BlockStore:
    """A target's blocks on disk (the module docstring); `cache.prefix_cache.BlockTier`."""

    def __init__(
        self, target: Target, parts: Sequence[BlockFiles], clock: Callable[[], float] = time.time
    ) -> None:
        """parts: one per pipeline worker, in order (`HostRecords.arrays[k]`'s layout)."""
        tables, host = target.blocks, target.host
        if tables is None or host is None or len(parts) != len(host.arrays):
            raise ValueError("a block store needs the target's host records, a part per worker")
        self.target = target
        self.parts = list(parts)
        self.block = tables.block
        self.writes = self.write_errors = self.restore_errors = 0
        self.backoff = DiskBackoff(log, "K/V blocks; they are not kept", clock)
        self._queue: deque[_Write] = deque()
        self._pending: set[bytes] = set()  # keys queued or being written
        self._writer: asyncio.Task[None] | None = None

    @classmethod
    async def open(
        cls,
        target: Target,
        root: str | Path,
        fingerprint: str,
        budget: int,
        lock_fd: int | None = None,
    ) -> BlockStore:
        """The store of `target` (started) in `root` (--kv-cache-dir) for the model named by
        `fingerprint`, at most `budget` bytes (--kv-cache-budget); `lock_fd`: the model
        directory's lock, owned from here on. Snapshot files of the model move to its
        quarantine/ (one log line), then every part is scanned (a thread). OSError or
        SnapshotDirError when the directory cannot be used (the lock released)."""
        host = target.host
        assert host is not None and target.blocks is not None
        sizes = [int(a.shape[1]) for a in host.arrays]
        parts: list[BlockFiles] = []
        try:
            for (_, plan), size in zip(target.placement.workers, sizes, strict=True):
                share = budget * size // max(1, sum(sizes))
                part = part_name(target, plan)
                fd, lock_fd = lock_fd, None  # the first part holds the lock
                parts.append(
                    BlockFiles(
                        root, fingerprint, part, size, target.blocks.block, share, lock_fd=fd
                    )
                )
            await asyncio.to_thread(retire_snapshots, Path(root) / model_dir_name(fingerprint))
            for p in parts:
                await asyncio.to_thread(p.scan)
        except BaseException:
            for p in parts:
                p.close()
            if lock_fd is not None:
                os.close(lock_fd)
            raise
        return cls(target, parts)

    # -- the engine's calls -----------------------------------------------------------------

    def match(self, prompt: Sequence[int]) -> list[bytes]:
        """The keys of `prompt`'s whole blocks on disk in every part, from its first one,
        leaving at least one token to compute (the model must produce logits)."""
        limit = (len(prompt) - 1) // self.block
        if limit <= 0:
            return []
        return min((p.chain(prompt, limit) for p in self.parts), key=len)

    async def restore(self, slot: int, prompt: Sequence[int], keys: Sequence[bytes]) -> int:
        """Start the empty `slot` on the blocks `keys` (`match`'s): read into free host
        records, which its table adopts; as many as there are records for, up to the first
        bad file. -> the positions restored (its first span pages them in). A worker's
        refusal resets the slot and raises."""
        t = self.target
        tables, host = t.blocks, t.host
        assert tables is not None and host is not None
        n = min(len(keys), tables.free_records)
        if n < len(keys):
            log.debug(
                "prefix cache: %d of %d blocks restored: host records are short", n, len(keys)
            )
        if not n:
            return 0
        records = [tables.hold_record() for _ in range(n)]
        try:
            good = await asyncio.to_thread(self._read, keys[:n], records)
            if good < n:
                self.restore_errors += 1
            if not good:
                return 0
            moves = tables.adopt(slot, records[:good])
            try:
                await host.page(t.executor, slot, moves, prompt[: good * self.block])
            except BaseException:
                with contextlib.suppress(Exception):
                    await t.reset(slot)  # its table (the adopted records) and the workers'
                raise
        finally:
            for record in records:
                tables.release_record(record)
        return good * self.block

    async def save(self, slot: int, prompt: Sequence[int]) -> int:
        """Copy `slot`'s blocks of `prompt`'s whole blocks that are not on disk yet into
        free host records (as many as are free, in prefix order) and queue them for the
        writer. -> the blocks queued."""
        t = self.target
        tables, host = t.blocks, t.host
        assert tables is not None and host is not None
        if not self.backoff.ready():
            return 0
        keys = prompt_keys(prompt, self.block, tables.length(slot))
        todo = [
            j
            for j, key in enumerate(keys)
            if key not in self._pending
            and not all(p.has(key) for p in self.parts)
            and tables.entry(slot, j) != PAGED
        ]
        if len(todo) > tables.free_records:
            log.debug(
                "prefix cache: %d of %d new blocks saved: host records are short",
                tables.free_records,
                len(todo),
            )
            todo = todo[: tables.free_records]
        if not todo:
            return 0
        moves = [tables.save(slot, j) for j in todo]
        try:
            await host.page(t.executor, slot, moves)
        except BaseException as exc:
            for m in moves:
                tables.release_record(m.record)
            if not isinstance(exc, Exception):
                raise
            log.warning("prefix cache: saving %d blocks failed: %s", len(moves), exc)
            return 0
        b = self.block
        for m in moves:
            j, key = m.index, keys[m.index]
            self._pending.add(key)
            tokens = tuple(int(x) for x in prompt[j * b : (j + 1) * b])
            self._queue.append(_Write(key, keys[j - 1] if j else ROOT_KEY, tokens, m.record))
        if self._writer is None or self._writer.done():
            self._writer = asyncio.get_running_loop().create_task(self._write_queued())
        return len(moves)

    # -- BlockTier: the prefix cache's view -----------------------------------------------

    @property
    def error(self) -> str | None:
        return self.backoff.error

    def counts(self) -> tuple[int, int]:
        """(blocks on disk, the bytes of every part's files)."""
        return max(len(p) for p in self.parts), sum(p.used_bytes for p in self.parts)

    async def clear(self) -> int:
        """Delete every block file after the pending writes; -> the blocks deleted."""
        await self.flush()
        return max(await asyncio.gather(*(asyncio.to_thread(p.clear) for p in self.parts)))

    async def flush(self) -> None:
        while self._writer is not None and not self._writer.done():
            with contextlib.suppress(Exception):
                await asyncio.shield(self._writer)

    async def close(self) -> None:
        await self.flush()
        for p in self.parts:
            p.close()

    # -- internals ------------------------------------------------------------------------

    def _read(self, keys: Sequence[bytes], records: Sequence[int]) -> int:
        """Fill `records` with the blocks `keys`, every part's bytes (a thread); -> how many
        were read before the first bad file (quarantined by its part)."""
        host = self.target.host
        assert host is not None
        for i, (key, record) in enumerate(zip(keys, records, strict=True)):
            try:
                for part, rows in zip(self.parts, host.arrays, strict=True):
                    part.read_into(key, memoryview(rows[record]))
            except BlockFileError as exc:
                log.info("prefix cache: %d of %d blocks restored: %s", i, len(keys), exc)
                return i
            for part in self.parts:
                part.touch(key)
        return len(keys)

    def _write(self, w: _Write) -> None:
        host = self.target.host
        assert host is not None
        for part, rows in zip(self.parts, host.arrays, strict=True):
            part.write(w.parent, w.tokens, rows[w.record])

    async def _write_queued(self) -> None:
        tables = self.target.blocks
        assert tables is not None
        while self._queue:
            w = self._queue.popleft()
            try:
                if self.backoff.ready():
                    await asyncio.to_thread(self._write, w)
                    self.writes += 1
                    self.backoff.works()
            except OSError as exc:
                self.write_errors += 1
                self.backoff.failed(exc)
            except Exception:
                self.write_errors += 1
                log.exception("prefix cache: writing a K/V block to disk failed")
            finally:
                self._pending.discard(w.key)
                tables.release_record(w.record)


def part_name(target: Target, plan: WorkerPlan) -> str:
    """One worker's part of the blocks: "b16-bf16-L0-15-1a2b3c4d", the pool's block, the
    K/V dtype, its layers, and a hash of the rest that a record's bytes depend on (its
    devices and shard split, the compute dtype, how weights are held)."""
    p = target.placement
    kv = p.kv_dtype or p.dtype
    a, b = plan.layers
    rest = (plan.devices, plan.shard_ranges(), p.dtype, p.weights_mode, p.batch_invariant)
    digest = hashlib.sha256(repr(rest).encode()).hexdigest()[:8]
    block = p.kv_block
    return f"b{block}-{_SHORT_DTYPES.get(kv, kv)}-L{a}-{b}-{digest}"


def retire_snapshots(model_dir: Path) -> int:
    """Move the model's snapshot files (one safetensors file per prompt, cache/disk.py)
    into its quarantine/: blocks replace them. One log line; -> how many."""
    with os.scandir(model_dir) as it:
        old = [e for e in it if e.name.endswith(OLD_SUFFIX) and e.is_file(follow_symlinks=False)]
    if not old:
        return 0
    qdir = model_dir / QUARANTINE
    moved, problem = 0, ""
    try:
        real_dir(qdir, create=True)  # never through a symlink
        for entry in old:
            dest = qdir / entry.name
            i = 1
            while os.path.lexists(dest):
                dest = qdir / f"{entry.name}.{i}"
                i += 1
            os.replace(entry.path, dest)
            moved += 1
    except (OSError, SnapshotDirError) as exc:  # left where they are: never read again
        problem = f"; {len(old) - moved} left in place: {exc}"
    log.warning(
        "prefix cache: %d snapshot files of the older format moved to %s (this model keeps "
        "K/V blocks on disk now)%s",
        moved,
        qdir,
        problem,
    )
    return moved
