"""Daemon configuration: one option table, four ways in, one frozen ``Config``.

Every option is one ``Option`` row in ``OPTIONS``. From that row come:

* the flag of ``luced serve`` (``port`` -> ``--port``; ``model`` is the positional ``MODEL``),
* the environment variable (``port`` -> ``LUCED_PORT``; empty means unset),
* the TOML key: a top-level key of the config file (``port = 8000``, no table),
* the README table (``options_markdown()``) and ``systemd/luced.toml.example``
  (``example_toml()``); ``python -m luced.serve.config markdown|toml`` prints them.

Precedence, per option: flags > ``LUCED_*`` environment > config file > defaults. The
config file is ``--config PATH``, else ``$LUCED_CONFIG``, else ``/etc/luced/luced.toml``
when it exists. A repeatable option (``backend_python``) is replaced as a whole by a
higher layer, never merged.

Every value is converted and validated by its option's rules when a ``Config`` is
constructed; an error names the option and where the value came from
(``LUCED_PORT: not an integer: 'x'``, ``/etc/luced/luced.toml: port: ...``).
A new option is one row here plus one typed field on ``Config`` (an import-time check
keeps the two in step).
"""

from __future__ import annotations

import argparse
import difflib
import math
import os
import re
import sys
import textwrap
import tomllib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from luced.engine.placement import PlacementError, parse_device, parse_devices, parse_weights
from luced.ipc.frames import WEIGHT_MODES

DEFAULT_CONFIG_PATH = Path("/etc/luced/luced.toml")
CONTEXT_CAP = 8192  # default context when the model's own is longer (KV memory)
ADMIN_SOCKET_NAME = "admin.sock"

Pairs = tuple[tuple[str, Path], ...]  # (group, interpreter) in the order given
Env = Mapping[str, str]
# A derived default sees the environment and the options resolved before it.
DefaultFn = Callable[[Env, Mapping[str, Any]], Any]

_GROUP_RE = re.compile(r"[A-Za-z0-9_.:-]+")


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


# --- conversion: each returns the typed value or raises ValueError(reason) ----------


def _to_int(v: Any) -> int:
    if isinstance(v, bool):
        raise ValueError(f"not an integer: {v!r}")
    if isinstance(v, int):
        return v
    if isinstance(v, str):
        try:
            return int(v.strip())
        except ValueError:
            pass
    raise ValueError(f"not an integer: {v!r}")


_BYTE_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def _to_bytes(v: Any) -> int:
    """A byte count: an integer, or a number with a binary unit ("512M", "1.5G", "2GiB")."""
    if isinstance(v, str):
        m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([kmgt]?)(?:i?b)?\s*", v.lower())
        if m is None:
            raise ValueError(f"not a byte count (e.g. 4096, 512M, 2G): {v!r}")
        return int(float(m[1]) * _BYTE_UNITS[m[2]])
    return _to_int(v)


def _to_float(v: Any) -> float:
    if isinstance(v, bool):
        raise ValueError(f"not a number: {v!r}")
    try:
        x = float(v.strip() if isinstance(v, str) else v)
    except (TypeError, ValueError):
        raise ValueError(f"not a number: {v!r}") from None
    if not math.isfinite(x):
        raise ValueError(f"not a finite number: {v!r}")
    return x


def _to_pool(v: Any) -> int | str:
    """KV Flash pool: a token count, or "auto"."""
    if isinstance(v, str) and v.strip().lower() == "auto":
        return "auto"
    n = _to_int(v)
    if n < 1:
        raise ValueError(f"a pool needs tokens (or auto), got {n}")
    return n


def _to_experts(v: Any) -> int | None:
    """MoE hot experts per layer: a count, or "all" (None)."""
    if isinstance(v, str) and v.strip().lower() == "all":
        return None
    n = _to_int(v)
    if n < 0:
        raise ValueError(f"a count of experts (or all), got {n}")
    return n


def _to_str(v: Any) -> str:
    if not isinstance(v, str):
        raise ValueError(f"not a string: {v!r}")
    if not v:
        raise ValueError("empty string")
    return v


def _to_bool(v: Any) -> bool:
    if isinstance(v, bool):
        return v
    if isinstance(v, str) and v.strip().lower() in ("1", "true", "yes", "on"):
        return True
    if isinstance(v, str) and v.strip().lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a boolean (true / false): {v!r}")


