"""Relaying engine requests to their HTTP client, whatever the API: all of a request's
deltas for a reply that does not stream, several requests' deltas as they come for one
that does (`interleaved`: OpenAI's n choices), and the guard around a reply that streams."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Sequence

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


async def all_choices(handles: Sequence[RequestHandle]) -> list[list[Delta]]:
    """Each request's deltas, once all of them ended; the first error as an APIError,
    the others cancelled then (and all of them when the client went away)."""
    try:
        return await asyncio.gather(*map(all_deltas, handles))
    except BaseException:
        cancel_all(handles)
        raise


async def whole_text(handle: RequestHandle) -> str:
    """A non-streamed request's text, once it ends; its error as an APIError."""
    return "".join(d.text for d in await all_deltas(handle))


async def interleaved(handles: Sequence[RequestHandle]) -> AsyncIterator[tuple[int, Delta | None]]:
    """Every request's deltas as they come, as (its index in `handles`, delta), and
    (index, None) once it ended. Use it under `contextlib.aclosing`: closed early, it
    stops reading (the requests go on; cancel them)."""
    if len(handles) == 1:  # no tasks for the common case
        async for delta in handles[0]:
            yield 0, delta
        yield 0, None
        return
    came: asyncio.Queue[tuple[int, Delta | None]] = asyncio.Queue()

    async def read(i: int, handle: RequestHandle) -> None:
        async for delta in handle:
            came.put_nowait((i, delta))
        came.put_nowait((i, None))

    readers = [asyncio.create_task(read(i, h), name=h.request_id) for i, h in enumerate(handles)]
    try:
        ended = 0
        while ended < len(handles):
            i, delta = await came.get()
            ended += delta is None
            yield i, delta
    finally:
        for task in readers:
            task.cancel()


def cancel_all(handles: Sequence[RequestHandle]) -> None:
    for handle in handles:
        handle.cancel()


@contextlib.asynccontextmanager
async def stream_guard(
    handles: Sequence[RequestHandle],
    resp: web.StreamResponse,
    stream_id: str,
    error_events: Callable[[APIError], list[bytes]],
) -> AsyncIterator[None]:
    """Around a streamed reply: a client that went away cancels its requests; an internal
    failure after the headers went out ends the stream with the API's error event(s)."""
    try:
        yield
    except ConnectionResetError:  # the client went away mid-stream
        cancel_all(handles)
    except asyncio.CancelledError:
        cancel_all(handles)
        raise
    except Exception as exc:
        cancel_all(handles)
        if not resp.prepared:
            raise
        # Headers are out, so no error status: end the stream with an error event.
        log.exception("stream %s failed", stream_id)
        with contextlib.suppress(ConnectionResetError):
            for event in error_events(APIError(500, f"internal error: {exc}")):
                await resp.write(event)


def event_stream() -> web.StreamResponse:
    """A server-sent events reply, its headers not yet sent."""
    return web.StreamResponse(
        headers={
            "Content-Type": "text/event-stream; charset=utf-8",
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",  # a proxy must not hold the tokens back
        }
    )
