"""Prefix cache: TTFT cold vs memory hit vs disk hit, snapshots vs K/V blocks, in one run.

    python tools/bench_prefix.py [--model smollm2|gemma3|PATH] [--prefix 2048]
                                 [--rounds 3] [--threads N] [--dtype float32]

A real Target (worker subprocess, shared memory, frames) and Engine with a prefix cache of
snapshots (arena + snapshot files in a temporary directory: the path the daemon takes for
hybrids, KV Flash or remote workers, forced here with `block_store=0`), and a second engine
over its own worker whose cache keeps K/V blocks (host records + block files: the daemon's
where requests share a block pool). Every request shares a ~`prefix` token document and
ends in its own question, as a chat over one long context does:

    cold      nothing cached (the cache is cleared first): prefill of the whole prompt
    kept      right after `cold`: that request's blocks are kept in the workers' pool
              (--kv-keep-tokens) and the new request takes them (no copy) + prefill of
              the question
    memory    the document's snapshot is in the arena: restore + prefill of the question
    records   the same from K/V blocks in host records (engine/kv/block_store.py), on the
              second engine: adopted, paged in, prefill of the rest
    disk      the memory tier was dropped, the file remains: read into the arena,
              restore, prefill of the question
    blocks    the same from K/V blocks on disk, on the second engine: its memory was
              dropped, the document's block files remain: read into host records, paged
              in, prefill of the rest
    memory+1  `memory` while another request (another document) decodes beside it
    shared+1  while another request over the same document decodes: the new one takes
              the document's K/V blocks from it (no copy; the engine prefers that to
              restoring the running one's snapshot, which covers less than a block more)
              + prefill of the rest

TTFT = submit -> first token out of the engine (includes the snapshot of the new prompt
taken after its prefill, or the save of its new whole blocks). Kept blocks are dropped
before every mode but `kept`. Medians over rounds; the modes are interleaved per round.
The engines run up to 2 requests at once over K/V blocks of 16 (the daemon's defaults);
for the +1 modes it also reports the K/V blocks the workers hold at the new request's
first token against the blocks the two requests' tables map (what they hold without
sharing).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path

from luced.cache.arena import SnapshotArena
from luced.cache.disk import DiskIdentity, SnapshotDisk
from luced.cache.prefix_cache import PrefixCache
from luced.engine.config import KVConfig, ModelInfo, SchedulingLimits
from luced.engine.core import Engine, GenerationRequest
from luced.engine.kv.block_store import BlockStore
from luced.engine.target import Target, TargetPlacement
from luced.gguf_file import GGUFFile
from luced.ipc.shm import ShmOwner
from luced.sampling_params import SamplingParams
from luced.serve.bundled import gemma3_path, smollm2_path
from luced.serve.prefix_setup import placement_key
from luced.text.tokenizer import Tokenizer

MODELS = {"smollm2": smollm2_path, "gemma3": gemma3_path}
BLOCK = 16  # K/V block rows (--kv-block-size's default)


async def ttft(engine: Engine, prompt: list[int]) -> tuple[float, int]:
    req = GenerationRequest("bench", prompt, SamplingParams(temperature=0), 2, ignore_eos=True)
    t0 = time.perf_counter()
    handle = engine.submit(req)
    first = None
    async for _ in handle:
        first = first or time.perf_counter()
    assert first is not None and handle.finish_reason == "length", handle.error
    return first - t0, handle.cached_tokens


async def drop_kept(engine: Engine) -> None:
    """No finished request's blocks stay in the pool (the loop frees them)."""
    engine.drop_kept()
    while engine.kv.evicted:
        await asyncio.sleep(0.005)


async def beside(
    engine: Engine, held: list[int], prompt: list[int]
) -> tuple[float, int, tuple[int, int]]:
    """TTFT of `prompt` while a request over `held` decodes (its prompt prefilled): (TTFT,
    prompt positions not computed, (K/V blocks the workers hold, blocks the two requests'
    tables map) at the new request's first token)."""
    greedy = SamplingParams(temperature=0)
    holder = engine.submit(GenerationRequest("holder", held, greedy, 200, ignore_eos=True))
    stream = aiter(holder)
    await anext(stream)  # its prompt is prefilled
    req = GenerationRequest("bench", prompt, greedy, 16, ignore_eos=True)
    t0 = time.perf_counter()
    handle = engine.submit(req)
    first, blocks = 0.0, (0, 0)
    async for _ in handle:
        if not first:
            first = time.perf_counter()
            stats = await engine.target.stats()
            blocks = (int(stats["kv_blocks_used"]), int(stats["kv_blocks_mapped"]))
    holder.cancel()
    while engine.running:  # the holder's lane is released at its next step
        await asyncio.sleep(0.01)
    return first - t0, handle.cached_tokens, blocks


