"""The models an app serves, as its handlers see them: `Catalog`.

A handler resolves the request's `model` to an engine for as long as it answers:

    async with catalog.lease(body.get("model")) as engine:   # 404 unknown, 400 missing,
        handle = engine.submit(...)                           # 503 (+ Retry-After) when
        ...                                                   # its model cannot load now

While a lease is held its model is not unloaded. `SingleModel` is the catalog of one
engine that lives as long as the app (tests, tools); the daemon's is
`luced.serve.models.ModelRegistry`, which loads a model on its first lease and unloads it
when idle. Both give /v1/models its cards and /health its answer.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any, Protocol

from luced.api.fields import APIError
from luced.engine.core import Engine
from luced.engine.metrics import Metrics


class Catalog(Protocol):
    def lease(self, name: str | None) -> contextlib.AbstractAsyncContextManager[Engine]:
        """The engine of model `name` (None: the only one), loaded, while the block runs."""
        ...

    def cards(self) -> list[dict[str, Any]]:
        """/v1/models: a card per served model."""
        ...

    def card(self, name: str) -> dict[str, Any]:
        """One model's card; APIError 404 for a name not served."""
        ...

    def health(self) -> tuple[int, dict[str, Any]]:
        """/health's status and body."""
        ...

    def peek(self, name: str | None) -> Engine | None:
        """The engine of model `name` if it is loaded, without loading it (None: the one
        used last); APIError 404 for a name not served."""
        ...

    def overview(self) -> dict[str, Any]:
        """What /v1/status adds to an engine's status (several models: every model's row)."""
        ...

    def metrics_of(self, name: str | None) -> Metrics:
        """The metrics whose timeline /v1/status/history shows for model `name`."""
        ...

    def refresh(self) -> None:
        """Set every loaded model's gauges from its engine's status."""
        ...

    def exposition(self) -> bytes:
        """/metrics: the Prometheus text of every model and of the daemon."""
        ...


def model_card(name: str, created: int, context_length: int | None, **extra: Any) -> dict:
    card: dict[str, Any] = {"id": name, "object": "model", "created": created, "owned_by": "luced"}
    if context_length is not None:
        card["max_model_len"] = context_length  # vLLM's extra field
    return {**card, **extra}


def unknown_model(name: str, served: Sequence[str]) -> APIError:
    """The 404 for a model this server does not serve, naming the ones it does."""
    names = ", ".join(repr(n) for n in served)
    return APIError(
        404,
        f"The model {name!r} does not exist; this server serves {names}",
        param="model",
        code="model_not_found",
    )


class SingleModel:
    """The catalog of one engine, running as long as the app (see the module docstring)."""

    def __init__(self, engine: Engine, metrics: Metrics) -> None:
        self.engine = engine
        self._metrics = metrics
        self.started = int(time.time())

    def _check(self, name: str | None) -> None:
        if name is not None and name != self.engine.model_name:
            raise unknown_model(name, [self.engine.model_name])

    @contextlib.asynccontextmanager
    async def lease(self, name: str | None) -> AsyncIterator[Engine]:
        self._check(name)
        yield self.engine

    def cards(self) -> list[dict[str, Any]]:
        return [model_card(self.engine.model_name, self.started, self.engine.context_length)]

    def card(self, name: str) -> dict[str, Any]:
        self._check(name)
        return self.cards()[0]

    def health(self) -> tuple[int, dict[str, Any]]:
        state = self.engine.state
        return (200, {"status": "ok"}) if state == "ready" else (503, {"status": state})

    def peek(self, name: str | None) -> Engine | None:
        self._check(name)
        return self.engine

    def overview(self) -> dict[str, Any]:
        return {}

    def metrics_of(self, name: str | None) -> Metrics:
        self._check(name)
        return self._metrics

    def refresh(self) -> None:
        self._metrics.refresh(self.engine.status())

    def exposition(self) -> bytes:
        self.refresh()
        return self._metrics.exposition()
