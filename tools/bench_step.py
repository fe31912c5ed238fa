#!/usr/bin/env python3
"""The worker's cost of one decode step of B sequences, source tree against source tree.

    python tools/bench_step.py --trees "A;B" [--batches 8,16] [--context 160] [--rounds 20]
        [--steps 5] [--threads 1] [--clock cpu|wall] [--model PATH]

For each tree and batch size, one process (PYTHONPATH=TREE) plays the daemon to an
in-process worker (`runtime.backend.Backend`, over real shared memory): it loads the model
(`--weights auto`, a block pool as the daemon's default), primes B sequences with
`--context` tokens each, then runs decode steps of B single-token greedy spans. A step is
what the worker does for it and what the daemon does to send it: the `forward` frame built,
encoded, decoded, handled, and its reply encoded (no socket). The trees' processes run side
by side and take turns, `--steps` steps at a time for `--rounds` rounds, so both see the
same load on a shared machine. `--clock cpu` (default) times the process's CPU time, which
other jobs on the machine disturb less than wall time; keep `--threads 1` with it (idle
OpenMP threads spin). Reported per batch size: each tree's median and minimum step, and the
ratio of each tree to the first (median of the rounds' ratios). The bundled SmolLM2-135M by
default.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import secrets
import statistics
import sys
import time
from pathlib import Path

from tree_procs import TreeProcs  # run as a script: tools/ is on sys.path

GREEDY = {"temperature": 0}


def serve(model: str, batch: int, context: int, threads: int, clock: str) -> None:
    """The child: load, prime, then run the steps each line of stdin asks for ("N")."""
    import torch

    from luced.ipc import codec
    from luced.ipc import frames as F
    from luced.ipc.regions import RegionAllocator, required_bytes
    from luced.ipc.shm import ShmOwner
    from luced.runtime.backend import Backend

    torch.set_num_threads(threads)
    now = time.process_time if clock == "cpu" else time.perf_counter

    def call(backend: Backend, req: F.Request) -> F.Reply:
        _, decoded, _ = codec.decode_request(codec.encode_request(1, req))
        reply = backend.handle(decoded)  # raises what the worker would answer as an error
        codec.encode_reply(1, reply)
        return reply

    with ShmOwner("bench" + secrets.token_hex(2)) as owner:
        specs = {"tokens": ((batch * context,), "int32"), "ids": ((batch,), "int32")}
        seg = owner.create("io", required_bytes(specs.values()))
        alloc = RegionAllocator.for_segment(seg)
        r = {n: alloc.alloc(n, shape, dt) for n, (shape, dt) in specs.items()}
        tokens = seg.array(r["tokens"].offset, r["tokens"].shape, "int32")
        ids = seg.array(r["ids"].offset, r["ids"].shape, "int32")
        backend = Backend("cpu", ("cpu",))
        call(backend, F.Hello(instance=owner.instance))
        # The daemon's block tables, in a tree that has them (protocol 22 on).
        daemon_tables = "kv_blocks" in {f.name for f in dataclasses.fields(F.Load)}
        pool = {}
        if daemon_tables:
            from luced.engine.kv.blocks import BlockTables, pool_blocks

            tables = BlockTables(pool_blocks(batch * (context + 4096), batch, 16), 16)
            pool = {"kv_blocks": tables.n_blocks}
        load = F.Load(
            model=model,
            layers=(0, _layers(model)),
            dtype="float32",
            devices=("cpu",),
            kv_capacity=context + 4096,
            owns_embed=True,
            owns_head=True,
            weights="auto",
            kv_block=16,
            **pool,
        )
        call(backend, load)

        def span(seq: int, start: int, n: int) -> F.Span:
            grown = {}
            if daemon_tables:
                g = tables.write(seq, start, start + n)
                grown = {"copies": g.copies, "blocks": g.blocks, "table": g.length}
            return F.Span(sequence=seq, start=start, n=n, sampling=GREEDY, **grown)

        def forward(spans: tuple[F.Span, ...]) -> None:
            outputs = {"ids": r["ids"]}
            call(backend, F.Forward(spans, "sample", outputs, tokens=r["tokens"]))

        g = torch.Generator().manual_seed(0)
        last = []
        for seq in range(batch):  # each prompt alone, as the daemon prefills
            tokens[:context] = torch.randint(1000, 30000, (context,), generator=g).numpy()
            forward((span(seq, 0, context),))
            last.append(int(ids[0]))
        tokens[:batch] = last
        pos = context
        print("ready", flush=True)
        for line in sys.stdin:
            times = []
            for _ in range(int(line)):
                t = now()
                forward(tuple(span(seq, pos, 1) for seq in range(batch)))
                times.append(now() - t)
                tokens[:batch] = ids[:batch]
                pos += 1
            print(json.dumps(times), flush=True)


def _layers(model: str) -> int:
    from luced.gguf_file import GGUFFile

    gguf = GGUFFile(model)
    return int(gguf.require(f"{gguf.require('general.architecture')}.block_count"))


def compare(args: argparse.Namespace, trees: list[str], batch: int) -> None:
    argv = [__file__, "--serve", "--model", os.path.abspath(args.model)]
    argv += ["--batches", str(batch), "--context", str(args.context)]
    argv += ["--threads", str(args.threads), "--clock", args.clock]
    children = TreeProcs(trees, argv)
    try:
        for i in range(len(trees)):
            if children.readline(i).strip() != "ready":
                raise SystemExit(
                    f"a step process failed to start (exit {children.procs[i].wait()})"
                )
            children.ask(i, 2)  # warm-up
        times: list[list[float]] = [[] for _ in trees]
        ratios: list[list[float]] = [[] for _ in trees]
        for order in children.orders(args.rounds):
            medians = [0.0] * len(trees)
            for i in order:
                got = children.ask(i, args.steps)
                times[i] += got
                medians[i] = statistics.median(got)
            for i in range(len(trees)):
                ratios[i].append(medians[i] / medians[0])
    finally:
        children.close()
    for i, tree in enumerate(trees):
        med, low = statistics.median(times[i]) * 1e3, min(times[i]) * 1e3
        ratio = statistics.median(ratios[i])
        print(f"| {batch} | {tree} | {med:.2f} | {low:.2f} | {ratio:.3f} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trees", default=str(Path(__file__).resolve().parent.parent))
    ap.add_argument("--batches", default="8,16")
    ap.add_argument("--context", type=int, default=160)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    ap.add_argument("--model", default=None)
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # the child
    args = ap.parse_args()
    if args.model is None:
        from luced.serve.bundled import smollm2_path

        args.model = str(smollm2_path())
    if args.serve:
        serve(args.model, int(args.batches), args.context, args.threads, args.clock)
        return
    print(f"decode step, context {args.context}, {args.threads} thread(s), {args.clock} time")
    print("| B | tree | median ms | min ms | ratio to first |")
    print("|---|---|---|---|---|")
    for batch in (int(b) for b in args.batches.split(",")):
        compare(args, args.trees.split(";"), batch)


if __name__ == "__main__":
    main()
