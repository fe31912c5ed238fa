"""Several models in one daemon: which it serves, which are loaded, and when that changes.

    registry = ModelRegistry(config, owner)        # --model NAME=PATH ..., --models-dir DIR
    async with registry.lease("qwen3") as engine:  # the HTTP side (`api.catalog.Catalog`):
        ...                                        # loads the model first when it is not
    await registry.load("qwen3")                   # lucectl load / --preload
    await registry.unload("qwen3", force=False)    # lucectl unload
    registry.rows()                                # lucectl models

A served model's states (`ServedModel.state`; while it is loaded its engine says more:
ready, degraded or draining, docs/design.md "Daemon states")::

    unloaded --lease or load--> loading --> ready --idle, budget or unload--> unloading
        ^                          |                                            |
        |                          +--> failed (its error kept; the next lease  |
        +-------------------------------- or `lucectl load` tries again) <------+

Loading: the first lease of a model not loaded starts its load, as a task of its own: the
GGUF is read in a thread, room is made under the memory budget, then the model's
workers start (`serve.loader`). The lease waits for it in the model's load queue: at most
its `max_queue` requests wait, more get a 503 with Retry-After; one that waits longer than
`model_load_timeout` gets a 503 too, and the load goes on. Other models serve meanwhile:
nothing of a load runs on the event loop for long.

A lease is held from the request's resolution to the end of its reply, so a model with a
request running, queued, or waiting for its load is never unloaded. An unleased model is
unloaded after `model_keep_alive` seconds (its own, from its table, or the daemon's), when
a load needs its room under `models_memory_budget` (the least recently used first), or
by `lucectl unload` (which refuses while it has requests, unless forced: they end with an
error). Unloading stops its engine and workers and unlinks its shared memory.

A daemon started with MODEL serves that one model as before: the registry holds it
pinned (loaded at start, never unloaded) and the HTTP side sees it through
`api.catalog.SingleModel`.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import re
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from luced.api.catalog import About, Served, model_card, template_source, unknown_model
from luced.api.fields import APIError
from luced.engine.core import Engine
from luced.engine.metrics import Metrics, merged_exposition
from luced.engine.request import Unavailable
from luced.ipc.shm import ShmOwner
from luced.serve.admin import CommandError
from luced.serve.config import Config
from luced.serve.loader import SINGLE, LoadedModel, StartupError, describe, read_spec
from luced.serve.options import ConfigError, ModelEntry

log = logging.getLogger("luced")

UNLOADED, LOADING, READY, UNLOADING, FAILED = (
    "unloaded", "loading", "ready", "unloading", "failed",
)  # fmt: skip
REAP_INTERVAL = 0.25  # seconds between checks for idle models
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")


@dataclass(frozen=True)
class Holder:
    """A loaded model as the memory budget sees it."""

    name: str
    memory: int  # bytes, estimated
    last_used: float  # monotonic seconds
    idle: bool  # no lease: it may be unloaded


def plan_room(held: Sequence[Holder], need: int, budget: int) -> list[str] | None:
    """The idle models to unload, least recently used first, so that `need` more bytes fit
    the budget beside the rest; [] when they fit already; None when even unloading every
    idle model would not make the room (a busy one must finish first)."""
    used = sum(h.memory for h in held)
    plan: list[str] = []
    for h in sorted((h for h in held if h.idle), key=lambda h: h.last_used):
        if used + need <= budget:
            break
        plan.append(h.name)
        used -= h.memory
    return plan if used + need <= budget else None


class ServedModel:
    """One model the daemon serves: its config, state, and while loaded its engine."""

    def __init__(
        self, name: str, config: Config, segments: str, pending: ModelEntry | None = None
    ) -> None:
        self.name = name
        self.config = config
        self.segments = segments  # the name prefix of its shared-memory segments
        self.pending = pending  # a [models.NAME] table waiting for models_dir's NAME.gguf
        self.metrics = Metrics(name)  # kept across loads: counters never go back
        self.state = UNLOADED
        self.loaded: LoadedModel | None = None
        self.leases = 0  # requests resolved to it and not yet answered
        self.waiting = 0  # of those, the ones waiting for its load
        self.pinned = False  # never unloaded (the one model of a daemon started with MODEL)
        self.reserved = False  # its memory counts against the budget
        self.memory = 0  # bytes, estimated when its GGUF is read
        self.context: int | None = None
        self.load_s: float | None = None
        self.error: str | None = None
        self.loading: asyncio.Task | None = None
        self.unloading: asyncio.Task | None = None
        self.unload_asap = False  # unload once idle (Ollama's keep_alive 0)
        self.about: About | None = None  # read from its GGUF when asked, unloaded
        self.last_used = time.monotonic()
        self.last_used_unix: float | None = None

    @property
    def engine(self) -> Engine | None:
        return self.loaded.engine if self.loaded is not None else None

    def used(self) -> None:
        self.last_used = time.monotonic()
        self.last_used_unix = time.time()

    def served(self) -> Served:
        """Its engine and what replies and listings say of it (loaded)."""
        assert self.loaded is not None
        spec, keep = self.loaded.spec, self.config.registry.model_keep_alive
        expires = None
        if keep and not self.pinned and not self.leases:
            expires = (self.last_used_unix or time.time()) + keep
        return Served(self.loaded.engine, spec.facts, spec.fingerprint, expires)

    def describe(self) -> str:
        """Its state, the engine's own while it is loaded (ready, degraded, draining)."""
        engine = self.engine
        return engine.state if self.state == READY and engine is not None else self.state

    def row(self) -> dict[str, Any]:
        """What `lucectl models` shows of it."""
        engine = self.engine
        return {
            "name": self.name,
            "state": self.describe(),
            "path": str(self.config.model.model_path()),
            "memory_bytes": self.memory or None,
            "last_used": self.last_used_unix,
            "requests": self.leases,
            "running": len(engine.scheduler.running) if engine is not None else 0,
            "waiting": len(engine.scheduler.waiting) + self.waiting if engine else self.waiting,
            "context_length": self.context,
            "load_s": self.load_s,
            "keep_alive_s": None if self.pinned else self.config.registry.model_keep_alive,
            "error": self.error,
        }


