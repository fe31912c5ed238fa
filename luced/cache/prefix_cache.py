"""Prefix cache: reuse the K/V of a prompt's longest cached prefix instead of recomputing it.

The engine's view (one event loop owns all of it; file I/O runs in worker threads)::

    hit = cache.lookup(prompt)                  # radix index, tokens compared
    done = await cache.restore(hit, target) if hit else 0
    ... prefill prompt[done:] at position done ...
    await cache.save(prompt, n, target)         # after the prefill (n = a cut point)

Tiers. Memory: a daemon-owned shared-memory arena (``SnapshotArena``); workers export
their layers' K/V rows ``[0, n)`` into a block and import them back (``KVMover``), so a
worker restart loses nothing. Disk (optional): one safetensors file per entry
(``SnapshotDisk``), written in the background after each save, scanned at start. An entry
lives in either tier or both; a disk-only entry is read back into the arena on a hit.
Each tier evicts least-recently-used entries by bytes: memory when an allocation does not
fit (an evicted entry with a disk copy stays, disk-only), disk down to ``disk_budget``
after each write. Pinned entries (being restored, exported or written) are never evicted;
dropping one defers its removal to its last unpin. A model whose prompts are kept as K/V
blocks by prefix key instead (``blocks``, the engine's engine/kv/block_store.py) has no
arena and no snapshot files: the cache is the facade of those (queries, hits, stats,
clearing), and its index stays empty.

Reuse rules. Attention-only models (default): K/V rows ``[0, m)`` of any snapshot are the
K/V of its first m tokens, so any common prefix is reusable. ``exact_cuts`` (recurrent
state): only an entry's cut points are restorable; a snapshot holds the state at each of
its cuts (``save`` is told the positions where the model kept it, plus the end). A restore
always leaves at least one prompt token to compute (the model must produce logits). A
prompt shorter than ``min_tokens`` is not worth a snapshot of its own, and a match shorter
than ``min_reuse`` is not worth the copy; any longer common prefix is reused, to the token,
as a server that keeps its last prompt's KV would.

A block holds the layout's tensors (token axis sized to the entry's length N; a recurrent
state's cut axis to its number of cuts C) and ``tokens`` (int32 ``[N]``).
``export_kv(n, regions, cuts, entry)`` fills state slot i with the state at ``cuts[i]``;
``import_kv(n, regions, tokens, entry)`` gets regions sized N >= n, reads the first n positions
along each tensor's token axis, and each state from a one-slot region (the slot of cut n).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Callable, Coroutine, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import numpy as np

from luced.cache.arena import TOKENS, TOKENS_SPEC, Block, SnapshotArena, check_layout
from luced.cache.arena import layout_bytes as _layout_bytes
from luced.cache.backoff import DiskBackoff
from luced.cache.disk import SnapshotDisk, SnapshotFileError
from luced.cache.index import PrefixIndex, as_tokens
from luced.cache.layout import TensorSpec
from luced.ipc.regions import Region, view

log = logging.getLogger(__name__)

MEMORY, DISK, BOTH = "memory", "disk", "both"


class KVMover(Protocol):
    """What the cache needs from the model (the target implements it over all shards)."""

    async def kv_layout(self) -> list[TensorSpec]:
        """The snapshot tensors, token axis sized 1 (asked once, before building the cache)."""
        ...

    async def export_kv(
        self, n: int, regions: dict[str, Region], cuts: Sequence[int], entry: str
    ) -> None:
        """Copy the live KV positions ``[0, n)`` into ``regions`` (token axis sized n), and
        each recurrent state at ``cuts[i]`` (ascending, the last one n) into its slot i.
        ``entry``: the entry's id, under which a part kept elsewhere (a worker on another
        host) is kept."""
        ...

    async def import_kv(
        self, n: int, regions: dict[str, Region], tokens: Region, entry: str
    ) -> None:
        """Make the live KV hold positions ``[0, n)`` from ``regions`` (token axis >= n; a
        recurrent state one slot, the state at n) and the part kept elsewhere as ``entry``;
        ``tokens`` (int32, >= n) are the ids at those positions."""
        ...


class BlockCounts(NamedTuple):
    """What a `BlockTier` holds."""

    memory: int = 0  # blocks in memory
    memory_bytes: int = 0  # theirs, a hybrid's recurrent states' too
    capacity: int = 0  # bytes the memory tier may hold
    disk: int = 0  # block files
    disk_bytes: int = 0  # theirs and the state files'
    memory_states: int = 0  # a hybrid's recurrent states at block ends, in memory
    disk_states: int = 0  # and on disk


class BlockTier(Protocol):
    """The prefix cache's K/V blocks by prefix key, in memory and on disk, that replace the
    arena and the snapshot files where they can (the engine's engine/kv/block_store.py):
    counted, cleared and flushed with the cache."""

    @property
    def error(self) -> str | None:
        """Why its disk writes are paused (the OS's error), until one works."""
        ...

    @property
    def on_disk(self) -> bool:
        """Whether it keeps blocks on disk too (--kv-cache-dir)."""
        ...

    def counts(self) -> BlockCounts: ...

    async def clear(self, disk: bool = False) -> int:
        """Drop every block in memory (after the pending writes), and with `disk` every
        block file; -> how many blocks."""
        ...

    async def flush(self) -> None:
        """Wait for the pending writes."""
        ...

    async def close(self) -> None:
        """Flush, then release the memory, the files (and the directory's lock)."""
        ...


@dataclass(frozen=True)
class Hit:
    entry_id: str
    n: int  # tokens to restore: 1 <= n < len(prompt)
    tier: str  # where the entry was at lookup: "memory", "disk" or "both"


@dataclass(frozen=True)
class EntryInfo:
    """One entry, for ``lucectl snapshot list``."""

    id: str
    n_tokens: int
    nbytes: int  # arena bytes (memory tier) of the whole entry
    disk_bytes: int  # file size, 0 when not on disk
    tier: str
    hits: int
    last_used: float  # unix time (the cache's clock)
    created: float
    pinned: bool
    tokens: np.ndarray  # int32 [n_tokens], read-only: detokenize the head for a preview


@dataclass(frozen=True)
class CacheStats:
    queries: int  # lookups
    hits: int  # successful restores
    hit_tokens: int  # tokens restored in total
    entries: int
    memory_entries: int  # in memory (memory-only or both)
    disk_entries: int  # on disk (disk-only or both)
    memory_bytes: int  # arena bytes in use
    memory_capacity: int
    disk_bytes: int  # bytes of the indexed files
    disk_budget: int | None
    disk_writes: int
    disk_write_errors: int
    restore_errors: int  # disk entries found corrupt on restore (quarantined)
    disk_problem: str | None = None  # why --kv-cache-dir is not in use (memory tier only)
    disk_error: str | None = None  # why disk writes are paused (the OS's error), until one works
    disk_blocks: int = 0  # block files (`blocks`: the K/V blocks by prefix key)
    disk_block_bytes: int = 0  # theirs, and the state files' (a hybrid's)
    memory_blocks: int = 0  # blocks in memory (host records; the arena's place)
    memory_block_bytes: int = 0  # theirs, and the states' (a hybrid's)
    memory_states: int = 0  # a hybrid's recurrent states beside the blocks, in memory
    disk_states: int = 0  # and their files


@dataclass(eq=False)
class _Entry:
    id: str
    tokens: np.ndarray  # int32 [n], read-only
    cuts: tuple[int, ...]
    nbytes: int  # arena bytes
    created: float
    last_used: float
    block: Block | None = None  # the memory copy
    disk_bytes: int = 0  # the disk copy's file size; 0 = none
    hits: int = 0
    pins: int = 0
    writing: bool = False  # a disk write is queued or running
    doomed: bool = False  # dropped while pinned: released at the last unpin

    @property
    def tier(self) -> str:
        if self.block is not None:
            return BOTH if self.disk_bytes else MEMORY
        return DISK


class PrefixCache:
    """Index + memory arena + optional disk tier (see the module docstring).

    Owns ``arena``, ``disk`` and ``blocks``: ``close`` closes them. With a disk tier the
    directory is scanned here and its valid files are indexed as disk-only entries. No
    arena: no snapshots (the `blocks` are the tiers).
    """

    def __init__(
        self,
        layout: Sequence[TensorSpec],
        arena: SnapshotArena | None,
        disk: SnapshotDisk | None = None,
        *,
        disk_budget: int | None = None,
        min_tokens: int = 16,
        min_reuse: int = 4,
        exact_cuts: bool = False,
        clock: Callable[[], float] = time.time,
    ) -> None:
        check_layout(layout)
        self.specs: tuple[TensorSpec, ...] = (*layout, TOKENS_SPEC)
        if disk is not None and (disk.specs != self.specs or arena is None):
            raise ValueError("the disk tier was opened with another layout, or no arena")
        self.arena = arena
        self.disk = disk
        self.disk_budget = disk_budget
        self.disk_problem: str | None = None  # set by the daemon when the directory failed
        # The tiers of blocks, in place of `disk` or both (set by the daemon; owned: `close`).
        self.blocks: BlockTier | None = None
        # Told each entry id that leaves the index for good (the engine tells the workers
        # on other hosts, which keep their part of it).
        self.on_drop: Callable[[str], None] | None = None
        self.min_tokens = max(1, min_tokens)
        self.min_reuse = max(1, min_reuse)
        self.exact_cuts = exact_cuts
        self._clock = clock
        self._index = PrefixIndex()
        self._entries: dict[str, _Entry] = {}  # indexed entries
        self._busy: dict[str, _Entry] = {}  # pinned entries (doomed ones too)
        self._tasks: set[asyncio.Task[None]] = set()  # disk writes and deletions
        self._write_lock = asyncio.Lock()  # one disk write at a time, in save order
        self.queries = self.hits = self.hit_tokens = 0
        self.disk_writes = self.disk_write_errors = self.restore_errors = 0
        self._backoff = DiskBackoff(log, "snapshots; they stay in memory", clock)
        if disk is not None:
            for d in disk.scan():
                e = _Entry(
                    d.entry_id,
                    d.tokens,
                    d.cuts,
                    self.layout_bytes(len(d.tokens), len(d.cuts)),
                    d.created,
                    d.last_used,
                    disk_bytes=d.nbytes,
                )
                self._add(e)
            if disk_budget is not None:
                for entry_id in disk.evict_to(disk_budget):
                    self._forget(self._entries[entry_id])

    def layout_bytes(self, n: int, n_cuts: int = 1) -> int:
        """Arena bytes of an entry of ``n`` tokens and ``n_cuts`` cut points."""
        return _layout_bytes(self.specs, n, n_cuts)

    # -- the engine's calls -----------------------------------------------------------------

    def lookup(self, prompt: Sequence[int] | np.ndarray) -> Hit | None:
        """The best reusable prefix of ``prompt``, or None; ``n`` leaves >= 1 token to compute.

        Counts a query; ``restore`` counts the hit (a hit that cannot be restored is none).
        """
        self.queries += 1
        prompt = as_tokens(prompt)
        if len(prompt) <= self.min_reuse:
            return None
        found = self._index.longest(prompt[:-1], cuts_only=self.exact_cuts, key=self._rank)
        if found is None or found[1] < self.min_reuse:
            return None
        entry_id, n = found
        return Hit(entry_id, n, self._entries[entry_id].tier)

    async def restore(self, hit: Hit, mover: KVMover) -> int:
        """Bring the model's KV to ``hit.n`` positions; returns n, or 0 if nothing was restored.

        A disk-only entry is read into the arena first (in a thread); a bad file is
        quarantined, its entry dropped, and 0 returned (the caller prefills from 0).
        Errors of ``mover`` propagate (the model's KV state is then the mover's to report).
        """
        e = self._entries.get(hit.entry_id)
        if e is None or not 0 < hit.n <= len(e.tokens):
            return 0
        self._pin(e)
        try:
            if e.block is None and not await self._load_from_disk(e):
                return 0
            assert e.block is not None
            regions = self._arena.regions(e.block, self.specs, len(e.tokens), len(e.cuts))
            tokens = regions.pop(TOKENS)
            await mover.import_kv(hit.n, self._state_slot(regions, e, hit.n), tokens, e.id)
        finally:
            self._unpin(e)
        e.hits += 1
        self.hits += 1
        self.hit_tokens += hit.n
        await self._touch(e)
        return hit.n

    async def save(
        self,
        tokens: Sequence[int] | np.ndarray,
        n: int,
        mover: KVMover,
        cuts: Iterable[int] = (),
    ) -> str | None:
        """Snapshot the model's KV positions ``[0, n)`` (holding ``tokens[:n]``).

        Returns the id of the entry now covering ``tokens[:n]`` (an existing one is just
        touched), or None when skipped (shorter than ``min_tokens``, no arena room).
        ``cuts``: further positions < n where this snapshot may be restored with
        ``exact_cuts`` (only where the mover kept its recurrent state: it exports one per
        cut; attention-only models need none). Entries made redundant (their tokens a
        prefix of these, every cut covered) leave memory now and disk once this entry is
        written. Starts the disk
        write in the background; never waits for it. Errors of ``mover`` propagate.
        """
        toks = as_tokens(tokens)
        if not 0 < n <= len(toks):
            raise ValueError(f"cannot snapshot {n} of {len(toks)} tokens")
        toks = toks[:n]
        if n < self.min_tokens or self.arena is None:
            return None
        found = self._index.longest(toks, cuts_only=self.exact_cuts, key=self._rank)
        if found is not None and found[1] == n:
            await self._touch(self._entries[found[0]])
            return found[0]
        cut_list = tuple(sorted({int(c) for c in cuts if 0 < int(c) < n} | {n}))
        nbytes = self.layout_bytes(n, len(cut_list))
        block = self._alloc(nbytes)
        if block is None:
            log.info("prefix cache: no arena room for %d tokens; not saved", n)
            return None
        now = self._clock()
        saved = toks.copy()
        saved.flags.writeable = False
        e = _Entry(self._new_id(), saved, cut_list, nbytes, now, now, block)
        self._pin(e)  # not indexed before the export completes: no lookup can see it
        try:
            regions = self.arena.regions(block, self.specs, n, len(cut_list))
            view(self.arena.segment, regions.pop(TOKENS))[:] = saved
            await mover.export_kv(n, regions, cut_list, e.id)
        except BaseException:
            e.block = None
            self.arena.free(block)
            self._unpin(e)
            raise
        self._add(e)
        for r in self._redundant(e):
            if r.block is not None:
                self._drop_memory(r)
        if (
            self.disk is not None
            and (self.disk_budget is None or e.nbytes <= self.disk_budget)  # layout >= data
            and self._backoff.ready()
        ):
            self._schedule_write(e)
        self._unpin(e)
        return e.id

    def count_hit(self, n: int) -> None:
        """A restore of n positions from the block tier (`blocks`)."""
        self.hits += 1
        self.hit_tokens += n

    # -- admin ----------------------------------------------------------------------------

    def entries(self) -> list[EntryInfo]:
        """Every entry, most recently used first."""
        out = [
            EntryInfo(
                e.id,
                len(e.tokens),
                e.nbytes,
                e.disk_bytes,
                e.tier,
                e.hits,
                e.last_used,
                e.created,
                e.pins > 0,
                e.tokens,
            )
            for e in self._entries.values()
        ]
        return sorted(out, key=lambda i: (-i.last_used, i.id))

    async def drop(self, entry_id: str) -> bool:
        """Remove an entry from both tiers (deferred to its last unpin if in use)."""
        e = self._entries.get(entry_id)
        if e is None:
            return False
        await self._delete_files(self._discard(e))
        return True

    async def clear(self, disk: bool = False) -> int:
        """Drop the memory tier (entries with a disk copy stay, disk-only; the blocks in
        memory), or with ``disk`` every entry and its file, and every block. Waits for
        pending writes first; entries being restored stay in memory (``disk``: removed
        after the restore). Returns entries and blocks removed."""
        await self._wait_tasks()
        count, ids = 0, []
        for e in list(self._entries.values()):
            if disk:
                ids += self._discard(e)
                count += 1
            elif e.block is not None and e.pins == 0:
                self._drop_memory(e)
                count += 1
        await self._delete_files(ids)
        if self.blocks is not None:
            count += await self.blocks.clear(disk)
        return count

    async def save_all(self) -> int:
        """Write every memory entry without a disk copy to disk now, and wait for the block
        files' writes; returns the entries on disk afterwards that were written by this
        call (budget eviction may remove some)."""
        if self.blocks is not None:
            await self.blocks.flush()
        if self.disk is None:
            return 0
        todo = [
            e
            for e in self._entries.values()
            if e.block is not None and not e.disk_bytes and not e.writing
        ]
        for e in todo:
            self._schedule_write(e)
        await self._wait_tasks()
        return sum(1 for e in todo if e.disk_bytes and e.id in self._entries)

    def stats(self) -> CacheStats:
        es = list(self._entries.values())
        blocks = self.blocks.counts() if self.blocks is not None else BlockCounts()
        arena = self.arena
        memory = (arena.used, arena.capacity) if arena else (blocks.memory_bytes, blocks.capacity)
        return CacheStats(
            queries=self.queries,
            hits=self.hits,
            hit_tokens=self.hit_tokens,
            entries=len(es),
            memory_entries=sum(1 for e in es if e.block is not None),
            disk_entries=sum(1 for e in es if e.disk_bytes),
            memory_bytes=memory[0],
            memory_capacity=memory[1],
            disk_bytes=self.disk.used if self.disk is not None else 0,
            disk_budget=self.disk_budget,
            disk_writes=self.disk_writes,
            disk_write_errors=self.disk_write_errors,
            restore_errors=self.restore_errors,
            disk_problem=self.disk_problem,
            disk_error=self.disk_error or (self.blocks.error if self.blocks is not None else None),
            disk_blocks=blocks.disk,
            disk_block_bytes=blocks.disk_bytes,
            memory_blocks=blocks.memory,
            memory_block_bytes=blocks.memory_bytes,
            memory_states=blocks.memory_states,
            disk_states=blocks.disk_states,
        )

    @property
    def disk_error(self) -> str | None:
        """Why disk writes are paused (the OS's error), until one works."""
        return self._backoff.error

    async def flush(self) -> None:
        """Wait until every pending disk write (and file deletion) has finished."""
        await self._wait_tasks()

    async def close(self) -> None:
        """Wait for pending disk writes, then close the arena (unlink) and the disk tiers."""
        await self._wait_tasks()
        if self.blocks is not None:
            await self.blocks.close()
        if self.arena is not None:
            self.arena.close()
        if self.disk is not None:
            self.disk.close()

    # -- internals ------------------------------------------------------------------------

    @property
    def _arena(self) -> SnapshotArena:
        assert self.arena is not None  # entries exist only with one
        return self.arena

    def _rank(self, entry_id: str) -> tuple[bool, float]:
        e = self._entries[entry_id]
        return e.block is not None, e.last_used  # equal matches: memory first, then MRU

    def _state_slot(self, regions: dict[str, Region], e: _Entry, n: int) -> dict[str, Region]:
        """``regions`` with each recurrent state narrowed to its slot of cut ``n``."""
        states = [s.name for s in self.specs if s.token_axis is None]
        if not states:
            return regions
        if n not in e.cuts:  # the index only offers cuts in exact-cut mode
            raise ValueError(f"entry {e.id} holds its recurrent state at {e.cuts}, not at {n}")
        slot = e.cuts.index(n)
        return {k: r.rows(slot, slot + 1) if k in states else r for k, r in regions.items()}

    def _new_id(self) -> str:
        while True:
            entry_id = secrets.token_hex(6)
            if entry_id in self._entries or entry_id in self._busy:
                continue
            if self.disk is None or not self.disk.path(entry_id).exists():
                return entry_id

    def _add(self, e: _Entry) -> None:
        self._index.insert(e.id, e.tokens, e.cuts)
        self._entries[e.id] = e

    def _forget(self, e: _Entry) -> None:
        """Out of the index (bookkeeping only)."""
        if self._entries.pop(e.id, None) is not None:
            self._index.remove(e.id)
            if self.on_drop is not None:
                self.on_drop(e.id)

    def _discard(self, e: _Entry) -> list[str]:
        """Remove ``e`` entirely; returns the ids whose files the caller deletes."""
        self._forget(e)
        if e.pins:
            e.doomed = True
            return []
        return self._release(e)

    def _release(self, e: _Entry) -> list[str]:
        if e.block is not None:
            self._arena.free(e.block)
            e.block = None
        if e.disk_bytes:
            e.disk_bytes = 0
            return [e.id]
        return []

    def _pin(self, e: _Entry) -> None:
        e.pins += 1
        self._busy[e.id] = e

    def _unpin(self, e: _Entry) -> None:
        e.pins -= 1
        if e.pins == 0:
            self._busy.pop(e.id, None)
            if e.doomed:
                ids = self._release(e)
                if ids:
                    self._spawn(self._delete_files(ids))

    def _drop_memory(self, e: _Entry) -> None:
        assert e.block is not None and e.pins == 0
        self._arena.free(e.block)
        e.block = None
        if not e.disk_bytes:
            self._forget(e)

    def _alloc(self, nbytes: int) -> Block | None:
        """An arena block, evicting least-recently-used unpinned memory copies as needed."""
        block = self._arena.alloc(nbytes)
        if block is not None:
            return block
        victims = [e for e in self._entries.values() if e.block is not None and not e.pins]
        evictable = sum(e.block.nbytes for e in victims if e.block is not None)
        if self._arena.free_bytes + evictable < nbytes:
            return None  # cannot fit even then: evict nothing
        victims.sort(key=lambda e: (e.last_used, e.id))
        for v in victims:
            self._drop_memory(v)
            block = self._arena.alloc(nbytes)
            if block is not None:
                return block
        return None  # fragmentation: the pinned blocks split the free space

    def _redundant(self, new: _Entry) -> list[_Entry]:
        """Unpinned entries every use of which ``new`` serves as well."""
        out = []
        for entry_id, _ in self._index.prefixes(new.tokens):
            r = self._entries[entry_id]
            if r is new or r.pins:
                continue
            if not self.exact_cuts or set(r.cuts) <= set(new.cuts):
                out.append(r)
        return out

    async def _touch(self, e: _Entry) -> None:
        e.last_used = self._clock()
        if e.disk_bytes and self.disk is not None:
            await asyncio.to_thread(self.disk.touch, e.id, e.last_used)

    async def _load_from_disk(self, e: _Entry) -> bool:
        """Read a disk-only entry into a new arena block (``e`` is pinned)."""
        assert self.disk is not None
        block = self._alloc(e.nbytes)
        if block is None:
            log.info("prefix cache: no arena room to load %s from disk", e.id)
            return False
        path = self.disk.path(e.id)
        try:
            views = self._arena.views(block, self.specs, len(e.tokens), len(e.cuts))
            await asyncio.to_thread(self.disk.read_into, path, views)
            if not np.array_equal(views[TOKENS], e.tokens):
                raise SnapshotFileError(f"{path.name}: token ids differ from the scanned ones")
        except SnapshotFileError as err:
            self._arena.free(block)
            self.restore_errors += 1
            await asyncio.to_thread(self.disk.quarantine, path, str(err))
            e.disk_bytes = 0  # the file is in quarantine now
            self._discard(e)
            return False
        except BaseException:
            self._arena.free(block)
            raise
        e.block = block
        return True

    def _schedule_write(self, e: _Entry) -> None:
        self._pin(e)  # the block must stay until the file is written
        e.writing = True
        self._spawn(self._write(e))

    async def _write(self, e: _Entry) -> None:
        assert self.disk is not None
        disk = self.disk
        try:
            async with self._write_lock:
                if e.doomed or e.block is None:
                    return
                views = self._arena.views(e.block, self.specs, len(e.tokens), len(e.cuts))

                def write() -> int:
                    d = disk.write(e.id, views, e.cuts)
                    disk.touch(e.id, e.last_used)  # file mtime = LRU clock
                    return d.nbytes

                e.disk_bytes = await asyncio.to_thread(write)
                self.disk_writes += 1
                self._backoff.works()
                if e.doomed:
                    return  # released (file deleted) at the unpin below
                # This file serves every use of its redundant entries: drop theirs.
                await self._delete_files([i for r in self._redundant(e) for i in self._discard(r)])
                if self.disk_budget is not None:
                    victims = disk.plan_eviction(self.disk_budget, lambda i: i in self._busy)
                    for entry_id in victims:
                        v = self._entries.get(entry_id)
                        if v is not None:
                            v.disk_bytes = 0
                            if v.block is None:
                                self._forget(v)
                    await self._delete_files(victims)
        except OSError as exc:
            self.disk_write_errors += 1
            self._backoff.failed(exc)
        except Exception:
            self.disk_write_errors += 1
            log.exception("prefix cache: writing snapshot %s to disk failed", e.id)
        finally:
            e.writing = False
            self._unpin(e)

    async def _delete_files(self, ids: list[str]) -> None:
        if not ids or self.disk is None:
            return
        disk = self.disk

        def delete() -> None:
            for entry_id in ids:
                try:
                    disk.remove(entry_id)
                except OSError as e:
                    log.warning("prefix cache: cannot delete snapshot %s: %s", entry_id, e)

        await asyncio.to_thread(delete)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _wait_tasks(self) -> None:
        while self._tasks:
            with contextlib.suppress(Exception):
                await asyncio.gather(*list(self._tasks))
