"""Prefill and decode speed of luced configurations, interleaved in one run: two source trees
(a before/after), `--batch-invariant` on each, and other prefill chunk sizes.

    python tools/bench_prefill.py REF_TREE [--new TREE] [--sides ref,ref:bi,new,new:bi]
        [--prompts 512,2048] [--chunk 512] [--weights auto] [--threads 1] [--rounds 5]
        [--decode 32]

A side is `ref` or `new` (the tree) with optional `:bi` (`Model.load(batch_invariant=True)`),
`:torch` (`LUCED_KERNELS=torch`: torch's packed kernels and SDPA, not luced's) and `:chunkN`
(prefill chunks of N tokens instead of --chunk). Each side is one process
(this file run with PYTHONPATH=tree) that loads SmolLM2 once and, when asked, prefills a
prompt of each length into a fresh cache the way the daemon does (chunks of `chunk`
tokens, the logits of each chunk's last row only) and then decodes `decode` greedy steps
after the longest one. Rounds alternate the side order (forward, then reversed), so drift
and the neighbours' load hit every side. Prints, per prompt length, each side's median
wall time, tok/s and CPU time (of the process: all its threads), and the medians of its
per-round wall and CPU ratios to the first side; the same for a decode step. On a shared
machine CPU time is the steadier measure at 1 thread (wall time includes the waits for a
core); at more threads it also counts OpenMP's spinning.
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


def serve(weights: str, threads: int, invariant: bool, chunk: int, decode: int) -> None:
    """Side process: read prompt lengths (a JSON list) per line; print the timings (JSON)."""
    import torch

    from luced.runtime.model import Model
    from luced.serve import bundled

    torch.set_num_threads(threads)
    model = Model.load(bundled.smollm2_path(), weights=weights, batch_invariant=invariant)
    ids = torch.randint(1000, 30000, (8192,), generator=torch.Generator().manual_seed(0))

    def prefill(n: int) -> tuple[object, int, float, float]:
        cache = model.new_cache(n + decode + 8)
        wall, cpu = time.perf_counter(), time.process_time()
        for a in range(0, n, chunk):
            piece = ids[a : min(n, a + chunk)]
            h, _ = model.forward_layers(model.embed(piece), cache, a, ids=piece)
            logits = model.logits(h[-1:])
        return (
            cache,
            int(logits[-1].argmax()),
            time.perf_counter() - wall,
            time.process_time() - cpu,
        )

    print("ready", flush=True)
    for line in sys.stdin:
        out: dict[str, list[float]] = {}
        for n in json.loads(line):
            cache, token, wall, cpu = prefill(n)
            out[str(n)] = [wall, cpu]
        wall, cpu = time.perf_counter(), time.process_time()
        for pos in range(n, n + decode):  # after the longest prompt (the last)
            token = int(model.forward(torch.tensor([token]), cache, pos)[-1].argmax())  # type: ignore[arg-type]
        out["decode"] = [
            (time.perf_counter() - wall) / decode,
            (time.process_time() - cpu) / decode,
        ]
        print(json.dumps(out), flush=True)


class Side:
    def __init__(self, spec: str, trees: dict[str, Path], args: argparse.Namespace) -> None:
        tree, *opts = spec.split(":")
        chunk = next((int(o.removeprefix("chunk")) for o in opts if o.startswith("chunk")), None)
        self.name = spec
        cmd = [sys.executable, __file__, "--serve", args.weights, str(args.threads)]
        cmd += ["1" if "bi" in opts else "0", str(chunk or args.chunk), str(args.decode)]
        env = dict(os.environ, PYTHONPATH=str(trees[tree]))
        if "torch" in opts:
            env["LUCED_KERNELS"] = "torch"
        self.proc = subprocess.Popen(
            cmd, cwd=trees[tree], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert self.proc.stdout is not None
        if self.proc.stdout.readline().strip() != "ready":
            raise RuntimeError(f"{spec}: side failed to start")

    def run(self, prompts: list[int]) -> dict[str, list[float]]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(prompts) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait()


def table(key: str, sides: list[Side], samples: list[list[dict]], tokens: int) -> list[str]:
    """One Markdown row per side: median wall time, tok/s and CPU time, and the medians of
    the per-round wall and CPU ratios to the first side."""
    rows = []
    for side, runs in zip(sides, samples, strict=True):
        wall, cpu = ([r[key][i] for r in runs] for i in (0, 1))
        ratios = [
            statistics.median(a[key][i] / b[key][i] for a, b in zip(runs, samples[0], strict=True))
            for i in (0, 1)
        ]
        med = statistics.median(wall)
        rows.append(
            f"| {key} | {side.name} | {med * 1e3:.1f} ms | {tokens / med:.1f} | "
            f"{ratios[0]:.2f}x | {statistics.median(cpu) * 1e3:.1f} ms | **{ratios[1]:.2f}x** |"
        )
    return rows


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--serve":
        weights, threads, invariant, chunk, decode = sys.argv[2:7]
        serve(weights, int(threads), invariant == "1", int(chunk), int(decode))
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("ref", type=Path, help="the 'before' source tree (e.g. a git worktree)")
    p.add_argument("--new", type=Path, default=Path(__file__).resolve().parents[1])
    p.add_argument("--sides", default="ref,ref:bi,new,new:bi")
    p.add_argument("--prompts", default="512,2048")
    p.add_argument("--chunk", type=int, default=512, help="prefill chunk (--max-batch-tokens)")
    p.add_argument("--weights", default="auto")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--decode", type=int, default=32, help="decode steps after the longest")
    args = p.parse_args()
    trees = {"ref": args.ref.resolve(), "new": args.new.resolve()}
    prompts = sorted(int(n) for n in args.prompts.split(","))
    print(f"ref {trees['ref']}, new {trees['new']}; {args.weights}, {args.threads} threads")
    sides = [Side(spec, trees, args) for spec in args.sides.split(",")]
    try:
        for side in sides:
            side.run(prompts[:1])  # warm up
        samples: list[list[dict]] = [[] for _ in sides]
        for r in range(args.rounds):
            order = range(len(sides)) if r % 2 == 0 else reversed(range(len(sides)))
            for i in order:
                samples[i].append(sides[i].run(prompts))
    finally:
        for side in sides:
            side.close()
    print("| prompt | side | wall | tok/s | wall vs first | CPU time | CPU vs first |")
    print("|---|---|---|---|---|---|---|")
    for n in prompts:
        print("\n".join(table(str(n), sides, samples, n)))
    print("\n".join(table("decode", sides, samples, 1)))


if __name__ == "__main__":
    main()
