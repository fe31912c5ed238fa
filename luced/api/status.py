"""The daemon's state as JSON, for the web page and for scripts; both routes only read.

    GET /v1/status                  what `lucectl status` shows (Engine.status: the queue
                                    with each running and waiting request, the workers and
                                    their placement, KV and prefix-cache use, speculation)
                                    plus `snapshots`, as `lucectl snapshot list` lists them
    GET /v1/status/history?since=T  the last ten minutes of the metrics, a sample a second
                                    (luced.engine.timeline), only the seconds after unix
                                    time T when given: a poller asks for what is new

Both take `?model=NAME` to show one served model (a daemon serving several); without it,
the model used last. A model that is not loaded shows no engine status: /v1/status then
holds the daemon's state and every model's row (`models`, as `lucectl models` lists them).

They sit under /v1/, so with an API key they want it like the rest of the API. The
timeline's gauges (running, waiting, KV use) are sampled once a second by a task that
the app owns (in its cleanup_ctx).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from luced.api.catalog import Catalog
from luced.api.fields import APIError
from luced.api.formats import dumps
from luced.cache.prefix_cache import PrefixCache
from luced.engine.timeline import SPAN_S
from luced.text.tokenizer import Tokenizer

log = logging.getLogger(__name__)

PREVIEW_TOKENS = 24  # tokens shown of each snapshot's start and end


def snapshot_rows(cache: PrefixCache | None, tokenizer: Tokenizer) -> list[dict[str, Any]]:
    """The prefix cache's snapshots as `lucectl snapshot list` shows them."""
    if cache is None:
        return []
    return [
        {
            "id": e.id,
            "tokens": e.n_tokens,
            "bytes": e.nbytes,
            "disk_bytes": e.disk_bytes,
            "tier": e.tier,
            "hits": e.hits,
            "last_used": e.last_used,
            "in_use": e.pinned,
            "prefix": tokenizer.decode(e.tokens[:PREVIEW_TOKENS].tolist()),
            # Snapshots of one app share their start (the system prompt): the end (the
            # last turn) is what tells them apart.
            "suffix": tokenizer.decode(e.tokens[-PREVIEW_TOKENS:].tolist()),
        }
        for e in cache.entries()
    ]


def add_routes(app: web.Application, models: Catalog) -> None:
    """The two routes, and the task that samples the gauges while the app runs."""

    async def status(request: web.Request) -> web.Response:
        engine = models.peek(request.query.get("model"))
        body = models.overview()
        if engine is not None:
            snapshots = snapshot_rows(engine.prefix_cache, engine.tokenizer)
            body = {**engine.status(), "snapshots": snapshots, **body}
        else:  # no model loaded: the daemon's state
            body = {"model": None, "state": models.health()[1]["status"], **body}
        return web.json_response(body, dumps=dumps)

    async def history(request: web.Request) -> web.Response:
        timeline = models.metrics_of(request.query.get("model")).timeline
        series = timeline.since(_since(request))
        return web.json_response({"interval_s": 1, "span_s": SPAN_S, **series}, dumps=dumps)

    async def sample_every_second(app: web.Application) -> AsyncIterator[None]:
        task = asyncio.create_task(_sample(models), name="status-sampler")
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    app.add_routes([web.get("/v1/status", status), web.get("/v1/status/history", history)])
    app.cleanup_ctx.append(sample_every_second)


def _since(request: web.Request) -> float | None:
    raw = request.query.get("since")
    if raw is None:
        return None
    try:
        t = float(raw)
    except ValueError:
        t = math.nan
    if not math.isfinite(t):
        raise APIError(400, f"since must be a unix time in seconds, got {raw!r}", param="since")
    return t


async def _sample(models: Catalog) -> None:
    """Refresh the gauges (the timeline's among them) in the middle of every second."""
    failed = False
    while True:
        await asyncio.sleep(1.5 - time.time() % 1.0)
        try:
            models.refresh()
        except Exception:
            if not failed:  # logged once, not every second
                log.exception("sampling the status for the timeline failed")
            failed = True
