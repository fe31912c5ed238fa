"""A worker subprocess driven by hand (the test plays the daemon), shared by the runtime tests."""

from __future__ import annotations

import contextlib
import secrets
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import posix_ipc
import pytest
import torch

from luced.ipc import frames as F
from luced.ipc.channel import BlockingChannel
from luced.ipc.regions import Region, RegionAllocator, required_bytes
from luced.ipc.shm import ShmOwner, scan

THREADS = torch.get_num_threads()  # same as in-process, so the float math is identical
TAG = secrets.token_hex(3)  # instance ids of this module start with it


@pytest.fixture(scope="module", autouse=True)
def no_segments_left() -> Iterator[None]:
    """After the module, no segment of ours remains in /dev/shm (as tests/ipc checks)."""
    yield
    leaked = [info for info in scan() if info.name.startswith(f"/luced-{TAG}")]
    for info in leaked:
        with contextlib.suppress(posix_ipc.Error):
            posix_ipc.unlink_shared_memory(info.name)
    assert not leaked, f"shared-memory segments left behind: {[i.name for i in leaked]}"


class WorkerProc:
    """A worker subprocess and the daemon's end of its socket."""

    def __init__(
        self, log_dir: Path, group: str = "cpu", devices: str = "cpu", *, inbox: bool = False
    ) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.log_path = log_dir / f"worker-{group}-{secrets.token_hex(2)}.log"
        argv = ["--fd", str(theirs.fileno()), "--group", group, "--devices", devices]
        fds = [theirs]
        self.inbox: socket.socket | None = None  # the daemon's end (links are handed over)
        if inbox:
            self.inbox, their_inbox = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            argv += ["--inbox", str(their_inbox.fileno())]
            fds.append(their_inbox)
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "luced.runtime.worker", *argv, "--threads", str(THREADS)],
                pass_fds=[s.fileno() for s in fds],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
            )
        for s in fds:
            s.close()  # else our own copy would keep the worker's end open
        ours.settimeout(60)  # a hung worker fails the test instead of hanging it
        self.chan = BlockingChannel(ours)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def call(self, req: F.Request) -> F.Reply:
        return self.chan.call(req)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        self.chan.close()
        if self.inbox is not None:
            self.inbox.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        print(f"--- {self.log_path.name} ---\n{self.log()}")  # shown when a test fails


class Regions:
    """The daemon's side of a test: named regions carved from one new segment of `owner`
    (specs: name -> (shape, dtype)); `r[name]` for frames, `a(name)` to read and write."""

    def __init__(self, owner: ShmOwner, segment: str, specs: dict[str, tuple]) -> None:
        self.seg = owner.create(segment, required_bytes(specs.values()))
        alloc = RegionAllocator.for_segment(self.seg)
        self.r: dict[str, Region] = {
            n: alloc.alloc(n, shape, dt) for n, (shape, dt) in specs.items()
        }

    def a(self, name: str) -> np.ndarray:
        r = self.r[name]
        return self.seg.array(r.offset, r.shape, r.dtype)


SPAN_FIELDS = {"sequence", "verify", "q_row", "keep_state", "keep_block_states", "ring", "moves"}


def forward_frame(
    n: int,
    start: int,
    want: str = "sample",
    outputs: dict[str, Region] | None = None,
    positions: str = "last",
    sampling: dict | None = None,
    **kw: object,
) -> F.Forward:
    """A forward of one span, as the daemon sends for one sequence: `positions` "last" (the
    row after the last token), "all" (a row after every token) or "none" (feed only); the
    keyword arguments named in SPAN_FIELDS go to the span, the others to the frame."""
    n_out = {"last": 1, "all": n, "none": 0}[positions]
    span = {k: kw.pop(k) for k in SPAN_FIELDS & kw.keys()}
    span.setdefault("sequence", 0)
    return F.Forward(
        spans=(F.Span(start=start, n=n, n_out=n_out, sampling=sampling or {}, **span),),  # type: ignore[arg-type]
        want=want,  # type: ignore[arg-type]
        outputs=outputs or {},
        **kw,  # type: ignore[arg-type]
    )
