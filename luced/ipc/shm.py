"""POSIX shared-memory segments owned by the daemon and attached by workers.

Every segment starts with a fixed 64-byte header; regions (see ``regions.py``) live
after it, so absolute offsets >= ``HEADER_SIZE`` are what frames carry.

Header layout (little-endian, ``HEADER_SIZE`` = 64 bytes)::

    0        8        12       16                24       32       40                 56     64
    +--------+--------+--------+-----------------+--------+--------+------------------+------+
    | magic  | layout | owner  | owner start     | total  | created| instance id      | zero |
    | LUCED  | version| pid    | (/proc starttime| size   | (unix  | (ASCII, NUL-     |      |
    | SHM    | u32    | u32    |  ticks) u64     | u64    | ns) u64|  padded) 16 B    |      |
    +--------+--------+--------+-----------------+--------+--------+------------------+------+
    | data: regions at 64-byte aligned offsets ...                                          |

* Bytes 0..16 (magic, layout version, owner pid) keep their place in every layout
  version, so ``cleanup_stale`` can judge segments written by other luced builds.
* ``owner start`` is field 22 of ``/proc/<pid>/stat`` of the owner (0 where /proc is
  missing). With the pid it identifies the owner process even after pid reuse; unlike
  wall-clock time it does not move when the clock is stepped.
* ``total size`` includes the header. ``created`` is informational (wall clock).

Who writes, who reads, in which order:

* Only the owner (the daemon) creates a segment, with ``O_CREX`` so it never adopts
  a segment somebody else made. It writes the header exactly once, right after
  ``ftruncate`` (which zero-fills): every field but the magic first, the magic last, so
  a reader that sees the magic sees a whole header. Nobody writes the header again.
* Attachers (workers) and ``cleanup_stale`` only read the header. Workers learn a
  segment's name from a control frame sent after it was created, and the socket round
  trip orders the header writes before their reads.
* Data regions have one writer at a time; the frames say who (see ``frames.py``).

Who unlinks: only the owner, on every exit path: ``Segment``'s context manager,
``ShmOwner.unlink_all`` (the daemon calls it at the end of its shutdown and may install
it for signals; ``atexit`` is the last resort), ``ShmOwner.release`` for one served
model's segments when the daemon unloads it. Attaching processes never unlink; they
only unmap. Unlinking removes the name; mappings stay valid until each process unmaps,
so a worker mid-step is not disturbed. A daemon killed with -9 leaves its segments
behind; the next daemon removes them with ``cleanup_stale`` at start.

Names: ``/luced-<instance>-<name>``; the instance is a short random id per daemon run,
so two daemons (or two test sessions) never collide. Limitation: liveness is judged
by pid, so the daemons sharing one ``/dev/shm`` must share one pid namespace.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import glob
import mmap
import os
import re
import secrets
import signal
import struct
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType, TracebackType
from typing import Self

import numpy as np
import posix_ipc

MAGIC = b"LUCEDSHM"
LAYOUT_VERSION = 1
HEADER_SIZE = 64
PREFIX = "luced-"
SHM_DIR = Path("/dev/shm")


def shm_room(shm_dir: Path = SHM_DIR) -> int:
    """Bytes a sparse segment may grow to: half the free space in /dev/shm. Creating a
    segment always works, but a write past what tmpfs holds kills the writer with SIGBUS
    (Docker's default /dev/shm is 64 MiB), so what may fill up is sized to this."""
    st = os.statvfs(shm_dir)
    return st.f_bavail * st.f_frsize // 2


# magic, version, pid, owner start ticks, total size, created ns, instance, reserved
_HEADER = struct.Struct("<8sIIQQQ16s8x")
assert _HEADER.size == HEADER_SIZE
_FIXED = struct.Struct("<8sII")  # the version-independent first 16 bytes

_INSTANCE_RE = re.compile(r"^[0-9a-z]{1,16}$")
_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,200}$")


class SegmentError(Exception):
    """A segment is missing, malformed, or used against its ownership rules."""


class SegmentNotFoundError(SegmentError):
    """No segment exists under that name."""


class BadSegmentError(SegmentError):
    """A segment exists but its header is not one this build can read."""


@dataclass(frozen=True)
class SegmentHeader:
    version: int
    owner_pid: int
    owner_start: int
    size: int
    created_ns: int
    instance: str
    magic: bytes = MAGIC

    def pack(self) -> bytes:
        return _HEADER.pack(
            self.magic,
            self.version,
            self.owner_pid,
            self.owner_start,
            self.size,
            self.created_ns,
            self.instance.encode("ascii"),
        )

    @classmethod
    def unpack(cls, data: bytes) -> SegmentHeader:
        magic, version, pid, start, size, created, inst = _HEADER.unpack(data[:HEADER_SIZE])
        instance = inst.rstrip(b"\0").decode("ascii", errors="replace")
        return cls(version, pid, start, size, created, instance, magic)


