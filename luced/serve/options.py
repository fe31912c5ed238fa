"""The daemon's options: one table, ``OPTIONS``, and how each value is read.

Every option is one ``Option`` row. From that row come:

* its group: the typed object it lives in (``Config.http.port``; ``serve.config``),
* its type, default and checks (``kind``, ``minimum``, ``choices``, ...),
* the flag of ``luced serve`` (``port`` -> ``--port``; ``model`` is the positional ``MODEL``),
* the environment variable (``port`` -> ``LUCED_PORT``; empty means unset),
* the TOML key: a top-level key of the config file (``port = 8000``; the groups do not
  show in the file),
* the table in docs/configuration.md and ``systemd/luced.toml.example`` (``serve.config_docs``).

A new option is a row here (in the order the docs list it) and a typed field of the same
name in its group's class in ``serve.config``. That field is the one thing said twice, on
purpose: a group class generated from the table (``dataclasses.make_dataclass``) would
read the same at run time, but editors and type checkers could not see its fields, so
``cfg.http.port`` would be untyped everywhere it is used. An import-time check keeps the
two in step: same names, same order, and the field's annotation is the row's type
(``Option.annotation``).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from luced.engine.placement import parse_device, parse_devices, parse_weights
from luced.ipc.frames import WEIGHT_MODES
from luced.serve.admission import Network, parse_networks
from luced.serve.bundled import BUNDLED
from luced.serve.option_values import Pairs, items, to_experts, to_pairs, to_pool, unflagged
from luced.values import (
    to_bool,
    to_bytes,
    to_float,
    to_int,
    to_path,
    to_str,
    to_strs,
)

CONTEXT_CAP = 8192  # default context when the model's own is longer (KV memory)
ADMIN_SOCKET_NAME = "admin.sock"

# The groups, in the order `Config` holds them: what each option configures.
GROUPS = ("model", "registry", "scheduler", "kv", "speculation", "moe", "http", "daemon")

# What a served model's `[models.NAME]` table may set for that model alone: how it is
# computed, placed, drafted and scheduled, and how long it stays loaded. Not the daemon's
# own options (HTTP, admin, the other models), nor `kernels` (the workers' environment),
# nor `model_name` (the table's name).
PER_MODEL_GROUPS = frozenset({"model", "scheduler", "kv", "speculation", "moe"})
_DAEMON_WIDE = frozenset({"model", "model_name", "kernels"})
_MODEL_OWN = frozenset({"model_keep_alive"})

Env = Mapping[str, str]
# A derived default sees the environment and the options resolved before it.
DefaultFn = Callable[[Env, Mapping[str, Any]], Any]

# A served model's name: what requests put in `model` (`qwen3`, `org/model`, `llama3:8b`).
_MODEL_NAME_RE = re.compile(r"[A-Za-z0-9_.:@/+-]{1,128}")


class ConfigError(ValueError):
    """A bad option value; the message names the option and its source."""


def default_runtime_dir(env: Env | None = None) -> Path:
    """$RUNTIME_DIRECTORY (systemd), else $XDG_RUNTIME_DIR/luced, else /tmp/luced-$UID."""
    env = os.environ if env is None else env
    if env.get("RUNTIME_DIRECTORY"):
        # systemd joins several RuntimeDirectory= entries with ':'; ours is the first.
        return Path(env["RUNTIME_DIRECTORY"].split(":")[0])
    if env.get("XDG_RUNTIME_DIR"):
        return Path(env["XDG_RUNTIME_DIR"]) / "luced"
    return Path(f"/tmp/luced-{os.getuid()}")


def default_admin_socket(env: Env | None = None) -> Path:
    """Where the daemon puts its admin socket when neither it nor runtime_dir is set."""
    env = os.environ if env is None else env
    runtime = env.get("LUCED_RUNTIME_DIR") or default_runtime_dir(env)
    return Path(runtime) / ADMIN_SOCKET_NAME


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))  # the cores this process may run on
    except AttributeError:
        return os.cpu_count() or 1


@dataclass(frozen=True)
class ModelEntry:
    """One served model of `models`: its name, its GGUF (None: NAME.gguf of models_dir),
    and the options its table sets for it alone (typed; see PER_MODEL_GROUPS)."""

    name: str
    path: Path | None
    settings: tuple[tuple[str, Any], ...] = ()


def per_model(name: str) -> bool:
    """Whether a `[models.NAME]` table may set option `name` (see PER_MODEL_GROUPS)."""
    opt = OPTION_BY_NAME[name]
    return name in _MODEL_OWN or (opt.group in PER_MODEL_GROUPS and name not in _DAEMON_WIDE)


def _to_models(v: Any) -> tuple[ModelEntry, ...]:
    """Served models: NAME=PATH or PATH (named by its stem) items: "a=/x.gguf,b=/y.gguf"
    (env), a list (flags), or a TOML table of NAME = PATH or NAME = {model = PATH, ...}."""
    out: dict[str, ModelEntry] = {}
    for item in items(v, "NAME=PATH"):
        entry = _model_entry(item)
        if entry.name in out:
            raise ValueError(f"model {entry.name!r} given twice")
        out[entry.name] = entry
    return tuple(out.values())


def _model_entry(item: Any) -> ModelEntry:
    if isinstance(item, ModelEntry):
        return item
    if isinstance(item, str):
        name, sep, path = item.partition("=")
        if not sep:  # a bare path: named by its file's stem
            name, path = Path(item).name.removesuffix(".gguf"), item
        return ModelEntry(_model_name(name), to_path(path))
    if not (isinstance(item, tuple | list) and len(item) == 2):
        raise ValueError(f"not NAME=PATH: {item!r}")
    name, spec = _model_name(item[0]), item[1]
    if not isinstance(spec, Mapping):
        return ModelEntry(name, to_path(spec))
    settings = []
    for key, value in spec.items():
        if key == "model":
            continue
        if key not in OPTION_BY_NAME or not per_model(key):
            allowed = ", ".join(o.name for o in OPTIONS if per_model(o.name))
            raise ValueError(f"models.{name}: {key!r} is not a per-model option ({allowed})")
        settings.append((key, OPTION_BY_NAME[key].convert(value, f"models.{name}.{key}")))
    path = spec.get("model")
    return ModelEntry(name, None if path is None else to_path(path), tuple(settings))


def _model_name(name: Any) -> str:
    if not isinstance(name, str) or not _MODEL_NAME_RE.fullmatch(name):
        raise ValueError(f"bad model name {name!r} (1-128 of letters, digits, _ . : @ / + -)")
    return name


@dataclass(frozen=True)
class Kind:
    """How an option's values are read: the converter and the type it returns."""

    convert: Callable[[Any], Any]
    type: Any


