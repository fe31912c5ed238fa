#!/usr/bin/env python3
"""Time to first token of a model that is not loaded (a cold load) and of one that is.

Starts `luced serve --model NAME=PATH ...` (default: the bundled SmolLM2 as `smol`), then
for `--rounds` rounds and each model in turn: `lucectl unload` it, stream one completion
(cold: the request waits for the model's workers to start and load), stream the same
completion again (warm). Cold and warm samples alternate, so a busy machine weighs on both
alike; the warm TTFT is the baseline of the same run. Reports per model the median (and
range) of each, their ratio, and the load time the daemon measured (`lucectl models`).

    python tools/bench_models.py [--model NAME=PATH ...] [--rounds 5] [--threads 2]
        [--prompt-tokens 64] [--max-tokens 8] [-- EXTRA SERVE OPTIONS]
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from bench_http import prompt_text, start_daemon

from luced.serve.lucectl import request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ttft(url: str, model: str, prompt: str, max_tokens: int) -> float:
    """Seconds from sending a streamed completion to its first text chunk."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    req = urllib.request.Request(
        url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    t0 = time.perf_counter()
    first = None
    with urllib.request.urlopen(req, timeout=3600) as resp:
        for raw in resp:  # read to the end: the next request finds the model idle
            line = raw.decode().strip()
            if first is None and line.startswith("data: {") and '"text"' in line:
                first = time.perf_counter() - t0
    if first is None:
        raise RuntimeError(f"{model}: the stream had no text")
    return first


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="append", metavar="NAME=PATH", help="repeatable")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("extra", nargs="*", help="more `luced serve` options (after --)")
    args = parser.parse_args()
    if not args.model:
        from luced.serve.bundled import default_model_path

        args.model = [f"smol={default_model_path()}"]
    names = [m.partition("=")[0] for m in args.model]
    prompt = prompt_text(args.prompt_tokens)
    with tempfile.TemporaryDirectory(prefix="luced-bench-") as tmp:
        port = free_port()
        flags = [f for m in args.model for f in ("--model", m)]
        proc = start_daemon(None, port, args.threads, Path(tmp), (*flags, *args.extra))
        url, admin = f"http://127.0.0.1:{port}", Path(tmp) / "admin.sock"
        cold: dict[str, list[float]] = {n: [] for n in names}
        warm: dict[str, list[float]] = {n: [] for n in names}
        loads: dict[str, list[float]] = {n: [] for n in names}
        try:
            for r in range(args.rounds):
                for name in names:
                    request(admin, "unload", 600, model=name)
                    cold[name].append(ttft(url, name, prompt, args.max_tokens))
                    warm[name].append(ttft(url, name, prompt, args.max_tokens))
                    _, reply = request(admin, "models", 10)
                    row = next(m for m in reply["models"] if m["name"] == name)
                    loads[name].append(row["load_s"])
                    print(
                        f"round {r + 1} {name}: cold {cold[name][-1]:.2f} s, "
                        f"warm {warm[name][-1] * 1e3:.0f} ms, load {row['load_s']:.2f} s",
                        file=sys.stderr,
                    )
        finally:
            proc.terminate()
            proc.wait(60)
    print(f"{'model':<12} {'cold TTFT':>20} {'warm TTFT':>22} {'cold/warm':>10} {'load':>8}")
    for name in names:
        c, w = cold[name], warm[name]
        print(
            f"{name:<12} {statistics.median(c):7.2f} s ({min(c):.2f}-{max(c):.2f}) "
            f"{statistics.median(w) * 1e3:7.0f} ms ({min(w) * 1e3:.0f}-{max(w) * 1e3:.0f}) "
            f"{statistics.median(c) / statistics.median(w):9.0f}x "
            f"{statistics.median(loads[name]):6.2f} s"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
