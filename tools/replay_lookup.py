"""What `--draft ngram` can gain on a target's own answers: its greedy answers replayed
through the daemon's prompt lookup under three block policies, priced by step costs
measured on the same target.

    python tools/replay_lookup.py [--model smollm2|gemma3|tiny-FAMILY|PATH]
        [--workloads grounded chat code] [--prompts 3] [--tokens 256] [--block-size 16]
        [--threads N] [--weights auto] [--rounds 3] [--step-overhead-ms 0]

Per prompt, in this process: the plain greedy answer (the packed kernels give each row
the same bits whatever the batch, so it is the daemon's answer too), then the seconds of
a forward that feeds n = 1..block tokens after the prompt (interleaved rounds, medians),
plus `--step-overhead-ms`, kept as ratios c(n) / c(1). The answer is replayed through
`PromptLookup` and each policy, and a policy's speed is the answer's tokens times c(1)
over the summed step costs (plain decoding: 1.00):

    fixed      draft block - 1 proposals whenever the lookup matches
               (`--no-adaptive-block-size`)
    adaptive   the daemon's `BlockSizer` on these costs (the default)
    hindsight  each step drafts exactly the proposals that will be accepted: the
               best any block size policy can do with the lookup's proposals (a step
               it cuts shorter starts the next lookup elsewhere, so this is a
               reference, not a proven bound)

A replay has no daemon: a daemon's step also pays for its frames, sampling and
bookkeeping, the same for a plain step as for a verify, which speculation spreads over
more tokens; so measured runs (`tools/bench_dflash.py`) read at or above a replay without
`--step-overhead-ms`. Give it the difference between a daemon's plain step (1 / plain
decode tok/s there) and the replay's c(1) (printed) to price steps as the daemon does.
The replay answers how much of a shortfall is the model (its answer does not repeat the
prompt), the verify's cost, or the sizing.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

import torch

from luced.engine.spec.ngram import PromptLookup
from luced.engine.spec.sizer import BlockSizer, StepCosts
from luced.gguf_file import GGUFFile
from luced.runtime.generate import generate
from luced.runtime.model import Model
from luced.sampling_params import SamplingParams
from luced.text.tokenizer import Tokenizer

if __package__:  # imported as tools.replay_lookup (its test)
    from tools import bench_prompts
    from tools.bench_dflash import model_path
else:  # run as a script: tools/ is on sys.path
    import bench_prompts
    from bench_dflash import model_path

POLICIES = ("fixed", "adaptive", "hindsight")
GREEDY = SamplingParams(temperature=0)


def step_costs(
    model: Model, prompt: list[int], answer: list[int], block: int, rounds: int
) -> dict[int, float]:
    """Seconds of a forward of n = 1..block answer tokens right after the prompt, on a copy
    of the prompt's cache (the copy is not timed)."""
    primed = model.new_cache(len(prompt) + block)
    model.forward(torch.tensor(prompt), primed, 0)
    seconds: dict[int, list[float]] = {}
    for r in range(rounds + 1):  # the first round warms up
        for n in range(1, block + 1):
            cache, ids = copy.deepcopy(primed), torch.tensor(answer[:n])
            began = time.perf_counter()
            model.forward(ids, cache, len(prompt))
            if r:
                seconds.setdefault(n, []).append(time.perf_counter() - began)
    return {n: statistics.median(s) for n, s in seconds.items()}


