"""The HTTP listener: aiohttp's server behind a bound on concurrent connections.

Every connection costs a file descriptor and a little memory whether or not it ever sends
a request, so clients that open many and send half a header could exhaust the daemon.
Two limits keep that bounded:

- the runner's ``keepalive_timeout`` (aiohttp starts it when the connection opens) closes
  a connection that has not sent a whole request header, or stayed idle between requests,
  for that long (``--http-timeout``);
- ``LimitedSite`` answers connections beyond ``--max-connections`` with a 503 in the
  OpenAI error shape and closes them, instead of handing them to aiohttp.

Errors aiohttp answers before any route runs (an oversized header) are JSON too
(``JSONErrorHandler``).

The body has its own deadline where the API reads it (``api.server.read_body``).
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, cast

from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

from luced.api.fields import error_body

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


class _Refuse(asyncio.Protocol):
    """A connection over the limit: one 503, then closed, whatever it sends."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # (uvloop's transports are not asyncio.Transport subclasses, but write alike)
        cast(asyncio.WriteTransport, transport).write(_BUSY)
        transport.close()


def _open_connections(server: web.Server) -> int:
    """aiohttp's connections, less those it has closed already: a closed handler leaves
    `server.connections` only in its connection_lost callback, which uvloop runs after the
    socket is closed, so a client that saw the close and reconnects at once would otherwise
    find its old connection still counted (and be refused)."""
    return sum(
        1 for h in server.connections if h.transport is not None and not h.transport.is_closing()
    )


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


class LimitedSite(web.BaseSite):
    """A TCP site whose protocol factory refuses connections beyond ``max_connections``
    (aiohttp's open connections, less those it has closed) and answers the rest with
    ``JSONErrorHandler``. ``handler_args`` are the runner's handler arguments (e.g.
    keepalive_timeout), which aiohttp would have passed to its own handler."""

    __slots__ = ("_handler_args", "_host", "_max_connections", "_port")

    def __init__(
        self,
        runner: web.BaseRunner,
        host: str,
        port: int,
        max_connections: int,
        handler_args: dict[str, Any],
    ) -> None:
        super().__init__(runner)
        self._host = host
        self._port = port
        self._max_connections = max_connections
        self._handler_args = handler_args

    @property
    def name(self) -> str:
        return f"http://{self._host}:{self._port}"

    async def start(self) -> None:
        await super().start()
        server = self._runner.server
        assert server is not None

        loop = asyncio.get_running_loop()

        def protocol() -> asyncio.BaseProtocol:
            if _open_connections(server) >= self._max_connections:
                return _Refuse()
            return JSONErrorHandler(server, loop=loop, **self._handler_args)

        self._server = await loop.create_server(
            protocol, self._host, self._port, backlog=self._backlog, reuse_address=True
        )
