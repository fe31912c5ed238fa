#!/usr/bin/env python3
"""HTTP benchmark: N concurrent streaming clients against a luced daemon.

Starts `luced serve` (or uses --url), sends one warm-up completion (not counted: the first
prompt's prefill and first calls would weigh on the level that runs first), then
`--requests` completions (default: two per client, at least 8) with `--concurrency`
clients in flight, each a prompt of about `--prompt-tokens`
tokens and `--max-tokens` generated tokens (ignore_eos, greedy), and reports aggregate
generated tok/s, requests/s, TTFT p50/p99 and inter-token latency p50/p99 (gaps between
streamed chunks). `--concurrency 1,4,8,16` runs each level in turn. With --compare it also
runs tools/generate.py in-process on the same model and prompt length, interleaved with
single-client HTTP runs, and reports the daemon path's cost in decode speed. With
--max-running 1,8 it starts one daemon per setting (continuous batching off and on),
--rounds times, alternating, runs every concurrency level on each, and reports each
setting's medians side by side with the throughput ratio to the first setting;
--variants "A;B" compares `luced serve` option strings the same way (each with every
--max-running value), e.g. --variants "--kv-block-size 0;--kv-block-size 16", and
--trees "OLD;NEW" source trees (each daemon runs with PYTHONPATH=TREE), e.g. a worktree
of an older commit against this one.

    python tools/bench_http.py [--model PATH] [--concurrency 1,4,8,16] [--requests N]
        [--prompt-tokens 128] [--max-tokens 64] [--threads 2] [--compare]
        [--max-running 1,8] [--variants "A;B"] [--trees "OLD;NEW"] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import astuple, dataclass
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
    arrivals: list[float] = []  # each streamed chunk with text
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
            elif chunk["choices"]:
                arrivals.append(time.perf_counter())
    end = time.perf_counter()
    first = arrivals[0] if arrivals else None
    ttft = (first or end) - t0
    decode = (tokens - 1) / (end - first) if first and tokens > 1 and end > first else 0.0
    return Result(ttft, decode, [b - a for a, b in itertools.pairwise(arrivals)])


@dataclass
class Result:
    ttft: float
    decode: float  # tok/s of this stream after its first token
    itl: list[float]  # gaps between its streamed chunks


@dataclass
class Load:
    """One load's summary: aggregate generated tok/s, requests/s, TTFT and ITL percentiles."""

    tok_s: float
    rps: float
    ttft_p50: float
    ttft_p99: float
    itl_p50: float
    itl_p99: float

    @staticmethod
    def of(results: list[Result], wall: float, max_tokens: int) -> Load:
        ttfts = [r.ttft for r in results]
        itls = [g for r in results for g in r.itl] or [0.0]
        n = len(results)
        return Load(
            n * max_tokens / wall,
            n / wall,
            pct(ttfts, 0.5),
            pct(ttfts, 0.99),
            pct(itls, 0.5),
            pct(itls, 0.99),
        )


async def run_load(url: str, concurrency: int, requests: int, prompt: str, max_tokens: int):
    sem = asyncio.Semaphore(concurrency)
    timeout = aiohttp.ClientTimeout(total=3600)
    # A connection per request: llama-server (--url) closes a stream's connection at its
    # end, which a pooled keep-alive connection would only find out on its next request.
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:

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
    model: str | None,
    port: int,
    threads: int,
    tmp: Path,
    extra: tuple[str, ...] = (),
    tree: str | None = None,
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
        cmd.insert(4, str(Path(model).resolve()) if Path(model).exists() else model)
    tree = None if tree is None else os.path.abspath(tree)
    env = None if tree is None else {**os.environ, "PYTHONPATH": tree}
    # `python -m` puts the working directory first on sys.path, before PYTHONPATH, for the
    # daemon and for the workers it starts: run in the tree, or another tree's code runs.
    proc = subprocess.Popen(cmd, env=env, cwd=tree)
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
    ap.add_argument("--concurrency", default="4", help="clients in flight; a list: 1,4,8,16")
    ap.add_argument(
        "--requests", type=int, help="per concurrency level (default 2 per client, at least 8)"
    )
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--compare", action="store_true", help="also measure in-process decode")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved repeats for --compare")
    ap.add_argument("--max-running", help="comma-separated settings to compare, e.g. 1,8")
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds of --max-running")
    ap.add_argument("--serve-args", default="", help="more `luced serve` options, one string")
    ap.add_argument(
        "--variants",
        help="`luced serve` option strings to compare, ';'-separated (with each --max-running)",
    )
    ap.add_argument("--trees", help="source trees to compare, ';'-separated (PYTHONPATH each)")
    args = ap.parse_args()
    if args.max_running or args.variants or args.trees:
        return compare_settings(args)

    prompt = prompt_text(args.prompt_tokens)
    proc = None
    tmp = Path(tempfile.mkdtemp(prefix="luced-bench-"))
    url = args.url
    if url is None:
        proc = start_daemon(args.model, args.port, args.threads, tmp, args.serve_args.split())
        url = f"http://127.0.0.1:{args.port}"
    try:
        print(
            f"prompt ~{args.prompt_tokens} tokens, {args.max_tokens} generated, "
            f"threads {args.threads}"
        )
        print(HEADER)
        warm_up(url, prompt, args.max_tokens)
        for c in levels(args.concurrency):
            load = measure(url, c, level_requests(args, c), prompt, args.max_tokens)
            print(row(f"concurrency {c}", load))
        if args.compare:
            http, local = [], []
            for _ in range(args.repeats):  # interleaved: HTTP, in-process, HTTP, ...
                (res,), _ = asyncio.run(run_load(url, 1, 1, prompt, args.max_tokens))
                http.append(res.decode)
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


