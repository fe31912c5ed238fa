"""The attention share of a decode step at a long context, per K/V dtype (--kv-dtype).

    python tools/bench_attention.py [--model PATH] [--weights auto] [--context 4096]
                                    [--kv-dtypes float32,bfloat16] [--steps 16] [--rounds 3]

Each K/V dtype gets a model (same weights, float32 compute) whose cache is primed with
`--context` ids; then decode steps are timed, the dtypes interleaved round by round, and
one profiled step per dtype splits the step into attention (the SDPA kernel) and the rest.
Reported per dtype: median ms per decode step, attention ms and share, and the KV bytes
read per token. The bundled SmolLM2-135M by default.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from luced.runtime.model import Model
from luced.serve.bundled import smollm2_path

SDPA = "aten::_scaled_dot_product"  # the CPU flash kernel's op names start with this


def step_ms(model: Model, cache, steps: int) -> float:
    """ms per decode step over `steps` steps, then the cache is rolled back."""
    start = cache.pos
    t0 = time.perf_counter()
    for i in range(steps):
        model.forward(torch.tensor([100 + i]), cache, start + i)
    elapsed = (time.perf_counter() - t0) / steps * 1e3
    cache.truncate(start)
    return elapsed


def attention_ms(model: Model, cache) -> float:
    """ms of one decode step spent in the attention kernel (torch profiler, self time)."""
    start = cache.pos
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        model.forward(torch.tensor([7]), cache, start)
    cache.truncate(start)
    return sum(e.self_cpu_time_total for e in prof.key_averages() if e.key.startswith(SDPA)) / 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--weights", default="auto")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--kv-dtypes", default="float32,bfloat16")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = args.model or smollm2_path()
    dtypes = args.kv_dtypes.split(",")
    models = {d: Model.load(path, weights=args.weights, kv_dtype=d) for d in dtypes}
    caches = {}
    with torch.inference_mode():
        prompt = torch.randint(0, models[dtypes[0]].cfg.vocab, (args.context,))
        for d, model in models.items():
            caches[d] = model.new_cache(args.context + args.steps)
            for a in range(0, args.context, 512):  # prefill in chunks, as the daemon does
                model.forward(prompt[a : a + 512], caches[d], a)
        times: dict[str, list[float]] = {d: [] for d in dtypes}
        for _ in range(args.rounds):
            for d in dtypes:
                times[d].append(step_ms(models[d], caches[d], args.steps))
        attn = {d: attention_ms(models[d], caches[d]) for d in dtypes}
    print(
        f"{path.name}, weights {args.weights}, float32 compute, context {args.context}, "
        f"{args.threads} threads, {args.rounds} rounds x {args.steps} steps (medians)"
    )
    print("kv dtype   step ms  attention ms  share  KV MB read per token")
    for d in dtypes:
        ms = statistics.median(times[d])
        cache = caches[d]
        per_position = sum(2 * h * dim for h, dim in cache.shapes.values()) * cache.dtype.itemsize
        kv_mb = per_position * args.context / 1e6
        print(f"{d:9s} {ms:8.1f}  {attn[d]:12.1f}  {attn[d] / ms:5.0%}  {kv_mb:10.0f}")


if __name__ == "__main__":
    main()
