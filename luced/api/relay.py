"""Relaying one engine request to its HTTP client, whatever the API: all of its deltas for
a reply that does not stream, and the guard around a reply that does."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable

from aiohttp import web

from luced.api.fields import APIError
from luced.api.formats import finish_error
from luced.engine.core import RequestHandle
from luced.engine.output import Delta

log = logging.getLogger(__name__)


async def all_deltas(handle: RequestHandle) -> list[Delta]:
    """A non-streamed request's deltas, once it ends; its error as an APIError."""
    try:
        deltas = [delta async for delta in handle]
    except BaseException:  # cancelled (the client went away) or the engine broke
        handle.cancel()
        raise
    if (err := finish_error(handle.finish_reason, handle.error)) is not None:
        raise err
    return deltas


async def whole_text(handle: RequestHandle) -> str:
    """A non-streamed request's text, once it ends; its error as an APIError."""
    return "".join(d.text for d in await all_deltas(handle))


@contextlib.asynccontextmanager
async def stream_guard(
    handle: RequestHandle,
    resp: web.StreamResponse,
    stream_id: str,
    error_events: Callable[[APIError], list[bytes]],
) -> AsyncIterator[None]:
    """Around a streamed reply: a client that went away cancels its request; an internal
    failure after the headers went out ends the stream with the API's error event(s)."""
    try:
        yield
    except ConnectionResetError:  # the client went away mid-stream
        handle.cancel()
    except asyncio.CancelledError:
        handle.cancel()
        raise
    except Exception as exc:
        handle.cancel()
        if not resp.prepared:
            raise
        # Headers are out, so no error status: end the stream with an error event.
        log.exception("stream %s failed", stream_id)
        with contextlib.suppress(ConnectionResetError):
            for event in error_events(APIError(500, f"internal error: {exc}")):
                await resp.write(event)
