#!/usr/bin/env python3
"""HTTP benchmark: N concurrent streaming clients against a luced daemon.

Starts `luced serve` (or uses --url), sends `--requests` chat completions with
`--concurrency` clients in flight, each a prompt of about `--prompt-tokens` tokens and
`--max-tokens` generated tokens (ignore_eos, greedy), and reports TTFT p50/p95, decode
tok/s per stream and requests/s. With --compare it also runs tools/generate.py
in-process on the same model and prompt length, interleaved with single-client HTTP
runs, and reports the daemon path's cost in decode speed. With --max-running 1,8 it
starts one daemon per setting (continuous batching off and on), --rounds times,
alternating, and reports each setting's medians side by side.

    python tools/bench_http.py [--model PATH] [--concurrency 4] [--requests 8]
        [--prompt-tokens 128] [--max-tokens 64] [--threads 2] [--compare]
        [--max-running 1,8] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "while",
    "birds",
    "sing",
    "in",
    "tall",
    "green",
    "trees",
]


def prompt_text(n_tokens: int) -> str:
    # About one token per word for these common English words.
    return " ".join(WORDS[i % len(WORDS)] for i in range(n_tokens))


async def one_request(session: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int):
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    first = None
    tokens = 0
    async with session.post(url + "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            elif chunk["choices"] and first is None:
                first = time.perf_counter()
    end = time.perf_counter()
    ttft = (first or end) - t0
    decode = (tokens - 1) / (end - first) if first and tokens > 1 and end > first else 0.0
    return ttft, decode


async def run_load(url: str, concurrency: int, requests: int, prompt: str, max_tokens: int):
    sem = asyncio.Semaphore(concurrency)
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def task():
            async with sem:
                return await one_request(session, url, prompt, max_tokens)

        t0 = time.perf_counter()
        results = await asyncio.gather(*(task() for _ in range(requests)))
        wall = time.perf_counter() - t0
    return results, wall


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def start_daemon(
    model: str | None, port: int, threads: int, tmp: Path, extra: tuple[str, ...] = ()
) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "luced.cli",
        "serve",
        "--port",
        str(port),
        "--runtime-dir",
        str(tmp),
        "--threads",
        str(threads),
        "--log-level",
        "warning",
        *extra,
    ]
    if model:
        cmd.insert(4, model)
    proc = subprocess.Popen(cmd)
    for _ in range(600):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return proc
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("the daemon did not become healthy")


def in_process_decode(model: str | None, prompt: str, max_tokens: int, threads: int) -> float:
    cmd = [
        sys.executable,
        str(ROOT / "tools" / "generate.py"),
        "--prompt",
        prompt,
        "--max-tokens",
        str(max_tokens),
        "--threads",
        str(threads),
        "--ignore-eos",
        "--json",
    ]
    if model:
        cmd += ["--model", model]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["decode_tok_s"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model")
    ap.add_argument("--url", help="use a running daemon instead of starting one")
    ap.add_argument("--port", type=int, default=8931)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--compare", action="store_true", help="also measure in-process decode")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved repeats for --compare")
    ap.add_argument("--max-running", help="comma-separated settings to compare, e.g. 1,8")
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds of --max-running")
    args = ap.parse_args()
    if args.max_running:
        return compare_max_running(args)

    prompt = prompt_text(args.prompt_tokens)
    proc = None
    tmp = Path(tempfile.mkdtemp(prefix="luced-bench-"))
    url = args.url
    if url is None:
        proc = start_daemon(args.model, args.port, args.threads, tmp)
        url = f"http://127.0.0.1:{args.port}"
    try:
        results, wall = asyncio.run(
            run_load(url, args.concurrency, args.requests, prompt, args.max_tokens)
        )
        ttfts = [r[0] for r in results]
        decodes = [r[1] for r in results if r[1] > 0]
        print(
            f"concurrency {args.concurrency}, {args.requests} requests, "
            f"prompt ~{args.prompt_tokens} tokens, {args.max_tokens} generated, "
            f"threads {args.threads}"
        )
        print(f"TTFT p50 {pct(ttfts, 0.5):.3f} s, p95 {pct(ttfts, 0.95):.3f} s")
        print(f"decode per stream: median {statistics.median(decodes):.1f} tok/s")
        print(
            f"requests/s {args.requests / wall:.2f}, "
            f"generated tok/s {args.requests * args.max_tokens / wall:.1f}"
        )
        if args.compare:
            http, local = [], []
            for _ in range(args.repeats):  # interleaved: HTTP, in-process, HTTP, ...
                (res,), _ = asyncio.run(run_load(url, 1, 1, prompt, args.max_tokens))
                http.append(res[1])
                local.append(in_process_decode(args.model, prompt, args.max_tokens, args.threads))
            h, loc = statistics.median(http), statistics.median(local)
            print(
                f"single stream decode: HTTP {h:.1f} tok/s vs in-process {loc:.1f} tok/s "
                f"(daemon path costs {100 * (1 - h / loc):+.1f}%)"
            )
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
        for f in tmp.iterdir():
            f.unlink()
        os.rmdir(tmp)
    return 0


def compare_max_running(args: argparse.Namespace) -> int:
    """One daemon per --max-running setting, the same load on each, settings alternating
    over rounds (drift hits them alike); medians per setting."""
    settings = [int(x) for x in args.max_running.split(",")]
    prompt = prompt_text(args.prompt_tokens)
    rows: dict[int, list[tuple[float, float, float]]] = {m: [] for m in settings}
    for _ in range(args.rounds):
        for m in settings:
            with tempfile.TemporaryDirectory(prefix="luced-bench-") as tmp:
                extra = ("--max-running", str(m))
                proc = start_daemon(args.model, args.port, args.threads, Path(tmp), extra)
                try:
                    url = f"http://127.0.0.1:{args.port}"
                    load = run_load(url, args.concurrency, args.requests, prompt, args.max_tokens)
                    results, wall = asyncio.run(load)
                finally:
                    proc.send_signal(signal.SIGTERM)
                    proc.wait(60)
            ttft = pct([r[0] for r in results], 0.5)
            rows[m].append((ttft, args.requests / wall, args.requests * args.max_tokens / wall))
    print(
        f"concurrency {args.concurrency}, {args.requests} requests, prompt ~{args.prompt_tokens} "
        f"tokens, {args.max_tokens} generated, threads {args.threads}, {args.rounds} rounds"
    )
    print("max_running  TTFT p50 s  requests/s  generated tok/s")
    for m, rs in rows.items():
        ttft, rps, tps = (statistics.median(col) for col in zip(*rs, strict=True))
        print(f"{m:11d}  {ttft:10.3f}  {rps:10.2f}  {tps:15.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
