"""End-to-end tests: a daemon a test started is stopped even when the test fails, so a
failure costs that test, not the processes and /dev/shm segments of the rest of the run."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from daemon_proc import DaemonProcess


@pytest.fixture(autouse=True)
def stop_leftover_daemons() -> Iterator[None]:
    before = set(DaemonProcess.running)
    yield
    for daemon in DaemonProcess.running - before:
        daemon.stop(timeout=10)  # SIGTERM, then SIGKILL