def new_instance_id() -> str:
    """A short random id for one daemon run (8 hex characters)."""
    return secrets.token_hex(4)


def segment_name(instance: str, name: str) -> str:
    """The POSIX name ``/luced-<instance>-<name>``, validated."""
    if not _INSTANCE_RE.match(instance):
        raise SegmentError(f"bad instance id {instance!r}: want 1-16 of [0-9a-z]")
    if not _NAME_RE.match(name):
        raise SegmentError(f"bad segment name {name!r}: want 1-200 of [A-Za-z0-9_.-]")
    return f"/{PREFIX}{instance}-{name}"


def process_start_ticks(pid: int) -> int | None:
    """Field 22 of /proc/<pid>/stat (start time in clock ticks since boot), or None."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # comm (field 2) may contain spaces and parentheses; the rest follows the last ")".
    rest = stat.rsplit(")", 1)[1].split()
    return int(rest[19])  # rest[0] is field 3 (state)


def pid_alive(pid: int, start_ticks: int = 0) -> bool:
    """Whether the process ``pid`` (started at ``start_ticks``, 0 = unknown) still runs."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, belongs to another user
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # no /proc (not Linux): the kill probe is all we have
    rest = stat.rsplit(")", 1)[1].split()
    if rest[0] in ("Z", "X"):
        return False  # killed, not yet reaped by its parent
    # A different start time means the pid was reused by a newer process.
    return not (start_ticks and int(rest[19]) != start_ticks)


class Segment:
    """One mapped segment. Build with ``Segment.create`` (owner) or ``Segment.attach``."""

    def __init__(self, name: str, mm: mmap.mmap, header: SegmentHeader, owner: bool) -> None:
        self.name = name
        self.header = header
        self.size = len(mm)
        self.is_owner = owner
        self._mmap: mmap.mmap | None = mm
        self._unlinked = False
        self._pid = os.getpid()  # a forked child is not the owner

    # -- construction -----------------------------------------------------------------

    @classmethod
    def create(
        cls,
        instance: str,
        name: str,
        nbytes: int,
        *,
        on_created: Callable[[str], object] | None = None,
    ) -> Segment:
        """Create ``/luced-<instance>-<name>`` with ``nbytes`` of data after the header.

        ``on_created(full_name)`` runs right after ``shm_open`` and before anything that
        can fail, so an owner registry learns the name as early as possible.
        """
        full = segment_name(instance, name)
        if nbytes < 0:
            raise SegmentError(f"{full}: negative size {nbytes}")
        total = HEADER_SIZE + nbytes
        try:
            shm = posix_ipc.SharedMemory(full, posix_ipc.O_CREX, mode=0o600, size=total)
        except posix_ipc.ExistentialError as e:
            raise SegmentError(f"{full} already exists (another daemon run?)") from e
        try:
            if on_created is not None:
                on_created(full)
            mm = mmap.mmap(shm.fd, total)
        except BaseException:
            with contextlib.suppress(posix_ipc.ExistentialError):
                shm.unlink()
            raise
        finally:
            shm.close_fd()
        header = SegmentHeader(
            version=LAYOUT_VERSION,
            owner_pid=os.getpid(),
            owner_start=process_start_ticks(os.getpid()) or 0,
            size=total,
            created_ns=time.time_ns(),
            instance=instance,
        )
        packed = header.pack()
        mm[8:HEADER_SIZE] = packed[8:]  # everything but the magic ...
        mm[0:8] = MAGIC  # ... then the magic: a reader seeing it sees a whole header
        return cls(full, mm, header, owner=True)

    @classmethod
    def attach(cls, name: str) -> Segment:
        """Map an existing segment read-write; validates magic, layout version and size."""
        full = name if name.startswith("/") else "/" + name
        try:
            shm = posix_ipc.SharedMemory(full)
        except posix_ipc.ExistentialError as e:
            raise SegmentNotFoundError(
                f"shared-memory segment {full} does not exist (its daemon exited, or the "
                "name is from another daemon instance)"
            ) from e
        try:
            if shm.size < HEADER_SIZE:
                raise BadSegmentError(
                    f"{full}: {shm.size} bytes, smaller than the {HEADER_SIZE}-byte header "
                    "(not a luced segment, or still being created)"
                )
            mm = mmap.mmap(shm.fd, shm.size)
        finally:
            shm.close_fd()
        header = SegmentHeader.unpack(mm[:HEADER_SIZE])
        problem = _header_problem(header, len(mm))
        if problem:
            mm.close()
            raise BadSegmentError(f"{full}: {problem}")
        return cls(full, mm, header, owner=False)

    # -- views --------------------------------------------------------------------------

    def buffer(self, offset: int, nbytes: int) -> memoryview:
        """A writable memoryview of ``nbytes`` at ``offset`` (no copy)."""
        mm = self._mapped()
        if offset < HEADER_SIZE or nbytes < 0 or offset + nbytes > self.size:
            raise SegmentError(
                f"{self.name}: bytes [{offset}, {offset + nbytes}) outside the data area "
                f"[{HEADER_SIZE}, {self.size})"
            )
        return memoryview(mm)[offset : offset + nbytes]

    def array(self, offset: int, shape: Iterable[int], dtype: np.dtype | str) -> np.ndarray:
        """A writable numpy view of ``shape`` x ``dtype`` at ``offset`` (no copy)."""
        dt = np.dtype(dtype)
        shape = tuple(int(s) for s in shape)
        count = int(np.prod(shape, dtype=np.int64))
        buf = self.buffer(offset, count * dt.itemsize)
        return np.frombuffer(buf, dtype=dt, count=count).reshape(shape)

    def address(self) -> int:
        """The mapping's base address (to page-lock it); valid until `close`. The buffer
        export this takes is released before returning, so `close` still unmaps."""
        view = (ctypes.c_char * self.size).from_buffer(self._mapped())
        try:
            return ctypes.addressof(view)
        finally:
            del view

    def _mapped(self) -> mmap.mmap:
        if self._mmap is None:
            raise SegmentError(f"{self.name} is closed")
        return self._mmap

    # -- lifetime -----------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._mmap is None

    def close(self) -> None:
        """Unmap. If numpy views are still alive the mapping lingers until they die."""
        mm, self._mmap = self._mmap, None
        if mm is not None:
            with contextlib.suppress(BufferError):  # exported views: freed with them
                mm.close()

    def unlink(self) -> None:
        """Remove the name (owner only; idempotent). Mappings stay valid."""
        if not self.is_owner:
            raise SegmentError(f"{self.name}: only the owner unlinks; attachers just close")
        if not self._unlinked and os.getpid() == self._pid:
            self._unlinked = True
            with contextlib.suppress(posix_ipc.ExistentialError):
                posix_ipc.unlink_shared_memory(self.name)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.is_owner:
            self.unlink()
        self.close()

    def __repr__(self) -> str:
        role = "owner" if self.is_owner else "attached"
        return f"Segment({self.name!r}, {self.size} bytes, {role})"


