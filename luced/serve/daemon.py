"""The daemon process: wires config, shared memory, the served models, HTTP and admin.

Start-up order with MODEL (one model; HTTP answers first, so /health says 503 "loading"
during the load):

    stale segments removed -> GGUF header, tokenizer, chat template, placement (daemon
    side) -> HTTP site + admin socket -> workers started and model loaded -> READY=1

With several models (--model NAME=PATH, --models-dir): HTTP site + admin socket ->
--preload's models loaded (/health 503 "loading" meanwhile) -> READY=1; every other
model loads on its first request, and unloads when idle (`serve.models`).

Shutdown (SIGTERM or SIGINT): stop accepting (health 503 "draining"), let running
streams finish for up to `shutdown_timeout`, end the rest with an error event, stop the
workers, unlink every shared-memory segment, exit 0. Segments are also unlinked on any
exception path and, as a last resort, at interpreter exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from luced.api.catalog import Catalog, SingleModel
from luced.api.server import Guard, make_app
from luced.engine.core import Engine
from luced.engine.executor import WorkerDied, WorkerReplyError
from luced.engine.watchdog import LoopWatchdog
from luced.ipc.shm import ShmOwner, cleanup_stale
from luced.serve import sdnotify
from luced.serve.admin import (
    AdminSocketError,
    CommandError,
    arg_bool,
    arg_str,
    start_admin_server,
)
from luced.serve.config import Config, ConfigError
from luced.serve.listener import listen
from luced.serve.loader import StartupError
from luced.serve.models import ModelRegistry
from luced.serve.prefix_setup import snapshot_handlers

__all__ = ["Daemon", "StartupError", "run"]

log = logging.getLogger("luced")

GIL_SWITCH_S = 0.001


async def worker_rows(engine: Engine) -> list[dict]:
    """`Engine.workers`' rows, each pipeline worker's with its process's counters under
    "stats" (`Target.stats`: forwards, tokens, decode-graph steps, steps decoded ahead,
    ...); none while one of them is starting, restarting or gone."""
    rows = engine.workers()
    if not rows:
        return rows
    try:
        stats = (await engine.target.stats())["workers"]
    except (WorkerDied, WorkerReplyError) as exc:  # not ready, or it went while we asked
        log.info("worker counters unavailable: %s", exc)
        return rows
    by_pid = {s.get("pid"): s for s in stats}
    return [{**r, "stats": by_pid[r["pid"]]} if r.get("pid") in by_pid else r for r in rows]


class Daemon:
    def __init__(self, config: Config) -> None:
        self.config = config
        # The workers read their kernels from the environment they inherit
        # (`runtime.native_build.kernel_choice`), so a flag or config-file value reaches them.
        os.environ["LUCED_KERNELS"] = config.model.kernels
        self.stopping = asyncio.Event()
        self.owner = ShmOwner()
        self.registry: ModelRegistry | None = None
        self.catalog: Catalog | None = None  # what the HTTP side serves
        self.started = time.time()

    async def run(self) -> int:
        removed = cleanup_stale()
        if removed:
            log.warning("removed %d stale shared-memory segment(s): %s", len(removed), removed)
        self.owner.install_atexit()
        log.info("shared memory instance %s", self.owner.instance)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stopping.set)
        try:
            return await self._serve()
        finally:
            self.owner.unlink_all()

    async def _serve(self) -> int:
        cfg = self.config
        registry = self.registry = ModelRegistry(cfg, self.owner)
        catalog: Catalog = registry
        lag = registry.metrics
        if registry.single:
            (model,) = registry.models.values()
            sdnotify.status(f"reading {Path(model.config.model.model_path()).name}")
            # The model's Target and Engine (no worker yet) before the port and the admin
            # socket: a bad option or a taken cache directory stops the start here.
            loaded = registry.prepare_single()
            spec = loaded.spec
            catalog = SingleModel(loaded.engine, model.metrics, spec.facts, spec.fingerprint)
            lag = model.metrics
        try:
            runner, admin = await self._open(catalog)
        except BaseException:
            await registry.close()
            raise
        watchdog = LoopWatchdog(lambda seconds: lag.observe("loop_lag", seconds))
        watchdog.start()
        reaper = asyncio.create_task(registry.reap_idle(), name="keep-alive")
        http = cfg.http
        try:
            sdnotify.status("loading")
            start = registry.start_single() if registry.single else registry.preload()
            load = asyncio.create_task(start)
            stop = asyncio.create_task(self.stopping.wait())
            await asyncio.wait({load, stop}, return_when=asyncio.FIRST_COMPLETED)
            if not load.done():  # asked to stop while loading
                load.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await load
            else:
                load.result()
                served = ", ".join(registry.models)
                sdnotify.ready(f"serving {served} on {http.host}:{http.port}")
                await self.stopping.wait()
            sdnotify.stopping()
            log.info("draining (up to %.0f s)", http.shutdown_timeout)
            if not await registry.drain(http.shutdown_timeout):
                log.warning("shutdown timeout: aborting the remaining requests")
        finally:
            reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reaper
            await watchdog.stop()
            admin.close()
            with contextlib.suppress(Exception):
                await admin.wait_closed()
            await registry.close()  # pending disk writes land, workers stop
            await runner.cleanup()
        log.info("stopped")
        return 0

    async def _open(self, catalog: Catalog) -> tuple[Any, Any]:
        self.catalog = catalog
        """The HTTP site and the admin socket, each a one-line StartupError when taken."""
        http = self.config.http
        try:
            api_key = http.effective_api_key()
        except ConfigError as exc:
            raise StartupError(str(exc)) from exc
        guard = Guard(http.host, http.allowed_hosts, http.allowed_origins, http.metrics_public)
        app = make_app(catalog, api_key=api_key, guard=guard, body_timeout=http.http_timeout)
        try:
            runner = await listen(app, http)
        except OSError as exc:  # e.g. the port is taken: one line, no load
            # uvloop's text repeats the address; a bad host name has only its own text
            reason = os.strerror(exc.errno) if (exc.errno or 0) > 0 else str(exc)
            raise StartupError(
                f"cannot listen on {http.host}:{http.port}: {reason} (choose another with "
                "--port or --host, or stop what holds it)"
            ) from exc
        log.info("listening on http://%s:%d", http.host, http.port)
        path = self.config.daemon.admin_socket
        try:
            admin = await start_admin_server(path, self._admin_handlers())
        except AdminSocketError as exc:  # e.g. a second default instance: one line, no load
            await runner.cleanup()
            raise StartupError(f"{exc} (choose another with --admin-socket)") from exc
        return runner, admin

    # -- lucectl's verbs (serve.admin) -----------------------------------------------------

    def _engine(self, args: dict) -> Engine:
        """The engine a verb's `model` argument names (the only model when it names none)."""
        registry = self.registry
        assert registry is not None
        name = args.get("model")
        if name is None and len(registry.models) != 1:
            raise CommandError(f"name a model with --model (served: {', '.join(registry.models)})")
        model = registry.named(str(name)) if name is not None else registry.only
        if model.engine is None:
            raise CommandError(f"model {model.name!r} is {model.describe()}, not loaded")
        return model.engine

    def _admin_handlers(self) -> dict:
        registry = self.registry
        assert registry is not None
        several = not registry.single

        async def status(args: dict) -> dict:
            if several and args.get("model") is None:
                rows = registry.rows()
                return {
                    "state": registry.health()[1]["status"],
                    "uptime_s": round(time.time() - self.started, 1),
                    "queue": {
                        "running": sum(r["running"] for r in rows),
                        "waiting": sum(r["waiting"] for r in rows),
                    },
                    "models": rows,
                }
            return self._engine(args).status()

        async def workers(args: dict) -> dict:
            if several and args.get("model") is None:
                engines = [(m.name, m.engine) for m in registry.models.values() if m.engine]
                rows = [(n, await worker_rows(e)) for n, e in engines]
                return {"workers": [{"model": n, **w} for n, ws in rows for w in ws]}
            return {"workers": await worker_rows(self._engine(args))}

        async def metrics(_: dict) -> dict:
            # What GET /metrics serves, without the HTTP side's API key.
            assert self.catalog is not None
            return {"text": self.catalog.exposition().decode()}

        async def drain(_: dict) -> dict:
            # Same as SIGTERM: stop accepting, finish what runs, then exit 0.
            registry.draining = True
            for model in registry.models.values():
                if model.engine is not None:
                    model.engine.draining = True
            self.stopping.set()
            return {"state": "draining"}

        async def models(_: dict) -> dict:
            return {"models": registry.rows()}

        async def load(args: dict) -> dict:
            model = await registry.load(_name(args))
            return {"model": model.name, "state": model.describe(), "load_s": model.load_s}

        async def unload(args: dict) -> dict:
            model = await registry.unload(_name(args), force=arg_bool(args, "force"))
            return {"model": model.name, "state": model.describe()}

        return {
            "status": status,
            "workers": workers,
            "metrics": metrics,
            "drain": drain,
            "models": models,
            "load": load,
            "unload": unload,
            **snapshot_handlers(self._engine),
        }


def _name(args: dict) -> str:
    name = arg_str(args, "model")
    if not name:
        raise CommandError('give the model\'s name: {"model": NAME}')
    return name


def run(config: Config) -> int:
    import uvloop

    logging.basicConfig(
        level=getattr(logging, str(config.daemon.log_level).upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    # A thread preparing a large request runs Python; the event loop waits for the GIL
    # up to this long at each hand-over (5 ms by default, a few per /health answer).
    sys.setswitchinterval(GIL_SWITCH_S)
    return uvloop.run(Daemon(config).run())
