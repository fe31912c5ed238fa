"""The HTTP app: route table, typed app state, API key, OpenAI-shaped errors.

    POST /v1/chat/completions    chat, streaming (SSE) or not
    POST /v1/completions         legacy completions, streaming or not
    POST /v1/messages            Anthropic Messages, streaming or not (luced.api.anthropic)
    POST /v1/messages/count_tokens   the prompt's token count for a Messages body
    POST /v1/embeddings          embeddings (luced.api.embeddings)
    POST /tokenize, /detokenize  llama-server's token utilities
    GET  /v1/models              the served models; GET /v1/models/{id} one model card
    GET  /health                 200 {"status": "ok"} when ready, else 503 {"status": state}
                                 (several models: luced.serve.models)
    GET  /metrics                Prometheus text (luced.engine.metrics)
    GET  /v1/status, /v1/status/history   the state and the last minutes (luced.api.status)
    GET  /, /static/...          the web page: chat, status, plots (luced.api.page)
    /api/chat, /api/generate, /api/tags, /api/ps, /api/show, /api/version, /api/embed
                                 Ollama's API (luced.api.ollama_routes)

A request's trace: the handler reads the body and holds the lease of the model it names
until its reply ends (`luced.api.lease`: a 404 for a model not served; one not loaded is
loaded first), `luced.api.prepare` validates it (a 400 naming the field) and renders and
tokenizes its prompt in a thread, `Engine.submit` queues it (429/400/503 as
`EngineError`; chat and completions: a request per choice, `luced.api.choices`), and the
handler relays the engine's deltas through `luced.api.formats`.

Disconnects: serve with `web.AppRunner(app, handler_cancellation=True)`. Then a client
that goes away while its request waits in the queue, in prefill or in decode cancels the
handler, and the handler cancels the engine's work (`RequestHandle.cancel`). Without it,
aiohttp lets the handler run on, and only a stream notices, at its next write.

With an api_key, every /v1/ and /api/ route and /tokenize, /detokenize (and /metrics
unless metrics_public) want `Authorization: Bearer KEY` or Anthropic's `x-api-key: KEY` (401
otherwise); /health stays open for probes, and so does the web page, which holds nothing
secret and asks its user for the key. Errors are shaped by the API a path belongs to:
Anthropic's under /v1/messages, Ollama's under /api/, OpenAI's everywhere else.

A web page must not drive a local daemon (`_guard`): a POST needs `Content-Type:
application/json` (415 otherwise), which a cross-site form or fetch cannot send without a
CORS preflight; a request whose Origin header names another site (not this Host, not in
allowed_origins) is refused (403), preflights included; and the Host header must name
the bound address (a loopback name when bound to loopback) or one of allowed_hosts (403
otherwise), which defeats DNS rebinding. Our own page is same-origin: its requests carry
this Host as their Origin, or no Origin at all.

Bodies: a body with a bad Content-Encoding is a 400 (and the connection closes: the rest
of its stream cannot be read). Everything from the body's bytes to the prompt's token ids
runs in a thread, bounded before any costly step (`luced.api.prepare`).
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import logging
import math
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from luced.api import anthropic, choices, ollama_routes, page, status
from luced.api.catalog import Catalog, SingleModel
from luced.api.embeddings import (
    MAX_INPUTS,
    embed_all,
    embedding_tokens,
    prepare_embeddings,
    response_json,
)
from luced.api.fields import APIError
from luced.api.formats import (
    ChatFormat,
    CompletionFormat,
    OutputFormat,
    dumps,
    finish_error,
)
from luced.api.lease import (
    BODY_TIMEOUT,
    LEASE,
    MAX_BODY,
    MODELS,
    PREPARER,
    leased_engine,
    leasing,
    leasing_inputs,
    prepare,
)
from luced.api.ollama_models import ModelFacts
from luced.api.openai import generation_request
from luced.api.prepare import (
    Prepared,
    Preparer,
    prepare_chat,
    prepare_completion,
    prepare_detokenize,
    prepare_messages,
    prepare_responses,
    prepare_tokenize,
)
from luced.api.relay import event_stream, stream_guard, whole_text
from luced.api.responses import ResponseFormat
from luced.api.responses import usage as responses_usage
from luced.api.tools import ToolChatFormat
from luced.engine.core import Engine, EngineError, RequestHandle
from luced.engine.metrics import CONTENT_TYPE, Metrics

log = logging.getLogger(__name__)

# Long contexts are long JSON: 128k tokens of text with escapes is a few MiB.
DEFAULT_MAX_BODY = 32 * 1024 * 1024

API_KEY = web.AppKey("api_key", str)  # "" = no key required
GUARD = web.AppKey("guard", "Guard")
__all__ = ["MODELS", "Guard", "make_app"]

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

_LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1", "[::1]"})
_ANY_ADDRESS = frozenset({"0.0.0.0", "::", "[::]", ""})


@dataclass(frozen=True)
class Guard:
    """Who may drive the API from a browser: see the module docstring."""

    bound_host: str = "127.0.0.1"
    allowed_hosts: tuple[str, ...] = ()
    allowed_origins: tuple[str, ...] = ()
    metrics_public: bool = False

    def host_ok(self, host_header: str | None) -> bool:
        if host_header is None:
            return False
        host = host_header.strip().lower()
        if host.startswith("["):  # [::1]:8000
            host = host[: host.find("]") + 1]
        elif host.count(":") == 1:
            host = host.rsplit(":", 1)[0]
        allowed = {h.lower() for h in self.allowed_hosts}
        bound = self.bound_host.lower()
        if bound in _ANY_ADDRESS and not allowed:
            return True
        if bound in _LOOPBACK_NAMES or bound.startswith("127."):
            allowed |= _LOOPBACK_NAMES
        allowed |= {bound, f"[{bound}]"}
        return host in allowed

    def origin_ok(self, origin: str, host_header: str | None) -> bool:
        """A browser's Origin: this very site (its host:port is the Host header, whatever
        the scheme a proxy in front terminates) or one of allowed_origins."""
        if origin in self.allowed_origins:
            return True
        _, sep, netloc = origin.partition("://")
        return bool(sep) and host_header is not None and netloc.lower() == host_header.lower()


def make_app(
    models: Catalog | Engine,
    metrics: Metrics | None = None,
    *,
    api_key: str | None = None,
    client_max_size: int = DEFAULT_MAX_BODY,
    guard: Guard | None = None,
    body_timeout: float = 30.0,
    model: ModelFacts | None = None,
    system_fingerprint: str = "",
) -> web.Application:
    """The app over `models`' catalog, or over one engine and its metrics; then `model`:
    what Ollama's listings say about its GGUF (none: only its name), and
    `system_fingerprint`: what chat and completions replies name their backend by."""
    if isinstance(models, Engine):
        models = SingleModel(models, metrics or Metrics(), model, system_fingerprint)
    app = web.Application(middlewares=[_errors, _guard, _auth], client_max_size=client_max_size)
    app[GUARD] = guard or Guard()
    app[BODY_TIMEOUT] = body_timeout
    app[MODELS] = models
    app[API_KEY] = api_key or ""
    app[PREPARER] = Preparer()
    app[MAX_BODY] = client_max_size
    app.on_cleanup.append(_close_preparer)
    app.add_routes(
        [
            web.post("/v1/chat/completions", chat_completions),
            web.post("/v1/completions", completions),
            web.post("/v1/messages", messages),
            web.post("/v1/messages/count_tokens", count_tokens),
            web.post("/v1/responses", responses),
            web.post("/v1/embeddings", embeddings),
            web.post("/tokenize", tokenize),
            web.post("/detokenize", detokenize),
            web.get("/v1/models", list_models),
            web.get("/v1/models/{model:.+}", get_model),
            web.get("/health", health),
            web.get("/metrics", prometheus),
        ]
    )
    status.add_routes(app, models)
    ollama_routes.add_routes(app, models)
    page.add_routes(app)
    return app


async def _close_preparer(app: web.Application) -> None:
    app[PREPARER].close()


# --- middlewares -------------------------------------------------------------------------


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every failure leaves as OpenAI's {"error": {...}} with its status."""
    try:
        return await handler(request)
    except APIError as exc:
        return error_response(exc, request)
    except EngineError as exc:
        return error_response(
            APIError(exc.status, exc.message, code=exc.code, retry_after=exc.retry_after),
            request,
        )
    except web.HTTPException as exc:  # aiohttp's own: unknown route, 405, body too large
        if exc.status < 400:
            raise
        text = exc.text or ""
        message = exc.reason if text.startswith(f"{exc.status}:") or not text else text
        resp = error_response(
            APIError(exc.status, f"{request.method} {request.path}: {message}"), request
        )
        if "Allow" in exc.headers:
            resp.headers["Allow"] = exc.headers["Allow"]
        return resp
    except ConnectionResetError:
        raise  # the client is gone; nothing to answer
    except Exception as exc:
        log.exception("unhandled error in %s %s", request.method, request.path)
        return error_response(
            APIError(500, f"internal error: {type(exc).__name__}: {exc}"), request
        )


