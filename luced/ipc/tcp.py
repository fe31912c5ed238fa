"""Control connections to workers on other hosts: TCP, authenticated by a shared key.

    luced worker --listen 10.0.0.2:7070 --worker-key-file /etc/luced/worker.key --model M
    luced serve M --target-devices cpu,tcp://10.0.0.2:7070/cpu --worker-key-file ...

Before any frame, both ends prove that they hold the key K (HMAC-SHA256), without sending
it; fresh nonces make a recorded exchange worthless::

    worker -> daemon   MAGIC (8 bytes) | Ns (32 random bytes)
    daemon -> worker   Nc (32 random bytes) | HMAC(K, "daemon" | Ns | Nc)
    worker -> daemon   HMAC(K, "worker" | Nc | Ns)

A peer that fails, or takes longer than the handshake's timeout, is closed before it can
send a frame (the worker logs its address). After the handshake the stream carries the
length-prefixed frames of ``channel.py``, as a unix socket does.

The connection is authenticated, not encrypted, and neither are the torch.distributed
links between workers (hidden states, feature rows): hosts must share a private network
or a WireGuard link. TLS on this connection alone would hide the token ids but not the
hidden states beside them, which carry the same text, so it is not offered.

Sockets are tuned for a control link: no Nagle delay, and keep-alive probes plus a user
timeout, so a peer behind a partition is noticed within ``DEAD_PEER_S`` even while the
connection is idle.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
import secrets
import socket
import stat
from pathlib import Path

MAGIC = b"LUCEDWK1"
NONCE_BYTES = 32
KEY_MIN_BYTES = 32
DIGEST_BYTES = hashlib.sha256().digest_size
HANDSHAKE_TIMEOUT = 10.0  # seconds for the whole exchange
DEAD_PEER_S = 15  # keep-alive: idle 5 s, then 5 probes 2 s apart; unacknowledged data: 15 s


class AuthError(ConnectionError):
    """The peer could not prove that it holds the key (or spoke something else)."""


class KeyFileError(ValueError):
    """The key file is missing, too short, or readable by others."""


def parse_address(text: str) -> tuple[str, int]:
    """ "HOST:PORT" or "[V6]:PORT" -> (host, port); ValueError naming the text."""
    host, sep, port = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{text!r} is not HOST:PORT")
    return host, int(port)


def read_key(path: Path) -> bytes:
    """The shared key: the file's contents without surrounding whitespace, at least
    KEY_MIN_BYTES, in a file only its owner may read (as ssh insists for its keys)."""
    try:
        mode = path.stat().st_mode
        key = path.read_bytes().strip()
    except OSError as exc:
        raise KeyFileError(f"worker key file {path}: {exc.strerror or exc}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise KeyFileError(
            f"worker key file {path} is open to other users (mode {stat.S_IMODE(mode):o}); "
            f"chmod 600 {path}"
        )
    if len(key) < KEY_MIN_BYTES:
        raise KeyFileError(
            f"worker key file {path} holds {len(key)} bytes; a key needs at least "
            f"{KEY_MIN_BYTES} (e.g. `head -c 32 /dev/urandom | base64 > {path}`)"
        )
    return key


def _mac(key: bytes, who: bytes, first: bytes, second: bytes) -> bytes:
    return hmac.new(key, who + first + second, hashlib.sha256).digest()


def tune(sock: socket.socket) -> None:
    """No Nagle delay; keep-alive and a user timeout that end a dead peer's connection."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 5), ("TCP_KEEPINTVL", 2), ("TCP_KEEPCNT", 5)):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
    if hasattr(socket, "TCP_USER_TIMEOUT"):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, DEAD_PEER_S * 1000)


# -- the worker's side (blocking) ------------------------------------------------------------


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise AuthError("the peer closed the connection during the handshake")
        buf += chunk
    return bytes(buf)


def accept_peer(sock: socket.socket, key: bytes, timeout: float = HANDSHAKE_TIMEOUT) -> None:
    """Authenticate a daemon that connected to this worker; AuthError when it fails (the
    caller closes the socket). Leaves the socket blocking, without a timeout."""
    sock.settimeout(timeout)
    try:
        ns = secrets.token_bytes(NONCE_BYTES)
        sock.sendall(MAGIC + ns)
        answer = _recv_exact(sock, NONCE_BYTES + DIGEST_BYTES)
        nc, mac = answer[:NONCE_BYTES], answer[NONCE_BYTES:]
        if not hmac.compare_digest(mac, _mac(key, b"daemon", ns, nc)):
            raise AuthError("the peer does not hold the worker key")
        sock.sendall(_mac(key, b"worker", nc, ns))
    except TimeoutError:
        raise AuthError(f"no handshake within {timeout:g} s") from None
    except OSError as exc:
        if isinstance(exc, AuthError):
            raise
        raise AuthError(f"handshake failed: {exc}") from None
    sock.settimeout(None)
    tune(sock)


# -- the daemon's side (asyncio) -------------------------------------------------------------


async def connect(
    host: str, port: int, key: bytes, timeout: float = HANDSHAKE_TIMEOUT
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Connect to a worker and authenticate both ways. Raises OSError when the host is not
    reachable, AuthError when the peer is not a worker holding the key, TimeoutError."""
    async with asyncio.timeout(timeout):
        reader, writer = await asyncio.open_connection(host, port)
        try:
            tune(writer.get_extra_info("socket"))
            try:
                hello = await reader.readexactly(len(MAGIC) + NONCE_BYTES)
            except asyncio.IncompleteReadError:
                raise AuthError(
                    f"{host}:{port} closed the connection: it refused this daemon's key, or "
                    "it is not a luced worker"
                ) from None
            if hello[: len(MAGIC)] != MAGIC:
                raise AuthError(f"{host}:{port} is not a luced worker (it said {hello[:8]!r})")
            ns = hello[len(MAGIC) :]
            nc = os.urandom(NONCE_BYTES)
            writer.write(nc + _mac(key, b"daemon", ns, nc))
            await writer.drain()
            try:
                proof = await reader.readexactly(DIGEST_BYTES)
            except asyncio.IncompleteReadError:
                raise AuthError(
                    f"{host}:{port} refused this daemon's key (see the worker's log)"
                ) from None
            if not hmac.compare_digest(proof, _mac(key, b"worker", nc, ns)):
                raise AuthError(f"{host}:{port} does not hold the worker key")
        except BaseException:
            writer.close()
            raise
    return reader, writer
