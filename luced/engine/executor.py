"""The target's worker processes as the daemon sees them: spawn, handshake, call, supervise.

Each worker is `python -m luced.runtime.worker` holding a socketpair end inherited by fd
(no socket file to clean up). The daemon talks to it only through `luced.ipc` frames;
bulk data lives in daemon-owned shared memory. A watcher task notices the process
exit: the handle turns `dead`, any call in flight fails with `WorkerDied`, and the
`Executor` that owns it starts a replacement with the same share.

Deadlines bound a worker's silence as the daemon's loop saw it (`watchdog.Silence`): a
daemon that stalls kills nobody. A start or a load (`frames.SLOW`) may take as long as
it needs while the worker sends progress notes; `Deadlines.start` bounds the silence
between them. Any other call gets `Deadlines.call` plus 20x its expected time.

    Executor   the pool: one Slot per pipeline worker (layer order) + the draft's own
               worker when it has one; start, restart with backoff, close, describe
    Slot       a fixed share (WorkerSpec + WorkerPlan) and whichever process serves it now
    WorkerHandle   one process: start + hello, load, call, stop
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from luced.engine.placement import WorkerPlan, WorkerSpec
from luced.engine.watchdog import Silence
from luced.ipc import links
from luced.ipc.channel import AsyncChannel, ChannelClosedError, RemoteError
from luced.ipc.frames import (
    KERNELS_FALLBACK,
    SLOW,
    Carry,
    DraftBlock,
    Forward,
    Hello,
    HelloReply,
    KVExport,
    KVImport,
    Load,
    LoadDraft,
    LoadDraftReply,
    LoadExperts,
    LoadExpertsReply,
    LoadReply,
    Reply,
    Request,
    Shutdown,
)

log = logging.getLogger(__name__)


def kernels_summary(workers: list[dict]) -> str | None:
    """What runs the workers' matrices and decode attention (`describe`'s "kernels"): one
    description when they agree, else each group's; None before any load."""
    by_group = {w["group"]: w["kernels"] for w in workers if w.get("kernels")}
    if len(set(by_group.values())) <= 1:
        return next(iter(by_group.values()), None)
    return ", ".join(f"{group}: {kernels}" for group, kernels in by_group.items())


class WorkerDied(RuntimeError):
    """The worker process exited (or its socket closed) before answering."""


class WorkerReplyError(RuntimeError):
    """The worker answered a request with an error (it lives on; the request failed)."""


START_FLAG = "--worker-start-timeout"
RESTART_MAX_S = 30.0  # the longest wait between restarts of a local worker
RECONNECT_MAX_S = 5.0  # ... and between attempts to reach a worker on another host


@dataclass(frozen=True)
class Deadlines:
    """call: the floor of a call's deadline (a hung worker is killed and restarted);
    start: the longest silence of a starting or loading worker, between its progress
    notes (seconds)."""

    call: float = 30.0
    start: float = 60.0


def error_text(exc: BaseException) -> str:
    """An exception as one line that is never blank (a bare TimeoutError() has no text)."""
    return str(exc) or f"{type(exc).__name__} (with no message)"


def _worker_env() -> dict[str, str]:
    # systemd accepts sd_notify only from the main process: keep workers off the socket.
    env = {k: v for k, v in os.environ.items() if k != "NOTIFY_SOCKET"}
    env["PYTHONUNBUFFERED"] = "1"
    return env


# A call may take this many times its expected duration (the worker's measured seconds
# per token times the call's tokens) on top of the floor before the worker counts as hung.
DEADLINE_SLACK = 20.0


def call_tokens(req: Request) -> int:
    """The tokens a call works on: what its duration scales with."""
    if isinstance(req, Forward):
        return req.n_tokens
    if isinstance(req, DraftBlock):
        return req.block_size
    if isinstance(req, KVExport | KVImport):
        return max(1, req.position)
    return 1