def _to_strs(v: Any) -> tuple[str, ...]:
    """A list of names: "a,b" (flag, env) or a TOML array of strings."""
    items = v.split(",") if isinstance(v, str) else v
    if not isinstance(items, list | tuple):
        raise ValueError(f"not a list of strings: {v!r}")
    return tuple(_to_str(s.strip() if isinstance(s, str) else s) for s in items if s != "")


def _to_path(v: Any) -> Path:
    if isinstance(v, Path):
        return v
    return Path(_to_str(v)).expanduser()


def _to_pairs(v: Any) -> Pairs:
    """GROUP=PATH items: "a=/x,b=/y" (env), a list of "GROUP=PATH", a TOML table, or pairs."""
    if isinstance(v, str):
        items: list[Any] = [s for s in (p.strip() for p in v.split(",")) if s]
    elif isinstance(v, Mapping):
        items = list(v.items())
    elif isinstance(v, list | tuple):
        items = list(v)
    else:
        raise ValueError(f"not a list of GROUP=PATH: {v!r}")
    out: dict[str, Path] = {}
    for item in items:
        if isinstance(item, str):
            group, sep, path = item.partition("=")
            if not sep:
                raise ValueError(f"not GROUP=PATH: {item!r}")
        elif isinstance(item, tuple | list) and len(item) == 2:
            group, path = item
        else:
            raise ValueError(f"not GROUP=PATH: {item!r}")
        if not isinstance(group, str) or not _GROUP_RE.fullmatch(group):
            raise ValueError(f"bad group name {group!r} (letters, digits, _ . : -)")
        if group in out:
            raise ValueError(f"group {group!r} given twice")
        try:
            out[group] = _to_path(path)
        except ValueError as exc:
            raise ValueError(f"group {group!r}: {exc}") from None
    return tuple(out.items())


