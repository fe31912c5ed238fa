"""Handing a connected socket to a worker through its inbox (SCM_RIGHTS).

Workers that talk to each other directly (a target worker and the expert worker) get their
connection from the daemon: it makes a socketpair and sends one end to each through that
worker's inbox, a unix socketpair inherited at start (``--inbox FD``). One handover is one
byte of data carrying one fd; the daemon closes its copies right after sending, so the pair
belongs to the two workers alone and closes when either exits. A worker that is restarted
gets a new inbox and, once the daemon links it again, a new connection.

The MoE expert call (``luced.runtime.expert_link``) carries its bulk data in a scratch
region of a daemon-owned segment, one per target worker, laid out per call as::

    +----------------+---------------+-------------------+
    | x / y  [n, H]  | ids [n, k]    | weights [n, k]    |   each part 64-byte aligned
    | float32        | int32         | float32           |
    +----------------+---------------+-------------------+
"""

from __future__ import annotations

import array
import socket

from luced.ipc.regions import Region, align_up

MARK = b"L"


def hand_over(inbox: socket.socket, sock: socket.socket) -> None:
    """Send `sock` through `inbox` (the daemon's end) and close our copy of it."""
    try:
        socket.send_fds(inbox, [MARK], [sock.fileno()])
    finally:
        sock.close()


def take(inbox: socket.socket, *, block: bool) -> socket.socket | None:
    """The next socket handed over (the worker's end), None when none is waiting
    (`block` False). Raises ConnectionError when the daemon closed the inbox."""
    flags = 0 if block else socket.MSG_DONTWAIT
    fds = array.array("i")
    try:  # (socket.recv_fds ignores its flags: recvmsg directly)
        data, ancdata, _, _ = inbox.recvmsg(1, socket.CMSG_SPACE(4 * fds.itemsize), flags)
    except BlockingIOError:
        return None
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
    if not data:
        for fd in fds:
            socket.close(fd)
        raise ConnectionError("the daemon closed this worker's inbox")
    for extra in fds[1:]:
        socket.close(extra)
    return socket.socket(fileno=fds[0]) if fds else None


def link_pair() -> tuple[socket.socket, socket.socket]:
    """A fresh worker-to-worker connection: (caller's end, server's end)."""
    return socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)


def expert_layout(scratch: Region, n: int, hidden: int, k: int) -> tuple[Region, Region, Region]:
    """x, ids and weights of an n-row expert call in `scratch` (the picture above)."""
    x = Region(scratch.segment, scratch.offset, (n, hidden), "float32")
    at = align_up(x.offset + x.nbytes)
    ids = Region(scratch.segment, at, (n, k), "int32")
    weights = Region(scratch.segment, align_up(at + ids.nbytes), (n, k), "float32")
    return x, ids, weights


def scratch_bytes(rows: int, hidden: int, k: int) -> int:
    """A scratch that fits `rows` rows in one call (alignment slack included)."""
    return rows * (4 * hidden + 8 * k) + 128


def scratch_rows(nbytes: int, hidden: int, k: int) -> int:
    """How many rows one call fits in a scratch of `nbytes`."""
    return max(0, (nbytes - 128) // (4 * hidden + 8 * k))