class WorkerHandle:
    def __init__(
        self,
        spec: WorkerSpec,
        instance: str,
        on_exit: Callable[[WorkerHandle, int], None] | None = None,
        deadlines: Deadlines = Deadlines(),
        *,
        inbox: bool = False,
    ) -> None:
        """A worker that misses a deadline is hung (stopped, deadlocked, swapping): it is
        killed, and its slot restarts it like any dead worker (one that never started is
        left to whoever started it)."""
        self.spec = spec
        self.wants_inbox = inbox
        # Our end of the worker's inbox: worker-to-worker links are handed over through it
        # (luced.ipc.links); None for a worker that takes part in none.
        self.inbox: socket.socket | None = None
        self.instance = instance
        self.on_exit = on_exit
        self.deadlines = deadlines
        self.seconds_per_token: float | None = None  # forwards, smoothed
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

    async def start(self) -> None:
        """Spawn the process and say hello: as long as it takes while the worker reports
        progress (torch's import, opening the devices), killed after `deadlines.start`
        seconds without a word."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        cmd = [self.spec.python, "-m", "luced.runtime.worker", "--fd", str(theirs.fileno())]
        cmd += ["--group", self.spec.group, "--devices", ",".join(self.spec.devices)]
        if self.spec.threads:
            cmd += ["--threads", str(self.spec.threads)]
        passed = [theirs]
        if self.wants_inbox:
            self.inbox, their_inbox = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            cmd += ["--inbox", str(their_inbox.fileno())]
            passed.append(their_inbox)
        try:
            self.proc = await asyncio.create_subprocess_exec(
                *cmd,
                pass_fds=tuple(s.fileno() for s in passed),
                stdin=asyncio.subprocess.DEVNULL,
                env=_worker_env(),
            )
        except OSError as exc:
            ours.close()
            self._close_inbox()
            raise WorkerDied(f"cannot start worker {self.spec.group}: {exc}") from exc
        finally:
            for s in passed:
                s.close()
        self.channel = await AsyncChannel.from_socket(ours)
        self._watcher = asyncio.create_task(self._watch(), name=f"watch-{self.spec.group}")
        reply = await self.call(Hello(instance=self.instance))
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
        if KERNELS_FALLBACK in reply.kernels:
            log.warning(
                "worker %s runs %s: decode runs several times slower than on luced's native "
                'kernels (install gcc and restart, or set kernels = "torch" to choose this)',
                self.spec.group,
                reply.kernels,
            )
        return reply

    async def load_draft(self, req: LoadDraft) -> LoadDraftReply:
        """Load a DFlash draft; a draft-only worker is ready once it holds one."""
        if self.loaded is None:
            self.state = "loading"
        reply = await self.call(req)
        assert isinstance(reply, LoadDraftReply)
        self.state = "ready"
        return reply

    async def load_experts(self, req: LoadExperts) -> LoadExpertsReply:
        """Load the MoE expert worker's experts; it is ready once it holds them."""
        self.state = "loading"
        reply = await self.call(req)
        assert isinstance(reply, LoadExpertsReply)
        self.state = "ready"
        return reply

    async def call(self, req: Request, carry: Carry | None = None) -> Reply:
        """One request, one reply, within a deadline on the worker's silence: a start or
        a load (`SLOW`: their length is the machine's and the model's) may take as long
        as it needs while progress notes come. `carry`: relays through the worker's hops
        (workers on other hosts). Raises WorkerDied / WorkerReplyError."""
        reply, _ = await self.exchange(req, carry)
        return reply

    async def exchange(
        self, req: Request, carry: Carry | None = None
    ) -> tuple[Reply, tuple[bytes, ...]]:
        """`call`, -> (the reply, the bytes of the regions its carry got)."""
        if self.state == "dead" or self.channel is None:
            raise WorkerDied(f"worker {self.spec.group} is not running")
        limit = self.deadlines.start if isinstance(req, SLOW) else self.deadline(req)
        async with self._call_lock:
            began = time.monotonic()
            try:
                # asyncio.timeout (in Silence), not wait_for: on 3.11 wait_for loses a
                # cancel that lands as the reply arrives, and a cancelled decode loop runs on.
                async with Silence(limit) as silence:
                    reply, carried = await self.channel.exchange(req, carry, silence.heard)
            except RemoteError as exc:
                raise WorkerReplyError(exc.error) from None
            except (ChannelClosedError, ConnectionError, asyncio.IncompleteReadError) as exc:
                self.state = "dead"
                self._lost()
                raise WorkerDied(f"worker {self.spec.group} ({self.where}) died") from exc
            except TimeoutError:
                self._kill_hung(req, limit)
                raise self._silence_error(req, silence) from None
        if isinstance(req, Forward):
            self._observe_speed((time.monotonic() - began) / req.n_tokens)
        return reply, carried

    @property
    def where(self) -> str:
        """How logs and errors name the process: its pid (on another host, its address)."""
        return f"pid {self.pid}"

    def _lost(self) -> None:
        """The connection broke (the process watcher reports a local worker's exit)."""

    def deadline(self, req: Request) -> float:
        """Seconds the worker gets for `req`: the floor plus DEADLINE_SLACK times what
        its size should take at this worker's measured speed (10 floors before any
        forward was measured: a first call may warm caches up)."""
        if self.seconds_per_token is None:
            return 10 * self.deadlines.call
        expected = self.seconds_per_token * call_tokens(req)
        return self.deadlines.call + DEADLINE_SLACK * expected

    def _observe_speed(self, seconds_per_token: float) -> None:
        old = self.seconds_per_token
        self.seconds_per_token = (
            seconds_per_token if old is None else old + 0.1 * (seconds_per_token - old)
        )

    def _kill_hung(self, req: Request, deadline: float) -> None:
        log.error(
            "worker %s (%s) missed its deadline of %.1f s for %s: killing it",
            self.spec.group,
            self.where,
            deadline,
            req.OP,
        )
        # The watcher restarts a worker that had started; a start's failure is its caller's.
        self.state = "dead" if self.hello is not None else "stopping"
        if self.proc is not None and self.proc.returncode is None:
            self.proc.kill()  # SIGKILL ends a stopped process too

    def _silence_error(self, req: Request, silence: Silence) -> WorkerDied:
        who = f"worker {self.spec.group} ({self.where})"
        if not isinstance(req, SLOW):
            return WorkerDied(
                f"{who} did not answer {req.OP} within {silence.limit:.1f} s; "
                "it was killed and restarts"
            )
        since = f"it said {silence.stage!r}" if silence.stage else f"it was sent {req.OP}"
        doing = "start" if isinstance(req, Hello) else f"finish {req.OP}"
        return WorkerDied(
            f"{who} did not {doing}: nothing from it for {silence.limit:g} s since {since}, "
            "and a starting or loading worker reports progress twice a second, so it was "
            f"stopped or stuck; it was killed. If this machine is that slow, raise "
            f"{START_FLAG} (now {silence.limit:g} s)"
        )

    async def _watch(self) -> None:
        assert self.proc is not None
        code = await self.proc.wait()
        self.exit_code = code
        was_stopping = self.state == "stopping"
        self.state = "dead"
        self._close_inbox()
        if self.channel is not None:
            await self.channel.close()
        if not was_stopping:
            log.error("worker %s (pid %d) exited with code %s", self.spec.group, self.pid, code)
            if self.on_exit is not None:
                self.on_exit(self, code)

    def _close_inbox(self) -> None:
        if self.inbox is not None:
            self.inbox.close()
            self.inbox = None

    async def stop(self, timeout: float = 5.0) -> None:
        """Ask the worker to exit; kill it if it does not within `timeout`."""
        if self.proc is None or self.proc.returncode is not None:
            return
        self.state = "stopping"
        with contextlib.suppress(Exception):
            async with asyncio.timeout(timeout):
                await self.channel.call(Shutdown())
        try:
            async with asyncio.timeout(timeout):
                await self.proc.wait()
        except TimeoutError:
            self.proc.kill()
            await self.proc.wait()
        if self._watcher is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher

    def describe(self) -> dict:
        return {
            "group": self.spec.group,
            "devices": self.spec.names(),
            "pid": self.pid,
            "state": self.state,
            "layers": list(self.loaded.layers) if self.loaded else None,
            "uptime_s": round(time.time() - self.started_at, 1),
            "threads": self.spec.threads,  # torch threads (None: torch's own default)
            "python": self.spec.python,
            "kernels": self.loaded.kernels if self.loaded else None,  # native.describe
        }


