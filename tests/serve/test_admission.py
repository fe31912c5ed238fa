"""The rule that places a new connection in a full listener, on connection records: which
one it displaces (exactly), when it gets only a /health place, when it is refused."""

from __future__ import annotations

from dataclasses import dataclass
from ipaddress import ip_network

import pytest

from luced.serve.admission import Admission, Gate, Peer, Stage, parse_networks

A, B, C = Peer("10.0.0.1", False), Peer("10.0.0.2", False), Peer("10.0.0.3", False)
PROXY = Peer("10.9.9.9", True)


@dataclass(frozen=True)
class Conn:
    peer: Peer
    stage: Stage
    since: float
    health_only: bool = False


def conns(peer: Peer, n: int, stage: Stage = Stage.SENDING, first: float = 0.0) -> list[Conn]:
    """n connections of one peer, opened one second apart from `first`."""
    return [Conn(peer, stage, first + i) for i in range(n)]


def test_places_are_split_into_regular_and_a_reserve_for_health() -> None:
    assert (Gate(64).regular, Gate(64).reserve) == (56, 8)
    assert (Gate(512).regular, Gate(512).reserve) == (504, 8)
    assert (Gate(16).regular, Gate(16).reserve) == (14, 2)
    assert (Gate(4).regular, Gate(4).reserve) == (4, 0)
    assert (Gate(1).regular, Gate(1).reserve) == (1, 0)


def test_a_free_regular_place_is_taken() -> None:
    assert Gate(64).admit(A, conns(A, 55)) == Admission(False)


def test_full_the_longest_idle_connection_of_any_peer_makes_room() -> None:
    held = conns(A, 50) + conns(B, 3, Stage.IDLE, first=30.0) + conns(A, 3, Stage.BUSY)
    # The newcomer's own peer holds all the sending ones: idle ones still go first.
    assert Gate(64).admit(A, held) == Admission(False, held[50])
    assert Gate(64).admit(C, held) == Admission(False, held[50])


def test_one_peer_sending_everywhere_gives_way_to_another() -> None:
    held = conns(A, 56, first=100.0)
    held[7] = Conn(A, Stage.SENDING, 1.0)  # the oldest
    assert Gate(64).admit(B, held) == Admission(False, held[7])
    # A itself, over its share, gets a place only /health is answered in.
    assert Gate(64).admit(A, held) == Admission(True)


def test_the_share_is_the_regular_places_over_the_peers() -> None:
    held = conns(A, 30) + conns(B, 20, first=50.0) + conns(C, 6, Stage.BUSY)
    # 3 peers: a share of 56 // 3 = 18; A (30) and B (20) are over it, A the most.
    assert Gate(64).admit(C, held) == Admission(False, held[0])
    assert Gate(64).admit(B, held) == Admission(True)  # B holds 20 >= 18 itself
    # 2 peers: a share of 28; B (20) is under it, so A (30) gives way to B.
    held = conns(A, 30) + conns(B, 26, first=50.0)
    assert Gate(64).admit(B, held) == Admission(False, held[0])
    # A peer at its share with nobody over it: the reserve.
    held = conns(A, 28) + conns(B, 28, first=50.0)
    assert Gate(64).admit(B, held) == Admission(True)


def test_connections_answering_a_request_are_never_closed() -> None:
    held = conns(A, 56, Stage.BUSY)
    assert Gate(64).admit(B, held) == Admission(True)


def test_a_full_reserve_gives_up_its_longest_silent_connection() -> None:
    regular = conns(A, 56, Stage.BUSY)
    probes = [Conn(A, Stage.SENDING, 5.0 - i, health_only=True) for i in range(8)]
    assert Gate(64).admit(B, regular + probes) == Admission(True, probes[7])
    answering = [Conn(A, Stage.BUSY, float(i), health_only=True) for i in range(8)]
    assert Gate(64).admit(B, regular + answering) is None


def test_trusted_proxies_keep_their_connections_and_are_never_over_a_share() -> None:
    held = conns(PROXY, 56)
    assert Gate(64).admit(B, held) == Admission(True)  # nothing of the proxy's closes
    held = conns(PROXY, 20) + conns(B, 36, first=50.0)
    # The proxy's newcomer is under any share; B (36 > 28) gives way.
    assert Gate(64).admit(PROXY, held) == Admission(False, held[20])


def test_no_reserve_and_no_share_to_take_is_a_refusal() -> None:
    assert Gate(4).admit(A, conns(A, 4)) is None
    assert Gate(4).admit(B, conns(A, 4)) == Admission(False, conns(A, 4)[0])


def test_peers_are_addresses_and_ipv6_hosts_by_their_64() -> None:
    gate = Gate(64, parse_networks("10.0.0.0/8,2001:db8:1::/48"))
    assert gate.peer("10.1.2.3") == Peer("10.1.2.3", True)
    assert gate.peer("192.168.1.5") == Peer("192.168.1.5", False)
    assert gate.peer("::ffff:10.1.2.3") == Peer("10.1.2.3", True)  # dual-stack IPv4
    assert gate.peer("2001:db8::1") == gate.peer("2001:db8::ffff") == Peer("2001:db8::/64", False)
    assert gate.peer("2001:db8:0:1::1").key == "2001:db8:0:1::/64"
    assert gate.peer("2001:db8:1:5::7") == Peer("2001:db8:1:5::/64", True)
    assert gate.peer("fe80::1%eth0").key == "fe80::/64"
    assert gate.peer(None) == Peer("", False)


def test_trusted_proxies_parse_addresses_and_networks_only() -> None:
    assert parse_networks(" 10.0.0.1 , fd00::/8,") == (
        ip_network("10.0.0.1"),
        ip_network("fd00::/8"),
    )
    assert parse_networks(["127.0.0.0/8"]) == (ip_network("127.0.0.0/8"),)
    for bad in ("10.0.0.1/8", "proxy.example", "10.0.0.0/33"):
        with pytest.raises(ValueError, match="not an address or network"):
            parse_networks(bad)
    with pytest.raises(ValueError, match="not an address or network: 1"):
        parse_networks([1])  # (not 0.0.0.1)