LABEL = 36  # the setting column's width
HEADER = f"{'setting':{LABEL}s}  gen tok/s  req/s  TTFT p50/p99 s   ITL p50/p99 ms"


def row(label: str, load: Load, ratio: str = "") -> str:
    return (
        f"{label:{LABEL}s}  {load.tok_s:9.1f}  {load.rps:5.2f}  "
        f"{load.ttft_p50:6.2f} / {load.ttft_p99:<6.2f}  "
        f"{1e3 * load.itl_p50:6.1f} / {1e3 * load.itl_p99:<6.1f}{ratio}"
    )


def levels(spec: str) -> list[int]:
    return [int(x) for x in spec.split(",")]


def measure(url: str, concurrency: int, requests: int, prompt: str, max_tokens: int) -> Load:
    results, wall = asyncio.run(run_load(url, concurrency, requests, prompt, max_tokens))
    return Load.of(results, wall, max_tokens)


def level_requests(args: argparse.Namespace, concurrency: int) -> int:
    """Completions per level: --requests, else two per client and at least 8 (a level of
    one client and two requests measured mostly its own noise)."""
    return args.requests or max(2 * concurrency, 8)


def warm_up(url: str, prompt: str, max_tokens: int) -> None:
    """One completion before a daemon is measured, so no level pays for the first."""
    asyncio.run(run_load(url, 1, 1, prompt, max_tokens))


def compare_settings(args: argparse.Namespace) -> int:
    """One daemon per setting (each --trees tree with each --max-running value and each
    --variants string), every concurrency level on each, settings alternating over rounds
    (drift hits them alike); medians per setting and level, and aggregate tok/s against
    the first setting at the same level."""
    running = args.max_running.split(",") if args.max_running else [""]
    variants = args.variants.split(";") if args.variants else [""]
    trees = args.trees.split(";") if args.trees else [""]
    combos = list(itertools.product(trees, running, variants))
    settings = [
        " ".join(filter(None, (Path(t).name, f"max_running={m}" if m else "", v.strip())))
        for t, m, v in combos
    ]
    serve = {
        label: (*(("--max-running", m) if m else ()), *v.split(), *args.serve_args.split())
        for label, (_, m, v) in zip(settings, combos, strict=True)
    }
    tree_of = {label: t or None for label, (t, _, _) in zip(settings, combos, strict=True)}
    prompt = prompt_text(args.prompt_tokens)
    runs: dict[tuple[str, int], list[Load]] = {}
    for _ in range(args.rounds):
        for m in settings:
            with tempfile.TemporaryDirectory(prefix="luced-bench-") as tmp:
                extra = serve[m]
                proc = start_daemon(
                    args.model, args.port, args.threads, Path(tmp), extra, tree_of[m]
                )
                try:
                    url = f"http://127.0.0.1:{args.port}"
                    warm_up(url, prompt, args.max_tokens)
                    for c in levels(args.concurrency):
                        load = measure(url, c, level_requests(args, c), prompt, args.max_tokens)
                        runs.setdefault((m, c), []).append(load)
                finally:
                    proc.send_signal(signal.SIGTERM)
                    proc.wait(60)
    print(
        f"prompt ~{args.prompt_tokens} tokens, {args.max_tokens} generated, threads "
        f"{args.threads}, {args.rounds} rounds, medians"
    )
    print(HEADER)
    for c in levels(args.concurrency):
        base = None
        for m in settings:
            loads = runs[(m, c)]
            med = Load(*(statistics.median(col) for col in zip(*map(astuple, loads), strict=True)))
            base = base or med
            ratio = f"  {med.tok_s / base.tok_s:.2f}x" if m != settings[0] else ""
            print(row(f"c={c} {m}", med, ratio))
    return 0


if __name__ == "__main__":
    sys.exit(main())
