"""Frames for workers on other hosts: the identity of a model file (hello), ping, link, and
the carry that rides beside a request (``codec``'s envelope key "carry").

A worker on another host (``luced worker --listen``) cannot map the daemon's shared memory.
It keeps a private *mirror* of the regions it uses (``runtime.mirror``), and a request's
carry says how their bytes get there and back::

    put        region bytes the daemon writes into the mirror before the request
               (token ids, grammar masks, q rows: small, inline in the control frame)
    get        regions whose bytes the worker returns in the reply ("carried", in order:
               sampled ids, logprobs, logits, captured ring cells)
    relay_in   before the request, receive these regions' bytes from a hop's peer
    relay_out  after the request, send these regions' bytes to a hop's peer (a failed
               request sends an abort instead, so the peer fails at once)
    forget     segments the mirror drops after the request (scratch: a prefix snapshot)

A *hop* is a torch.distributed group of two workers (``link``), one per pair that moves
bulk data between hosts: hidden states from stage to stage, feature-ring rows for a
draft, KV rows of a prefix snapshot. The daemon is not a rank; it numbers each hop's
transfers (``Relay.step``) so that a receiver drops what a failed step left behind. A
local worker relays for the daemon: its shared-memory view is the daemon's own, so a
``relay_out`` of a daemon-written region moves it to the remote peer.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from luced.ipc.frames.base import REPLIES, REQUESTS, Reply, Request, _op
from luced.ipc.regions import Region
from luced.ipc.typed import Record

_SHA256 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class FileIdentity(Record):
    """A model file as its size and SHA-256: a remote host holds its own copy, found by
    these, whatever its path there."""

    size: int
    sha256: str  # lowercase hex

    def _check(self) -> None:
        if self.size < 0 or not _SHA256.fullmatch(self.sha256):
            raise self._fail(f"need size >= 0 and a hex sha256, got {self.size}, {self.sha256!r}")


@_op("ping", REQUESTS)
@dataclass(frozen=True)
class Ping(Request):
    """Nothing to do: a remote worker's heartbeat (its round trip), or a carrier of relays."""


@_op("ping", REPLIES)
@dataclass(frozen=True)
class PingReply(Reply):
    pass


@_op("link", REQUESTS)
@dataclass(frozen=True)
class Link(Request):
    """Join hop ``hop`` as ``rank`` of a new torch.distributed group of two (gloo), through
    the TCP store at ``store`` ("host:port"), binding this end's data sockets to
    ``address``. A new ``generation`` replaces the hop's old group (a group does not
    survive a dead peer). ``timeout_s`` bounds the rendezvous and every send and receive.
    ``serve``: what this end serves on the hop rather than relays ("experts": an expert
    worker answers its peer's calls, ``runtime.expert_link.HopExperts``)."""

    hop: str
    generation: int
    rank: int
    store: str
    address: str
    timeout_s: float
    serve: str = ""

    def _check(self) -> None:
        if not self.hop or self.rank not in (0, 1) or self.generation < 0:
            raise self._fail(f"need a hop name, rank 0 or 1, generation >= 0; got {self}")
        host, _, port = self.store.rpartition(":")
        if not host or not port.isdigit() or not self.address:
            raise self._fail(f"store must be host:port and address a host, got {self.store!r}")
        if not self.timeout_s > 0:
            raise self._fail(f"timeout_s must be > 0, got {self.timeout_s}")
        if self.serve not in ("", "experts"):
            raise self._fail(f'serve must be "" or "experts", got {self.serve!r}')


@_op("link", REPLIES)
@dataclass(frozen=True)
class LinkReply(Reply):
    elapsed_us: int


@dataclass(frozen=True)
class Put(Record):
    region: Region
    data: bytes

    def _check(self) -> None:
        if len(self.data) != self.region.nbytes:
            raise self._fail(f"{len(self.data)} bytes for a region of {self.region.nbytes}")


@dataclass(frozen=True)
class Relay(Record):
    """Transfer ``step`` of ``hop``: the regions' bytes, one after another."""

    hop: str
    step: int
    regions: tuple[Region, ...]

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.regions)

    def _check(self) -> None:
        if not self.hop or self.step < 0 or not self.regions:
            raise self._fail("a relay names its hop, a step >= 0 and at least one region")


@dataclass(frozen=True)
class Carry(Record):
    """What moves beside one request (module docstring)."""

    put: tuple[Put, ...] = ()
    get: tuple[Region, ...] = ()
    relay_in: tuple[Relay, ...] = ()
    relay_out: tuple[Relay, ...] = ()
    forget: tuple[str, ...] = ()

    @property
    def empty(self) -> bool:
        return not (self.put or self.get or self.relay_in or self.relay_out or self.forget)
