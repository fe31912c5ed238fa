"""Hops (runtime/hops.py): both ends in this process, one per thread, over a real gloo group
on loopback; the carry (runtime/carry.py) around a request, and the mirror of a remote
worker's regions (runtime/mirror.py)."""

from __future__ import annotations

import datetime
import socket
import threading
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch
import torch.distributed as dist

from luced.ipc import frames as F
from luced.ipc.regions import Region
from luced.runtime.carry import Carrier
from luced.runtime.hops import HopError, Hops
from luced.runtime.mirror import Mirror, regions_of
from luced.runtime.state import WorkerError, WorkerState

SEG = "/luced-abcd1234-io"


def both(fa: Callable[[], object], fb: Callable[[], object]) -> tuple:
    """Run two ends at once (gloo's calls block until the peer joins)."""
    out: list = [None, None]

    def run(i: int, f: Callable[[], object]) -> None:
        try:
            out[i] = f()
        except Exception as exc:
            out[i] = exc

    threads = [threading.Thread(target=run, args=(i, f)) for i, f in enumerate((fa, fb))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return tuple(out)


@pytest.fixture
def hops() -> Iterator[tuple[Hops, Hops]]:
    """Two ends: `a` holds the store (a remote worker's), `b` connects to it."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    store = dist.TCPStore(
        "127.0.0.1", port, None, True, datetime.timedelta(seconds=10),
        wait_for_workers=False, master_listen_fd=listener.detach(),
    )  # fmt: skip
    a, b = Hops((f"127.0.0.1:{port}", store)), Hops()
    yield a, b
    a.close()
    b.close()


def link(a: Hops, b: Hops, generation: int = 1, timeout: float = 5.0) -> None:
    store = a.own_store[0]  # type: ignore[index]

    def frame(rank: int) -> F.Link:
        return F.Link(hop="act-0", generation=generation, rank=rank, store=store,
                      address="127.0.0.1", timeout_s=timeout)  # fmt: skip

    got = both(lambda: a.link(frame(0), "daemon1"), lambda: b.link(frame(1), "daemon1"))
    assert all(isinstance(r, F.LinkReply) for r in got), got


def relay(step: int, *sizes: int) -> F.Relay:
    regions = tuple(Region(SEG, 64 + 4096 * i, (n,), "uint8") for i, n in enumerate(sizes))
    return F.Relay(hop="act-0", step=step, regions=regions)


def test_transfers_arrive_in_order_and_failed_steps_fail_fast(hops) -> None:
    a, b = hops
    link(a, b, timeout=2.0)
    out = [torch.arange(10, dtype=torch.uint8), torch.full((3,), 7, dtype=torch.uint8)]
    a.send(relay(0, 10, 3), out)
    into = [torch.zeros(10, dtype=torch.uint8), torch.zeros(3, dtype=torch.uint8)]
    b.recv(relay(0, 10, 3), into)
    assert [t.tolist() for t in into] == [t.tolist() for t in out]
    # The sender's frame of step 1 failed: the receiver learns it at once, not at a timeout.
    a.abort(relay(1, 4))
    with pytest.raises(HopError, match="step 1 of 4 bytes wanted; its frame failed"):
        b.recv(relay(1, 4), [torch.zeros(4, dtype=torch.uint8)])
    with pytest.raises(HopError, match="down until linked again"):
        b.recv(relay(2, 4), [torch.zeros(4, dtype=torch.uint8)])
    # A send nobody takes (the receiving frame of a failed step never came) holds up the
    # next one for the link's timeout at most: the daemon links such a hop anew first.
    link(a, b, generation=2, timeout=1.0)
    a.send(relay(2, 4), [torch.full((4,), 1, dtype=torch.uint8)])
    with pytest.raises(HopError, match="hop act-0"):
        a.send(relay(3, 4), [torch.full((4,), 2, dtype=torch.uint8)])
    # A new generation starts clean; the byte counts say what moved.
    link(a, b, generation=3)
    a.send(relay(3, 2), [torch.tensor([5, 6], dtype=torch.uint8)])
    got = torch.zeros(2, dtype=torch.uint8)
    b.recv(relay(3, 2), [got])
    assert got.tolist() == [5, 6]
    assert a.stats() == {"hop_act-0_sent_bytes": 2, "hop_act-0_received_bytes": 0}

    # A step the receiver does not want (an abort it never waited for) is skipped.
    def sender() -> None:
        a.abort(relay(4, 2))
        a.send(relay(5, 2), [torch.tensor([8, 9], dtype=torch.uint8)])

    both(sender, lambda: b.recv(relay(5, 2), [got]))
    assert got.tolist() == [8, 9]


def test_a_silent_or_dead_peer_is_a_hop_error_within_the_timeout(hops) -> None:
    a, b = hops
    link(a, b, timeout=1.0)
    with pytest.raises(HopError, match="hop act-0"):  # nothing was sent
        b.recv(relay(0, 4), [torch.zeros(4, dtype=torch.uint8)])
    link(a, b, generation=2, timeout=1.0)
    a.close()  # the peer goes away
    with pytest.raises(HopError, match="hop act-0"):
        b.recv(relay(0, 4), [torch.zeros(4, dtype=torch.uint8)])
    with pytest.raises(HopError, match="is not linked"):
        a.send(relay(0, 4), [torch.zeros(4, dtype=torch.uint8)])


def test_mirror_extents_merge_and_keep_their_bytes() -> None:
    m = Mirror()
    m.view(Region(SEG, 64, (10,), "int32"))[:] = np.arange(10)
    m.view(Region(SEG, 1000, (4,), "float32"))[:] = 1.5
    wider = m.view(Region(SEG, 64, (300,), "int32"))  # covers both: one extent, bytes kept
    assert wider[:10].tolist() == list(range(10))
    assert m.view(Region(SEG, 1000, (4,), "float32")).tolist() == [1.5] * 4
    assert len(m._extents[SEG]) == 1 and wider.ctypes.data % 64 == 0
    m.view(Region("/luced-abcd1234-act", 4096, (2, 3), "float32"))
    assert m.nbytes == 300 * 4 + 64 * 0 + 2 * 3 * 4 + 4096 % 64
    m.forget(SEG)
    assert m.view(Region(SEG, 64, (10,), "int32")).tolist() == [0] * 10  # a new extent


def test_regions_of_a_frame_are_all_found() -> None:
    tokens, ids = Region(SEG, 64, (8,), "int32"), Region(SEG, 128, (8,), "int32")
    ring = Region(SEG, 4096, (16, 2, 8), "float32")
    req = F.Forward(
        spans=(F.Span(sequence=0, start=0, n=8, ring=ring),),
        want="sample",
        outputs={"ids": ids},
        tokens=tokens,
        capture=(1, 2),
    )
    assert sorted(r.offset for r in regions_of(req)) == [64, 128, 4096]


def test_the_carrier_puts_gets_and_relays(hops) -> None:
    a, b = hops
    link(a, b)
    remote, local = WorkerState("r", ("cpu",), Mirror()), WorkerState("l", ("cpu",), Mirror())
    for w in (remote, local):
        w.instance = "abcd1234"
    put = F.Put(region=Region(SEG, 64, (4,), "int32"), data=np.arange(4, dtype="<i4").tobytes())
    carrier = Carrier(remote, a, remote.attachments)  # type: ignore[arg-type]
    carrier.before(F.Carry(put=(put,)))
    got = carrier.after(F.Carry(get=(Region(SEG, 68, (2,), "int32"),)))
    assert np.frombuffer(got[0], "<i4").tolist() == [1, 2]
    # A relay out of one end's region arrives in the same region of the other's.
    moved = F.Relay(hop="act-0", step=0, regions=(Region(SEG, 64, (4,), "int32"),))
    other = Carrier(local, b, local.attachments)  # type: ignore[arg-type]
    both(
        lambda: carrier.after(F.Carry(relay_out=(moved,))),
        lambda: other.before(F.Carry(relay_in=(moved,))),
    )
    assert local.tensor(Region(SEG, 64, (4,), "int32")).tolist() == [0, 1, 2, 3]
    # A worker that maps the daemon's memory takes relays, never puts or gets.
    with pytest.raises(WorkerError, match="for workers on other hosts"):
        Carrier(local, b).before(F.Carry(put=(put,)))
