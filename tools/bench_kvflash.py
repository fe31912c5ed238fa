"""KV Flash cost, memory and retrieval: decode speed and worker RSS at long contexts, pool
or none; needle retrieval under `lru` and `qk` at ~9% residency.

    python tools/bench_kvflash.py [--contexts 1024,4096,8192] [--pool 1024] [--tokens 32]
                                  [--threads N] [--model PATH]
                                  [--niah-context 8192] [--niah-pool 768]
                                  [--niah-depths 0.1,0.5,0.9] [--skip-speed] [--skip-niah]
                                  [--chat 2048] [--rounds 3]

For each context and each cache (plain, pool), a fresh Target (worker subprocess, shared
memory, frames) on the bundled SmolLM2-135M in float32: prefill `context - tokens` random
ids, then decode `tokens` greedy tokens. Reported: decode tok/s and the worker's RSS after
the run (its K/V included; the host tier lives in the daemon's shared memory and is
reported apart). Random ids: the speed and memory do not depend on the text.

Needle in a haystack (upstream's teacher-forced probe, lucebox ``test_kvflash.cpp``): a
context of real text (this repository's docs, tokenized, tiled) with 48 seeded random
tokens at a depth; after the context the first 32 needle tokens are fed (the question:
copy what follows), a reselection is asked for (the daemon reselects by the next step's
scores; a no-op under `lru`), then each of the last 16 is fed in turn and counted when it
was the model's greedy prediction. Run through the same Target as the speed runs, for a
pool covering the context (the control) and for `--niah-pool` under `lru` and `qk`.

A chat longer than the pool (`--chat N`, through a real Engine, `--pool`, `lru`): turn 1
is N tokens of the docs and 8 generated; turn 2 is turn 1's prompt and a question. Its
time to first token and the prompt tokens it did not compute, against the same turn 2
with nothing kept (cold), medians of `--rounds` interleaved rounds. Run it with
PYTHONPATH at another tree to compare trees (the script uses only the Engine's API).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import statistics
import time
from collections.abc import AsyncIterator
from pathlib import Path

from luced.engine.config import KVConfig, ModelInfo, SchedulingLimits
from luced.engine.core import Engine, GenerationRequest
from luced.engine.driver import Driver
from luced.engine.kv.blocks import PAGED
from luced.engine.kvflash.transport import KVFlashSettings, pager_config
from luced.engine.target import Target, TargetPlacement
from luced.gguf_file import GGUFFile
from luced.ipc.shm import ShmOwner
from luced.sampling_params import SamplingParams
from luced.text.tokenizer import Tokenizer

GREEDY = {"temperature": 0}


def cpu_placement(gguf: GGUFFile, path: Path, context: int, threads: int) -> TargetPlacement:
    """One CPU worker in float32, prompts in chunks of 512."""
    return TargetPlacement.split(
        model=str(path),
        n_layers=int(gguf.require(f"{gguf.arch}.block_count")),
        dtype="float32",
        kv_capacity=context,
        max_batch_tokens=512,
        devices=("cpu",),
        threads=threads,
    )


@contextlib.asynccontextmanager
async def flash_target(
    path: Path, context: int, pool: int, policy: str, threads: int
) -> AsyncIterator[Driver]:
    """A started Target on one CPU worker, with a KV Flash pool (0: the plain cache)."""
    gguf = GGUFFile(path)
    flash = pager_config(KVFlashSettings(pool, policy=policy), pool, gguf) if pool else None
    with ShmOwner() as owner:
        target = Target(owner, cpu_placement(gguf, path, context, threads), kv_flash=flash)
        try:
            await target.start()
            yield Driver(target)
        finally:
            await target.close()


async def run_one(path: Path, context: int, pool: int, tokens: int, threads: int) -> dict:
    vocab = len(GGUFFile(path).get("tokenizer.ggml.tokens"))
    async with flash_target(path, context, pool, "lru", threads) as d:
        rng = random.Random(0)
        prompt = [rng.randrange(100, vocab) for _ in range(context - tokens)]
        t0 = time.perf_counter()
        s = await d.prefill(prompt, GREEDY)
        prefill_s = time.perf_counter() - t0
        token = s.token
        t0 = time.perf_counter()
        for _ in range(tokens - 1):
            token = (await d.step(token, GREEDY)).token
        decode = (tokens - 1) / (time.perf_counter() - t0)
        stats = await d.target.stats()
        status = d.target.flash_status() or {}
    return {
        "context": context,
        "pool": pool or "-",
        "prefill_tok_s": len(prompt) / prefill_s,
        "decode_tok_s": decode,
        "rss_mib": stats["rss_bytes"] / 2**20,
        "kv_mib": stats["kv_bytes"] / 2**20,
        "host_mib": status.get("host_bytes", 0) / 2**20,
    }


NEEDLE, QUESTION = 48, 32  # needle tokens; the first QUESTION are fed, the rest probed


def haystack(path: Path, n: int) -> list[int]:
    """n tokens of real text: the repository's docs, tokenized, tiled (a language-like key
    manifold; uniform random filler gives the scorer no contrast)."""
    root = Path(__file__).resolve().parent.parent
    text = "\n\n".join(p.read_text() for p in (root / "README.md", root / "docs" / "design.md"))
    ids = Tokenizer.from_gguf(GGUFFile(path)).encode(text)
    return (ids * (n // len(ids) + 1))[:n]


async def niah(
    path: Path, filler: list[int], pool: int, policy: str, depth: float, threads: int
) -> dict:
    """One teacher-forced needle probe (module doc): needle tokens predicted of 16."""
    rng = random.Random(0xDEADBEEF)
    needle = [rng.randrange(1000, 40000) for _ in range(NEEDLE)]
    context = len(filler)
    at = int(depth * (context - 512)) // 32 * 32
    prompt = filler[:at] + needle + filler[at + NEEDLE :]
    t0 = time.perf_counter()
    async with flash_target(path, context + NEEDLE, pool, policy, threads) as d:
        token = (await d.prefill(prompt, GREEDY)).token
        for t in needle[:QUESTION]:
            token = (await d.step(t, GREEDY)).token
        pager = d.target.pager(0)
        if pager is not None:
            pager.ask_reselect()  # the question is asked: rank every block by its query
        hits = 0
        for t in needle[QUESTION:]:
            hits += token == t
            token = (await d.step(t, GREEDY)).token
        tables, block = d.target.blocks, 64
        table = tables.table(0) if tables is not None else ()
        blocks = range(at // block, (at + NEEDLE - 1) // block + 1)
        status = d.target.flash_status() or {}
    return {
        "policy": policy if pool < context else "full",
        "pool": pool,
        "depth": depth,
        "hits": hits,
        "needle_resident": sum(j < len(table) and table[j] != PAGED for j in blocks),
        "needle_blocks": len(blocks),
        "recalls": status.get("recalls", 0),
        "seconds": time.perf_counter() - t0,
    }


async def run_niah(
    path: Path, context: int, pool: int, depths: list[float], threads: int
) -> list[dict]:
    filler = haystack(path, context - NEEDLE)  # the needle probe fills the context
    full = -(-(context + NEEDLE) // 256) * 256
    rows = []
    for depth in depths:
        for arm_pool, policy in ((full, "lru"), (pool, "lru"), (pool, "qk")):
            row = await niah(path, filler, arm_pool, policy, depth, threads)
            rows.append(row)
            print(row, flush=True)
    return rows


async def turn(engine: Engine, prompt: list[int], tokens: int) -> tuple[float, int]:
    """Time to first token and the prompt tokens not computed."""
    greedy = SamplingParams(temperature=0)
    t0 = time.perf_counter()
    handle = engine.submit(GenerationRequest("chat", prompt, greedy, tokens, ignore_eos=True))
    first = 0.0
    async for _ in handle:
        first = first or time.perf_counter()
    assert handle.finish_reason == "length", handle.error
    return first - t0, handle.cached_tokens


async def run_chat(path: Path, context: int, pool: int, rounds: int, threads: int) -> None:
    """A chat longer than the pool: turn 2 on turn 1's kept prompt against cold (module
    doc)."""
    gguf = GGUFFile(path)
    tokenizer = Tokenizer.from_gguf(gguf)
    capacity = context + 256
    flash = pager_config(KVFlashSettings(pool, policy="lru"), pool, gguf)
    docs = haystack(path, context * 2 * rounds)
    with ShmOwner() as owner:
        placement = cpu_placement(gguf, path, capacity, threads)
        target = Target(owner, placement, kv_flash=flash, step_tokens=512 + 32, sequences=2)
        engine = Engine(
            target,
            tokenizer,
            None,
            model=ModelInfo("bench", capacity),
            limits=SchedulingLimits(max_running=2),
            kv=KVConfig(keep_tokens=capacity),
        )
        await target.start()
        engine.start()
        cold, kept, reused = [], [], []
        try:
            for i in range(rounds):
                first, fresh = (docs[j * context : (j + 1) * context] for j in (2 * i, 2 * i + 1))
                question = tokenizer.encode(f" Question {i}: what came next, and why?")
                t, n = await turn(engine, fresh + question, 8)  # a document never seen
                assert n == 0, n
                cold.append(t)
                await turn(engine, first, 8)
                t, n = await turn(engine, first + question, 8)
                kept.append(t)
                reused.append(n)
                engine.drop_kept()
                while engine.kv.evicted:  # the loop frees them in the workers
                    await asyncio.sleep(0.005)
        finally:
            await engine.stop()
            await target.close()
    med = statistics.median
    print(
        f"\nchat turn 2 after a {context}-token turn 1, pool {pool} (lru), medians of {rounds}:"
        f" TTFT cold {med(cold) * 1e3:.0f} ms, on the kept turn {med(kept) * 1e3:.0f} ms "
        f"({med(cold) / med(kept):.1f}x), prompt tokens reused {med(reused):.0f}"
    )


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="1024,4096,8192")
    ap.add_argument("--pool", type=int, default=1024)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--niah-context", type=int, default=8192)
    ap.add_argument("--niah-pool", type=int, default=768)
    ap.add_argument("--niah-depths", default="0.1,0.5,0.9")
    ap.add_argument("--skip-speed", action="store_true")
    ap.add_argument("--skip-niah", action="store_true")
    ap.add_argument("--no-baseline", action="store_true", help="pooled runs only (RSS bound)")
    ap.add_argument("--chat", type=int, default=0, help="turn-1 tokens of the chat run (only)")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if args.model is None:
        from luced.serve.bundled import smollm2_path

        args.model = smollm2_path()
    if args.chat:
        await run_chat(args.model, args.chat, args.pool, args.rounds, args.threads)
        return
    if not args.skip_niah:
        depths = [float(d) for d in args.niah_depths.split(",")]
        found = await run_niah(args.model, args.niah_context, args.niah_pool, depths, args.threads)
        residency = args.niah_pool / args.niah_context
        print()
        print(
            f"needle tokens predicted /16, context {args.niah_context}, pool {args.niah_pool}"
            f" ({residency:.1%} residency)"
        )
        print("| depth | full cache | lru | qk | needle blocks resident (lru / qk) |")
        print("|---|---|---|---|---|")
        for i in range(0, len(found), 3):
            full, lru, qk = found[i : i + 3]
            print(
                f"| {full['depth']:.0%} | {full['hits']}/16 | {lru['hits']}/16 | {qk['hits']}/16 "
                f"| {lru['needle_resident']}/{lru['needle_blocks']} / "
                f"{qk['needle_resident']}/{qk['needle_blocks']} |"
            )
        print()
    if args.skip_speed:
        return
    rows = []
    for context in (int(c) for c in args.contexts.split(",")):
        for pool in (args.pool,) if args.no_baseline else (0, args.pool):
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
    rss_bound([r for r in rows if r["pool"] != "-"])


def rss_bound(pooled: list[dict]) -> None:
    """Memory is bounded: the worker's RSS at the longest context against the shortest,
    same pool, minus the host tier the worker touched (the daemon's shared memory, mapped
    and written by the worker, so it shows in its RSS)."""
    if len(pooled) < 2:
        return
    short, long = pooled[0], pooled[-1]
    ratio = (long["rss_mib"] - long["host_mib"]) / (short["rss_mib"] - short["host_mib"])
    print(
        f"\nworker RSS less host tier, context {long['context']} vs {short['context']} "
        f"({long['context'] / short['context']:.0f}x) at pool {long['pool']}: "
        f"x{ratio:.3f} (bound x1.10)"
    )


if __name__ == "__main__":
    asyncio.run(main())