@web.middleware
async def _guard(request: web.Request, handler: Handler) -> web.StreamResponse:
    guard = request.app[GUARD]
    if not guard.host_ok(request.headers.get("Host")):
        raise APIError(
            403, f"Host {request.headers.get('Host')!r} is not allowed (--allowed-hosts)"
        )
    origin = request.headers.get("Origin")
    cors = origin is not None and origin in guard.allowed_origins
    # Browsers name the calling page's site in Origin: ours or an allowed one may call. A
    # preflight asks for a cross-origin call, so only an allowed origin gets one.
    if (request.method == "OPTIONS" and not cors) or (
        origin is not None and not guard.origin_ok(origin, request.headers.get("Host"))
    ):
        raise APIError(
            403, f"cross-origin requests from {origin!r} are not allowed (--allowed-origins)"
        )
    if request.method == "OPTIONS":
        return web.Response(
            status=204,
            headers={
                "Access-Control-Allow-Origin": origin or "",
                "Access-Control-Allow-Methods": "GET, POST",
                "Access-Control-Allow-Headers": (
                    "Authorization, Content-Type, x-api-key, anthropic-version"
                ),
                "Access-Control-Max-Age": "600",
                "Vary": "Origin",
            },
        )
    if request.method == "POST" and request.content_type != "application/json":
        raise APIError(415, f"Content-Type must be application/json, got {request.content_type!r}")
    resp = await handler(request)
    if cors and not resp.prepared:
        resp.headers["Access-Control-Allow-Origin"] = origin or ""
        resp.headers["Vary"] = "Origin"
    return resp


