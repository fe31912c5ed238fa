"""The backend worker process: one per backend group, started and owned by the daemon.

    python -m luced.runtime.worker --fd N --group NAME --devices cpu[,cpu...] [--threads N]
                                   [--inbox M]

The daemon makes a unix socketpair, passes one end as fd N (``pass_fds``) and speaks the
frames of ``luced.ipc.frames`` over it; the verbs themselves live in
``luced.runtime.backend``. Request trace::

    daemon                                  worker (this process)
    write token ids into region "tokens"
    send {"op": "forward", tokens, outputs, ...}  ->  view "tokens" in place, run the layers,
                                                      write ids / logits into the regions
    read the regions                          <-  {"ok": true, "n_out", "position", ...}

``--inbox M`` (MoE expert compute): a second inherited socket through which the daemon
hands over direct worker-to-worker links (``luced.ipc.links``): a target worker's link to
the expert worker, or, in the expert worker, one per target worker.

Start: the process answers its first request (the daemon's ``hello``) only once torch is
imported and the backend made, which may take minutes on a busy machine or a cold disk;
until then, and while it loads a model, it sends progress notes twice a second
(``BlockingChannel.keep_alive``), so the daemon bounds its silence, not its start.
``LUCED_TEST_WORKER_SLOW_START=STAGE:SECONDS`` (tests only) sleeps at start: ``silent``
before the first request is even read, ``import`` while importing (with notes).

Lifecycle: the daemon owns it. SIGINT and SIGTERM are ignored (a Ctrl-C in the terminal
or systemd's stop signal to the whole cgroup must not kill a worker mid-step: the daemon
drains first, then sends ``shutdown``, or kills it). The worker exits after replying to
``shutdown``, and as soon as the socket closes (the daemon is gone), so it never lingers.
Exit status: 0 for those two, 1 for a frame that could not be parsed (the stream cannot
be resynchronised), 2 for bad arguments. Logs go to stderr as ``[worker GROUP pid] ...``.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from luced.ipc import frames as F
from luced.ipc.channel import BlockingChannel
from luced.ipc.frames import FrameError

if TYPE_CHECKING:
    from luced.runtime.backend import Backend
    from luced.runtime.carry import Carrier

log = logging.getLogger("luced.runtime.worker")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m luced.runtime.worker",
        description="luced backend worker (started by the daemon, not by hand)",
    )
    p.add_argument("--fd", type=int, required=True, help="inherited, connected unix socket")
    p.add_argument("--group", required=True, help="backend group name, e.g. cpu or cuda")
    add_device_args(p, None, "comma-separated devices this worker drives, e.g. cuda:0,cuda:1")
    p.add_argument(
        "--inbox",
        type=int,
        default=None,
        help="inherited unix socket through which the daemon hands over worker-to-worker "
        "links (MoE expert compute)",
    )
    args = p.parse_args(argv)
    check_device_args(p, args)
    return args


def add_device_args(p: argparse.ArgumentParser, default: tuple[str, ...] | None, help: str) -> None:
    """--devices (required without a default) and --threads, as every worker takes them."""
    p.add_argument(
        "--devices",
        required=default is None,
        default=default,
        type=lambda s: tuple(d.strip() for d in s.split(",") if d.strip()),
        help=help,
    )
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")


def check_device_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if not args.devices:
        p.error("--devices is empty")
    if args.threads is not None and args.threads < 1:
        p.error("--threads must be >= 1")


def slow_start(stage: str) -> None:
    """Tests only: sleep here when ``LUCED_TEST_WORKER_SLOW_START`` is ``STAGE:SECONDS``."""
    wanted, _, seconds = os.environ.get("LUCED_TEST_WORKER_SLOW_START", "").partition(":")
    if wanted == stage:
        log.warning("test-only slow start: sleeping %s s (%s)", seconds, stage)
        time.sleep(float(seconds))


def start_backend(args: argparse.Namespace, channel: BlockingChannel) -> Backend:
    """torch and the backend: the slow part of a start, run inside the first request."""
    channel.stage = "importing torch"
    slow_start("import")
    import torch

    from luced.runtime.backend import Backend

    channel.stage = "opening the devices"
    if args.threads:
        torch.set_num_threads(args.threads)
    inbox = socket.socket(fileno=args.inbox) if args.inbox is not None else None
    backend = Backend(args.group, args.devices, inbox)
    if backend.device_problem:  # hello reports it to the daemon; log it here too
        log.error("%s", backend.device_problem)
    log.info(
        "serving %s on fd %d (torch %s, %d threads)",
        ",".join(args.devices), args.fd, torch.__version__, torch.get_num_threads(),
    )  # fmt: skip
    return backend


class _BackendCarrier:
    """The backend's carrier (``runtime.carry``), once the first request has started it."""

    def __init__(self, backend: Callable[[], Backend | None]) -> None:
        self._backend = backend

    def _carrier(self) -> Carrier:
        from luced.runtime.carry import Carrier

        backend = self._backend()
        if backend is None:
            raise FrameError("a carry before hello")
        return Carrier(backend, backend.hops)

    def before(self, carry: F.Carry) -> None:
        self._carrier().before(carry)

    def after(self, carry: F.Carry) -> tuple[bytes, ...]:
        return self._carrier().after(carry)

    def failed(self, carry: F.Carry) -> None:
        self._carrier().failed(carry)


def main(argv: list[str] | None = None) -> int:
    # First, before the slow torch import: a signal in that window must not kill us either.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    args = parse_args(argv)
    logging.basicConfig(
        stream=sys.stderr,
        level=logging.INFO,
        format=f"[worker {args.group} {os.getpid()}] %(levelname)s %(name)s: %(message)s",
    )
    try:
        sock = socket.socket(fileno=args.fd)
    except OSError as e:
        log.error("--fd %d is not a usable socket: %s", args.fd, e)
        return 2
    if sock.family != socket.AF_UNIX or sock.type != socket.SOCK_STREAM:
        log.error("--fd %d is not a unix stream socket", args.fd)
        return 2

    slow_start("silent")
    channel = BlockingChannel(sock)
    backend: Backend | None = None

    def handle(req: F.Request) -> F.Reply:
        # The first request (the daemon's hello, a SLOW one: with progress notes) starts
        # the backend; torch is imported only now, with the signals already ignored.
        nonlocal backend
        if backend is None:
            backend = start_backend(args, channel)
        return backend.handle(req)

    def idle() -> None:
        if backend is not None:
            backend.after_reply()

    code = 0
    try:
        # Returns after shutdown or when the daemon closes. A carry (relays to workers on
        # other hosts) never comes before hello, which starts the backend.
        channel.serve(handle, _BackendCarrier(lambda: backend), idle)
    except FrameError as e:
        log.error("unreadable frame, closing: %s", e)
        code = 1
    except ConnectionError as e:  # the daemon vanished while we replied
        log.info("daemon gone: %s", e)
    finally:
        if backend is not None:
            backend.close()
        channel.close()
    log.info("exiting")
    return code


if __name__ == "__main__":
    sys.exit(main())