def _unflagged(parse: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """A placement parser whose errors drop their flag prefix (the label adds the source)."""

    def convert(v: Any) -> Any:
        try:
            return parse(v)
        except PlacementError as exc:
            raise ValueError(str(exc).split(": ", 1)[-1]) from None

    return convert


_CONVERTERS: dict[str, Callable[[Any], Any]] = {
    "devices": _unflagged(parse_devices),
    "device": _unflagged(lambda v: parse_device(str(v).strip())[0]),
    "weights": _unflagged(parse_weights),
    "int": _to_int,
    "pool": _to_pool,
    "experts": _to_experts,
    "bytes": _to_bytes,
    "float": _to_float,
    "str": _to_str,
    "path": _to_path,
    "pairs": _to_pairs,
    "bool": _to_bool,
    "strs": _to_strs,
}


@dataclass(frozen=True)
class Option:
    """One daemon option. ``default`` is a value, or a function for derived defaults."""

    name: str
    type: str  # a key of _CONVERTERS
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

    @property
    def flag(self) -> str:
        return self.metavar if self.positional else "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return "LUCED_" + self.name.upper()

    @property
    def repeatable(self) -> bool:
        return self.type == "pairs"

    def convert(self, value: Any, label: str) -> Any:
        """The typed, validated value; errors are ``ConfigError("{label}: {reason}")``."""
        if value is None:
            if self.nullable:
                return None
            raise ConfigError(f"{label}: a value is required")
        try:
            out = _CONVERTERS[self.type](value)
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
        "model", "path", None, "GGUF model file to serve.",
        nullable=True, positional=True, metavar="MODEL",
        default_doc="the bundled SmolLM2-135M-Instruct",
        example="/var/lib/luced/models/model.gguf",
    ),
    Option("host", "str", "127.0.0.1", "Address the HTTP server listens on."),
    Option("port", "int", 8000, "HTTP port (0 picks a free one).", minimum=0, maximum=65535),
    Option(
        "api_key", "str", None,
        "If set, /v1/* requests (and /tokenize, /detokenize, and /metrics unless "
        "metrics_public) must send `Authorization: Bearer KEY` or `x-api-key: KEY`. A flag "
        "shows in `ps`: prefer the environment or api_key_file.",
        nullable=True, default_doc="unset (no key)", example="change-me",
    ),
    Option(
        "api_key_file", "path", None,
        "File whose first line is the API key (instead of api_key; keeps it out of `ps`).",
        nullable=True, default_doc="unset", example="/etc/luced/api-key",
    ),
    Option(
        "metrics_public", "bool", False,
        "Serve /metrics without the API key.",
        default_doc="false", example=True,
    ),
    Option(
        "allowed_hosts", "strs", (),
        "Host header values accepted besides the bound address (and localhost names when "
        "bound to loopback); anything else is a 403, which stops DNS rebinding. Bound to "
        "0.0.0.0 or :: with none given, any Host is accepted.",
        default_doc="none", example=("luced.example.org",),
    ),
    Option(
        "allowed_origins", "strs", (),
        "Browser origins allowed to call the API (CORS); preflights from any other "
        "origin are refused.",
        default_doc="none (no cross-origin calls)", example=("http://localhost:3000",),
    ),
    Option(
        "model_name", "str", None, "Model id served on /v1/models and expected in requests.",
        nullable=True, default_doc="the GGUF file name without .gguf", example="smollm2",
    ),
    Option(
        "dtype", "str", "float32", "Compute dtype of the workers.",
        choices=("float32", "bfloat16", "float16"),
    ),
    Option(
        "weights", "str", "auto",
        "How the workers hold weight matrices. `int4` / `int8`: packed for weight-only "
        "kernels (see `kernels`; 4.5 / 8 bits per weight read per decoded token; GGUF Q4_0 "
        "and Q4_1 map to int4 exactly, other types are requantized). `auto`: per tensor "
        "(4-bit types int4, 5- to 8-bit types int8, float tensors exact) where the CPU has "
        "the kernels' AVX2 / AVX512 paths, else `dequant`. `dequant`: every matrix "
        "expanded to the compute dtype (the exact path; GPUs use it for now).",
        choices=WEIGHT_MODES,
    ),
    Option(
        "kernels", "str", "auto",
        "Which kernels run packed matrices and decode attention on CPU workers. `native`: "
        "luced's own (C, built with the system's gcc into ~/.cache/luced/kernels on first "
        "use; `tools/install.sh` prebuilds them), an error if they cannot be built. "
        "`torch`: torch's weight-only kernels and SDPA. `auto`: native where they build, "
        "else torch with one warning.",
        choices=("auto", "native", "torch"),
    ),
    Option(
        "kv_dtype", "str", "auto",
        "dtype of the K/V cache. `auto` = `--dtype`. bfloat16 / float16 halve the KV "
        "memory of a float32 model. On CPUs attention (decode and prefill) reads 16-bit "
        "rows in luced's kernel with float32 arithmetic (bfloat16 is the faster at long "
        "contexts, README: KV dtype and attention at long contexts); GPUs attend in the "
        "cache's dtype.",
        choices=("auto", "float32", "bfloat16", "float16"),
    ),
    Option(
        "batch_invariant", "bool", False,
        "Make every token's logits independent of how tokens are grouped into forwards "
        "where luced's native kernels do not already: they do by default for packed "
        "matrices (`--weights auto`, `int4`, `int8`) and for attention on CPUs, so a "
        "prompt restored from the prefix cache gives the fresh prompt's logits bit for bit "
        "without this (README: Exactness). This adds torch's packed kernels "
        "(`LUCED_KERNELS=torch`, no compiler: 64 rows at a time instead of dense) and "
        "attention the native kernel does not take (SDPA query by query), at a cost. Not "
        "covered: float-held matrices, MoE routers, Gated DeltaNet, KV Flash.",
    ),
    Option(
        "threads", "int", None, "Torch threads per CPU worker.",
        minimum=1, nullable=True, example=4,
        default_doc="the usable CPU cores, shared among the target's workers (at least 1 "
        "each)",
    ),
    Option(
        "context_length", "int", None, "Context window in tokens (prompt + completion).",
        minimum=1, nullable=True,
        default_doc=f"the model's, at most {CONTEXT_CAP}", example=CONTEXT_CAP,
    ),
    Option(
        "max_queue", "int", 16,
        "Requests that may wait behind the running ones; more are answered 429.", minimum=0,
    ),
    Option(
        "max_running", "int", 8,
        "Requests generated at once (continuous batching): each runs in its own sequence "
        "of the workers, their decode steps go through the model together in one forward "
        "per step, and a new request's prompt is prefilled between those steps. 1 serves "
        "one request at a time. With `--kv-flash` each running request pages its own pool. "
        "Greedy speculative requests (`--draft ngram` or a DFlash draft model) put their "
        "verify blocks in the batch.",
        minimum=1, maximum=64,
    ),
    Option(
        "kv_pool_tokens", "int", 0,
        "KV positions the running requests hold together (continuous batching). When a "
        "running request cannot grow, the one that arrived last is preempted: its KV is "
        "freed and it is recomputed when there is room, with the same output. At least "
        "the context length; 0 = max-running whole contexts, or what half the free memory "
        "holds if less.",
        minimum=0,
    ),
    Option(
        "kv_block_size", "int", 16,
        "Rows per block of the workers' K/V pool (continuous batching): every running "
        "request's K/V lives in blocks of one pool per worker shard, so a request whose "
        "prompt starts like a running one's takes that prefix's blocks without computing or "
        "copying them. 0: each request's K/V on its own, nothing shared. Not used with "
        "`--kv-flash` or `--max-running 1`; a hybrid (recurrent) model does not share.",
        minimum=0, maximum=1024,
    ),
    Option(
        "max_queued_tokens", "int", 32768,
        "Prompt tokens that may wait in the queue; more are answered 429.", minimum=1,
    ),
    Option(
        "max_batch_tokens", "int", 512,
        "Prefill chunk: prompt tokens fed to the model per step.", minimum=1,
    ),
    Option(
        "default_max_tokens", "int", None,
        "Completion limit for requests that give no max_tokens.",
        minimum=1, nullable=True, default_doc="up to the context length", example=1024,
    ),
    Option(
        "shutdown_timeout", "float", 30.0,
        "Seconds SIGTERM waits for running streams before aborting them.", minimum=0,
    ),
    Option(
        "http_timeout", "float", 30.0,
        "Seconds an HTTP client may take to send a whole request header, or its body, or "
        "stay idle between requests on a kept-alive connection, before it is closed (a "
        "slow body gets a 408).",
        minimum=0.1,
    ),
    Option(
        "max_connections", "int", 512,
        "Concurrent HTTP connections; more are answered 503 and closed at once. Each "
        "costs a file descriptor: keep it below the process's open-file limit.",
        minimum=1,
    ),
    Option(
        "worker_timeout", "float", 30.0,
        "Seconds a worker call may take beyond 20× its expected time (the worker's "
        "measured seconds per token × the call's tokens) before the worker counts as hung "
        "(stopped, deadlocked): it is killed and restarted, the running request ends with "
        "an error, queued ones wait for the restart. Loads have no deadline.",
        minimum=0.1,
    ),
    Option(
        "runtime_dir", "path",
        lambda env, values: default_runtime_dir(env),
        "Directory for the admin socket.",
        default_doc="$RUNTIME_DIRECTORY, else $XDG_RUNTIME_DIR/luced, else /tmp/luced-$UID",
        example="/run/luced",
    ),
    Option(
        "admin_socket", "path",
        lambda env, values: values["runtime_dir"] / ADMIN_SOCKET_NAME,
        "Admin unix socket (mode 0600) that lucectl talks to.",
        default_doc=f"RUNTIME_DIR/{ADMIN_SOCKET_NAME}",
        example=f"/run/luced/{ADMIN_SOCKET_NAME}",
    ),
    Option(
        "backend_python", "pairs", (),
        "GROUP=PATH: the Python interpreter for a backend group's worker (e.g. a ROCm "
        "torch beside a CUDA one). Repeat the flag; the environment variable takes a "
        "comma-separated list, the file a table.",
        default_doc="the daemon's interpreter for every group",
        example=(("hip", Path("/opt/luced/rocm-venv/bin/python")),),
    ),
    Option(
        "target_devices", "devices", ("cpu",),
        "Devices of the target model, one layer shard each, in layer order (e.g. "
        "`cuda:0,cuda:1,hip:0`). `cuda:N` devices form one worker, `hip:N` another; "
        "`cpu`, `cpu:1`, `cpu:2` are distinct CPU workers; a repeated device (`cpu,cpu`) "
        "is two shards in one worker.",
        default_doc="cpu (one worker, no split)", example=("cpu", "cpu:1"),
    ),
    Option(
        "target_layer_split", "weights", None,
        "Relative layer counts of the shards of --target-devices (e.g. `0.08,0.46,0.46` "
        "or `1,1`); contiguous ranges, each at least one layer.",
        nullable=True, default_doc="equal shares", example=(1, 1),
    ),
    Option(
        "draft", "path", None,
        "DFlash draft (GGUF file or safetensors directory), or `ngram` for prompt-lookup "
        "drafting without a model (proposals copied from earlier in the prompt and output; "
        "pays on input-grounded work). Requests decode speculatively, a block at a time, "
        "with output exactly as plain decoding's (greedy token for token; sampled by "
        "rejection sampling). A draft file named ngram is given with its directory.",
        nullable=True, default_doc="none (plain decoding)",
        example="/var/lib/luced/models/draft.gguf",
    ),
    Option(
        "draft_device", "device", None,
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
        "block_size", "int", 16,
        "Tokens per speculative block: the last accepted token plus block_size - 1 "
        "proposals. With --adaptive-block-size, the largest block and where each request "
        "starts.",
        minimum=2, maximum=64,
    ),
    Option(
        "adaptive_block_size", "bool", True,
        "Each speculating request picks its block size from its own recent acceptance "
        "and the step costs measured at start (a plain step against a verify of k "
        "tokens), and decodes plainly while drafting does not pay. Output is the same "
        "either way; only speed changes. Seeded sampled requests keep --block-size, so a "
        "seed repeats its tokens.",
    ),
    Option(
        "prefix_cache_bytes", "bytes", 2**30,
        "Size of the prefix cache's shared-memory arena of KV snapshots (e.g. `512M`, "
        "`4G`; 0 turns the prefix cache off). SmolLM2-135M in float32 needs 45 KiB per "
        "cached token, so the default holds about 23k tokens. Capped, with a warning, at "
        "half the free space of /dev/shm.",
        minimum=0, default_doc="1G", example="4G",
    ),
    Option(
        "kv_cache_dir", "path", None,
        "Directory of the prefix cache's disk tier: snapshots are written there as "
        "safetensors files in the background and found again after a restart.",
        nullable=True, default_doc="none (memory only)", example="/var/lib/luced/kv",
    ),
    Option(
        "kv_cache_budget", "bytes", 8 * 2**30,
        "Most bytes the disk tier keeps; least recently used snapshots go first.",
        minimum=0, default_doc="8G", example="64G",
    ),
    Option(
        "kv_flash", "pool", None,
        "KV Flash: keep at most this many tokens of K/V per attention layer in the "
        "workers (a pool of 64-token blocks; rounded up to a multiple of 256, clamped to "
        "the context); older 64-token chunks are paged out to a shared-memory host tier "
        "and attention skips them. Each running request has a pool of its own. `auto` "
        "sizes the pools from free memory (shared by max_running of them), each capped by "
        "kv_flash_max_pool. Lossless while the sequence fits the pool.",
        nullable=True, default_doc="off (every worker keeps the whole context)", example="auto",
    ),
    Option(
        "kv_flash_policy", "str", "qk",
        "Which chunk KV Flash evicts when the pool is full. `lru`: the least recently "
        "written (StreamingLLM: sinks + recency, never recalled). `qk`: the lowest score "
        "by the cosine of the current query with each chunk's mean key; every "
        "max(tau, history/45) tokens the top-scored chunks are made resident, recalled "
        "from the host tier.",
        choices=("lru", "qk"),
    ),
    Option(
        "kv_flash_tau", "int", 64,
        "KV Flash reselection interval floor in generated tokens (max(tau, history/45)).",
        minimum=1,
    ),
    Option(
        "kv_flash_max_pool", "int", 16384,
        "Largest pool `--kv-flash auto` picks (tokens): attention cost per step grows "
        "with it.",
        minimum=512,
    ),
    Option(
        "moe_hot_experts", "experts", None,
        "MoE models: routed experts each target worker keeps per layer (the lowest ids, "
        "or the most routed ones given --moe-routing-profile); the other (cold) experts of "
        "a token are computed in process on the CPU from the mapped GGUF, and their sum "
        "added to the hot ones'. `all` keeps every expert.",
        nullable=True, default_doc="all (every expert in the target's workers)", example=4,
    ),
    Option(
        "moe_routing_profile", "path", None,
        "With --moe-hot-experts: a routing profile of this model (per-layer expert "
        "selection counts, JSON, recorded by tools/moe_profile.py); each layer keeps its "
        "most-routed experts hot. A profile of another model is a start-up error.",
        nullable=True, default_doc="none (the lowest ids are hot)",
        example="/var/lib/luced/models/model.routing.json",
    ),
    Option(
        "moe_expert_device", "device", None,
        "MoE models with --moe-hot-experts: compute the cold experts in an expert worker "
        "on this device (`cpu:1`, `cuda:1`, ...), which holds exactly them; target workers "
        "call it directly over shared memory, one call per MoE layer per step. While it is "
        "down (it is restarted) they compute them in process.",
        nullable=True, default_doc="none (cold experts in process)", example="cpu:1",
    ),
    Option(
        "moe_expert_required", "bool", False,
        "With --moe-expert-device: a step whose expert worker fails is an error instead of "
        "being computed in process.",
    ),
    Option(
        "log_level", "str", "info", "Log level.",
        choices=("debug", "info", "warning", "error"),
    ),
)  # fmt: skip
OPTION_BY_NAME: dict[str, Option] = {o.name: o for o in OPTIONS}


