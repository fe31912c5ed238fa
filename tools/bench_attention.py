"""The attention share of a decode step at a long context, per K/V dtype (--kv-dtype) and
attention kernel (the native decode kernel, or SDPA).

    python tools/bench_attention.py [--model PATH] [--weights auto] [--context 4096]
                                    [--kv-dtypes float32,bfloat16] [--steps 16] [--rounds 3]

Each K/V dtype gets a model (same weights, float32 compute) whose cache is primed with
`--context` ids; then decode steps are timed, the variants interleaved round by round, and
one instrumented step per variant splits the step into attention and the rest. Each cache
runs twice: through the native decode kernel (csrc/decode_attention.c, which reads
float32, bfloat16 and float16 rows) and through SDPA, the torch path. Reported per
variant: median ms per decode step, attention ms and share, and the KV bytes read per
token. The bundled SmolLM2-135M by default.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from luced.runtime import native_attention
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


@contextlib.contextmanager
def attention_kernel(kernel: str) -> Iterator[None]:
    """Decode attention on `kernel` ("native" where it applies, or "sdpa") inside."""
    supported = native_attention.supported
    if kernel == "sdpa":
        native_attention.supported = lambda *_: False  # type: ignore[assignment]
    try:
        yield
    finally:
        native_attention.supported = supported  # type: ignore[assignment]


def attention_ms(model: Model, cache) -> float:
    """ms of one decode step spent in attention: SDPA's self time (torch profiler) plus the
    native kernel's calls (timed around them; the profiler does not see them)."""
    start = cache.pos
    native = native_attention.decode_attention
    spent = [0.0]

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        out = native(*args, **kwargs)
        spent[0] += time.perf_counter() - t0
        return out

    native_attention.decode_attention = timed  # type: ignore[assignment]
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            model.forward(torch.tensor([7]), cache, start)
    finally:
        native_attention.decode_attention = native  # type: ignore[assignment]
    cache.truncate(start)
    sdpa = sum(e.self_cpu_time_total for e in prof.key_averages() if e.key.startswith(SDPA))
    return sdpa / 1e3 + spent[0] * 1e3


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
    variants = [(d, k) for d in dtypes for k in ("native", "sdpa")]
    caches = {}
    with torch.inference_mode():
        prompt = torch.randint(0, models[dtypes[0]].cfg.vocab, (args.context,))
        for d, model in models.items():
            caches[d] = model.new_cache(args.context + args.steps)
            for a in range(0, args.context, 512):  # prefill in chunks, as the daemon does
                model.forward(prompt[a : a + 512], caches[d], a)
        times: dict[tuple[str, str], list[float]] = {v: [] for v in variants}
        attn: dict[tuple[str, str], float] = {}
        for _ in range(args.rounds):
            for d, kernel in variants:
                with attention_kernel(kernel):
                    times[d, kernel].append(step_ms(models[d], caches[d], args.steps))
        for d, kernel in variants:
            with attention_kernel(kernel):
                attn[d, kernel] = attention_ms(models[d], caches[d])
    print(
        f"{path.name}, weights {args.weights}, float32 compute, context {args.context}, "
        f"{args.threads} threads, {args.rounds} rounds x {args.steps} steps (medians)"
    )
    print("kv dtype  kernel   step ms  attention ms  share  KV MB read per token")
    for d, kernel in variants:
        ms, spent = statistics.median(times[d, kernel]), attn[d, kernel]
        cache = caches[d]
        per_position = sum(2 * h * dim for h, dim in cache.shapes.values()) * cache.dtype.itemsize
        kv_mb = per_position * args.context / 1e6
        print(f"{d:9s} {kernel:6s} {ms:8.1f}  {spent:12.1f}  {spent / ms:5.0%}  {kv_mb:10.0f}")


if __name__ == "__main__":
    main()
