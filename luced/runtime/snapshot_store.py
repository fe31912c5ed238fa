"""A worker's own tier of prefix-cache snapshots: a worker on another host keeps its
layers' rows on its host, in memory and on its disk, as the daemon keeps the rest. Only for
the targets whose prefix cache keeps snapshots (one running request without KV Flash, a
recurrent hybrid); the others keep K/V blocks, whose part on this host is
``kv_store.py``'s.

    luced worker --listen ... [--prefix-cache-bytes 1G] [--kv-cache-dir DIR]
                              [--kv-cache-budget 8G]

The daemon's prefix cache decides what is cached (its index, its entry ids); a remote
shard's part of an entry lives here under the same id (``kv_export`` ``store``) and comes
back by id (``kv_import`` ``store``). The daemon's arena and disk files hold only the
local shards' rows, so no KV row crosses the network for the prefix cache.

Tiers, each least-recently-used first within its budget:

* memory: one set of host arrays per entry, at most ``--prefix-cache-bytes``;
* disk (with ``--kv-cache-dir``): the daemon's file format (``luced.cache.disk``), one
  directory per model and layer range, written by one background thread in save order
  (never blocking a step), scanned again when the worker starts, at most
  ``--kv-cache-budget`` bytes.

An entry this host lost (a restart without a disk tier, its own eviction, a file found
corrupt) is refused by ``kv_import``: the daemon prefills instead and drops the entry.
``kv_forget`` drops what the daemon dropped. The store outlives daemon connections
(entries are the daemon's ids, valid while the same model and layers are loaded).
"""

from __future__ import annotations

import functools
import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from luced.cache.arena import TOKENS
from luced.cache.disk import (
    DiskIdentity,
    SnapshotDirBusy,
    SnapshotDirError,
    SnapshotDisk,
    SnapshotFileError,
)
from luced.cache.layout import TensorSpec
from luced.cache.writer import DiskWriter
from luced.ipc.regions import numpy_dtype

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Held:
    """One entry: the layout's arrays (token axis n, a state's slot axis one per cut)."""

    arrays: dict[str, np.ndarray]
    tokens: np.ndarray  # int32 [n]
    cuts: tuple[int, ...]  # ascending, the last one n

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values()) + self.tokens.nbytes


