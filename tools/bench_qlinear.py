"""Where packed GEMV stops paying: time of one linear layer against the rows M it runs on,
packed kernels (qlinear.PackedLinear.gemv: torch's, and the native ones when built) against
the dense path (dequantize into the scratch buffer + matmul in the CPU's fast dtype),
interleaved in one run, per shape and form.

    python tools/bench_qlinear.py [--threads N] [--rows 1,4,8,16,32,64] [--shapes smollm2]

Prints a table of ms per call (torch / native / dense, median) and the crossover M (first M
where dense beats the fastest packed kernel) per shape; qlinear.GEMV_MAX_ROWS is chosen from
it (docs/design.md "Compact weights").
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from luced.runtime import native, qlinear
from luced.runtime.qlinear import PackedLinear, quantize

SHAPES = {  # (out, in): SmolLM2's fused matrices as a decode step calls them
    "smollm2 qkv 960x576": (960, 576),
    "smollm2 gate_up 3072x576": (3072, 576),
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
    p.add_argument("--shapes", default="", help="only shapes whose name contains this")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    rows = [int(r) for r in args.rows.split(",")]
    dt = qlinear.dense_dtype("cpu")
    cpu = torch.backends.cpu.get_cpu_capability()
    kern = native.kernels(torch.device("cpu"), "auto")
    kinds = ["torch", "native"] if kern is not None else ["torch"]
    isa = f"native {kern.isa}, {8 * kern.levels}-bit activations" if kern else "no native"
    print(f"cpu {cpu}, {isa}, dense dtype {dt}, {args.threads} threads")
    head = " / ".join([*kinds, "dense"])
    print("| shape | form | " + " | ".join(f"M={m} {head}" for m in rows) + " | crossover |")
    print("|---|---|" + "---|" * (len(rows) + 1))
    for name, (n, k) in SHAPES.items():
        if args.shapes not in name:
            continue
        w = torch.randn(n, k) * 0.02
        for form in ("int4", "int8"):
            packed = {kind: PackedLinear(quantize(w, form), torch.float32, kind) for kind in kinds}
            cells, cross = [], None
            for m in rows:
                x = torch.randn(m, k).to(torch.bfloat16)
                reps = max(3, args.reps if n < 10000 else 3)
                # interleaved: each kind's samples span the same stretch of time
                times = {kind: [] for kind in [*kinds, "dense"]}
                for _ in range(reps):
                    for kind in kinds:
                        times[kind].append(_time(lambda x=x, w=packed[kind]: w.gemv(x), 1))
                    dense_w = packed["torch"]
                    times["dense"].append(
                        _time(lambda x=x, w=dense_w: F.linear(x.to(dt), w.dense(dt)), 1)
                    )
                med = {kind: statistics.median(v) for kind, v in times.items()}
                cells.append(" / ".join(f"{med[kind]:.3f}" for kind in [*kinds, "dense"]))
                if cross is None and med["dense"] < min(med[kind] for kind in kinds):
                    cross = m
            cross_text = cross or f">{rows[-1]}"
            print(f"| {name} | {form} | " + " | ".join(cells) + f" | {cross_text} |")


if __name__ == "__main__":
    main()
