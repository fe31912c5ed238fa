#!/usr/bin/env python3
"""Benchmark luced's runtime against transformers on the bundled real models, in one run.

For each model and dtype: prefill tok/s on a 512-token prompt, decode tok/s over 128
tokens (greedy), and the same for transformers `generate()` loading the same GGUF.
Also the cold start: wall time from launching `tools/generate.py` to its first token.
Runs are interleaved (luced, transformers, luced, ...) and medians reported, because
this machine drifts. Prints a Markdown table.

    python tools/bench_runtime.py [--threads 2] [--repeats 3] [--models smollm2,gemma3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
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
    model.forward(ids, cache, 0)
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


def cold_start(path: Path, threads: int) -> float:
    """Seconds from process launch to the first generated token (load + tokenize + TTFT)."""
    t = time.perf_counter()
    out = subprocess.run(
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
            "--json",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    wall = time.perf_counter() - t
    json.loads(out.stdout.strip().splitlines()[-1])
    return wall


def _median(runs: list[tuple[float, float]], i: int) -> float:
    return statistics.median(r[i] for r in runs)


def _fmt(runs: list[tuple[float, float]]) -> str:
    return f"prefill {_median(runs, 0):.0f} tok/s, decode {_median(runs, 1):.1f} tok/s"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--models", default="smollm2,gemma3")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--no-hf", action="store_true", help="skip transformers")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from luced.runtime.model import Model
    from luced.serve.bundled import gemma3_path, smollm2_path

    paths = {"smollm2": smollm2_path, "gemma3": gemma3_path}
    rows = []
    for name in args.models.split(","):
        path = paths[name]()
        cold = [cold_start(path, args.threads) for _ in range(2)]
        rows.append(f"| {name} | cold start to first token | {min(cold):.2f} s (best of 2) | |")
        for dtype in args.dtypes.split(","):
            model = Model.load(path, dtype=dtype)
            ids = prompt_ids(model.cfg.vocab)
            hf = None
            if not args.no_hf:
                from transformers import AutoModelForCausalLM

                hf = AutoModelForCausalLM.from_pretrained(
                    str(path.parent), gguf_file=path.name, dtype=getattr(torch, dtype)
                ).eval()
            ours, theirs = [], []
            for _ in range(args.repeats):  # interleaved A B A B
                ours.append(luced_run(model, ids))
                if hf is not None:
                    theirs.append(hf_run(hf, ids))
            line = f"| {name} | {dtype} | {_fmt(ours)} |"
            if theirs:
                ratio = _median(ours, 1) / _median(theirs, 1)
                line += f" {_fmt(theirs)} (luced decode {ratio:.1f}x) |"
            else:
                line += " |"
            rows.append(line)
            print(line, file=sys.stderr, flush=True)
            del model, hf
    print(
        f"threads={args.threads}, prompt {PROMPT_TOKENS} tokens, decode {DECODE_TOKENS} tokens, "
        f"medians of {args.repeats} interleaved runs\n"
    )
    print("| model | dtype | luced | transformers generate() |")
    print("|---|---|---|---|")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
