#!/usr/bin/env python3
"""GPU decode benchmark, in process, on one model: what tools/gpu_check.py reports.

    python tools/bench_gpu.py MODEL.gguf --out bench.json [--device cuda:0] [--quick]

Sections (each written to --out as soon as it is measured, so a run cut short still reports):
    env        device, torch, CUDA
    bandwidth  a device-to-device copy of 1 GiB: bytes read + written over its time (median
               of 10): the ceiling's numerator
    load       load seconds, bytes held by the packed matrices and in all, bytes per weight
    decode     batch-1 greedy tok/s: eager (the runtime's `Model.forward` over a KVCache),
               the fixed-shape step eager, and its CUDA graph (runtime/decode_graph.py),
               interleaved rounds, medians; bytes read per token (every matrix once, plus
               the K/V attended) and the fraction of the bandwidth ceiling each reaches
    matmul     each distinct packed matrix shape alone at one row (20 calls in a CUDA graph, so
               launches are not timed): microseconds, GB/s, and all matrices of a token
               against the graph step, which says how much of decode is the int4 kernel
    transfer   host -> device GB/s of a 256 MiB shared-memory region: pageable, page-locked
               (runtime/device_io.py), and through the pinned staging buffer
    batch      aggregate tok/s at 1, 8, 32, 64 sequences: eager batched forward
               (`Model.forward_batch`, the worker's batched verb) against graph replays
    verify     a 16-token forward against one decode step (eager and graph): what a DFlash
               verify costs, and the speedup an oracle drafter (all 16 accepted) would give;
               the same window through the captured step, against the graph decode step
    attention  one layer's decode attention through the row map: gather + SDPA against the
               Triton kernel (runtime/paged_attention.py), 1 and 32 sequences, 512 to 8192
               rows (last, after the compile)
    compiled   the graph step compiled by torch.compile first (`--decode-graphs compile`) at
               1 and 32 sequences: tok/s, the first step's seconds (the compile), the
               fraction of the ceiling at 1 and the speedup over the plain graph

Every step syncs with the host (the token comes back, as the worker's sampler needs it).
On the CPU (`--device cpu`, a dry run of the script) the graph columns run eagerly.
"""

from __future__ import annotations

import argparse
import functools
import json
import secrets
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from luced.engine.kv.blocks import BlockTables, pool_blocks
from luced.ipc.regions import Attachments, RegionAllocator
from luced.ipc.shm import ShmOwner
from luced.runtime.decode_graph import DecodeGraphs
from luced.runtime.device_io import DeviceIO
from luced.runtime.kv_blocks import BlockPool, PagedKVCache
from luced.runtime.model import Model
from luced.runtime.qlinear import PackedLinear

PROMPT = 32


class Report:
    """The JSON file, rewritten whole after every section."""

    def __init__(self, path: Path) -> None:
        self.path, self.data = path, {}

    def add(self, section: str, values: dict) -> None:
        self.data[section] = values
        self.path.write_text(json.dumps(self.data, indent=1))
        print(f"[bench] {section}: {json.dumps(values)}", flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def seconds(fn: Callable[[], object], device: torch.device) -> float:
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def bandwidth(device: torch.device, nbytes: int) -> dict:
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).normal_()
    dst = torch.empty_like(src)
    times = [seconds(lambda: dst.copy_(src), device) for _ in range(12)][2:]
    t = statistics.median(times)
    return {"bytes": nbytes, "gb_per_s": 2 * nbytes / t / 1e9}


def held_bytes(model: Model) -> tuple[int, int, int]:
    """(bytes of the packed matrices, of every tensor, weights they hold)."""
    packed = dense = count = 0
    for w in model.weights.values():
        mats = w if isinstance(w, list) else [w]
        for m in mats:
            if isinstance(m, PackedLinear):
                packed += m.nbytes()
                count += m.out_features * m.in_features
            elif torch.is_tensor(m):
                dense += m.numel() * m.element_size()
    return packed, packed + dense, count


def prompt_ids(n: int, vocab: int, device: torch.device, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab, (n,), generator=g).to(device)


def eager_decode(model: Model, steps: int, device: torch.device) -> float:
    """Seconds per token of greedy decoding through `Model.forward` over a KVCache."""
    cache = model.new_cache(PROMPT + steps + 1)
    logits = model.forward(prompt_ids(PROMPT, model.cfg.vocab, device, 0), cache, 0)
    token = int(logits[-1].argmax())
    t0 = time.perf_counter()
    for i in range(steps):
        logits = model.forward(torch.tensor([token], device=device), cache, PROMPT + i)
        token = int(logits[-1].argmax())
    return (time.perf_counter() - t0) / steps


