"""Backend worker processes as the daemon sees them: spawn, handshake, call, supervise.

Each worker is `python -m luced.runtime.worker` holding a socketpair end inherited by fd
(no socket file to clean up). The daemon talks to it only through `luced.ipc` frames;
bulk data lives in daemon-owned shared memory. A watcher task notices the process
exit: the handle turns `dead`, any call in flight fails with `WorkerDied`, and the
supervisor (`on_exit`) decides about a restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from luced.ipc.channel import AsyncChannel, ChannelClosedError, RemoteError
from luced.ipc.frames import (
    Hello,
    HelloReply,
    Load,
    LoadDraft,
    LoadDraftReply,
    LoadReply,
    Reply,
    Request,
    Shutdown,
)

log = logging.getLogger(__name__)


class WorkerDied(RuntimeError):
    """The worker process exited (or its socket closed) before answering."""


class WorkerError(RuntimeError):
    """The worker answered a request with an error."""


@dataclass(frozen=True)
class WorkerSpec:
    group: str  # backend group name: "cpu", "cpu:1", "cuda", ...
    devices: tuple[str, ...]
    python: str = sys.executable  # a group may bring its own interpreter (ROCm torch)
    threads: int | None = None


def _worker_env() -> dict[str, str]:
    # systemd accepts sd_notify only from the main process: keep workers off the socket.
    env = {k: v for k, v in os.environ.items() if k != "NOTIFY_SOCKET"}
    env["PYTHONUNBUFFERED"] = "1"
    return env


class WorkerHandle:
    def __init__(
        self,
        spec: WorkerSpec,
        instance: str,
        on_exit: Callable[[WorkerHandle, int], None] | None = None,
    ) -> None:
        self.spec = spec
        self.instance = instance
        self.on_exit = on_exit
        self.state = "starting"  # starting -> idle -> loading -> ready; dead at any time
        self.proc: asyncio.subprocess.Process | None = None
        self.channel: AsyncChannel | None = None
        self.hello: HelloReply | None = None
        self.loaded: LoadReply | None = None
        self.started_at = time.time()
        self.exit_code: int | None = None
        self._watcher: asyncio.Task | None = None
        self._call_lock = asyncio.Lock()

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    async def start(self, timeout: float = 60.0) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        cmd = [self.spec.python, "-m", "luced.runtime.worker", "--fd", str(theirs.fileno())]
        cmd += ["--group", self.spec.group, "--devices", ",".join(self.spec.devices)]
        if self.spec.threads:
            cmd += ["--threads", str(self.spec.threads)]
        try:
            self.proc = await asyncio.create_subprocess_exec(
                *cmd,
                pass_fds=(theirs.fileno(),),
                stdin=asyncio.subprocess.DEVNULL,
                env=_worker_env(),
            )
        except OSError as exc:
            ours.close()
            raise WorkerDied(f"cannot start worker {self.spec.group}: {exc}") from exc
        finally:
            theirs.close()
        self.channel = await AsyncChannel.from_socket(ours)
        self._watcher = asyncio.create_task(self._watch(), name=f"watch-{self.spec.group}")
        reply = await asyncio.wait_for(self.call(Hello(instance=self.instance)), timeout)
        assert isinstance(reply, HelloReply)
        self.hello = reply
        self.state = "idle"
        log.info("worker %s started (pid %d, %s)", self.spec.group, self.pid, reply.versions)

    async def load(self, req: Load) -> LoadReply:
        self.state = "loading"
        reply = await self.call(req)
        assert isinstance(reply, LoadReply)
        self.loaded = reply
        self.state = "ready"
        return reply

    async def load_draft(self, req: LoadDraft) -> LoadDraftReply:
        """Load a DFlash draft; a draft-only worker is ready once it holds one."""
        if self.loaded is None:
            self.state = "loading"
        reply = await self.call(req)
        assert isinstance(reply, LoadDraftReply)
        self.state = "ready"
        return reply

    async def call(self, req: Request) -> Reply:
        """One request, one reply. Raises WorkerDied / WorkerError."""
        if self.state == "dead" or self.channel is None:
            raise WorkerDied(f"worker {self.spec.group} is not running")
        async with self._call_lock:
            try:
                return await self.channel.call(req)
            except RemoteError as exc:
                raise WorkerError(exc.error) from None
            except (ChannelClosedError, ConnectionError, asyncio.IncompleteReadError) as exc:
                self.state = "dead"
                raise WorkerDied(f"worker {self.spec.group} (pid {self.pid}) died") from exc

    async def _watch(self) -> None:
        assert self.proc is not None
        code = await self.proc.wait()
        self.exit_code = code
        was_stopping = self.state == "stopping"
        self.state = "dead"
        if self.channel is not None:
            await self.channel.close()
        if not was_stopping:
            log.error("worker %s (pid %d) exited with code %s", self.spec.group, self.pid, code)
            if self.on_exit is not None:
                self.on_exit(self, code)

    async def stop(self, timeout: float = 5.0) -> None:
        """Ask the worker to exit; kill it if it does not within `timeout`."""
        if self.proc is None or self.proc.returncode is not None:
            return
        self.state = "stopping"
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.channel.call(Shutdown()), timeout)
        try:
            await asyncio.wait_for(self.proc.wait(), timeout)
        except TimeoutError:
            self.proc.kill()
            await self.proc.wait()
        if self._watcher is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher

    def describe(self) -> dict:
        return {
            "group": self.spec.group,
            "devices": list(self.spec.devices),
            "pid": self.pid,
            "state": self.state,
            "layers": list(self.loaded.layers) if self.loaded else None,
            "uptime_s": round(time.time() - self.started_at, 1),
            "python": self.spec.python,
        }
