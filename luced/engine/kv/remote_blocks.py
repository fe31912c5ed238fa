"""A worker on another host's part of the prefix cache's block files, as the block store
(engine/kv/block_store.py) sees it: the files are on the worker's host (runtime/kv_store.py,
`kv_files`), the index of them here, so a match asks nobody.

    index  what the worker listed when the store opened (keys, parents, tokens), plus each
           block it took to write, less each key a reply says it lost (`gone`: evicted,
           a failed write, a bad file) or a read found missing: the daemon's one index
    send   the held records' bytes, from the worker's own mirror of its host records
           (never from the daemon's copy of them, which that worker never writes), one
           frame per save in a task of its own: the worker copies them before it answers
           and writes them in its own thread, and the store holds each record until then
    read   the worker reads the files into the records of its mirror, in order, up to the
           first one missing; the store restores no worker's block past the fewest read

A record's bytes there exist only while the connection that saved or read them lives
(`HostRecords.epoch`): a write is sent only within the epoch its records were held in, so a
reconnected worker never writes an empty record under a key.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal, Protocol

import numpy as np

from luced.cache.block_files import BlockFile, file_size
from luced.cache.files import SnapshotDirError
from luced.engine.executor import WorkerDied, WorkerHandle
from luced.engine.target import Target
from luced.ipc.frames import KVFiles, KVFilesReply
from luced.ipc.frames.remote import KEY_BYTES

log = logging.getLogger(__name__)

Action = Literal["list", "write", "read", "clear"]


class Held(Protocol):
    """A block the store holds in memory: what its key was hashed from, and its record."""

    @property
    def parent(self) -> bytes: ...

    @property
    def tokens(self) -> tuple[int, ...]: ...

    @property
    def record(self) -> int: ...


class RemotePart:
    """The block files of `target`'s pipeline worker `slot`, on its host (module
    docstring)."""

    def __init__(
        self, target: Target, slot: int, model: str, part: str, record_bytes: int, block: int
    ) -> None:
        assert target.host is not None
        self.executor = target.executor
        self.slot = slot
        self.host = target.host
        self.model = model
        self.part = part
        self.block = block
        self.file_bytes = file_size(part, block, record_bytes)
        self._index: dict[bytes, BlockFile] = {}
        self._sending: set[bytes] = set()  # keys of the writes in flight
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def where(self) -> str:
        return self.executor.slots[self.slot].spec.group

    # -- the index (BlockFiles' view) -------------------------------------------------------

    def __len__(self) -> int:
        return len(self._index)

    @property
    def used_bytes(self) -> int:
        return len(self._index) * self.file_bytes

    def get(self, key: bytes) -> BlockFile | None:
        return self._index.get(key)

    def has(self, key: bytes) -> bool:
        return key in self._index

    def holds(self, key: bytes) -> bool:
        """Whether the worker has the block `key` on disk or is being sent it."""
        return key in self._index or key in self._sending

    def close(self) -> None:
        """Nothing here to release: the worker keeps its directory."""

    # -- the worker's files -----------------------------------------------------------------

    async def scan(self) -> None:
        """Index the worker's files of this part (a page at a time). SnapshotDirError when
        it keeps none (no --kv-cache-dir there, or it cannot be used) or cannot say."""
        self._index.clear()
        after = b""
        while True:
            try:
                reply = await self._call(self._frame("list", after=after))
            except Exception as exc:
                raise SnapshotDirError(f"the worker {self.where} cannot list: {exc}") from exc
            if not reply.disk:
                raise SnapshotDirError(
                    f"the worker {self.where} keeps no block files (start it with --kv-cache-dir)"
                )
            ids = np.frombuffer(reply.tokens, "<i4").reshape(reply.done, self.block)
            for i in range(reply.done):
                key = reply.keys[i * KEY_BYTES : (i + 1) * KEY_BYTES]
                parent = reply.parents[i * KEY_BYTES : (i + 1) * KEY_BYTES]
                self._add(key, parent, tuple(ids[i].tolist()))
            if not reply.more or not reply.done:
                return
            after = reply.keys[-KEY_BYTES:]

    async def read(self, keys: Sequence[bytes], records: Sequence[int], epoch: int) -> int:
        """Fill the worker's `records` with the blocks `keys`; -> how many it read, in order
        (0 when it cannot answer, or its records are not those of `epoch` any more)."""
        req = self._frame("read", records=tuple(records), keys=b"".join(keys))
        try:
            reply = await self._call(req, epoch)
        except Exception as exc:
            log.info("prefix cache: %s read no K/V blocks: %s", self.where, exc)
            return 0
        done = min(reply.done, len(keys)) if reply.disk else 0
        for key in keys[done:]:  # missing there, or not known to be there: written again
            self._index.pop(key, None)
        return done

    def send(
        self, blocks: Sequence[tuple[bytes, Held]], epoch: int, release: Callable[[int], None]
    ) -> None:
        """Have the worker write its bytes of the held blocks (key, held), their records
        held since `epoch` and by the caller until the worker took them (then `release`d),
        in a task of its own (`flush` waits for it); each indexed once taken."""
        if not blocks:
            return
        self._sending.update(key for key, _ in blocks)
        task = asyncio.get_running_loop().create_task(self._write(blocks, epoch, release))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def flush(self) -> None:
        """Wait for the writes sent (the worker took them; it writes in the background)."""
        while self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _write(
        self, blocks: Sequence[tuple[bytes, Held]], epoch: int, release: Callable[[int], None]
    ) -> None:
        try:
            ids = np.array([h.tokens for _, h in blocks], "<i4")
            req = self._frame(
                "write",
                records=tuple(h.record for _, h in blocks),
                parents=b"".join(h.parent for _, h in blocks),
                tokens=ids.tobytes(),
            )
            try:
                reply = await self._call(req, epoch)
            except Exception as exc:  # their bytes stay in memory only
                log.info("prefix cache: %s did not write K/V blocks: %s", self.where, exc)
                return
            taken = min(reply.done, len(blocks)) if reply.disk else 0
            for key, h in blocks[:taken]:
                self._add(key, h.parent, h.tokens)
        finally:
            for key, h in blocks:
                self._sending.discard(key)
                release(h.record)

    async def clear(self) -> int:
        """Delete the worker's files of this part; -> how many (0 when it cannot answer:
        they stay there, forgotten here)."""
        self._index.clear()
        try:
            reply = await self._call(self._frame("clear"))
        except Exception as exc:
            log.warning("prefix cache: %s kept its K/V block files: %s", self.where, exc)
            return 0
        return reply.done

    # -- internals ------------------------------------------------------------------------

    def _frame(self, action: Action, **fields: Any) -> KVFiles:
        """A `kv_files` frame on this part; one with records names the worker's own."""
        host = self.host.regions[self.slot] if "records" in fields else None
        return KVFiles(action=action, model=self.model, part=self.part, kv_host=host, **fields)

    def _worker(self) -> WorkerHandle:
        slot = self.executor.slots[self.slot]
        h = slot.handle
        if h is None or h.state != "ready":
            raise WorkerDied(f"the model worker {slot.spec.group} is not ready")
        return h

    async def _call(self, req: KVFiles, epoch: int | None = None) -> KVFilesReply:
        """`req` to the worker; with `epoch`, only while its records are that epoch's (the
        handle is taken in the same turn of the loop as the check: a later connection
        would be another handle, whose call fails)."""
        worker = self._worker()
        if epoch is not None and epoch != self.host.epoch:
            raise WorkerDied(f"{self.where} reconnected: its host records are empty")
        reply = await worker.call(req)
        assert isinstance(reply, KVFilesReply)
        for i in range(0, len(reply.gone), KEY_BYTES):
            self._index.pop(reply.gone[i : i + KEY_BYTES], None)
        return reply

    def _add(self, key: bytes, parent: bytes, tokens: tuple[int, ...]) -> None:
        self._index[key] = BlockFile(key, parent, tokens, self.file_bytes, time.time())
