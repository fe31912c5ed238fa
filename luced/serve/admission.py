"""Who gets a place when the HTTP listener is full: the rule behind ``--max-connections``.

Pure bookkeeping over the open connections (no sockets here): ``listener.Connection``
reports each one's peer, stage and age, and ``Gate.admit`` decides for a new one.

The places are ``--max-connections``; an eighth of them (at most 8) is a reserve where only
``GET /health`` is answered, so a probe finds room whatever the other clients hold. The
rest are the regular places. A new connection, when the regular places are all taken:

1. takes the place of the connection idle the longest between requests (keep-alive);
   a client must expect a kept-alive connection to close, so this costs nobody a request;
2. else, if its peer holds fewer than its share of the connections still sending a
   request (header or body), takes the place of the oldest such connection of the peer
   that holds the most, when that peer holds more than its share. The share is the
   regular places divided by the peers with a connection (the new one included), at
   least 1. So one peer cannot keep the others out by opening connections and sending
   slowly (or nothing); connections answering a whole request are never closed;
3. else it gets a reserve place (only /health is answered there, then it is closed); a
   full reserve gives up its connection that has waited longest for a whole request;
4. else it is refused (a JSON 503).

A peer is an IP address; IPv6 addresses count by their /64, which one host usually holds
whole. Peers in ``--trusted-proxies`` (a load balancer speaks for many clients) neither
count against a share nor lose connections to one; they still fill places.
"""

from __future__ import annotations

import enum
import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

Network = ipaddress.IPv4Network | ipaddress.IPv6Network

_RESERVE_MAX = 8  # /health probes are answered at once; a few places suffice
_V6_PREFIX = 64  # the addresses one IPv6 host typically holds


def parse_networks(value: Any) -> tuple[Network, ...]:
    """Addresses or CIDR networks: "10.0.0.1,fd00::/8" or a list of them. A network
    with host bits set (10.0.0.1/8) is a ValueError, so a typo does not widen trust."""
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, list | tuple):
        raise ValueError(f"not a list of addresses: {value!r}")
    out = []
    for item in items:
        if isinstance(item, Network):  # (already parsed)
            out.append(item)
            continue
        if not isinstance(item, str):  # (ip_network takes 1 as 0.0.0.1)
            raise ValueError(f"not an address or network: {item!r}")
        if item.strip():
            try:
                out.append(ipaddress.ip_network(item.strip()))
            except ValueError as exc:
                raise ValueError(f"not an address or network: {item!r} ({exc})") from None
    return tuple(out)


class Stage(enum.Enum):
    SENDING = "sending"  # opened, or between requests with part of the next one, or a body
    BUSY = "busy"  # a whole request arrived and is being answered
    IDLE = "idle"  # kept alive after an answer, nothing of the next request yet


@dataclass(frozen=True)
class Peer:
    key: str  # the address (an IPv6 one as its /64)
    trusted: bool


class Tracked(Protocol):
    """What the gate reads of an open connection."""

    @property
    def peer(self) -> Peer: ...

    @property
    def health_only(self) -> bool: ...  # holds a reserve place

    @property
    def stage(self) -> Stage: ...

    @property
    def since(self) -> float: ...  # when it opened or last finished an answer


C = TypeVar("C", bound=Tracked)


@dataclass(frozen=True)
class Admission(Generic[C]):
    health_only: bool  # a reserve place: only /health is answered
    evict: C | None = None  # the connection to close first


class Gate:
    """The rule of this module's docstring for ``max_connections`` places."""

    __slots__ = ("regular", "reserve", "trusted")

    def __init__(self, max_connections: int, trusted: Sequence[Network] = ()) -> None:
        self.reserve = min(_RESERVE_MAX, max_connections // 8)
        self.regular = max_connections - self.reserve
        self.trusted = tuple(trusted)

    def peer(self, host: str | None) -> Peer:
        """The peer of a connection from ``host`` (None: no address, e.g. a unix socket)."""
        if not host:
            return Peer("", False)
        addr = ipaddress.ip_address(host.split("%", 1)[0])  # (an IPv6 zone is not the host)
        if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
            addr = addr.ipv4_mapped  # a dual-stack socket's IPv4 client
        trusted = any(addr in net for net in self.trusted)
        if isinstance(addr, ipaddress.IPv6Address):
            return Peer(str(ipaddress.IPv6Network((addr, _V6_PREFIX), strict=False)), trusted)
        return Peer(str(addr), trusted)

    def admit(self, peer: Peer, open_: Sequence[C]) -> Admission[C] | None:
        """A new connection from ``peer`` beside the ``open_`` ones (in the order they
        opened): its place and whom it displaces, or None to refuse it."""
        regular = [c for c in open_ if not c.health_only]
        if len(regular) < self.regular:
            return Admission(False)
        idle = [c for c in regular if c.stage is Stage.IDLE]
        if idle:
            return Admission(False, min(idle, key=_since))
        victim = self._over_share(peer, regular)
        if victim is not None:
            return Admission(False, victim)
        probes = [c for c in open_ if c.health_only]
        if len(probes) < self.reserve:
            return Admission(True)
        silent = [c for c in probes if c.stage is Stage.SENDING]
        if silent:
            return Admission(True, min(silent, key=_since))
        return None

    def _over_share(self, peer: Peer, regular: Sequence[C]) -> C | None:
        """The oldest sending connection of the peer most over its share, if ``peer`` is
        under its own."""
        peers = {peer.key} | {c.peer.key for c in regular}
        share = max(1, self.regular // len(peers))
        sending: dict[str, list[C]] = {}
        for c in regular:
            if c.stage is Stage.SENDING and not c.peer.trusted:
                sending.setdefault(c.peer.key, []).append(c)
        if not peer.trusted and len(sending.get(peer.key, ())) >= share:
            return None
        heaviest = max(sending.values(), key=len, default=[])
        return min(heaviest, key=_since) if len(heaviest) > share else None


def _since(c: Tracked) -> float:
    return c.since
