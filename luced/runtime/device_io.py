"""Shared memory that feeds a GPU: the worker's segments page-locked, so the copies between
them and the device are DMA transfers with no host copy in between.

A worker views the daemon's segments in place (numpy over the mapping, `WorkerState.tensor`).
A copy between pageable host memory and a GPU goes through the driver's own pinned bounce
buffers, chunk by chunk: one extra host copy each way, and no overlap. Registering a
segment's whole mapping with CUDA (cudaHostRegister, portable to every context) page-locks
it: torch then sees its views as pinned memory (`is_pinned()`), and every `.to(device)` /
`copy_` that the verbs already make (token ids, boundary activations, results, feature-ring
captures, K/V export and import) is one DMA transfer. Nothing else changes at the call sites.

    attach (first view of a segment)  -> pin: register [base, base + size)
    refused (a sandbox, RLIMIT_MEMLOCK, an unsupported mapping)
                                      -> logged once; `upload` stages that segment's views
                                         through one pinned buffer the worker owns
    close (reload, shutdown)          -> unpin every segment, before the mapping goes

Page-locking commits the pages: a registered segment (the prefix arena, KV Flash's host
tier) is resident from the worker's first use of it, not as it fills.

Who does what: the daemon creates, writes and unlinks segments (ipc/shm.py); the worker
registers only what it mapped, and unregisters it before it unmaps (`Attachments` calls
`unpin` first). Registration is a property of the worker process's mapping, not of the
segment: the daemon's own mapping stays pageable.

On the CPU (or with no CUDA device among the worker's) every method is a no-op and `upload`
returns its input: the transport is what it always was.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

log = logging.getLogger(__name__)

HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context

# (address, bytes) -> 0 on success or a CUDA error code; address -> code
Register = Callable[[int, int], int]
Unregister = Callable[[int], int]


def _cudart() -> ctypes.CDLL | None:
    """The CUDA runtime library torch loaded, found in this process's mappings (None when
    torch has none loaded, e.g. linked statically)."""
    maps = Path("/proc/self/maps")
    if not maps.exists():
        return None
    for line in maps.read_text().splitlines():
        path = line.split()[-1]
        if "libcudart.so" in Path(path).name:
            return ctypes.CDLL(path)
    return None


def cuda_register(address: int, nbytes: int) -> int:
    """cudaHostRegister, clearing the runtime's last error when refused (torch checks it
    after every kernel launch, so a stale refusal would fail the next unrelated kernel)."""
    torch.cuda.init()
    lib = _cudart()
    if lib is None:
        code = int(torch.cuda.cudart().cudaHostRegister(address, nbytes, HOST_REGISTER_PORTABLE))
        return code
    lib.cudaHostRegister.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
    code = int(lib.cudaHostRegister(address, nbytes, HOST_REGISTER_PORTABLE))
    if code:
        lib.cudaGetLastError()
    return code


def cuda_unregister(address: int) -> int:
    lib = _cudart()
    if lib is None:
        return int(torch.cuda.cudart().cudaHostUnregister(address))
    lib.cudaHostUnregister.argtypes = [ctypes.c_void_p]
    code = int(lib.cudaHostUnregister(address))
    if code:
        lib.cudaGetLastError()
    return code


@dataclass
class HostPins:
    """Which segments' mappings this worker page-locked (name -> address), which it could
    not (name -> the CUDA error code), and the calls that do it."""

    enabled: bool
    register: Register = cuda_register
    unregister: Unregister = cuda_unregister
    pinned: dict[str, int] = field(default_factory=dict)
    refused: dict[str, int] = field(default_factory=dict)

    def pin(self, name: str, address: int, nbytes: int) -> bool:
        """Page-lock a segment's mapping once; whether it is page-locked."""
        if not self.enabled:
            return False
        if name in self.pinned:
            return True
        if name in self.refused:
            return False
        code = self.register(address, nbytes)
        if code:
            self.refused[name] = code
            log.warning(
                "page-locking %s (%d bytes) refused (CUDA error %d): its copies to the GPU "
                "go through a pinned staging buffer",
                name,
                nbytes,
                code,
            )
            return False
        self.pinned[name] = address
        return True

    def unpin(self, name: str) -> None:
        """Before the mapping goes: unregister it (a refused one has nothing to undo)."""
        self.refused.pop(name, None)
        address = self.pinned.pop(name, None)
        if address is not None:
            code = self.unregister(address)
            if code:
                log.warning("unregistering %s failed (CUDA error %d)", name, code)

    def close(self) -> None:
        for name in list(self.pinned):
            self.unpin(name)
        self.refused.clear()


class Staging:
    """One pinned host buffer, grown to the largest copy, for copies out of a mapping CUDA
    would not page-lock: a host copy into it, then DMA. Its last upload must have left
    before the next one overwrites it."""

    def __init__(self) -> None:
        self.buffer: torch.Tensor | None = None
        self.copies = 0
        self._sent: torch.cuda.Event | None = None

    def upload(self, host: torch.Tensor, device: torch.device) -> torch.Tensor:
        nbytes = host.numel() * host.element_size()
        if self._sent is not None:
            self._sent.synchronize()
        if self.buffer is None or self.buffer.numel() < nbytes:
            self.buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        staged = self.buffer[:nbytes].view(host.dtype).view(host.shape)
        staged.copy_(host)
        out = staged.to(device, non_blocking=True)
        self._sent = torch.cuda.Event()
        self._sent.record()
        self.copies += 1
        return out


class DeviceIO:
    """The worker's side of the transport to its GPU: `HostPins` over its segments and the
    staging fallback (module docstring)."""

    def __init__(self, devices: tuple[str, ...], pins: HostPins | None = None) -> None:
        gpu = any(d.partition(":")[0] in ("cuda", "hip") for d in devices)
        self.pins = pins if pins is not None else HostPins(enabled=gpu)
        self.staging = Staging()

    def attach(self, name: str, address: int, nbytes: int) -> None:
        """A segment was mapped: page-lock it (on a GPU worker)."""
        self.pins.pin(name, address, nbytes)

    def detach(self, name: str) -> None:
        """A segment is about to be unmapped."""
        self.pins.unpin(name)

    def upload(self, host: torch.Tensor, device: torch.device, segment: str) -> torch.Tensor:
        """A view of `segment` on `device`: itself on the CPU, one DMA from a page-locked
        segment, staged from one that was refused."""
        if device.type == "cpu":
            return host
        if segment in self.pins.refused:
            return self.staging.upload(host, device)
        return host.to(device, non_blocking=segment in self.pins.pinned)

    def close(self) -> None:
        self.pins.close()
