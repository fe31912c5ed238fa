"""The transport's GPU side (luced.runtime.device_io), where a CPU can check it: which
segments are page-locked, refused, staged and released, and that a worker's mapping is
registered at its real address and unregistered before it is unmapped. The CUDA runtime's
two calls are stand-ins here that record what they were asked; on a GPU the real calls,
`is_pinned`, the staged copies and the transfer rates are checked by tests/cuda.
"""

from __future__ import annotations

import logging
import secrets

import numpy as np
import pytest
import torch

from luced.ipc.regions import Attachments, RegionAllocator
from luced.ipc.shm import ShmOwner
from luced.runtime.device_io import DeviceIO, HostPins
from luced.runtime.state import WorkerState


class FakeRuntime:
    """Records cudaHostRegister / cudaHostUnregister calls; refuses the addresses it is told."""

    def __init__(self, refuse: int = 0) -> None:
        self.calls: list[tuple] = []
        self.refuse = refuse  # the error code a register returns (0: success)

    def register(self, address: int, nbytes: int) -> int:
        self.calls.append(("register", address, nbytes))
        return self.refuse

    def unregister(self, address: int) -> int:
        self.calls.append(("unregister", address))
        return 0

    def pins(self) -> HostPins:
        return HostPins(enabled=True, register=self.register, unregister=self.unregister)


def test_a_segment_is_registered_once_and_released_on_close() -> None:
    rt = FakeRuntime()
    pins = rt.pins()
    assert pins.pin("/a", 4096, 100) and pins.pin("/a", 4096, 100)
    assert pins.pin("/b", 8192, 50)
    assert rt.calls == [("register", 4096, 100), ("register", 8192, 50)]
    pins.unpin("/a")
    pins.close()
    pins.close()  # idempotent
    assert rt.calls[2:] == [("unregister", 4096), ("unregister", 8192)]
    assert pins.pinned == {} and pins.refused == {}


def test_a_refused_segment_is_logged_once_and_never_retried(caplog) -> None:
    rt = FakeRuntime(refuse=712)  # cudaErrorHostMemoryAlreadyRegistered
    pins = rt.pins()
    with caplog.at_level(logging.WARNING, logger="luced.runtime.device_io"):
        assert not pins.pin("/a", 4096, 100)
        assert not pins.pin("/a", 4096, 100)
    assert rt.calls == [("register", 4096, 100)]
    assert pins.refused == {"/a": 712}
    assert [r.getMessage() for r in caplog.records] == [
        "page-locking /a (100 bytes) refused (CUDA error 712): its copies to the GPU go "
        "through a pinned staging buffer"
    ]
    pins.unpin("/a")  # nothing was registered: nothing to undo
    assert rt.calls == [("register", 4096, 100)]


def test_a_cpu_worker_never_calls_cuda() -> None:
    rt = FakeRuntime()
    io = DeviceIO(("cpu", "cpu:1"), HostPins(False, rt.register, rt.unregister))
    io.attach("/a", 4096, 100)
    host = torch.arange(4)
    assert io.upload(host, torch.device("cpu"), "/a") is host
    io.close()
    assert rt.calls == []
    assert not WorkerState("cpu", ("cpu",)).device_io.pins.enabled
    assert WorkerState("cuda", ("cuda:0", "cuda:1")).device_io.pins.enabled  # no CUDA touched
    assert WorkerState("hip", ("hip:0",)).device_io.pins.enabled


def test_the_worker_pins_its_real_mapping_and_unpins_before_unmapping() -> None:
    rt = FakeRuntime()
    io = DeviceIO(("cuda:0",), rt.pins())
    closed_at_unregister = []

    def unregister(address: int) -> int:
        closed_at_unregister.append(seg_view.closed)
        return rt.unregister(address)

    io.pins.unregister = unregister
    with ShmOwner(secrets.token_hex(4)) as owner:
        seg = owner.create("act", 1 << 16)
        region = RegionAllocator.for_segment(seg).alloc("rows", (16, 32), "float32")
        att = Attachments(
            on_attach=lambda s: io.attach(s.name, s.address(), s.size),
            on_close=lambda s: io.detach(s.name),
        )
        rows = att.view(region)
        att.view(region)  # the same segment: attached and registered once
        seg_view = att.segment(region.segment)
        mapping = seg_view._mmap
        base = rows.ctypes.data - region.offset  # the worker's own mapping of the segment
        assert rt.calls == [("register", base, seg.size)]
        del rows
        att.close()
        assert rt.calls[1:] == [("unregister", base)]
        assert closed_at_unregister == [False]  # still mapped while CUDA releases it
        assert mapping.closed  # and then really unmapped: the address export was released


def test_address_is_the_mapping_base_and_leaves_it_closable() -> None:
    with ShmOwner(secrets.token_hex(4)) as owner:
        seg = owner.create("x", 4096)
        seg.array(64, (4,), np.int32)[:] = [1, 2, 3, 4]
        address = seg.address()
        got = np.ctypeslib.as_array((np.ctypeslib.ctypes.c_int32 * 4).from_address(address + 64))
        assert got.tolist() == [1, 2, 3, 4]
        del got
        mapping = seg._mmap
        seg.close()
        assert mapping.closed


@pytest.mark.parametrize("devices", [("cpu",), ("cuda:0",)])
def test_upload_on_the_cpu_is_the_view_itself(devices: tuple[str, ...]) -> None:
    io = DeviceIO(devices, FakeRuntime().pins())
    host = torch.ones(3)
    assert io.upload(host, torch.device("cpu"), "/any") is host
