"""systemd readiness and status notifications (``sd_notify``), in a few lines of our own.

A notification is one datagram of ``KEY=value`` lines sent to the AF_UNIX socket named
by ``$NOTIFY_SOCKET`` (a path, or an abstract name written with a leading ``@``).
Without ``$NOTIFY_SOCKET`` (not started by systemd with Type=notify) every call is a
no-op. A failure to send is logged and never raised: systemd's bookkeeping must not
take the daemon down.

With the default ``NotifyAccess=main`` systemd accepts messages from the daemon's pid
only; worker processes should be started without ``NOTIFY_SOCKET`` in their environment.
"""

from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger(__name__)


def notify(**fields: str | int | float) -> bool:
    """Send ``KEY=value`` fields (keys upper-cased), e.g. ``notify(ready=1, status="up")``.

    Returns True when a datagram was sent.
    """
    address = os.environ.get("NOTIFY_SOCKET")
    if not address or not fields:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]  # abstract namespace
    elif not address.startswith("/"):
        log.warning("NOTIFY_SOCKET=%r: unsupported address, not notifying", address)
        return False
    # A value may not span lines: systemd reads one assignment per line.
    payload = "\n".join(
        f"{key.upper()}={str(value).replace(chr(10), ' ')}" for key, value in fields.items()
    )
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(address)
            sock.sendall(payload.encode())
    except OSError as exc:
        log.warning("sd_notify to %r failed: %s", os.environ.get("NOTIFY_SOCKET"), exc)
        return False
    return True


def ready(status: str | None = None) -> bool:
    """The model is loaded and the HTTP server listens (Type=notify start-up completes)."""
    return notify(ready=1, status=status) if status else notify(ready=1)


def status(text: str) -> bool:
    """A free-form status line shown by ``systemctl status``."""
    return notify(status=text)


def stopping(status: str | None = None) -> bool:
    """Shutdown has begun (draining)."""
    return notify(stopping=1, status=status) if status else notify(stopping=1)
