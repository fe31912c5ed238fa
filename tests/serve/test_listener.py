"""The listener's connection bound counts what is open: a connection the server has closed
frees its place at once, before its connection_lost callback (which uvloop runs after the
socket is closed, so a client could see the close, reconnect and be refused)."""

from __future__ import annotations

import asyncio
import socket

from aiohttp import web

from luced.serve.listener import LimitedSite, _open_connections


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _ok(request: web.Request) -> web.Response:
    return web.Response(text="ok")


async def test_a_closed_connection_stops_counting_before_connection_lost() -> None:
    app = web.Application()
    app.router.add_get("/", _ok)
    args = {"access_log": None, "keepalive_timeout": 30}
    runner = web.AppRunner(app, handle_signals=False, **args)
    await runner.setup()
    port = _free_port()
    site = LimitedSite(runner, "127.0.0.1", port, 1, args)
    await site.start()
    server = runner.server
    assert server is not None
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        for _ in range(100):  # until the server has the connection
            if server.connections:
                break
            await asyncio.sleep(0.01)
        (handler,) = server.connections
        assert _open_connections(server) == 1
        # The server closes it (as its keepalive timeout does); connection_lost comes later.
        handler.force_close()
        assert len(server.connections) == 1 and _open_connections(server) == 0
        assert await reader.read() == b""
        writer.close()
        # A new client is served, not refused with the 503 of a full site.
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        answer = await reader.read()
        assert answer.startswith(b"HTTP/1.1 200"), answer[:80]
        writer.close()
    finally:
        await runner.cleanup()
