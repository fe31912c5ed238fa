"""The models an app serves, as its handlers see them: `Catalog`.

A handler resolves the request's `model` to its engine for as long as it answers
(`luced.api.lease` does it for the routes):

    async with catalog.lease("qwen3") as served:   # 404 not served, 400 none named of
        served.engine.submit(...)                  # several, 503 (+ Retry-After) when it
                                                   # cannot be loaded now

While a lease is held its model is not unloaded. `SingleModel` is the catalog of one
engine that lives as long as the app (a daemon started with MODEL, tests, tools); the
daemon serving several is `luced.serve.models.ModelRegistry`, which loads a model on
its first lease and unloads it when idle. Both give /v1/models its cards, /health its
answer, and Ollama's listings (`luced.api.ollama_routes`) their models.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from luced.api.fields import APIError
from luced.api.ollama_models import ModelFacts
from luced.engine.core import Engine
from luced.engine.metrics import Metrics
from luced.text.chat_template import ChatTemplate


@dataclass(frozen=True)
class Served:
    """A loaded model: its engine, and what replies and listings say of it."""

    engine: Engine
    facts: ModelFacts = field(default_factory=ModelFacts)  # Ollama's listings
    fingerprint: str = ""  # OpenAI's system_fingerprint ("" = none)
    expires: float | None = None  # unix time it unloads if still idle (None: never)


@dataclass(frozen=True)
class About:
    """A served model, loaded or not, as Ollama's /api/show describes it."""

    facts: ModelFacts
    template: str  # the chat template's source
    context_length: int


def template_source(template: ChatTemplate | None) -> str:
    """What /api/show says of a chat template: an encoder's (embeddings only) is none."""
    return "" if template is None else template.source


class Catalog(Protocol):
    @property
    def several(self) -> bool:
        """Whether requests name their model among several (its name is read first)."""
        ...

    def names(self) -> list[str]: ...

    def lease(self, name: str | None) -> contextlib.AbstractAsyncContextManager[Served]:
        """Model `name` (None: the only one), loaded, while the block runs."""
        ...

    def context_bound(self) -> int | None:
        """The largest context a request may fill (None: not known before its model
        loads): what bounds a body before its model is known."""
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

    def running(self) -> list[Served]:
        """The loaded models (Ollama's /api/ps)."""
        ...

    async def about(self, name: str | None) -> About:
        """Model `name` (None: the only one) described without loading it."""
        ...

    def unload_when_idle(self, name: str) -> None:
        """Unload model `name` once no request holds it (Ollama's keep_alive 0)."""
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
    """The catalog of one engine, running as long as the app (see the module docstring).
    Its requests' `model` is checked as they are parsed (`luced.api.openai.check_model`)."""

    several = False

    def __init__(
        self, engine: Engine, metrics: Metrics, facts: ModelFacts | None = None, fingerprint=""
    ) -> None:
        self.served = Served(engine, facts or ModelFacts(), fingerprint)
        self.engine = engine
        self._metrics = metrics
        self.started = int(time.time())

    def _check(self, name: str | None) -> None:
        if name is not None and name != self.engine.model.name:
            raise unknown_model(name, [self.engine.model.name])

    def names(self) -> list[str]:
        return [self.engine.model.name]

    @contextlib.asynccontextmanager
    async def lease(self, name: str | None) -> AsyncIterator[Served]:
        self._check(name)
        yield self.served

    def context_bound(self) -> int:
        return self.engine.model.context_length

    def cards(self) -> list[dict[str, Any]]:
        return [model_card(self.engine.model.name, self.started, self.engine.model.context_length)]

    def card(self, name: str) -> dict[str, Any]:
        self._check(name)
        return self.cards()[0]

    def health(self) -> tuple[int, dict[str, Any]]:
        state = self.engine.state
        return (200, {"status": "ok"}) if state == "ready" else (503, {"status": state})

    def peek(self, name: str | None) -> Engine | None:
        self._check(name)
        return self.engine

    def running(self) -> list[Served]:
        return [self.served]

    async def about(self, name: str | None) -> About:
        self._check(name)
        source = template_source(self.engine.chat_template)
        return About(self.served.facts, source, self.engine.model.context_length)

    def unload_when_idle(self, name: str) -> None:
        """Its one model stays loaded until the daemon stops."""

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
