"""Ollama's API beside the OpenAI one: the routes, on the engine path every API shares.

    GET  /api/version           {"version"}: the Ollama API release these routes follow
    GET  /api/tags, /api/ps     the served model (luced.api.ollama_models)
    POST /api/show              its details, model_info, template, parameters
    POST /api/chat              chat, streamed as NDJSON unless "stream": false
    POST /api/generate          a prompt through the chat template (or raw), likewise
    POST /api/embed             embeddings, unit length (luced.api.embeddings)
    POST /api/embeddings        Ollama's older route: one prompt, its vector as pooled

A request's trace: `prepare` (the server's: read the body, then `luced.api.ollama`
validates it, renders and tokenizes the prompt, off the event loop), `Engine.submit`, and
the deltas relayed through `luced.api.ollama_format` as NDJSON lines, or as one object.
Errors are Ollama's `{"error": message}` with the status (`luced.api.server` shapes them
for every /api/ path); one that comes after the first line is the stream's last line.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from aiohttp import web

from luced.api import ollama_models
from luced.api.embeddings import (
    embed_all,
    embedding_tokens,
    prepare_ollama_embed,
    prepare_ollama_embeddings,
    vectors_json,
)
from luced.api.fields import APIError
from luced.api.formats import dumps, finish_error
from luced.api.ollama import Prepared, check_model, prepare_chat, prepare_generate
from luced.api.ollama_format import NDJSON, OllamaReply, Timings, line
from luced.api.ollama_models import ModelFacts
from luced.api.openai import generation_request
from luced.api.relay import all_deltas, stream_guard
from luced.engine.core import Engine

# The Ollama release whose API these routes follow: clients gate features (tools,
# structured outputs, think) on the version they read here.
OLLAMA_VERSION = "0.32.0"

# The server's body reader: fn(engine, *args, body) run off the event loop once the body
# is in (luced.api.server.prepare).
Prepare = Callable[..., Awaitable[Any]]


def add_routes(app: web.Application, engine: Engine, facts: ModelFacts, prepare: Prepare) -> None:
    async def version(request: web.Request) -> web.Response:
        return web.json_response({"version": OLLAMA_VERSION})

    async def tags(request: web.Request) -> web.Response:
        return web.json_response(ollama_models.tags(facts, engine.model_name), dumps=dumps)

    async def ps(request: web.Request) -> web.Response:
        body = ollama_models.ps(facts, engine.model_name, engine.context_length, engine.workers())
        return web.json_response(body, dumps=dumps)

    async def show(request: web.Request) -> web.Response:
        await prepare(request, _show_model)
        template = engine.chat_template.source if engine.chat_template is not None else ""
        body = ollama_models.show(facts, template, engine.context_length)
        return web.json_response(body, dumps=dumps)

    async def chat(request: web.Request) -> web.StreamResponse:
        arrived = time.monotonic()
        return await _reply(request, engine, await prepare(request, prepare_chat), arrived)

    async def generate(request: web.Request) -> web.StreamResponse:
        arrived = time.monotonic()
        return await _reply(request, engine, await prepare(request, prepare_generate), arrived)

    async def embed(request: web.Request) -> web.Response:
        arrived = time.monotonic()
        prep = await prepare(request, prepare_ollama_embed, tokens=embedding_tokens(engine))
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


def _show_model(engine: Engine, body: Mapping[str, Any]) -> str:
    """/api/show names its model as `model` (or the older `name`)."""
    field = "model" if body.get("model") else "name"
    return check_model(body, engine.model_name, field)


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
    if req.idle:  # Ollama's load / unload idioms: luced's one model stays loaded
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

    async with stream_guard(handle, resp, request_id, error_line):
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