class ShardSnapshots:
    """The memory and disk tiers of one worker's snapshots (module docstring)."""

    def __init__(
        self, memory_bytes: int, directory: Path | None = None, disk_budget: int = 8 << 30
    ) -> None:
        self.memory_bytes = memory_bytes
        self.directory = directory
        self.disk_budget = disk_budget
        self.layout: tuple[TensorSpec, ...] = ()
        self.disk: SnapshotDisk | None = None
        self._key: tuple | None = None  # what the open layout belongs to
        self._memory: OrderedDict[str, Held] = OrderedDict()  # least recently used first
        self._used = 0
        self._writer = DiskWriter(log, None, "snapshots")  # the disk's writes and removals

    def open(self, fingerprint: str, dtype: str, layers: str, layout: list[TensorSpec]) -> None:
        """Serve snapshots of this model's `layers` in `dtype` (the load in hand). The same
        again keeps everything; another load empties memory and opens its own directory."""
        key = (fingerprint, dtype, layers, tuple(layout))
        if key == self._key:
            return
        self.close()
        self._key, self.layout = key, tuple(layout)
        if self.directory is None:
            return
        # One directory per model, layers and dtype: a scan quarantines files of another.
        identity = DiskIdentity(f"{fingerprint} {layers} {dtype}", "", f"layers {layers}", dtype)
        try:
            self.disk = SnapshotDisk(self.directory, identity, layout)
            found = self.disk.scan()
        except SnapshotDirBusy as exc:
            log.warning("snapshot store: %s; keeping snapshots in memory only", exc)
            self.disk = None
            return
        except (OSError, SnapshotDirError) as exc:
            log.warning("snapshot store: %s unusable (%s): memory only", self.directory, exc)
            if self.disk is not None:
                self.disk.close()
            self.disk = None
            return
        size = sum(e.nbytes for e in found)
        log.info(
            "snapshot store: %d snapshot(s) (%d MiB) of layers %s in %s",
            len(found), size >> 20, layers, self.disk.dir,
        )  # fmt: skip

    def put(self, entry_id: str, held: Held) -> None:
        """Keep `held` in memory (evicting the least recently used) and write it to disk
        in the background."""
        self._keep(entry_id, held)
        if self.disk is not None:
            self._writer.queue(
                None, "a snapshot", functools.partial(self._write, self.disk, entry_id, held)
            )

    def get(self, entry_id: str) -> Held | None:
        """The entry from memory, else read back from disk (and kept in memory), else
        None."""
        held = self._memory.get(entry_id)
        if held is not None:
            self._memory.move_to_end(entry_id)
            return held
        d = self.disk.get(entry_id) if self.disk is not None else None
        if d is None:
            return None
        arrays = self.empty(len(d.tokens), len(d.cuts))
        tokens = np.empty(len(d.tokens), np.int32)
        assert self.disk is not None
        try:
            self.disk.read_into(d.path, {**arrays, TOKENS: tokens})
        except SnapshotFileError as exc:
            self.disk.quarantine(d.path, str(exc))
            return None
        self.disk.touch(entry_id)
        held = Held(arrays, tokens, d.cuts)
        self._keep(entry_id, held)  # not written again: it is on disk already
        return held

    def empty(self, n: int, slots: int) -> dict[str, np.ndarray]:
        """Fresh host arrays of an entry of n positions and `slots` cuts, one per tensor
        of the layout (what `Held.arrays` holds)."""
        return {s.name: np.empty(s.shape_for(n, slots), numpy_dtype(s.dtype)) for s in self.layout}

    def _keep(self, entry_id: str, held: Held) -> None:
        """In memory, most recently used, the least recently used going past the budget."""
        if held.nbytes > self.memory_bytes:
            return
        old = self._memory.pop(entry_id, None)
        self._used += held.nbytes - (old.nbytes if old is not None else 0)
        self._memory[entry_id] = held
        while self._used > self.memory_bytes:
            _, gone = self._memory.popitem(last=False)
            self._used -= gone.nbytes

    def forget(self, ids: Sequence[str]) -> int:
        """Drop these entries from memory now and from disk in order with the writes;
        returns how many this worker held."""
        held = 0
        for entry_id in ids:
            old = self._memory.pop(entry_id, None)
            if old is not None:
                self._used -= old.nbytes
            on_disk = self.disk is not None and self.disk.get(entry_id) is not None
            held += old is not None or on_disk
        if self.disk is not None:
            self._writer.queue(
                None, "a removal", functools.partial(self._remove, self.disk, tuple(ids))
            )
        return held

    def flush(self) -> None:
        """Wait for the queued disk writes and removals (tests, shutdown)."""
        self._writer.flush()

    def close(self) -> None:
        """Finish the disk work, release the directory, forget memory."""
        self._writer.close()
        if self.disk is not None:
            self.disk.close()
            self.disk = None
        self._memory.clear()
        self._used = 0
        self._key = None

    def _write(self, disk: SnapshotDisk, entry_id: str, held: Held) -> None:
        try:
            disk.write(entry_id, {**held.arrays, TOKENS: held.tokens}, held.cuts)
            disk.evict_to(self.disk_budget)
        except OSError as exc:  # a full disk: this snapshot stays in memory only
            log.warning("snapshot store: write of %s failed: %s", entry_id, exc)

    @staticmethod
    def _remove(disk: SnapshotDisk, ids: tuple[str, ...]) -> None:
        try:
            for entry_id in ids:
                disk.remove(entry_id)
        except OSError as exc:
            log.warning("snapshot store: forget of %s failed: %s", ids, exc)
