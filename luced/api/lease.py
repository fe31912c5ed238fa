"""From a request's body to the engine of the model it names, held until the reply ends.

    @leasing                                       # a route that generates or tokenizes
    async def chat_completions(request):
        prep = await prepare(request, prepare_chat)   # luced.api.prepare, in a thread
        engine = leased_engine(request)

`leasing` reads the body (`read_body`: bounded, never decoded on the event loop), finds
the model it names (a daemon serving several: `peek`, in a thread), and holds that
model's lease from the app's catalog (`luced.api.catalog`) while the handler runs, so a
model is never unloaded under a request, and a model not loaded is loaded first. A
catalog of one model needs no name: its request's `model` is checked while it is parsed.
A route whose body carries many inputs (embeddings) is `@leasing_inputs(n)`: its body is
bounded by n contexts, not one.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

from luced.api.catalog import Catalog, Served
from luced.api.fields import APIError, read_text
from luced.api.prepare import Preparer, max_body_bytes
from luced.engine.core import Engine

MODELS = web.AppKey("models", Catalog)
PREPARER = web.AppKey("preparer", Preparer)
MAX_BODY = web.AppKey("max_body", int)  # bytes
BODY_TIMEOUT = web.AppKey("body_timeout", float)  # seconds to receive a request body
YIELD_BYTES = 1 << 20

T = TypeVar("T")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass(frozen=True)
class Lease:
    served: Served
    chunks: list[bytes]  # the body, as it came


LEASE = web.RequestKey("lease", Lease)
BODY = web.RequestKey("body", list)  # its chunks, once read


def requested_model(body: Mapping[str, Any]) -> str | None:
    """The body's `model` (a 400 when it is not a string); None when it names none."""
    model = body.get("model") if isinstance(body, Mapping) else None
    return None if model is None else read_text("model", model)


async def requested(
    request: web.Request, peek: Callable[[Any], T], always: bool = False
) -> T | None:
    """What `peek(body)` reads of the body (decoded in a thread) when the app serves
    several models, or `always`; None otherwise. Reads the body first."""
    chunks = await read_body(request)
    if not (always or request.app[MODELS].several):
        return None
    return await request.app[PREPARER].peek(chunks, peek)


@contextlib.asynccontextmanager
async def leased(request: web.Request, name: str | None) -> AsyncIterator[Served]:
    """Model `name`'s lease (None: the app's only model) for the block, with the body."""
    chunks = await read_body(request)
    async with request.app[MODELS].lease(name) as served:
        request[LEASE] = Lease(served, chunks)
        try:
            yield served
        finally:
            # A kept-alive connection may keep its last request: not the model with it.
            del request[LEASE]


def leasing(handler: Handler) -> Handler:
    """Run `handler` under the lease of the model its body's `model` names."""
    return _leasing(handler, 1)


def leasing_inputs(inputs: int) -> Callable[[Handler], Handler]:
    """`leasing` for a route whose body carries up to `inputs` inputs of a context each."""
    return functools.partial(_leasing, contexts=inputs)


def _leasing(handler: Handler, contexts: int) -> Handler:
    @functools.wraps(handler)
    async def run(request: web.Request) -> web.StreamResponse:
        await read_body(request, contexts)
        async with leased(request, await requested(request, requested_model)):
            return await handler(request)

    return run


def leased_engine(request: web.Request) -> Engine:
    return request[LEASE].served.engine


async def prepare(
    request: web.Request, fn: Callable[..., T], *args: Any, tokens: int | None = None
) -> T:
    """`fn(engine, *args, body)` in a thread (`luced.api.prepare`), under the lease.
    `tokens`: what the request may carry in all, its values' bound (default: the context)."""
    lease = request[LEASE]
    engine = lease.served.engine
    return await request.app[PREPARER].run(lease.chunks, fn, engine, *args, tokens=tokens)


async def read_body(request: web.Request, contexts: int = 1) -> list[bytes]:
    """The body's bytes, as they came (read once, kept on the request): 413 past the body
    limit or the most a request of `contexts` contexts can take has (`max_body_bytes`;
    from Content-Length before reading a byte), 408 when the body does not arrive within
    the body timeout, 400 for a bad Content-Encoding (corrupt gzip). The loop is let go
    every YIELD_BYTES: bytes already buffered are read without waiting, tens of MB in one
    step otherwise. Serving several models, the context is the largest known, if any."""
    if BODY in request:
        return request[BODY]
    context = request.app[MODELS].context_bound()
    limit = request.app[MAX_BODY]
    most = limit if context is None else min(limit, max_body_bytes(contexts * context))
    why = f"bytes: at most {most}"
    if most < limit:
        held = f"a context of {context} tokens takes"
        if contexts > 1:
            held = f"{contexts} inputs of a context of {context} tokens take"
        why += f" ({held} no more)"
    if (request.content_length or 0) > most:
        raise APIError(413, f"the request body has {request.content_length} {why}")
    chunks: list[bytes] = []
    size = unyielded = 0
    try:
        async with asyncio.timeout(request.app[BODY_TIMEOUT]):
            async for chunk in request.content.iter_any():
                size += len(chunk)
                if size > most:
                    raise APIError(413, f"the request body has more than {most} {why}")
                chunks.append(chunk)
                unyielded += len(chunk)
                if unyielded > YIELD_BYTES:
                    unyielded = 0
                    await asyncio.sleep(0)
    except TimeoutError:
        raise APIError(
            408, f"the request body did not arrive within {request.app[BODY_TIMEOUT]:g} s"
        ) from None
    except (RequestPayloadError, HttpProcessingError, ValueError, OSError) as exc:
        if isinstance(exc, ConnectionResetError):
            raise
        _abandon_body(request)
        raise APIError(400, f"the request body cannot be decoded: {exc}") from None
    request[BODY] = chunks
    return chunks


def _abandon_body(request: web.Request) -> None:
    """The rest of a body that failed to decode is never read: close the connection after
    the answer. Otherwise aiohttp reads on to empty the stream for the next request, meets
    the same failure again and logs it as an unhandled exception."""
    request.content.feed_eof()
    request.protocol.close()
