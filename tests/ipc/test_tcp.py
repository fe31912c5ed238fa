"""The control connection's handshake (ipc/tcp.py): both ends prove the key, anything else
is refused before a frame; the key file's rules; addresses."""

from __future__ import annotations

import asyncio
import socket
import threading
from pathlib import Path

import pytest

from luced.ipc import frames as F
from luced.ipc import tcp
from luced.ipc.channel import AsyncChannel, BlockingChannel

KEY = b"0123456789abcdef0123456789abcdef"


def serve_once(key: bytes) -> tuple[int, list]:
    """A worker's side on a free loopback port: authenticate one peer, answer its frames
    (a stats reply) until it leaves. -> (port, outcomes: "ok" or the AuthError)."""
    server = socket.create_server(("127.0.0.1", 0))
    outcomes: list = []

    def run() -> None:
        conn, _ = server.accept()
        server.close()
        with conn:
            try:
                tcp.accept_peer(conn, key, timeout=5)
            except tcp.AuthError as exc:
                outcomes.append(exc)
                return
            outcomes.append("ok")
            BlockingChannel(conn).serve(lambda req: F.StatsReply(stats={"up": 1}))

    threading.Thread(target=run, daemon=True).start()
    return server.getsockname()[1], outcomes


async def test_both_ends_with_the_key_exchange_frames() -> None:
    port, outcomes = serve_once(KEY)
    reader, writer = await tcp.connect("127.0.0.1", port, KEY)
    channel = AsyncChannel(reader, writer)
    assert await channel.call(F.Stats()) == F.StatsReply(stats={"up": 1})
    await channel.close()
    assert outcomes == ["ok"]


async def test_a_daemon_with_another_key_is_refused_before_any_frame() -> None:
    port, outcomes = serve_once(KEY)
    with pytest.raises(tcp.AuthError, match="refused this daemon's key"):
        await tcp.connect("127.0.0.1", port, b"x" * 32)
    await asyncio.sleep(0.1)
    assert "does not hold the worker key" in str(outcomes[0])


async def test_a_worker_without_the_key_is_refused_by_the_daemon() -> None:
    """An impostor that sends a well-formed challenge cannot answer with the right proof."""
    server = socket.create_server(("127.0.0.1", 0))

    def impostor() -> None:
        conn, _ = server.accept()
        with conn:
            conn.sendall(tcp.MAGIC + bytes(tcp.NONCE_BYTES))
            conn.recv(1024)
            conn.sendall(bytes(tcp.DIGEST_BYTES))  # a proof it cannot make
            conn.recv(1)

    threading.Thread(target=impostor, daemon=True).start()
    with pytest.raises(tcp.AuthError, match="does not hold the worker key"):
        await tcp.connect("127.0.0.1", server.getsockname()[1], KEY)
    server.close()


async def test_something_else_on_the_port_is_named() -> None:
    server = socket.create_server(("127.0.0.1", 0))

    def http() -> None:
        conn, _ = server.accept()
        with conn:
            conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n" + bytes(64))

    threading.Thread(target=http, daemon=True).start()
    with pytest.raises(tcp.AuthError, match="is not a luced worker"):
        await tcp.connect("127.0.0.1", server.getsockname()[1], KEY)
    server.close()


def test_a_silent_peer_times_out_and_a_replayed_answer_fails() -> None:
    a, b = socket.socketpair()
    with a, b, pytest.raises(tcp.AuthError, match=r"no handshake within 0\.2 s"):
        tcp.accept_peer(a, KEY, timeout=0.2)
    # A recorded answer to another challenge is worthless: the worker's nonce is new.
    a, b = socket.socketpair()
    with a, b:
        b.settimeout(5)
        t = threading.Thread(target=lambda: b.sendall(bytes(32) + bytes(32)))
        t.start()
        with pytest.raises(tcp.AuthError, match="does not hold the worker key"):
            tcp.accept_peer(a, KEY, timeout=5)
        t.join()


def test_key_files(tmp_path: Path) -> None:
    good = tmp_path / "good.key"
    good.write_text(KEY.decode() + "\n")
    good.chmod(0o600)
    assert tcp.read_key(good) == KEY
    short = tmp_path / "short.key"
    short.write_text("abc")
    short.chmod(0o600)
    with pytest.raises(tcp.KeyFileError, match="holds 3 bytes; a key needs at least 32"):
        tcp.read_key(short)
    shared = tmp_path / "shared.key"
    shared.write_bytes(KEY)
    shared.chmod(0o644)
    with pytest.raises(tcp.KeyFileError, match=r"open to other users .*chmod 600"):
        tcp.read_key(shared)
    with pytest.raises(tcp.KeyFileError, match="No such file"):
        tcp.read_key(tmp_path / "missing.key")


def test_addresses() -> None:
    assert tcp.parse_address("10.0.0.2:7070") == ("10.0.0.2", 7070)
    assert tcp.parse_address("[fd00::2]:7070") == ("fd00::2", 7070)
    assert tcp.parse_address("worker.lan:1") == ("worker.lan", 1)
    for bad in ("10.0.0.2", ":7070", "h:0", "h:70000", "h:x"):
        with pytest.raises(ValueError, match="is not HOST:PORT"):
            tcp.parse_address(bad)