def paged(
    model: Model, batch: int, capacity: int
) -> tuple[BlockTables, BlockPool, list[PagedKVCache]]:
    """`batch` paged caches of one pool and the daemon's tables that hand out its blocks
    (engine/kv/blocks.py) -> (tables, pool, caches)."""
    tables = BlockTables(pool_blocks(batch * capacity, batch, 16), 16)
    pool = model.new_block_pool(16, max_blocks=tables.n_blocks)
    return tables, pool, [model.new_paged_cache(pool, capacity) for _ in range(batch)]


def grow(tables: BlockTables, lane: int, cache: PagedKVCache, end: int) -> None:
    """The daemon's growth of `lane` to cover [0, end), followed by its cache."""
    g = tables.write(lane, cache.pos, end)
    cache.follow(g.copies, g.blocks)


def step_decode(
    model: Model, batch: int, steps: int, device: torch.device, capture: bool, compile: bool = False
):
    """Seconds per step of `batch` sequences through the fixed-shape step (a graph when
    `capture` on a GPU; compiled by torch.compile first with `compile`); the first step (a
    capture, a compile) is timed apart. -> (seconds, captures, the first step's seconds, why
    the step was not compiled or None)."""
    tables, pool, caches = paged(model, batch, PROMPT + steps + 2)
    for i, c in enumerate(caches):
        grow(tables, i, c, PROMPT)
        model.forward(prompt_ids(PROMPT, model.cfg.vocab, device, i), c, 0)
    graphs = DecodeGraphs(model, pool, PROMPT + steps + 2, capture=capture, compile=compile)
    ids = torch.ones(batch, dtype=torch.int64, device=device)

    def step(ids: torch.Tensor) -> torch.Tensor:
        for i, c in enumerate(caches):  # the daemon's growth comes with each step
            grow(tables, i, c, c.pos + 1)
        return graphs.step(caches, ids).argmax(-1)

    t0 = time.perf_counter()
    ids = step(ids)
    ids.tolist()
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(steps):
        ids = step(ids)
        ids.tolist()  # the tokens go back to the host, as a worker's sampler needs them
    return (time.perf_counter() - t0) / steps, graphs.captures, first, graphs.compile_error


def batched_decode(model: Model, batch: int, steps: int, device: torch.device) -> float:
    """Seconds per step of `batch` sequences through `Model.forward_batch` (paged caches)."""
    tables, _, caches = paged(model, batch, PROMPT + steps + 1)
    for i, c in enumerate(caches):
        grow(tables, i, c, PROMPT)
        model.forward(prompt_ids(PROMPT, model.cfg.vocab, device, i), c, 0)
    tokens = [1] * batch
    t0 = time.perf_counter()
    for _ in range(steps):
        for i, c in enumerate(caches):
            grow(tables, i, c, c.pos + 1)
        ids = [torch.tensor([t], device=device) for t in tokens]
        logits = model.forward_batch(ids, caches, [c.pos for c in caches])
        tokens = torch.cat(logits).argmax(-1).tolist()
    return (time.perf_counter() - t0) / steps


def verify_cost(model: Model, device: torch.device, repeats: int) -> float:
    """Seconds of one 16-token forward after a prompt (a DFlash verify block)."""
    times = []
    for r in range(repeats):
        cache = model.new_cache(PROMPT + 17)
        model.forward(prompt_ids(PROMPT, model.cfg.vocab, device, r), cache, 0)
        block = prompt_ids(16, model.cfg.vocab, device, 100 + r)
        times.append(seconds(lambda c=cache, b=block: model.forward(b, c, PROMPT), device))
    return statistics.median(times)


def graph_verify_cost(model: Model, device: torch.device, repeats: int) -> float:
    """Seconds of one 16-token window through the captured step (its bucket captured by a
    first call, not timed), the window rolled back after each call as a rejection would."""
    tables, pool, (cache,) = paged(model, 1, PROMPT + 17)
    grow(tables, 0, cache, PROMPT + 16)  # the prompt and the window
    model.forward(prompt_ids(PROMPT, model.cfg.vocab, device, 0), cache, 0)
    graphs = DecodeGraphs(model, pool, PROMPT + 17)
    times = []
    for r in range(repeats + 1):
        block = prompt_ids(16, model.cfg.vocab, device, 100 + r)
        times.append(seconds(lambda b=block: graphs.step([cache], b, [16]), device))
        cache.truncate(PROMPT)
    return statistics.median(times[1:])