@web.middleware
async def _auth(request: web.Request, handler: Handler) -> web.StreamResponse:
    key = request.app[API_KEY]
    keyed = request.path.startswith(_KEYED) or (
        request.path == "/metrics" and not request.app[GUARD].metrics_public
    )
    if key and keyed:
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        given = token.strip() if scheme.lower() == "bearer" else None
        if "x-api-key" in request.headers:  # Anthropic's clients send this instead
            given = request.headers["x-api-key"].strip()
        # compare_digest: the time taken does not tell how much of the key matched.
        if given is None or not hmac.compare_digest(
            given.encode("utf-8", "surrogateescape"), key.encode()
        ):
            raise APIError(
                401,
                "missing or wrong API key; send the header Authorization: Bearer KEY"
                " (or x-api-key: KEY)",
                code="invalid_api_key",
            )
    return await handler(request)


_KEYED = ("/v1/", "/api/", "/tokenize", "/detokenize")


def error_response(exc: APIError, request: web.Request | None = None) -> web.Response:
    headers = {}
    if exc.retry_after is not None:
        # Retry-After is whole seconds; never 0, which would invite a tight retry loop.
        headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after)))
    body = exc.body()
    if request is not None and _is_anthropic(request):
        body = anthropic.error_body(exc)
    elif request is not None and request.path.startswith("/api/"):
        body = {"error": exc.message}  # Ollama's shape
    return web.json_response(body, status=exc.status, headers=headers, dumps=dumps)


