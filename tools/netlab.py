"""Two hosts on one machine, with a faulty wire between them: for tests and benchmarks of
workers on other hosts (root only; Linux network namespaces).

    host A: this process's namespace    10.X.Y.1  veth ─┐
                                                        │  namespace "…-wire": the bridge
    host B: namespace "…-b", private /dev/shm 10.X.Y.2  veth ─┘  (a userspace L2 forwarder)

The bridge (``python tools/netlab.py bridge IF_A IF_B --control SOCKET``) copies every
Ethernet frame between its two interfaces through AF_PACKET sockets, so it sees all the
traffic between the hosts: the control connection, the torch.distributed store and gloo's
own data connections (whose ports are chosen at run time and published through the
store, which a per-port TCP proxy would miss). On command (a line on its unix socket)
it adds a one-way delay, drops everything (a partition), or resets every TCP connection
it sees (``reset``: a RST to both ends of each, until ``reset off``). Checksum offload is
turned off on the veths (ioctl SIOCETHTOOL), since a frame captured before the kernel
filled its checksum would arrive corrupt, and their MTU is 64000 so a segment is a frame.

Host B's processes run under ``unshare -m`` with a fresh tmpfs on /dev/shm: they cannot
reach host A's shared memory, as on a real other host.

    with Lab() as lab:                      # LabUnavailable(reason) without the rights
        proc = lab.popen_b([python, "-m", "luced.runtime.listen", "--listen", f"{lab.b}:7070", ...])
        lab.wire("delay 5")                  # ms each way; "partition on|off", "reset on|off"

`Loopback()` is the fallback where namespaces are not permitted: host B is this host's
loopback, its processes still in a private mount namespace when ``unshare -m`` works; it
has no wire, so faults cannot be injected (``lab.wire`` raises LabUnavailable).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import fcntl
import heapq
import os
import secrets
import select
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Self

IP = "ip"
MTU = 64000
SIOCETHTOOL = 0x8946
ETHTOOL_STXCSUM = 0x17  # set TX checksum offload


class LabUnavailable(RuntimeError):
    """Network namespaces (or the bridge) cannot be set up here; the message says why."""


def _run(*argv: str) -> None:
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode:
        raise LabUnavailable(f"{' '.join(argv)}: {done.stderr.strip() or done.returncode}")


def tx_checksum_off(ifname: str) -> None:
    """ethtool -K IF tx off, without ethtool (runs in the interface's namespace)."""
    value = ctypes.create_string_buffer(struct.pack("II", ETHTOOL_STXCSUM, 0))
    ifreq = struct.pack("16sP", ifname.encode(), ctypes.addressof(value)) + bytes(16)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        fcntl.ioctl(s, SIOCETHTOOL, ifreq)


def private_shm(argv: list[str]) -> list[str]:
    """`argv` in a mount namespace of its own with an empty /dev/shm."""
    script = 'mount -t tmpfs -o size=4g tmpfs /dev/shm && exec "$@"'
    return ["unshare", "-m", "--propagation", "private", "sh", "-c", script, "sh", *argv]


def clear_stale_namespaces() -> None:
    """Delete the namespaces of labs whose creating process is gone (killed before its
    `close`): ``luced-PID-TAG-b`` / ``-wire``."""
    listed = subprocess.run([IP, "netns", "list"], capture_output=True, text=True).stdout
    for line in listed.splitlines():
        parts = line.split()[0].split("-") if line.strip() else []
        if len(parts) != 4 or parts[0] != "luced" or not parts[1].isdigit():
            continue
        try:
            os.kill(int(parts[1]), 0)
        except ProcessLookupError:
            subprocess.run([IP, "netns", "del", line.split()[0]], capture_output=True)
        except PermissionError:  # alive, another user's
            pass


class Lab:
    """Hosts A (here) and B (a namespace) joined through the bridge (module docstring)."""

    def __init__(self) -> None:
        if os.geteuid() != 0:
            raise LabUnavailable("network namespaces need root")
        clear_stale_namespaces()
        tag = secrets.token_hex(3)
        # The creator's pid in the names: a lab whose process was killed is found and
        # cleared by the next one, and a live one's (a parallel test's) left alone.
        self.ns_b = f"luced-{os.getpid()}-{tag}-b"
        self.ns_wire = f"luced-{os.getpid()}-{tag}-wire"
        self.if_a, self.if_b = f"lc{tag}a", f"lc{tag}b"
        octet = int(tag[:2], 16) % 200 + 20
        self.a, self.b = f"10.{octet}.{int(tag[2:4], 16)}.1", f"10.{octet}.{int(tag[2:4], 16)}.2"
        self.control = Path(tempfile.gettempdir()) / f"luced-{tag}-wire.sock"
        self._bridge: subprocess.Popen | None = None
        self._made: list[str] = []

    def __enter__(self) -> Self:
        try:
            self._setup()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _setup(self) -> None:
        for ns in (self.ns_b, self.ns_wire):
            _run(IP, "netns", "add", ns)
            self._made.append(ns)
        wa, wb = f"{self.if_a}w", f"{self.if_b}w"
        _run(IP, "link", "add", self.if_a, "mtu", str(MTU), "type", "veth", "peer", "name", wa,
             "mtu", str(MTU), "netns", self.ns_wire)  # fmt: skip
        self._made.append(f"link:{self.if_a}")
        _run(IP, "link", "add", self.if_b, "mtu", str(MTU), "netns", self.ns_b, "type", "veth",
             "peer", "name", wb, "mtu", str(MTU), "netns", self.ns_wire)  # fmt: skip
        _run(IP, "addr", "add", f"{self.a}/24", "dev", self.if_a)
        _run(IP, "link", "set", self.if_a, "up")
        in_b = (IP, "netns", "exec", self.ns_b)
        _run(*in_b, IP, "addr", "add", f"{self.b}/24", "dev", self.if_b)
        _run(*in_b, IP, "link", "set", self.if_b, "up")
        _run(*in_b, IP, "link", "set", "lo", "up")
        for end in (wa, wb):
            _run(IP, "netns", "exec", self.ns_wire, IP, "link", "set", end, "up")
        tx_checksum_off(self.if_a)
        me = [sys.executable, __file__]
        _run(*in_b, *me, "csum-off", self.if_b)
        _run(IP, "netns", "exec", self.ns_wire, *me, "csum-off", wa, wb)
        self._bridge = subprocess.Popen(
            [
                IP,
                "netns",
                "exec",
                self.ns_wire,
                *me,
                "bridge",
                wa,
                wb,
                "--control",
                str(self.control),
            ]
        )
        deadline = time.monotonic() + 20
        while not self.control.exists():
            if self._bridge.poll() is not None or time.monotonic() > deadline:
                raise LabUnavailable("the bridge did not start")
            time.sleep(0.05)

    def popen_b(self, argv: list[str], **kwargs: object) -> subprocess.Popen:
        """A process on host B (its own /dev/shm)."""
        return subprocess.Popen([IP, "netns", "exec", self.ns_b, *private_shm(argv)], **kwargs)  # type: ignore[call-overload]

    def wire(self, command: str) -> str:
        """Tell the bridge: "delay MS", "partition on|off", "reset on|off", "stats"."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(10)
            s.connect(str(self.control))
            s.sendall(command.encode() + b"\n")
            return s.makefile().readline().strip()

    def close(self) -> None:
        if self._bridge is not None:
            self._bridge.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._bridge.wait(10)
            if self._bridge.poll() is None:
                self._bridge.kill()
            self._bridge = None
        for made in reversed(self._made):
            if made.startswith("link:"):
                subprocess.run([IP, "link", "del", made[5:]], capture_output=True)
            else:
                subprocess.run([IP, "netns", "del", made], capture_output=True)
        self._made.clear()
        self.control.unlink(missing_ok=True)


class Loopback:
    """Host B on this host's loopback, in a private mount namespace where permitted."""

    a = b = "127.0.0.1"

    def __init__(self) -> None:
        probe = subprocess.run(private_shm(["true"]), capture_output=True, text=True)
        self.isolated = probe.returncode == 0
        self.why = "" if self.isolated else probe.stderr.strip()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def popen_b(self, argv: list[str], **kwargs: object) -> subprocess.Popen:
        return subprocess.Popen(private_shm(argv) if self.isolated else argv, **kwargs)  # type: ignore[call-overload]

    def wire(self, command: str) -> str:
        raise LabUnavailable("loopback has no wire to break (network namespaces not permitted)")


# -- the bridge ------------------------------------------------------------------------------

ETH_P_ALL = 3
ETH_P_IP = 0x0800
TCP_RST, TCP_ACK = 0x04, 0x10


def _checksum(data: bytes) -> int:
    if len(data) % 2:
        data += b"\0"
    total = sum(struct.unpack(f"!{len(data) // 2}H", data))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF


def _rst(frame: bytes, towards_sender: bool) -> bytes | None:
    """A TCP RST for the connection of `frame` (Ethernet + IPv4 + TCP): to its sender
    (seq = what it acknowledged) or on to its receiver (seq = its own); None if not TCP."""
    if len(frame) < 54 or struct.unpack("!H", frame[12:14])[0] != ETH_P_IP or frame[23] != 6:
        return None
    ihl = (frame[14] & 0x0F) * 4
    ip, tcp = frame[14 : 14 + ihl], frame[14 + ihl :]
    src, dst = ip[12:16], ip[16:20]
    sport, dport, seq, ack = struct.unpack("!HHII", tcp[:12])
    if tcp[13] & TCP_RST:
        return None
    if towards_sender:
        if not tcp[13] & TCP_ACK:
            return None
        eth = frame[6:12] + frame[0:6] + frame[12:14]
        src, dst, sport, dport, seq = dst, src, dport, sport, ack
    else:
        eth = frame[0:14]
    header = struct.pack("!HHIIBBHHH", sport, dport, seq, 0, 5 << 4, TCP_RST, 0, 0, 0)
    pseudo = src + dst + struct.pack("!BBH", 0, 6, len(header))
    header = header[:16] + struct.pack("!H", _checksum(pseudo + header)) + header[18:]
    ipv4 = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 40, 0, 0x4000, 64, 6, 0, src, dst)
    ipv4 = ipv4[:10] + struct.pack("!H", _checksum(ipv4)) + ipv4[12:]
    return eth + ipv4 + header


