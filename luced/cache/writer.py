"""One background thread that runs a disk tier's jobs in the order given, so that the
thread serving frames never waits for a disk: a worker on another host's own stores of
the prefix cache (runtime/kv_store.py, runtime/snapshot_store.py) write and delete there."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)


class DiskWriter:
    """A thread running jobs (callables) in order, started by the first job; `flush` waits
    for those given, `close` ends the thread after them (the next job starts another). A
    job's exception is logged, the next job runs. Jobs are given by one thread."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._jobs: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._thread: threading.Thread | None = None

    def put(self, job: Callable[[], None]) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
            self._thread.start()
        self._jobs.put(job)

    def flush(self) -> None:
        self._jobs.join()

    def close(self) -> None:
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                job()
            except Exception:
                log.exception("%s: a disk job failed", self.name)
            finally:
                self._jobs.task_done()
        self._jobs.task_done()