def _is_anthropic(request: web.Request) -> bool:
    return request.path == "/v1/messages" or request.path.startswith("/v1/messages/")


# --- generation --------------------------------------------------------------------------


def _fingerprint(request: web.Request) -> str | None:
    return request[LEASE].served.fingerprint or None


@leasing
async def chat_completions(request: web.Request) -> web.StreamResponse:
    prep = await prepare(request, prepare_chat)
    tools = prep.tools
    make = ChatFormat if tools is None else functools.partial(ToolChatFormat, tools=tools)
    return await _choices(request, prep, "chatcmpl", make)


@leasing
async def completions(request: web.Request) -> web.StreamResponse:
    prep = await prepare(request, prepare_completion)
    return await _choices(request, prep, "cmpl", CompletionFormat)


async def _choices(
    request: web.Request, prep: Prepared, prefix: str, make: Callable[..., OutputFormat]
) -> web.StreamResponse:
    """Chat and completions: a format per choice (n of each prompt), then `choices.generate`."""
    engine, options = leased_engine(request), prep.options
    head = (f"{prefix}-{uuid.uuid4().hex}", engine.model.name, int(time.time()))
    fmts = [
        make(
            *head,
            top_logprobs=options.top_logprobs,
            include_usage=options.include_usage,
            system_fingerprint=_fingerprint(request),
            index=k,
        )
        for k in range(options.n * len(prep.prompts))
    ]
    return await choices.generate(request, engine, fmts, options, prep.prompts)


@leasing
async def messages(request: web.Request) -> web.StreamResponse:
    """Anthropic's POST /v1/messages, on the same engine path as chat completions."""
    engine = leased_engine(request)
    prep = await prepare(request, prepare_messages, False)
    message_id = f"msg_{uuid.uuid4().hex}"
    if prep.tools is None:
        fmt = anthropic.MessageFormat(message_id, engine.model.name, prep.thinking)
    else:
        fmt = anthropic.ToolMessageFormat(message_id, engine.model.name, prep.tools, prep.thinking)
    handle = engine.submit(generation_request(fmt.id, prep.options, prep.prompt))
    if prep.options.stream:
        return await _stream_messages(request, fmt, handle)
    text = await whole_text(handle)
    body = fmt.response(
        text, handle.finish_reason or "stop", handle.stop_string, _anthropic_usage(handle)
    )
    return web.json_response(body, dumps=dumps)


@leasing
async def responses(request: web.Request) -> web.StreamResponse:
    """OpenAI's POST /v1/responses (stateless), on the chat completions path."""
    engine = leased_engine(request)
    prep = await prepare(request, prepare_responses)
    options = prep.options
    fmt = ResponseFormat(
        f"resp_{uuid.uuid4().hex}", engine.model.name, int(time.time()), prep.request, prep.tools
    )
    handle = engine.submit(generation_request(fmt.id, options, prep.prompt))

    def used() -> dict[str, Any]:
        return responses_usage(handle.prompt_tokens, handle.cached_tokens, handle.completion_tokens)

    if not options.stream:
        text = await whole_text(handle)
        return web.json_response(
            fmt.response(text, handle.finish_reason or "stop", used()), dumps=dumps
        )
    resp = event_stream()
    async with stream_guard([handle], resp, fmt.id, fmt.error_events):
        await resp.prepare(request)
        for ev in fmt.start():
            await resp.write(ev)
        async for delta in handle:
            for ev in fmt.delta(delta.text) if delta.text else ():
                await resp.write(ev)
        if (err := finish_error(handle.finish_reason, handle.error)) is not None:
            tail = fmt.error_events(err)
        else:
            tail = fmt.end(handle.finish_reason or "stop", used())
        for ev in tail:
            await resp.write(ev)
    return resp


