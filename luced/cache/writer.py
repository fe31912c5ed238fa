"""One background writer of a disk tier: queued items written one at a time, in the order
queued, by one thread, so that neither the daemon's event loop (the token stream) nor a
worker serving frames waits for a disk. A write the OS refuses (a full disk) pauses writing
(`DiskBackoff`, one warning) and the items queued meanwhile are skipped.

Users: the daemon's block store, whose K/V blocks and a hybrid's recurrent states
(engine/kv/block_store.py, engine/kv/state_store.py) share one, so their files are written
in order and a full disk pauses both; and a worker on another host, whose own stores of
the prefix cache (runtime/kv_store.py, runtime/snapshot_store.py) write and delete there.

An item's `done` follows it whether it was written, failed or skipped: on the event loop
that queued it where there is one (the daemon's tables belong to its loop), else in the
writer's thread. `pending` turns false in the same step as `done` runs.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable, Hashable
from dataclasses import dataclass

from luced.cache.backoff import DiskBackoff


@dataclass(frozen=True)
class _Item:
    key: Hashable | None  # None: not tracked by `pending` (a removal)
    what: str  # names it in a log line: "a K/V block"
    write: Callable[[], None]  # blocks: the writer's thread runs it
    done: Callable[[], None] | None
    loop: asyncio.AbstractEventLoop | None  # where `done` runs


class DiskWriter:
    """The module docstring's writer: a thread, started by the first item, ended by
    `close` (the next item starts another). Items are queued by one thread."""

    def __init__(
        self, log: logging.Logger, backoff: DiskBackoff | None = None, name: str = "disk-writer"
    ) -> None:
        """backoff: the tier's pause after a refused write; None: an OSError is logged and
        the next item written all the same (the caller's write may catch its own)."""
        self.log = log
        self.backoff = backoff
        self.name = name
        self.writes = self.errors = 0
        self._items: queue.Queue[_Item | None] = queue.Queue()
        self._pending: set[Hashable] = set()  # keys queued or being written
        self._mutex = threading.Lock()  # `_pending`, shared with the thread
        self._thread: threading.Thread | None = None

    def pending(self, key: Hashable) -> bool:
        """Whether `key` is queued or being written."""
        with self._mutex:
            return key in self._pending

    def ready(self) -> bool:
        """Whether a write may be tried now (not paused after a refused one)."""
        return self.backoff is None or self.backoff.ready()

    def queue(
        self,
        key: Hashable | None,
        what: str,
        write: Callable[[], None],
        done: Callable[[], None] | None = None,
    ) -> None:
        """Write `key` (`write`, in the thread) after the items queued before it, then call
        `done` (the module docstring); `what` names it in a log line ("a K/V block"). The
        caller checks `pending` first: a key is queued once."""
        try:
            loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        if key is not None:
            with self._mutex:
                self._pending.add(key)
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
            self._thread.start()
        self._items.put(_Item(key, what, write, done, loop))

    def flush(self) -> None:
        """Wait until everything queued is written (or failed, or skipped): a worker's
        thread, tests. On an event loop, `drain`."""
        self._items.join()

    async def drain(self) -> None:
        """`flush` from an event loop; the items' `done` have run when it returns."""
        # The thread hands each `done` to this loop before it counts the item done, so
        # they run before this coroutine resumes.
        await asyncio.to_thread(self._items.join)

    def close(self) -> None:
        """End the thread after the items queued."""
        if self._thread is not None:
            self._items.put(None)
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        while (item := self._items.get()) is not None:
            try:
                self._write(item)
            finally:
                if item.loop is not None and not item.loop.is_closed():
                    item.loop.call_soon_threadsafe(self._finish, item)
                else:
                    self._finish(item)
                self._items.task_done()
        self._items.task_done()

    def _write(self, item: _Item) -> None:
        backoff = self.backoff
        try:
            if backoff is None or backoff.ready():
                item.write()
                self.writes += 1
                if backoff is not None:
                    backoff.works()
        except OSError as exc:
            self.errors += 1
            if backoff is not None:
                backoff.failed(exc)
            else:
                self.log.warning("prefix cache: cannot write %s to disk: %s", item.what, exc)
        except Exception:
            self.errors += 1
            self.log.exception("prefix cache: writing %s to disk failed", item.what)

    def _finish(self, item: _Item) -> None:
        with self._mutex:
            self._pending.discard(item.key)
        if item.done is not None:
            item.done()
