#!/usr/bin/env python3
"""Quality of each weights mode on one text: perplexity, and top-1 agreement with the exact
float32 path (`dequant`), on the same tokens.

    python tools/perplexity.py MODEL.gguf FILE.txt [--ctx 256] [--chunks 4]
        [--weights dequant,auto,int4,int8] [--threads 2]
        [--kernels torch,native] [--batch-invariant]
        [--llama-perplexity PATH]   # llama.cpp's perplexity on the same file, for comparison

The text is tokenized once (BOS first, as llama-perplexity does) and cut into --chunks
windows of --ctx tokens; each window is scored from its second half, as llama-perplexity
scores (the first half is context only), so the numbers are comparable with its output.
Prints a Markdown table. `--kernels` scores each compact mode once per packed-kernel
implementation (LUCED_KERNELS); `--batch-invariant` sends every row through the packed
kernels (otherwise calls of more than 64 rows run dense, so a 256-token window tests
them little).
"""

from __future__ import annotations

import argparse
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import torch


def score(model, windows: list[torch.Tensor]) -> tuple[float, list[torch.Tensor]]:
    """(mean negative log-likelihood over the scored halves, argmax ids per window)."""
    nll, count, tops = 0.0, 0, []
    for ids in windows:
        logits = model.forward(ids, model.new_cache(len(ids)), 0).float()
        half = len(ids) // 2
        logp = torch.log_softmax(logits[half:-1], -1)
        target = ids[half + 1 :]
        nll -= logp.gather(1, target[:, None]).sum().item()
        count += len(target)
        tops.append(logits[half:-1].argmax(-1))
    return nll / count, tops


def llama_perplexity(exe: str, model: Path, text: Path, ctx: int, chunks: int, threads: int) -> str:
    out = subprocess.run(
        [
            exe,
            "-m",
            str(model),
            "-f",
            str(text),
            "-c",
            str(ctx),
            "--chunks",
            str(chunks),
            "-t",
            str(threads),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    found = re.search(r"Final estimate: PPL = ([0-9.]+)", out.stdout + out.stderr)
    return found.group(1) if found else f"failed (exit {out.returncode})"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("file", type=Path)
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--weights", default="dequant,auto,int4,int8")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kernels", default="", help="e.g. torch,native (default: LUCED_KERNELS)")
    ap.add_argument("--batch-invariant", action="store_true")
    ap.add_argument("--llama-perplexity", metavar="PATH")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from luced.runtime.model import Model
    from luced.text.tokenizer import Tokenizer

    ids = Tokenizer.from_gguf(args.model).encode(args.file.read_text(), add_bos=True)
    n = min(args.chunks, len(ids) // args.ctx)
    if n < 1:
        sys.exit(f"{args.file}: {len(ids)} tokens, fewer than --ctx {args.ctx}")
    windows = [torch.tensor(ids[i * args.ctx : (i + 1) * args.ctx]) for i in range(n)]
    modes = args.weights.split(",")
    if "dequant" not in modes:
        modes.insert(0, "dequant")  # the reference for top-1 agreement
    results = {}
    for mode in modes:
        for kernels in args.kernels.split(",") if mode != "dequant" else [""]:
            if kernels:
                os.environ["LUCED_KERNELS"] = kernels  # read as each matrix is packed
            model = Model.load(args.model, weights=mode, batch_invariant=args.batch_invariant)
            results[f"{mode} ({kernels})" if kernels else mode] = score(model, windows)
    ref_tops = torch.cat(results["dequant"][1])
    print(f"{args.model.name}, {args.file.name}: {n} windows of {args.ctx} tokens\n")
    print("| weights | perplexity | top-1 agreement with dequant (float32) |")
    print("|---|---|---|")
    for mode, (nll, tops) in results.items():
        agree = (torch.cat(tops) == ref_tops).float().mean().item()
        print(f"| {mode} | {math.exp(nll):.3f} | {agree:.2%} |")
    if args.llama_perplexity:
        ppl = llama_perplexity(
            args.llama_perplexity, args.model, args.file, args.ctx, n, args.threads
        )
        print(f"| llama.cpp llama-perplexity | {ppl} | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