@leasing_inputs(MAX_INPUTS)
async def embeddings(request: web.Request) -> web.Response:
    """OpenAI's POST /v1/embeddings: each input pooled in the engine's steps."""
    engine = leased_engine(request)
    prep = await prepare(request, prepare_embeddings, tokens=embedding_tokens(engine))
    vectors = await embed_all(engine, prep.inputs, f"embd-{uuid.uuid4().hex}")
    n_tokens = sum(map(len, prep.inputs))
    fmt = prep.request.encoding_format
    text = await asyncio.to_thread(response_json, vectors, fmt, engine.model.name, n_tokens)
    return web.Response(text=text, content_type="application/json")


def _anthropic_usage(handle: RequestHandle) -> dict[str, int]:
    return anthropic.usage(handle.prompt_tokens, handle.cached_tokens, handle.completion_tokens)


async def _stream_messages(
    request: web.Request, fmt: anthropic.MessageFormat, handle: RequestHandle
) -> web.StreamResponse:
    resp = event_stream()

    def error_events(err: APIError) -> list[bytes]:
        return [anthropic.event("error", anthropic.error_body(err))]

    async with stream_guard([handle], resp, fmt.id, error_events):
        await resp.prepare(request)
        for ev in fmt.start(handle.prompt_tokens):
            await resp.write(ev)
        async for delta in handle:
            if delta.text and (ev := fmt.delta(delta.text)):
                await resp.write(ev)
        if (err := finish_error(handle.finish_reason, handle.error)) is not None:
            await resp.write(anthropic.event("error", anthropic.error_body(err)))
        else:
            reason = handle.finish_reason or "stop"
            for ev in fmt.end(reason, handle.stop_string, _anthropic_usage(handle)):
                await resp.write(ev)
    return resp


@leasing
async def count_tokens(request: web.Request) -> web.Response:
    """Anthropic's POST /v1/messages/count_tokens: the prompt a Messages body would make."""
    prep = await prepare(request, prepare_messages, True)
    return web.json_response({"input_tokens": len(prep.prompt)}, dumps=dumps)


# --- llama-server's token utilities ------------------------------------------------------


@leasing
async def tokenize(request: web.Request) -> web.Response:
    """{"content", "add_special" (BOS, default false), "parse_special" (control tokens
    written in content are tokens, default true), "with_pieces"} -> {"tokens": [...]};
    with_pieces, each token is {"id", "piece"} (piece: text, or a byte list when the
    token is not whole UTF-8)."""
    tokenizer = leased_engine(request).tokenizer
    ids, with_pieces = await prepare(request, prepare_tokenize)
    if not with_pieces:
        return web.json_response({"tokens": ids}, dumps=dumps)
    out = []
    for i in ids:
        raw = tokenizer.token_bytes(i)
        try:
            piece: str | list[int] = raw.decode("utf-8")
        except UnicodeDecodeError:
            piece = list(raw)
        out.append({"id": i, "piece": piece})
    return web.json_response({"tokens": out}, dumps=dumps)


@leasing
async def detokenize(request: web.Request) -> web.Response:
    """{"tokens": [ids]} -> {"content": text}; control tokens appear as their text, so
    detokenize inverts tokenize."""
    content = await prepare(request, prepare_detokenize)
    return web.json_response({"content": content}, dumps=dumps)


# --- models, health, metrics -------------------------------------------------------------


async def list_models(request: web.Request) -> web.Response:
    cards = request.app[MODELS].cards()
    return web.json_response({"object": "list", "data": cards}, dumps=dumps)


async def get_model(request: web.Request) -> web.Response:
    card = request.app[MODELS].card(request.match_info["model"])
    return web.json_response(card, dumps=dumps)


async def health(request: web.Request) -> web.Response:
    status, body = request.app[MODELS].health()
    return web.json_response(body, status=status)


async def prometheus(request: web.Request) -> web.Response:
    body = request.app[MODELS].exposition()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})
