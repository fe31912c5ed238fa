"""Hops: where a pipeline's hidden rows cross hosts, a torch.distributed link carries them.

Between two stages on the daemon's host the rows go through its shared memory
(``act.boundary-k``: stage k writes, stage k + 1 reads). Where a boundary has a worker on
another host on either side, the two stages are linked as a torch.distributed group of
two (a *hop*, ``runtime/hops.py``), and the rows travel over it, never through the
daemon: stage k's ``forward`` carries ``relay_out`` of the rows it writes, stage
k + 1's a ``relay_in`` of the same region::

    cpu ──shm boundary-0── cpu:1 ──hop "act-1"── tcp://10.0.0.2:7070/cpu ──hop "act-2"── tcp://…

Linking: when both ends of a hop are ready (after a load, a restart or a reconnect), both
are sent ``link`` at once with the next generation. The store is a remote end's (its
hello says where; rank 0); each end binds its data sockets to its own address on the
route to the other (a local worker's: the source address the daemon's host uses to
reach the remote one). A hop whose step failed, or whose ends are not the handles it was
linked with, is linked again before its next use.

Steps: every transfer on a hop has the next step number of its direction, named in both
frames, so a receiver skips what a failed step left on the link (``runtime/hops.py``).

Accounting: each hop counts the bytes it moved and the tokens they were for, so status
and the benchmark report bytes per token on each hop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import socket

from luced.engine.executor import Executor, Slot, WorkerDied, WorkerHandle
from luced.ipc import tcp
from luced.ipc.frames import Carry, Link, Relay
from luced.ipc.regions import Region

log = logging.getLogger(__name__)


def route_source(host: str) -> str:
    """The local address this host sends from to reach `host` (no packet is sent)."""
    family, _, _, _, addr = socket.getaddrinfo(host, 9, proto=socket.IPPROTO_UDP)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(addr)
        return s.getsockname()[0]


@dataclasses.dataclass
class Hop:
    """A link between two slots' workers (whichever processes serve them now)."""

    name: str
    ends: tuple[Slot, Slot]
    serve: str = ""  # what the second end serves on it (Link.serve): "experts"
    generation: int = 0
    linked: tuple[WorkerHandle, WorkerHandle] | None = None  # the handles it was linked with
    stale: bool = False  # a step failed on it: link again before the next
    steps: int = 0  # transfers so far (the next one's number)
    bytes: int = 0  # everything it moved
    tokens: int = 0  # tokens whose rows it moved (hidden states, ring rows)
    lock: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock)

    def relay(self, regions: tuple[Region, ...], tokens: int) -> Relay:
        """The next transfer of `regions`: the rows of `tokens` tokens."""
        relay = Relay(hop=self.name, step=self.steps, regions=regions)
        self.steps += 1
        self.bytes += relay.nbytes
        self.tokens += tokens
        return relay

    def describe(self) -> dict:
        per_token = round(self.bytes / self.tokens, 1) if self.tokens else None
        return {
            "hop": self.name,
            "between": [end.spec.group for end in self.ends],
            "link": "torch.distributed gloo",
            "generation": self.generation,
            "bytes": self.bytes,
            "tokens": self.tokens,
            "bytes_per_token": per_token,
        }


class Hops:
    """The hops between the target's workers (module docstring); `timeout` bounds every
    transfer (seconds)."""

    def __init__(self, executor: Executor, timeout: float) -> None:
        self.executor = executor
        self.timeout = timeout
        self.hops: dict[str, Hop] = {}
        slots = executor.slots
        self.boundaries: dict[int, Hop] = {  # pipeline boundary k -> its hop
            k: self.add(f"act-{k}", slots[k], slots[k + 1])
            for k in range(len(slots) - 1)
            if slots[k].spec.remote or slots[k + 1].spec.remote
        }

    def add(self, name: str, a: Slot, b: Slot, serve: str = "") -> Hop:
        """A hop between two slots (one of them on another host); `b` serves `serve`."""
        hop = self.hops[name] = Hop(name, (a, b), serve)
        return hop

    async def ensure(self) -> None:
        """Link every hop whose ends are ready and not linked as they are now. A hop to the
        expert worker, which is not needed to serve (its layers fall back in process), is
        left for the next try when it cannot be linked; any other failure is raised."""
        for hop in self.hops.values():
            a, b = (end.handle for end in hop.ends)
            if a is None or b is None or a.state != "ready" or b.state != "ready":
                continue
            async with hop.lock:
                if hop.linked != (a, b) or hop.stale:
                    try:
                        await self._link(hop, a, b)
                    except WorkerDied as exc:
                        if hop.serve != "experts":
                            raise
                        hop.stale = True
                        log.warning("%s; its cold experts run in process meanwhile", exc)

    async def _link(self, hop: Hop, a: WorkerHandle, b: WorkerHandle) -> None:
        host = b if b.spec.remote else a  # whose store: a remote end's (rank 0)
        assert host.hello is not None and host.hello.store
        store_host = tcp.parse_address(host.hello.store)[0]
        hop.generation += 1
        hop.linked = None

        def end(w: WorkerHandle) -> Link:
            address = (
                tcp.parse_address(w.spec.address)[0] if w.spec.remote else route_source(store_host)
            )
            return Link(
                hop=hop.name,
                generation=hop.generation,
                rank=0 if w is host else 1,
                store=host.hello.store,  # type: ignore[union-attr]
                address=address,
                timeout_s=self.timeout,
                serve=hop.serve if w is b else "",
            )

        try:
            await asyncio.gather(a.call(end(a)), b.call(end(b)))
        except Exception as exc:
            raise WorkerDied(f"hop {hop.name} could not be linked: {exc}") from exc
        hop.linked, hop.stale = (a, b), False
        log.info(
            "hop %s linked (generation %d, store %s)", hop.name, hop.generation, host.hello.store
        )

    def carries(self, boundaries: list[Region], tokens: int) -> list[Carry | None]:
        """Each pipeline worker's relays for one forward: worker k sends `boundaries[k]`
        over hop k, worker k + 1 receives it; None where a worker relays nothing."""
        out: list[Carry | None] = [None] * len(self.executor.slots)
        for k, hop in self.boundaries.items():
            relay = hop.relay((boundaries[k],), tokens)
            out[k] = with_relays(out[k], relay_out=relay)
            out[k + 1] = with_relays(out[k + 1], relay_in=relay)
        return out

    def failed(self) -> None:
        """A step failed: its hops may hold half a transfer; link them again before use."""
        for hop in self.hops.values():
            hop.stale = True

    def describe(self) -> list[dict]:
        return [hop.describe() for hop in self.hops.values()]


def with_relays(carry: Carry | None, **relay: Relay) -> Carry:
    """`carry` (or an empty one) with one more relay in, or out."""
    carry = carry or Carry()
    return dataclasses.replace(
        carry,
        relay_in=carry.relay_in + ((relay["relay_in"],) if "relay_in" in relay else ()),
        relay_out=carry.relay_out + ((relay["relay_out"],) if "relay_out" in relay else ()),
    )
