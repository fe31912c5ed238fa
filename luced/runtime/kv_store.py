"""A worker on another host keeps its layers' part of the prefix cache's K/V blocks on its
own host: in its host records (memory) and in block files (disk), by the daemon's keys.

    luced worker --listen ... [--prefix-cache-bytes 1G] [--kv-cache-dir DIR]
                              [--kv-cache-budget 8G]

The daemon's block store (engine/kv/block_store.py) decides everything, with one index:
which blocks are saved, written, read and into which records; this worker only executes.

* memory: its mirror of the daemon's host records (`<name>-kvhost`, runtime/mirror.py), which
  `kv_page` SAVE fills from the pool and ADOPT pages back in. The daemon sizes the prefix
  cache's records so that this worker's part of them fits its ``--prefix-cache-bytes``
  (``hello``'s reply says it). A mirror lives as long as the daemon's connection.
* disk (with ``--kv-cache-dir``): one `BlockFiles` (cache/block_files.py), the daemon's
  file format and names, ``DIR/<model>/blocks/<part>/<key hex>.kvb``, at most
  ``--kv-cache-budget`` bytes, least recently used (read) first. It outlives connections
  and restarts (scanned again when a daemon next names it).

``kv_files`` (ipc/frames/remote.py) acts on the part it names, opened on first use (the
model directory locked: one process per model directory, else memory only)::

    list   the files' keys, parents and tokens, a page at a time (the daemon's index of
           this part at its start)
    write  the named records' bytes copied out of the mirror now (the daemon may reuse a
           record once this is answered), written by one background thread in order, never
           in the way of a step; at most PENDING_BYTES wait, past them a block is not taken
    read   the named blocks read into the named records in order, stopping at the first
           one missing or bad (quarantined): the daemon restores no worker's block past it
    clear  every file of the part, after the writes in hand

Every reply carries ``gone``: the keys this part lost since the last one (evicted for room,
a write the OS refused, a file found bad), so the daemon's index forgets them. A write the
OS refuses (a full disk) pauses writing (cache/backoff.py).
"""

from __future__ import annotations

import bisect
import functools
import logging
import os
import threading
from pathlib import Path

import numpy as np

from luced.cache.backoff import DiskBackoff
from luced.cache.block_files import BlockFileError, BlockFiles, block_key
from luced.cache.files import SnapshotDirBusy, SnapshotDirError, lock_model_dir
from luced.cache.writer import DiskWriter
from luced.ipc import frames as F
from luced.ipc.frames.remote import KEY_BYTES

log = logging.getLogger(__name__)

PENDING_BYTES = 256 << 20  # record copies waiting for the writer thread
LIST_BYTES = 4 << 20  # one page of a listing: keys, parents and tokens


