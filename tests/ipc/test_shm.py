"""Segments: lifecycle, attach errors, zero-copy across processes, every owner exit path,
and stale-segment cleanup after kill -9."""

from __future__ import annotations

import json
import mmap
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import posix_ipc
import pytest

from luced.ipc.regions import RegionAllocator, view
from luced.ipc.shm import (
    HEADER_SIZE,
    LAYOUT_VERSION,
    MAGIC,
    BadSegmentError,
    Segment,
    SegmentError,
    SegmentHeader,
    SegmentNotFoundError,
    ShmOwner,
    cleanup_stale,
    pid_alive,
    process_start_ticks,
    segment_name,
)

SHM = Path("/dev/shm")

# An owner process: creates one segment, prints its name, then waits to be killed.
OWNER = """
import sys, time
from luced.ipc.shm import ShmOwner
own = ShmOwner(sys.argv[1])
if sys.argv[2] == "handlers":
    own.install_signal_handlers()
    own.install_atexit()
seg = own.create("a", 4096)
print(seg.name, flush=True)
time.sleep(60)
"""


def exists(name: str) -> bool:
    return (SHM / name.lstrip("/")).exists()


def raw_segment(name: str, data: bytes, size: int | None = None) -> None:
    """A segment with arbitrary bytes, made behind luced's back (bad-header cases)."""
    shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, size=size or max(len(data), 1))
    with mmap.mmap(shm.fd, shm.size) as mm:
        mm[: len(data)] = data
    shm.close_fd()


def dead_pid() -> int:
    p = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], stdout=-1)
    return int(p.stdout)


def test_create_attach_unlink_lifecycle(instance: str) -> None:
    with ShmOwner(instance) as owner:
        seg = owner.create("act", 1000)
        assert seg.name == f"/luced-{instance}-act" and exists(seg.name)
        assert seg.size == HEADER_SIZE + 1000 == (SHM / seg.name[1:]).stat().st_size
        att = Segment.attach(seg.name)
        h = att.header
        assert (h.magic, h.version, h.owner_pid, h.instance, h.size) == (
            MAGIC,
            LAYOUT_VERSION,
            os.getpid(),
            instance,
            seg.size,
        )
        assert h.owner_start == process_start_ticks(os.getpid())
        assert abs(h.created_ns - time.time_ns()) < 10e9
        att.close()
        assert exists(seg.name), "an attacher's close must not unlink"
        with pytest.raises(SegmentError, match="only the owner"):
            Segment.attach(seg.name).unlink()
        assert owner.names == [seg.name]
    assert not exists(seg.name)
    with pytest.raises(SegmentNotFoundError, match="does not exist"):
        Segment.attach(seg.name)


def test_create_is_exclusive_and_names_are_validated(instance: str) -> None:
    with ShmOwner(instance) as owner:
        owner.create("x", 10)
        with pytest.raises(SegmentError, match="already exists"):
            owner.create("x", 10)
        with pytest.raises(SegmentError, match="already exists"):
            Segment.create(instance, "x", 10)  # another owner racing for the name
        assert owner.names == [f"/luced-{instance}-x"]
    for bad in ("", "a/b", "a b", "é"):
        with pytest.raises(SegmentError, match="bad segment name"):
            segment_name(instance, bad)
    with pytest.raises(SegmentError, match="bad instance"):
        ShmOwner("Not-Hex")


def test_attach_missing_segment(instance: str) -> None:
    with pytest.raises(SegmentNotFoundError, match=f"/luced-{instance}-nope does not exist"):
        Segment.attach(f"/luced-{instance}-nope")


@pytest.mark.parametrize(
    ("data", "size", "match"),
    [
        (b"NOTLUCED" + bytes(56), None, "bad magic"),
        (SegmentHeader(99, 1, 0, 64, 0, "x").pack(), None, "layout version 99, this build reads 1"),
        (SegmentHeader(LAYOUT_VERSION, 1, 0, 4096, 0, "x").pack(), None, "header says 4096"),
        (b"LUCEDSHM", 8, "smaller than the 64-byte header"),
    ],
)
def test_attach_bad_header(instance: str, data: bytes, size: int | None, match: str) -> None:
    name = f"/luced-{instance}-bad"
    raw_segment(name, data, size)
    try:
        with pytest.raises(BadSegmentError, match=match):
            Segment.attach(name)
    finally:
        posix_ipc.unlink_shared_memory(name)


def test_child_process_writes_parent_sees_zero_copy(instance: str, run_py) -> None:
    code = """
import json, sys
import numpy as np
from luced.ipc.regions import Attachments, Region
r_in, r_out = (Region.from_wire(json.loads(a)) for a in sys.argv[1:3])
with Attachments() as att:
    x = att.view(r_in)
    att.view(r_out)[:] = x * 2 + np.arange(x.shape[1], dtype=np.float32)
    print(float(x.sum()))
"""
    with ShmOwner(instance) as owner:
        seg = owner.create("act", 4096)
        alloc = RegionAllocator.for_segment(seg)
        r_in = alloc.alloc("in", (3, 7), "float32")
        r_out = alloc.alloc("out", (3, 7), "float32")
        x = np.random.default_rng(0).standard_normal((3, 7)).astype(np.float32)
        view(seg, r_in)[:] = x
        out = view(seg, r_out)  # taken before the child runs: the same pages, no copy
        p = run_py(code, json.dumps(r_in.to_wire()), json.dumps(r_out.to_wire()))
        stdout, stderr = p.communicate(timeout=20)
        assert p.returncode == 0, stderr
        assert float(stdout) == pytest.approx(float(x.sum()), rel=1e-5)
        np.testing.assert_array_equal(out, x * 2 + np.arange(7, dtype=np.float32))
        assert exists(seg.name), "the attaching child must not unlink"
    assert not exists(seg.name)


