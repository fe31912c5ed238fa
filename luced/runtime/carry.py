"""The worker's side of a request's carry (``ipc/frames/remote.py``): puts, gets, relays.

Regions are viewed as this worker views them for its verbs (``WorkerState.bytes_of``):
the daemon's shared memory on its host, the mirror (``runtime.mirror``) on another. So a
local worker's ``relay_out`` of a region the daemon wrote moves the daemon's bytes to a
remote peer, and its ``relay_in`` writes a remote peer's bytes where the daemon reads
them: the local worker relays for the daemon, which is no torch.distributed rank.
"""

from __future__ import annotations

import torch

from luced.ipc import frames as F
from luced.ipc.regions import Region
from luced.runtime.hops import Hops
from luced.runtime.mirror import Mirror
from luced.runtime.state import WorkerError, WorkerState


class Carrier:
    """``channel.Carrier`` over a worker's region views and hops; ``mirror`` is None on the
    daemon's host (puts and gets are for workers that cannot map its memory)."""

    def __init__(self, state: WorkerState, hops: Hops, mirror: Mirror | None = None) -> None:
        self.state = state
        self.hops = hops
        self.mirror = mirror

    def before(self, carry: F.Carry) -> None:
        if (carry.put or carry.get) and self.mirror is None:
            raise WorkerError("put and get are for workers on other hosts")
        for put in carry.put:
            self._bytes(put.region).copy_(torch.frombuffer(bytearray(put.data), dtype=torch.uint8))
        for relay in carry.relay_in:
            self.hops.recv(relay, [self._bytes(r) for r in relay.regions])

    def after(self, carry: F.Carry) -> tuple[bytes, ...]:
        for relay in carry.relay_out:
            self.hops.send(relay, [self._bytes(r) for r in relay.regions])
        got = tuple(self._bytes(r).numpy().tobytes() for r in carry.get)
        self._forget(carry)
        return got

    def failed(self, carry: F.Carry) -> None:
        for relay in carry.relay_out:
            self.hops.abort(relay)
        self._forget(carry)

    def _forget(self, carry: F.Carry) -> None:
        if self.mirror is not None:
            for segment in carry.forget:
                self.mirror.forget(segment)

    def _bytes(self, region: Region) -> torch.Tensor:
        return self.state.bytes_of(region)
