"""Workers on other hosts in tests: host B (``tools/netlab.py``: a network namespace with a
/dev/shm of its own behind a bridge that can delay, cut or reset the wire; loopback with a
private /dev/shm where namespaces are not permitted) and ``luced worker --listen`` there."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from luced.engine.remote import RemoteSettings
from luced.ipc.files import identify
from luced.ipc.tcp import read_key
from tools import netlab

ROOT = Path(__file__).resolve().parent.parent


@contextlib.contextmanager
def two_hosts() -> Iterator[netlab.Lab | netlab.Loopback]:
    """Host B: a namespace behind the bridge, else loopback (said in the test log)."""
    try:
        lab = netlab.Lab().__enter__()
    except netlab.LabUnavailable as exc:
        loop = netlab.Loopback()
        why = "" if loop.isolated else f"; not even a private /dev/shm ({loop.why})"
        print(f"network namespaces unavailable ({exc}): host B is loopback{why}")
        yield loop
        return
    try:
        yield lab
    finally:
        lab.close()


def needs_wire(host: netlab.Lab | netlab.Loopback) -> None:
    if isinstance(host, netlab.Loopback):
        pytest.skip("network namespaces are not permitted here: no wire to delay, cut or reset")


def key_file(tmp: Path, text: str = "k" * 40) -> Path:
    path = tmp / f"worker-{len(text)}-{text[:4]}.key"
    path.write_text(text)
    path.chmod(0o600)
    return path


def settings(key: Path, *files: Path) -> RemoteSettings:
    return RemoteSettings(key=read_key(key), files={str(f): identify(f) for f in files})


class WorkerProc:
    """A ``luced worker --listen`` on host B; its log lines are kept in ``lines``."""

    def __init__(
        self,
        host: netlab.Lab | netlab.Loopback,
        key: Path,
        models: list[Path],
        port: int,
        threads: int = 1,
        args: tuple[str, ...] = (),
    ) -> None:
        self.host, self.key, self.models, self.port, self.threads = host, key, models, port, threads
        self.args = args  # more flags of `luced worker`
        self.proc: subprocess.Popen | None = None
        self.lines: list[str] = []

    @property
    def address(self) -> str:
        return f"{self.host.b}:{self.port}"

    def device(self, name: str = "cpu") -> str:
        return f"tcp://{self.address}/{name}"

    def start(self, timeout: float = 180) -> WorkerProc:
        argv = [sys.executable, "-m", "luced.cli", "worker", "--listen", self.address]
        argv += ["--worker-key-file", str(self.key), "--threads", str(self.threads)]
        for model in self.models:
            argv += ["--model", str(model)]
        argv += self.args
        env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
        since = len(self.lines)  # a restart: the last run's lines are there too
        self.proc = self.host.popen_b(argv, stderr=subprocess.PIPE, text=True, env=env)
        threading.Thread(target=self._read, args=(self.proc,), daemon=True).start()
        self.wait_log("listening on", timeout, since)
        return self

    def _read(self, proc: subprocess.Popen) -> None:
        for line in proc.stderr:
            self.lines.append(line.rstrip())

    def wait_log(self, pattern: str, timeout: float = 60, since: int = 0) -> str:
        """The first log line matching `pattern` (a regex) from line `since` on, waiting
        for it."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in self.lines[since:]:
                if re.search(pattern, line):
                    return line
            if self.proc is not None and self.proc.poll() is not None:
                raise AssertionError(
                    f"worker exited {self.proc.returncode}:\n" + "\n".join(self.lines)
                )
            time.sleep(0.1)
        raise AssertionError(f"no log line like {pattern!r}:\n" + "\n".join(self.lines[-30:]))

    def kill(self) -> None:
        """kill -9: the host's process dies mid-whatever."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)

    def stop(self) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        return self.proc.returncode
