"""This worker's ends of its hops: bulk data to and from workers on other hosts.

A hop joins two workers, at least one of them remote, in a torch.distributed group of
their own (world size 2, gloo; ``link``). The daemon is no rank: it names each transfer
in the frames it sends both ends (``Relay``: hop, step, regions) and the ends move the
regions' bytes. The group is made anew on every ``link`` (a new generation): a group
does not survive a dead peer, and after any failed or timed-out transfer its queues are
out of step, so the hop refuses to move more until it is linked again.

One transfer on the wire, both directions alike::

    header  int64 [3]      step, bytes of the body, 1 (ok) or 0 (the sender's frame failed:
                           no body follows)
    body    uint8 [bytes]  the regions' bytes, one after another

Sends are asynchronous, from a copy: gloo completes a send only once the peer has posted
its receive, and the peer's frame comes only after the sender has replied to the daemon.
So a send is waited for only before the hop's next one, by which time the daemon has had
the receiver's reply. A step whose receiving frame never came leaves a send nobody takes:
the daemon links the hop again after any failed step (a new group), and the wait, bounded
by the link's timeout, only catches what it missed. A receiver knows the step it wants:
an older header is skipped, a newer one or an abort of its own step fails the frame.
Every receive is bounded by the link's timeout. Only the serving thread uses this (one
frame at a time).
"""

from __future__ import annotations

import datetime
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import torch
import torch.distributed as dist

from luced.ipc import frames as F
from luced.ipc.tcp import parse_address

log = logging.getLogger(__name__)
T = TypeVar("T")


class HopError(RuntimeError):
    """A transfer failed (a dead or late peer, a failed step): the hop needs a new link."""


@dataclass
class _Hop:
    name: str
    generation: int
    rank: int
    group: dist.ProcessGroup
    store: dist.Store  # kept alive with the group
    timeout: datetime.timedelta
    peer: int  # the other rank
    broken: str = ""  # why it may not move more
    pending: list[tuple[dist.Work, torch.Tensor]] = field(default_factory=list)
    sent: int = 0  # body bytes each way
    received: int = 0

    def wait_sends(self) -> None:
        """The previous transfer's sends, taken by the peer by now (module docstring)."""
        for work, _ in self.pending:
            work.wait(self.timeout)
        self.pending.clear()


