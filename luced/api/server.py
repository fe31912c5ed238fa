"""The HTTP app: route table, typed app state, API key, OpenAI-shaped errors.

    POST /v1/chat/completions    chat, streaming (SSE) or not
    POST /v1/completions         legacy completions, streaming or not
    POST /v1/messages            Anthropic Messages, streaming or not (luced.api.anthropic)
    POST /v1/messages/count_tokens   the prompt's token count for a Messages body
    POST /tokenize, /detokenize  llama-server's token utilities
    GET  /v1/models              the served models; GET /v1/models/{id} one model card
    GET  /health                 200 {"status": "ok"} when ready, else 503 {"status": state}
                                 (several models: luced.serve.models)
    GET  /metrics                Prometheus text (luced.engine.metrics)
    GET  /v1/status, /v1/status/history   the state and the last minutes (luced.api.status)
    GET  /, /static/...          the web page: chat, status, plots (luced.api.page)

A request's trace: the handler reads the body, leases the engine of its `model` from the
app's catalog (`luced.api.catalog`: a 404 for a model not served; a model not loaded is
loaded first), `luced.api.openai` validates the body (a 400 naming the field), the chat
template and tokenizer run in a thread (long prompts would stall the loop),
`Engine.submit` queues it (429/400/503 as `EngineError`), and the handler relays the
engine's deltas through `luced.api.formats`, holding the lease until its reply ends.

Disconnects: serve with `web.AppRunner(app, handler_cancellation=True)`. Then a client
that goes away while its request waits in the queue, in prefill or in decode cancels the
handler, and the handler cancels the engine's work (`RequestHandle.cancel`). Without it,
aiohttp lets the handler run on, and only a stream notices, at its next write.

With an api_key, every /v1/ route and /tokenize, /detokenize (and /metrics unless
metrics_public) want `Authorization: Bearer KEY` or Anthropic's `x-api-key: KEY` (401
otherwise); /health stays open for probes, and so does the web page, which holds nothing
secret and asks its user for the key. Errors are shaped by the API a path belongs to:
Anthropic's under /v1/messages, OpenAI's everywhere else.

A web page must not drive a local daemon (`_guard`): a POST needs `Content-Type:
application/json` (415 otherwise), which a cross-site form or fetch cannot send without a
CORS preflight; a request whose Origin header names another site (not this Host, not in
allowed_origins) is refused (403), preflights included; and the Host header must name
the bound address (a loopback name when bound to loopback) or one of allowed_hosts (403
otherwise), which defeats DNS rebinding. Our own page is same-origin: its requests carry
this Host as their Origin, or no Origin at all.

Bodies: a body with a bad Content-Encoding is a 400; bodies over 1 MiB are decoded in a
thread; prompt text longer than MAX_CHARS_PER_TOKEN characters per context token is a 400
before any tokenizing (the tokenizer holds the GIL, so a 30 MB prompt would stall every
client), and tokenizing runs in a thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

from luced.api import anthropic, page, status
from luced.api.catalog import Catalog, SingleModel
from luced.api.fields import APIError, as_int, decode_body, json_kind, read_bool, read_text
from luced.api.formats import (
    SSE_DONE,
    ChatFormat,
    CompletionFormat,
    OutputFormat,
    dumps,
    finish_error,
    sse,
)
from luced.api.openai import (
    ChatRequest,
    Options,
    chat_prompt,
    completion_prompt,
    generation_request,
    parse_chat,
    parse_completion,
)
from luced.api.responses import ResponseFormat, parse_responses
from luced.api.responses import usage as responses_usage
from luced.api.tools import ToolChatFormat
from luced.engine.core import Engine, EngineError, RequestHandle
from luced.engine.metrics import CONTENT_TYPE, Metrics
from luced.text.tokenizer import Tokenizer
from luced.text.tool_calls import ToolFormat, has_tool_turns, tool_format

log = logging.getLogger(__name__)

# Long contexts are long JSON: 128k tokens of text with escapes is a few MiB.
DEFAULT_MAX_BODY = 32 * 1024 * 1024

MODELS = web.AppKey("models", Catalog)
API_KEY = web.AppKey("api_key", str)  # "" = no key required
GUARD = web.AppKey("guard", "Guard")
BODY_TIMEOUT = web.AppKey("body_timeout", float)  # seconds to receive a request body

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


# No token is this long; a prompt longer than this per context token cannot fit anyway.
MAX_CHARS_PER_TOKEN = 32
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
) -> web.Application:
    """The app over `models`' catalog, or over one engine and its metrics."""
    if isinstance(models, Engine):
        models = SingleModel(models, metrics or Metrics())
    app = web.Application(middlewares=[_errors, _guard, _auth], client_max_size=client_max_size)
    app[GUARD] = guard or Guard()
    app[BODY_TIMEOUT] = body_timeout
    app[MODELS] = models
    app[API_KEY] = api_key or ""
    app.add_routes(
        [
            web.post("/v1/chat/completions", chat_completions),
            web.post("/v1/completions", completions),
            web.post("/v1/messages", messages),
            web.post("/v1/messages/count_tokens", count_tokens),
            web.post("/v1/responses", responses),
            web.post("/tokenize", tokenize),
            web.post("/detokenize", detokenize),
            web.get("/v1/models", list_models),
            web.get("/v1/models/{model:.+}", get_model),
            web.get("/health", health),
            web.get("/metrics", prometheus),
        ]
    )
    status.add_routes(app, models)
    page.add_routes(app)
    return app


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


