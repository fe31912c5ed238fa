"""A disk tier's pause after the OS refused a write (a full disk): no writes for
DISK_RETRY_S, doubling with each failure up to DISK_RETRY_MAX_S, and one warning, not a
traceback per write. Both disk tiers use it: the snapshots (cache/prefix_cache.py) and
the block files (engine/kv/block_store.py)."""

from __future__ import annotations

import errno
import logging
import time
from collections.abc import Callable

DISK_RETRY_S, DISK_RETRY_MAX_S = 30.0, 600.0


class DiskBackoff:
    def __init__(
        self,
        log: logging.Logger,
        what: str,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """log: the tier's logger; what: the warning's subject ("snapshots ...; they stay
        in memory")."""
        self.log = log
        self.what = what
        self.clock = clock
        self.error: str | None = None  # the OS's reason while writes are paused
        self._retry_at = 0.0  # the clock's; writes wait for it after a failure
        self._backoff = DISK_RETRY_S

    def ready(self) -> bool:
        """Whether a write may be tried now."""
        return self.clock() >= self._retry_at

    def failed(self, exc: OSError) -> None:
        """The OS refused a write: pause writing and say so once."""
        name = errno.errorcode.get(exc.errno or 0, "")
        problem = f"{exc.strerror or exc}{f' ({name})' if name else ''}"
        self._retry_at = self.clock() + self._backoff
        if self.error is None:
            subject, _, outcome = self.what.partition("; ")
            self.log.warning(
                "prefix cache: cannot write %s to disk: %s; %s, next try in %.0f s",
                subject,
                problem,
                outcome,
                self._backoff,
            )
        self.error = problem
        self._backoff = min(2 * self._backoff, DISK_RETRY_MAX_S)

    def works(self) -> None:
        """A write landed: writing goes on as usual."""
        if self.error is not None:
            subject = self.what.partition("; ")[0]
            self.log.info("prefix cache: writing %s to disk again", subject)
        self.error = None
        self._backoff = DISK_RETRY_S