class Slot:
    """One worker's fixed share, and whichever process serves it now. The draft's own
    worker and the MoE expert worker (``plan`` None, ``role`` "draft" / "experts") are
    slots outside the pipeline."""

    def __init__(
        self, index: int, spec: WorkerSpec, plan: WorkerPlan | None, role: str = "pipeline"
    ) -> None:
        self.index = index
        self.spec = spec
        self.plan = plan
        self.role = role
        self.handle: WorkerHandle | None = None
        self.restarts = 0
        self.restart_task: asyncio.Task | None = None
        self.restart_error: str | None = None  # why the last restart failed, until one works
        self.detail: dict = {}  # what the loader wants `describe` to show (the experts held)

    @property
    def share(self) -> str:
        if self.plan is None:
            return "the draft" if self.role == "draft" else "the cold experts"
        return "layers [{}, {})".format(*self.plan.layers)


# Loads a freshly started worker with its slot's share (the target's layers, or the draft).
Loader = Callable[[Slot, WorkerHandle], Awaitable[object]]
# Makes the handle of a worker on another host (engine/remote.py), given its exit callback.
RemoteFactory = Callable[[WorkerSpec, Callable[[WorkerHandle, int], None]], WorkerHandle]


class Executor:
    """The target's worker pool: starts each slot's process and loads it (``loader``),
    restarts a dead one in the background with the same share, stops them all.

    ``in_sync`` turns False when a pipeline worker dies: the survivors' KV no longer
    matches the restarted one's, so the target must reset every shard before the next
    forward (it sets ``in_sync`` again)."""

    def __init__(
        self,
        instance: str,
        workers: tuple[tuple[WorkerSpec, WorkerPlan], ...],
        loader: Loader,
        on_state_change: Callable[[], None] | None = None,
        deadlines: Deadlines = Deadlines(),
        *,
        inboxes: bool = False,  # pipeline workers get an inbox (they link to the experts)
        remote: RemoteFactory | None = None,  # handles of workers on other hosts
    ) -> None:
        self.instance = instance
        self.remote = remote
        self.deadlines = deadlines  # each worker's (WorkerHandle)
        self.slots = [Slot(i, spec, plan) for i, (spec, plan) in enumerate(workers)]
        self.draft_slot: Slot | None = None  # the draft's own worker, when it has one
        self.expert_slot: Slot | None = None  # the MoE expert worker, when there is one
        self.inboxes = inboxes
        self.loader = loader
        self.on_state_change = on_state_change
        self.in_sync = True
        self._closing = False

    @property
    def ready(self) -> bool:
        """Every pipeline worker and the draft's (the expert worker is not needed: its
        layers fall back in process while it restarts)."""
        return all(s.handle is not None and s.handle.state == "ready" for s in self._needed())

    def _needed(self) -> list[Slot]:
        return [*self.slots, *([self.draft_slot] if self.draft_slot else [])]

    @property
    def restart_error(self) -> str | None:
        """Why a needed worker's last restart attempt failed (it is retried with backoff);
        None when no attempt has failed since each worker last started."""
        return next((s.restart_error for s in self._needed() if s.restart_error), None)

    def _all_slots(self) -> list[Slot]:
        extra = [s for s in (self.draft_slot, self.expert_slot) if s is not None]
        return [*self.slots, *extra]

    def expert_worker(self) -> WorkerHandle | None:
        """The expert worker when it is ready, else None."""
        h = self.expert_slot.handle if self.expert_slot else None
        return h if h is not None and h.state == "ready" else None

    def link_experts(self, target: WorkerHandle) -> bool:
        """Hand a fresh worker-to-worker link to a pipeline worker and the expert worker;
        False when either is not there to take it."""
        experts = self.expert_worker()
        if experts is None or experts.inbox is None or target.inbox is None:
            return False
        caller, server = links.link_pair()
        try:
            links.hand_over(target.inbox, caller)
            links.hand_over(experts.inbox, server)
        except OSError as exc:  # one of them just died: its restart links again
            log.warning("cannot link worker %s to the expert worker: %s", target.spec.group, exc)
            return False
        return True

    def workers(self) -> list[WorkerHandle]:
        """The pipeline's handles in layer order; WorkerDied when one is not ready."""
        handles = [s.handle for s in self.slots]
        for slot, h in zip(self.slots, handles, strict=True):
            if h is None or h.state != "ready":
                raise WorkerDied(f"the model worker {slot.spec.group} is not ready")
        return handles  # type: ignore[return-value]

    def draft_worker(self) -> WorkerHandle:
        """The draft's own worker when it has one, else the (only) target worker."""
        if self.draft_slot is None:
            return self.workers()[0]
        h = self.draft_slot.handle
        if h is None or h.state != "ready":
            raise WorkerDied(f"the draft worker {self.draft_slot.spec.group} is not ready")
        return h

    async def start(self) -> None:
        """Start and load every pipeline worker, concurrently; the first error is raised."""
        results = await asyncio.gather(
            *(self.start_slot(s) for s in self.slots), return_exceptions=True
        )
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise errors[0]

    async def add_draft_slot(self, spec: WorkerSpec) -> object:
        """Start the draft's own worker; returns what the loader answered."""
        self.draft_slot = Slot(len(self.slots), spec, None, "draft")
        return await self.start_slot(self.draft_slot)

    async def add_expert_slot(self, spec: WorkerSpec) -> object:
        """Start the MoE expert worker; returns what the loader answered."""
        self.expert_slot = Slot(len(self.slots) + 1, spec, None, "experts")
        return await self.start_slot(self.expert_slot)

    async def start_slot(self, slot: Slot) -> object:
        inbox = slot.role == "experts" or (slot.role == "pipeline" and self.inboxes)
        if slot.spec.remote:
            if self.remote is None:
                raise WorkerDied(f"worker {slot.spec.group} is on another host: no worker key")
            worker = self.remote(slot.spec, self._exit_handler(slot))
        else:
            worker = WorkerHandle(
                slot.spec, self.instance, self._exit_handler(slot), self.deadlines, inbox=inbox
            )
        slot.handle = worker
        self._notify()
        await worker.start()
        result = await self.loader(slot, worker)
        self._notify()
        return result

    def _notify(self) -> None:
        if self.on_state_change is not None:
            self.on_state_change()

    def _exit_handler(self, slot: Slot) -> Callable[[WorkerHandle, int], None]:
        def on_exit(worker: WorkerHandle, code: int) -> None:
            if slot.role == "pipeline":  # (the draft and the experts keep no sequence state)
                self.in_sync = False
            self._notify()
            if not self._closing and slot.restart_task is None and worker is slot.handle:
                loop = asyncio.get_running_loop()
                slot.restart_task = loop.create_task(self._restart(slot))

        return on_exit

    async def _restart(self, slot: Slot) -> None:
        """Replace one dead worker with the same share; the others keep their weights. A
        worker on another host is reconnected (someone else runs it), soon after it is back."""
        delay, longest = 0.5, (RECONNECT_MAX_S if slot.spec.remote else RESTART_MAX_S)
        verb = "reconnecting to" if slot.spec.remote else "restarting"
        try:
            while not self._closing:
                slot.restarts += 1
                log.warning(
                    "%s worker %s, %s (restart #%d)",
                    verb,
                    slot.spec.group,
                    slot.share,
                    slot.restarts,
                )
                try:
                    await self.start_slot(slot)
                    slot.restart_error = None
                    return
                except Exception as exc:  # keep trying: a transient failure must not stick
                    log.error(
                        "worker %s (%s) restart #%d failed: %s; trying again in %.1f s",
                        slot.spec.group,
                        slot.share,
                        slot.restarts,
                        error_text(exc),
                        delay,
                    )
                    if slot.handle is not None:
                        await slot.handle.stop()
                    slot.restart_error = error_text(exc)
                    self._notify()  # the engine fails what waits for it (core.py)
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, longest)
        finally:
            slot.restart_task = None

    async def close(self) -> None:
        self._closing = True
        slots = self._all_slots()
        for slot in slots:
            if slot.restart_task is not None:
                slot.restart_task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await slot.restart_task
        await asyncio.gather(*(s.handle.stop() for s in slots if s.handle is not None))

    def describe(self) -> list[dict]:
        """One entry per shard: group, devices, layer range, worker pid and state."""
        out = []
        for slot in self.slots:
            if slot.handle is None:
                continue
            assert slot.plan is not None
            info = slot.handle.describe()
            for device, layers in zip(slot.plan.devices, slot.plan.shard_ranges(), strict=True):
                shard = dict(info)
                shard["devices"] = [slot.spec.named(device)]
                shard["layers"] = list(layers)
                shard["restarts"] = slot.restarts
                out.append(shard)
        d = self.draft_slot
        if d is not None and d.handle is not None:
            info = {**d.handle.describe(), "devices": d.spec.names(), "layers": "draft"}
            out.append({**info, "role": "draft", "restarts": d.restarts})
        x = self.expert_slot
        if x is not None and x.handle is not None:
            info = {**x.handle.describe(), "devices": x.spec.names(), "layers": "experts"}
            out.append({**info, **x.detail, "role": "experts", "restarts": x.restarts})
        return out
