"""A backend worker for a daemon on another host: ``luced worker --listen ADDR:PORT``.

    luced worker --listen 10.0.0.2:7070 --worker-key-file /etc/luced/worker.key \\
                 --model /srv/models/model.gguf [--model /srv/models/draft.gguf] \\
                 [--devices cpu] [--threads N] [--data-port 7071] \\
                 [--prefix-cache-bytes 1G] [--kv-cache-dir DIR] [--kv-cache-budget 8G]

Started by hand or by systemd (``systemd/luced-worker.service``), never by the daemon, and
it outlives daemons: it serves one daemon connection at a time. When that connection ends
(the daemon stopped or was cut off, or a newer authenticated connection arrived: a daemon
that reconnected) it drops what that daemon had it hold (sequences, mirrored regions,
links), keeps the loaded weights for a daemon that loads the same layers again, and
serves the next one.

Connections pass the key handshake of ``ipc/tcp.py`` within 10 s or are closed; a
refused peer is logged with its address. Then the frames are a local worker's, plus the
carry of ``ipc/frames/remote.py``: the daemon's regions live here in a ``Mirror``.

Files: the daemon names model files by its own paths; ``hello`` says each one's size and
SHA-256, and this worker maps them onto the ``--model`` files with the same identity (a
missing or different copy fails hello, naming both). Each ``--model`` file is hashed once
at start.

Prefix cache: this worker's layers' part of it stays on this host. K/V blocks
(``kv_store.py``) in its mirror of the daemon's host records, of which the daemon gives the
prefix cache at most ``--prefix-cache-bytes`` here, and, with ``--kv-cache-dir``, in block
files on its disk, by the daemon's prefix keys; where the daemon keeps snapshots instead
(`--kv-block-size 0` without KV Flash, a recurrent hybrid), their rows
(``snapshot_store.py``) in that much memory and on that disk, by the daemon's entry ids.
The files outlive daemon connections and restarts.

Data links: a torch.distributed TCP store listens on ADDR:--data-port (any free port by
default; ``hello``'s reply says which), and each hop's gloo sockets on ADDR. None of them
is authenticated: ADDR must be on a private network (or a WireGuard link).

SIGTERM / SIGINT end it once the frame in hand is answered. Exit status 2: bad arguments,
or a key file that is missing, short or open to other users.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import logging
import os
import queue
import signal
import socket
import sys
import threading
from pathlib import Path

from luced.ipc import frames as F
from luced.ipc.channel import BlockingChannel
from luced.ipc.files import identify
from luced.ipc.tcp import AuthError, KeyFileError, accept_peer, parse_address, read_key
from luced.runtime.worker import add_device_args, check_device_args
from luced.values import to_bytes

log = logging.getLogger("luced.runtime.listen")

MAX_HANDSHAKES = 16  # connections being authenticated at once; more are closed at once


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="luced worker",
        description="luced backend worker for a daemon on another host",
    )
    p.add_argument("--listen", required=True, help="ADDR:PORT to listen on (a private address)")
    p.add_argument("--worker-key-file", required=True, type=Path, help="the shared key (mode 600)")
    p.add_argument(
        "--model",
        action="append",
        required=True,
        type=Path,
        help="a model file this host holds (the target's GGUF, a draft); repeat for each",
    )
    add_device_args(p, ("cpu",), "comma-separated devices this worker drives (default: cpu)")
    p.add_argument(
        "--prefix-cache-bytes",
        type=_byte_count,
        default=2**30,
        help="memory for this host's part of the prefix cache (e.g. 512M; default 1G)",
    )
    p.add_argument(
        "--kv-cache-dir",
        type=Path,
        default=None,
        help="directory of this host's prefix-cache disk tier (default: memory only)",
    )
    p.add_argument(
        "--kv-cache-budget",
        type=_byte_count,
        default=8 * 2**30,
        help="most bytes the disk tier keeps (default 8G)",
    )
    p.add_argument(
        "--data-port",
        type=int,
        default=0,
        help="port of the torch.distributed store on ADDR (default: any free port)",
    )
    args = p.parse_args(argv)
    try:
        args.address = parse_address(args.listen)
    except ValueError as exc:
        p.error(f"--listen: {exc}")
    check_device_args(p, args)
    return args


def _byte_count(text: str) -> int:
    try:
        return to_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


class Files:
    """This host's copies of model files by identity, and one daemon's names for them."""

    def __init__(self, paths: list[Path]) -> None:
        self.by_identity: dict[F.FileIdentity, Path] = {}
        for path in paths:
            ident = identify(path)
            self.by_identity[ident] = path
            log.info("model %s: %d bytes, sha256 %s", path, ident.size, ident.sha256)
        self.names: dict[str, str] = {}  # the daemon's path -> ours

    def resolve(self, wanted: dict[str, F.FileIdentity]) -> None:
        """Map the daemon's paths onto our copies (hello); WorkerError naming what is missing."""
        from luced.runtime.state import WorkerError

        missing = [f"{p} ({i.size} bytes, sha256 {i.sha256[:16]}…)" for p, i in wanted.items()
                   if i not in self.by_identity]  # fmt: skip
        if missing:
            held = ", ".join(
                f"{p} ({i.size} bytes, sha256 {i.sha256[:16]}…)"
                for i, p in self.by_identity.items()
            )
            raise WorkerError(
                f"this worker holds no copy of {'; '.join(missing)}: it holds {held}. Copy the "
                "daemon's file here (same bytes) and name it with --model"
            )
        self.names = {p: str(self.by_identity[i]) for p, i in wanted.items()}

    def sha256(self, path: str) -> str:
        """The hash of one of our files (a translated path)."""
        return next(i.sha256 for i, p in self.by_identity.items() if str(p) == path)

    def translate(self, req: F.Request) -> F.Request:
        """`req` with the daemon's file paths replaced by ours."""
        fields = {"load": ("model",), "load_draft": ("path", "target"), "load_experts": ("model",)}
        changes = {
            name: self.names.get(getattr(req, name), getattr(req, name))
            for name in fields.get(req.OP, ())
            if getattr(req, name) is not None
        }
        return dataclasses.replace(req, **changes) if changes else req


