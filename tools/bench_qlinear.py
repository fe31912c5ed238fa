"""Where packed GEMV stops paying: time of one linear layer against the rows M it runs on,
packed kernel (qlinear.PackedLinear.gemv) against the dense path (dequantize into the scratch
buffer + matmul in the CPU's fast dtype), interleaved in one run, per shape and form.

    python tools/bench_qlinear.py [--threads N] [--rows 1,4,8,16,32,64]

Prints a table of ms per call and the crossover M (first M where dense wins) per shape;
qlinear.GEMV_MAX_ROWS is chosen from it (docs/design.md "Compact weights").
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from luced.runtime import qlinear
from luced.runtime.qlinear import PackedLinear, quantize

SHAPES = {  # (out, in)
    "smollm2 ffn_up 1536x576": (1536, 576),
    "smollm2 ffn_down 576x1536": (576, 1536),
    "smollm2 head 49152x576": (49152, 576),
    "gemma3 ffn_up 2048x640": (2048, 640),
}


def _time(fn, reps: int) -> float:
    fn()
    samples = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
    return statistics.median(samples) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", default="1,2,4,8,16,24,32,64,128")
    p.add_argument("--reps", type=int, default=7)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    rows = [int(r) for r in args.rows.split(",")]
    dt = qlinear.dense_dtype("cpu")
    cpu = torch.backends.cpu.get_cpu_capability()
    print(f"cpu {cpu}, dense dtype {dt}, {args.threads} threads")
    print("| shape | form | " + " | ".join(f"M={m} gemv / dense" for m in rows) + " | crossover |")
    print("|---|---|" + "---|" * (len(rows) + 1))
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k) * 0.02
        for form in ("int4", "int8"):
            packed = PackedLinear(quantize(w, form), torch.float32)
            cells, cross = [], None
            for m in rows:
                x = torch.randn(m, k).to(torch.bfloat16)
                reps = max(3, args.reps if n < 10000 else 3)
                gemv = _time(lambda x=x, w=packed: w.gemv(x), reps)
                dense = _time(lambda x=x, w=packed: F.linear(x.to(dt), w.dense(dt)), reps)
                cells.append(f"{gemv:.2f} / {dense:.2f}")
                if cross is None and dense < gemv:
                    cross = m
            cross_text = cross or f">{rows[-1]}"
            print(f"| {name} | {form} | " + " | ".join(cells) + f" | {cross_text} |")


if __name__ == "__main__":
    main()
