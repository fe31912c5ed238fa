"""A real `luced serve` subprocess on a free loopback port, for end-to-end tests."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import ClassVar

from prometheus_client.parser import text_string_to_metric_families


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class DaemonProcess:
    # Started and not yet stopped: tests/e2e/conftest.py stops what a failed test left.
    running: ClassVar[set[DaemonProcess]] = set()

    def __init__(self, model: Path | None, tmp: Path, *extra: str, env: dict | None = None) -> None:
        """model: the GGUF to serve (MODEL); None when `extra` names several models."""
        self.port = free_port()
        self.model_name = model.name.removesuffix(".gguf") if model is not None else ""
        self.runtime_dir = tmp / "run"
        self.runtime_dir.mkdir(parents=True, exist_ok=True)
        self.admin_socket = self.runtime_dir / "admin.sock"
        self.log_path = tmp / "daemon.log"
        self.args = [
            sys.executable,
            "-m",
            "luced.cli",
            "serve",
            *([str(model)] if model is not None else []),
            "--port",
            str(self.port),
            "--runtime-dir",
            str(self.runtime_dir),
            "--admin-socket",
            str(self.admin_socket),
            "--threads",
            "1",
            *extra,
        ]
        self.env = {**os.environ, "LUCED_LOG_LEVEL": "info", **(env or {})}
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 120.0) -> DaemonProcess:
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            self.args, stdout=self._log, stderr=subprocess.STDOUT, env=self.env
        )
        DaemonProcess.running.add(self)
        try:
            self.wait_health(200, timeout)
        except BaseException:
            self.stop()  # closes the log too
            raise
        return self

    def health(self) -> tuple[int, dict]:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"{}")
        except OSError:
            return 0, {}

    def wait_health(self, status: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited with {self.proc.returncode}:\n{self.log()}")
            if self.health()[0] == status:
                return
            time.sleep(0.1)
        raise TimeoutError(f"/health never returned {status}:\n{self.log()}")

    def metrics(self) -> str:
        with urllib.request.urlopen(self.url + "/metrics", timeout=5) as r:
            return r.read().decode()

    def metric(self, name: str, labels: str = "", scraped: str | None = None) -> float:
        """The value of one /metrics sample (0 when absent): `name`, with the labels of
        `labels` (e.g. 'tier="memory"') among its own; the daemon adds model_name.
        `scraped`: a /metrics text to read instead (several samples of one moment)."""
        wanted = dict(kv.split("=", 1) for kv in labels.split(",") if kv)
        wanted = {k.strip(): v.strip().strip('"') for k, v in wanted.items()}
        text = self.metrics() if scraped is None else scraped
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and wanted.items() <= sample.labels.items():
                    return sample.value
        return 0.0

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""

    def worker_pid(self) -> int:
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "luced.serve.lucectl",
                "--socket",
                str(self.admin_socket),
                "--json",
                "workers",
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        return int(json.loads(out.stdout)["workers"][0]["pid"])

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        with contextlib.suppress(Exception):
            self._log.close()
        DaemonProcess.running.discard(self)
        return self.proc.returncode

    def instance(self) -> str:
        for line in self.log().splitlines():
            if "shared memory instance " in line:
                return line.rsplit("shared memory instance ", 1)[1].split()[0]
        raise AssertionError(f"no instance id in the daemon log:\n{self.log()}")

    def lucectl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        """`lucectl --socket <this daemon's> ARGS`, text output captured."""
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "luced.serve.lucectl",
                "--socket",
                str(self.admin_socket),
                *args,
            ],
            capture_output=True,
            text=True,
            check=check,
        )

    def lucectl_json(self, *args: str) -> dict:
        return json.loads(self.lucectl("--json", *args).stdout)

    def segments(self) -> list[str]:
        """This daemon's shared-memory segments still present in /dev/shm."""
        prefix = f"luced-{self.instance()}-"
        return [n for n in os.listdir("/dev/shm") if n.startswith(prefix)]
