"""Finding a new prompt's longest prefix held in the KV pool: the block-hash index
(engine/kv/prefix_blocks.py) against comparing the prompt with every lane, as the engine
did before, on the same lanes, interleaved.

    python tools/bench_prefix_index.py [--lanes 64] [--tokens 4096] [--shared 1024]
                                       [--rounds 20]

Lanes are random token lists of --tokens, the first --shared of them common to all and
to the prompt (a system prompt); the prompt shares exactly that much with each lane.
Prints the median time of one lookup each way and of indexing one lane's blocks.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from luced.cache.index import common_prefix
from luced.engine.kv.prefix_blocks import PrefixBlocks


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--lanes", type=int, default=64)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--shared", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=20)
    args = p.parse_args()
    rng = random.Random(0)
    system = [rng.randrange(50_000) for _ in range(args.shared)]

    def tail() -> list[int]:
        return [rng.randrange(50_000) for _ in range(args.tokens - args.shared)]

    lanes = [system + tail() for _ in range(args.lanes)]
    prompt = system + tail()
    index, indexing = PrefixBlocks(), []
    for lane, tokens in enumerate(lanes):
        t0 = time.perf_counter()
        index.hold(lane, tokens, len(tokens))
        indexing.append(time.perf_counter() - t0)
    every, hashed = [], []
    for _ in range(args.rounds):
        t0 = time.perf_counter()
        want = max((common_prefix(prompt[:-1], t), -lane) for lane, t in enumerate(lanes))
        t1 = time.perf_counter()
        got = index.longest(prompt[:-1])
        t2 = time.perf_counter()
        assert got == (-want[1], want[0]) if want[0] else got == (-1, 0), (got, want)
        every.append(t1 - t0)
        hashed.append(t2 - t1)
    a, b = statistics.median(every), statistics.median(hashed)
    print(
        f"{args.lanes} lanes of {args.tokens} tokens, {args.shared} shared: "
        f"compare with every lane {a * 1e3:.2f} ms, block-hash index {b * 1e3:.3f} ms "
        f"({a / b:.0f}x); indexing a lane {statistics.median(indexing) * 1e3:.2f} ms"
    )


if __name__ == "__main__":
    main()
