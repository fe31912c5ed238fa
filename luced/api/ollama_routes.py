"""Ollama's API beside the OpenAI one: the routes, on the engine path every API shares.

    GET  /api/version           {"version"}: the Ollama API release these routes follow
    GET  /api/tags, /api/ps     the served models, the loaded ones (luced.api.ollama_models)
    POST /api/show              a model's details, model_info, template, parameters
    POST /api/chat              chat, streamed as NDJSON unless "stream": false
    POST /api/generate          a prompt through the chat template (or raw), likewise
    POST /api/embed             embeddings, unit length (luced.api.embeddings)
    POST /api/embeddings        Ollama's older route: one prompt, its vector as pooled

A request's trace: the lease of its model (`luced.api.lease`; a daemon serving several
reads the name first, as Ollama matches names), `prepare` (`luced.api.ollama` validates
the body, renders and tokenizes the prompt, off the event loop), `Engine.submit`, and
the deltas relayed through `luced.api.ollama_format` as NDJSON lines, or as one object.
/api/show describes a model without loading it; the "unload" idiom does not load one.
Errors are Ollama's `{"error": message}` with the status (`luced.api.server` shapes them
for every /api/ path); one that comes after the first line is the stream's last line.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Callable

from aiohttp import web

from luced.api import ollama_models
from luced.api.catalog import Catalog
from luced.api.embeddings import (
    MAX_INPUTS,
    embed_all,
    embedding_tokens,
    prepare_ollama_embed,
    prepare_ollama_embeddings,
    vectors_json,
)
from luced.api.fields import APIError
from luced.api.formats import dumps, finish_error
from luced.api.lease import leased, leased_engine, prepare, read_body, requested
from luced.api.ollama import (
    Named,
    Prepared,
    match_model,
    named_model,
    named_request,
    named_show,
    prepare_chat,
    prepare_generate,
)
from luced.api.ollama_format import NDJSON, OllamaReply, Timings, line
from luced.api.openai import generation_request
from luced.api.relay import all_deltas, stream_guard
from luced.engine.core import Engine

# The Ollama release whose API these routes follow: clients gate features (tools,
# structured outputs, think) on the version they read here.
OLLAMA_VERSION = "0.32.0"


def add_routes(app: web.Application, models: Catalog) -> None:
    async def version(request: web.Request) -> web.Response:
        return web.json_response({"version": OLLAMA_VERSION})

    async def tags(request: web.Request) -> web.Response:
        listed = []
        for name in models.names():
            about = await models.about(name)
            listed += ollama_models.tags(about.facts, name)["models"]
        return web.json_response({"models": listed}, dumps=dumps)

    async def ps(request: web.Request) -> web.Response:
        listed = []
        for served in models.running():
            e = served.engine
            entry = ollama_models.ps(
                served.facts, e.model.name, e.model.context_length, e.workers(), served.expires
            )
            listed += entry["models"]
        return web.json_response({"models": listed}, dumps=dumps)

    async def show(request: web.Request) -> web.Response:
        named = await requested(request, named_show, always=True)
        assert named is not None
        about = await models.about(_served(models, named))
        body = ollama_models.show(about.facts, about.template, about.context_length)
        return web.json_response(body, dumps=dumps)

    async def chat(request: web.Request) -> web.StreamResponse:
        return await _answer(request, models, "chat", prepare_chat)

    async def generate(request: web.Request) -> web.StreamResponse:
        return await _answer(request, models, "generate", prepare_generate)

    async def embed(request: web.Request) -> web.Response:
        arrived = time.monotonic()
        async with _embedding_lease(request, models) as engine:
            tokens = embedding_tokens(engine)
            prep = await prepare(request, prepare_ollama_embed, tokens=tokens)
            vectors = await embed_all(engine, prep.inputs, f"ollama-{uuid.uuid4().hex}")
        rows = await asyncio.to_thread(vectors_json, vectors)
        tail = {
            "total_duration": int((time.monotonic() - arrived) * 1e9),
            "load_duration": 0,
            "prompt_eval_count": sum(map(len, prep.inputs)),
        }
        text = f'{{"model":{dumps(prep.model)},"embeddings":{rows},{dumps(tail)[1:]}'
        return web.Response(text=text, content_type="application/json")

    async def embeddings(request: web.Request) -> web.Response:
        async with _embedding_lease(request, models) as engine:
            prep = await prepare(request, prepare_ollama_embeddings)
            vectors = await embed_all(engine, prep.inputs, f"ollama-{uuid.uuid4().hex}")
        rows = vectors_json(vectors, normalize=False)[1:-1]  # one vector, or none
        return web.Response(text=f'{{"embedding":{rows or "[]"}}}', content_type="application/json")

    app.add_routes(
        [
            web.get("/api/version", version),
            web.get("/api/tags", tags),
            web.get("/api/ps", ps),
            web.post("/api/show", show),
            web.post("/api/chat", chat),
            web.post("/api/generate", generate),
            web.post("/api/embed", embed),
            web.post("/api/embeddings", embeddings),
        ]
    )


def _served(models: Catalog, named: Named | None) -> str | None:
    """The served model a body names as Ollama matches names (None: not named)."""
    if named is None or named.model is None:
        return None
    return match_model(named.model, models.names())


@contextlib.asynccontextmanager
async def _embedding_lease(request: web.Request, models: Catalog) -> AsyncIterator[Engine]:
    """The engine of the model an embeddings body names (as Ollama matches names), leased
    for the block; the body may carry MAX_INPUTS inputs (`luced.api.lease.read_body`)."""
    await read_body(request, MAX_INPUTS)
    async with leased(request, _served(models, await requested(request, named_model))):
        yield leased_engine(request)


async def _answer(
    request: web.Request, models: Catalog, kind: str, fn: Callable[..., Prepared]
) -> web.StreamResponse:
    arrived = time.monotonic()
    named = await requested(request, named_request)
    name = _served(models, named)
    if named is not None and named.unload and name is not None and models.peek(name) is None:
        # "Unload" a model that is not loaded: nothing to do, and nothing to load for it.
        reply = OllamaReply(kind, named.model or name).idle("unload")
        return web.json_response(reply, dumps=dumps)
    async with leased(request, name) as served:
        prep = await prepare(request, fn)
        if prep.request.idle and prep.request.done_reason == "unload":
            models.unload_when_idle(served.engine.model.name)
        return await _reply(request, served.engine, prep, arrived)


async def _reply(
    request: web.Request, engine: Engine, prep: Prepared, arrived: float
) -> web.StreamResponse:
    req = prep.request
    fmt = OllamaReply(
        req.kind,
        req.model,
        tools=prep.tools,
        top_logprobs=prep.options.top_logprobs,
        prompt=prep.prompt if req.kind == "generate" and req.raw is None else None,
    )
    if req.idle:  # Ollama's load / unload idioms: the model is loaded now
        if req.done_reason == "load" and engine.state != "ready":
            # "loaded" would be untrue: the client is told to come back, as a request is
            raise APIError(503, f"luced is {engine.state}; try again later", retry_after=1.0)
        return web.json_response(fmt.idle(req.done_reason), dumps=dumps)
    request_id = f"ollama-{uuid.uuid4().hex}"
    handle = engine.submit(generation_request(request_id, prep.options, prep.prompt))
    if not prep.options.stream:
        deltas = await all_deltas(handle)
        body = fmt.whole(deltas, handle.finish_reason or "stop", Timings.of(handle, arrived))
        return web.json_response(body, dumps=dumps)
    resp = web.StreamResponse(headers={"Content-Type": NDJSON, "X-Accel-Buffering": "no"})

    def error_line(err: APIError) -> list[bytes]:
        return [line({"error": err.message})]

    async with stream_guard([handle], resp, request_id, error_line):
        await resp.prepare(request)
        async for delta in handle:
            if (chunk := fmt.chunk(delta)) is not None:
                await resp.write(line(chunk))
        if (err := finish_error(handle.finish_reason, handle.error)) is not None:
            tail = [{"error": err.message}]
        else:
            tail = fmt.end(handle.finish_reason or "stop", Timings.of(handle, arrived))
        for obj in tail:
            await resp.write(line(obj))
    return resp
