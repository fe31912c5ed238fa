"""MoE expert compute cost: decode and prefill tok/s with every expert local, with half the
experts cold computed in process (the fallback), and with them in an expert worker.

    python tools/bench_moe.py [--prompt 128] [--tokens 64] [--rounds 3] [--threads 1]

A tiny random qwen3moe sized so that expert compute dominates a step (hidden 256, 4 layers,
32 experts of width 1024, 4 per token) is built once. Three real Targets (worker
subprocesses, shared memory, frames) load it and are measured interleaved, round by round,
so drift on a shared machine hits them alike; the table shows medians over rounds:

    all-local    every expert in the target's worker
    in-process   --moe-hot-experts 16: the other 16 per layer on the CPU in the same worker
    remote       --moe-hot-experts 16 --moe-expert-device cpu:1: in an expert worker

For the remote placement, per MoE-layer call during decode: round trip as the target
worker sees it (write the scratch, frame, wait, read back), the expert worker's compute in
it, the difference (what the link costs), and that overhead summed over the MoE layers as
a share of a decode step.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from luced.engine.driver import Driver
from luced.engine.target import Target, TargetPlacement
from luced.gguf_file import GGUFFile
from luced.ipc.shm import ShmOwner
from luced.runtime.tiny import make_tiny_gguf

SIZE = dict(hidden=256, layers=4, experts=32, experts_used=4, expert_ffn=1024, context=1024)
HOT = 16
PLACEMENTS = {"all-local": {}, "in-process": {"moe_hot": HOT}}
PLACEMENTS["remote"] = {"moe_hot": HOT, "moe_expert_device": "cpu:1"}


def build(directory: Path) -> Path:
    path = directory / "bench-qwen3moe.gguf"
    make_tiny_gguf("qwen3moe", path, seed=1, **SIZE)
    return path


async def remote_stats(target: Target) -> dict:
    return dict((await target.stats())["workers"][0])


async def one_run(target: Target, prompt: list[int], n: int) -> dict[str, float]:
    greedy = {"temperature": 0}
    d = Driver(target)
    t0 = time.perf_counter()
    s = await d.prefill(prompt, greedy)
    prefill = time.perf_counter() - t0
    before = await remote_stats(target)
    token = s.token
    t1 = time.perf_counter()
    for _ in range(n - 1):
        token = (await d.step(token, greedy)).token
    decode = time.perf_counter() - t1
    after = await remote_stats(target)
    out = {"prefill_tok_s": len(prompt) / prefill, "decode_tok_s": (n - 1) / decode}
    calls = after.get("moe_remote_calls", 0) - before.get("moe_remote_calls", 0)
    if calls:
        rt = (after["moe_remote_us"] - before["moe_remote_us"]) / calls
        compute = (after["moe_remote_compute_us"] - before["moe_remote_compute_us"]) / calls
        out |= {"rt_us": rt, "compute_us": compute, "calls_per_step": calls / (n - 1)}
        out["step_us"] = decode / (n - 1) * 1e6
    return out


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens (one prefill chunk)")
    p.add_argument("--tokens", type=int, default=64, help="generated tokens per run")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp, ShmOwner() as owner:
        path = build(Path(tmp))
        gguf = GGUFFile(path)
        n_layers = int(gguf.require("qwen3moe.block_count"))
        vocab = len(gguf.metadata["tokenizer.ggml.tokens"])
        prompt = [(97 + 31 * i) % vocab for i in range(args.prompt)]
        targets: dict[str, Target] = {}
        try:
            for label, moe in PLACEMENTS.items():
                placement = TargetPlacement.split(
                    model=str(path),
                    n_layers=n_layers,
                    dtype="float32",
                    kv_capacity=args.prompt + args.tokens + 8,
                    max_batch_tokens=args.prompt,
                    devices=("cpu",),
                    threads=args.threads,
                    moe_dims=(SIZE["hidden"], SIZE["experts_used"]),
                    **moe,
                )
                targets[label] = Target(owner, placement, name=f"m{len(targets)}")
                await targets[label].start()
            results: dict[str, list[dict[str, float]]] = {label: [] for label in targets}
            for _ in range(args.rounds):
                for label, target in targets.items():
                    results[label].append(await one_run(target, prompt, args.tokens))
        finally:
            for target in targets.values():
                await target.close()
    med = {
        label: {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        for label, runs in results.items()
    }
    base = med["all-local"]
    print(f"tiny qwen3moe {SIZE}, {HOT} hot experts per layer; prompt {args.prompt} tokens, "
          f"{args.tokens} generated, {args.rounds} rounds, {args.threads} thread(s) per "
          "worker, float32, greedy; medians")  # fmt: skip
    print("| placement | decode tok/s | vs all-local | prefill tok/s | vs all-local |")
    print("|---|---|---|---|---|")
    for label, m in med.items():
        print(
            f"| {label} | {m['decode_tok_s']:.1f} | {m['decode_tok_s'] / base['decode_tok_s']:.2f} "
            f"| {m['prefill_tok_s']:.0f} | {m['prefill_tok_s'] / base['prefill_tok_s']:.2f} |"
        )
    r = med["remote"]
    link = r["rt_us"] - r["compute_us"]
    print()
    print("| remote, per MoE-layer decode call | µs |")
    print("|---|---|")
    print(f"| round trip seen by the target | {r['rt_us']:.0f} |")
    print(f"| expert worker compute in it | {r['compute_us']:.0f} |")
    print(f"| link overhead (difference) | {link:.0f} |")
    share = 100 * link * r["calls_per_step"] / r["step_us"]
    step_ms = r["step_us"] / 1e3
    print(
        f"| overhead × {r['calls_per_step']:.0f} calls per step, share of a "
        f"{step_ms:.1f} ms decode step | {share:.1f}% |"
    )


if __name__ == "__main__":
    asyncio.run(main())
