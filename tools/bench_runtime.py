#!/usr/bin/env python3
"""Benchmark luced's runtime on the bundled real models, in one run, against transformers
and (with --llama-bench) llama.cpp's llama-bench on the same GGUF and thread count.

For each model, dtype and weights mode (--weights, as `luced serve --weights`): prefill
tok/s on a 512-token prompt (pp512), decode tok/s over 128 tokens (tg128, greedy), the cold
start (wall time from launching `tools/generate.py` to its first token) and that process's
peak RSS. llama-bench gives pp512 and tg128 for the same file; its cold start and peak RSS
are those of a `llama-bench -p 16 -n 1` process. Runs are interleaved (luced, llama.cpp,
luced, ...) and medians reported, because this machine drifts; ratios are luced / llama.cpp
(for cold start and RSS, lower is better). Prints Markdown tables.

    python tools/bench_runtime.py [--threads 2] [--repeats 3] [--models smollm2,gemma3]
        [--weights dequant,auto,int4,int8] [--llama-bench PATH] [--no-hf]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
PROMPT_TOKENS = 512
DECODE_TOKENS = 128


def prompt_ids(vocab: int) -> torch.Tensor:
    # Deterministic "text-like" ids away from special tokens at the start of the vocab.
    g = torch.Generator().manual_seed(0)
    return torch.randint(1000, min(vocab, 30000), (PROMPT_TOKENS,), generator=g)


def luced_run(model, ids: torch.Tensor) -> tuple[float, float]:
    from luced.runtime.generate import generate
    from luced.sampling_params import SamplingParams

    cache = model.new_cache(PROMPT_TOKENS + 8)
    t = time.perf_counter()
    # Logits of the last position only, as a serving prefill (and llama-bench's pp) does.
    with torch.inference_mode():
        h, _ = model.forward_layers(model.embed(ids), cache, 0, ids=ids)
        model.logits(h[-1:])
    prefill = PROMPT_TOKENS / (time.perf_counter() - t)
    gen = generate(model, ids[:16].tolist(), SamplingParams(temperature=0), DECODE_TOKENS + 1)
    return prefill, gen.decode_tok_s


def hf_run(hf, ids: torch.Tensor) -> tuple[float, float]:
    with torch.no_grad():
        t = time.perf_counter()
        hf(ids[None])
        prefill = PROMPT_TOKENS / (time.perf_counter() - t)
        short = ids[None, :16]
        t = time.perf_counter()
        hf.generate(short, max_new_tokens=1, min_new_tokens=1, do_sample=False)
        first = time.perf_counter() - t
        t = time.perf_counter()
        out = hf.generate(
            short,
            max_new_tokens=DECODE_TOKENS + 1,
            min_new_tokens=DECODE_TOKENS + 1,
            do_sample=False,
        )
        total = time.perf_counter() - t
    n = out.shape[1] - short.shape[1]
    return prefill, (n - 1) / max(total - first, 1e-9)


def _run_measured(cmd: list[str]) -> tuple[str, float, float]:
    """(stdout, wall seconds, peak RSS MiB) of one child process. The peak comes from GNU
    time, whose child is forked from a small process: a child forked from this one would
    report this process's (model-holding) RSS as its own high-water mark."""
    with tempfile.NamedTemporaryFile("r") as peak:
        t = time.perf_counter()
        out = subprocess.run(
            ["/usr/bin/time", "-f", "%M", "-o", peak.name, *cmd],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            check=True,
        ).stdout
        wall = time.perf_counter() - t
        rss_kib = float(peak.read().strip().splitlines()[-1])
    return out, wall, rss_kib / 1024


def cold_start(path: Path, threads: int, weights: str = "dequant") -> tuple[float, float]:
    """(seconds from process launch to the first generated token, peak RSS MiB)."""
    out, wall, rss = _run_measured(
        [
            sys.executable,
            str(ROOT / "tools" / "generate.py"),
            "--model",
            str(path),
            "--prompt",
            "Hello",
            "--max-tokens",
            "1",
            "--threads",
            str(threads),
            "--weights",
            weights,
            "--json",
        ]
    )
    json.loads(out.strip().splitlines()[-1])
    return wall, rss


def llama_bench(exe: str, path: Path, threads: int) -> tuple[float, float]:
    """llama-bench's (pp512, tg128) tok/s on the file, one repetition."""
    sizes = ["-p", str(PROMPT_TOKENS), "-n", str(DECODE_TOKENS)]
    out, _, _ = _run_measured(
        [exe, "-m", str(path), "-t", str(threads), "-r", "1", *sizes, "-o", "json"]
    )
    tests = json.loads(out)
    pp = next(t["avg_ts"] for t in tests if t["n_prompt"] == PROMPT_TOKENS and not t["n_gen"])
    tg = next(t["avg_ts"] for t in tests if t["n_gen"] == DECODE_TOKENS and not t["n_prompt"])
    return pp, tg