class Listener:
    """Accepts and authenticates daemon connections; the newest one is served (module
    docstring). Handshakes run on threads, so a silent peer holds up nobody."""

    def __init__(self, address: tuple[str, int], key: bytes) -> None:
        self.key = key
        self.sock = socket.create_server(address, reuse_port=False, backlog=16)
        self.ready: queue.Queue[socket.socket] = queue.Queue()
        self.current: socket.socket | None = None  # the connection being served
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(MAX_HANDSHAKES)
        self.closed = False

    def start(self) -> None:
        threading.Thread(target=self._accept, name="accept", daemon=True).start()

    def _accept(self) -> None:
        while not self.closed:
            try:
                conn, peer = self.sock.accept()
            except OSError:
                return
            if not self._slots.acquire(blocking=False):
                log.warning("refused %s: %d handshakes already under way", peer[0], MAX_HANDSHAKES)
                conn.close()
                continue
            threading.Thread(target=self._handshake, args=(conn, peer), daemon=True).start()

    def _handshake(self, conn: socket.socket, peer: tuple) -> None:
        try:
            accept_peer(conn, self.key)
        except AuthError as exc:
            log.warning("refused unauthenticated peer %s:%s: %s", peer[0], peer[1], exc)
            conn.close()
            return
        finally:
            self._slots.release()
        log.info("daemon connected from %s:%s", peer[0], peer[1])
        with self._lock:
            if self.current is not None:  # a daemon that reconnected: the old link is dead
                log.warning("a newer connection replaces the one being served")
                _shut(self.current)
        self.ready.put(conn)

    def next(self) -> socket.socket | None:
        """The next authenticated connection, or None once closed."""
        while not self.closed:
            try:
                conn = self.ready.get(timeout=0.5)
            except queue.Empty:
                continue
            with self._lock:
                self.current = conn
            return conn
        return None

    def done(self, conn: socket.socket) -> None:
        with self._lock:
            if self.current is conn:
                self.current = None
        conn.close()

    def close(self) -> None:
        self.closed = True
        self.sock.close()
        with self._lock:
            if self.current is not None:
                _shut(self.current)