def attention_costs(model: Model, device: torch.device, gpu: bool) -> dict:
    """Microseconds of one layer's decode attention through the row map at the model's head
    shapes, gather + SDPA against the Triton kernel (runtime/paged_attention.py), for 1 and
    32 sequences over 512, 2048 and 8192 attended rows, each row map a random permutation of
    the pool's rows (as blocks scattered by sharing and reuse)."""
    from luced.runtime.paged_attention import gather_attention, triton, triton_attention

    hkv, dim = model.cfg.kv_shape(model.layers[0])
    heads = model.cfg.n_heads
    ways = {"gather": gather_attention}
    if gpu and triton is not None:
        ways["triton"] = triton_attention
    out: dict = {"heads": heads, "kv_heads": hkv, "head_dim": dim, "us": {}}
    for batch in (1, 32):
        for length in (512, 2048, 8192) if gpu else (512,):
            pool_rows = batch * length
            keys = torch.randn(hkv, pool_rows, dim, device=device, dtype=model.kv_dtype)
            values = torch.randn_like(keys)
            rows = torch.randperm(pool_rows, device=device).view(batch, length)
            positions = torch.full((batch,), length - 1, device=device)
            q = torch.randn(batch, heads, dim, device=device, dtype=model.kv_dtype)
            for name, fn in ways.items():
                call = functools.partial(fn, q, keys, values, rows, positions, None, dim**-0.5)
                out["us"][f"{name}_b{batch}_l{length}"] = 1e6 * kernel_seconds(call, device)
    return out


def kernel_seconds(fn: Callable[[], object], device: torch.device, calls: int = 20) -> float:
    """Seconds per call of `fn`, launches excluded on a GPU (a graph of `calls` calls)."""
    if device.type != "cuda":
        return statistics.median(seconds(fn, device) for _ in range(calls))
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        fn()  # warm-up outside the capture, as torch's graph docs ask
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    times = [seconds(graph.replay, device) for _ in range(7)][2:]
    return statistics.median(times) / calls


def matmuls(model: Model, device: torch.device) -> dict:
    """Each distinct packed matrix shape at one row (module docstring)."""
    groups: dict[tuple[str, int, int], list[PackedLinear]] = {}
    for w in model.weights.values():
        for m in w if isinstance(w, list) else [w]:
            if isinstance(m, PackedLinear):
                groups.setdefault((m.form, m.out_features, m.in_features), []).append(m)
    shapes, total = [], 0.0
    for (form, n, k), mats in groups.items():
        x = torch.randn(1, k, dtype=torch.bfloat16, device=device)
        t = kernel_seconds(lambda m=mats[0], x=x: m(x), device)
        total += t * len(mats)
        shapes.append({"form": form, "out": n, "in": k, "count": len(mats), "us": t * 1e6,
                       "gb_per_s": mats[0].nbytes() / t / 1e9})  # fmt: skip
    return {"shapes": shapes, "all_matrices_s": total}


def transfer(device: torch.device, nbytes: int) -> dict:
    """GB/s of host -> device copies out of a shared-memory region (median of 5)."""
    rows = nbytes // (4 * 4096)
    out = {}
    with ShmOwner(secrets.token_hex(4)) as owner:
        seg = owner.create("bench", nbytes + 4096)
        region = RegionAllocator.for_segment(seg).alloc("x", (rows, 4096), "float32")
        plain = Attachments()
        host = torch.from_numpy(plain.view(region))
        host.fill_(1.5)
        out["pageable"] = _rate(lambda: host.to(device), nbytes, device)
        host = None
        plain.close()
        io = DeviceIO((str(device),))
        pinned = Attachments(
            on_attach=lambda s: io.attach(s.name, s.address(), s.size),
            on_close=lambda s: io.detach(s.name),
        )
        host = torch.from_numpy(pinned.view(region))
        out["page_locked"] = _rate(lambda: io.upload(host, device, seg.name), nbytes, device)
        out["page_locked_ok"] = seg.name in io.pins.pinned
        staging = DeviceIO((str(device),))
        staging.pins.refused[seg.name] = -1  # as if CUDA had refused it
        out["staged"] = _rate(lambda: staging.upload(host, device, seg.name), nbytes, device)
        host = None
        pinned.close()
    return out