class Hops:
    """The hops of one worker by name (module docstring). ``store`` is this worker's own
    TCP store when it has one (a remote worker: "host:port" it listens on)."""

    def __init__(self, own_store: tuple[str, dist.TCPStore] | None = None) -> None:
        self.own_store = own_store
        self._hops: dict[str, _Hop] = {}
        # What a `link` with `serve` starts on its new group: (group, peer rank) -> None,
        # returning at once (a thread of its own answers the peer until the group ends).
        self.servers: dict[str, Callable[[dist.ProcessGroup, int], None]] = {}

    def link(self, req: F.Link, instance: str) -> F.LinkReply:
        """Join hop `req.hop` anew; `instance` (the daemon's) scopes its rendezvous keys: a
        store outlives daemons, and a new daemon counts generations from 1 again."""
        t0 = time.perf_counter()
        self.drop(req.hop)
        timeout = datetime.timedelta(seconds=req.timeout_s)
        if self.own_store is not None and self.own_store[0] == req.store:
            store: dist.Store = self.own_store[1]
        else:
            host, port = parse_address(req.store)
            store = dist.TCPStore(host, port, None, False, timeout, use_libuv=True)
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timeout
        # The data sockets listen on the named address only (the private network).
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=req.address)]
        scoped = dist.PrefixStore(f"luced/{instance}/{req.hop}/{req.generation}", store)
        try:
            group = dist.ProcessGroupGloo(scoped, req.rank, 2, options)
        except RuntimeError as exc:
            raise HopError(f"hop {req.hop}: no link with its peer: {_first_line(exc)}") from None
        self._hops[req.hop] = _Hop(
            req.hop, req.generation, req.rank, group, store, timeout, 1 - req.rank
        )
        if req.serve:
            server = self.servers.get(req.serve)
            if server is None:
                raise HopError(f"hop {req.hop}: this worker serves no {req.serve}")
            server(group, 1 - req.rank)
        log.info(
            "hop %s linked (generation %d, rank %d, data on %s, store %s)",
            req.hop, req.generation, req.rank, req.address, req.store,
        )  # fmt: skip
        return F.LinkReply(elapsed_us=int((time.perf_counter() - t0) * 1e6))

    def group(self, name: str) -> tuple[dist.ProcessGroup, int, datetime.timedelta] | None:
        """A usable hop's group, its peer's rank and its timeout (None: not linked, or
        broken), for a caller that speaks its own protocol on it (HopExperts)."""
        hop = self._hops.get(name)
        if hop is None or hop.broken:
            return None
        return hop.group, hop.peer, hop.timeout

    def broke(self, name: str, why: str) -> None:
        """A caller's transfer on hop `name` failed: it moves nothing more until linked."""
        hop = self._hops.get(name)
        if hop is not None:
            hop.broken = why

    def drop(self, name: str) -> None:
        hop = self._hops.pop(name, None)
        if hop is not None:
            hop.pending.clear()
            try:  # fails what is pending and closes its connections: nothing waits on a dead peer
                hop.group.abort()
            except RuntimeError as exc:
                log.warning("hop %s: abort: %s", name, _first_line(exc))

    def close(self) -> None:
        for name in list(self._hops):
            self.drop(name)

    def stats(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for hop in self._hops.values():
            out[f"hop_{hop.name}_sent_bytes"] = hop.sent
            out[f"hop_{hop.name}_received_bytes"] = hop.received
        return out

    def _usable(self, relay: F.Relay) -> _Hop:
        hop = self._hops.get(relay.hop)
        if hop is None:
            raise HopError(f"hop {relay.hop} is not linked")
        if hop.broken:
            raise HopError(f"hop {relay.hop} is down until linked again: {hop.broken}")
        return hop

    def send(self, relay: F.Relay, data: list[torch.Tensor]) -> None:
        """Start sending transfer `relay.step`: the bytes of `data` (uint8 tensors) in order."""
        hop = self._usable(relay)
        body = torch.cat(data) if len(data) > 1 else data[0].clone()
        header = torch.tensor([relay.step, body.numel(), 1], dtype=torch.int64)
        self._guard(hop, hop.wait_sends)
        self._post(hop, header)
        if body.numel():
            self._post(hop, body)
        hop.sent += body.numel()

    def abort(self, relay: F.Relay) -> None:
        """Tell the peer that transfer `relay.step` will not come (this side's frame failed)."""
        hop = self._hops.get(relay.hop)
        if hop is None or hop.broken:
            return
        try:
            self._guard(hop, hop.wait_sends)
            self._post(hop, torch.tensor([relay.step, 0, 0], dtype=torch.int64))
        except HopError as exc:
            log.warning("%s", exc)

    def recv(self, relay: F.Relay, into: list[torch.Tensor]) -> None:
        """Receive transfer `relay.step` into `into` (uint8 tensors, in order)."""
        hop = self._usable(relay)
        want = sum(t.numel() for t in into)
        while True:
            header = torch.empty(3, dtype=torch.int64)
            self._receive(hop, header)
            step, nbytes, ok = header.tolist()
            if step < relay.step:  # left by a step whose receiving frame never came
                if ok and nbytes:
                    skip = torch.empty(nbytes, dtype=torch.uint8)
                    self._guard(
                        hop, lambda s=skip: hop.group.recv([s], hop.peer, 0).wait(hop.timeout)
                    )
                continue
            if step > relay.step or not ok or nbytes != want:
                why = "its frame failed" if not ok else f"it sent step {step} of {nbytes} bytes"
                hop.broken = f"the peer's transfer {relay.step} did not come: {why}"
                raise HopError(f"hop {relay.hop}: step {relay.step} of {want} bytes wanted; {why}")
            break
        body = into[0] if len(into) == 1 else torch.empty(want, dtype=torch.uint8)
        self._receive(hop, body)
        if len(into) > 1:
            at = 0
            for t in into:
                t.copy_(body[at : at + t.numel()])
                at += t.numel()
        hop.received += want

    def _receive(self, hop: _Hop, into: torch.Tensor) -> None:
        self._guard(hop, lambda: hop.group.recv([into], hop.peer, 0).wait(hop.timeout))

    def _post(self, hop: _Hop, tensor: torch.Tensor) -> None:
        work = self._guard(hop, lambda: hop.group.send([tensor], hop.peer, 0))
        hop.pending.append((work, tensor))  # the copy lives until the peer took it

    def _guard(self, hop: _Hop, op: Callable[[], T]) -> T:
        """Run a gloo call; any failure breaks the hop (its queues are out of step)."""
        try:
            return op()
        except RuntimeError as exc:
            hop.broken = _first_line(exc)
            hop.pending.clear()
            raise HopError(f"hop {hop.name}: {hop.broken}") from None


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
