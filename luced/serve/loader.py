"""One model's daemon side: from its config to a serving Engine, and back to nothing.

    spec = read_spec(cfg)                  # the GGUF's header, tokenizer, template, sizes and
                                           # the placement: checks, no worker (a thread may run it)
    model = LoadedModel.build(spec, owner, metrics, name)   # Target + Engine, disk tier locked
    await model.start()                    # workers, draft, calibration, prefix cache, the loop
    await model.close("why")               # requests end, workers stop, segments unlinked

Every shared-memory segment of the model is named ``<name>-...`` (the Target's, its KV
Flash pagers' and feature rings', the prefix cache's arena where it keeps snapshots), so
``close`` unlinks exactly them (`ShmOwner.release`); a daemon serving one model keeps the
historical names (``target-io``, ``prefix-arena``) and never closes it before it exits.

``StartupError`` is a problem the operator configured, reported in one line naming the
option: at start it stops the daemon; for a model loaded on demand its requests get it.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from luced.api.catalog import About, template_source
from luced.api.ollama_models import ModelFacts
from luced.engine.core import Engine
from luced.engine.executor import Deadlines, WorkerDied, WorkerReplyError
from luced.engine.kv.budget import resolve_kv_pool
from luced.engine.kv.pager import PagerConfig
from luced.engine.kvflash.transport import (
    KVFlashSettings,
    model_bytes_per_token,
    pager_config,
    resolve_pool,
)
from luced.engine.metrics import Metrics
from luced.engine.pooling import declared_pooling, is_encoder
from luced.engine.remote import RemoteSettings
from luced.engine.target import Target, TargetPlacement
from luced.gguf_file import GGUFFile
from luced.ipc.files import identify
from luced.ipc.frames import MoeCounts
from luced.ipc.shm import ShmOwner
from luced.ipc.tcp import KeyFileError, read_key
from luced.serve import routing_profile, sdnotify
from luced.serve.config import Config
from luced.serve.options import usable_cores
from luced.serve.prefix_setup import (
    DiskReservation,
    model_fingerprint,
    open_prefix_cache,
    reserve_disk_dir,
)
from luced.text.chat_template import ChatTemplate
from luced.text.tokenizer import Tokenizer

log = logging.getLogger("luced")

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
SINGLE = "target"  # the segment name prefix of a daemon's only model


class StartupError(RuntimeError):
    """Something the operator configured cannot be served (reported in one line)."""


@dataclass(frozen=True)
class ModelSpec:
    """What a model's GGUF and options make of it before any worker runs."""

    config: Config
    path: str
    tokenizer: Tokenizer
    template: ChatTemplate | None  # None: an encoder's (it serves embeddings only)
    n_layers: int
    context: int
    running: int
    kv_pool: int  # positions the running requests hold together
    kv_flash: PagerConfig | None
    placement: TargetPlacement
    memory: int  # bytes, estimated: the file, the KV, the prefix cache's memory, the draft
    facts: ModelFacts  # what Ollama's /api/tags, /api/show list
    fingerprint: str  # OpenAI's system_fingerprint of its replies
    remote: RemoteSettings | None  # the key and file identities for workers on other hosts
    encoder: bool = False  # bidirectional attention (BERT): embeddings only
    pooling: str = "mean"  # how the APIs pool its embeddings (engine/pooling.py)

    @property
    def name(self) -> str:
        return self.config.model.served_model_name()

    @property
    def block_store(self) -> bool:
        """Whether the prefix cache keeps K/V blocks by prefix key (engine/kv/block_store.py:
        in host records, and on disk with --kv-cache-dir; a draft's feature-ring rows
        beside them; a worker on another host's part on its host) rather than snapshots
        (the arena, a file per prompt): for requests whose K/V lives in blocks of one pool
        (--kv-block-size's, or KV Flash's). A hybrid's recurrent states go beside its
        blocks (engine/kv/state_store.py); a hybrid with a worker on another host turns out
        to keep snapshots once loaded (`Target.store_records`)."""
        kv = self.config.kv
        return kv.prefix_cache_bytes > 0 and self.placement.kv_block > 0 and not self.encoder


