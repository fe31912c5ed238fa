"""Daemon configuration: the option table's rows in typed groups, and the four ways in.

``Config`` holds one frozen group per concern, each built from its rows of
``serve.options.OPTIONS`` (which says each option's group, type, default and checks)::

    cfg.model        ModelOptions        the GGUF, dtype, weights, kernels, threads, placement
    cfg.registry     RegistryOptions     several served models: which, when loaded, budget
    cfg.scheduler    SchedulerOptions    queue and batch limits
    cfg.kv           KVOptions           K/V dtype and pool, prefix cache, KV Flash
    cfg.speculation  SpeculationOptions  draft, block size
    cfg.moe          MoEOptions          expert placement
    cfg.http         HTTPOptions         listener, API key, browser guard, shutdown
    cfg.daemon       DaemonOptions       worker deadlines, runtime dir, admin socket, log level

A component takes the group it needs (``listener.listen(app, cfg.http)``). Every value is
converted and validated by its row when its group is constructed, so a group is valid
wherever it travels; an error names the option and where the value came from
(``LUCED_PORT: not an integer: 'x'``, ``/etc/luced/luced.toml: port: ...``), and each
group keeps the sources of its own options for later errors (``cfg.kv.label(...)``).

The engine ranks below this package and takes groups of its own (``luced.engine.config``:
resolved values, not options); each option group builds the engine's with ``for_engine``,
from its options and what the model's GGUF resolved (the served context, the KV pool).

Precedence, per option: flags > ``LUCED_*`` environment > config file > defaults. The
config file is ``--config PATH``, else ``$LUCED_CONFIG``, else ``/etc/luced/luced.toml``
when it exists; its keys are the option names, top level (no tables per group), and
``[models.NAME]`` tables, one per served model, with its path and its own settings
(``Config.for_model``). A repeatable option (``backend_python``, ``models``) is replaced
as a whole by a higher layer, never merged. ``python -m luced.serve.config
markdown|toml`` prints the generated docs (``serve.config_docs``).
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys
import tomllib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, ClassVar, get_type_hints

from luced.engine.config import KVConfig, ModelInfo, SchedulingLimits, SpeculationConfig
from luced.engine.placement import parse_device, remote_address
from luced.serve.admission import Network
from luced.serve.options import (
    CONTEXT_CAP,
    GROUPS,
    OPTION_BY_NAME,
    OPTIONS,
    ConfigError,
    Env,
    ModelEntry,
    Option,
    Pairs,
)

DEFAULT_CONFIG_PATH = Path("/etc/luced/luced.toml")


@dataclass(frozen=True)
class Options:
    """An option group: its rows of OPTIONS as typed fields (in table order), converted
    and validated on construction. ``sources``: option name -> where its value came from
    ("--port", "LUCED_PORT", "FILE: port", "default")."""

    group: ClassVar[str]
    sources: Mapping[str, str] = field(
        default_factory=dict, compare=False, repr=False, kw_only=True
    )

    def __post_init__(self) -> None:
        object.__setattr__(self, "sources", dict(self.sources))
        for opt in self.options():
            value = opt.convert(getattr(self, opt.name), self.label(opt.name))
            object.__setattr__(self, opt.name, value)

    @classmethod
    def options(cls) -> tuple[Option, ...]:
        return tuple(o for o in OPTIONS if o.group == cls.group)

    def label(self, name: str) -> str:
        """How errors name an option: by its source, or by its name."""
        src = self.sources.get(name)
        return name if src in (None, "default") else src


@dataclass(frozen=True)
class ModelOptions(Options):
    """The model and how its workers run it."""

    group: ClassVar[str] = "model"
    model: Path | None  # None: the bundled default (see model_path)
    model_name: str | None  # None: the GGUF stem (see served_model_name)
    dtype: str
    weights: str
    kernels: str
    batch_invariant: bool
    decode_graphs: str
    threads: int | None  # None: the usable cores shared among the workers
    context_length: int | None  # None: the model's, capped (see effective_context_length)
    pooling: str  # "auto": the GGUF's pooling_type, else mean
    backend_python: Pairs
    target_devices: tuple[str, ...]
    target_layer_split: tuple[float, ...] | None  # None: equal shares

    def __post_init__(self) -> None:
        super().__post_init__()
        split = self.target_layer_split
        if split is not None and len(split) != len(self.target_devices):
            raise ConfigError(
                f"{self.label('target_layer_split')}: {len(split)} weights for "
                f"{len(self.target_devices)} devices in {self.label('target_devices')}"
            )

    def model_path(self) -> Path:
        """The GGUF to serve: MODEL's path, or a bundled model by name or by default,
        resolved only when asked (assembling Gemma's file takes a while)."""
        from luced.serve.bundled import UnknownModel, resolve

        try:
            return resolve(self.model)
        except UnknownModel as exc:
            raise ConfigError(f"{self.label('model')}: {exc}") from None

    def served_model_name(self) -> str:
        return self.model_name or self.model_path().name.removesuffix(".gguf")

    def effective_context_length(self, model_context: int) -> int:
        """The context to serve given the model's trained length."""
        if self.context_length is None:
            return min(model_context, CONTEXT_CAP)
        if self.context_length > model_context:
            raise ConfigError(
                f"{self.label('context_length')}: {self.context_length} exceeds the "
                f"model's context length {model_context}"
            )
        return self.context_length

    def worker_python(self, group: str) -> str:
        """The interpreter that runs a backend group's worker."""
        return str(dict(self.backend_python).get(group, sys.executable))

    def for_engine(self, context: int, encoder: bool, pooling: str) -> ModelInfo:
        """The engine's `ModelInfo`, given what the GGUF makes of these options: the
        served context (`effective_context_length`), and pooling `auto` resolved."""
        return ModelInfo(self.served_model_name(), context, encoder, pooling)


@dataclass(frozen=True)
class RegistryOptions(Options):
    """Which models a daemon serving several serves, when they load and unload."""

    group: ClassVar[str] = "registry"
    models: tuple[ModelEntry, ...]
    models_dir: Path | None  # None: only `models`
    preload: tuple[str, ...]
    model_keep_alive: float  # 0: never unloaded for being idle
    models_memory_budget: int  # 0: no budget
    model_load_timeout: float

    @property
    def several(self) -> bool:
        """Whether the daemon serves named models (`models`, `models_dir`), not MODEL."""
        return bool(self.models) or self.models_dir is not None


@dataclass(frozen=True)
class SchedulerOptions(Options):
    """How many requests wait and run, and how much each step feeds the model."""

    group: ClassVar[str] = "scheduler"
    max_queue: int
    max_running: int
    max_queued_tokens: int
    max_batch_tokens: int
    max_step_tokens: int  # 0: a chunk beside every running request's window
    decode_ahead: str  # "auto": on for a GPU worker
    default_max_tokens: int | None  # None: up to the context length

    def for_engine(self) -> SchedulingLimits:
        """The engine's `SchedulingLimits`. (The step's budget sizes the Target's regions,
        and decode_ahead is the runner's: the loader passes those.)"""
        return SchedulingLimits(
            max_running=self.max_running,
            max_queue=self.max_queue,
            max_queued_tokens=self.max_queued_tokens,
            default_max_tokens=self.default_max_tokens,
        )


@dataclass(frozen=True)
class KVOptions(Options):
    """Where K/V lives: its dtype, the running requests' pool, the prefix cache, KV Flash."""

    group: ClassVar[str] = "kv"
    kv_dtype: str
    kv_pool_tokens: int
    kv_block_size: int
    kv_keep_tokens: int | None  # None: one context, at most a quarter of the pool
    prefix_cache_bytes: int
    kv_cache_dir: Path | None  # None: memory tier only
    kv_cache_budget: int
    kv_flash: int | str | None  # None: off; tokens or "auto" (see luced.engine.kvflash)
    kv_flash_policy: str
    kv_flash_tau: int
    kv_flash_max_pool: int

    def row_dtype(self, dtype: str) -> str:
        """The K/V rows' dtype for a model computed in ``dtype`` (``auto`` follows it)."""
        return dtype if self.kv_dtype == "auto" else self.kv_dtype

    def for_engine(self, context: int, pool: int, block_store: bool) -> KVConfig:
        """The engine's `KVConfig` for a model serving `context` positions from a pool of
        `pool` (kv_pool_tokens resolved); `block_store`: whether its prefix cache keeps
        K/V blocks (`ModelSpec.block_store`) rather than snapshots. kv_keep_tokens auto
        keeps one context, at most a quarter of the pool."""
        keep = self.kv_keep_tokens
        return KVConfig(
            pool_tokens=pool,
            keep_tokens=keep if keep is not None else min(context, pool // 4),
            block_store=self.prefix_cache_bytes if block_store else 0,
        )


@dataclass(frozen=True)
class SpeculationOptions(Options):
    """Speculative decoding: the drafter and its blocks."""

    group: ClassVar[str] = "speculation"
    draft: Path | None  # None: plain decoding
    draft_device: str | None
    block_size: int
    adaptive_block_size: bool

    @property
    def lookup_drafts(self) -> bool:
        """--draft ngram: prompt-lookup drafting in the daemon, no draft model."""
        return self.draft is not None and str(self.draft) == "ngram"

    def for_engine(self) -> SpeculationConfig:
        """The engine's `SpeculationConfig` (the draft model itself is the Target's)."""
        return SpeculationConfig(self.block_size, self.lookup_drafts, self.adaptive_block_size)


@dataclass(frozen=True)
class MoEOptions(Options):
    """Where an MoE model's experts are computed."""

    group: ClassVar[str] = "moe"
    moe_hot_experts: int | None  # None: all
    moe_routing_profile: Path | None  # None: the lowest ids are hot
    moe_expert_device: str | None  # None: cold experts in process
    moe_expert_required: bool


@dataclass(frozen=True)
class HTTPOptions(Options):
    """The HTTP side: where it listens, who may call it, its time limits."""

    group: ClassVar[str] = "http"
    host: str
    port: int
    api_key: str | None = field(repr=False)  # kept out of logs
    api_key_file: Path | None
    metrics_public: bool
    allowed_hosts: tuple[str, ...]
    allowed_origins: tuple[str, ...]
    shutdown_timeout: float
    http_timeout: float
    max_connections: int
    trusted_proxies: tuple[Network, ...]

    def effective_api_key(self) -> str | None:
        """api_key, else the first line of api_key_file (ConfigError if unreadable)."""
        if self.api_key is not None or self.api_key_file is None:
            return self.api_key
        try:
            key = self.api_key_file.read_text().splitlines()[0].strip()
        except (OSError, UnicodeDecodeError, IndexError) as exc:
            raise ConfigError(f"{self.label('api_key_file')}: cannot read a key: {exc}") from exc
        if not key:
            raise ConfigError(f"{self.label('api_key_file')}: the first line is empty")
        return key


@dataclass(frozen=True)
class DaemonOptions(Options):
    """The process: its workers' deadlines, its admin socket, its log."""

    group: ClassVar[str] = "daemon"
    worker_timeout: float
    worker_start_timeout: float
    worker_key_file: Path | None
    runtime_dir: Path
    admin_socket: Path
    log_level: str


@dataclass(frozen=True)
class Config:
    """Every daemon option, in its group. Build with ``load_config`` or
    ``Config.from_values``; checks across groups run on construction."""

    model: ModelOptions
    registry: RegistryOptions
    scheduler: SchedulerOptions
    kv: KVOptions
    speculation: SpeculationOptions
    moe: MoEOptions
    http: HTTPOptions
    daemon: DaemonOptions

    def __post_init__(self) -> None:
        limit, context = self.scheduler.default_max_tokens, self.model.context_length
        if limit is not None and context is not None and limit > context:
            raise ConfigError(
                f"{self.label('default_max_tokens')}: {limit} exceeds context_length {context}"
            )
        if self.registry.several:
            for name in ("model", "model_name"):  # each served model has its path and name
                if self.value(name) is not None:
                    raise ConfigError(
                        f"{self.label(name)}: not with {self.label('models')} / "
                        f"{self.label('models_dir')}, which name their models themselves"
                    )
        remote = self.remote_devices()
        if remote and self.daemon.worker_key_file is None:
            raise ConfigError(
                f"{remote[0]} is a worker on another host: give {self.label('worker_key_file')}, "
                "the key it was started with"
            )

    def remote_devices(self) -> list[str]:
        """The devices on other hosts (``tcp://``) of the target, the draft and the experts."""
        named = [*self.model.target_devices, self.speculation.draft_device]
        named.append(self.moe.moe_expert_device)
        return [d for d in named if d is not None and remote_address(d) is not None]

    def for_model(self, entry: ModelEntry, path: Path) -> Config:
        """The config of one served model: this one with `entry`'s GGUF and name, and its
        table's settings over the top-level values (errors name them as
        ``FILE: models.NAME.KEY``). It serves that model alone (no `models`)."""
        values: dict[str, Any] = {"model": path, "model_name": entry.name}
        values.update(entry.settings)
        table = f"{self.label('models')}.{entry.name}"
        labels = {k: f"{table}.{k}" for k, _ in entry.settings}
        values.update(models=(), models_dir=None, preload=())
        groups = {}
        for name in GROUPS:
            group = getattr(self, name)
            mine = {k: v for k, v in values.items() if OPTION_BY_NAME[k].group == name}
            if mine:
                sources = {**group.sources, **{k: labels[k] for k in mine if k in labels}}
                group = replace(group, **mine, sources=sources)
            groups[name] = group
        return Config(**groups)

    @classmethod
    def from_values(
        cls,
        values: Mapping[str, Any] | None = None,
        *,
        sources: Mapping[str, str] | None = None,
        env: Env | None = None,
    ) -> Config:
        """A Config from the given values by option name (raw or typed), as in the
        config file; the rest get their defaults."""
        values = dict(values or {})
        sources = dict(sources or {})
        env = os.environ if env is None else env
        unknown = sorted(set(values) - set(OPTION_BY_NAME))
        if unknown:
            raise ConfigError(f"unknown option(s): {', '.join(unknown)}")
        resolved: dict[str, Any] = {}
        for opt in OPTIONS:  # table order: derived defaults may read earlier options
            if opt.name in values:
                label = sources.get(opt.name, opt.name)
                resolved[opt.name] = opt.convert(values[opt.name], label)
            else:
                resolved[opt.name] = opt.default_for(env, resolved)
                sources.setdefault(opt.name, "default")
        groups = {}
        for name, group in GROUP_TYPES.items():
            rows = [o.name for o in group.options()]
            groups[name] = group(
                **{n: resolved[n] for n in rows},
                sources={n: sources[n] for n in rows if n in sources},
            )
        return cls(**groups)

    def value(self, name: str) -> Any:
        """An option's value by its name (the TOML key)."""
        return getattr(getattr(self, OPTION_BY_NAME[name].group), name)

    @property
    def sources(self) -> dict[str, str]:
        """Option name -> where its value came from, for every option."""
        return {n: s for g in GROUPS for n, s in getattr(self, g).sources.items()}

    def label(self, name: str) -> str:
        """How errors name an option: by its source, or by its name."""
        return getattr(self, OPTION_BY_NAME[name].group).label(name)

    def effective_kv_dtype(self) -> str:
        """--kv-dtype resolved: the K/V rows' dtype."""
        return self.kv.row_dtype(self.model.dtype)

    def draft_python(self) -> str | None:
        """The interpreter of the draft's group when --draft-device names one."""
        if self.speculation.draft_device is None:
            return None
        return self.model.worker_python(parse_device(self.speculation.draft_device)[1])


def check_group(group: type[Options]) -> None:
    """A group class has exactly its rows' fields, in table order, each annotated with
    its row's type (``Option.annotation``); AssertionError otherwise."""
    declared = get_type_hints(group)
    names = [f.name for f in fields(group) if f.name != "sources"]
    rows = group.options()
    if names != [o.name for o in rows]:
        raise AssertionError(
            f"{group.__name__}'s fields {names} differ from the rows of group "
            f"{group.group!r} in OPTIONS {[o.name for o in rows]} (names or order)"
        )
    for opt in rows:
        if declared[opt.name] != opt.annotation:
            raise AssertionError(
                f"{group.__name__}.{opt.name} is {declared[opt.name]}, its row says "
                f"{opt.annotation}"
            )


def _check_groups() -> dict[str, type[Options]]:
    """Config holds one field per group, in GROUPS order, each a checked group class
    (``check_group``). Returns group name -> class."""
    if [f.name for f in fields(Config)] != list(GROUPS):
        raise AssertionError(f"Config's fields must be the groups {GROUPS}, in order")
    hints = get_type_hints(Config)
    for name in GROUPS:
        if hints[name].group != name:
            raise AssertionError(f"Config.{name} holds {hints[name].__name__}, of another group")
        check_group(hints[name])
    return {name: hints[name] for name in GROUPS}


GROUP_TYPES = _check_groups()


# --- the layers: flags, environment, file ---------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--config`` and one argument per option; absent ones stay out of the namespace."""
    parser.add_argument(
        "--config",
        metavar="PATH",
        default=argparse.SUPPRESS,
        help=f"TOML config file (env LUCED_CONFIG; default {DEFAULT_CONFIG_PATH} if present)",
    )
    for opt in OPTIONS:
        text = f"{opt.help} (env {opt.env}; default {opt.default_text})".replace("%", "%%")
        if opt.positional:
            parser.add_argument(
                opt.name, nargs="?", default=argparse.SUPPRESS, metavar=opt.metavar, help=text
            )
            continue
        kwargs: dict[str, Any] = {"dest": opt.name, "default": argparse.SUPPRESS, "help": text}
        if opt.repeatable:
            kwargs.update(action="append", metavar=opt.metavar or "GROUP=PATH")
        elif opt.choices:
            kwargs["metavar"] = "{" + ",".join(opt.choices) + "}"
        elif opt.type in ("devices", "weights", "strs"):
            kwargs["metavar"] = "LIST"
        elif opt.type == "pool":
            kwargs["metavar"] = "TOKENS|auto"
        elif opt.type == "bool":
            kwargs.update(nargs="?", const="true", metavar="BOOL")
        else:
            kwargs["metavar"] = opt.name.upper()
        parser.add_argument(opt.flag, **kwargs)


def build_parser(prog: str = "luced serve") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Serve a GGUF model over an OpenAI-compatible HTTP API.",
        epilog="Precedence: flags > LUCED_* environment > config file > defaults.",
    )
    add_arguments(parser)
    return parser


def read_config_file(path: Path) -> dict[str, Any]:
    """The options of a TOML file (top-level keys), unknown keys refused."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: invalid TOML: {exc}") from None
    for key in data:
        if key not in OPTION_BY_NAME:
            close = difflib.get_close_matches(key.replace("-", "_"), OPTION_BY_NAME, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"{path}: unknown option {key!r}{hint}")
    return data


def config_from_args(
    ns: argparse.Namespace,
    env: Env | None = None,
    default_config_path: Path | None = DEFAULT_CONFIG_PATH,
) -> Config:
    """Merge the parsed flags with the environment, the config file and the defaults."""
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}

    def layer(new: Mapping[str, Any], label: Callable[[Option], str]) -> None:
        for name, value in new.items():
            values[name] = value
            sources[name] = label(OPTION_BY_NAME[name])

    path: Path | None
    if "config" in ns:
        path = Path(ns.config)
    elif env.get("LUCED_CONFIG"):
        path = Path(env["LUCED_CONFIG"])
    elif default_config_path is not None and default_config_path.is_file():
        path = default_config_path
    else:
        path = None
    if path is not None:
        layer(read_config_file(path), lambda o: f"{path}: {o.name}")
    layer({o.name: env[o.env] for o in OPTIONS if env.get(o.env)}, lambda o: o.env)
    layer({o.name: getattr(ns, o.name) for o in OPTIONS if o.name in ns}, lambda o: o.flag)
    return Config.from_values(values, sources=sources, env=env)


def load_config(
    argv: Sequence[str],
    env: Env | None = None,
    default_config_path: Path | None = DEFAULT_CONFIG_PATH,
) -> Config:
    """``luced serve`` arguments (without "serve") -> Config. Raises ConfigError;
    argparse exits with status 2 on malformed flags."""
    ns = build_parser().parse_args(list(argv))
    return config_from_args(ns, env, default_config_path)


if __name__ == "__main__":
    from luced.serve.config_docs import main

    sys.exit(main(sys.argv[1:]))
