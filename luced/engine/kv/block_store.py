"""The prefix cache as K/V blocks by prefix key (cache/block_files.py's keys): its memory
tier is host records (engine/kv/host.py) held by key, its disk tier (with --kv-cache-dir) a
file per block and worker; a prompt comes back as a page-in, not an import of copies. KV
Flash is one more policy over the same table: its lanes' paged-out blocks are records
already.

    save     after a prompt's prefill, its whole blocks not held in memory yet: each
             resident one copied from the lane's pool block into a free host record
             (`BlockTables.save`, one `kv_page` to the workers), each paged out by KV
             Flash held as its record is (a held record is never written again:
             `BlockTables`), and the store keeps them by key; then one background writer
             (cache/writer.py: a thread, one block at a time, never in the way of the
             token stream) writes each local worker's bytes of the records not on
             disk yet to its part (`HostRecords.arrays[k]` row r); a worker on another
             host is sent them to write itself (below)
    match    the prompt's whole blocks held in memory or on disk in every part, each in
             one or the other, consecutive from its first one, leaving at least one prompt
             token to compute
    restore  the new sequence's empty table adopts the blocks' records (`BlockTables.adopt`,
             one `kv_page` with their token ids; under KV Flash's `qk` the workers key the
             blocks from the records' K rows, as the computing lane keyed them): those held
             in memory as they are, the others first read from their files into free
             records (a thread), kept in memory from then on. Its first span pages them in
             (`ModelRunner._page_in`), or under KV Flash its pager pages in what a lane
             that computed them would hold (`Pager.sync`, as a sharer of a kept prompt):
             its rows are the saved ones, byte for byte, and restored == fresh

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
into and adopted from its own mirror of its host records, never the daemon's copy, which
this store never reads or writes. A record held before such a worker reconnected is empty
there: the store gives up every block it held then (`HostRecords.epoch`). Without parts
(no --kv-cache-dir, or it or a remote worker's cannot be used) the memory tier is the whole
cache.

A file that fails its checks is quarantined by `BlockFiles`; a restore stops before it, and
before a block any worker on another host read no file for: every worker restores the same
blocks, or none. A write the OS refuses (a full disk) pauses writing (cache/backoff.py) with
one warning; the blocks saved meanwhile stay in memory only.

With a DFlash draft's feature rings each block keeps the captured rows of its positions
beside its K/V, by the same key, in memory and in a part of their own on disk
(engine/kv/block_rings.py: which rows a restore needs, and why a missing one ends a match).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np

from luced.cache.backoff import DiskBackoff
from luced.cache.block_files import (
    ROOT_KEY,
    SHORT_DTYPES,
    STATE_FILES,
    BlockFileError,
    BlockFiles,
    block_tokens,
    found,
    prompt_keys,
    read_parts,
    write_parts,
)
from luced.cache.files import QUARANTINE, SnapshotDirError, model_dir_name, move_aside
from luced.cache.prefix_cache import BlockCounts
from luced.cache.writer import DiskWriter
from luced.engine.kv.block_rings import BlockRings, ring_bytes, ring_part_name
from luced.engine.kv.blocks import PAGED, RecordsExhausted
from luced.engine.kv.host import store_records
from luced.engine.kv.remote_blocks import RemotePart
from luced.engine.kv.state_records import STATE_SHARE
from luced.engine.kv.state_store import StateStore
from luced.engine.placement import WorkerPlan
from luced.engine.target import Target

log = logging.getLogger(__name__)

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
        state_parts: Sequence[BlockFiles] = (),
        rings: BlockRings | None = None,
    ) -> None:
        """parts: one per pipeline worker, in order (`HostRecords.arrays[k]`'s layout);
        none: memory only. A hybrid's recurrent states go beside the blocks
        (engine/kv/state_store.py; `state_parts` their files, as `parts`). rings: the
        blocks' feature-ring rows (with their disk part), made in memory only when the
        target captures features and none is given (so the store is made after the draft
        is loaded)."""
        tables, host = target.blocks, target.host
        if tables is None or host is None or not target.store_records:
            raise ValueError("a block store needs the target's host records for it")
        if target.recurrent and target.states is None:
            raise ValueError("a block store of a hybrid needs the target's state records")
        if parts and len(parts) != len(host.arrays):
            raise ValueError(f"{len(parts)} parts of blocks for {len(host.arrays)} workers")
        self.target = target
        self.tables = tables
        self.parts = list(parts)
        self.block = tables.block
        self.capacity = min(target.store_records, tables.records)
        self.record_bytes = sum(int(a.shape[1]) for a in host.arrays)  # one over every worker
        if rings is None and target.capture is not None:
            rings = BlockRings(target, self.block)
        self.rings = rings
        if rings is not None and target.store_bytes:  # its rows count in the same bytes
            least = store_records(target.placement.kv_capacity, self.block)
            fits = target.store_bytes // (self.record_bytes + rings.block_bytes)
            self.capacity = min(self.capacity, max(least, fits))
        self.restore_errors = 0
        self.backoff = DiskBackoff(log, "K/V blocks; they stay in memory only", clock)
        # Each record held by it until written (a worker on another host's: `RemotePart`).
        self.writer = DiskWriter(log, self.backoff, "kv-blocks")
        self._held: OrderedDict[bytes, _Held] = OrderedDict()  # least recently used first
        self._epoch = host.epoch  # whose records `_held` are (the module docstring)
        self.states = StateStore(target, self.writer, state_parts) if target.recurrent else None
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
        widths = target.states.widths if target.states is not None else []
        state_budget = int(budget * STATE_SHARE) if widths else 0  # a hybrid's states' share
        ring = ring_bytes(target, block)  # the feature rings' part, with a draft's
        workers = list(zip(target.placement.workers, sizes, strict=True))
        total = max(1, sum(size for (spec, _), size in workers if not spec.remote) + ring)
        parts: list[BlockFiles | RemotePart] = []
        states: list[BlockFiles] = []
        try:
            for k, ((spec, plan), size) in enumerate(workers):
                part = part_name(target, plan)
                if spec.remote:  # its own files and budget, on its host
                    parts.append(RemotePart(target, k, fingerprint, part, size, block))
                    continue
                share = (budget - state_budget) * size // total
                fd, lock_fd = lock_fd, None  # the first local part holds the lock
                parts.append(BlockFiles(root, fingerprint, part, size, block, share, lock_fd=fd))
            if ring:
                name = ring_part_name(target, [p.part for p in parts])
                share = (budget - state_budget) * ring // total
                fd, lock_fd = lock_fd, None  # every worker is on another host: it holds it
                parts.append(BlockFiles(root, fingerprint, name, ring, block, share, lock_fd=fd))
            if lock_fd is not None:  # every worker is on another host: no file here
                os.close(lock_fd)
                lock_fd = None
            for part, width in zip(parts, widths, strict=False):
                share = state_budget * width // max(1, sum(widths))
                states.append(
                    BlockFiles(
                        root, fingerprint, part.part, width, part.block, share, kind=STATE_FILES
                    )
                )
            await asyncio.to_thread(retire_snapshots, Path(root) / model_dir_name(fingerprint))
            for p in (*parts, *states):
                await (p.scan() if isinstance(p, RemotePart) else asyncio.to_thread(p.scan))
        except BaseException:
            for p in (*parts, *states):
                p.close()
            if lock_fd is not None:
                os.close(lock_fd)
            raise
        if not ring:
            return cls(target, parts, state_parts=states)
        assert isinstance(parts[-1], BlockFiles)
        rings = BlockRings(target, block, parts[-1])
        return cls(target, parts[:-1], state_parts=states, rings=rings)

    # -- the engine's calls -----------------------------------------------------------------

    def match(self, prompt: Sequence[int]) -> list[bytes]:
        """The keys of `prompt`'s whole blocks held in memory or on disk in every part,
        from its first one, leaving at least one token to compute (the model must produce
        logits); a hybrid's up to the deepest with a recurrent state (`StateStore.usable`).
        The blocks' parents and tokens are compared: a collision never matches."""
        self._check_epoch()
        limit = (len(prompt) - 1) // self.block
        keys = prompt_keys(prompt, self.block, limit) if limit > 0 else []
        parent, n = ROOT_KEY, len(keys)
        for i, key in enumerate(keys):
            tokens = self._tokens(prompt, i)
            if not self._found(key, parent, tokens) or not self._has_rows(
                key, parent, tokens, i, len(prompt)
            ):
                n = i
                break
            parent = key
        if self.states is not None:  # a hybrid's blocks past its deepest state are no use
            n = self.states.usable(prompt, keys[:n])
        return keys[:n]

    async def restore(self, slot: int, prompt: Sequence[int], keys: Sequence[bytes]) -> int:
        """Start the empty `slot` on the blocks `keys` (`match`'s): its table adopts their
        records, those in memory as they are, the others read from disk into free records
        first; as many as there are records for, up to the first bad file. With
        feature rings their rows go back into the slot's ring (`BlockRings.restore`; the
        caller sets the sequence's floor, `BlockRings.floor`); a hybrid's up to the
        deepest state that can be had, loaded with them (`StateStore.take`). -> the
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
        state: int | None = None  # a hybrid's state record, held here
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
            rows: Sequence[object] = ()  # each block's feature-ring rows, when needed
            if n and self.rings is not None:
                rows = await self.rings.fetch(keys[:n], len(prompt))
                if len(rows) < n:
                    self.restore_errors += 1
                    n = len(rows)
            loads: tuple[tuple[int, int, int], ...] = ()
            if self.states is not None:  # no block past the state restores anything
                n, state = await self.states.take(prompt, keys, n)
                loads = self.states.load(state, n) if state is not None else ()
            if n:
                moves = tables.adopt(slot, records[:n])
                try:
                    regions = t.states.regions if t.states is not None else ()
                    await t.host.page(
                        t.executor, slot, moves, prompt[: n * self.block], loads, regions
                    )
                except BaseException:
                    with contextlib.suppress(Exception):
                        await t.reset(slot)  # its table (the adopted records) and the workers'
                    raise
                for i in [i for i in taken if i < n]:  # in memory from now on
                    self._keep(keys[i], keys[i - 1] if i else ROOT_KEY, prompt, i, taken.pop(i))
                if self.rings is not None:
                    self.rings.restore(slot, keys[:n], rows[:n], len(prompt), self._held)
                self._use(keys[:n])
                self._touch_files([keys[i] for i in range(n) if memory[i] is not None])
                if (pager := t.pager(slot)) is not None:  # KV Flash: it pages in what it keeps
                    pager.sync(n * self.block)
        finally:
            for record in (*retained, *taken.values()):
                tables.release_record(record)
            if state is not None and self.states is not None:
                self.states.release(state)
        self._trim()
        return n * self.block

    async def save(
        self, slot: int, prompt: Sequence[int], cuts: Sequence[int] = (), ring_floor: int = 0
    ) -> int:
        """Keep `slot`'s blocks of `prompt`'s whole blocks that are not in memory yet (as
        many as there is room for, in prefix order): a resident one copied into a free
        host record, a paged-out one (KV Flash) as its record is; queue those not on disk
        for the writer; a hybrid's recurrent states at `cuts` too (`StateStore.save`).
        Right after the prompt's prefill: with feature rings the held blocks get their
        rows from the slot's ring (`BlockRings.take`; its sequence's `ring_floor`). -> the
        blocks saved."""
        t, tables = self.target, self.tables
        assert t.host is not None
        self._check_epoch()
        keys = prompt_keys(prompt, self.block, tables.length(slot))
        mine = [h.record for k in keys if (h := self._held.get(k)) is not None]
        new = [j for j, key in enumerate(keys) if key not in self._held]
        for record in mine:  # no reclaim gives up this prompt's own blocks for the others
            tables.retain_record(record)
        try:
            self.reclaim(len(self._held) + len(new) - self.capacity)
            todo = self._room(slot, new)
            if len(todo) < len(new):
                log.debug(
                    "prefix cache: %d of %d new blocks saved: host records are short",
                    len(todo),
                    len(new),
                )
            # A paged-out block's record is held as it is, a resident block copied.
            records = {j: tables.record(slot, j) for j in todo if tables.entry(slot, j) == PAGED}
            for record in records.values():
                tables.retain_record(record)
            moves = [tables.save(slot, j) for j in todo if j not in records]
        finally:
            for record in mine:
                tables.release_record(record)
        if moves:
            try:
                await t.host.page(t.executor, slot, moves)
            except BaseException as exc:
                for record in [*records.values(), *(m.record for m in moves)]:
                    tables.release_record(record)
                if not isinstance(exc, Exception):
                    raise
                log.warning("prefix cache: saving %d blocks failed: %s", len(moves), exc)
                return 0
        records |= {m.index: m.record for m in moves}
        for j in todo:
            self._keep(keys[j], keys[j - 1] if j else ROOT_KEY, prompt, j, records[j])
        if self.rings is not None:
            held = [(j, k) for j, k in enumerate(keys) if k in self._held]
            self.rings.take(slot, held, len(prompt), ring_floor)
        self._use(keys)
        self._queue_writes(keys)
        if self.states is not None:
            await self.states.save(slot, prompt, cuts)
        return len(todo)

    def _room(self, slot: int, new: Sequence[int]) -> list[int]:
        """The leading ones of `slot`'s logical blocks `new` that the store has room for:
        within its capacity, and an available record for each resident one (a copy)."""
        room = self.capacity - len(self._held)
        copies = self.tables.available_records
        for i, j in enumerate(new):
            if self.tables.entry(slot, j) != PAGED:
                copies -= 1
            if i >= room or copies < 0:
                return list(new[:i])
        return list(new)

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
            if self.rings is not None:
                self.rings.drop(key)
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
        states = self.states.counts() if self.states is not None else BlockCounts()
        rings = self.rings
        return BlockCounts(
            len(self._held),
            len(self._held) * self.record_bytes
            + (rings.memory_bytes if rings else 0)
            + states.memory_bytes,
            self.capacity * (self.record_bytes + (rings.block_bytes if rings else 0))
            + states.capacity,
            disk,
            sum(p.used_bytes for p in self._files()) + states.disk_bytes,
            states.memory_states,
            states.disk_states,
        )

    async def clear(self, disk: bool = False) -> int:
        """Give up every block in memory (after the pending writes), and with `disk` delete
        every block file; -> the blocks removed (one in both tiers counts once)."""
        await self.flush()
        gone = [k for k in self._held if not disk or not self._written(k)]
        self._release_all()
        states = await self.states.clear(disk) if self.states is not None else 0
        if not disk or not self.parts:
            return len(gone) + states
        files = await asyncio.gather(
            *(
                p.clear() if isinstance(p, RemotePart) else asyncio.to_thread(p.clear)
                for p in self._files()
            )
        )
        return len(gone) + max(files[: len(self.parts)]) + states

    async def flush(self) -> None:
        """Wait for the writes in hand: here, and sent to workers on other hosts."""
        await self.writer.drain()
        await asyncio.gather(*(p.flush() for p in self._remote()))

    async def close(self) -> None:
        await self.flush()
        self.writer.close()
        self._release_all()
        if self.states is not None:
            self.states.close()
        self.tables.reclaimer = None
        for p in self._files():
            p.close()

    # -- internals ------------------------------------------------------------------------

    def _tokens(self, prompt: Sequence[int], i: int) -> tuple[int, ...]:
        return block_tokens(prompt, self.block, i)

    def _holds(self, key: bytes, parent: bytes, tokens: tuple[int, ...]) -> bool:
        """Whether the block `key` (of `parent` and `tokens`) is in memory."""
        held = self._held.get(key)
        return held is not None and held.parent == parent and held.tokens == tokens

    def _found(self, key: bytes, parent: bytes, tokens: tuple[int, ...]) -> bool:
        """Whether the block `key` (of `parent` and `tokens`) is in memory or on disk in
        every part."""
        return found(self._held.get(key), self.parts, key, parent, tokens)

    def _has_rows(
        self, key: bytes, parent: bytes, tokens: tuple[int, ...], i: int, length: int
    ) -> bool:
        """Whether block i of a prompt of `length` tokens has the feature-ring rows a
        restore needs (none without rings, nor before the prompt's own ring reaches)."""
        rings = self.rings
        if rings is None or not rings.needed(i, length):
            return True
        return rings.found(key, parent, tokens, self._holds(key, parent, tokens))

    def _files(self) -> list[BlockFiles | RemotePart]:
        """Every part on disk: the workers' and the feature rings'."""
        ring = self.rings.part if self.rings is not None else None
        return [*self.parts, *([ring] if ring is not None else [])]

    def _written(self, key: bytes) -> bool:
        return bool(self.parts) and all(p.has(key) for p in self.parts)

    def _local(self) -> list[tuple[BlockFiles, np.ndarray]]:
        """The parts in this daemon's files, each with its worker's host records."""
        host = self.target.host
        assert host is not None
        pairs = zip(self.parts, host.arrays, strict=True)
        return [(p, rows) for p, rows in pairs if isinstance(p, BlockFiles)]

    def _remote(self) -> list[RemotePart]:
        return [p for p in self.parts if isinstance(p, RemotePart)]

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

    def _touch_files(self, keys: Sequence[bytes]) -> None:
        """Mark blocks restored from memory used in this daemon's files too (the disk
        tier's LRU, its index and the files' mtimes), in the writer's thread, so a prompt
        served from memory is not the first its files give up."""
        files = [p for p in self._files() if isinstance(p, BlockFiles)]
        if keys and files and self.writer.ready():
            self.writer.queue(None, "a use of K/V blocks", partial(_touch, files, list(keys)))

    def _trim(self) -> None:
        self.reclaim(len(self._held) - self.capacity)

    def _release_all(self) -> None:
        held, self._held = self._held, OrderedDict()
        for h in held.values():
            self.tables.release_record(h.record)
        if self.rings is not None:
            self.rings.drop_all()

    def _queue_writes(self, keys: Sequence[bytes]) -> None:
        """Queue the prompt's blocks held in memory and not on disk here for the writer
        (none while writes are paused), and send those a worker on another host lacks to
        it; each record held until written (or taken there)."""
        if not self.parts:
            return
        local = [p for p, _ in self._local()]
        for key in keys:
            held = self._held.get(key)
            rows = self.rings is None or self.rings.written(key)  # rows kept after the K/V
            here = all(p.has(key) for p in local) and rows
            if held is None or here or self.writer.pending(key) or not self.backoff.ready():
                continue
            self.tables.retain_record(held.record)
            done = partial(self.tables.release_record, held.record)
            self.writer.queue(key, "a K/V block", partial(self._write, key, held), done)
        for part in self._remote():
            todo = [(k, h) for k in keys if (h := self._held.get(k)) and not part.holds(k)]
            for _, h in todo:
                self.tables.retain_record(h.record)
            part.send(todo, self._epoch, self.tables.release_record)

    async def _read(self, keys: Sequence[bytes], records: Sequence[int], epoch: int) -> int:
        """Fill `records` with the blocks `keys`, every part's bytes (here in a thread, on
        its host for a remote one); -> how many every part read before its first missing
        or bad file (quarantined by its part)."""
        counts = await asyncio.gather(
            asyncio.to_thread(_read_local, self._local(), keys, records),
            *(p.read(keys, records, epoch) for p in self._remote()),
        )
        return min(counts)

    def _write(self, key: bytes, held: _Held) -> None:
        """Write the local workers' bytes of `held` (and its ring rows): a thread's work."""
        local = self._local()
        rows = [rows[held.record] for _, rows in local]
        write_parts([p for p, _ in local], rows, held.parent, held.tokens)  # on disk: touched
        if self.rings is not None:
            self.rings.write(key, held.parent, held.tokens)


def _touch(parts: Sequence[BlockFiles], keys: Sequence[bytes]) -> None:
    for part in parts:
        for key in keys:
            part.touch(key)


def _read_local(
    local: Sequence[tuple[BlockFiles, np.ndarray]], keys: Sequence[bytes], records: Sequence[int]
) -> int:
    """Fill `records` of the local workers' host records (`local`: each part with its
    worker's) with the blocks `keys` from their files (a thread); -> how many were read
    before the first bad file (quarantined by its part)."""
    parts = [p for p, _ in local]
    for i, (key, record) in enumerate(zip(keys, records, strict=True)):
        try:
            read_parts(parts, [rows[record] for _, rows in local], key)
        except BlockFileError as exc:
            log.info("prefix cache: %d of %d blocks read from disk: %s", i, len(keys), exc)
            return i
    return len(keys)


def part_name(target: Target, plan: WorkerPlan) -> str:
    """One worker's part of the blocks: "b16-bf16-L0-15-1a2b3c4d", the pool's block, the
    K/V dtype, its layers, and a hash of the rest that a record's bytes depend on (its
    devices and shard split, the compute dtype, how weights are held; under KV Flash its
    pool, policy and protected blocks and the prompt chunk, which decide what each row
    attended to)."""
    p = target.placement
    kv = p.kv_dtype or p.dtype
    a, b = plan.layers
    rest: tuple = (plan.devices, plan.shard_ranges(), p.dtype, p.weights_mode, p.batch_invariant)
    if target.flash is not None:  # the residency the rows were computed over
        c = target.flash.cfg
        rest += (c.pool_tokens, c.policy, c.tau, c.sink_blocks, c.tail, target.prompt_chunk)
    digest = hashlib.sha256(repr(rest).encode()).hexdigest()[:8]
    block = p.kv_block
    return f"b{block}-{SHORT_DTYPES.get(kv, kv)}-L{a}-{b}-{digest}"


def retire_snapshots(model_dir: Path) -> int:
    """Move the model's snapshot files (one safetensors file per prompt, cache/disk.py)
    into its quarantine/ (which keeps its newest files only): blocks replace them. One log
    line; -> how many."""
    with os.scandir(model_dir) as it:
        old = [e for e in it if e.name.endswith(OLD_SUFFIX) and e.is_file(follow_symlinks=False)]
    if not old:
        return 0
    qdir = model_dir / QUARANTINE
    moved, problem = 0, ""
    try:
        for entry in old:
            move_aside(model_dir, Path(entry.path))
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