KINDS: dict[str, Kind] = {
    "devices": Kind(unflagged(parse_devices), tuple[str, ...]),
    "device": Kind(unflagged(lambda v: parse_device(str(v).strip())[0]), str),
    "weights": Kind(unflagged(parse_weights), tuple[float, ...]),
    "int": Kind(to_int, int),
    "pool": Kind(to_pool, int | str),
    "experts": Kind(to_experts, int | None),
    "bytes": Kind(to_bytes, int),
    "float": Kind(to_float, float),
    "str": Kind(to_str, str),
    "path": Kind(to_path, Path),
    "pairs": Kind(to_pairs, Pairs),
    "models": Kind(_to_models, tuple[ModelEntry, ...]),
    "bool": Kind(to_bool, bool),
    "strs": Kind(to_strs, tuple[str, ...]),
    "networks": Kind(parse_networks, tuple[Network, ...]),
}


@dataclass(frozen=True)
class Option:
    """One daemon option. ``default`` is a value, or a function for derived defaults."""

    name: str
    group: str  # one of GROUPS: the attribute of Config that holds it
    type: str  # a key of KINDS
    default: Any
    help: str
    choices: tuple[str, ...] = ()
    minimum: float | None = None
    maximum: float | None = None
    nullable: bool = False  # None is a meaningful value ("unset": see default_doc)
    default_doc: str | None = None  # how the docs state a derived or unset default
    example: Any = None  # value shown in the example TOML when the default is not one
    positional: bool = False  # the one positional argument of `luced serve`
    metavar: str | None = None
    flag_name: str | None = None  # the flag, when not the name's (`models`: --model)

    @property
    def flag(self) -> str:
        if self.positional:
            return self.metavar or self.name
        return self.flag_name or "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return "LUCED_" + self.name.upper()

    @property
    def repeatable(self) -> bool:
        return self.type in ("pairs", "models")

    @property
    def annotation(self) -> Any:
        """The type of the option's field in its group."""
        kind = KINDS[self.type].type
        return kind | None if self.nullable else kind

    @property
    def default_text(self) -> str:
        """The default as prose (help, docs): derived ones by their description."""
        if self.default_doc is not None:
            return self.default_doc
        if self.type in ("int", "float"):
            return _num(self.default)
        return str(self.default)

    def convert(self, value: Any, label: str) -> Any:
        """The typed, validated value; errors are ``ConfigError("{label}: {reason}")``."""
        if value is None:
            if self.nullable:
                return None
            raise ConfigError(f"{label}: a value is required")
        try:
            out = KINDS[self.type].convert(value)
        except ValueError as exc:
            raise ConfigError(f"{label}: {exc}") from None
        if self.choices and out not in self.choices:
            raise ConfigError(f"{label}: not one of {', '.join(self.choices)}: {value!r}")
        if self.minimum is not None and out < self.minimum:
            raise ConfigError(f"{label}: must be >= {_num(self.minimum)}, got {out}")
        if self.maximum is not None and out > self.maximum:
            raise ConfigError(f"{label}: must be <= {_num(self.maximum)}, got {out}")
        return out

    def default_for(self, env: Env, values: Mapping[str, Any]) -> Any:
        return self.default(env, values) if callable(self.default) else self.default


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