def _header_problem(header: SegmentHeader, actual_size: int) -> str | None:
    if header.magic != MAGIC:
        return f"bad magic {header.magic!r} (not a luced segment, or still being created)"
    if header.version != LAYOUT_VERSION:
        return (
            f"layout version {header.version}, this build reads {LAYOUT_VERSION} "
            "(daemon and worker come from different luced builds)"
        )
    if header.size != actual_size:
        return f"header says {header.size} bytes but the segment has {actual_size}"
    return None


class ShmOwner:
    """The daemon's registry of the segments it created; unlinks them all on exit.

    Use as a context manager, and/or call ``unlink_all`` from the daemon's shutdown
    path. ``install_signal_handlers`` suits processes without their own shutdown path
    (tools, tests); the daemon drains on SIGTERM and calls ``unlink_all`` at the end.
    ``install_atexit`` is the last resort. A forked child never unlinks its parent's
    segments: ``unlink_all`` is a no-op outside the creating process.
    """

    def __init__(self, instance: str | None = None) -> None:
        self.instance = instance or new_instance_id()
        segment_name(self.instance, "x")  # validate the instance id now
        self._pid = os.getpid()
        self._names: dict[str, None] = {}  # insertion-ordered set of full names
        self._segments: dict[str, Segment] = {}

    def create(self, name: str, nbytes: int) -> Segment:
        """Create ``/luced-<instance>-<name>`` with ``nbytes`` of data; owned by this registry."""
        full = segment_name(self.instance, name)
        if full in self._names:
            raise SegmentError(f"{full} already exists (created by this owner)")
        try:
            seg = Segment.create(self.instance, name, nbytes, on_created=self._names.setdefault)
        except BaseException:
            self._names.pop(full, None)  # create() unlinked it already
            raise
        self._segments[seg.name] = seg
        return seg

    @property
    def names(self) -> list[str]:
        return list(self._names)

    def segment(self, name: str) -> Segment | None:
        """The segment this owner created under the full name `name`, if any."""
        return self._segments.get(name)

    def unlink(self, seg: Segment) -> None:
        seg.unlink()
        self._names.pop(seg.name, None)
        self._segments.pop(seg.name, None)

    def unlink_all(self) -> list[str]:
        """Unlink every segment this owner created; returns their names. Idempotent.

        Safe from a signal handler: it only unlinks names (no unmapping), so code
        that is still using the mappings keeps working until the process exits.
        """
        if os.getpid() != self._pid:
            return []
        done = []
        for full in list(self._names):
            with contextlib.suppress(posix_ipc.ExistentialError):
                posix_ipc.unlink_shared_memory(full)
            seg = self._segments.get(full)
            if seg is not None:
                seg._unlinked = True
            self._names.pop(full, None)
            done.append(full)
        return done

    def release(self, prefix: str) -> list[str]:
        """Unlink and unmap the segments whose names start with ``prefix`` (one served
        model's, when the daemon unloads it); returns their full names. A mapping that
        numpy views still hold is unmapped when the last of them dies."""
        start = f"/{PREFIX}{self.instance}-{prefix}"
        done = [full for full in self._names if full.startswith(start)]
        for full in done:
            with contextlib.suppress(posix_ipc.ExistentialError):
                posix_ipc.unlink_shared_memory(full)
            self._names.pop(full, None)
            seg = self._segments.pop(full, None)
            if seg is not None:
                seg._unlinked = True
                seg.close()
        return done

    def close_all(self) -> None:
        """Unlink, then unmap every segment (views still alive keep their mapping)."""
        self.unlink_all()
        for seg in self._segments.values():
            seg.close()
        self._segments.clear()

    def install_atexit(self) -> None:
        atexit.register(self.unlink_all)

    def install_signal_handlers(
        self, signals: Iterable[signal.Signals] = (signal.SIGTERM, signal.SIGHUP)
    ) -> None:
        """On each signal: unlink all, then do what the previous disposition did.

        A previous Python handler is called; the default action is re-raised with the
        default disposition restored (so the exit status still says "killed by
        SIGTERM"); an ignored signal stays ignored and is not hooked.
        """
        for sig in signals:
            previous = signal.getsignal(sig)
            if previous == signal.SIG_IGN:
                continue

            def handler(signum: int, frame: FrameType | None, previous: object = previous) -> None:
                self.unlink_all()
                if callable(previous):
                    previous(signum, frame)
                elif previous in (signal.SIG_DFL, None):
                    signal.signal(signum, signal.SIG_DFL)
                    os.kill(os.getpid(), signum)

            signal.signal(sig, handler)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close_all()


