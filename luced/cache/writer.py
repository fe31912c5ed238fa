"""One background writer of a disk tier: queued items written one at a time, each in a
thread, by one asyncio task that never stands in the token stream's way; a write the OS
refuses (a full disk) pauses writing (`DiskBackoff`, one warning) and the items queued
meanwhile are skipped. The block store's K/V blocks and a hybrid's recurrent states
(engine/kv/block_store.py, engine/kv/state_store.py) share one, so their files are
written in order and a full disk pauses both."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable, Hashable

from luced.cache.backoff import DiskBackoff


class DiskWriter:
    def __init__(self, log: logging.Logger, backoff: DiskBackoff) -> None:
        self.log = log
        self.backoff = backoff
        self.writes = self.errors = 0
        # (key, what, write, done): `write` blocks (a thread runs it), `done` always follows
        self._queue: deque[tuple[Hashable, str, Callable[[], None], Callable[[], None]]] = deque()
        self._pending: set[Hashable] = set()  # keys queued or being written
        self._task: asyncio.Task[None] | None = None

    def pending(self, key: Hashable) -> bool:
        """Whether `key` is queued or being written."""
        return key in self._pending

    def queue(
        self, key: Hashable, what: str, write: Callable[[], None], done: Callable[[], None]
    ) -> None:
        """Write `key` (`write`, in a thread) after the items queued before it, then call
        `done` (on the loop) whether it was written, failed or skipped; `what` names it in
        a log line ("a K/V block"). The caller checks `pending` first: a key is queued
        once."""
        self._pending.add(key)
        self._queue.append((key, what, write, done))
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def flush(self) -> None:
        """Wait until everything queued is written (or failed)."""
        while self._task is not None and not self._task.done():
            with contextlib.suppress(Exception):
                await asyncio.shield(self._task)

    async def _run(self) -> None:
        while self._queue:
            key, what, write, done = self._queue.popleft()
            try:
                if self.backoff.ready():
                    await asyncio.to_thread(write)
                    self.writes += 1
                    self.backoff.works()
            except OSError as exc:
                self.errors += 1
                self.backoff.failed(exc)
            except Exception:
                self.errors += 1
                self.log.exception("prefix cache: writing %s to disk failed", what)
            finally:
                self._pending.discard(key)
                done()