_KEYED = ("/v1/", "/tokenize", "/detokenize")


def error_response(exc: APIError, request: web.Request | None = None) -> web.Response:
    headers = {}
    if exc.retry_after is not None:
        # Retry-After is whole seconds; never 0, which would invite a tight retry loop.
        headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after)))
    body = exc.body()
    if request is not None and _is_anthropic(request):
        body = anthropic.error_body(exc)
    return web.json_response(body, status=exc.status, headers=headers, dumps=dumps)


def _is_anthropic(request: web.Request) -> bool:
    return request.path == "/v1/messages" or request.path.startswith("/v1/messages/")


async def read_json(request: web.Request) -> dict[str, Any]:
    """The body as a JSON object: 400 for a bad Content-Encoding (corrupt gzip) or bad
    JSON; a large body is parsed in a thread so that other clients are not held up."""
    try:
        async with asyncio.timeout(request.app[BODY_TIMEOUT]):
            raw = await request.read()
    except TimeoutError:
        raise APIError(
            408, f"the request body did not arrive within {request.app[BODY_TIMEOUT]:g} s"
        ) from None
    except (RequestPayloadError, HttpProcessingError, ValueError, OSError) as exc:
        if isinstance(exc, ConnectionResetError):
            raise
        raise APIError(400, f"the request body cannot be decoded: {exc}") from None
    if len(raw) > 1 << 20:
        return await asyncio.to_thread(decode_body, raw)
    return decode_body(raw)


def check_chars(engine: Engine, n_chars: int, param: str) -> None:
    """A 400 for prompt text that cannot fit the context, before any tokenizing."""
    limit = engine.context_length * MAX_CHARS_PER_TOKEN
    if n_chars > limit:
        raise APIError(
            400,
            f"{param}: {n_chars} characters cannot fit the context of "
            f"{engine.context_length} tokens (at most {limit} characters)",
            param=param,
        )


def _lease(request: web.Request, body: dict[str, Any]) -> contextlib.AbstractAsyncContextManager:
    """The engine of the body's `model` (the app's only model when it names none), held
    until the reply ends (`luced.api.catalog`)."""
    model = body.get("model")
    return request.app[MODELS].lease(None if model is None else read_text("model", model))


def _tool_format(engine: Engine, req: ChatRequest | anthropic.MessagesRequest) -> ToolFormat | None:
    """How the template shows tools, when the request offers some or its history holds
    calls or results (a template without tools cannot render those as they came)."""
    if req.calls_tools or has_tool_turns(req.messages):
        return tool_format(engine.chat_template)
    return None


def _text_chars(messages: Any) -> int:
    return sum(len(v) for m in messages for v in m.values() if isinstance(v, str))


# --- generation --------------------------------------------------------------------------


async def chat_completions(request: web.Request) -> web.StreamResponse:
    body = await read_json(request)
    async with _lease(request, body) as engine:
        return await _chat(request, engine, body)


async def _chat(request: web.Request, engine: Engine, body: dict) -> web.StreamResponse:
    req = parse_chat(body, model_name=engine.model_name, vocab_size=engine.tokenizer.vocab_size)
    check_chars(engine, _text_chars(req.messages), "messages")
    tools = _tool_format(engine, req)
    prompt = await asyncio.to_thread(
        chat_prompt, req, engine.chat_template, engine.tokenizer, tools
    )
    head = (f"chatcmpl-{uuid.uuid4().hex}", engine.model_name, int(time.time()))
    shape = {"top_logprobs": req.options.top_logprobs, "include_usage": req.options.include_usage}
    if tools is None or not req.calls_tools:
        return await _generate(request, engine, ChatFormat(*head, **shape), req.options, prompt)
    fmt = ToolChatFormat(*head, tools=tools, **shape)
    options = replace(req.options, grammar=tools.grammar(req.tools, req.tool_choice))
    return await _generate(request, engine, fmt, options, prompt)