async def bench(args: argparse.Namespace) -> None:
    model = MODELS[args.model]() if args.model in MODELS else Path(args.model)
    gguf = GGUFFile(model)
    tokenizer = Tokenizer.from_gguf(gguf)
    doc = " ".join(f"Paragraph {i}: the printing press spread ideas quickly." for i in range(400))
    prefix = tokenizer.encode(doc)[: args.prefix]
    other = tokenizer.encode(doc.replace("printing press", "steam engine"))[: args.prefix]
    questions = [tokenizer.encode(f" Question {i}: what happened next?") for i in range(99)]
    placement = TargetPlacement.one_cpu_worker(
        gguf,
        threads=args.threads,
        kv_capacity=args.prefix + 256,
        max_batch_tokens=512,
        dtype=args.dtype,
        kv_block=BLOCK,
    )
    modes = ("cold", "kept", "memory", "records", "disk", "blocks", "memory+1", "shared+1")
    rows: dict[str, list[float]] = {mode: [] for mode in modes}
    blocks: dict[str, list[tuple[int, int]]] = {"memory+1": [], "shared+1": []}
    with tempfile.TemporaryDirectory() as tmp, ShmOwner() as owner:

        def make(name: str, blocks: bool) -> tuple[Target, Engine]:
            target = Target(owner, placement, name=name, step_tokens=512 + 2 * 16, sequences=2)
            engine = Engine(
                target,
                tokenizer,
                None,
                model=ModelInfo("bench", placement.kv_capacity),
                limits=SchedulingLimits(max_running=2),
                kv=KVConfig(
                    keep_tokens=placement.kv_capacity,
                    block_store=(1 << 30) if blocks else 0,  # bytes of host records for them
                ),
            )
            return target, engine

        (target, engine), (target_b, engine_b) = make("target", False), make("blocks", True)
        await target.start()
        await target_b.start()
        layout = await target.kv_layout()
        identity = DiskIdentity("bench", "", placement_key(target), args.dtype)
        disk = SnapshotDisk(Path(tmp) / "snapshots", identity, layout)
        cache = PrefixCache(layout, SnapshotArena(owner, 2 << 30), disk)
        engine.prefix_cache = cache
        cache_b = PrefixCache(layout, None)  # no arena: the blocks are its tiers
        cache_b.blocks = await BlockStore.open(target_b, Path(tmp) / "blocks", "bench", 8 << 30)
        engine_b.prefix_cache = cache_b
        engine.start()
        engine_b.start()
        try:
            q = iter(questions)
            for _ in range(args.rounds):
                await cache.clear(disk=True)
                await drop_kept(engine)
                t, n = await ttft(engine, prefix + next(q))
                assert n == 0
                rows["cold"].append(t)
                t, n = await ttft(engine, prefix + next(q))
                assert n >= len(prefix) and len(engine.kv.kept) == 1
                rows["kept"].append(t)
                await drop_kept(engine)
                await cache.flush()  # the disk copy is written in the background
                t, n = await ttft(engine, prefix + next(q))
                assert n >= len(prefix)
                rows["memory"].append(t)
                await drop_kept(engine)
                t, n, held = await beside(engine, other + next(q), prefix + next(q))
                assert n >= len(prefix)
                rows["memory+1"].append(t)
                blocks["memory+1"].append(held)
                await cache.flush()
                await cache.clear(disk=False)  # only the files remain
                await drop_kept(engine)
                t, n = await ttft(engine, prefix + next(q))
                assert n >= len(prefix), n
                rows["disk"].append(t)
                await cache_b.clear(disk=True)  # the blocks of the round before too
                await ttft(engine_b, prefix + next(q))
                await cache_b.save_all()  # its blocks are written
                await drop_kept(engine_b)
                t, n = await ttft(engine_b, prefix + next(q))
                assert n >= len(prefix) - BLOCK, n
                rows["records"].append(t)
                await cache_b.clear(disk=False)  # only the block files remain
                await drop_kept(engine_b)
                t, n = await ttft(engine_b, prefix + next(q))
                assert n >= len(prefix) - BLOCK, n
                rows["blocks"].append(t)
                await drop_kept(engine)
                t, n, held = await beside(engine, prefix + next(q), prefix + next(q))
                assert n >= len(prefix) - BLOCK, n
                rows["shared+1"].append(t)
                blocks["shared+1"].append(held)
            snapshot_bytes = cache.layout_bytes(len(prefix))
            block_bytes = snapshot_bytes / len(prefix) * BLOCK
        finally:
            for e, c, t in ((engine, cache, target), (engine_b, cache_b, target_b)):
                await e.stop()
                await c.close()
                await t.close()
    cold = statistics.median(rows["cold"])
    print(
        f"\n{model.name} ({args.dtype}, {args.threads} threads): shared prefix "
        f"{len(prefix)} tokens, snapshot {snapshot_bytes / 2**20:.0f} MiB, "
        f"medians of {args.rounds} rounds\n"
    )
    print(f"{'':8s}{'TTFT ms':>10s}{'of cold':>10s}")
    for name, ts in rows.items():
        t = statistics.median(ts)
        print(f"{name:8s}{t * 1e3:10.1f}{t / cold:10.1%}")
    records = statistics.median(rows["records"]) / statistics.median(rows["memory"])
    print(f"\nmemory hit, K/V blocks in host records / a snapshot in the arena: {records:.1%}")
    print(f"\nK/V blocks of {BLOCK} at the new request's first token (medians):")
    for mode, held in blocks.items():
        used, mapped = (statistics.median(col) for col in zip(*held, strict=True))
        print(
            f"{mode:8s}  held {used:.0f} ({used * block_bytes / 2**20:.1f} MiB), "
            f"the tables map {mapped:.0f} ({mapped * block_bytes / 2**20:.1f} MiB)"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--prefix", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    asyncio.run(bench(ap.parse_args()))


if __name__ == "__main__":
    main()
