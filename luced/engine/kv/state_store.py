"""A hybrid's recurrent states in the prefix cache's block store (engine/kv/block_store.py):
the state after block i of a prompt, kept by block i's prefix key, so that a prompt
restored up to that block resumes its recurrent layers there. A recurrent layer (Gated
DeltaNet) keeps no rows, only a state that sums up every position before it, so its
blocks alone restore nothing: a restore stops at the deepest block that has both.

    save     after a prompt's prefill, the states its workers kept at its cut points
             (`Sequence.cuts`: block ends where the scheduler ended a chunk, and its end)
             that neither tier holds: each copied into a free state record (one `kv_page`
             with state saves; engine/kv/state_records.py) and held by its block's key,
             those not on disk queued for the writer the blocks' writer is (a `.kvs` file
             per worker beside its blocks: cache/block_files.py `STATE_FILES`)
    match    of a prompt's matched blocks, those up to the deepest that has a state in
             memory or on disk in every part (`usable`)
    restore  that state in a record (`take`: held in memory, or read from disk into a free
             record; a file that fails its checks is quarantined by its part and the next
             shallower state tried), loaded by the `kv_page` that adopts the blocks

Memory: `Target.states`' records (their share of --prefix-cache-bytes), the least recently
used given up whenever a save or a read needs one (a record a write or a restore holds
too is not); a prompt's deepest state is used last, so it goes last. Disk: each part keeps
at most its share of --kv-cache-budget (`STATE_SHARE`), least recently used first.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

from luced.cache.block_files import (
    ROOT_KEY,
    BlockFileError,
    BlockFiles,
    block_tokens,
    found,
    prompt_keys,
    read_parts,
    write_parts,
)
from luced.cache.prefix_cache import BlockCounts
from luced.cache.writer import DiskWriter
from luced.engine.kv.state_records import StateRecords
from luced.engine.target import Target

log = logging.getLogger(__name__)

SAVE, LOAD = 0, 1  # a state move's kind (`KVPage.states`: (kind, position, record))


@dataclass(frozen=True)
class _Held:
    """A state in memory: its record, and what its block's key was hashed from."""

    parent: bytes
    tokens: tuple[int, ...]
    record: int


