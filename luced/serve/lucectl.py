"""lucectl: ask a running luced about itself over the admin socket.

    lucectl [--socket PATH] [--json] [--timeout S] COMMAND [--json] [--timeout S]

    status | workers | metrics | drain [--no-wait] | snapshot list | snapshot drop ID
    | snapshot save | cache clear [--disk] --yes | models | load NAME | unload NAME [--force]

``--json`` and ``--timeout`` go before or after the command. ``drain`` waits until the
daemon has stopped; its ``--timeout`` bounds that wait (exit 1 when it passes).

A daemon serving several models: `models` lists them (state, memory, last use), `load`
and `unload` change that (`load` waits for the load; `unload` refuses a model with
requests running or queued unless --force, which ends them with an error), and status,
workers, snapshot and cache take `--model NAME` (status and workers without it: every
model).

The socket: ``--socket``, else ``$LUCED_ADMIN_SOCKET``, else the daemon's default
(``luced.serve.options.default_admin_socket``); when that does not exist but the systemd
unit's ``/run/luced/admin.sock`` does, that one. Tables by default; ``--json`` prints
the daemon's reply line as it came.

Exit status: 0 done; 1 the daemon answered with an error (or not in time);
2 the daemon could not be reached (not running, permission denied) or bad usage.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from luced.ipc.frames import KERNELS_FALLBACK
from luced.serve.options import default_admin_socket

SYSTEMD_SOCKET = Path("/run/luced/admin.sock")  # RuntimeDirectory=luced in luced.service
DEFAULT_TIMEOUT = 10.0

EXIT_FAILED = 1
EXIT_UNREACHABLE = 2


class Unreachable(Exception):
    """No daemon to talk to at the socket path."""


class Failed(Exception):
    """The daemon was reached but gave no usable answer."""


def resolve_socket(arg: str | None, env: Mapping[str, str] | None = None) -> Path:
    env = os.environ if env is None else env
    if arg:
        return Path(arg)
    if env.get("LUCED_ADMIN_SOCKET"):
        return Path(env["LUCED_ADMIN_SOCKET"])
    path = default_admin_socket(env)
    if not path.exists() and SYSTEMD_SOCKET.exists():
        return SYSTEMD_SOCKET
    return path


def request(path: Path, cmd: str, timeout: float | None, **args: Any) -> tuple[bytes, dict]:
    """One request -> (the reply line, its parsed JSON)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        try:
            sock.connect(str(path))
        except FileNotFoundError:
            raise Unreachable(f"luced is not running (no socket at {path})") from None
        except ConnectionRefusedError:
            raise Unreachable(f"luced is not running (nothing listens on {path})") from None
        except PermissionError:
            raise Unreachable(
                f"permission denied connecting to {path} (run as the daemon's user or as root)"
            ) from None
        except OSError as exc:
            raise Unreachable(f"cannot connect to {path}: {exc.strerror or exc}") from None
        # If the daemon hung up at once, its refusal line is still to be read.
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            sock.sendall(json.dumps({"cmd": cmd, **args}).encode() + b"\n")
        buf = b""
        try:
            while b"\n" not in buf:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                buf += chunk
        except TimeoutError:
            raise Failed(f"luced did not answer {cmd!r} within {timeout:g} s") from None
        except ConnectionResetError:
            pass
    line = buf.split(b"\n", 1)[0]
    if not line:
        raise Failed("luced closed the connection without a reply")
    try:
        reply = json.loads(line)
    except json.JSONDecodeError:
        raise Failed(f"luced sent a reply that is not JSON: {line[:200]!r}") from None
    if not isinstance(reply, dict):
        raise Failed(f"luced sent a reply that is not an object: {line[:200]!r}")
    return line, reply


# --- formatting --------------------------------------------------------------------------


def human_bytes(n: Any) -> str:
    if not isinstance(n, int | float):
        return fmt(n)
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            return f"{int(size)} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def human_duration(seconds: Any) -> str:
    if not isinstance(seconds, int | float):
        return fmt(seconds)
    s = int(seconds)
    d, s = divmod(s, 86400)
    h, s = divmod(s, 3600)
    m, s = divmod(s, 60)
    if d:
        return f"{d}d {h}h {m:02d}m"
    if h:
        return f"{h}h {m:02d}m {s:02d}s"
    if m:
        return f"{m}m {s:02d}s"
    return f"{s}s"


def human_age(unix_time: Any, now: float) -> str:
    if not isinstance(unix_time, int | float):
        return fmt(unix_time)
    return human_duration(max(0.0, now - unix_time)) + " ago"


def short_tail(text: Any, width: int = 40) -> str:
    """The end of a text as one cell (…, then its last width - 1 characters)."""
    s = fmt(text).replace("\r", "\\r").replace("\n", "\\n").replace("\t", "\\t")
    return s if len(s) <= width else "…" + s[-(width - 1) :]


def fmt(value: Any) -> str:
    """A JSON value as one table cell."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    if isinstance(value, list):
        return ",".join(fmt(v) for v in value)
    if isinstance(value, dict):
        return ", ".join(f"{k}={fmt(v)}" for k, v in value.items())
    return str(value)


def _numeric(cell: str) -> bool:
    return cell.replace(".", "", 1).isdigit() or cell == "-"


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Columns two spaces apart; numeric columns right-aligned."""
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(header)]
    right = [bool(rows) and all(_numeric(r[i]) for r in rows) for i in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        parts = [
            c.rjust(w) if r else c.ljust(w) for c, w, r in zip(cells, widths, right, strict=True)
        ]
        return "  ".join(parts).rstrip()

    return "\n".join([line(header), *(line(r) for r in rows)])


def _layers(value: Any) -> str:
    if isinstance(value, list) and len(value) == 2:
        return f"[{value[0]}, {value[1]})"  # half-open, as in the frames
    return fmt(value)


WORKER_COLUMNS = ("group", "pid", "state", "devices", "layers", "restarts")
# The counters of a worker process (a row's "stats", from the worker's `stats` frame) shown
# as the last columns; --json has them all.
WORKER_COUNTERS = {
    "rss_bytes": "RSS",
    "busy_s": "BUSY",
    "forward_count": "FORWARDS",
    "tokens_processed": "TOKENS",
    "decode_graph_steps": "GRAPH_STEPS",
    "ahead_served": "AHEAD_SERVED",
    "ahead_dropped": "AHEAD_DROPPED",
}


def workers_table(workers: Sequence[Mapping[str, Any]]) -> str:
    if not workers:
        return "(no workers)"
    rows = [_with_counters(w) for w in workers]
    keys = list(WORKER_COLUMNS)
    for w in rows:  # extra fields the daemon reports become extra columns
        keys += [k for k in w if k not in keys]
    keys = [k for k in keys if any(k in w for w in rows)]

    def cell(w: Mapping[str, Any], k: str) -> str:
        value = w.get(k)
        if k == "layers":
            return _layers(value)
        if k == "busy_s" and isinstance(value, int | float) and value < 60:
            return f"{value:.1f}s"  # compute time: a short run's is under a second
        if k.endswith("bytes"):
            return human_bytes(value)
        if k.endswith("_s"):
            return human_duration(value)
        return fmt(value)

    header = [WORKER_COUNTERS.get(k) or k.removesuffix("_s").upper() for k in keys]
    return table(header, [[cell(w, k) for k in keys] for w in rows])


def _with_counters(worker: Mapping[str, Any]) -> dict[str, Any]:
    """A worker's row with its process's counters last, in place of its "stats"."""
    row = {k: v for k, v in worker.items() if k != "stats"}
    stats = worker.get("stats")
    if isinstance(stats, Mapping):
        row |= {k: stats[k] for k in WORKER_COUNTERS if k in stats}
    return row


def _placement(value: Any) -> str:
    if not isinstance(value, list):
        return fmt(value)
    parts = []
    for p in value:
        if isinstance(p, dict):
            parts.append(f"{p.get('group')} [{fmt(p.get('devices'))}]: {_layers(p.get('layers'))}")
        else:
            parts.append(fmt(p))
    return "; ".join(parts)


def _queue(q: Any) -> str:
    if not isinstance(q, dict):
        return fmt(q)
    text = f"{q.get('running', 0)} running"
    if "max_running" in q:
        text += f" (max {q['max_running']})"
    text += f", {q.get('waiting', 0)} waiting"
    if "max_queue" in q:
        text += f" (max {q['max_queue']})"
    tokens = q.get("queued_tokens", q.get("waiting_tokens"))
    if tokens is not None:
        text += f", {tokens} prompt tokens waiting"
        if "max_queued_tokens" in q:
            text += f" (max {q['max_queued_tokens']})"
    if q.get("mean_batch") is not None:
        text += f"; {q['batched_steps']} batched steps, {q['mean_batch']} sequences each"
    if q.get("kv_kept_requests"):  # finished requests' prompt blocks, for later prompts
        paged = q.get("kv_kept_paged_tokens")
        text += (
            f"; finished prompts kept in the KV pool: {q['kv_kept_requests']} "
            f"({q.get('kv_kept_tokens', 0)} tokens"
            + (f", {paged} paged out to host memory)" if paged else ")")
        )
    # Each running and waiting request and its tokens so far.
    for key, label in (("requests", "running"), ("waiting_requests", "waiting")):
        for r in q.get(key) or []:
            text += (
                f"\n  {fmt(r.get('id'))} {label}: {fmt(r.get('prompt_tokens'))} prompt + "
                f"{fmt(r.get('completion_tokens'))} generated"
            )
    return text


def _counts(t: Any) -> str:
    """{"prompt_tokens": 5, "errors": 0} -> "5 prompt tokens, 0 errors"."""
    if not isinstance(t, dict):
        return fmt(t)
    return ", ".join(f"{fmt(v)} {k.replace('_', ' ')}" for k, v in t.items())


def _prefix_cache(c: Any) -> str:
    """The engine's prefix_cache status as one line ("off" when it is null)."""
    if c is None:
        return "off"
    if not isinstance(c, dict):
        return fmt(c)
    disk = ""
    if c.get("disk_budget") is not None:
        used = (c.get("disk_bytes") or 0) + (c.get("disk_block_bytes") or 0)
        disk = f", disk {human_bytes(used)} of {human_bytes(c.get('disk_budget'))}"
        if c.get("disk_blocks"):
            disk += f" ({fmt(c.get('disk_blocks'))} K/V blocks{_states(c.get('disk_states'))})"
    if c.get("disk_error"):
        disk += f", disk writes PAUSED: {c.get('disk_error')}"
    if c.get("disk_problem"):
        disk = f", disk tier OFF (memory only): {c.get('disk_problem')}"
    held = (
        f"{fmt(c.get('entries'))} snapshots ({fmt(c.get('memory_entries'))} in memory, "
        f"{fmt(c.get('disk_entries'))} on disk)"
    )
    if c.get("memory_blocks") and not c.get("entries"):  # prompts kept as K/V blocks
        states = _states(c.get("memory_states"))
        held = f"{fmt(c.get('memory_blocks'))} K/V blocks{states} in memory"
    return (
        f"{held}, memory {human_bytes(c.get('memory_bytes'))} "
        f"of {human_bytes(c.get('memory_capacity'))}{disk}; {fmt(c.get('hits'))} hits "
        f"({fmt(c.get('hit_tokens'))} tokens) in {fmt(c.get('queries'))} lookups"
    )


def _states(n: Any) -> str:
    """A hybrid's recurrent states beside its blocks: ", 3 recurrent states", or nothing."""
    return f", {fmt(n)} recurrent states" if n else ""


def _kv_flash(f: Any) -> str:
    """The engine's kv_flash status as one line ("off" when it is null)."""
    if f is None:
        return "off"
    if not isinstance(f, dict):
        return fmt(f)
    return (
        f"pool {fmt(f.get('pool_tokens'))} tokens ({fmt(f.get('policy'))}), "
        f"{fmt(f.get('resident_blocks'))} blocks resident, "
        f"{fmt(f.get('paged_out_blocks'))} paged out ({human_bytes(f.get('host_bytes'))}); "
        f"{fmt(f.get('evictions'))} evictions, {fmt(f.get('recalls'))} recalls"
    )


def _hops(h: Any) -> str:
    """The links between workers on different hosts, one a line ("none" when null)."""
    if not h:
        return "none"
    if not isinstance(h, list):
        return fmt(h)
    return "\n  ".join(
        f"{fmt(x.get('hop'))} (workers {fmt(x.get('between'))}), {fmt(x.get('link'))}, "
        f"generation {fmt(x.get('generation'))}: {human_bytes(x.get('bytes'))} for "
        f"{fmt(x.get('tokens'))} tokens, {fmt(x.get('bytes_per_token'))} B/token"
        for x in h
        if isinstance(x, dict)
    )


def _kernels(k: Any) -> str:
    text = fmt(k)
    if KERNELS_FALLBACK in text:
        text += " (decode runs several times slower than on native kernels)"
    return text


def render_status(reply: Mapping[str, Any]) -> str:
    rows: list[tuple[str, str]] = []
    body = {k: v for k, v in reply.items() if k != "ok"}
    model = body.pop("model", None)
    path = body.pop("model_path", None)
    if model is not None or path is not None:
        rows.append(("model", fmt(model) + (f"  ({path})" if path else "")))
    workers = body.pop("workers", None)
    models = body.pop("models", None)
    placement = body.get("placement")
    if (
        workers is None
        and isinstance(placement, list)
        and all(isinstance(p, dict) and "pid" in p for p in placement)
    ):
        workers = placement  # the placement lists the worker processes themselves
    named = {
        "state": fmt,
        "placement": _placement,
        "uptime_s": human_duration,
        "queue": _queue,
        "tokens": _counts,
        "totals": _counts,
        "requests": _counts,
        "prefix_cache": _prefix_cache,
        "kv_flash": _kv_flash,
        "kernels": _kernels,
        "hops": _hops,
    }
    for key, show in named.items():
        if key in body:
            rows.append((key.removesuffix("_s"), show(body.pop(key))))
    rows += [(k, fmt(v)) for k, v in body.items()]
    width = max((len(k) for k, _ in rows), default=0)
    out = "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)
    if workers is not None:
        out += "\n\nworkers\n" + workers_table(workers)
    if isinstance(models, list):
        out += "\n\nmodels\n" + render_models(models)
    return out


SNAPSHOT_HEADER = ("ID", "TOKENS", "BYTES", "TIER", "HITS", "LAST USE", "ENDS WITH")


def render_snapshots(reply: Mapping[str, Any], now: float | None = None) -> str:
    now = time.time() if now is None else now
    snaps = reply.get("snapshots") or []
    rows = [
        [
            fmt(s.get("id")),
            fmt(s.get("tokens")),
            human_bytes(s.get("bytes")),
            fmt(s.get("tier")),
            fmt(s.get("hits")),
            human_age(s.get("last_used"), now),
            short_tail(s.get("suffix")),
        ]
        for s in snaps
    ]
    text = table(SNAPSHOT_HEADER, rows)
    blocks = reply.get("blocks")
    if isinstance(blocks, dict):  # a model that keeps its prompts as K/V blocks
        return (
            f"(no snapshots: this model keeps prompts as K/V blocks, "
            f"{fmt(blocks.get('memory'))} in memory, {fmt(blocks.get('disk'))} on disk)"
        )
    return text + "\n(no snapshots)" if not rows else text


def render_plain(reply: Mapping[str, Any]) -> str:
    body = {k: v for k, v in reply.items() if k != "ok"}
    if not body:
        return "ok"
    width = max(len(k) for k in body)
    return "\n".join(f"{k.ljust(width)}  {fmt(v)}" for k, v in body.items())


MODEL_HEADER = ("NAME", "STATE", "MEMORY", "REQUESTS", "LAST USE", "LOAD", "KEEP ALIVE")


def render_models(models: Sequence[Mapping[str, Any]], now: float | None = None) -> str:
    """The served models, one row each, then the errors of those that failed to load."""
    now = time.time() if now is None else now

    def keep(m: Mapping[str, Any]) -> str:
        s = m.get("keep_alive_s")
        return "never unloaded" if s is None else "until needed" if s == 0 else human_duration(s)

    rows = [
        [
            fmt(m.get("name")),
            fmt(m.get("state")),
            human_bytes(m.get("memory_bytes")),
            f"{fmt(m.get('running', 0))} running, {fmt(m.get('waiting', 0))} waiting",
            human_age(m.get("last_used"), now),
            f"{m['load_s']:.1f}s" if isinstance(m.get("load_s"), int | float) else "-",
            keep(m),
        ]
        for m in models
    ]
    text = table(MODEL_HEADER, rows) if rows else "(no models)"
    errors = [f"{m.get('name')}: {m['error']}" for m in models if m.get("error")]
    return "\n".join([text, *errors])


def render(cmd: str, reply: Mapping[str, Any]) -> str:
    if cmd == "models":
        return render_models(reply.get("models") or [])
    if cmd == "status":
        return render_status(reply)
    if cmd == "workers":
        return workers_table(reply.get("workers") or [])
    if cmd == "snapshot_list":
        return render_snapshots(reply)
    if cmd == "metrics":
        return str(reply.get("text", "")).rstrip("\n")
    return render_plain(reply)


# --- command line --------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lucectl", description="Control a running luced.")
    parser.add_argument(
        "--socket",
        metavar="PATH",
        help="admin socket (default: $LUCED_ADMIN_SOCKET, else the daemon's default)",
    )
    parser.add_argument("--json", action="store_true", help="print the daemon's raw JSON reply")
    parser.add_argument(
        "--timeout",
        type=float,
        metavar="S",
        help=f"seconds to wait for the reply (default {DEFAULT_TIMEOUT:g}; drain waits)",
    )
    # --json and --timeout are also accepted after the subcommand (`lucectl status --json`,
    # `lucectl drain --timeout 60`); SUPPRESS keeps a subparser from resetting the value
    # given before it.
    late = argparse.ArgumentParser(add_help=False)
    late.add_argument(
        "--json", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    # --model NAME: which served model a verb is about (a daemon serving several).
    which = argparse.ArgumentParser(add_help=False)
    which.add_argument("--model", metavar="NAME", help="the served model (of several)")

    def add(
        group: Any,
        name: str,
        help: str,
        timeout_help: str = argparse.SUPPRESS,
        model: bool = False,
    ) -> argparse.ArgumentParser:
        command = group.add_parser(name, help=help, parents=[late, which] if model else [late])
        command.add_argument(
            "--timeout", type=float, metavar="S", default=argparse.SUPPRESS, help=timeout_help
        )
        return command

    add(sub, "status", "model, state, placement, queue, uptime, token counts", model=True)
    add(sub, "workers", "the backend worker processes", model=True)
    add(sub, "metrics", "the Prometheus metrics, as GET /metrics serves them")
    drain = add(
        sub,
        "drain",
        "stop accepting requests, let running ones finish; wait until it stops",
        timeout_help="give up waiting after S seconds (exit 1); the daemon keeps draining",
    )
    drain.add_argument(
        "--no-wait", action="store_true", help="return once the daemon has started draining"
    )
    snap = add(sub, "snapshot", "prefix-cache snapshots")
    snap_sub = snap.add_subparsers(dest="snapshot_command", required=True, metavar="COMMAND")
    add(snap_sub, "list", "list the snapshots", model=True)
    drop = add(snap_sub, "drop", "remove one snapshot from memory and disk", model=True)
    drop.add_argument("id", help="a snapshot id from `snapshot list`")
    add(
        snap_sub,
        "save",
        "write every memory snapshot to the disk tier now (and finish the K/V blocks' writes)",
        model=True,
    )
    cache = add(sub, "cache", "the prefix cache as a whole")
    cache_sub = cache.add_subparsers(dest="cache_command", required=True, metavar="COMMAND")
    clear = add(cache_sub, "clear", "drop the memory tier (and the disk tier)", model=True)
    clear.add_argument(
        "--disk", action="store_true", help="delete the files on disk too (snapshots, K/V blocks)"
    )
    clear.add_argument("--yes", action="store_true", help="confirm (required)")
    add(sub, "models", "the served models: state, memory, requests, last use")
    load = add(sub, "load", "load a served model now (waits until it is loaded)")
    load.add_argument("name", help="a model name from `lucectl models`")
    unload = add(sub, "unload", "unload a served model: stop its workers, free its memory")
    unload.add_argument("name", help="a model name from `lucectl models`")
    unload.add_argument(
        "--force", action="store_true", help="end its running and queued requests with an error"
    )
    return parser


def command(args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    """The admin command and its arguments for parsed command-line args."""
    which = {"model": args.model} if getattr(args, "model", None) else {}
    if args.command == "snapshot":
        extra = {"id": args.id} if args.snapshot_command == "drop" else {}
        return f"snapshot_{args.snapshot_command}", {**extra, **which}
    if args.command == "cache":
        return "cache_clear", {"disk": args.disk, **which}
    if args.command == "load":
        return "load", {"model": args.name}
    if args.command == "unload":
        return "unload", {"model": args.name, "force": args.force}
    return args.command, which


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "cache" and not args.yes:
        parser.error("cache clear drops snapshots for good: add --yes to confirm")
    cmd, extra = command(args)
    timeout = args.timeout
    if timeout is None and cmd not in ("drain", "snapshot_save", "load", "unload"):  # long
        timeout = DEFAULT_TIMEOUT
    path = resolve_socket(args.socket)
    try:
        raw, reply = request(path, cmd, timeout, **extra)
    except Unreachable as exc:
        print(f"lucectl: {exc}", file=sys.stderr)
        return EXIT_UNREACHABLE
    except Failed as exc:
        print(f"lucectl: {exc}", file=sys.stderr)
        return EXIT_FAILED
    try:
        if args.json:
            print(raw.decode())
        elif reply.get("ok") is True:
            print(render(cmd, reply))
        sys.stdout.flush()
    except BrokenPipeError:  # `lucectl status | head`: the reader left, which is fine
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    if reply.get("ok") is not True:
        print(f"lucectl: luced: {reply.get('error', 'unknown error')}", file=sys.stderr)
        return EXIT_FAILED
    if cmd == "drain" and not args.no_wait:
        return wait_stopped(path, args.timeout)
    return 0


def wait_stopped(path: Path, timeout: float | None) -> int:
    """Poll the daemon until its admin socket goes away (drained and stopped), saying
    what still runs; EXIT_FAILED if `timeout` passes first."""
    deadline = None if timeout is None else time.monotonic() + timeout
    last = ""
    while deadline is None or time.monotonic() < deadline:
        try:
            _, status = request(path, "status", DEFAULT_TIMEOUT)
        except (Unreachable, Failed):
            print("luced stopped", file=sys.stderr)
            return 0
        queue = status.get("queue") or {}
        line = f"draining: {queue.get('running', 0)} running, {queue.get('waiting', 0)} waiting"
        if line != last:
            print(line, file=sys.stderr)
            last = line
        time.sleep(0.25)
    print(f"lucectl: luced still draining after {timeout:g} s", file=sys.stderr)
    return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
