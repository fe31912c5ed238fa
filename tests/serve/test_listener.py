"""The listener on real loopback sockets: what it counts as open, and how a full one shares
its places. Two peers are two source addresses (all of 127.0.0.0/8 is loopback on Linux):
127.0.0.1 fills the listener, 127.0.0.2 must still be answered."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest
from aiohttp import web

from luced.serve.admission import Stage
from luced.serve.config import Config
from luced.serve.listener import LimitedSite, listen

GREEDY, OTHER = "127.0.0.1", "127.0.0.2"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


RELEASE = web.AppKey("release", asyncio.Event)  # set: /slow answers


async def _ok(request: web.Request) -> web.Response:
    await request.read()
    return web.Response(text="ok")


async def _slow(request: web.Request) -> web.Response:
    await request.read()
    await request.app[RELEASE].wait()
    return web.Response(text="ok")


@dataclass
class Listener:
    site: LimitedSite
    port: int
    clients: list[asyncio.StreamWriter] = field(default_factory=list)  # closed at the end

    async def connect(self, source: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", self.port, local_addr=(source, 0)
        )
        self.clients.append(writer)
        return reader, writer

    def request(self, method: str = "GET", path: str = "/health", close: bool = False) -> bytes:
        body = b'{"x": 1}' if method == "POST" else b""
        return (
            f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n"
            + ("Connection: close\r\n" if close else "")
            + "\r\n"
        ).encode() + body

    async def ask(self, source: str, method: str = "GET", path: str = "/health") -> bytes:
        """One request on a new connection from `source`: the whole answer."""
        reader, writer = await self.connect(source)
        writer.write(self.request(method, path, close=True))
        return await asyncio.wait_for(reader.read(), 30)

    async def settled(self, n: int, stage: Stage) -> None:
        """Until the server holds n open connections, all in `stage`."""
        for _ in range(3000):
            held = self.site.open_connections()
            if len(held) == n and all(c.stage is stage for c in held):
                return
            await asyncio.sleep(0.01)
        raise AssertionError([c.stage for c in self.site.open_connections()])


async def _listener(max_connections: int, trusted: str = "") -> AsyncIterator[Listener]:
    app = web.Application()
    app.router.add_get("/health", _ok)
    app.router.add_post("/v1/chat/completions", _ok)
    app.router.add_post("/slow", _slow)
    app[RELEASE] = asyncio.Event()
    port = _free_port()
    values = {"port": port, "max_connections": max_connections, "trusted_proxies": trusted}
    values["http_timeout"] = 300  # never the rescue here
    runner = await listen(app, Config.from_values(values, env={}).http)
    (site,) = runner.sites
    assert isinstance(site, LimitedSite)
    it = Listener(site, port)
    try:
        yield it
    finally:
        app[RELEASE].set()
        for writer in it.clients:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
        await runner.cleanup()


@pytest.fixture
async def listener() -> AsyncIterator[Listener]:
    async for it in _listener(64):
        yield it


def _status(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1])


def _error_code(answer: bytes) -> str:
    return json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["code"]


async def test_a_closed_connection_stops_counting_before_connection_lost() -> None:
    """A connection the server has closed frees its place at once, before its
    connection_lost callback (which uvloop runs after the socket is closed, so a client
    could see the close, reconnect and be refused)."""
    async for it in _listener(1):
        reader, _ = await it.connect(GREEDY)
        await it.settled(1, Stage.SENDING)
        server = it.site._runner.server
        assert server is not None
        (handler,) = server.connections
        # The server closes it (as its keepalive timeout does); connection_lost comes later.
        handler.force_close()
        assert len(server.connections) == 1 and it.site.open_connections() == []
        assert await reader.read() == b""
        # A new client is served, not refused with the 503 of a full site.
        assert _status(await it.ask(GREEDY)) == 200


async def test_idle_keep_alive_connections_give_way_oldest_first(listener: Listener) -> None:
    it = listener
    kept = []
    for i in range(80):  # one peer, each connection kept alive after one answer
        reader, writer = await it.connect(GREEDY)
        writer.write(it.request())
        assert (await reader.readuntil(b"ok")).startswith(b"HTTP/1.1 200")
        kept.append((reader, writer))
        await it.settled(min(i + 1, 56), Stage.IDLE)
    # Past the 56 regular places each newcomer closed the longest idle: the first 24.
    for reader, _ in kept[:24]:
        assert await asyncio.wait_for(reader.read(), 30) == b""
    assert _status(await it.ask(OTHER)) == 200
    assert _status(await it.ask(OTHER, "POST", "/v1/chat/completions")) == 200


async def test_one_peer_sending_half_headers_cannot_keep_another_out(listener: Listener) -> None:
    it = listener
    half = []
    for _ in range(80):  # one peer, each connection stuck in its header
        reader, writer = await it.connect(GREEDY)
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Le")
        half.append((reader, writer))
    await it.settled(64, Stage.SENDING)  # 56 regular places and the reserve of 8
    assert sum(c.health_only for c in it.site.open_connections()) == 8
    # The greedy peer, at its share, gets a reserve place (the longest silent one there
    # gives way): /health is answered there, and nothing else.
    assert _status(await it.ask(GREEDY)) == 200
    answer = await it.ask(GREEDY, "POST", "/v1/chat/completions")
    assert _status(answer) == 503 and _error_code(answer) == "too_many_connections"
    # Another peer is answered in full: the greedy one is over its share (56 // 2), so its
    # oldest half header gives way, told why with the listener's 503.
    assert _status(await it.ask(OTHER, "POST", "/v1/chat/completions")) == 200
    answer = await asyncio.wait_for(half[0][0].read(), 30)
    assert _status(answer) == 503 and _error_code(answer) == "too_many_connections"
    assert _status(await it.ask(OTHER)) == 200


async def test_a_trusted_proxy_is_not_held_to_a_share() -> None:
    async for it in _listener(16, trusted=GREEDY):  # 14 regular places, 2 reserved
        for _ in range(14):
            _, writer = await it.connect(GREEDY)
            writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        await it.settled(14, Stage.SENDING)
        # The proxy's slow clients keep their places: another peer only reaches /health.
        assert _status(await it.ask(OTHER)) == 200
        answer = await it.ask(OTHER, "POST", "/v1/chat/completions")
        assert _status(answer) == 503 and _error_code(answer) == "too_many_connections"
        assert [c.peer.key for c in it.site.open_connections()] == [GREEDY] * 14


async def test_a_body_still_arriving_counts_as_sending_a_whole_one_as_busy() -> None:
    async for it in _listener(16):  # 14 regular places, 2 reserved
        trickled = []
        for _ in range(14):  # whole headers, half their bodies
            reader, writer = await it.connect(GREEDY)
            writer.write(b"POST /slow HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n12345")
            trickled.append((reader, writer))
        await it.settled(14, Stage.SENDING)
        # A slow body is a slow sender: the oldest gives way to another peer.
        assert _status(await it.ask(OTHER, "POST", "/v1/chat/completions")) == 200
        assert await asyncio.wait_for(trickled[0][0].read(), 30) == b""
        # Bodies that arrived whole are requests being answered: none gives way.
        for _, writer in trickled[1:]:
            writer.write(b"67890")
        _, writer = await it.connect(GREEDY)
        writer.write(b"POST /slow HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
        await it.settled(14, Stage.BUSY)
        answer = await it.ask(OTHER, "POST", "/v1/chat/completions")
        assert _status(answer) == 503 and _error_code(answer) == "too_many_connections"
        assert _status(await it.ask(OTHER)) == 200  # (in the reserve)
