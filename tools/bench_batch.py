"""What one batched decode step buys: B sequences decoded in one ragged forward against the
same B sequences decoded one forward each, in process, interleaved.

    python tools/bench_batch.py [--model PATH] [--weights auto] [--batches 1,2,4,8]
                                [--context 256] [--steps 16] [--rounds 3] [--threads N]
                                [--kv-dtype float32,bfloat16]

Each sequence is primed with `--context` random ids (its own), then both ways decode
`--steps` greedy tokens per sequence on copies of the same caches; rounds alternate which
way runs first. Reported per batch size: aggregate decode tok/s of each way, the ratio,
and that every sequence produced the same tokens both ways (greedy; exact under the packed
weights, where the kernels are batch-invariant). The bundled SmolLM2-135M by default.
`--kv-dtype a,b`: each K/V dtype in turn (16-bit rows halve what attention reads).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from pathlib import Path

import torch

from luced.runtime.model import Model
from luced.serve.bundled import smollm2_path


def decode_alone(model: Model, caches: list, last: list[int], pos: int, steps: int) -> list:
    out = [[] for _ in caches]
    for step in range(steps):
        for i, cache in enumerate(caches):
            token = out[i][-1] if out[i] else last[i]
            logits = model.forward(torch.tensor([token]), cache, pos + step)
            out[i].append(int(logits[-1].argmax()))
    return out


def decode_batched(model: Model, caches: list, last: list[int], pos: int, steps: int) -> list:
    out = [[] for _ in caches]
    for step in range(steps):
        feeds = [torch.tensor([o[-1] if o else t]) for o, t in zip(out, last, strict=True)]
        logits = model.forward_batch(feeds, caches, [pos + step] * len(caches))
        for i, rows in enumerate(logits):
            out[i].append(int(rows[-1].argmax()))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--weights", default="auto")
    ap.add_argument("--batches", default="1,2,4,8")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--kv-dtype", default="float32", help="K/V dtypes, comma-separated")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = args.model or smollm2_path()
    for kv_dtype in args.kv_dtype.split(","):
        model = Model.load(path, weights=args.weights, kv_dtype=kv_dtype)
        print(f"{path.name}, weights {args.weights}, K/V {kv_dtype}, {args.threads} threads, "
              f"context {args.context}")  # fmt: skip
        run(model, args)


def run(model: Model, args: argparse.Namespace) -> None:
    capacity = args.context + args.steps + 1
    g = torch.Generator().manual_seed(0)
    print("batch  alone tok/s  batched tok/s  ratio  same tokens")
    for b in [int(x) for x in args.batches.split(",")]:
        primed, last = [], []
        for _ in range(b):
            ids = torch.randint(3, model.cfg.vocab, (args.context,), generator=g)
            cache = model.new_cache(capacity)
            model.forward(ids[:-1], cache, 0)
            primed.append(cache)
            last.append(int(ids[-1]))
        times: dict[str, list[float]] = {"alone": [], "batched": []}
        tokens: dict[str, list] = {}
        ways = {"alone": decode_alone, "batched": decode_batched}
        for r in range(args.rounds):
            for name in ("alone", "batched") if r % 2 == 0 else ("batched", "alone"):
                caches = copy.deepcopy(primed)
                t0 = time.perf_counter()
                tokens[name] = ways[name](model, caches, last, args.context - 1, args.steps)
                times[name].append(time.perf_counter() - t0)
        rate = {k: b * args.steps / statistics.median(v) for k, v in times.items()}
        same = tokens["alone"] == tokens["batched"]
        ratio = rate["batched"] / rate["alone"]
        print(f"{b:5d}  {rate['alone']:11.1f}  {rate['batched']:13.1f}  {ratio:5.2f}x  {same}")


if __name__ == "__main__":
    main()