class ShardBlocks:
    """This host's block files of one part at a time (module docstring)."""

    def __init__(self, directory: Path | None, budget: int = 8 << 30) -> None:
        self.directory = directory
        self.budget = budget
        self.files: BlockFiles | None = None
        self.backoff = DiskBackoff(log, "K/V blocks; they stay in memory only")
        self._name: tuple[str, str, int, int] | None = None  # what `files` is
        self._lock = threading.Lock()  # the two below, shared with the writer thread
        self._gone: list[bytes] = []
        self._pending = 0  # bytes of the record copies queued
        self._writer = DiskWriter(log, self.backoff, "block-files")

    def serve(
        self, req: F.KVFiles, rows: np.ndarray | None, record_bytes: int, block: int
    ) -> F.KVFilesReply:
        """One `kv_files` frame; `rows`: this worker's view of `req.kv_host` (uint8
        [records, record_bytes]), given for a write or a read."""
        files = self.open(req.model, req.part, record_bytes, block)
        if files is None:
            return F.KVFilesReply(disk=False, gone=self._take_gone())
        if req.action == "list":
            return self._list(files, req.after, block)
        if req.action == "clear":
            self.flush()
            done = files.clear()
        else:
            assert rows is not None
            if rows.ndim != 2 or rows.shape[1] != record_bytes:
                raise ValueError(f"host records must be [records, {record_bytes}] bytes")
            if max(req.records) >= rows.shape[0]:
                raise ValueError(f"a record past the {rows.shape[0]} of kv_host")
            if req.action == "write":
                done = self._take(files, rows, req.records, req.parents, req.tokens, block)
            else:
                done = self._read(files, rows, req.records, req.keys)
        return F.KVFilesReply(disk=True, done=done, gone=self._take_gone())

    def open(self, model: str, part: str, record_bytes: int, block: int) -> BlockFiles | None:
        """The part's files (scanned on first use; another part's closed first), or None
        without a usable directory."""
        name = (model, part, record_bytes, block)
        if name == self._name:
            return self.files
        self.close()
        self._name = name
        if self.directory is None:
            return None
        try:
            lock = lock_model_dir(self.directory, model)
        except (OSError, SnapshotDirError) as exc:
            busy = isinstance(exc, SnapshotDirBusy)
            log.warning(
                "block files: %s %s (%s): K/V blocks stay in memory only",
                self.directory,
                "is in use by another process" if busy else "cannot be used",
                exc,
            )
            return None
        try:
            files = BlockFiles(
                self.directory, model, part, record_bytes, block, self.budget,
                lock_fd=lock, on_drop=self._dropped,
            )  # fmt: skip
        except ValueError:
            os.close(lock)
            raise
        except (OSError, SnapshotDirError) as exc:  # (the lock released)
            log.warning("block files: %s: K/V blocks stay in memory only", exc)
            return None
        try:
            found = files.scan()
        except OSError as exc:
            files.close()
            log.warning("block files: cannot list %s (%s): memory only", files.dir, exc)
            return None
        self.files = files
        log.info(
            "block files: %d blocks (%d MiB) of part %s in %s",
            found, files.used_bytes >> 20, part, files.dir,
        )  # fmt: skip
        return files

    def flush(self) -> None:
        """Wait for the queued writes (a clear, tests, shutdown)."""
        self._writer.flush()

    def close(self) -> None:
        """Finish the writes, release the directory."""
        self._writer.close()
        if self.files is not None:
            self.files.close()
            self.files = None
        self._name = None

    # -- internals ------------------------------------------------------------------------

    def _list(self, files: BlockFiles, after: bytes, block: int) -> F.KVFilesReply:
        found = sorted(files.files(), key=lambda f: f.key)
        start = bisect.bisect_right([f.key for f in found], after) if after else 0
        page = found[start : start + max(1, LIST_BYTES // (2 * KEY_BYTES + 4 * block))]
        tokens = np.array([f.tokens for f in page], "<i4").reshape(len(page), block)
        return F.KVFilesReply(
            disk=True,
            done=len(page),
            keys=b"".join(f.key for f in page),
            parents=b"".join(f.parent for f in page),
            tokens=tokens.tobytes(),
            more=start + len(page) < len(found),
            gone=self._take_gone(),
        )

    def _take(
        self,
        files: BlockFiles,
        rows: np.ndarray,
        records: tuple[int, ...],
        parents: bytes,
        tokens: bytes,
        block: int,
    ) -> int:
        """Queue copies of `records` for the writer, in order; -> how many were taken
        (none while writes are paused)."""
        ids = np.frombuffer(tokens, "<i4")
        if len(ids) != len(records) * block:
            raise ValueError(f"a block holds {block} tokens, got {len(ids) / len(records):g}")
        if not self._writer.ready():
            return 0
        for i, record in enumerate(records):
            with self._lock:
                if self._pending and self._pending + rows.shape[1] > PENDING_BYTES:
                    return i
                self._pending += rows.shape[1]
            parent = parents[i * KEY_BYTES : (i + 1) * KEY_BYTES]
            block_ids = tuple(ids[i * block : (i + 1) * block].tolist())
            key = block_key(parent, block_ids)
            data = rows[record].copy()
            write = functools.partial(files.write, parent, block_ids, data)
            done = functools.partial(self._written, files, key, data.nbytes)
            self._writer.queue(None, "a K/V block", write, done)
        return len(records)

    def _read(
        self, files: BlockFiles, rows: np.ndarray, records: tuple[int, ...], keys: bytes
    ) -> int:
        """Fill `records` with the blocks `keys` in order; -> how many before the first
        one missing or bad."""
        for i, record in enumerate(records):
            key = keys[i * KEY_BYTES : (i + 1) * KEY_BYTES]
            try:
                if files.get(key) is None:
                    raise BlockFileError(f"{key.hex()}: not on this host's disk")
                files.read_into(key, memoryview(rows[record]))
            except BlockFileError as exc:
                log.info("block files: %d of %d blocks read: %s", i, len(records), exc)
                return i
            files.touch(key)
        return len(records)

    def _dropped(self, key: bytes) -> None:
        with self._lock:
            self._gone.append(key)

    def _take_gone(self) -> bytes:
        with self._lock:
            gone, self._gone = self._gone, []
        return b"".join(gone)

    def _written(self, files: BlockFiles, key: bytes, nbytes: int) -> None:
        """The writer thread's word on one block: written, or its key reported gone (a
        write the OS refused, or skipped while writes are paused)."""
        if not files.has(key):  # never written: the daemon's index must forget it
            self._dropped(key)
        with self._lock:
            self._pending -= nbytes
