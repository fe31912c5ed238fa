"""The daemon process: wires config, shared memory, the worker, the engine, HTTP and admin.

Start-up order (HTTP answers first, so /health says 503 "loading" during the load):

    stale segments removed -> GGUF header, tokenizer, chat template (daemon side)
    -> HTTP site + admin socket -> worker started and model loaded -> READY=1

Shutdown (SIGTERM or SIGINT): stop accepting (health 503 "draining"), let running
streams finish for up to `shutdown_timeout`, end the rest with an error event, stop the
worker, unlink every shared-memory segment, exit 0. Segments are also unlinked on any
exception path and, as a last resort, at interpreter exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
from pathlib import Path

from luced.api.server import Guard, make_app
from luced.engine.core import Engine
from luced.engine.executor import Deadlines, WorkerDied, WorkerReplyError
from luced.engine.kv_budget import resolve_kv_pool
from luced.engine.kvflash.pager import PagerConfig
from luced.engine.kvflash.transport import (
    KVFlashSettings,
    model_bytes_per_token,
    pager_config,
    resolve_pool,
)
from luced.engine.metrics import Metrics
from luced.engine.remote import RemoteSettings
from luced.engine.target import Target, TargetPlacement
from luced.engine.watchdog import LoopWatchdog
from luced.gguf_file import GGUFFile
from luced.ipc.files import identify
from luced.ipc.frames import MoeCounts
from luced.ipc.shm import ShmOwner, cleanup_stale
from luced.ipc.tcp import KeyFileError, read_key
from luced.serve import routing_profile, sdnotify
from luced.serve.admin import AdminSocketError, start_admin_server
from luced.serve.config import Config, ConfigError
from luced.serve.listener import listen
from luced.serve.options import usable_cores
from luced.serve.prefix_setup import (
    DiskReservation,
    open_prefix_cache,
    reserve_disk_dir,
    snapshot_handlers,
)
from luced.text.chat_template import ChatTemplate
from luced.text.tokenizer import Tokenizer

log = logging.getLogger("luced")

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


class StartupError(RuntimeError):
    """Something the operator configured cannot be served (reported in one line)."""


class Daemon:
    def __init__(self, config: Config) -> None:
        self.config = config
        # The workers read their kernels from the environment they inherit
        # (`runtime.native_build.kernel_choice`), so a flag or config-file value reaches them.
        os.environ["LUCED_KERNELS"] = config.model.kernels
        self.stopping = asyncio.Event()
        self.owner = ShmOwner()
        self.engine: Engine | None = None
        self.target: Target | None = None
        self.template: ChatTemplate | None = None
        self.tokenizer: Tokenizer | None = None
        self.disk_reservation = DiskReservation()

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
        cfg, model = self.config, self.config.model
        model_path = str(model.model_path())
        gguf = GGUFFile(model_path)
        sdnotify.status(f"reading {Path(model_path).name}")
        tokenizer = Tokenizer.from_gguf(gguf)
        tokenizer.special_pattern  # noqa: B018 - built now (0.4 s for Gemma), not on a request
        template = ChatTemplate.from_gguf(gguf, gguf.arch)
        self.template, self.tokenizer = template, tokenizer
        n_layers = int(gguf.require(f"{gguf.arch}.block_count"))
        kv_sources = gguf.kv_sources()  # a layer split keeps these layers with their sources
        context = model.effective_context_length(int(gguf.require(f"{gguf.arch}.context_length")))
        running = self._max_running()
        kv_flash = self._kv_flash(gguf, context, running)
        moe_dims = (
            int(gguf.get(f"{gguf.arch}.embedding_length", 0)),
            int(gguf.get(f"{gguf.arch}.expert_used_count", 0)),
        )
        moe_profile = self._moe_profile(gguf)
        kv_pool = self._kv_pool(gguf, context, running)
        del gguf
        moe = cfg.moe
        if moe.moe_expert_device is not None:
            if moe.moe_hot_experts is None:
                raise StartupError(
                    f"{moe.label('moe_expert_device')}: every expert is hot; give "
                    f"{moe.label('moe_hot_experts')} a count so that some are cold"
                )
            if not moe_dims[1]:
                raise StartupError(f"{moe.label('moe_expert_device')}: the model has no experts")

        # Placement errors (bad devices, more shards than layers, a missing interpreter)
        # stop the start-up here, naming the flag, before any worker runs.
        placement = TargetPlacement.split(
            model=model_path,
            n_layers=n_layers,
            dtype=model.dtype,
            weights_mode=model.weights,
            batch_invariant=model.batch_invariant,
            kv_dtype=cfg.effective_kv_dtype(),
            # Several running requests hold their K/V in blocks of one pool per worker, so
            # one can start on another's prompt prefix; KV Flash pools each on its own.
            kv_block=cfg.kv.kv_block_size if running > 1 and kv_flash is None else 0,
            kv_capacity=context,
            max_batch_tokens=cfg.scheduler.max_batch_tokens,
            devices=model.target_devices,
            weights=model.target_layer_split or (),
            kv_sources=kv_sources,
            pythons={g: str(p) for g, p in model.backend_python},
            # Only one worker computes at a time, but idle workers' OpenMP threads still
            # contend: sharing the cores measured faster than every worker using all. The
            # daemon's own work (HTTP, detokenizing) is light beside the native kernels: on
            # 2 cores a 2-thread worker served 1.3x (one stream) to 1.45x (eight) the
            # tokens of a 1-thread one that left a core to the daemon (README, Performance).
            threads=model.threads,
            cores=usable_cores(),
            moe_hot=moe.moe_hot_experts,
            moe_expert_device=moe.moe_expert_device,
            moe_required=moe.moe_expert_required,
            moe_dims=moe_dims,
            moe_profile=moe_profile,
        )
        # Exclusive resources before the slow load: the cache directory's lock here, the
        # port and the admin socket below, each a one-line StartupError when taken.
        try:
            self.disk_reservation = reserve_disk_dir(cfg.kv, model_path)
        except ValueError as exc:
            raise StartupError(str(exc)) from exc
        metrics = Metrics(model.served_model_name())  # vLLM's model_name label
        deadlines = Deadlines(call=cfg.daemon.worker_timeout, start=cfg.daemon.worker_start_timeout)
        sched = cfg.scheduler
        step = sched.max_step_tokens or (
            sched.max_batch_tokens + running * cfg.speculation.block_size
        )
        self.target = Target(
            self.owner,
            placement,
            kv_flash=kv_flash,
            deadlines=deadlines,
            sequences=running,
            step_tokens=max(step, sched.max_batch_tokens + running),
            remote=await self._remote_settings(model_path),
        )
        self.engine = engine = Engine(
            self.target,
            tokenizer,
            template,
            model_name=model.served_model_name(),
            context_length=context,
            max_queue=cfg.scheduler.max_queue,
            max_queued_tokens=cfg.scheduler.max_queued_tokens,
            default_max_tokens=cfg.scheduler.default_max_tokens,
            block_size=cfg.speculation.block_size,
            lookup_drafts=cfg.speculation.lookup_drafts,
            adaptive_blocks=cfg.speculation.adaptive_block_size,
            metrics=metrics,
            max_running=running,
            kv_pool_tokens=kv_pool,
        )
        http = cfg.http
        try:
            api_key = http.effective_api_key()
        except ConfigError as exc:
            raise StartupError(str(exc)) from exc
        guard = Guard(http.host, http.allowed_hosts, http.allowed_origins, http.metrics_public)
        app = make_app(
            engine, metrics, api_key=api_key, guard=guard, body_timeout=http.http_timeout
        )
        try:
            runner = await listen(app, http)
        except OSError as exc:  # e.g. the port is taken: one line, no load
            self.disk_reservation.release()
            # uvloop's text repeats the address; a bad host name has only its own text
            reason = os.strerror(exc.errno) if (exc.errno or 0) > 0 else str(exc)
            raise StartupError(
                f"cannot listen on {http.host}:{http.port}: {reason} (choose another with "
                "--port or --host, or stop what holds it)"
            ) from exc
        log.info("listening on http://%s:%d", http.host, http.port)
        try:
            admin = await start_admin_server(cfg.daemon.admin_socket, self._admin_handlers())
        except AdminSocketError as exc:  # e.g. a second default instance: one line, no load
            await runner.cleanup()
            self.disk_reservation.release()
            raise StartupError(f"{exc} (choose another with --admin-socket)") from exc
        watchdog = LoopWatchdog(lambda lag: metrics.observe("loop_lag", lag))
        watchdog.start()
        try:
            sdnotify.status(f"loading {Path(model_path).name}")
            load = asyncio.create_task(self._start_model())
            stop = asyncio.create_task(self.stopping.wait())
            await asyncio.wait({load, stop}, return_when=asyncio.FIRST_COMPLETED)
            if not load.done():  # asked to stop while loading
                load.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await load
            else:
                load.result()
                engine.start()
                log.info("ready: %s (%d layers, context %d)", engine.model_name, n_layers, context)
                for shard in self.target.describe():
                    layers = shard["layers"]
                    share = (
                        layers if isinstance(layers, str) else f"layers [{layers[0]}, {layers[1]})"
                    )
                    log.info(
                        "worker %s %s %s pid %s",
                        shard["group"],
                        shard["devices"][0],
                        share,
                        shard["pid"],
                    )
                sdnotify.ready(f"serving {engine.model_name} on {http.host}:{http.port}")
                await self.stopping.wait()
            sdnotify.stopping()
            log.info("draining (up to %.0f s)", http.shutdown_timeout)
            if not await engine.drain(http.shutdown_timeout):
                log.warning("shutdown timeout: aborting the remaining requests")
            await engine.stop()
        finally:
            await watchdog.stop()
            admin.close()
            with contextlib.suppress(Exception):
                await admin.wait_closed()
            if engine.prefix_cache is not None:  # pending disk writes land first
                await engine.prefix_cache.close()
            await self.target.close()
            await runner.cleanup()
            self.disk_reservation.release()
        log.info("stopped")
        return 0

    async def _remote_settings(self, model_path: str) -> RemoteSettings | None:
        """The key and the model files' identities for workers on other hosts (None when
        every worker is local). Hashing reads each file once (about 1 GB/s)."""
        cfg = self.config
        remote = cfg.remote_devices()
        if not remote:
            return None
        assert cfg.daemon.worker_key_file is not None  # Config checked it
        try:
            key = read_key(cfg.daemon.worker_key_file)
        except KeyFileError as exc:
            raise StartupError(f"{cfg.daemon.label('worker_key_file')}: {exc}") from None
        paths = [model_path]
        draft = cfg.speculation.draft
        if draft is not None and not cfg.speculation.lookup_drafts:
            paths.append(str(draft))
        sdnotify.status("hashing the model files for the workers on other hosts")
        log.info("workers on other hosts: %s; hashing %s", ", ".join(remote), ", ".join(paths))
        files = {p: await asyncio.to_thread(identify, p) for p in paths}
        return RemoteSettings(key=key, files=files)

    def _moe_profile(self, gguf: GGUFFile) -> MoeCounts:
        """--moe-routing-profile's counts, checked against the model; () without one."""
        moe = self.config.moe
        if moe.moe_routing_profile is None:
            return ()
        label = moe.label("moe_routing_profile")
        if moe.moe_hot_experts is None:
            raise StartupError(
                f"{label}: every expert is hot; give {moe.label('moe_hot_experts')} a count "
                "so that the profile chooses them"
            )
        try:
            return routing_profile.load(moe.moe_routing_profile, gguf).to_wire()
        except routing_profile.ProfileError as exc:
            raise StartupError(f"{label}: {exc}") from None

    def _max_running(self) -> int:
        """--max-running (logged)."""
        running = self.config.scheduler.max_running
        if running > 1:
            log.info("continuous batching: up to %d requests at once", running)
        return running

    def _kv_pool(self, gguf: GGUFFile, context: int, running: int) -> int:
        """--kv-pool-tokens resolved (auto: from the free memory), logged."""
        cfg = self.config
        per_token = model_bytes_per_token(gguf, DTYPE_BYTES[cfg.effective_kv_dtype()])
        try:
            pool = resolve_kv_pool(cfg.kv.kv_pool_tokens, running, context, per_token)
        except ValueError as exc:
            raise StartupError(f"{cfg.kv.label('kv_pool_tokens')}: {exc}") from exc
        if running > 1:
            log.info(
                "KV pool: %d positions for %d running requests (%d MiB at %d KiB a position)",
                pool,
                running,
                pool * per_token >> 20,
                per_token >> 10,
            )
        return pool

    def _kv_flash(self, gguf: GGUFFile, context: int, running: int) -> PagerConfig | None:
        """The KV Flash pager's config (--kv-flash), or None when it is off. Each of the
        `running` sequences has a pool of its own: `auto` shares the memory among them."""
        cfg, kv = self.config, self.config.kv
        if kv.kv_flash is None:
            return None
        settings = KVFlashSettings(
            kv.kv_flash, kv.kv_flash_policy, kv.kv_flash_tau, kv.kv_flash_max_pool
        )
        per_token = model_bytes_per_token(gguf, DTYPE_BYTES[cfg.effective_kv_dtype()])
        pool = resolve_pool(settings, context, per_token * running)
        try:
            pager = pager_config(settings, pool, gguf)
        except ValueError as exc:  # PoolTooSmall: the sinks, tail and window need more
            raise StartupError(f"{kv.label('kv_flash')}: {exc}") from exc
        log.info(
            "KV Flash: a pool of %d tokens (%s) per running request, policy %s, %d KiB of "
            "K/V per token",
            pool,
            kv.kv_flash,
            kv.kv_flash_policy,
            per_token // 1024,
        )
        return pager

    async def _start_model(self) -> None:
        assert self.target is not None
        try:
            await self.target.start()
        except (WorkerDied, WorkerReplyError) as exc:  # the worker's log lines say more
            raise StartupError(f"loading the model: {exc}") from exc
        spec = self.config.speculation
        draft = spec.draft
        if spec.lookup_drafts:
            self.target.enable_lookup_drafts(spec.block_size)
            log.info("draft: n-gram prompt lookup, block size %d", spec.block_size)
        elif draft is not None:
            try:
                reply = await self.target.load_draft(
                    str(draft),
                    device=spec.draft_device,
                    block_size=spec.block_size,
                    python=self.config.draft_python(),
                )
            except (WorkerDied, WorkerReplyError, ValueError) as exc:
                raise StartupError(f"--draft {draft}: {exc}") from exc
            log.info(
                "draft %s: captures target layers %s, block size %d",
                draft.name,
                list(reply.capture_layers),
                spec.block_size,
            )
        assert self.engine is not None
        if draft is not None and spec.adaptive_block_size:
            costs = await self.engine.calibrate()
            log.info(
                "adaptive block size: step costs %s ms",
                {n: round(s * 1e3, 2) for n, s in costs.items()},
            )
        try:
            self.engine.prefix_cache = await open_prefix_cache(
                self.config.kv,
                self.config.model.dtype,
                self.target,
                self.owner,
                str(self.config.model.model_path()),
                self.template,
                self.disk_reservation,
            )
        except ValueError as exc:
            raise StartupError(str(exc)) from exc

    def _admin_handlers(self) -> dict:
        async def status(_: dict) -> dict:
            return self.engine.status()

        async def workers(_: dict) -> dict:
            return {"workers": self.engine.workers()}

        async def drain(_: dict) -> dict:
            # Same as SIGTERM: stop accepting, finish what runs, then exit 0.
            self.engine.draining = True
            self.stopping.set()
            return {"state": self.engine.state}

        assert self.tokenizer is not None
        return {
            "status": status,
            "workers": workers,
            "drain": drain,
            **snapshot_handlers(lambda: self.engine.prefix_cache, self.tokenizer),
        }


def run(config: Config) -> int:
    import uvloop

    logging.basicConfig(
        level=getattr(logging, str(config.daemon.log_level).upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    return uvloop.run(Daemon(config).run())