def _loading(model: ServedModel, reason: str, why: str) -> Unavailable:
    """A 503 for a request that cannot wait for its model's load; counted by `reason`."""
    model.metrics.rejected(reason)
    return Unavailable(
        f"model {model.name!r} is loading and {why}; try again later",
        retry_after=max(1.0, model.load_s or 5.0),
        reason=reason,
    )


class ModelRegistry:
    """Every model the daemon serves (the module docstring)."""

    def __init__(self, config: Config, owner: ShmOwner) -> None:
        self.config = config
        self.owner = owner
        self.single = not config.registry.several
        self.metrics = Metrics()  # the daemon's own: its event loop's lag
        self.models: dict[str, ServedModel] = {}
        self.draining = False
        self.started = int(time.time())
        self.preloading = False
        self._room = asyncio.Lock()  # one load makes room at a time
        self._changed = asyncio.Event()  # a lease ended, a model unloaded or failed
        if self.single:
            model = self._add(ModelEntry(config.model.served_model_name(), None), None)
            model.pinned = True
        else:
            for entry in config.registry.models:
                self._add(entry, entry.path)
            self._scan()
            missing = [m.name for m in self.models.values() if m.pending is not None]
            if missing:
                raise ConfigError(
                    f"{config.label('models')}: no model file for {', '.join(missing)}: give "
                    f"each `model = PATH`, or put NAME.gguf in {config.label('models_dir')}"
                )
        unknown = [n for n in config.registry.preload if n not in self.models]
        if unknown:
            raise ConfigError(
                f"{config.label('preload')}: {', '.join(map(repr, unknown))} not served "
                f"(served: {', '.join(self.models)})"
            )

    def _add(self, entry: ModelEntry, path: Path | None) -> ServedModel:
        if self.single:
            config, segments = self.config, SINGLE
        else:
            # A table without a path is completed by the directory's NAME.gguf (`_scan`).
            config = self.config.for_model(entry, path) if path is not None else self.config
            segments = f"m{len(self.models) + 1}-{_UNSAFE.sub('_', entry.name)[:48]}"
        pending = entry if path is None and not self.single else None
        model = self.models[entry.name] = ServedModel(entry.name, config, segments, pending)
        return model

    def _scan(self) -> None:
        """Add the *.gguf files of models_dir not served yet, each named by its stem."""
        directory = self.config.registry.models_dir
        if directory is None:
            return
        try:
            files = sorted(directory.glob("*.gguf"))
        except OSError as exc:
            log.warning("models_dir %s cannot be listed: %s", directory, exc)
            return
        for path in files:
            name = path.name.removesuffix(".gguf")
            model = self.models.get(name)
            if model is not None and model.pending is not None:  # its table's file
                model.config = self.config.for_model(model.pending, path)
                model.pending = None
            elif model is None:
                try:
                    self._add(ModelEntry(name, path), path)
                except ConfigError as exc:  # a name the options refuse: not served
                    log.warning("models_dir: %s not served: %s", path.name, exc)

    # -- the HTTP side (api.catalog.Catalog) -----------------------------------------------

    @property
    def several(self) -> bool:
        return not self.single

    def names(self) -> list[str]:
        self._scan()
        return list(self.models)

    def context_bound(self) -> int | None:
        contexts = [m.context for m in self.models.values()]
        return None if None in contexts else max(c for c in contexts if c is not None)

    @contextlib.asynccontextmanager
    async def lease(self, name: str | None) -> AsyncIterator[Served]:
        model = self._resolve(name)
        model.leases += 1
        model.used()
        try:
            await self._ready(model)
            yield model.served()
        finally:
            model.leases -= 1
            model.used()
            self._changed.set()

    def _resolve(self, name: str | None) -> ServedModel:
        if name is None:
            if len(self.models) == 1:
                return next(iter(self.models.values()))
            raise APIError(
                400,
                f"model is required: this server serves {', '.join(map(repr, self.models))}",
                param="model",
            )
        model = self.models.get(name)
        if model is None:
            self._scan()  # a file put in models_dir since
            model = self.models.get(name)
        if model is None:
            raise unknown_model(name, list(self.models))
        return model

    async def _ready(self, model: ServedModel) -> Engine:
        """The model's engine, once it is loaded (the module docstring: the load queue)."""
        if self.draining:
            raise Unavailable("luced is draining; try again later", retry_after=1.0)
        if model.state == READY and model.engine is not None:
            return model.engine
        bound, timeout = model.config.scheduler.max_queue, model.config.registry.model_load_timeout
        if model.waiting >= bound:
            raise _loading(
                model,
                "load_queue",
                f"{model.waiting} requests wait for it already (max_queue {bound})",
            )
        model.waiting += 1
        try:
            done, _ = await asyncio.wait({self._start_load(model)}, timeout=timeout)
        finally:
            model.waiting -= 1
        if not done:
            label = model.config.label("model_load_timeout")
            raise _loading(model, "load_timeout", f"it did not load within {timeout:g} s ({label})")
        if model.state != READY or model.engine is None:
            why = model.error or ("luced is draining" if self.draining else model.state)
            raise APIError(
                503, f"model {model.name!r} could not be loaded: {why}", code="model_load_failed"
            )
        return model.engine

    def cards(self) -> list[dict[str, Any]]:
        self._scan()
        return [
            model_card(m.name, self.started, m.context, state=m.describe())
            for m in self.models.values()
        ]

    def card(self, name: str) -> dict[str, Any]:
        model = self._resolve(name)
        return model_card(model.name, self.started, model.context, state=model.describe())

    def health(self) -> tuple[int, dict[str, Any]]:
        """200 while the daemon serves (each model loads on demand), with every model's
        state; 503 while preloads load or the daemon drains."""
        states = {m.name: m.describe() for m in self.models.values()}
        status = "draining" if self.draining else "loading" if self.preloading else "ok"
        return (200 if status == "ok" else 503), {"status": status, "models": states}

    def _last_used(self) -> ServedModel | None:
        ready = [m for m in self.models.values() if m.engine is not None]
        return max(ready, key=lambda m: m.last_used, default=None)

    def peek(self, name: str | None) -> Engine | None:
        model = self._resolve(name) if name is not None else self._last_used()
        return model.engine if model is not None else None

    def running(self) -> list[Served]:
        return [m.served() for m in self.models.values() if m.state == READY and m.loaded]

    async def about(self, name: str | None) -> About:
        model = self._resolve(name)
        if model.loaded is not None:
            spec = model.loaded.spec
            return About(spec.facts, template_source(spec.template), spec.context)
        if model.about is None:
            try:
                model.about = await asyncio.to_thread(describe, model.config)
            except Exception as exc:  # a file that is not a model, or is gone
                raise APIError(
                    503, f"model {model.name!r} cannot be read: {exc}", code="model_load_failed"
                ) from None
        return model.about

    def unload_when_idle(self, name: str) -> None:
        self._resolve(name).unload_asap = True

    def overview(self) -> dict[str, Any]:
        return {"models": self.rows()}

    def metrics_of(self, name: str | None) -> Metrics:
        model = self._resolve(name) if name is not None else self._last_used()
        return model.metrics if model is not None else self.metrics

    def refresh(self) -> None:
        for model in self.models.values():
            if model.state == READY and model.engine is not None:
                model.metrics.refresh(model.engine.status())

    def exposition(self) -> bytes:
        self.refresh()
        return merged_exposition(self.metrics, [m.metrics for m in self.models.values()])

    def rows(self) -> list[dict[str, Any]]:
        return [m.row() for m in self.models.values()]

    # -- loading ---------------------------------------------------------------------------

    def prepare_single(self) -> LoadedModel:
        """A daemon started with MODEL: its model's Target and Engine, before the HTTP side
        opens (its errors stop the start before the port is taken)."""
        model = self.only
        spec = read_spec(model.config)
        model.memory, model.context = spec.memory, spec.context
        model.loaded = LoadedModel.build(spec, self.owner, model.metrics, model.segments)
        model.state = LOADING
        return model.loaded

    async def start_single(self) -> None:
        model = self.only
        assert model.loaded is not None
        began = time.monotonic()
        await model.loaded.start()
        model.state, model.load_s = READY, round(time.monotonic() - began, 2)

    async def load(self, name: str) -> ServedModel:
        """Load model `name` if it is not (lucectl load, --preload); CommandError when it
        cannot be."""
        model = self.named(name)
        if self.draining:
            raise CommandError("luced is draining")
        if model.state != READY:
            await asyncio.wait({self._start_load(model)})
        if model.state != READY:
            raise CommandError(f"model {name!r} could not be loaded: {model.error}")
        model.used()
        return model

    def _start_load(self, model: ServedModel) -> asyncio.Task:
        if model.loading is None or model.loading.done():
            model.loading = asyncio.create_task(self._load(model), name=f"load {model.name}")
        return model.loading

    async def _load(self, model: ServedModel) -> None:
        if model.unloading is not None:
            await asyncio.wait({model.unloading})
        if model.state == READY:
            return
        model.state, model.error = LOADING, None
        began, loaded = time.monotonic(), None
        log.info("loading model %s (%s)", model.name, model.config.model.model_path())
        try:
            spec = await asyncio.to_thread(read_spec, model.config)
            model.memory, model.context = spec.memory, spec.context
            await self._make_room(model)
            loaded = model.loaded = LoadedModel.build(
                spec, self.owner, model.metrics, model.segments
            )
            await loaded.start()
        except BaseException as exc:
            model.state, model.loaded, model.reserved = FAILED, None, False
            model.error = str(exc) or type(exc).__name__
            if loaded is not None:
                with contextlib.suppress(Exception):
                    await loaded.close("the model failed to load")
            if isinstance(exc, asyncio.CancelledError):
                model.error = "the load was cancelled (luced is stopping)"
                raise
            log.error("model %s could not be loaded: %s", model.name, model.error)
        else:
            model.state, model.load_s = READY, round(time.monotonic() - began, 2)
            model.used()
            log.info("model %s loaded in %.1f s", model.name, model.load_s)
        finally:
            self._changed.set()

    async def _make_room(self, model: ServedModel) -> None:
        """Reserve the model's memory under the budget, unloading idle models (least
        recently used first); waits for busy ones to finish, up to model_load_timeout."""
        budget = self.config.registry.models_memory_budget
        label = self.config.label("models_memory_budget")
        if budget and model.memory > budget:
            raise StartupError(
                f"model {model.name!r} needs about {model.memory >> 20} MiB, more than "
                f"{label} ({budget >> 20} MiB)"
            )
        timeout = model.config.registry.model_load_timeout
        try:
            async with self._room, asyncio.timeout(timeout):
                while budget:
                    self._changed.clear()
                    held = [
                        Holder(m.name, m.memory, m.last_used, m.state == READY and not m.leases)
                        for m in self.models.values()
                        if m.reserved and m is not model
                    ]
                    plan = plan_room(held, model.memory, budget)
                    if plan == []:
                        break
                    if plan is None:  # the busy ones must finish first
                        await self._changed.wait()
                        continue
                    for name in plan:
                        log.info("unloading %s to make room for %s (%s)", name, model.name, label)
                        await self._begin_unload(self.models[name], "room")
                model.reserved = True
        except TimeoutError:
            busy = [m.name for m in self.models.values() if m.reserved and m.leases]
            raise StartupError(
                f"no room for model {model.name!r} under {label} within {timeout:g} s: "
                f"{', '.join(busy) or 'other models'} kept serving"
            ) from None

    # -- unloading -------------------------------------------------------------------------

    def _begin_unload(self, model: ServedModel, reason: str) -> asyncio.Task:
        """Unload a ready model: its state turns "unloading" now, so no lease takes it; the
        returned task stops it."""
        assert model.state == READY and model.loaded is not None
        model.state, model.unload_asap = UNLOADING, False
        loaded, model.loaded = model.loaded, None
        model.unloading = asyncio.create_task(
            self._finish_unload(model, loaded, reason), name=f"unload {model.name}"
        )
        return model.unloading

    async def _finish_unload(self, model: ServedModel, loaded: LoadedModel, reason: str) -> None:
        began = time.monotonic()
        try:
            await loaded.close(reason)
        except Exception:
            log.exception("model %s: unloading failed", model.name)
        finally:
            del loaded
            gc.collect()  # the segments' last numpy views: their mappings go with them
            model.metrics.refresh({})  # its gauges read 0 while it is unloaded
            model.state, model.reserved, model.unloading = UNLOADED, False, None
            self._changed.set()
        log.info("model %s unloaded in %.1f s", model.name, time.monotonic() - began)

    async def unload(self, name: str, force: bool = False) -> ServedModel:
        """lucectl unload: refused while requests hold the model, unless `force` (they end
        with an error)."""
        model = self.named(name)
        if model.pinned:
            raise CommandError(
                f"{name!r} is this daemon's only model (serve several with --model NAME=PATH "
                "or --models-dir to load and unload them)"
            )
        if model.state == LOADING:
            raise CommandError(f"{name!r} is loading; unload it once it is ready")
        if model.state == UNLOADING and model.unloading is not None:
            await asyncio.wait({model.unloading})
        if model.state != READY:
            return model
        if model.leases and not force:
            raise CommandError(
                f"{name!r} has {model.leases} request(s) running or queued; wait for them, "
                "or unload with --force to end them"
            )
        await self._begin_unload(model, f"the model {name!r} was unloaded (lucectl unload)")
        return model

    @property
    def only(self) -> ServedModel:
        """The one model of a registry that serves one (ValueError otherwise)."""
        (model,) = self.models.values()
        return model

    def named(self, name: str) -> ServedModel:
        """The served model `name`; CommandError naming the served ones otherwise."""
        model = self.models.get(name)
        if model is None:
            self._scan()
            model = self.models.get(name)
        if model is None:
            raise CommandError(f"no model {name!r} (served: {', '.join(self.models)})")
        return model

    async def reap_idle(self) -> None:
        """Unload every model idle past its keep-alive; runs until cancelled."""
        while True:
            await asyncio.sleep(REAP_INTERVAL)
            now = time.monotonic()
            for model in list(self.models.values()):
                keep = model.config.registry.model_keep_alive
                idle = model.state == READY and not model.leases and not model.pinned
                expired = keep and now - model.last_used >= keep
                if idle and (expired or model.unload_asap):
                    log.info(
                        "unloading %s: idle %s",
                        model.name,
                        f"for {keep:g} s" if expired else "(asked)",
                    )
                    self._begin_unload(model, "idle")

    # -- the daemon's life -----------------------------------------------------------------

    async def preload(self) -> None:
        """Load --preload's models at start, one after the other; StartupError if one
        cannot be."""
        self.preloading = True
        try:
            for name in self.config.registry.preload:
                try:
                    await self.load(name)
                except CommandError as exc:
                    raise StartupError(f"{self.config.label('preload')}: {exc}") from None
        finally:
            self.preloading = False

    async def drain(self, timeout: float) -> bool:
        """Stop accepting (loads under way are abandoned); let what runs finish, up to
        `timeout`. True when everything finished."""
        self.draining = True
        for model in self.models.values():
            if model.loading is not None and not model.loading.done():
                model.loading.cancel()
        loaded = [m.loaded for m in self.models.values() if m.loaded is not None]
        results = await asyncio.gather(*(m.drain(timeout) for m in loaded))
        return all(results)

    async def close(self) -> None:
        """Stop every model: loads cancelled, engines and workers stopped."""
        for model in self.models.values():
            for task in (model.loading, model.unloading):
                if task is not None and not task.done():
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
            if model.loaded is not None:
                loaded, model.loaded = model.loaded, None
                with contextlib.suppress(Exception):
                    await loaded.close()
                model.state = UNLOADED
