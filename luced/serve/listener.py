"""The HTTP listener: aiohttp's server behind a fair bound on concurrent connections.

Every connection costs a file descriptor and a little memory whether or not it ever sends
a request, so clients that open many and send half a header could exhaust the daemon, or
keep every other client out. Three things keep that bounded:

- the runner's ``keepalive_timeout`` (aiohttp starts it when the connection opens) closes
  a connection that has not sent a whole request header, or stayed idle between requests,
  for that long (``--http-timeout``);
- ``LimitedSite`` holds at most ``--max-connections``; when they are taken, a new
  connection gets a place by the rule of ``admission`` (it displaces the longest-idle
  kept-alive connection, else a slow sender of a peer over its share, else it may only ask
  for /health in a small reserve), or a 503 in the OpenAI error shape and closed;
- ``Connection`` tracks what that rule reads: each connection's peer and stage (sending
  a request, answering one, idle) and since when.

``listen(app, cfg.http)`` puts these together from the HTTP options.

Errors aiohttp answers before any route runs (an oversized header) are JSON too
(``JSONErrorHandler``).

The body has its own deadline where the API reads it (``api.server.read_body``).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, cast

from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

from luced.api.fields import error_body
from luced.serve.admission import Gate, Peer, Stage
from luced.serve.config import HTTPOptions

log = logging.getLogger(__name__)

_BUSY_BODY = json.dumps(
    error_body(
        "too many open connections; try again later", "server_error", None, "too_many_connections"
    )
).encode()
_BUSY = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
    b"Retry-After: 1\r\nConnection: close\r\n"
    + f"Content-Length: {len(_BUSY_BODY)}\r\n\r\n".encode()
    + _BUSY_BODY
)
_RETRY = {"Retry-After": "1"}


class JSONErrorHandler(RequestHandler):
    """aiohttp's connection handler, except that the errors it answers itself, before
    any route or middleware runs (a malformed or oversized request line or header), are
    JSON in the OpenAI error shape like every other error, not text/plain."""

    __slots__ = ()

    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if status >= 500 or request.writer.output_size > 0:
            return super().handle_error(request, status, exc, message)
        log.debug("bad request from %s: %s", request.remote, message)
        body = error_body(message or "bad request", "invalid_request_error")
        response = web.json_response(body, status=status)
        response.force_close()
        return response


# The site's placement of a new connection from an address: False refuses it.
Placer = Callable[["Connection", str | None], bool]


class Connection(JSONErrorHandler):
    """One HTTP connection as the gate sees it (``admission.Tracked``): its peer, its
    stage and since when. Opened, it asks ``place`` for a place; refused, it is answered
    the 503 and closed before aiohttp sees it."""

    __slots__ = ("_answered", "_heard", "_place", "_request", "health_only", "peer", "since")

    def __init__(self, manager: web.Server, place: Placer, **kwargs: Any):
        super().__init__(manager, **kwargs)
        self._place = place
        self.peer = Peer("", False)  # set by place()
        self.health_only = False  # set by place(): a reserve place
        self.since = time.monotonic()  # opened, or last finished an answer
        self._request: BaseRequest | None = None  # the request being answered
        self._answered = False  # has finished an answer
        self._heard = False  # bytes beyond the last request's body: the next one began

    @property
    def stage(self) -> Stage:
        if self._request is not None:
            return Stage.BUSY if self._request.content.is_eof() else Stage.SENDING
        return Stage.IDLE if self._answered and not self._heard else Stage.SENDING

    @property
    def is_open(self) -> bool:
        """Not closed by the server: a closed handler leaves ``server.connections`` only in
        its connection_lost callback, which uvloop runs after the socket is closed, so a
        client that saw the close and reconnects at once would otherwise still find it."""
        return self.transport is not None and not self.transport.is_closing()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        peername = transport.get_extra_info("peername")
        if not self._place(self, peername[0] if isinstance(peername, tuple) else None):
            # (uvloop's transports are not asyncio.Transport subclasses, but write alike)
            cast(asyncio.WriteTransport, transport).write(_BUSY)
            transport.close()
            return
        super().connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if data and (self._request is None or self._request.content.is_eof()):
            self._heard = True
        super().data_received(data)

    def evict(self) -> None:
        """Close to make room; one in the middle of a request header is told why."""
        if self.transport is not None and self._request is None and self.stage is Stage.SENDING:
            self.transport.write(_BUSY)
        self.force_close()

    async def _handle_request(
        self,
        request: BaseRequest,
        start_time: float | None,
        request_handler: Callable[[BaseRequest], Awaitable[web.StreamResponse]],
    ) -> tuple[web.StreamResponse, bool]:
        # (aiohttp's one call per request, around the route and the writing of its answer)
        self._request = request
        self._heard = False
        if self.health_only:
            request_handler = functools.partial(_probe, request_handler)
        try:
            return await super()._handle_request(request, start_time, request_handler)
        finally:
            self._request = None
            self._answered = True
            self.since = time.monotonic()
            if self.health_only:  # one answer (written: close flushes it), then its place
                self.force_close()


async def _probe(
    handler: Callable[[BaseRequest], Awaitable[web.StreamResponse]], request: BaseRequest
) -> web.StreamResponse:
    """The one request of a reserve place: /health is answered, anything else gets the
    503 of a full listener; the connection closes after it."""
    if request.path == "/health":
        response = await handler(request)
    else:
        response = web.Response(
            status=503, body=_BUSY_BODY, content_type="application/json", headers=_RETRY
        )
    response.force_close()
    return response


class LimitedSite(web.BaseSite):
    """A TCP site whose connections are ``Connection``s placed by ``gate`` (see
    ``admission``). ``handler_args`` are the runner's handler arguments (e.g.
    keepalive_timeout), which aiohttp would have passed to its own handler."""

    __slots__ = ("_gate", "_handler_args", "_host", "_port")

    def __init__(
        self, runner: web.BaseRunner, host: str, port: int, gate: Gate, handler_args: dict[str, Any]
    ) -> None:
        super().__init__(runner)
        self._host = host
        self._port = port
        self._gate = gate
        self._handler_args = handler_args

    @property
    def name(self) -> str:
        return f"http://{self._host}:{self._port}"

    def open_connections(self) -> list[Connection]:
        server = self._runner.server
        assert server is not None
        return [c for c in server.connections if isinstance(c, Connection) and c.is_open]

    def _place(self, conn: Connection, host: str | None) -> bool:
        """Find ``conn`` (from ``host``) a place, closing whom the gate says; False: none."""
        conn.peer = self._gate.peer(host)
        admission = self._gate.admit(conn.peer, self.open_connections())
        if admission is None:
            log.debug("refused a connection from %s: no place", conn.peer.key)
            return False
        conn.health_only = admission.health_only
        if admission.evict is not None:
            old = admission.evict
            log.debug(
                "closed a %s connection of %s for %s", old.stage.value, old.peer.key, conn.peer.key
            )
            old.evict()
        return True

    async def start(self) -> None:
        await super().start()
        server = self._runner.server
        assert server is not None
        loop = asyncio.get_running_loop()

        def protocol() -> asyncio.BaseProtocol:
            return Connection(server, self._place, loop=loop, **self._handler_args)

        self._server = await loop.create_server(
            protocol, self._host, self._port, backlog=self._backlog, reuse_address=True
        )


async def listen(app: web.Application, http: HTTPOptions) -> web.AppRunner:
    """Serve ``app`` on --host / --port behind a ``LimitedSite`` (--max-connections,
    --trusted-proxies), idle and header waits bounded by --http-timeout. The caller cleans
    the runner up; when listening fails (the port is taken) it is cleaned up here and the
    OSError raised."""
    handler_args = {"access_log": None, "keepalive_timeout": http.http_timeout}
    runner = web.AppRunner(app, handle_signals=False, handler_cancellation=True, **handler_args)
    await runner.setup()
    gate = Gate(http.max_connections, http.trusted_proxies)
    try:
        await LimitedSite(runner, http.host, http.port, gate, handler_args).start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner
