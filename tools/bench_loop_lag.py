#!/usr/bin/env python3
"""Event-loop lag under hostile bodies: how long `/health` takes while one large request is
being read, parsed, bounded, rendered and tokenized.

For each source tree (`--tree DIR`, repeatable: e.g. the old tree and this one; each runs
as `PYTHONPATH=DIR python -m luced.cli serve`) it starts a daemon, measures `/health`
latency idle, then for each body sends it once while another connection polls `/health`
every 5 ms, and reports the body's status and seconds and the polls' p50 / p99 / max
latency (the lag the request caused to every other client). A body still unanswered after
`--timeout` seconds counts as such and its daemon is restarted. Trees take turns body by
body (`--rounds`), so that load from other processes falls on both alike.

Bodies (`--bodies`, default all), sized for the served model's context C to pass this
tree's byte and comma bounds (the largest the JSON decoder is given), or beyond them:
    tools     128 tools with 234 KB descriptions (30 MB): the issue's body
    prompt    one user message of the most bytes a body may have (9 MB at C = 8192)
    ids       a completions prompt of the most token ids (580 k at C = 8192)
    objects   as many messages as fit, each a JSON object
    schema    a response_format schema of 0.8·32·C characters (at the bound, compiled)
    bound     tools whose descriptions total 0.8·32·C characters: within the bound, so
              rendered and tokenized (then too many tokens for the context: a 400)

    python tools/bench_loop_lag.py --tree /work/main --tree . [--model PATH]
        [--bodies tools,prompt,ids,objects,schema,bound] [--rounds 1] [--timeout 60]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

POLL_S = 0.005
IDLE_S = 2.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Daemon:
    def __init__(self, tree: Path, model: str | None, tmp: Path) -> None:
        self.tree, self.model, self.tmp = tree, model, tmp
        self.proc: subprocess.Popen | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.port = free_port()
        run = self.tmp / f"run-{self.port}"
        run.mkdir(parents=True)
        cmd = [sys.executable, "-m", "luced.cli", "serve", "--port", str(self.port)]
        cmd += ["--runtime-dir", str(run), "--admin-socket", str(run / "admin.sock")]
        cmd += ["--threads", "1", "--log-level", "warning"]
        if self.model:
            cmd.insert(4, self.model)
        env = {**os.environ, "PYTHONPATH": str(self.tree)}
        with open(run / "daemon.log", "w") as log:
            # cwd: `python -m` puts it first on sys.path, before PYTHONPATH
            self.proc = subprocess.Popen(
                cmd, env=env, cwd=self.tree, stdout=log, stderr=subprocess.STDOUT
            )
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
                    s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
                    if b" 200 " in s.recv(200):
                        return
            except OSError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"the daemon of {self.tree} did not become healthy")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None


@dataclass
class Probe:
    status: str  # the body's HTTP status, or "timeout"
    seconds: float
    lags_ms: list[float]
    said: str = ""  # the start of the reply

    def row(self) -> str:
        lags = sorted(self.lags_ms) or [0.0]
        p99 = lags[min(len(lags) - 1, int(0.99 * len(lags)))]
        return (
            f"{self.status:>7} {self.seconds:8.2f} s  health p50 {statistics.median(lags):7.1f}"
            f"  p99 {p99:7.1f}  max {max(lags):8.1f} ms  ({len(lags)} polls)  {self.said}"
        )


def post(port: int, path: str, body: bytes, timeout: float) -> tuple[str, str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", path, body, {"Content-Type": "application/json"})
        r = conn.getresponse()
        reply = r.read()
        try:
            said = json.loads(reply).get("error", {}).get("message", "")
        except (ValueError, AttributeError):
            said = ""
        return str(r.status), said[:70]
    except TimeoutError:
        return "timeout", ""
    finally:
        conn.close()


def probe(port: int, path: str | None, body: bytes, timeout: float) -> Probe:
    """Poll /health (one kept-alive connection, every POLL_S) while `body` is POSTed to
    `path` from another thread (None: poll IDLE_S, no body)."""
    out: dict[str, tuple[str, str]] = {}
    sender = None
    if path is not None:
        sender = threading.Thread(target=lambda: out.update(r=post(port, path, body, timeout)))
    lags: list[float] = []
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    t0 = time.perf_counter()
    if sender is not None:
        sender.start()
    try:
        while (sender.is_alive() if sender else time.perf_counter() - t0 < IDLE_S) or not lags:
            t = time.perf_counter()
            try:
                conn.request("GET", "/health")
                conn.getresponse().read()
            finally:
                lags.append((time.perf_counter() - t) * 1000)  # a poll that timed out too
            time.sleep(POLL_S)
    except TimeoutError:
        out["r"] = ("timeout", "")
    finally:
        conn.close()
    seconds = time.perf_counter() - t0
    if sender is not None:
        sender.join()
    status, said = out.get("r", ("idle", ""))
    return Probe(status, seconds, lags, said)


def bodies(context: int) -> dict[str, tuple[str, bytes]]:
    """name -> (path, body); see the module docstring."""
    bound = 32 * context
    words = "lorem ipsum dolor sit amet "

    def tools(n: int, chars: int) -> list[dict]:
        text = (words * (chars // len(words) + 1))[:chars]
        return [
            {
                "type": "function",
                "function": {
                    "name": f"tool_{i}",
                    "description": text,
                    "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
                },
            }
            for i in range(n)
        ]

    # What this tree's bounds let through to decoding (luced.api.prepare; 32 MiB at most):
    # bytes 32·32·C + 1 MiB, commas 2·32·C + 64 Ki. The old tree had no such bounds.
    most_bytes = min(32 << 20, 32 * bound + (1 << 20)) - 1024
    most_values = 2 * bound + (1 << 16) - 1024
    user = [{"role": "user", "content": "hi"}]
    props = {f"p{i}": {"type": "string", "description": "d" * 40} for i in range(bound // 80)}
    schema = {"type": "object", "properties": props}
    out = {
        "tools": ("/v1/chat/completions", {"messages": user, "tools": tools(128, 234_000)}),
        "prompt": (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x" * most_bytes}]},
        ),
        "ids": ("/v1/completions", {"prompt": [1] * most_values, "max_tokens": 1}),
        "objects": (
            "/v1/chat/completions",
            {"messages": [{"role": "user"}] * min(most_values, most_bytes // 20)},
        ),
        "schema": (
            "/v1/chat/completions",
            {
                "messages": user,
                "max_tokens": 1,
                "response_format": {"type": "json_schema", "json_schema": {"schema": schema}},
            },
        ),
        "bound": (
            "/v1/chat/completions",
            {"messages": user, "max_tokens": 1, "tools": tools(128, int(0.8 * bound) // 128)},
        ),
    }
    return {k: (path, json.dumps(b).encode()) for k, (path, b) in out.items()}


def warm_up(port: int) -> None:
    """A small request with a grammar: the daemon builds its grammar vocabulary once, on
    the first (0.9 s holding the GIL for SmolLM2), which is not what is measured here."""
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    body["response_format"] = {"type": "json_object"}
    post(port, "/v1/chat/completions", json.dumps(body).encode(), 120)


def context_of(url: str) -> int:
    import urllib.request

    with urllib.request.urlopen(url + "/v1/models", timeout=10) as r:
        return int(json.loads(r.read())["data"][0]["max_model_len"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--tree", action="append", required=True, help="a luced source tree")
    ap.add_argument("--model", default=None, help="GGUF (default: the bundled SmolLM2)")
    ap.add_argument("--bodies", default="tools,prompt,ids,objects,schema,bound")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=60.0)
    args = ap.parse_args()
    names = args.bodies.split(",")
    with tempfile.TemporaryDirectory(prefix="bench-lag-") as tmp:
        daemons = [Daemon(Path(t).resolve(), args.model, Path(tmp)) for t in args.tree]
        try:
            for d in daemons:
                d.start()
                warm_up(d.port)
            built = bodies(context_of(daemons[0].url))
            for name in names:
                print(f"{name}: {len(built[name][1]) / 2**20:.1f} MiB", flush=True)
            results: dict[tuple[str, str], list[Probe]] = {}
            for _ in range(args.rounds):
                for name in ["idle", *names]:
                    for d in daemons:
                        path, body = built.get(name, (None, b""))
                        p = probe(d.port, path, body, args.timeout)
                        results.setdefault((str(d.tree), name), []).append(p)
                        print(f"{d.tree}  {name:7} {p.row()}", flush=True)
                        if p.status == "timeout":
                            d.stop()
                            d.start()
            print("\nworst over rounds (max health latency):")
            for (tree, name), ps in results.items():
                worst = max(ps, key=lambda p: max(p.lags_ms, default=0.0))
                print(f"{tree}  {name:7} {worst.row()}")
        finally:
            for d in daemons:
                d.stop()


if __name__ == "__main__":
    main()