def read_spec(cfg: Config) -> ModelSpec:
    """Read the model's GGUF and check its options against it (StartupError naming the
    option, ConfigError, GGUFError, PlacementError); starts nothing."""
    model = cfg.model
    path = str(model.model_path())
    gguf = GGUFFile(path)
    tokenizer = Tokenizer.from_gguf(gguf)
    tokenizer.special_pattern  # noqa: B018 - built now (slow for Gemma), not on a request
    template = _template(gguf)
    n_layers = int(gguf.require(f"{gguf.arch}.block_count"))
    context = model.effective_context_length(int(gguf.require(f"{gguf.arch}.context_length")))
    running = cfg.scheduler.max_running
    per_token = model_bytes_per_token(gguf, DTYPE_BYTES[cfg.effective_kv_dtype()])
    kv_flash = _kv_flash(cfg, gguf, context, running, per_token)
    kv_pool = _kv_pool(cfg, context, running, per_token)
    moe_dims = (
        int(gguf.get(f"{gguf.arch}.embedding_length", 0)),
        int(gguf.get(f"{gguf.arch}.expert_used_count", 0)),
    )
    moe, moe_profile = cfg.moe, _moe_profile(cfg, gguf)
    kv_sources = gguf.kv_sources()  # a layer split keeps these layers with their sources
    facts = ModelFacts.from_gguf(gguf)
    encoder = is_encoder(gguf)
    pooling = model.pooling if model.pooling != "auto" else declared_pooling(gguf) or "mean"
    log.info(
        "%s embeddings: %s pooling%s",
        model.served_model_name(),
        pooling,
        "; an encoder: embeddings only" if encoder else "",
    )
    del gguf
    if moe.moe_expert_device is not None:
        if moe.moe_hot_experts is None:
            raise StartupError(
                f"{moe.label('moe_expert_device')}: every expert is hot; give "
                f"{moe.label('moe_hot_experts')} a count so that some are cold"
            )
        if not moe_dims[1]:
            raise StartupError(f"{moe.label('moe_expert_device')}: the model has no experts")
    # Placement errors (bad devices, more shards than layers, a missing interpreter)
    # stop here, naming the flag, before any worker runs.
    placement = TargetPlacement.split(
        model=path,
        n_layers=n_layers,
        dtype=model.dtype,
        weights_mode=model.weights,
        batch_invariant=model.batch_invariant,
        decode_graphs=model.decode_graphs,
        kv_dtype=cfg.effective_kv_dtype(),
        # Several running requests hold their K/V in blocks of one pool per worker, so
        # one can start on another's prompt prefix; KV Flash pages those blocks.
        kv_block=_kv_block(cfg, kv_flash),
        kv_capacity=context,
        max_batch_tokens=cfg.scheduler.max_batch_tokens,
        devices=model.target_devices,
        weights=model.target_layer_split or (),
        kv_sources=kv_sources,
        pythons={g: str(p) for g, p in model.backend_python},
        # Only one worker computes at a time, but idle workers' OpenMP threads still
        # contend: sharing the cores measured faster than every worker using all. The
        # daemon's own work (HTTP, detokenizing) is light beside the native kernels: a
        # worker on every core served more tokens than one that left a core to the
        # daemon (docs/performance.md).
        threads=model.threads,
        cores=usable_cores(),
        moe_hot=moe.moe_hot_experts,
        moe_expert_device=moe.moe_expert_device,
        moe_required=moe.moe_expert_required,
        moe_dims=moe_dims,
        moe_profile=moe_profile,
    )
    kv_rows = kv_flash.pool_tokens * running if kv_flash is not None else kv_pool
    draft = cfg.speculation.draft
    memory = (
        Path(path).stat().st_size
        + kv_rows * per_token
        + cfg.kv.prefix_cache_bytes
        + (_size(draft) if draft is not None and not cfg.speculation.lookup_drafts else 0)
    )
    return ModelSpec(
        cfg, path, tokenizer, template, n_layers, context, running, kv_pool, kv_flash,
        placement, memory, facts, system_fingerprint(cfg, path), _remote(cfg, path), encoder,
        pooling,
    )  # fmt: skip


