"""Single-sequence decode step time of two luced source trees, interleaved in one run: a
before/after for a runtime change on a machine whose speed drifts (shared vCPUs).

    python tools/bench_decode.py REF_TREE [--new TREE] [--models smollm2,gemma3]
        [--weights auto] [--dtype float32] [--threads 2] [--rounds 12] [--steps 16]
        [--ref-env LUCED_KERNELS=torch] [--new-env LUCED_KERNELS=native]

Each tree gets one worker process (this file run with PYTHONPATH=tree) that loads the model,
prefills 256 tokens and then decodes greedily in batches of --steps when asked; batches
alternate between the trees (ABBA order), so drift and neighbours' load hit both sides.
Prints, per model, the median wall ms per step and tok/s of each tree, the median of the
per-round ratios, and CPU time per step divided by threads (less sensitive to other
processes than wall time, though not to the memory bandwidth they take). `--ref-env` /
`--new-env` add environment variables to one side (REF_TREE may then be the same tree: torch
against native kernels in one run).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

PROMPT = 256
CAPACITY = 2048


def serve(model_name: str, weights: str, dtype: str, threads: int) -> None:
    """Worker: read a step count per line, decode that many tokens, print wall and CPU s."""
    import torch

    from luced.runtime.model import Model
    from luced.serve import bundled

    torch.set_num_threads(threads)
    path = bundled.smollm2_path() if model_name == "smollm2" else bundled.gemma3_path()
    model = Model.load(path, weights=weights, dtype=dtype)
    prompt = torch.randint(0, 30000, (PROMPT,), generator=torch.Generator().manual_seed(0))

    def fresh() -> tuple[object, int, int]:
        cache = model.new_cache(CAPACITY)
        return cache, int(model.forward(prompt, cache, 0)[-1].argmax()), PROMPT

    cache, token, pos = fresh()
    print("ready", flush=True)
    for line in sys.stdin:
        n = int(line)
        if pos + n > CAPACITY:  # start over, so both trees decode at the same positions
            cache, token, pos = fresh()
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(n):
            token = int(model.forward(torch.tensor([token]), cache, pos)[-1].argmax())  # type: ignore[arg-type]
            pos += 1
        print(time.perf_counter() - wall, time.process_time() - cpu, flush=True)


class Worker:
    def __init__(self, tree: Path, model: str, args: argparse.Namespace, extra: list[str]) -> None:
        cmd = [sys.executable, __file__, "--serve", model, args.weights, args.dtype]
        cmd.append(str(args.threads))
        env = dict(os.environ, PYTHONPATH=str(tree))
        env.update(item.split("=", 1) for item in extra)
        self.proc = subprocess.Popen(
            cmd, cwd=tree, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert self.proc.stdout is not None
        if self.proc.stdout.readline().strip() != "ready":
            raise RuntimeError(f"{tree}: worker failed to start")

    def run(self, steps: int) -> tuple[float, float]:
        """(wall s, CPU s) per step over `steps` decode steps."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"{steps}\n")
        self.proc.stdin.flush()
        wall, cpu = map(float, self.proc.stdout.readline().split())
        return wall / steps, cpu / steps

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait()


def compare(model: str, ref: Path, new: Path, args: argparse.Namespace) -> str:
    workers = [Worker(ref, model, args, args.ref_env), Worker(new, model, args, args.new_env)]
    try:
        for w in workers:
            w.run(4)  # warm up
        samples: list[list[tuple[float, float]]] = [[], []]
        for r in range(args.rounds):
            for i in (0, 1) if r % 2 == 0 else (1, 0):
                samples[i].append(workers[i].run(args.steps))
    finally:
        for w in workers:
            w.close()
    wall = [[s[0] for s in side] for side in samples]
    cpu = [statistics.median(s[1] for s in side) / args.threads * 1e3 for side in samples]
    ms = [statistics.median(side) * 1e3 for side in wall]
    ratio = statistics.median(a / b for a, b in zip(*wall, strict=True))
    return (
        f"| {model} | {args.weights} | {args.dtype} | {args.threads} | {ms[0]:.2f} ms "
        f"({1e3 / ms[0]:.1f} tok/s) | {ms[1]:.2f} ms ({1e3 / ms[1]:.1f} tok/s) | "
        f"**{ratio:.2f}x** | {cpu[0]:.2f} / {cpu[1]:.2f} ms = {cpu[0] / cpu[1]:.2f}x |"
    )


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--serve":
        serve(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]))
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("ref", type=Path, help="the 'before' source tree (e.g. a git worktree)")
    p.add_argument("--new", type=Path, default=Path(__file__).resolve().parents[1])
    p.add_argument("--models", default="smollm2")
    p.add_argument("--weights", default="auto")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--ref-env", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--new-env", action="append", default=[], metavar="KEY=VALUE")
    args = p.parse_args()
    print(f"ref {args.ref.resolve()}, new {args.new.resolve()}")
    columns = "model | weights | dtype | threads | ref step | new step | speedup | CPU/step"
    print(f"| {columns} |")
    print("|---|---|---|---|---|---|---|---|")
    for model in args.models.split(","):
        print(compare(model, args.ref.resolve(), args.new.resolve(), args), flush=True)


if __name__ == "__main__":
    main()
