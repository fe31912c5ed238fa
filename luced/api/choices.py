"""OpenAI's choices: one engine request per choice of each prompt, submitted all or none,
and relayed into one reply.

    prompts × n ─generation_requests─► requests ─submit_all─► handles (choice k = i·n + j)
    not streaming   every choice's deltas, then one body with `choices` in index order
    streaming       each choice's chunks as they come, interleaved, each naming its index;
                    a choice's finish chunk when it ends; the usage chunk after the last

The choices of a prompt after its first share that prompt's KV blocks (`share_prompt`:
they wait for the first's prefill) where the engine shares prefixes; elsewhere each
computes the prompt itself. Usage counts each prompt once, as OpenAI bills n choices: its
first choice's prompt and cached tokens; completion tokens and speculation counts add up
over every choice. A choice that fails ends the reply with its error and cancels the
others; a client that goes away cancels them all.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

from aiohttp import web

from luced.api.fields import APIError
from luced.api.formats import SSE_DONE, OutputFormat, dumps, finish_error, sse, usage
from luced.api.openai import Options, generation_requests
from luced.api.relay import all_choices, cancel_all, event_stream, interleaved, stream_guard
from luced.engine.core import Engine, EngineError, GenerationRequest, RequestHandle


def submit_all(engine: Engine, requests: Sequence[GenerationRequest]) -> list[RequestHandle]:
    """Queue every request, or none: one the engine refuses (a full queue, a prompt too
    long) cancels those queued before it and raises its error."""
    handles: list[RequestHandle] = []
    try:
        for req in requests:
            handles.append(engine.submit(req))
    except EngineError:
        cancel_all(handles)
        raise
    return handles


def reply_usage(handles: Sequence[RequestHandle], n: int) -> dict[str, Any]:
    """`usage` of a reply whose choices are `handles`, n per prompt (module docstring):
    also the prompt tokens restored from the prefix cache or shared (as OpenAI reports
    cached tokens) and, when choices decoded speculatively, the DFlash counts: drafts
    (verify steps), draft_tokens (proposed) and accepted_tokens."""
    firsts = handles[::n]
    out: dict[str, Any] = usage(
        sum(h.prompt_tokens for h in firsts), sum(h.completion_tokens for h in handles)
    )
    out["prompt_tokens_details"] = {"cached_tokens": sum(h.cached_tokens for h in firsts)}
    if any(h.spec["drafts"] for h in handles):
        out["speculative"] = {k: sum(h.spec[k] for h in handles) for k in handles[0].spec}
    return out


async def generate(
    request: web.Request,
    engine: Engine,
    fmts: Sequence[OutputFormat],
    options: Options,
    prompts: list[list[int]],
) -> web.StreamResponse:
    """Run every choice (`fmts[k]` shapes choice k) and relay them: one body, or a stream."""
    handles = submit_all(engine, generation_requests(fmts[0].id, options, prompts))
    if options.stream:
        return await _stream(request, fmts, handles, options.n)
    choices = await all_choices(handles)
    body = fmts[0].body(
        [
            fmt.choice(deltas, h.finish_reason or "stop")
            for fmt, h, deltas in zip(fmts, handles, choices, strict=True)
        ],
        reply_usage(handles, options.n),
    )
    return web.json_response(body, dumps=dumps)


async def _stream(
    request: web.Request, fmts: Sequence[OutputFormat], handles: list[RequestHandle], n: int
) -> web.StreamResponse:
    resp = event_stream()

    def error_events(err: APIError) -> list[bytes]:
        return [sse(err.body()), SSE_DONE]

    async with stream_guard(handles, resp, fmts[0].id, error_events):
        await resp.prepare(request)
        for fmt in fmts:
            for chunk in fmt.start():
                await resp.write(sse(chunk))
        failed = None
        async with contextlib.aclosing(interleaved(handles)) as came:
            async for k, delta in came:
                if delta is not None:
                    chunks = [c] if (c := fmts[k].chunk(delta)) is not None else []
                elif (failed := finish_error(handles[k].finish_reason, handles[k].error)) is None:
                    chunks = fmts[k].finish(handles[k].finish_reason or "stop")
                else:
                    cancel_all(handles)
                    break
                for chunk in chunks:
                    await resp.write(sse(chunk))
        tail = [failed.body()] if failed else fmts[0].usage_chunks(reply_usage(handles, n))
        for event in tail:
            await resp.write(sse(event))
        await resp.write(SSE_DONE)
    return resp