@dataclass(frozen=True)
class Config:
    """Every daemon option, typed and validated. Build with ``load_config`` or
    ``Config.from_values``; unset lazy values are resolved by the methods below."""

    model: Path | None  # None: the bundled default (see model_path)
    host: str
    port: int
    api_key: str | None = field(repr=False)  # kept out of logs
    api_key_file: Path | None
    metrics_public: bool
    allowed_hosts: tuple[str, ...]
    allowed_origins: tuple[str, ...]
    model_name: str | None  # None: the GGUF stem (see served_model_name)
    dtype: str
    weights: str
    kernels: str
    kv_dtype: str
    batch_invariant: bool
    threads: int
    context_length: int | None  # None: the model's, capped (see effective_context_length)
    max_queue: int
    max_running: int
    kv_pool_tokens: int
    kv_block_size: int
    max_queued_tokens: int
    max_batch_tokens: int
    default_max_tokens: int | None
    shutdown_timeout: float
    http_timeout: float
    max_connections: int
    worker_timeout: float
    runtime_dir: Path
    admin_socket: Path
    backend_python: Pairs
    target_devices: tuple[str, ...]
    target_layer_split: tuple[float, ...] | None  # None: equal shares
    draft: Path | None  # None: plain decoding
    draft_device: str | None
    block_size: int
    adaptive_block_size: bool
    prefix_cache_bytes: int
    kv_cache_dir: Path | None
    kv_cache_budget: int
    kv_flash: int | str | None  # None: off; tokens or "auto" (see luced.engine.kvflash)
    kv_flash_policy: str
    kv_flash_tau: int
    kv_flash_max_pool: int
    moe_hot_experts: int | None  # None: all
    moe_routing_profile: Path | None  # None: the lowest ids are hot
    moe_expert_device: str | None  # None: cold experts in process
    moe_expert_required: bool
    log_level: str
    # option name -> where its value came from ("--port", "LUCED_PORT", "FILE: port", ...)
    sources: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        for opt in OPTIONS:
            value = opt.convert(getattr(self, opt.name), self.label(opt.name))
            object.__setattr__(self, opt.name, value)
        object.__setattr__(self, "sources", dict(self.sources))
        if (
            self.default_max_tokens is not None
            and self.context_length is not None
            and self.default_max_tokens > self.context_length
        ):
            raise ConfigError(
                f"{self.label('default_max_tokens')}: {self.default_max_tokens} exceeds "
                f"context_length {self.context_length}"
            )
        split = self.target_layer_split
        if split is not None and len(split) != len(self.target_devices):
            raise ConfigError(
                f"{self.label('target_layer_split')}: {len(split)} weights for "
                f"{len(self.target_devices)} devices in {self.label('target_devices')}"
            )

    @classmethod
    def from_values(
        cls,
        values: Mapping[str, Any] | None = None,
        *,
        sources: Mapping[str, str] | None = None,
        env: Env | None = None,
    ) -> Config:
        """A Config from the given values (raw or typed); the rest get their defaults."""
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
        return cls(**resolved, sources=sources)

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

    def effective_kv_dtype(self) -> str:
        """--kv-dtype resolved: the K/V rows' dtype."""
        return self.dtype if self.kv_dtype == "auto" else self.kv_dtype

    def label(self, name: str) -> str:
        """How errors name an option: by its source, or by its name."""
        src = self.sources.get(name)
        return name if src in (None, "default") else src

    def model_path(self) -> Path:
        """The GGUF to serve; resolving the bundled default only when asked."""
        if self.model is not None:
            return self.model
        from luced.serve.bundled import default_model_path

        return default_model_path()

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

    @property
    def lookup_drafts(self) -> bool:
        """--draft ngram: prompt-lookup drafting in the daemon, no draft model."""
        return self.draft is not None and str(self.draft) == "ngram"

    def draft_python(self) -> str | None:
        """The interpreter of the draft's group when --draft-device names one."""
        if self.draft_device is None:
            return None
        return self.worker_python(parse_device(self.draft_device)[1])


