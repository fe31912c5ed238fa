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

Bodies (`--bodies`, default all), sized for the served model's context C:
    tools     128 tools with 234 KB descriptions (30 MB): the issue's body
    prompt    one 30 MB user message
    ids       a completions prompt of 12 M token ids (24 MB of small JSON values)
    schema    a response_format schema of 0.8·32·C characters (at the bound, compiled)
    fit       tools whose descriptions total 0.8·32·C characters (rendered and tokenized)

    python tools/bench_loop_lag.py --tree /work/main --tree . [--model PATH]
        [--bodies tools,prompt,ids,schema,fit] [--rounds 1] [--timeout 60]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp

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
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL)
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

    def row(self) -> str:
        lags = sorted(self.lags_ms) or [0.0]
        p99 = lags[min(len(lags) - 1, int(0.99 * len(lags)))]
        return (
            f"{self.status:>7} {self.seconds:8.2f} s  health p50 {statistics.median(lags):7.1f}"
            f"  p99 {p99:7.1f}  max {max(lags):8.1f} ms  ({len(lags)} polls)"
        )


async def probe(url: str, path: str | None, body: bytes, timeout: float) -> Probe:
    """Poll /health while `body` is POSTed to `path` (None: poll IDLE_S, no body)."""
    lags: list[float] = []
    done = asyncio.Event()

    async def poll(session: aiohttp.ClientSession) -> None:
        while not done.is_set():
            t0 = time.perf_counter()
            async with session.get(url + "/health") as r:
                await r.read()
            lags.append((time.perf_counter() - t0) * 1000)
            await asyncio.sleep(POLL_S)

    limits = aiohttp.ClientTimeout(total=timeout)
    async with (
        aiohttp.ClientSession(timeout=limits) as polls,
        aiohttp.ClientSession(timeout=limits) as sender,
    ):
        poller = asyncio.create_task(poll(polls))
        t0 = time.perf_counter()
        status = "idle"
        try:
            if path is None:
                await asyncio.sleep(IDLE_S)
            else:
                headers = {"Content-Type": "application/json"}
                async with sender.post(url + path, data=body, headers=headers) as r:
                    await r.read()
                    status = str(r.status)
        except TimeoutError:
            status = "timeout"
        seconds = time.perf_counter() - t0
        done.set()
        try:
            await asyncio.wait_for(poller, 10)
        except TimeoutError:
            poller.cancel()
            status = "timeout"
    return Probe(status, seconds, lags)


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

    user = [{"role": "user", "content": "hi"}]
    props = {f"p{i}": {"type": "string", "description": "d" * 40} for i in range(bound // 80)}
    schema = {"type": "object", "properties": props}
    out = {
        "tools": ("/v1/chat/completions", {"messages": user, "tools": tools(128, 234_000)}),
        "prompt": (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x" * (30 << 20)}]},
        ),
        "ids": ("/v1/completions", {"prompt": [1] * 12_000_000, "max_tokens": 1}),
        "schema": (
            "/v1/chat/completions",
            {
                "messages": user,
                "max_tokens": 1,
                "response_format": {"type": "json_schema", "json_schema": {"schema": schema}},
            },
        ),
        "fit": (
            "/v1/chat/completions",
            {"messages": user, "max_tokens": 1, "tools": tools(128, int(0.8 * bound) // 128)},
        ),
    }
    return {k: (path, json.dumps(b).encode()) for k, (path, b) in out.items()}


def context_of(url: str) -> int:
    import urllib.request

    with urllib.request.urlopen(url + "/v1/models", timeout=10) as r:
        return int(json.loads(r.read())["data"][0]["max_model_len"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--tree", action="append", required=True, help="a luced source tree")
    ap.add_argument("--model", default=None, help="GGUF (default: the bundled SmolLM2)")
    ap.add_argument("--bodies", default="tools,prompt,ids,schema,fit")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=60.0)
    args = ap.parse_args()
    names = args.bodies.split(",")
    with tempfile.TemporaryDirectory(prefix="bench-lag-") as tmp:
        daemons = [Daemon(Path(t).resolve(), args.model, Path(tmp)) for t in args.tree]
        try:
            for d in daemons:
                d.start()
            built = bodies(context_of(daemons[0].url))
            for name in names:
                print(f"{name}: {len(built[name][1]) / 2**20:.1f} MiB", flush=True)
            results: dict[tuple[str, str], list[Probe]] = {}
            for _ in range(args.rounds):
                for name in ["idle", *names]:
                    for d in daemons:
                        path, body = built.get(name, (None, b""))
                        p = asyncio.run(probe(d.url, path, body, args.timeout))
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
