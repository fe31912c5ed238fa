"""A worker on another host as the daemon sees it: connect, authenticate, call, reconnect.

``RemoteWorker`` is a ``WorkerHandle`` whose process someone else runs (``luced worker
--listen`` by hand or by systemd): the daemon connects to it, and when the connection is
lost it reconnects (the executor's restart path, with backoff) and never starts, kills or
restarts the process::

    start      TCP connect + the key handshake (ipc/tcp.py) + hello with the identity
               (size, SHA-256) of every model file it may be told to load
    call       the frame, and its carry (frames/remote.py): what the frame reads of the
               daemon's memory is put inline (token ids, grammar masks, q rows), what it
               writes there comes back inline (sampled ids, logprobs, logits, captured
               ring cells) unless a hop relays it (``engine/hops.py``, given by the caller)
    heartbeat  a ping after a second without a call: the round trip (``lucectl status``),
               and a connection found dead while idle
    lost       the connection closed, a missed deadline or a missed heartbeat: the handle is
               dead, the executor's watcher path runs (``on_exit``) and reconnects

What a frame reads or writes is the frame's own business (``Forward``'s tokens, outputs,
rings; ``DraftBlock``'s ring and outputs; a snapshot's regions): ``inline_carry`` lists it
per op. A KV Flash plan's slots, map and moves go inline and its qk scores come back; its
host records stay on the worker's host (its mirror of `kv_host` is its host tier: the
daemon never reads them), so a remote shard pages to its own memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable

from luced.engine.executor import Deadlines, WorkerDied, WorkerHandle
from luced.engine.feature_ring import cells
from luced.engine.placement import WorkerSpec
from luced.ipc import tcp
from luced.ipc.channel import AsyncChannel
from luced.ipc.frames import (
    Carry,
    DraftBlock,
    FileIdentity,
    Forward,
    Hello,
    HelloReply,
    KVExport,
    KVImport,
    Load,
    LoadReply,
    Ping,
    Put,
    Reply,
    Request,
    Shutdown,
)
from luced.ipc.regions import Region, buffer
from luced.ipc.shm import ShmOwner

log = logging.getLogger(__name__)

HEARTBEAT_S = 1.0  # a ping after this long without a call


@dataclasses.dataclass(frozen=True)
class RemoteSettings:
    """What connecting to workers on other hosts takes: the shared key, and each model file
    a worker may be told to load (the daemon's path -> size and hash)."""

    key: bytes
    files: dict[str, FileIdentity]
    heartbeat: float = HEARTBEAT_S


def inline_carry(
    req: Request, relayed: Carry | None, layers: tuple[int, int] | None
) -> tuple[list[Region], Carry]:
    """The regions `req` reads from the daemon's memory (to put) and the carry, getting
    what it writes there, less what its hops relay; `layers` (a pipeline worker's) picks
    the ring cells its captures write."""
    reads: list[Region] = []
    writes: list[Region] = []
    if isinstance(req, Forward):
        n, n_out = req.n_tokens, req.n_out
        for region, rows in ((req.tokens, n), (req.hidden_in, n), (req.allowed, n_out)):
            if region is not None:
                reads.append(region.rows(0, rows))
        if req.draft_probs is not None:
            reads.append(req.draft_probs.rows(0, max(s.q_row + s.n - 1 for s in req.spans)))
        for span in req.spans:  # KV Flash: the moves ride in the span; the qk scores out
            if span.kv_scores is not None:
                writes.append(span.kv_scores)
        # kv_host travels neither way: only this worker reads and writes its records, so
        # its mirror of them is its own host tier, in its host's memory.
        for name, region in req.outputs.items():
            writes.append(region.rows(0, n if name == "hidden" else n_out))
        held = [
            j for j, layer in enumerate(req.capture) if layers and layers[0] <= layer < layers[1]
        ]
        for span in req.spans:
            if held and span.ring is not None:
                writes += cells(span.ring, span.start, span.n, (held[0], held[-1] + 1))
    elif isinstance(req, DraftBlock):
        writes.append(req.outputs["ids"].rows(0, req.block_size or 2))
        if "probs" in req.outputs:
            writes.append(req.outputs["probs"].rows(0, (req.block_size or 2) - 1))
    elif isinstance(req, KVExport):
        writes += req.regions.values()
    elif isinstance(req, KVImport):
        reads += [*req.regions.values(), req.tokens.rows(0, req.position)]
    relays = (*relayed.relay_in, *relayed.relay_out) if relayed else ()
    moved = {r for relay in relays for r in relay.regions}
    return [r for r in reads if r not in moved], Carry(
        get=tuple(r for r in writes if r not in moved),
        relay_in=relayed.relay_in if relayed else (),
        relay_out=relayed.relay_out if relayed else (),
        forget=relayed.forget if relayed else (),
    )


class RemoteWorker(WorkerHandle):
    """A worker on another host (module docstring)."""

    def __init__(
        self,
        spec: WorkerSpec,
        instance: str,
        owner: ShmOwner,
        settings: RemoteSettings,
        on_exit: Callable[[WorkerHandle, int], None] | None = None,
        deadlines: Deadlines | None = None,
    ) -> None:
        super().__init__(spec, instance, on_exit, deadlines or Deadlines())
        self.owner = owner
        self.settings = settings
        self.layers: tuple[int, int] | None = None  # a pipeline worker's, once loaded
        self.rtt_s: float | None = None  # the last heartbeat's round trip
        self.sent_bytes = 0  # inline region bytes each way (relays count on their hops)
        self.received_bytes = 0
        self._last_call = time.monotonic()
        self._gone = False  # the loss was reported

    @property
    def pid(self) -> int | None:
        return self.hello.pid if self.hello else None

    @property
    def where(self) -> str:
        return f"tcp://{self.spec.address}"

    async def start(self) -> None:
        """Connect, authenticate both ways and say hello (the worker checks the files)."""
        host, port = tcp.parse_address(self.spec.address)
        try:
            reader, writer = await tcp.connect(host, port, self.settings.key, self.deadlines.start)
        except (OSError, TimeoutError) as exc:
            raise WorkerDied(f"cannot reach worker tcp://{self.spec.address}: {exc}") from None
        self.channel = AsyncChannel(reader, writer)
        hello = Hello(instance=self.instance, files=self.settings.files)
        try:
            reply = await self.call(hello)
        except BaseException:
            await self._close()
            raise
        assert isinstance(reply, HelloReply)
        self.hello = reply
        self.state = "idle"
        self._watcher = asyncio.create_task(self._heartbeat(), name=f"heartbeat-{self.spec.group}")
        log.info(
            "worker tcp://%s connected (pid %d there, %s)",
            self.spec.address, reply.pid, reply.versions.get("torch", "?"),
        )  # fmt: skip

    async def load(self, req: Load) -> LoadReply:
        reply = await super().load(req)
        self.layers = reply.layers  # its captures' ring cells come back inline
        return reply

    async def exchange(
        self, req: Request, carry: Carry | None = None
    ) -> tuple[Reply, tuple[bytes, ...]]:
        """The frame with its inline carry; what it got is written into the daemon's memory."""
        try:
            reads, full = inline_carry(req, carry, self.layers)
        except ValueError as exc:
            raise WorkerDied(f"worker tcp://{self.spec.address}: {exc}") from None
        given = carry.put if carry is not None else ()  # rows the caller read itself
        puts = given + tuple(Put(region=r, data=bytes(self._bytes(r))) for r in reads)
        full = dataclasses.replace(full, put=puts)
        self._last_call = time.monotonic()
        reply, carried = await super().exchange(req, full)
        self._last_call = time.monotonic()
        if len(carried) != len(full.get):
            raise WorkerDied(f"worker tcp://{self.spec.address} returned {len(carried)} of "
                             f"{len(full.get)} regions")  # fmt: skip
        for region, data in zip(full.get, carried, strict=True):
            self._bytes(region)[:] = data
        self.sent_bytes += sum(len(p.data) for p in puts)
        self.received_bytes += sum(map(len, carried))
        return reply, carried

    def _bytes(self, region: Region) -> memoryview:
        segment = self.owner.segment(region.segment)
        if segment is None:
            raise WorkerDied(f"no segment {region.segment} in this daemon")
        return buffer(segment, region)

    async def _heartbeat(self) -> None:
        """Ping when idle: the round trip, and a dead connection noticed between calls."""
        while self.state != "dead":
            await asyncio.sleep(self.settings.heartbeat)
            if (
                self._call_lock.locked()
                or time.monotonic() - self._last_call < self.settings.heartbeat
            ):
                continue
            began = time.monotonic()
            try:
                await self.call(Ping())
            except Exception as exc:
                if self.state != "stopping":
                    log.error("worker tcp://%s: heartbeat failed: %s", self.spec.address, exc)
                    self._lost()
                return
            self.rtt_s = time.monotonic() - began

    def _lost(self) -> None:
        """The connection is gone: the handle is dead and, if it had started, the executor
        reconnects (as it restarts a local worker whose process exited)."""
        if self.state == "stopping" or self._gone:
            return
        self._gone = True
        self.state = "dead"
        asyncio.get_running_loop().create_task(self._close())
        if self.hello is not None and self.on_exit is not None:
            self.on_exit(self, -1)

    def _kill_hung(self, req: Request, deadline: float) -> None:
        log.error(
            "worker tcp://%s missed its deadline of %.1f s for %s: closing its connection",
            self.spec.address, deadline, req.OP,
        )  # fmt: skip
        self._lost()

    async def _close(self) -> None:
        if self.channel is not None:
            with contextlib.suppress(Exception):
                await self.channel.close()

    async def stop(self, timeout: float = 5.0) -> None:
        """End this connection (the worker lives on and waits for the next daemon)."""
        if self.channel is None or self.state == "stopping":
            return
        alive = self.state != "dead"
        self.state = "stopping"
        if alive:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(timeout):
                    await self.channel.call(Shutdown())
        await self._close()
        if self._watcher is not None and self._watcher is not asyncio.current_task():
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher

    def describe(self) -> dict:
        return {
            **super().describe(),
            "address": self.spec.address,
            "link": "tcp",
            "rtt_ms": None if self.rtt_s is None else round(self.rtt_s * 1000, 2),
            "sent_bytes": self.sent_bytes,
            "received_bytes": self.received_bytes,
            "python": None,  # the remote host's own
        }