async def completions(request: web.Request) -> web.StreamResponse:
    body = await read_json(request)
    async with _lease(request, body) as engine:
        req = parse_completion(
            body, model_name=engine.model_name, vocab_size=engine.tokenizer.vocab_size
        )
        if isinstance(req.prompt, str):
            check_chars(engine, len(req.prompt), "prompt")
        prompt = await asyncio.to_thread(completion_prompt, req, engine.tokenizer)
        fmt = CompletionFormat(
            f"cmpl-{uuid.uuid4().hex}",
            engine.model_name,
            int(time.time()),
            top_logprobs=req.options.top_logprobs,
            include_usage=req.options.include_usage,
        )
        return await _generate(request, engine, fmt, req.options, prompt)


async def messages(request: web.Request) -> web.StreamResponse:
    """Anthropic's POST /v1/messages, on the same engine path as chat completions."""
    body = await read_json(request)
    async with _lease(request, body) as engine:
        return await _messages(request, engine, body)


async def _messages(request: web.Request, engine: Engine, body: dict) -> web.StreamResponse:
    req = anthropic.parse_messages(body, model_name=engine.model_name)
    check_chars(engine, _text_chars(req.messages) + len(req.prefill), "messages")
    tools = _tool_format(engine, req)
    prompt = await asyncio.to_thread(
        anthropic.message_prompt, req, engine.chat_template, engine.tokenizer, tools
    )
    message_id = f"msg_{uuid.uuid4().hex}"
    options = req.options
    if tools is None or not req.calls_tools:
        fmt = anthropic.MessageFormat(message_id, engine.model_name)
    else:
        fmt = anthropic.ToolMessageFormat(message_id, engine.model_name, tools)
        options = replace(options, grammar=tools.grammar(req.tools, req.tool_choice))
    handle = engine.submit(generation_request(fmt.id, options, prompt))
    if req.options.stream:
        return await _stream_messages(request, fmt, handle)
    text = await _whole_text(handle)
    body = fmt.response(
        text, handle.finish_reason or "stop", handle.stop_string, _anthropic_usage(handle)
    )
    return web.json_response(body, dumps=dumps)


async def responses(request: web.Request) -> web.StreamResponse:
    """OpenAI's POST /v1/responses (stateless), on the chat completions path."""
    body = await read_json(request)
    async with _lease(request, body) as engine:
        return await _responses(request, engine, body)


async def _responses(request: web.Request, engine: Engine, body: dict) -> web.StreamResponse:
    req = parse_responses(body, model_name=engine.model_name)
    check_chars(engine, _text_chars(req.messages), "input")
    tools = _tool_format(engine, req)
    prompt = await asyncio.to_thread(
        chat_prompt, req, engine.chat_template, engine.tokenizer, tools
    )
    options, offered = req.options, None
    if tools is not None and req.calls_tools:
        options = replace(options, grammar=tools.grammar(req.tools, req.tool_choice))
        offered = tools
    fmt = ResponseFormat(
        f"resp_{uuid.uuid4().hex}", engine.model_name, int(time.time()), req, offered
    )
    handle = engine.submit(generation_request(fmt.id, options, prompt))

    def used() -> dict[str, Any]:
        return responses_usage(handle.prompt_tokens, handle.cached_tokens, handle.completion_tokens)

    if not options.stream:
        text = await _whole_text(handle)
        return web.json_response(
            fmt.response(text, handle.finish_reason or "stop", used()), dumps=dumps
        )
    resp = _event_stream()
    async with _stream_guard(handle, resp, fmt.id, fmt.error_events):
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


async def _whole_text(handle: RequestHandle) -> str:
    """A non-streamed request's text, once it ends; its error as an APIError."""
    try:
        text = "".join([delta.text async for delta in handle])
    except BaseException:  # cancelled (the client went away) or the engine broke
        handle.cancel()
        raise
    if (err := finish_error(handle.finish_reason, handle.error)) is not None:
        raise err
    return text


def _anthropic_usage(handle: RequestHandle) -> dict[str, int]:
    return anthropic.usage(handle.prompt_tokens, handle.cached_tokens, handle.completion_tokens)


async def _stream_messages(
    request: web.Request, fmt: anthropic.MessageFormat, handle: RequestHandle
) -> web.StreamResponse:
    resp = _event_stream()

    def error_events(err: APIError) -> list[bytes]:
        return [anthropic.event("error", anthropic.error_body(err))]

    async with _stream_guard(handle, resp, fmt.id, error_events):
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


async def count_tokens(request: web.Request) -> web.Response:
    """Anthropic's POST /v1/messages/count_tokens: the prompt a Messages body would make."""
    body = await read_json(request)
    async with _lease(request, body) as engine:
        req = anthropic.parse_messages(body, model_name=engine.model_name, count_only=True)
        check_chars(engine, _text_chars(req.messages) + len(req.prefill), "messages")
        prompt = await asyncio.to_thread(
            anthropic.message_prompt,
            req,
            engine.chat_template,
            engine.tokenizer,
            _tool_format(engine, req),
        )
    return web.json_response({"input_tokens": len(prompt)}, dumps=dumps)


