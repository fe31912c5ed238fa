#!/usr/bin/env python3
"""A decode step's control frames, source tree against source tree: the `forward` frame of
B single-token spans and its reply, built, encoded and decoded as the daemon and a worker do.

    python tools/bench_frames.py --trees "A;B" [--batches 1,16] [--rounds 20] [--reps 500]

For each tree and batch size, one process (PYTHONPATH=TREE) times, per rep: building the
frame (its spans and their checks, as the daemon does), `codec.encode_request`,
`codec.decode_request` (the worker's side, checks again), and the reply: `ForwardReply`
built, `codec.encode_reply`, `codec.decode_reply`. The trees' processes take turns,
`--reps` reps at a time for `--rounds` rounds (CPU time), so both see the same load on a
shared machine. Reported per batch size and tree: the request's bytes, each part's median
microseconds, and the whole round trip's ratio to the first tree (median of the rounds'
ratios).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from tree_procs import TreeProcs  # run as a script: tools/ is on sys.path

PARTS = ("build", "encode", "decode", "reply")
SEG = "/luced-bench-io"


def serve(batch: int) -> None:
    """The child: per line of stdin ("REPS"), time REPS of each part; print the means."""
    from luced.ipc import codec
    from luced.ipc import frames as F
    from luced.ipc.regions import Region

    ids = Region(SEG, 4096, (256,), "int32")
    tokens = Region(SEG, 8192, (4096,), "int32")
    sampling = {"temperature": 0.7, "seed": 1234}

    def build(pos: int) -> F.Forward:
        spans = tuple(
            F.Span(sequence=j, start=pos, n=1, n_out=1, sampling=sampling) for j in range(batch)
        )
        return F.Forward(spans, "sample", {"ids": ids.rows(0, batch)}, tokens=tokens)

    payload = codec.encode_request(1, build(100))
    print(json.dumps({"bytes": len(payload)}), flush=True)
    for line in sys.stdin:
        reps = int(line)
        took = dict.fromkeys(PARTS, 0.0)
        for rep in range(reps):
            t0 = time.process_time()
            req = build(100 + rep)
            t1 = time.process_time()
            payload = codec.encode_request(rep, req)
            t2 = time.process_time()
            codec.decode_request(payload)
            t3 = time.process_time()
            positions = tuple(101 + rep for _ in range(batch))
            reply = codec.encode_reply(rep, F.ForwardReply(positions, 8150))
            codec.decode_reply(reply, "forward")
            t4 = time.process_time()
            for part, dt in zip(PARTS, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
                took[part] += dt
        print(json.dumps({p: took[p] / reps * 1e6 for p in PARTS}), flush=True)


def compare(args: argparse.Namespace, trees: list[str], batch: int) -> None:
    children = TreeProcs(trees, [__file__, "--serve", "--batches", str(batch)])
    try:
        sizes = [json.loads(children.readline(i))["bytes"] for i in range(len(trees))]
        for i in range(len(trees)):
            children.ask(i, args.reps)  # warm-up
        got: list[list[dict[str, float]]] = [[] for _ in trees]
        ratios: list[list[float]] = [[] for _ in trees]
        for order in children.orders(args.rounds):
            for i in order:
                got[i].append(children.ask(i, args.reps))
            totals = [sum(g[-1].values()) for g in got]
            for i in range(len(trees)):
                ratios[i].append(totals[i] / totals[0])
    finally:
        children.close()
    for i, tree in enumerate(trees):
        med = {p: statistics.median(g[p] for g in got[i]) for p in PARTS}
        cells = " | ".join(f"{med[p]:.1f}" for p in PARTS)
        total = statistics.median(sum(g.values()) for g in got[i])
        ratio = statistics.median(ratios[i])
        print(f"| {batch} | {tree} | {sizes[i]} | {cells} | {total:.1f} | {ratio:.3f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trees", default=str(Path(__file__).resolve().parent.parent))
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--reps", type=int, default=500)
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # the child
    args = ap.parse_args()
    if args.serve:
        serve(int(args.batches))
        return
    print("forward frame and reply, CPU microseconds per step (medians)")
    print("| B | tree | bytes | " + " | ".join(PARTS) + " | total | ratio to first |")
    print("|---|---|---|" + "---|" * len(PARTS) + "---|---|")
    for batch in (int(b) for b in args.batches.split(",")):
        compare(args, args.trees.split(";"), batch)


if __name__ == "__main__":
    main()