class StateStore:
    """A hybrid target's recurrent states by block key (the module docstring), beside its
    `BlockStore`, which calls it."""

    def __init__(
        self, target: Target, writer: DiskWriter, parts: Sequence[BlockFiles] = ()
    ) -> None:
        """parts: one per pipeline worker, in order, of `STATE_FILES` (none: memory only);
        writer: the block store's."""
        records, tables = target.states, target.blocks
        if records is None or tables is None or target.host is None:
            raise ValueError("a state store needs the target's state records (a hybrid's)")
        if parts and len(parts) != len(records.widths):
            raise ValueError(f"{len(parts)} parts of states for {len(records.widths)} workers")
        self.target = target
        self.records: StateRecords = records
        self.writer = writer
        self.parts = list(parts)
        self.block = tables.block
        self.restore_errors = 0  # state files found bad on a restore (quarantined)
        self._held: OrderedDict[bytes, _Held] = OrderedDict()  # least recently used first

    # -- the block store's calls --------------------------------------------------------------

    def usable(self, prompt: Sequence[int], keys: Sequence[bytes]) -> int:
        """How many of `keys` (the prompt's blocks found, from its first) a restore can
        take: up to the deepest that has a state in memory or on disk; 0 when none has."""
        for i in reversed(range(len(keys))):
            if self._found(prompt, keys, i):
                return i + 1
        return 0

    async def take(
        self, prompt: Sequence[int], keys: Sequence[bytes], n: int
    ) -> tuple[int, int | None]:
        """The deepest state among the first n of `keys` in a record, retained for the
        caller (`release` it): held in memory, or read from disk into a free record and
        held from then on (a file that fails its checks is quarantined, and the next
        shallower state tried). -> (the blocks it follows, its record), (0, None): none."""
        for i in reversed(range(n)):
            key, parent, tokens = keys[i], keys[i - 1] if i else ROOT_KEY, self._tokens(prompt, i)
            held = self._held.get(key)
            if held is not None and found(held, (), key, parent, tokens):
                self.records.retain(held.record)
                self._held.move_to_end(key)
                return i + 1, held.record
            if not found(None, self.parts, key, parent, tokens):
                continue
            record = self._hold()
            if record is None:  # every record is in use: only states in memory can serve
                continue
            if await asyncio.to_thread(self._read, key, record):
                record = self._keep(key, _Held(parent, tokens, record))
                self.records.retain(record)
                return i + 1, record
            self.records.release(record)
            self.restore_errors += 1
        return 0, None

    def load(self, record: int, blocks: int) -> tuple[tuple[int, int, int]]:
        """The state move that loads `record` after `blocks` adopted blocks."""
        return ((LOAD, blocks * self.block, record),)

    def release(self, record: int) -> None:
        self.records.release(record)

    async def save(self, slot: int, prompt: Sequence[int], cuts: Sequence[int]) -> int:
        """Keep the states `slot`'s workers kept at `cuts` (block ends within the prompt;
        the scheduler ended a chunk at each, or it is the prompt's end) that neither tier
        holds: each copied into a free record, the deepest first (fewer when the records
        are short), held by its block's key; those not on disk queued for the writer.
        -> how many were saved (a refusal saves none, with a warning)."""
        t = self.target
        assert t.host is not None
        block = self.block
        ends = sorted({c for c in cuts if 0 < c <= len(prompt) and c % block == 0})
        if not ends:
            return 0
        keys = prompt_keys(prompt, block, ends[-1] // block)
        mine = [keys[c // block - 1] for c in ends]  # shallowest first
        self._use(mine)  # none of the prompt's own is given up for the others
        moves = []
        for c in reversed(ends):
            if self._found(prompt, keys, c // block - 1):
                continue
            record = self._hold()
            if record is None:
                log.debug("prefix cache: no state record free for the state at %d", c)
                break
            moves.append((SAVE, c, record))
        if moves:
            try:
                await t.host.page(t.executor, slot, (), (), moves, self.records.regions)
            except BaseException as exc:
                for *_, record in moves:
                    self.records.release(record)
                if not isinstance(exc, Exception):
                    raise
                log.warning("prefix cache: saving %d recurrent states failed: %s", len(moves), exc)
                return 0
        for _, c, record in moves:
            i = c // block - 1
            parent = keys[i - 1] if i else ROOT_KEY
            self._keep(keys[i], _Held(parent, self._tokens(prompt, i), record))
        self._use(mine)
        self._queue_writes(mine)
        return len(moves)

    def counts(self) -> BlockCounts:
        """The states in memory and on disk, and their bytes (no block)."""
        size, held = self.records.nbytes, len(self._held)
        return BlockCounts(
            memory_bytes=held * size,
            capacity=self.records.records * size,
            disk_bytes=sum(p.used_bytes for p in self.parts),
            memory_states=held,
            disk_states=max((len(p) for p in self.parts), default=0),
        )

    async def clear(self, disk: bool = False) -> int:
        """Give up every state in memory (the writes are flushed first by the block store),
        and with `disk` delete every state file; -> the states removed (once each)."""
        gone = [k for k in self._held if not disk or not self._written(k)]
        self._release_all()
        if not disk or not self.parts:
            return len(gone)
        files = await asyncio.gather(*(asyncio.to_thread(p.clear) for p in self.parts))
        return len(gone) + max(files)

    def close(self) -> None:
        self._release_all()
        for p in self.parts:
            p.close()

    # -- internals ------------------------------------------------------------------------

    def _tokens(self, prompt: Sequence[int], i: int) -> tuple[int, ...]:
        return block_tokens(prompt, self.block, i)

    def _found(self, prompt: Sequence[int], keys: Sequence[bytes], i: int) -> bool:
        """Whether the state after block i (its key keys[i]) is in memory or on disk."""
        key, parent = keys[i], keys[i - 1] if i else ROOT_KEY
        return found(self._held.get(key), self.parts, key, parent, self._tokens(prompt, i))

    def _written(self, key: bytes) -> bool:
        return bool(self.parts) and all(p.has(key) for p in self.parts)

    def _hold(self) -> int | None:
        """A free record, held by the caller; the least recently used spare state given up
        for one when none is free. None: every record is in use."""
        record = self.records.hold()
        if record is None:
            spare = next(
                (k for k, h in self._held.items() if self.records.refs(h.record) == 1), None
            )
            if spare is None:
                return None
            self.records.release(self._held.pop(spare).record)
            record = self.records.hold()
        return record

    def _keep(self, key: bytes, held: _Held) -> int:
        """Hold `held`'s record as the state of `key`, taking over the caller's hold
        (released instead when the key is held already: a save and a read crossed).
        -> the record held by the key."""
        if key in self._held:
            self.records.release(held.record)
        else:
            self._held[key] = held
        return self._held[key].record

    def _use(self, keys: Sequence[bytes]) -> None:
        """Mark states used now, in order: the last one goes last."""
        for key in keys:
            if key in self._held:
                self._held.move_to_end(key)

    def _release_all(self) -> None:
        held, self._held = self._held, OrderedDict()
        for h in held.values():
            self.records.release(h.record)

    def _queue_writes(self, keys: Sequence[bytes]) -> None:
        """Queue the states of `keys` held in memory and not on disk for the writer, each
        record held by it until written (none while writes are paused)."""
        if not self.parts or not self.writer.ready():
            return
        for key in keys:
            held = self._held.get(key)
            if held is None or self.writer.pending(("state", key)) or self._written(key):
                continue
            self.records.retain(held.record)
            write = partial(self._write, held)
            done = partial(self.records.release, held.record)
            self.writer.queue(("state", key), "a recurrent state", write, done)

    def _rows(self, record: int) -> list:
        return [a[record] for a in self.records.arrays]

    def _read(self, key: bytes, record: int) -> bool:
        """Fill `record` with the state `key` from every part (a thread); False when a file
        fails its checks (its part quarantined it)."""
        try:
            read_parts(self.parts, self._rows(record), key)
        except BlockFileError as exc:
            log.info("prefix cache: a recurrent state not read from disk: %s", exc)
            return False
        return True

    def _write(self, held: _Held) -> None:
        write_parts(self.parts, self._rows(held.record), held.parent, held.tokens)