OPTIONS: tuple[Option, ...] = (
    Option(
        "model", "model", "path", None,
        f"GGUF model file to serve, or a bundled model by name: {', '.join(BUNDLED)}.",
        nullable=True, positional=True, metavar="MODEL",
        default_doc="the bundled SmolLM2-135M-Instruct (smollm2-135m)",
        example="/var/lib/luced/models/model.gguf",
    ),
    Option("host", "http", "str", "127.0.0.1", "Address the HTTP server listens on."),
    Option(
        "port", "http", "int", 8000, "HTTP port (0 picks a free one).", minimum=0, maximum=65535,
    ),
    Option(
        "api_key", "http", "str", None,
        "If set, /v1/* and /api/* requests (and /tokenize, /detokenize, and /metrics unless "
        "metrics_public) must send `Authorization: Bearer KEY` or `x-api-key: KEY`. A flag "
        "shows in `ps`: prefer the environment or api_key_file.",
        nullable=True, default_doc="unset (no key)", example="change-me",
    ),
    Option(
        "api_key_file", "http", "path", None,
        "File whose first line is the API key (instead of api_key; keeps it out of `ps`).",
        nullable=True, default_doc="unset", example="/etc/luced/api-key",
    ),
    Option(
        "metrics_public", "http", "bool", False,
        "Serve /metrics without the API key.",
        default_doc="false", example=True,
    ),
    Option(
        "allowed_hosts", "http", "strs", (),
        "Host header values accepted besides the bound address (and localhost names when "
        "bound to loopback); anything else is a 403, which stops DNS rebinding. Bound to "
        "0.0.0.0 or :: with none given, any Host is accepted.",
        default_doc="none", example=("luced.example.org",),
    ),
    Option(
        "allowed_origins", "http", "strs", (),
        "Other sites whose pages may call the API (CORS); a request from any other "
        "site's page is refused (403). The daemon's own page at / needs no entry.",
        default_doc="none (no cross-origin calls)", example=("http://localhost:3000",),
    ),
    Option(
        "model_name", "model", "str", None,
        "Model id served on /v1/models and expected in requests.",
        nullable=True, default_doc="the GGUF file name without .gguf", example="smollm2",
    ),
    Option(
        "models", "registry", "models", (),
        "Serve several models: NAME=PATH (or a PATH, named by its file's stem), each loaded "
        "on its first request (docs/features.md: Several models). Repeat the flag; the environment "
        "variable takes a comma-separated list; the file a table, `[models.NAME]` with "
        "`model = PATH` and that model's own settings. Not with MODEL.",
        default_doc="none (MODEL alone)", flag_name="--model", metavar="NAME=PATH",
        example=(("qwen3", Path("/var/lib/luced/models/qwen3.gguf")),),
    ),
    Option(
        "models_dir", "registry", "path", None,
        "Serve every *.gguf of this directory, each named by its file's stem, loaded on its "
        "first request; a new file is found when a request names it. Not with MODEL.",
        nullable=True, default_doc="none", example="/var/lib/luced/models",
    ),
    Option(
        "preload", "registry", "strs", (),
        "Served models loaded at start; /health says 503 `loading` until they are.",
        default_doc="none (each on its first request)", example=("qwen3",),
    ),
    Option(
        "model_keep_alive", "registry", "float", 300.0,
        "Seconds a served model stays loaded with no request running or queued before it "
        "is unloaded (its workers stopped, its memory freed). 0: until the memory budget "
        "needs the room. A `[models.NAME]` table may set its own.",
        minimum=0,
    ),
    Option(
        "models_memory_budget", "registry", "bytes", 0,
        "Memory the loaded models may take together (e.g. `24G`), estimated per model as "
        "its file, its KV pool and its prefix-cache memory. Before a load, the least "
        "recently used idle models are unloaded until it fits; a model that is serving is "
        "never unloaded, so a load may wait for one to finish. 0: no budget.",
        minimum=0, default_doc="0 (no budget)", example="24G",
    ),
    Option(
        "model_load_timeout", "registry", "float", 300.0,
        "Seconds a request waits for its model to load (and for the memory budget to make "
        "room) before a 503 with Retry-After; the load itself goes on.",
        minimum=1,
    ),
    Option(
        "dtype", "model", "str", "float32", "Compute dtype of the workers.",
        choices=("float32", "bfloat16", "float16"),
    ),
    Option(
        "weights", "model", "str", "auto",
        "How the workers hold weight matrices. `int4` / `int8`: packed for weight-only "
        "kernels (see `kernels`; 4.5 / 8 bits per weight read per decoded token; GGUF Q4_0 "
        "and Q4_1 map to int4 exactly, other types are requantized). `auto`: per tensor "
        "(4-bit types int4, 5- to 8-bit types int8, float tensors exact) on a CUDA GPU "
        "(torch's tinygemm int4 and int8 kernels) and where the CPU has the kernels' AVX2 / "
        "AVX512 paths, else `dequant`. `dequant`: every matrix expanded to the compute "
        "dtype (the exact path).",
        choices=WEIGHT_MODES,
    ),
    Option(
        "kernels", "model", "str", "auto",
        "Which kernels run packed matrices and decode attention on CPU workers. `native`: "
        "luced's own (C, built with the system's gcc into ~/.cache/luced/kernels on first "
        "use; `tools/install.sh` prebuilds them; a cached build serves without gcc), an "
        "error if they cannot be had. `torch`: torch's weight-only kernels and SDPA. "
        "`auto`: native where they can be had, else torch (decode several times slower; a "
        "warning, and `lucectl status` says so).",
        choices=("auto", "native", "torch"),
    ),
    Option(
        "kv_dtype", "kv", "str", "auto",
        "dtype of the K/V cache. `auto` = `--dtype`. bfloat16 / float16 halve the KV "
        "memory of a float32 model. On CPUs attention (decode and prefill) reads 16-bit "
        "rows in luced's kernel with float32 arithmetic (bfloat16 is the faster at long "
        "contexts, docs/performance.md: KV dtype and attention at long contexts); GPUs "
        "attend in the cache's dtype.",
        choices=("auto", "float32", "bfloat16", "float16"),
    ),
    Option(
        "batch_invariant", "model", "bool", False,
        "Make every token's logits independent of how tokens are grouped into forwards "
        "where luced's native kernels do not already: they do by default for packed "
        "matrices (`--weights auto`, `int4`, `int8`) and for attention on CPUs, so a "
        "prompt restored from the prefix cache gives the fresh prompt's logits bit for bit "
        "without this (docs/features.md: Exactness). This adds torch's packed kernels "
        "(`LUCED_KERNELS=torch`, no compiler: 64 rows at a time instead of dense) and "
        "attention the native kernel does not take (SDPA query by query), at a cost. Not "
        "covered: float-held matrices, MoE routers, Gated DeltaNet, KV Flash.",
    ),
    Option(
        "decode_graphs", "model", "str", "auto",
        "Run decode steps (one new token for each running request) through a fixed-shape "
        "step over the K/V block pool, captured once per batch size as a CUDA graph and "
        "replayed: a GPU then launches one graph per step instead of a thousand small "
        "kernels. `auto`: on CUDA workers; `on`: on CPU workers too (the same step, run "
        "eagerly: a check, not a speed-up); `compile`: as `on`, each step also compiled by "
        "torch.compile, which fuses a layer's small kernels (the first step of each batch "
        "size compiles: seconds to minutes; a CPU worker's packed kernels cannot be compiled, "
        "and there it runs as `on`); `off`. Needs the block pool (`--kv-block-size` > "
        "0, no `--kv-flash`) and a whole attention model in one worker (no split, MoE or "
        "recurrent layers); other steps run as before.",
        choices=("auto", "on", "compile", "off"),
    ),
    Option(
        "threads", "model", "int", None, "Torch threads per CPU worker.",
        minimum=1, nullable=True, example=4,
        default_doc="the usable CPU cores, shared among the target's workers (at least 1 "
        "each)",
    ),
    Option(
        "context_length", "model", "int", None, "Context window in tokens (prompt + completion).",
        minimum=1, nullable=True,
        default_doc=f"the model's, at most {CONTEXT_CAP}", example=CONTEXT_CAP,
    ),
    Option(
        "pooling", "model", "str", "auto",
        "How `/v1/embeddings` (and Ollama's `/api/embed`) pool an input's last-layer states "
        "into one vector: `mean` of every token's, the first token's (`cls`) or the last "
        "token's (`last`). `auto`: what the GGUF declares (`pooling_type`), else `mean`.",
        choices=("auto", "mean", "cls", "last"),
    ),
    Option(
        "max_queue", "scheduler", "int", 16,
        "Requests that may wait behind the running ones; more are answered 429.", minimum=0,
    ),
    Option(
        "max_running", "scheduler", "int", 8,
        "Requests generated at once (continuous batching): each runs in its own sequence "
        "of the workers, their decode steps go through the model together in one forward "
        "per step, and a new request's prompt is prefilled between those steps. 1 serves "
        "one request at a time. With `--kv-flash` each running request pages its own pool. "
        "Greedy speculative requests (`--draft ngram` or a DFlash draft model) put their "
        "verify blocks in the batch.",
        minimum=1, maximum=64,
    ),
    Option(
        "kv_pool_tokens", "kv", "int", 0,
        "KV positions the running requests hold together (continuous batching). When a "
        "running request cannot grow, the one that arrived last is preempted: its KV is "
        "freed and it is recomputed when there is room, with the same output. At least "
        "the context length; 0 = max-running whole contexts, or what half the free memory "
        "holds if less.",
        minimum=0,
    ),
    Option(
        "kv_block_size", "kv", "int", 16,
        "Rows per block of the workers' K/V pool (continuous batching): every running "
        "request's K/V lives in blocks of one pool per worker shard, so a request whose "
        "prompt starts like a running one's takes that prefix's blocks without computing or "
        "copying them. 0: each request's K/V on its own, nothing shared (and the prefix "
        "cache keeps snapshots). `--kv-flash` pages blocks of 64 rows whatever this says; a "
        "hybrid (recurrent) model does not share.",
        minimum=0, maximum=1024,
    ),
    Option(
        "kv_keep_tokens", "kv", "int", None,
        "KV positions that finished requests' blocks may keep in the pool: a later request "
        "whose prompt starts with the same tokens (a chat's next turn, a repeated prompt) "
        "takes them without computing or copying them. They hold only room the running "
        "requests do not use, and give way first, least recently used: one pages its "
        "blocks but the first out to host memory (about the bytes this many positions "
        "take) and stays whole, and is given up when that is full. 0: nothing is "
        "kept. Under `--kv-flash` it bounds what they keep resident. Needs the block "
        "pool (`--kv-block-size` > 0, or `--kv-flash`); not with a "
        "DFlash draft or a hybrid (recurrent) model. The prefix cache "
        "(`--prefix-cache-bytes`) is the copy behind it that outlives a restart.",
        minimum=0, nullable=True, example=8192,
        default_doc="one context, at most a quarter of the KV pool",
    ),
    Option(
        "max_queued_tokens", "scheduler", "int", 32768,
        "Prompt tokens that may wait in the queue; more are answered 429.", minimum=1,
    ),
    Option(
        "max_batch_tokens", "scheduler", "int", 512,
        "Prefill chunk: a prompt is fed in chunks that end at multiples of this many "
        "positions.", minimum=1,
    ),
    Option(
        "max_step_tokens", "scheduler", "int", 0,
        "Tokens one engine step feeds: every running request's decode token or draft "
        "window, and prompt chunks. 0: --max-batch-tokens + --max-running x --block-size.",
        minimum=0, default_doc="0 (a chunk beside every running request's window)", example=640,
    ),
    Option(
        "decode_ahead", "scheduler", "str", "auto",
        "While the daemon turns a decode step's tokens into the next step, the worker "
        "already runs that next step on the tokens it sampled, and answers it at once when "
        "it comes (nothing changes in the output; a step that turns out different is rolled "
        "back). It hides the round trip between the daemon and a single local worker; "
        "steps with a grammar, drafts, KV Flash or a split run as before. `auto`: on where "
        "the daemon has a core the step does not use: a GPU worker, or a CPU worker whose "
        "--threads leave one free. A CPU worker on every core would lose that core to the "
        "daemon during its step (docs/performance.md).",
        choices=("auto", "on", "off"),
    ),
    Option(
        "default_max_tokens", "scheduler", "int", None,
        "Completion limit for requests that give no max_tokens.",
        minimum=1, nullable=True, default_doc="up to the context length", example=1024,
    ),
    Option(
        "shutdown_timeout", "http", "float", 30.0,
        "Seconds SIGTERM waits for running streams before aborting them.", minimum=0,
    ),
    Option(
        "http_timeout", "http", "float", 30.0,
        "Seconds an HTTP client may take to send a whole request header, or its body, or "
        "stay idle between requests on a kept-alive connection, before it is closed (a "
        "slow body gets a 408).",
        minimum=0.1,
    ),
    Option(
        "max_connections", "http", "int", 512,
        "Concurrent HTTP connections, shared between client addresses. Each costs a file "
        "descriptor: keep it below the process's open-file limit. When all are taken, a "
        "new connection displaces the longest-idle kept-alive one, else the oldest slow "
        "sender of an address over its share; else it gets one of the places kept for "
        "/health (an eighth, at most 8), or a 503 (docs/api.md: Routes and fields).",
        minimum=1,
    ),
    Option(
        "trusted_proxies", "http", "networks", (),
        "Addresses or networks (CIDR) of proxies or load balancers in front of luced: "
        "their connections are not held to one client address's share of "
        "--max-connections, since each stands for many clients.",
        default_doc="none", example=("10.0.0.0/8",),
    ),
    Option(
        "worker_timeout", "daemon", "float", 30.0,
        "Seconds a worker call may take beyond 20× its expected time (the worker's "
        "measured seconds per token × the call's tokens) before the worker counts as hung "
        "(stopped, deadlocked): it is killed and restarted, the running request ends with "
        "an error, queued ones wait for the restart. Time the daemon itself was stalled "
        "(stopped, swapped out) does not count. Starts and loads: --worker-start-timeout.",
        minimum=0.1,
    ),
    Option(
        "worker_start_timeout", "daemon", "float", 60.0,
        "Seconds a starting or loading worker may go without a sign of life. Such a worker "
        "reports progress twice a second while it imports torch and loads, so a slow start "
        "or a big model takes as long as it needs; this only ends one that is stopped or "
        "stuck. Raise it on a machine so busy that a worker cannot even run its first "
        "imports in this time.",
        minimum=1.0,
    ),
    Option(
        "worker_key_file", "daemon", "path", None,
        "Key shared with workers on other hosts: devices written `tcp://HOST:PORT/DEVICE` in "
        "--target-devices, --draft-device or --moe-expert-device, each a `luced worker "
        "--listen HOST:PORT` started there with the same key. Every control connection "
        "proves that both ends hold it (nothing is encrypted: keep those hosts on a private "
        "network). At least 32 bytes, in a file only its owner may read.",
        nullable=True, default_doc="none (every worker on this host)",
        example="/etc/luced/worker.key",
    ),
    Option(
        "runtime_dir", "daemon", "path",
        lambda env, values: default_runtime_dir(env),
        "Directory for the admin socket.",
        default_doc="$RUNTIME_DIRECTORY, else $XDG_RUNTIME_DIR/luced, else /tmp/luced-$UID",
        example="/run/luced",
    ),
    Option(
        "admin_socket", "daemon", "path",
        lambda env, values: values["runtime_dir"] / ADMIN_SOCKET_NAME,
        "Admin unix socket (mode 0600) that lucectl talks to.",
        default_doc=f"RUNTIME_DIR/{ADMIN_SOCKET_NAME}",
        example=f"/run/luced/{ADMIN_SOCKET_NAME}",
    ),
    Option(
        "backend_python", "model", "pairs", (),
        "GROUP=PATH: the Python interpreter for a backend group's worker (e.g. a ROCm "
        "torch beside a CUDA one). Repeat the flag; the environment variable takes a "
        "comma-separated list, the file a table.",
        default_doc="the daemon's interpreter for every group",
        example=(("hip", Path("/opt/luced/rocm-venv/bin/python")),),
    ),
    Option(
        "target_devices", "model", "devices", ("cpu",),
        "Devices of the target model, one layer shard each, in layer order (e.g. "
        "`cuda:0,cuda:1,hip:0`). `cuda:N` devices form one worker, `hip:N` another; "
        "`cpu`, `cpu:1`, `cpu:2` are distinct CPU workers; a repeated device (`cpu,cpu`) "
        "is two shards in one worker.",
        default_doc="cpu (one worker, no split)", example=("cpu", "cpu:1"),
    ),
    Option(
        "target_layer_split", "model", "weights", None,
        "Relative layer counts of the shards of --target-devices (e.g. `0.08,0.46,0.46` "
        "or `1,1`); contiguous ranges, each at least one layer.",
        nullable=True, default_doc="equal shares", example=(1, 1),
    ),
    Option(
        "draft", "speculation", "path", None,
        "DFlash draft (GGUF file or safetensors directory), or `ngram` for prompt-lookup "
        "drafting without a model (proposals copied from earlier in the prompt and output; "
        "pays on input-grounded work). Requests decode speculatively, a block at a time, "
        "with output exactly as plain decoding's (greedy token for token; sampled by "
        "rejection sampling). A draft file named ngram is given with its directory.",
        nullable=True, default_doc="none (plain decoding)",
        example="/var/lib/luced/models/draft.gguf",
    ),
    Option(
        "draft_device", "speculation", "device", None,
        "Device of the draft (`cpu`, `cpu:1`, `cuda:1`, ...). A device of the target's "
        "worker puts the draft in that worker; any other gets it a worker of its own, "
        "which loads the target's embedding and head beside it and reads the feature "
        "ring in place.",
        nullable=True,
        default_doc="the target's worker; with a split target, a worker of its own on "
        "the head's device",
        example="cpu:1",
    ),
    Option(
        "block_size", "speculation", "int", 16,
        "Tokens per speculative block: the last accepted token plus block_size - 1 "
        "proposals. With --adaptive-block-size, the largest block and where each request "
        "starts.",
        minimum=2, maximum=64,
    ),
    Option(
        "adaptive_block_size", "speculation", "bool", True,
        "Each speculating request picks its block size from its own recent acceptance "
        "and the step costs measured at start (a plain step against a verify of k "
        "tokens), and decodes plainly while drafting does not pay. Output is the same "
        "either way; only speed changes. Seeded sampled requests keep --block-size, so a "
        "seed repeats its tokens.",
    ),
    Option(
        "prefix_cache_bytes", "kv", "bytes", 2**30,
        "Shared memory the prefix cache keeps prompts' K/V in (e.g. `512M`, `4G`; 0 turns "
        "the prefix cache off). Where the K/V lives in a block pool (several requests "
        "running, or --kv-flash), it holds their whole K/V blocks by prefix key in host "
        "records (at least one context's; under KV Flash the blocks it paged out are held "
        "as they are; with a DFlash draft, each block's captured features beside it), "
        "least recently used given up first, also to finished requests' kept blocks "
        "paging out; a worker on another host keeps its part of them on its host, within "
        "its own `--prefix-cache-bytes`; a hybrid (recurrent) model without KV Flash and "
        "with every worker local gives half of it to its recurrent states at block ends; "
        "otherwise an arena of one snapshot per prompt. "
        "SmolLM2-135M in float32 needs 45 KiB per cached token, so the default holds "
        "about 23k tokens. Capped, with a warning, at half the free space of /dev/shm.",
        minimum=0, default_doc="1G", example="4G",
    ),
    Option(
        "kv_cache_dir", "kv", "path", None,
        "Directory of the prefix cache's disk tier, written in the background and found "
        "again after a restart. Where the cache keeps K/V blocks (see "
        "`--prefix-cache-bytes`), each prompt's whole blocks are kept there too, one file "
        "per block and worker, and restored into the pool (a worker on another host keeps "
        "its files in its own `--kv-cache-dir`, which it then needs); otherwise one "
        "snapshot file per prompt.",
        nullable=True, default_doc="none (memory only)", example="/var/lib/luced/kv",
    ),
    Option(
        "kv_cache_budget", "kv", "bytes", 8 * 2**30,
        "Most bytes the disk tier keeps; least recently used snapshots or blocks go first "
        "(a hybrid's recurrent states beside its blocks: half of it).",
        minimum=0, default_doc="8G", example="64G",
    ),
    Option(
        "kv_flash", "kv", "pool", None,
        "KV Flash: keep at most this many tokens of each running request's K/V in the "
        "workers (rounded up to a multiple of 256, clamped to the context); its other "
        "64-token blocks are paged out to a shared-memory host tier and attention skips "
        "them. `auto` sizes the pools from free memory (shared by max_running of them), "
        "each capped by kv_flash_max_pool. Lossless while the sequence fits the pool.",
        nullable=True, default_doc="off (every worker keeps the whole context)", example="auto",
    ),
    Option(
        "kv_flash_policy", "kv", "str", "qk",
        "Which block KV Flash evicts when the pool is full. `lru`: the least recently "
        "written (StreamingLLM: sinks + recency, never recalled). `qk`: the lowest score "
        "by the cosine of the current query with each block's mean key; every "
        "max(tau, history/45) tokens the top-scored blocks are made resident, recalled "
        "from the host tier.",
        choices=("lru", "qk"),
    ),
    Option(
        "kv_flash_tau", "kv", "int", 64,
        "KV Flash reselection interval floor in generated tokens (max(tau, history/45)).",
        minimum=1,
    ),
    Option(
        "kv_flash_max_pool", "kv", "int", 16384,
        "Largest pool `--kv-flash auto` picks (tokens): attention cost per step grows "
        "with it.",
        minimum=512,
    ),
    Option(
        "moe_hot_experts", "moe", "experts", None,
        "MoE models: routed experts each target worker keeps per layer (the lowest ids, "
        "or the most routed ones given --moe-routing-profile); the other (cold) experts of "
        "a token are computed in process on the CPU from the mapped GGUF, and their sum "
        "added to the hot ones'. `all` keeps every expert.",
        nullable=True, default_doc="all (every expert in the target's workers)", example=4,
    ),
    Option(
        "moe_routing_profile", "moe", "path", None,
        "With --moe-hot-experts: a routing profile of this model (per-layer expert "
        "selection counts, JSON, recorded by tools/moe_profile.py); each layer keeps its "
        "most-routed experts hot. A profile of another model is a start-up error.",
        nullable=True, default_doc="none (the lowest ids are hot)",
        example="/var/lib/luced/models/model.routing.json",
    ),
    Option(
        "moe_expert_device", "moe", "device", None,
        "MoE models with --moe-hot-experts: compute the cold experts in an expert worker "
        "on this device (`cpu:1`, `cuda:1`, ...), which holds exactly them; target workers "
        "call it directly over shared memory, one call per MoE layer per step. While it is "
        "down (it is restarted) they compute them in process.",
        nullable=True, default_doc="none (cold experts in process)", example="cpu:1",
    ),
    Option(
        "moe_expert_required", "moe", "bool", False,
        "With --moe-expert-device: a step whose expert worker fails is an error instead of "
        "being computed in process.",
    ),
    Option(
        "log_level", "daemon", "str", "info", "Log level.",
        choices=("debug", "info", "warning", "error"),
    ),
)  # fmt: skip
OPTION_BY_NAME: dict[str, Option] = {o.name: o for o in OPTIONS}


def _check_table() -> None:
    for opt in OPTIONS:
        if opt.group not in GROUPS:
            raise AssertionError(f"option {opt.name}: group {opt.group!r} is not one of {GROUPS}")
        if opt.type not in KINDS:
            raise AssertionError(f"option {opt.name}: type {opt.type!r} is not one of KINDS")
        if (opt.default is None or callable(opt.default)) and opt.default_doc is None:
            raise AssertionError(f"option {opt.name}: a derived or unset default needs default_doc")
    if len(OPTION_BY_NAME) != len(OPTIONS):
        raise AssertionError("two options share a name")


_check_table()