def _rate(copy: Callable[[], object], nbytes: int, device: torch.device) -> float:
    times = [seconds(copy, device) for _ in range(6)][1:]
    return nbytes / statistics.median(times) / 1e9


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--weights", default="auto")
    ap.add_argument("--quick", action="store_true", help="fewer steps, batches and rounds")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    report = Report(args.out)
    gpu = device.type == "cuda"
    steps, rounds = (16, 2) if args.quick or not gpu else (32, 3)
    batches = (1, 8) if args.quick or not gpu else (1, 8, 32, 64)
    torch.set_grad_enabled(False)
    report.add(
        "env",
        {
            "device": torch.cuda.get_device_name(device) if gpu else "cpu",
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "model": args.model.name,
            "dtype": args.dtype,
            "weights": args.weights,
        },
    )
    report.add("bandwidth", bandwidth(device, (1 << 30) if gpu else (64 << 20)))
    t0 = time.monotonic()
    model = Model.load(args.model, device=device, dtype=args.dtype, weights=args.weights)
    sync(device)
    load_s = time.monotonic() - t0
    packed, total, count = held_bytes(model)
    report.add(
        "load",
        {
            "seconds": load_s,
            "packed_bytes": packed,
            "all_bytes": total,
            "packed_bits_per_weight": 8 * packed / max(count, 1),
            "device_allocated": torch.cuda.memory_allocated(device) if gpu else None,
        },
    )
    # Decode at batch 1, interleaved: eager runtime, fixed-shape step eager, graph.
    eager, step, graph, captures = [], [], [], 0
    for _ in range(rounds):
        eager.append(eager_decode(model, steps, device))
        step.append(step_decode(model, 1, steps, device, capture=False)[0])
        t, n, _, _ = step_decode(model, 1, steps, device, capture=True)
        graph.append(t)
        captures += n
    kv_row = sum(2 * h * d * model.kv_dtype.itemsize for h, d in (model.cfg.kv_shape(i)
             for i in model.layers))  # fmt: skip
    per_token = packed + (total - packed - _embedding_bytes(model)) + kv_row * (PROMPT + steps)
    ceiling = report.data["bandwidth"]["gb_per_s"] * 1e9 / per_token
    tok = {
        k: 1 / statistics.median(v) for k, v in (("eager", eager), ("step", step), ("graph", graph))
    }
    report.add(
        "decode",
        {
            "tok_per_s": tok,
            "bytes_per_token": per_token,
            "ceiling_tok_per_s": ceiling,
            "fraction_of_ceiling": {k: v / ceiling for k, v in tok.items()},
            "graph_captures": captures,
            "rounds": rounds,
            "steps": steps,
        },
    )
    mm = matmuls(model, device)
    mm["share_of_graph_step"] = mm["all_matrices_s"] / statistics.median(graph)
    report.add("matmul", mm)
    report.add("transfer", transfer(device, (256 << 20) if gpu else (16 << 20)))
    v16 = verify_cost(model, device, rounds + 2)
    v16_graph = graph_verify_cost(model, device, rounds + 2)
    step1 = statistics.median(eager)
    graph1 = statistics.median(graph)
    report.add(
        "verify",
        {
            "verify16_s": v16,
            "verify16_over_eager_step": v16 / step1,
            "verify16_over_graph_step": v16 / graph1,
            "oracle_speedup_over_eager": 16 * step1 / v16,
            "oracle_speedup_over_graph": 16 * graph1 / v16,
            "verify16_graph_s": v16_graph,
            "graph_verify16_over_graph_step": v16_graph / graph1,
            "oracle_speedup_graph_verify": 16 * graph1 / v16_graph,
        },
    )
    rates: dict[str, dict[int, float]] = {"eager_batched": {}, "graph": {}}
    for b in batches:
        rates["eager_batched"][b] = b / batched_decode(model, b, steps, device)
        rates["graph"][b] = b / step_decode(model, b, steps, device, capture=True)[0]
    scale = {k: v[batches[-1]] / v[1] for k, v in rates.items()}
    report.add("batch", {"tok_per_s": rates, f"ratio_{batches[-1]}_vs_1": scale})
    # Last: a compile may take minutes, and a stage cut short still has the rest.
    compiled: dict = {"tok_per_s": {}, "compile_s": {}, "fraction_of_ceiling": {}}
    for b in (1, 32) if gpu and not args.quick else (1,):
        t, _, first, error = step_decode(model, b, steps, device, capture=True, compile=True)
        compiled["compile_error"] = error  # None: compiled
        compiled["tok_per_s"][b] = b / t
        compiled["compile_s"][b] = first
        if b == 1:
            compiled["fraction_of_ceiling"][b] = 1 / t / ceiling
            compiled["over_graph"] = graph1 / t
        else:
            compiled[f"ratio_{b}_vs_1"] = compiled["tok_per_s"][b] / compiled["tok_per_s"][1]
        report.add("compiled", compiled)
    report.add("attention", attention_costs(model, device, gpu))


def _embedding_bytes(model: Model) -> int:
    """An untied embedding is held dense but read one row per token: not in the ceiling."""
    w = model.weights.get("tok_embd")
    return w.numel() * w.element_size() if torch.is_tensor(w) else 0


if __name__ == "__main__":
    main()