def replay(
    prompt: list[int], answer: list[int], costs: Mapping[int, float], policy: str, block: int
) -> float:
    """Speed against plain decoding of drafting `answer` (the first token comes from the
    prefill, as in the daemon) with the lookup under `policy`; costs: c(n) / c(1)."""
    table = StepCosts()
    table.observe(1, 1.0)
    for n, ratio in costs.items():
        table.observe(n, ratio)  # a first observation is taken as it is
    lookup = PromptLookup()
    sizer = BlockSizer(table, block, priors=PromptLookup.FIRST_ACCEPTANCE)
    lookup.extend([*prompt, answer[0]])
    done, spent = 1, 0.0
    while done < len(answer):
        kind, ahead = lookup.kind(), answer[done:]
        size = 1
        if kind is not None:
            size = {"fixed": block, "adaptive": sizer.next_block(kind)}.get(policy, block)
        if policy == "hindsight" and size > 1:
            size = 1 + accepted(lookup.propose(block - 1), ahead)
        size = min(size, len(ahead))  # as the daemon, no drafting past the tokens asked for
        proposals = lookup.propose(size - 1)  # [] when size is 1
        kept = accepted(proposals, ahead)
        spent += table.cost(len(proposals) + 1) or 1.0
        if proposals:
            sizer.observe(len(proposals), kept, kind or "draft")
        else:
            sizer.plain_step()
        lookup.extend(ahead[: kept + 1])  # the accepted proposals and the target's token
        done += kept + 1
    return (len(answer) - 1) / spent


def accepted(proposals: list[int], ahead: list[int]) -> int:
    """How many proposals greedy verification keeps: the run equal to the answer ahead."""
    kept = 0
    while kept < min(len(proposals), len(ahead) - 1) and proposals[kept] == ahead[kept]:
        kept += 1
    return kept


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2", help="smollm2 | gemma3 | tiny-FAMILY | PATH")
    ap.add_argument("--workloads", nargs="+", default=["grounded", "chat", "code"],
                    choices=bench_prompts.WORKLOADS)  # fmt: skip
    ap.add_argument("--prompts", type=int, default=3, help="prompts per workload")
    ap.add_argument("--prompt", type=int, default=64, help="tokens of the `repeat` workload")
    ap.add_argument("--tokens", type=int, default=256, help="answer tokens per prompt")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--weights", default="auto", help="auto | int4 | int8 | dequant")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--rounds", type=int, default=3, help="timing rounds of the step costs")
    ap.add_argument(
        "--step-overhead-ms",
        type=float,
        default=0.0,
        help="added to every step: a daemon's per-step cost beyond the forward",
    )
    args = ap.parse_args(argv)
    if args.block_size < 2:
        ap.error("--block-size must be at least 2")
    torch.set_num_threads(args.threads)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = model_path(args.model, Path(tmp))
        gguf = GGUFFile(path)
        tokenizer = Tokenizer.from_gguf(gguf)
        model = Model.load(path, weights=args.weights)
        print(f"{path.name}: {args.tokens} answer tokens, block {args.block_size}, "
              f"weights {args.weights}, {args.threads} threads")  # fmt: skip
        last = f"c({args.block_size})"
        print(f"{'workload':10s}{'prompt':>7s}{'context':>8s}{'c(1) ms':>9s}{last:>7s}"
              + "".join(f"{p:>11s}" for p in POLICIES))  # fmt: skip
        for workload in args.workloads:
            for i, prompt in enumerate(bench_prompts.prompts(workload, gguf, tokenizer, args)):
                # greedy, no stop token: the whole answer the benchmark asks for
                answer = generate(model, prompt, GREEDY, args.tokens).tokens
                seconds = step_costs(model, prompt, answer, args.block_size, args.rounds)
                seconds = {n: s + args.step_overhead_ms / 1e3 for n, s in seconds.items()}
                costs = {n: s / seconds[1] for n, s in seconds.items()}
                row = {"workload": workload, "prompt": i, "context": len(prompt)}
                row |= {p: replay(prompt, answer, costs, p, args.block_size) for p in POLICIES}
                rows.append(row)
                print(f"{workload:10s}{i:7d}{len(prompt):8d}{seconds[1] * 1e3:9.2f}"
                      + f"{costs[args.block_size]:7.2f}"
                      + "".join(f"{row[p]:10.2f}x" for p in POLICIES), flush=True)  # fmt: skip
    for workload in args.workloads:
        mine = [r for r in rows if r["workload"] == workload]
        means = [statistics.fmean(r[p] for r in mine) for p in POLICIES]
        print(f"{workload:10s}{'mean':>7s}{'':24s}" + "".join(f"{m:10.2f}x" for m in means))
    return rows


if __name__ == "__main__":
    main()