def bridge(if_a: str, if_b: str, control: Path) -> None:
    """Forward frames between two interfaces until SIGTERM (module docstring)."""
    raw = {}
    for name in (if_a, if_b):
        s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
        s.bind((name, 0))
        s.setblocking(False)
        raw[name] = s
    other = {raw[if_a]: raw[if_b], raw[if_b]: raw[if_a]}
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    control.unlink(missing_ok=True)
    server.bind(str(control))
    server.listen(4)
    state = {"delay": 0.0, "partition": False, "reset": False}
    counts = {"frames": 0, "bytes": 0, "dropped": 0, "resets": 0}
    queue: list[tuple[float, int, socket.socket, bytes]] = []  # (due, n, out, frame)
    n = 0
    while True:
        timeout = max(0.0, queue[0][0] - time.monotonic()) if queue else 1.0
        ready, _, _ = select.select([*raw.values(), server], [], [], timeout)
        for sock in ready:
            if sock is server:
                conn, _ = server.accept()
                with conn:
                    line = conn.makefile().readline().split()
                    reply = _command(line, state, counts)
                    conn.sendall(reply.encode() + b"\n")
                continue
            while True:
                try:
                    frame, addr = sock.recvfrom(MTU + 64)
                except BlockingIOError:
                    break
                if addr[2] == socket.PACKET_OUTGOING:
                    continue  # our own sends, seen again
                if state["partition"]:
                    counts["dropped"] += 1
                    continue
                if state["reset"]:
                    back, on = _rst(frame, True), _rst(frame, False)
                    if back is not None and on is not None:
                        sock.send(back)
                        other[sock].send(on)
                        counts["resets"] += 1
                        continue
                n += 1
                heapq.heappush(queue, (time.monotonic() + state["delay"], n, other[sock], frame))
        now = time.monotonic()
        while queue and queue[0][0] <= now:
            _, _, out, frame = heapq.heappop(queue)
            with contextlib.suppress(OSError):
                out.send(frame)
                counts["frames"] += 1
                counts["bytes"] += len(frame)


def _command(words: list[str], state: dict, counts: dict) -> str:
    match words:
        case ["delay", ms]:
            state["delay"] = float(ms) / 1000
        case ["partition" | "reset" as what, "on" | "off" as how]:
            state[what] = how == "on"
        case ["stats"]:
            pass
        case _:
            return f"error: unknown command {' '.join(words)!r}"
    return " ".join(f"{k}={v}" for k, v in {**state, **counts}.items())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("bridge", help="forward frames between two interfaces (in the wire ns)")
    b.add_argument("if_a")
    b.add_argument("if_b")
    b.add_argument("--control", type=Path, required=True)
    c = sub.add_parser("csum-off", help="turn TX checksum offload off on interfaces")
    c.add_argument("ifnames", nargs="+")
    args = p.parse_args(argv)
    if args.cmd == "csum-off":
        for name in args.ifnames:
            tx_checksum_off(name)
        return 0
    import signal

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        bridge(args.if_a, args.if_b, args.control)
    finally:
        args.control.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