def _shut(conn: socket.socket) -> None:
    with contextlib.suppress(OSError):  # already closed
        conn.shutdown(socket.SHUT_RDWR)  # the serving loop's recv returns


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    host, port = args.address
    logging.basicConfig(
        stream=sys.stderr,
        level=logging.INFO,
        format=f"[worker {args.listen} {os.getpid()}] %(levelname)s %(name)s: %(message)s",
    )
    try:
        key = read_key(args.worker_key_file)
        files = Files(args.model)
    except (KeyFileError, OSError) as exc:
        log.error("%s", exc)
        return 2
    import torch
    import torch.distributed as dist

    from luced.runtime.backend import Backend
    from luced.runtime.carry import Carrier
    from luced.runtime.hops import Hops
    from luced.runtime.kv_snapshot import snapshot_specs
    from luced.runtime.kv_store import ShardBlocks
    from luced.runtime.mirror import Mirror, regions_of
    from luced.runtime.snapshot_store import ShardSnapshots

    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        listener = Listener((host, port), key)
        data = socket.create_server((host, args.data_port))
    except OSError as exc:
        log.error("cannot listen on %s: %s", args.listen, exc)
        return 2
    store_at = f"{host}:{data.getsockname()[1]}"
    store = dist.TCPStore(
        host, data.getsockname()[1], None, True, datetime.timedelta(seconds=60),
        wait_for_workers=False, master_listen_fd=data.detach(),
    )  # fmt: skip
    mirror = Mirror()
    hops = Hops((store_at, store))
    backend = Backend(f"tcp://{args.listen}", args.devices, mirror=mirror, hops=hops)
    if backend.device_problem:
        log.error("%s", backend.device_problem)
        return 2
    carrier = Carrier(backend, hops, mirror)
    snapshots = ShardSnapshots(args.prefix_cache_bytes, args.kv_cache_dir, args.kv_cache_budget)
    backend.snapshots = snapshots
    backend.block_files = ShardBlocks(args.kv_cache_dir, args.kv_cache_budget)

    def stop(signum: int, frame: object) -> None:
        log.info("signal %d: exiting after the frame in hand", signum)
        listener.close()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    listener.start()
    log.info(
        "listening on %s (devices %s, torch %s, %d threads; data store %s)",
        args.listen, ",".join(args.devices), torch.__version__, torch.get_num_threads(), store_at,
    )  # fmt: skip

    def handle(req: F.Request) -> F.Reply:
        if isinstance(req, F.Hello):
            files.resolve(req.files)
            reply = backend.handle(req)
            assert isinstance(reply, F.HelloReply)
            return dataclasses.replace(
                reply, store=store_at, prefix_cache_bytes=args.prefix_cache_bytes
            )
        req = files.translate(req)
        if isinstance(req, F.Load):
            reply = backend.reuse_load(req) or backend.handle(req)
            if isinstance(reply, F.LoadReply):  # this load's snapshots (the same: kept)
                a, b = req.layers
                key = (files.sha256(req.model), req.weights, req.batch_invariant, req.moe_hot)
                dtype = req.kv_dtype or req.dtype
                snapshots.open(repr(key), dtype, f"{a}-{b}", snapshot_specs(backend))
            return reply
        mirror.reserve(regions_of(req))  # nothing merges while the frame runs
        return backend.handle(req)

    while (conn := listener.next()) is not None:
        channel = BlockingChannel(conn)
        try:
            channel.serve(handle, carrier)
        except (F.FrameError, ConnectionError, OSError) as exc:
            log.warning("connection ended: %s", exc)
        finally:
            listener.done(conn)
            backend.detach()
            log.info("daemon disconnected; waiting for the next")
    backend.close()
    snapshots.close()
    backend.block_files.close()
    log.info("exiting")
    return 0


if __name__ == "__main__":
    sys.exit(main())