def _check_table() -> None:
    names = [f.name for f in fields(Config) if f.name != "sources"]
    if names != [o.name for o in OPTIONS]:
        raise AssertionError("Config fields and OPTIONS differ (names or order)")
    for opt in OPTIONS:
        if (opt.default is None or callable(opt.default)) and opt.default_doc is None:
            raise AssertionError(f"option {opt.name}: a derived or unset default needs default_doc")


_check_table()


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
        text = f"{opt.help} (env {opt.env}; default {_default_text(opt)})".replace("%", "%%")
        if opt.positional:
            parser.add_argument(
                opt.name, nargs="?", default=argparse.SUPPRESS, metavar=opt.metavar, help=text
            )
            continue
        kwargs: dict[str, Any] = {"dest": opt.name, "default": argparse.SUPPRESS, "help": text}
        if opt.repeatable:
            kwargs.update(action="append", metavar="GROUP=PATH")
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


# --- documentation generated from the table --------------------------------------------


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, str | Path):
        return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, tuple) and not all(isinstance(p, tuple) for p in v):  # list -> array
        return "[" + ", ".join(_toml_value(p) for p in v) + "]"
    if isinstance(v, tuple):  # pairs -> inline table
        return "{ " + ", ".join(f"{k} = {_toml_value(p)}" for k, p in v) + " }"
    raise TypeError(f"no TOML form for {v!r}")