@dataclass(frozen=True)
class SegmentInfo:
    """What ``scan`` sees of one ``luced-*`` file in the shm directory."""

    name: str  # POSIX name, with the leading "/"
    header: SegmentHeader | None  # None when the file is too short to hold one
    owner_pid: int  # from the version-independent bytes; 0 if unreadable
    valid: bool  # magic and layout version match this build
    alive: bool  # the owner process still runs
    age_s: float  # since the file's last modification


def scan(prefix: str = PREFIX, shm_dir: Path = SHM_DIR) -> list[SegmentInfo]:
    """Every segment whose file name starts with ``prefix``, with its owner's liveness."""
    if not prefix.startswith(PREFIX):
        raise SegmentError(f"scan prefix {prefix!r} must start with {PREFIX!r}")
    if not shm_dir.is_dir():
        return []  # no /dev/shm (not Linux): nothing to judge
    out = []
    now = time.time()
    for path in sorted(shm_dir.glob(glob.escape(prefix) + "*")):
        try:
            with path.open("rb") as f:
                data = f.read(HEADER_SIZE)
            age = now - path.stat().st_mtime
        except OSError:
            continue  # vanished meanwhile, or not ours to read
        header = SegmentHeader.unpack(data) if len(data) == HEADER_SIZE else None
        pid = _FIXED.unpack(data[:16])[2] if len(data) >= 16 else 0
        valid = header is not None and header.magic == MAGIC and header.version == LAYOUT_VERSION
        start = header.owner_start if valid and header is not None else 0
        alive = pid_alive(pid, start) if pid else False
        out.append(SegmentInfo("/" + path.name, header, pid, valid, alive, age))
    return out


def cleanup_stale(
    prefix: str = PREFIX, shm_dir: Path = SHM_DIR, *, grace_s: float = 60.0
) -> list[str]:
    """Unlink ``luced-*`` segments whose owner is dead; returns the names removed.

    ``prefix`` narrows the scan (e.g. ``"luced-<instance>"``); the daemon uses the default.

    A valid header names its owner (pid + start ticks). A bad header still has its pid
    at bytes 12..16 if the owner got that far; a nonzero dead pid condemns it. A header
    with no pid at all is a creation in progress or garbage: removed only once it is
    older than ``grace_s`` (creation takes microseconds). Segments of other users that
    we may not unlink are skipped.
    """
    removed = []
    for info in scan(prefix, shm_dir):
        if info.alive:
            continue
        if info.owner_pid == 0 and info.age_s < grace_s:
            continue
        try:
            posix_ipc.unlink_shared_memory(info.name)
        except (posix_ipc.ExistentialError, posix_ipc.PermissionsError):
            continue
        removed.append(info.name)
    return removed