def _remote(cfg: Config, path: str) -> RemoteSettings | None:
    """The key and the model files' identities for workers on other hosts (None when every
    worker is local). Hashing reads each file once (about 1 GB/s)."""
    remote = cfg.remote_devices()
    if not remote:
        return None
    assert cfg.daemon.worker_key_file is not None  # Config checked it
    try:
        key = read_key(cfg.daemon.worker_key_file)
    except KeyFileError as exc:
        raise StartupError(f"{cfg.daemon.label('worker_key_file')}: {exc}") from None
    paths = [path]
    draft = cfg.speculation.draft
    if draft is not None and not cfg.speculation.lookup_drafts:
        paths.append(str(draft))
    sdnotify.status("hashing the model files for the workers on other hosts")
    log.info("workers on other hosts: %s; hashing %s", ", ".join(remote), ", ".join(paths))
    return RemoteSettings(key=key, files={p: identify(p) for p in paths})


def describe(cfg: Config) -> About:
    """The model as Ollama's /api/show describes it, read from its GGUF's header alone."""
    gguf = GGUFFile(str(cfg.model.model_path()))
    template = _template(gguf)
    context = cfg.model.effective_context_length(int(gguf.require(f"{gguf.arch}.context_length")))
    return About(ModelFacts.from_gguf(gguf), template_source(template), context)


def _template(gguf: GGUFFile) -> ChatTemplate | None:
    """The chat template; an encoder generates nothing: none is needed (nor usually present)."""
    return None if is_encoder(gguf) else ChatTemplate.from_gguf(gguf, gguf.arch)


def system_fingerprint(cfg: Config, model_path: str) -> str:
    """OpenAI's `system_fingerprint`: `luced-<version>-<hash>`, the hash over the model
    file and the options that change its numbers, so a client sees when the same request
    may give other tokens."""
    try:
        build = version("luced")
    except PackageNotFoundError:  # run from a source tree that was never installed
        build = "dev"
    m = cfg.model
    numbers = (model_fingerprint(model_path), m.weights, m.dtype, cfg.effective_kv_dtype())
    identity = "/".join([*numbers, str(m.batch_invariant)])
    return f"luced-{build}-{hashlib.sha256(identity.encode()).hexdigest()[:10]}"


def _size(path: Path) -> int:
    """A draft's bytes: its file, or the files of its directory."""
    if path.is_dir():
        return sum(p.stat().st_size for p in path.iterdir() if p.is_file())
    return path.stat().st_size if path.exists() else 0


def _moe_profile(cfg: Config, gguf: GGUFFile) -> MoeCounts:
    """--moe-routing-profile's counts, checked against the model; () without one."""
    moe = cfg.moe
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


def _kv_pool(cfg: Config, context: int, running: int, per_token: int) -> int:
    """--kv-pool-tokens resolved (auto: from the free memory), logged."""
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


def _kv_block(cfg: Config, kv_flash: PagerConfig | None) -> int:
    """Rows per block of the workers' K/V pools: KV Flash's block (the unit it pages),
    else --kv-block-size (0: one contiguous cache per sequence). One running request
    keeps its K/V in the pool too, so that the prefix cache keeps blocks for it."""
    if kv_flash is not None:
        return kv_flash.block
    return cfg.kv.kv_block_size


def _kv_flash(
    cfg: Config, gguf: GGUFFile, context: int, running: int, per_token: int
) -> PagerConfig | None:
    """The KV Flash pager's config (--kv-flash), or None when it is off. Each of the
    `running` sequences keeps at most its pool resident: `auto` shares the memory among
    them."""
    kv = cfg.kv
    if kv.kv_flash is None:
        return None
    settings = KVFlashSettings(
        kv.kv_flash, kv.kv_flash_policy, kv.kv_flash_tau, kv.kv_flash_max_pool
    )
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