def _default_text(opt: Option) -> str:
    """The default as prose (help, README): derived ones by their description."""
    if opt.default_doc is not None:
        return opt.default_doc
    if opt.type in ("int", "float"):
        return _num(opt.default)
    return str(opt.default)


def options_markdown() -> str:
    """The README options table."""

    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    def code(text: str) -> str:
        return f"`{text}`"

    rows = [
        "| TOML key | Flag | Environment | Default | Meaning |",
        "|---|---|---|---|---|",
        "| — | `--config PATH` | `LUCED_CONFIG` | `/etc/luced/luced.toml` if present "
        "| The TOML file read for the options below. |",
    ]
    for opt in OPTIONS:
        flag = f"`{opt.flag}` (positional)" if opt.positional else code(opt.flag)
        if opt.repeatable:
            flag = f"`{opt.flag} GROUP=PATH` (repeatable)"
        default = _default_text(opt)
        if opt.default_doc is None:
            default = code(default)
        meaning = opt.help
        if opt.choices:
            meaning += " One of " + ", ".join(code(c) for c in opt.choices) + "."
        rows.append(
            f"| {code(opt.name)} | {flag} | {code(opt.env)} | {cell(default)} | {cell(meaning)} |"
        )
    return "\n".join(rows) + "\n"


def example_toml() -> str:
    """The text of systemd/luced.toml.example: every option, commented out."""
    out = [
        "# luced configuration: copy to /etc/luced/luced.toml and uncomment what you change.",
        "# Every option is a top-level key. Precedence: `luced serve` flags > LUCED_*",
        "# environment variables > this file > defaults.",
        "# Generated by `python -m luced.serve.config toml` from the option table",
        "# in luced/serve/config.py.",
    ]
    for opt in OPTIONS:
        out.append("")
        out.extend(
            textwrap.wrap(
                opt.help, 86, initial_indent="# ", subsequent_indent="# ", break_on_hyphens=False
            )
        )
        if opt.choices:
            out.append("# One of: " + ", ".join(opt.choices) + ".")
        if opt.default_doc is not None:
            out.append(f"# Default: {opt.default_doc}.")
        shown = opt.example if opt.default_doc is not None else opt.default
        out.append(f"#{opt.name} = {_toml_value(shown)}")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else ""
    if what == "markdown":
        sys.stdout.write(options_markdown())
    elif what == "toml":
        sys.stdout.write(example_toml())
    else:
        sys.exit("usage: python -m luced.serve.config markdown|toml")
