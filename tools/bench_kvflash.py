"""KV Flash cost and memory: decode speed and worker RSS at long contexts, pool or none.

    python tools/bench_kvflash.py [--contexts 1024,4096,8192] [--pool 1024] [--tokens 32]
                                  [--threads N] [--model PATH]

For each context and each cache (plain, pool), a fresh Target (worker subprocess, shared
memory, frames) on the bundled SmolLM2-135M in float32: prefill `context - tokens` random
ids, then decode `tokens` greedy tokens. Reported: decode tok/s and the worker's RSS after
the run (its K/V included; the host tier lives in the daemon's shared memory and is
reported apart). Random ids: the speed and memory do not depend on the text.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from pathlib import Path

from luced.engine.kvflash.transport import KVFlashSettings, pager_config
from luced.engine.target import Target, TargetPlacement
from luced.gguf_file import GGUFFile
from luced.ipc.shm import ShmOwner

GREEDY = {"temperature": 0}


async def run_one(path: Path, context: int, pool: int, tokens: int, threads: int) -> dict:
    gguf = GGUFFile(path)
    flash = None
    if pool:
        flash = pager_config(KVFlashSettings(pool, policy="lru"), pool, gguf)
    vocab = len(gguf.get("tokenizer.ggml.tokens"))
    with ShmOwner() as owner:
        placement = TargetPlacement.split(
            model=str(path),
            n_layers=int(gguf.require(f"{gguf.arch}.block_count")),
            dtype="float32",
            kv_capacity=context,
            max_batch_tokens=512,
            devices=("cpu",),
            threads=threads,
        )
        target = Target(owner, placement, kv_flash=flash)
        try:
            await target.start()
            rng = random.Random(0)
            prompt = [rng.randrange(100, vocab) for _ in range(context - tokens)]
            t0 = time.perf_counter()
            s = await target.prefill(prompt, GREEDY, None)
            prefill_s = time.perf_counter() - t0
            token = s.token
            t0 = time.perf_counter()
            for _ in range(tokens - 1):
                token = (await target.step(token, GREEDY, None)).token
            decode = (tokens - 1) / (time.perf_counter() - t0)
            stats = await target.stats()
            status = target.flash_status() or {}
        finally:
            await target.close()
    return {
        "context": context,
        "pool": pool or "-",
        "prefill_tok_s": len(prompt) / prefill_s,
        "decode_tok_s": decode,
        "rss_mib": stats["rss_bytes"] / 2**20,
        "kv_mib": stats["kv_bytes"] / 2**20,
        "host_mib": status.get("host_bytes", 0) / 2**20,
    }


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="1024,4096,8192")
    ap.add_argument("--pool", type=int, default=1024)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--model", type=Path, default=None)
    args = ap.parse_args()
    if args.model is None:
        from luced.serve.bundled import smollm2_path

        args.model = smollm2_path()
    rows = []
    for context in (int(c) for c in args.contexts.split(",")):
        for pool in (0, args.pool):
            if pool and pool >= context:
                continue  # the pool would hold everything: same as plain
            row = await run_one(args.model, context, pool, args.tokens, args.threads)
            rows.append(row)
            print(row, flush=True)
    print()
    print(
        "| context | pool | prefill tok/s | decode tok/s | worker RSS MiB | KV MiB"
        " | host tier MiB |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['context']} | {r['pool']} | {r['prefill_tok_s']:.0f} | "
            f"{r['decode_tok_s']:.1f} | {r['rss_mib']:.0f} | {r['kv_mib']:.0f} | "
            f"{r['host_mib']:.0f} |"
        )


if __name__ == "__main__":
    asyncio.run(main())
