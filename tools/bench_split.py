"""Layer split cost: decode tok/s and TTFT, unsplit vs 2- and 3-worker splits, in one run;
with --remote, the same split across two hosts vs over shared memory.

    python tools/bench_split.py [--models smollm2,gemma3] [--prompt 64] [--tokens 64]
                                [--rounds 3] [--cores N]
    python tools/bench_split.py --remote [--delays 0,1,5] ...      (root: tools/netlab.py)

Every placement is a real Target (worker subprocesses, shared memory, frames), all
loaded at once and measured interleaved (round 1: A B C .., round 2: A B C ..), so
drift on a shared machine hits them alike; the table shows medians over rounds.
Placements (float32, greedy):

    unsplit     cpu                  one worker, --cores threads
    2w t=1      cpu,cpu:1            two workers, cores/2 threads each (total = cores)
    3w t=1      cpu,cpu:1,cpu:2      three workers, cores/3 (>= 1) threads each
    2w t=all    cpu,cpu:1            two workers, --cores threads each
    3w t=all    cpu,cpu:1,cpu:2      three workers, --cores threads each

The pipeline runs one worker at a time, so "t=all" (every worker may use every core
while it is the one computing) is the fair comparison of the split itself; "t=1" keeps
the total thread count equal to the cores.

orch µs/step = wall time of a decode step minus the workers' compute time in it
(ForwardReply.elapsed_us summed over workers): frames, wakeups, waits, and the daemon's
own handling. TTFT = reset + prefill of the prompt + the first sampled token.

--remote: bench_remote.py (host B a network namespace behind a bridge that adds a delay).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from pathlib import Path

from luced.engine.driver import Driver
from luced.engine.target import Target, TargetPlacement
from luced.gguf_file import GGUFFile
from luced.ipc.shm import ShmOwner
from luced.serve.bundled import gemma3_path, smollm2_path

MODELS = {"smollm2": smollm2_path, "gemma3": gemma3_path}


def placements(cores: int) -> list[tuple[str, tuple[str, ...], int]]:
    return [
        ("unsplit", ("cpu",), cores),
        ("2w t=1", ("cpu", "cpu:1"), max(1, cores // 2)),
        ("3w t=1", ("cpu", "cpu:1", "cpu:2"), max(1, cores // 3)),
        ("2w t=all", ("cpu", "cpu:1"), cores),
        ("3w t=all", ("cpu", "cpu:1", "cpu:2"), cores),
    ]


async def one_run(d: Driver, prompt: list[int], n: int) -> dict[str, float]:
    greedy = {"temperature": 0}
    t0 = time.perf_counter()
    s = await d.prefill(prompt, greedy)
    ttft = time.perf_counter() - t0
    token, orch = s.token, []
    t1 = time.perf_counter()
    for _ in range(n - 1):
        token = (await d.step(token, greedy)).token
        orch.append(d.runner.last_wall_us - d.runner.last_compute_us)
    decode = time.perf_counter() - t1
    return {"ttft_ms": ttft * 1e3, "tok_s": (n - 1) / decode, "orch_us": statistics.mean(orch)}


async def bench_model(name: str, path: Path, args: argparse.Namespace) -> list[list[str]]:
    gguf = GGUFFile(path)
    n_layers = int(gguf.require(f"{gguf.arch}.block_count"))
    vocab = len(gguf.metadata["tokenizer.ggml.tokens"])
    prompt = [(97 + 31 * i) % vocab for i in range(args.prompt)]
    rows: list[list[str]] = []
    with ShmOwner() as owner:
        targets: list[tuple[str, Driver]] = []
        try:
            for label, devices, threads in placements(args.cores):
                placement = TargetPlacement.split(
                    model=str(path),
                    n_layers=n_layers,
                    dtype="float32",
                    kv_capacity=args.prompt + args.tokens + 8,
                    max_batch_tokens=max(64, args.prompt),
                    devices=devices,
                    threads=threads,
                )
                target = Target(owner, placement, name=f"r{len(targets)}")
                targets.append((label, Driver(target)))
                await target.start()
            results: dict[str, list[dict[str, float]]] = {label: [] for label, _ in targets}
            for _ in range(args.rounds):
                for label, target in targets:
                    results[label].append(await one_run(target, prompt, args.tokens))
            base = statistics.median(r["tok_s"] for r in results["unsplit"])
            for (label, target), (_, devices, threads) in zip(
                targets, placements(args.cores), strict=True
            ):
                med = {
                    k: statistics.median(r[k] for r in results[label]) for k in results[label][0]
                }
                layers = (s["layers"] for s in target.target.describe())
                ranges = " ".join(f"[{a},{b})" for a, b in layers)
                rows.append(
                    [
                        name,
                        label,
                        f"{len(set(devices))}x{threads}",
                        ranges,
                        f"{med['tok_s']:.1f}",
                        f"{100 * med['tok_s'] / base:.0f}%",
                        f"{med['ttft_ms']:.0f}",
                        f"{med['orch_us']:.0f}",
                    ]
                )
        finally:
            for _, target in targets:
                await target.target.close()
    return rows


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--models", default="smollm2,gemma3")
    p.add_argument("--prompt", type=int, default=64, help="prompt tokens")
    p.add_argument("--tokens", type=int, default=64, help="generated tokens per run")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--cores", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--remote", action="store_true", help="split across hosts vs shared memory")
    p.add_argument("--delays", default="0,1,5", help="--remote: ms added each way on the wire")
    args = p.parse_args()
    if args.remote:
        from bench_remote import bench_remote  # run as a script: tools/ is on sys.path

        for name in args.models.split(","):
            await bench_remote(name, MODELS[name](), args)
        return
    header = ["model", "placement", "workers x threads", "layers", "tok/s", "vs unsplit"]
    header += ["TTFT ms", "orch µs/step"]
    rows = []
    for name in args.models.split(","):
        rows += await bench_model(name, MODELS[name](), args)
    print(f"prompt {args.prompt} tokens, {args.tokens} generated, {args.rounds} rounds, "
          f"{args.cores} cores, float32, greedy; medians")  # fmt: skip
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for r in rows:
        print("| " + " | ".join(r) + " |")


if __name__ == "__main__":
    asyncio.run(main())