class LoadedModel:
    """A model's Target and Engine in the daemon (the module docstring)."""

    def __init__(
        self,
        spec: ModelSpec,
        owner: ShmOwner,
        target: Target,
        engine: Engine,
        reservation: DiskReservation,
        name: str,
    ) -> None:
        self.spec, self.owner, self.name = spec, owner, name
        self.target, self.engine, self.reservation = target, engine, reservation

    @classmethod
    def build(cls, spec: ModelSpec, owner: ShmOwner, metrics: Metrics, name: str) -> LoadedModel:
        """The model's Target and Engine, no worker started yet. Its disk tier's directory is
        locked first, so that a second daemon on it is refused before the slow load."""
        cfg = spec.config
        try:
            reservation = reserve_disk_dir(cfg.kv, spec.path)
        except ValueError as exc:
            raise StartupError(str(exc)) from exc
        try:
            target, engine = cls._make(spec, owner, metrics, name)
        except ValueError as exc:  # e.g. a step too small for the running requests
            reservation.release()
            raise StartupError(str(exc)) from exc
        return cls(spec, owner, target, engine, reservation, name)

    @staticmethod
    def _make(
        spec: ModelSpec, owner: ShmOwner, metrics: Metrics, name: str
    ) -> tuple[Target, Engine]:
        cfg = spec.config
        deadlines = Deadlines(call=cfg.daemon.worker_timeout, start=cfg.daemon.worker_start_timeout)
        sched, running = cfg.scheduler, spec.running
        step = sched.max_step_tokens or (
            sched.max_batch_tokens + running * cfg.speculation.block_size
        )
        target = Target(
            owner,
            spec.placement,
            name=name,
            kv_flash=spec.kv_flash,
            deadlines=deadlines,
            sequences=running,
            step_tokens=max(step, sched.max_batch_tokens + running),
            remote=spec.remote,
        )
        engine = Engine(
            target,
            spec.tokenizer,
            spec.template,
            model=cfg.model.for_engine(spec.context, spec.encoder, spec.pooling),
            limits=sched.for_engine(),
            kv=cfg.kv.for_engine(spec.context, spec.kv_pool, spec.block_store),
            speculation=cfg.speculation.for_engine(),
            metrics=metrics,
        )
        engine.runner.decode_ahead = sched.decode_ahead
        return target, engine

    async def start(self) -> None:
        """Start and load the workers, then the draft, the adaptive block size's costs and
        the prefix cache; then the engine's loop (its state turns "ready")."""
        try:
            await self.target.start()
        except (WorkerDied, WorkerReplyError) as exc:  # the worker's log lines say more
            raise StartupError(f"loading the model: {exc}") from exc
        cfg = self.spec.config
        spec = cfg.speculation
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
                    python=cfg.draft_python(),
                )
            except (WorkerDied, WorkerReplyError, ValueError) as exc:
                raise StartupError(f"--draft {draft}: {exc}") from exc
            log.info(
                "draft %s: captures target layers %s, block size %d",
                draft.name,
                list(reply.capture_layers),
                spec.block_size,
            )
        if draft is not None and spec.adaptive_block_size:
            costs = await self.engine.calibrate()
            log.info(
                "adaptive block size: step costs %s ms",
                {n: round(s * 1e3, 2) for n, s in costs.items()},
            )
        arena = "prefix-arena" if self.name == SINGLE else f"{self.name}-prefix-arena"
        try:
            self.engine.prefix_cache = await open_prefix_cache(
                cfg.kv,
                cfg.model.dtype,
                self.target,
                self.owner,
                self.spec.path,
                self.spec.template,
                self.reservation,
                arena=arena,
            )
        except ValueError as exc:
            raise StartupError(str(exc)) from exc
        self.engine.start()
        self._log_ready()

    def _log_ready(self) -> None:
        spec = self.spec
        log.info("ready: %s (%d layers, context %d)", spec.name, spec.n_layers, spec.context)
        for shard in self.target.describe():
            layers = shard["layers"]
            share = layers if isinstance(layers, str) else f"layers [{layers[0]}, {layers[1]})"
            log.info(
                "worker %s %s %s pid %s", shard["group"], shard["devices"][0], share, shard["pid"]
            )

    async def drain(self, timeout: float) -> bool:
        """Stop accepting; let what runs finish, up to `timeout`."""
        return await self.engine.drain(timeout)

    async def close(self, reason: str = "luced is shutting down") -> None:
        """End what is queued or running with `reason`, stop the loop and the workers, let
        pending disk writes land, release the disk tier, unlink the model's segments."""
        self.engine.draining = True  # a request that has not reached submit gets a 503
        await self.engine.stop(reason)
        try:
            if self.engine.prefix_cache is not None:  # pending disk writes land first
                await self.engine.prefix_cache.close()
            await self.target.close()
        finally:
            self.reservation.release()
            if self.name != SINGLE:  # the daemon unlinks everything as it exits
                self.owner.release(f"{self.name}-")