def _event_stream() -> web.StreamResponse:
    return web.StreamResponse(
        headers={
            "Content-Type": "text/event-stream; charset=utf-8",
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",  # a proxy must not hold the tokens back
        }
    )


async def _generate(
    request: web.Request, engine: Engine, fmt: OutputFormat, options: Options, prompt: list[int]
) -> web.StreamResponse:
    handle = engine.submit(generation_request(fmt.id, options, prompt))
    if options.stream:
        return await _stream(request, fmt, handle)
    try:
        deltas = [delta async for delta in handle]
    except BaseException:  # cancelled (the client went away) or the engine broke
        handle.cancel()
        raise
    if (err := finish_error(handle.finish_reason, handle.error)) is not None:
        raise err
    fmt.usage_extra = usage_extra(handle)
    body = fmt.response(
        deltas, handle.finish_reason or "stop", handle.prompt_tokens, handle.completion_tokens
    )
    return web.json_response(body, dumps=dumps)


def usage_extra(handle: RequestHandle) -> dict:
    """`usage` beyond the token counts: prompt tokens restored from the prefix cache (as
    OpenAI reports cached tokens) and, when the request decoded speculatively, the DFlash
    counts: drafts (verify steps), draft_tokens (proposed) and accepted_tokens."""
    extra: dict = {"prompt_tokens_details": {"cached_tokens": handle.cached_tokens}}
    if handle.spec["drafts"]:
        extra["speculative"] = dict(handle.spec)
    return extra


async def _stream(
    request: web.Request, fmt: OutputFormat, handle: RequestHandle
) -> web.StreamResponse:
    resp = _event_stream()

    def error_events(err: APIError) -> list[bytes]:
        return [sse(err.body()), SSE_DONE]

    async with _stream_guard(handle, resp, fmt.id, error_events):
        await resp.prepare(request)
        for chunk in fmt.start():
            await resp.write(sse(chunk))
        async for delta in handle:
            if (chunk := fmt.chunk(delta)) is not None:
                await resp.write(sse(chunk))
        err = finish_error(handle.finish_reason, handle.error)
        if err is not None:
            tail = [err.body()]
        else:
            reason = handle.finish_reason or "stop"
            fmt.usage_extra = usage_extra(handle)
            tail = fmt.end(reason, handle.prompt_tokens, handle.completion_tokens)
        for event in tail:
            await resp.write(sse(event))
        await resp.write(SSE_DONE)
    return resp


@contextlib.asynccontextmanager
async def _stream_guard(
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


# --- llama-server's token utilities ------------------------------------------------------


async def tokenize(request: web.Request) -> web.Response:
    """{"content", "add_special" (BOS, default false), "parse_special" (control tokens
    written in content are tokens, default true), "with_pieces"} -> {"tokens": [...]};
    with_pieces, each token is {"id", "piece"} (piece: text, or a byte list when the
    token is not whole UTF-8)."""
    body = await read_json(request)
    content = read_text("content", body.get("content"))
    add_bos = read_bool(body, "add_special")
    special = read_bool(body, "parse_special", default=True)
    with_pieces = read_bool(body, "with_pieces")
    async with _lease(request, body) as engine:
        check_chars(engine, len(content), "content")
        tokenizer = engine.tokenizer
        ids = await asyncio.to_thread(
            tokenizer.encode, content, add_bos=add_bos, allow_special=special, add_eos=False
        )
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


async def detokenize(request: web.Request) -> web.Response:
    """{"tokens": [ids]} -> {"content": text}; control tokens appear as their text, so
    detokenize inverts tokenize."""
    body = await read_json(request)
    async with _lease(request, body) as engine:
        return _detokenize(engine.tokenizer, body)


def _detokenize(tokenizer: Tokenizer, body: dict) -> web.Response:
    tokens = body.get("tokens")
    if not isinstance(tokens, list):
        raise APIError(
            400, f"tokens must be an array of token ids, got {json_kind(tokens)}", param="tokens"
        )
    ids = []
    for i, t in enumerate(tokens):
        n = as_int(f"tokens[{i}]", t)
        if not 0 <= n < tokenizer.vocab_size:
            raise APIError(
                400,
                f"tokens[{i}]: token id {n} is not in [0, {tokenizer.vocab_size})",
                param=f"tokens[{i}]",
            )
        ids.append(n)
    return web.json_response({"content": tokenizer.decode(ids, skip_special=False)}, dumps=dumps)


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