def llama_cold(exe: str, path: Path, threads: int) -> tuple[float, float]:
    """(wall seconds, peak RSS MiB) of llama-bench loading the file and running a 16-token
    prompt and one token: its nearest to a cold start to the first token."""
    cmd = [exe, "-m", str(path), "-t", str(threads), "-p", "16", "-n", "1", "-r", "1"]
    _, wall, rss = _run_measured([*cmd, "--no-warmup", "-o", "json"])
    return wall, rss


def _median(runs: list[tuple[float, float]], i: int) -> float:
    return statistics.median(r[i] for r in runs)


def _fmt(runs: list[tuple[float, float]]) -> str:
    return f"prefill {_median(runs, 0):.0f} tok/s, decode {_median(runs, 1):.1f} tok/s"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--models", default="smollm2,gemma3")
    ap.add_argument("--dtypes", default="float32")
    ap.add_argument("--weights", default="dequant,auto,int4,int8", help="weights modes")
    ap.add_argument("--llama-bench", metavar="PATH", help="llama.cpp's llama-bench binary")
    ap.add_argument("--no-hf", action="store_true", help="skip transformers")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from luced.runtime.model import Model
    from luced.serve.bundled import gemma3_path, smollm2_path

    paths = {"smollm2": smollm2_path, "gemma3": gemma3_path}
    rows, llama_rows = [], []
    for name in args.models.split(","):
        path = paths[name]()
        for dtype in args.dtypes.split(","):
            for weights in args.weights.split(","):
                model = Model.load(path, dtype=dtype, weights=weights)
                ids = prompt_ids(model.cfg.vocab)
                hf = None
                if not args.no_hf and weights == "dequant":
                    from transformers import AutoModelForCausalLM

                    hf = AutoModelForCausalLM.from_pretrained(
                        str(path.parent), gguf_file=path.name, dtype=getattr(torch, dtype)
                    ).eval()
                ours, theirs, llama, cold, lcold = [], [], [], [], []
                for _ in range(args.repeats):  # interleaved A B A B
                    ours.append(luced_run(model, ids))
                    cold.append(cold_start(path, args.threads, weights))
                    if hf is not None:
                        theirs.append(hf_run(hf, ids))
                    if args.llama_bench:
                        llama.append(llama_bench(args.llama_bench, path, args.threads))
                        lcold.append(llama_cold(args.llama_bench, path, args.threads))
                line = f"| {name} | {dtype} | {weights} | {_fmt(ours)} |"
                line += f" {_median(cold, 0):.2f} s, {_median(cold, 1):.0f} MiB |"
                if theirs:
                    ratio = _median(ours, 1) / _median(theirs, 1)
                    line += f" {_fmt(theirs)} (luced decode {ratio:.1f}x) |"
                else:
                    line += " |"
                rows.append(line)
                print(line, file=sys.stderr, flush=True)
                if llama:
                    ll = (
                        f"| {name} | {dtype} | {weights} "
                        f"| {_median(ours, 1):.1f} / {_median(llama, 1):.1f} = "
                        f"**{_median(ours, 1) / _median(llama, 1):.2f}x** "
                        f"| {_median(ours, 0):.0f} / {_median(llama, 0):.0f} = "
                        f"**{_median(ours, 0) / _median(llama, 0):.2f}x** "
                        f"| {_median(cold, 0):.2f} / {_median(lcold, 0):.2f} s "
                        f"| {_median(cold, 1):.0f} / {_median(lcold, 1):.0f} MiB |"
                    )
                    llama_rows.append(ll)
                    print(ll, file=sys.stderr, flush=True)
                del model, hf
    print(
        f"threads={args.threads}, prompt {PROMPT_TOKENS} tokens, decode {DECODE_TOKENS} tokens, "
        f"medians of {args.repeats} interleaved runs\n"
    )
    print("| model | dtype | weights | luced | cold start, peak RSS | transformers generate() |")
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))
    if llama_rows:
        print("\nluced / llama.cpp (same GGUF, same threads, same run):\n")
        print(
            "| model | dtype | weights | decode tg128 tok/s | prefill pp512 tok/s "
            "| cold start to first token | peak RSS |"
        )
        print("|---|---|---|---|---|---|---|")
        print("\n".join(llama_rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