def test_exception_in_context_manager_unlinks(instance: str) -> None:
    with pytest.raises(RuntimeError), ShmOwner(instance) as owner:
        a = owner.create("a", 64)
        b = owner.create("b", 64)
        raise RuntimeError("boom")
    assert not exists(a.name) and not exists(b.name)
    with pytest.raises(RuntimeError), Segment.create(instance, "c", 64) as c:
        assert exists(c.name)
        raise RuntimeError("boom")
    assert not exists(c.name)


def test_unlink_all_is_idempotent_and_keeps_mappings(instance: str) -> None:
    owner = ShmOwner(instance)
    seg = owner.create("a", 64)
    arr = seg.array(HEADER_SIZE, (16,), np.int32)
    arr[:] = 7
    assert owner.unlink_all() == [seg.name]
    assert not exists(seg.name) and owner.unlink_all() == []
    assert arr.sum() == 7 * 16  # still mapped: a worker mid-step is not disturbed
    owner.close_all()
    assert seg.closed


def test_release_unlinks_and_unmaps_one_prefix(instance: str) -> None:
    """One served model's segments go when it is unloaded; the other model's stay."""
    with ShmOwner(instance) as owner:
        a_io, a_ring = owner.create("m1-a-io", 64), owner.create("m1-a-ring0", 64)
        other = owner.create("m10-a-io", 64)  # a prefix of m1-a- only as text: kept
        assert owner.release("m1-a-") == [a_io.name, a_ring.name]
        assert not exists(a_io.name) and not exists(a_ring.name) and a_io.closed
        assert exists(other.name) and owner.names == [other.name]
        assert owner.release("m1-a-") == []


def test_forked_child_never_unlinks_parent_segments(instance: str) -> None:
    with ShmOwner(instance) as owner:
        seg = owner.create("a", 64)
        pid = os.fork()
        if pid == 0:  # the child: its exit paths would call these
            owner.unlink_all()
            seg.unlink()
            os._exit(0)
        assert os.waitpid(pid, 0)[1] == 0
        assert exists(seg.name)


def test_sigterm_to_owner_with_handlers_unlinks(instance: str, run_py) -> None:
    p = run_py(OWNER, instance, "handlers")
    name = p.stdout.readline().strip()
    assert name == f"/luced-{instance}-a" and exists(name)
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=10) == -signal.SIGTERM  # still dies "by SIGTERM"
    assert not exists(name)


def test_cleanup_stale_removes_killed_owner_keeps_live(instance: str, run_py) -> None:
    # Scoped to this test's instances: other sessions' segments are not ours to judge.
    dead = run_py(OWNER, instance + "d", "handlers")
    live = run_py(OWNER, instance + "l", "handlers")
    dead_name, live_name = dead.stdout.readline().strip(), live.stdout.readline().strip()
    dead.kill()  # -9: no handler runs, the segment stays behind
    dead.wait(timeout=10)
    assert exists(dead_name) and exists(live_name)
    removed = cleanup_stale(f"luced-{instance}")
    assert removed == [dead_name]
    with pytest.raises(SegmentError, match="must start with 'luced-'"):
        cleanup_stale("x")
    assert not exists(dead_name) and exists(live_name)
    live.send_signal(signal.SIGTERM)
    live.wait(timeout=10)
    assert not exists(live_name)


def test_cleanup_stale_judges_bad_headers(instance: str) -> None:
    pid = dead_pid()
    bad_dead = f"/luced-{instance}-baddead"  # garbage, but bytes 12..16 name a dead pid
    bad_young = f"/luced-{instance}-badyoung"  # no pid at all, just created: kept
    bad_old = f"/luced-{instance}-badold"  # no pid at all, long abandoned: removed
    raw_segment(bad_dead, b"garbage!" + struct.pack("<II", 7, pid) + bytes(48))
    raw_segment(bad_young, bytes(64))
    raw_segment(bad_old, bytes(3))
    os.utime(SHM / bad_old[1:], (time.time() - 3600, time.time() - 3600))
    try:
        removed = cleanup_stale(f"luced-{instance}", grace_s=60)
        assert sorted(removed) == sorted([bad_dead, bad_old])
        assert exists(bad_young)
    finally:
        for n in (bad_dead, bad_young, bad_old):
            if exists(n):
                posix_ipc.unlink_shared_memory(n)


def test_pid_alive_sees_zombies_and_pid_reuse() -> None:
    me = os.getpid()
    start = process_start_ticks(me)
    assert start and pid_alive(me, start) and pid_alive(me)
    assert not pid_alive(me, start + 1), "another start time means a reused pid"
    assert not pid_alive(dead_pid()) and not pid_alive(0)
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.time() + 10
    while time.time() < deadline and pid_alive(child.pid):
        time.sleep(0.01)  # exits, not reaped yet: a zombie counts as dead
    assert not pid_alive(child.pid)
    child.wait()
