"""The prefix cache as K/V blocks by prefix key (cache/block_files.py's keys), for an
attention-only model without KV Flash: its memory tier is host records (engine/kv/host.py)
held by key, its disk tier (with --kv-cache-dir) a file per block and worker; a prompt
comes back as a page-in, not an import of copies.

    save     after a prompt's prefill, its whole blocks not held in memory yet: each
             copied from the lane's pool block into a free host record (`BlockTables.save`,
             one `kv_page` to the workers) that the store keeps by its key; then one
             background writer (a task, the blocking I/O in a thread, one block at a time,
             never in the way of the token stream) writes each worker's bytes of the
             records not on disk yet to its part (`HostRecords.arrays[k]` row r)
    match    the prompt's whole blocks held in memory or on disk in every part, each in
             one or the other, consecutive from its first one, leaving at least one prompt
             token to compute
    restore  the new sequence's empty table adopts the blocks' records (`BlockTables.adopt`,
             one `kv_page` with their token ids): those held in memory as they are, the
             others first read from their files into free records (a thread), kept in
             memory from then on; its first span pages them in (`ModelRunner._page_in`),
             so its rows are the saved ones, byte for byte, and restored == fresh

Memory: at most `capacity` records held (`Target.store_records`: --prefix-cache-bytes over
one record of every worker, at least a context's), the least recently used given up first:
past the capacity, and whenever anyone finds no record free (the tables' `reclaimer`: a
save, a restore, a kept lane paging out). A prompt's blocks are used deepest first, so its
first block, without which no later one is found, goes last. A record given up is still on
disk, or being written (the writer holds it until then); without a disk, or while writes
are paused, it is gone. A record that a table or the writer holds too is never given up.

Parts: one per pipeline worker, named for what its record's bytes depend on (`part_name`:
the block, the K/V dtype, the worker's layers, and a hash of its devices, shard split,
compute dtype and weights). A local worker's is a `BlockFiles` here, under the model
directory's lock, which the first one holds, keeping at most its share of
`--kv-cache-budget` by record size. A worker on another host keeps its own records and
files on its host (engine/kv/remote_blocks.py `RemotePart`: this store's index of them, its
`--kv-cache-dir` and `--kv-cache-budget` there): its bytes are saved to, written from, read
into and adopted from its own mirror of its host records, never the daemon's copy. A record
held before such a worker reconnected is empty there: the store gives up every block it
held then (`HostRecords.epoch`). Without parts (no --kv-cache-dir, or it or a remote
worker's cannot be used) the memory tier is the whole cache.

A file that fails its checks is quarantined by `BlockFiles`; a restore stops before it, and
before a block any worker on another host read no file for: every worker restores the same
blocks, or none. A write the OS refuses (a full disk) pauses writing (cache/backoff.py) with
one warning; the blocks saved meanwhile stay in memory only.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from luced.cache.backoff import DiskBackoff
from luced.cache.block_files import ROOT_KEY, BlockFileError, BlockFiles, prompt_keys
from luced.cache.files import QUARANTINE, SnapshotDirError, model_dir_name, real_dir
from luced.cache.prefix_cache import BlockCounts
from luced.engine.kv.blocks import PAGED, RecordsExhausted
from luced.engine.kv.remote_blocks import RemotePart
from luced.engine.placement import WorkerPlan
from luced.engine.target import Target

log = logging.getLogger(__name__)

_SHORT_DTYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}
OLD_SUFFIX = ".safetensors"  # snapshot files (cache/disk.py), which blocks replace


@dataclass(frozen=True)
class _Held:
    """A block in memory: its record, and what its key was hashed from."""

    parent: bytes
    tokens: tuple[int, ...]
    record: int


class BlockStore:
    """A target's prefix cache of blocks (the module docstring); `BlockTier` to the
    `PrefixCache` and `Reclaimer` to the block tables."""

    def __init__(
        self,
        target: Target,
        parts: Sequence[BlockFiles | RemotePart] = (),
        clock: Callable[[], float] = time.time,
    ) -> None:
        """parts: one per pipeline worker, in order (`HostRecords.arrays[k]`'s layout);
        none: memory only."""
        tables, host = target.blocks, target.host
        if tables is None or host is None or not target.store_records:
            raise ValueError("a block store needs the target's host records for it")
        if parts and len(parts) != len(host.arrays):
            raise ValueError(f"{len(parts)} parts of blocks for {len(host.arrays)} workers")
        self.target = target
        self.tables = tables
        self.parts = list(parts)
        self.block = tables.block
        self.capacity = min(target.store_records, tables.records)
        self.record_bytes = sum(int(a.shape[1]) for a in host.arrays)  # one over every worker
        self.writes = self.write_errors = self.restore_errors = 0
        self.backoff = DiskBackoff(log, "K/V blocks; they stay in memory only", clock)
        self._held: OrderedDict[bytes, _Held] = OrderedDict()  # least recently used first
        # Each record held by the writer, with the epoch it was held in.
        self._queue: deque[tuple[bytes, _Held, int]] = deque()
        self._pending: set[bytes] = set()  # keys queued or being written
        self._writer: asyncio.Task[None] | None = None
        self._epoch = host.epoch  # whose records `_held` are (the module docstring)
        tables.reclaimer = self

    @classmethod
    async def open(
        cls,
        target: Target,
        root: str | Path,
        fingerprint: str,
        budget: int,
        lock_fd: int | None = None,
    ) -> BlockStore:
        """The store of `target` (started) with its disk tier in `root` (--kv-cache-dir)
        for the model named by `fingerprint`, at most `budget` bytes (--kv-cache-budget);
        `lock_fd`: the model directory's lock, owned from here on. Snapshot files of the
        model move to its quarantine/ (one log line), then every part is scanned (a
        thread; a worker on another host lists its own). OSError or SnapshotDirError when
        the directory, or a remote worker's, cannot be used (the lock released)."""
        host = target.host
        assert host is not None and target.blocks is not None
        block = target.blocks.block
        sizes = [int(a.shape[1]) for a in host.arrays]
        parts: list[BlockFiles | RemotePart] = []
        try:
            for k, ((spec, plan), size) in enumerate(
                zip(target.placement.workers, sizes, strict=True)
            ):
                part = part_name(target, plan)
                if spec.remote:  # its own budget, on its host
                    parts.append(
                        RemotePart(target.executor, k, host, fingerprint, part, size, block)
                    )
                    continue
                share = budget * size // max(1, sum(sizes))
                fd, lock_fd = lock_fd, None  # the first local part holds the lock
                parts.append(BlockFiles(root, fingerprint, part, size, block, share, lock_fd=fd))
            if lock_fd is not None:  # every worker is on another host: no files here
                os.close(lock_fd)
                lock_fd = None
            await asyncio.to_thread(retire_snapshots, Path(root) / model_dir_name(fingerprint))
            for p in parts:
                await (p.scan() if isinstance(p, RemotePart) else asyncio.to_thread(p.scan))
        except BaseException:
            for p in parts:
                p.close()
            if lock_fd is not None:
                os.close(lock_fd)
            raise
        return cls(target, parts)

    # -- the engine's calls -----------------------------------------------------------------

    def match(self, prompt: Sequence[int]) -> list[bytes]:
        """The keys of `prompt`'s whole blocks held in memory or on disk in every part,
        from its first one, leaving at least one token to compute (the model must produce
        logits). The blocks' parents and tokens are compared: a collision never matches."""
        self._check_epoch()
        limit = (len(prompt) - 1) // self.block
        keys = prompt_keys(prompt, self.block, limit) if limit > 0 else []
        parent = ROOT_KEY
        for i, key in enumerate(keys):
            if not self._found(key, parent, self._tokens(prompt, i)):
                return keys[:i]
            parent = key
        return keys

    async def restore(self, slot: int, prompt: Sequence[int], keys: Sequence[bytes]) -> int:
        """Start the empty `slot` on the blocks `keys` (`match`'s): its table adopts their
        records, those in memory as they are, the others read from disk into free records
        first; as many as there are records for, up to the first bad file. -> the
        positions restored (its first span pages them in). A worker's refusal resets the
        slot and raises."""
        t, tables = self.target, self.tables
        assert t.host is not None
        self._check_epoch()
        epoch = self._epoch
        memory = [self._held.get(key) for key in keys]
        retained = [h.record for h in memory if h is not None]
        for record in retained:  # first: no record taken below is one of them
            tables.retain_record(record)
        taken: dict[int, int] = {}  # block i -> a free record it is read into, held here
        try:
            records: list[int] = []
            for i, held in enumerate(memory):
                if held is None:
                    try:
                        taken[i] = tables.hold_record()
                    except RecordsExhausted:
                        log.debug(
                            "prefix cache: %d of %d blocks restored: no records", i, len(keys)
                        )
                        break
                records.append(taken[i] if held is None else held.record)
            n = len(records)
            if taken:
                reads = sorted(taken)
                good = await self._read([keys[i] for i in reads], [taken[i] for i in reads], epoch)
                if good < len(reads):
                    self.restore_errors += 1
                    n = reads[good]
            if epoch != t.host.epoch:  # a worker on another host reconnected meanwhile
                n = 0
            if n:
                moves = tables.adopt(slot, records[:n])
                try:
                    await t.host.page(t.executor, slot, moves, prompt[: n * self.block])
                except BaseException:
                    with contextlib.suppress(Exception):
                        await t.reset(slot)  # its table (the adopted records) and the workers'
                    raise
                for i in [i for i in taken if i < n]:  # in memory from now on
                    self._keep(keys[i], keys[i - 1] if i else ROOT_KEY, prompt, i, taken.pop(i))
                self._use(keys[:n])
        finally:
            for record in (*retained, *taken.values()):
                tables.release_record(record)
        self._trim()
        return n * self.block

    async def save(self, slot: int, prompt: Sequence[int]) -> int:
        """Copy `slot`'s blocks of `prompt`'s whole blocks that are not in memory yet into
        free host records (as many as there are, in prefix order), keep them, and queue
        those not on disk for the writer. -> the blocks saved."""
        t, tables = self.target, self.tables
        assert t.host is not None
        self._check_epoch()
        keys = prompt_keys(prompt, self.block, tables.length(slot))
        mine = [h.record for k in keys if (h := self._held.get(k)) is not None]
        todo = [
            j
            for j, key in enumerate(keys)
            if key not in self._held and tables.entry(slot, j) != PAGED
        ]
        for record in mine:  # no reclaim gives up this prompt's own blocks for the others
            tables.retain_record(record)
        try:
            self.reclaim(len(self._held) + len(todo) - self.capacity)
            room = min(tables.available_records, self.capacity - len(self._held))
            if len(todo) > room:
                log.debug(
                    "prefix cache: %d of %d new blocks saved: host records are short",
                    max(0, room),
                    len(todo),
                )
                todo = todo[: max(0, room)]
            moves = [tables.save(slot, j) for j in todo]
        finally:
            for record in mine:
                tables.release_record(record)
        if moves:
            try:
                await t.host.page(t.executor, slot, moves)
            except BaseException as exc:
                for m in moves:
                    tables.release_record(m.record)
                if not isinstance(exc, Exception):
                    raise
                log.warning("prefix cache: saving %d blocks failed: %s", len(moves), exc)
                return 0
        for m in moves:
            j = m.index
            self._keep(keys[j], keys[j - 1] if j else ROOT_KEY, prompt, j, m.record)
        self._use(keys)
        self._queue_writes(keys)
        return len(moves)

    def memory(self) -> list[bytes]:
        """The keys of the blocks held in memory, least recently used first."""
        return list(self._held)

    # -- Reclaimer: the block tables' view ---------------------------------------------------

    def spare(self) -> int:
        """Records held in memory that no table or write holds too."""
        return sum(1 for h in self._held.values() if self.tables.record_refs(h.record) == 1)

    def reclaim(self, n: int) -> int:
        """Give up to n spare records, least recently used first; -> how many."""
        victims: list[bytes] = []
        for key, held in self._held.items():
            if len(victims) >= n:
                break
            if self.tables.record_refs(held.record) == 1:
                victims.append(key)
        for key in victims:
            self.tables.release_record(self._held.pop(key).record)
        return len(victims)

    # -- BlockTier: the prefix cache's view -----------------------------------------------

    @property
    def error(self) -> str | None:
        return self.backoff.error

    @property
    def on_disk(self) -> bool:
        return bool(self.parts)

    def counts(self) -> BlockCounts:
        disk = max((len(p) for p in self.parts), default=0)
        return BlockCounts(
            len(self._held),
            len(self._held) * self.record_bytes,
            self.capacity * self.record_bytes,
            disk,
            sum(p.used_bytes for p in self.parts),
        )

    async def clear(self, disk: bool = False) -> int:
        """Give up every block in memory (after the pending writes), and with `disk` delete
        every block file; -> the blocks removed (one in both tiers counts once)."""
        await self.flush()
        gone = [k for k in self._held if not disk or not self._written(k)]
        self._release_all()
        if not disk or not self.parts:
            return len(gone)
        files = await asyncio.gather(
            *(
                p.clear() if isinstance(p, RemotePart) else asyncio.to_thread(p.clear)
                for p in self.parts
            )
        )
        return len(gone) + max(files)

    async def flush(self) -> None:
        while self._writer is not None and not self._writer.done():
            with contextlib.suppress(Exception):
                await asyncio.shield(self._writer)

    async def close(self) -> None:
        await self.flush()
        self._release_all()
        self.tables.reclaimer = None
        for p in self.parts:
            p.close()

    # -- internals ------------------------------------------------------------------------

    def _tokens(self, prompt: Sequence[int], i: int) -> tuple[int, ...]:
        return tuple(int(x) for x in prompt[i * self.block : (i + 1) * self.block])

    def _found(self, key: bytes, parent: bytes, tokens: tuple[int, ...]) -> bool:
        """Whether the block `key` (of `parent` and `tokens`) is in memory or on disk in
        every part."""
        held = self._held.get(key)
        if held is not None and held.parent == parent and held.tokens == tokens:
            return True
        files = [p.get(key) for p in self.parts]
        return bool(files) and all(
            f is not None and f.parent == parent and f.tokens == tokens for f in files
        )

    def _written(self, key: bytes) -> bool:
        return bool(self.parts) and all(p.has(key) for p in self.parts)

    def _keep(self, key: bytes, parent: bytes, prompt: Sequence[int], i: int, record: int) -> None:
        """Hold `record` as the memory copy of block i of `prompt`, taking over the
        caller's hold (released instead when the key is held already)."""
        if key in self._held:
            self.tables.release_record(record)
        else:
            self._held[key] = _Held(parent, self._tokens(prompt, i), record)

    def _use(self, keys: Sequence[bytes]) -> None:
        """Mark a prompt's blocks used now, deepest first: its first block goes last."""
        for key in reversed(keys):
            if key in self._held:
                self._held.move_to_end(key)

    def _trim(self) -> None:
        self.reclaim(len(self._held) - self.capacity)

    def _release_all(self) -> None:
        held, self._held = self._held, OrderedDict()
        for h in held.values():
            self.tables.release_record(h.record)

    def _queue_writes(self, keys: Sequence[bytes]) -> None:
        """Queue the prompt's blocks held in memory and not on disk for the writer, each
        record held by it until written (none while writes are paused)."""
        if not self.parts or not self.backoff.ready():
            return
        for key in keys:
            held = self._held.get(key)
            if held is None or key in self._pending or self._written(key):
                continue
            self.tables.retain_record(held.record)
            self._pending.add(key)
            self._queue.append((key, held, self._epoch))
        if self._queue and (self._writer is None or self._writer.done()):
            self._writer = asyncio.get_running_loop().create_task(self._write_queued())

    def _check_epoch(self) -> None:
        """A worker on another host reconnected since the blocks in memory were held: its
        bytes of them are gone, so they all are (the module docstring)."""
        host = self.target.host
        assert host is not None
        if host.epoch == self._epoch:
            return
        self._epoch = host.epoch
        if self._held:
            log.info("prefix cache: %d K/V blocks in memory given up: a worker on another "
                     "host reconnected", len(self._held))  # fmt: skip
        self._release_all()

    def _local(self) -> list[tuple[BlockFiles, np.ndarray]]:
        """The parts in this daemon's files, each with its worker's host records."""
        host = self.target.host
        assert host is not None
        pairs = zip(self.parts, host.arrays, strict=True)
        return [(p, rows) for p, rows in pairs if isinstance(p, BlockFiles)]

    async def _read(self, keys: Sequence[bytes], records: Sequence[int], epoch: int) -> int:
        """Fill `records` with the blocks `keys`, every part's bytes (here in a thread, on
        its host for a remote one); -> how many every part read before its first missing
        or bad file (quarantined by its part)."""
        local = self._local()
        remote = [p for p in self.parts if isinstance(p, RemotePart)]
        counts = await asyncio.gather(
            asyncio.to_thread(self._read_local, local, keys, records),
            *(p.read(keys, records, epoch) for p in remote),
        )
        return min(counts)

    @staticmethod
    def _read_local(
        local: list[tuple[BlockFiles, np.ndarray]], keys: Sequence[bytes], records: Sequence[int]
    ) -> int:
        for i, (key, record) in enumerate(zip(keys, records, strict=True)):
            try:
                for part, rows in local:
                    part.read_into(key, memoryview(rows[record]))
            except BlockFileError as exc:
                log.info("prefix cache: %d of %d blocks read from disk: %s", i, len(keys), exc)
                return i
            for part, _ in local:
                part.touch(key)
        return len(keys)

    async def _write(self, key: bytes, held: _Held, epoch: int) -> None:
        """Every part's bytes of `held` to its files: here in a thread, a remote worker's by
        its own hand (while `epoch` is its records')."""
        local = self._local()

        def write_local() -> None:
            for part, rows in local:
                part.write(held.parent, held.tokens, rows[held.record])

        remote = [p for p in self.parts if isinstance(p, RemotePart)]
        await asyncio.gather(
            asyncio.to_thread(write_local),
            *(p.write(key, held.parent, held.tokens, held.record, epoch) for p in remote),
        )

    async def _write_queued(self) -> None:
        while self._queue:
            key, held, epoch = self._queue.popleft()
            try:
                host = self.target.host
                if self.backoff.ready() and host is not None and epoch == host.epoch:
                    await self._write(key, held, epoch)
                    self.writes += 1
                    self.backoff.works()
            except OSError as exc:
                self.write_errors += 1
                self.backoff.failed(exc)
            except Exception:
                self.write_errors += 1
                log.exception("prefix cache: writing a K/V block to disk failed")
            finally:
                self._pending.discard(key)
                self.tables.release_record(held.record)


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
