"""Speculative decoding's cost and ceiling: plain vs drafted decoding on one target.

    python tools/bench_dflash.py [--model smollm2|gemma3|tiny-FAMILY|PATH] [--block-size 16]
        [--workloads chat code grounded repeat] [--engines NAME ...] [--prompts 3]
        [--tokens 128] [--rounds 1] [--threads N] [--trained-draft PATH]
        [--rollbacks select,replay] [--weights dequant] [--batch-invariant]

Engines over real Targets (worker subprocesses, shared memory, frames), all loaded at
once and measured interleaved so drift on a shared machine hits them alike; each must
reproduce plain greedy decoding token for token:

    plain     no draft: one target forward per token
    random    a random-weight draft sized for the target (luced.runtime.tiny.draft):
              acceptance ~ 0, so every step costs a draft + a B-token verify and yields
              one token: the overhead of speculation
    oracle    the same draft loaded (captures on, same frames) but its proposals replaced
              by the target's own greedy continuation (`OracleProposer`): every proposal is
              accepted, B tokens per verify: the ceiling of the loop
    half      the random draft's frames, its proposals the target's own greedy
              continuation for the first half of the block and wrong after it
              (`HalfOracle`): every block is cut in the middle
    trained   a draft from `luced train-draft` (--trained-draft PATH)

`--rollbacks select,replay`: for a hybrid target (recurrent state), one engine per
rollback of a rejected suffix (`Target.rollback`) for each drafted kind: "select" keeps
the state after each verified position, "replay" rewinds to the window's start and
re-feeds the accepted tokens. `--model tiny-qwen35` / `tiny-qwen35moe` (any
luced.runtime.tiny family after `tiny-`) builds an 8-layer tiny random model.

Reported per engine (medians over rounds): decode tok/s (after the first token), tokens
per target forward, mean acceptance length (1 + accepted / drafts), the cost of one
draft and one forward (wall µs, measured around the proposer's and the runner's calls),
and `agree`:
the share of tokens before the first that differs from plain greedy (1.00 is required in
`dequant` and with `--batch-invariant`; packed weights without it may follow a near-tie
elsewhere).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, ClassVar

from luced.cli.train_draft import context_length
from luced.cli.train_draft import greedy as generate
from luced.engine.config import ModelInfo, SpeculationConfig
from luced.engine.core import Engine
from luced.engine.runner import ModelRunner
from luced.engine.scheduler import Work, WorkOutput
from luced.engine.spec.proposer import Proposer
from luced.engine.target import ROLLBACK, Target, TargetPlacement
from luced.gguf_file import GGUFFile
from luced.ipc.shm import ShmOwner
from luced.runtime.tiny import make_tiny_draft, make_tiny_gguf
from luced.serve.bundled import gemma3_path, smollm2_path
from luced.text.tokenizer import Tokenizer

if __package__:  # imported as tools.bench_dflash (the tests import its oracle targets)
    from tools import bench_prompts
else:  # run as a script: tools/ is on sys.path
    import bench_prompts

MODELS = {"smollm2": smollm2_path, "gemma3": gemma3_path}


class TimedProposer(Proposer):
    """Times each step's drafting (wall µs)."""

    def __init__(self, target: Target) -> None:
        super().__init__(target)
        self.draft_us: list[float] = []

    async def fill(self, works: list[Work]) -> None:
        if not any(w.window > 1 for w in works):
            return
        t0 = time.perf_counter()
        await super().fill(works)
        self.draft_us.append((time.perf_counter() - t0) * 1e6)


class OracleProposer(TimedProposer):
    """Proposes `script[pos + 1 : pos + B]`: the continuation the target itself produces
    greedily (computed beforehand with plain decoding). This perfect draft shows the
    ceiling of the speculative loop: everything else is real (verify forwards, captures
    into the ring, acceptance, KV rollback); only the draft forward is skipped."""

    script: ClassVar[list[int]] = []

    async def _draft(self, work: Work, sampling: dict | None) -> list[int]:
        pos, anchor, size = work.seq.computed, work.tokens[0], work.window
        if self.script[pos] != anchor:  # the anchor's position: everything before is fed
            raise AssertionError(f"oracle script disagrees with the anchor at {pos}")
        ahead = self.script[pos + 1 : pos + size]
        return [*ahead, *[anchor] * (size - 1 - len(ahead))]


class HalfOracle(OracleProposer):
    """The oracle's proposals for the first half of the window, wrong ones after it."""

    vocab: ClassVar[int] = 1

    async def _draft(self, work: Work, sampling: dict | None) -> list[int]:
        window = [work.tokens[0], *await super()._draft(work, sampling)]
        keep = work.window // 2
        return [t if i < keep else (t + 1) % self.vocab for i, t in enumerate(window)][1:]


class CountingRunner(ModelRunner):
    """Counts the forwards and times the ones that verify a window (wall µs)."""

    def __init__(self, target: Target) -> None:
        super().__init__(target)
        self.forwards = 0
        self.verify_us: list[float] = []

    async def forward(self, works: list[Work], *args: Any, **kw: Any) -> list[WorkOutput | None]:
        self.forwards += 1
        t0 = time.perf_counter()
        out = await super().forward(works, *args, **kw)
        if any(w.verifies for w in works):
            self.verify_us.append((time.perf_counter() - t0) * 1e6)
        return out


def model_path(name: str, tmp: Path) -> Path:
    if name in MODELS:
        return MODELS[name]()
    if name.startswith("tiny-"):
        path = tmp / f"{name}.gguf"
        make_tiny_gguf(name.removeprefix("tiny-"), path, seed=1, layers=8, context=2048)
        return path
    return Path(name)


def make_target(owner: ShmOwner, model: Path, args: Any, name: str) -> Target:
    gguf = GGUFFile(model)
    placement = TargetPlacement.one_cpu_worker(
        gguf,
        threads=args.threads,
        kv_capacity=context_length(gguf),
        max_batch_tokens=256,
        weights_mode=args.weights,
        batch_invariant=args.batch_invariant,
    )
    return Target(owner, placement, name=name, step_tokens=256 + 64)


# engine name -> (proposer class, drafter: "model" | "ngram" | None, adaptive window size)
ENGINES: dict[str, tuple[type[Proposer], str | None, bool]] = {
    "plain": (TimedProposer, None, False),
    "random": (TimedProposer, "model", False),
    "random-adaptive": (TimedProposer, "model", True),
    "ngram": (TimedProposer, "ngram", False),
    "ngram-adaptive": (TimedProposer, "ngram", True),
    "half": (HalfOracle, "model", False),
    "oracle": (OracleProposer, "model", False),
    "trained": (TimedProposer, "trained", False),  # the draft --trained-draft names
}


async def start_engine(
    name: str,
    owner: ShmOwner,
    model: Path,
    draft: Path,
    tokenizer: Tokenizer,
    args: Any,
    label: str | None = None,
    rollback: str = ROLLBACK,
) -> Engine:
    """An engine of kind `name` (ENGINES), called `label` (default: its kind), rolling a
    hybrid's rejected suffix back by `rollback`."""
    cls, drafter, adaptive = ENGINES[name]
    label = label or name
    target = make_target(owner, model, args, label.replace("/", "-"))
    target.rollback = rollback
    await target.start()
    if drafter in ("model", "trained"):
        path = args.trained_draft if drafter == "trained" else draft
        await target.load_draft(str(path), block_size=args.block_size)
    elif drafter == "ngram":
        target.enable_lookup_drafts(args.block_size)
    engine = Engine(
        target,
        tokenizer,
        None,
        model=ModelInfo(label, context_length(GGUFFile(model))),
        speculation=SpeculationConfig(args.block_size, drafter == "ngram", adaptive),
    )
    engine.runner = CountingRunner(target)
    engine.runner.proposer = cls(target)
    if adaptive:
        await engine.calibrate()
    engine.start()
    return engine


async def bench(args: argparse.Namespace) -> None:
    names = args.engines or [n for n in ENGINES if n != "trained" or args.trained_draft]
    if "trained" in names and not args.trained_draft:
        raise SystemExit("the trained engine needs --trained-draft PATH")
    rollbacks = args.rollbacks.split(",")
    with tempfile.TemporaryDirectory() as tmp, ShmOwner() as owner:
        model = model_path(args.model, Path(tmp))
        gguf = GGUFFile(model)
        tokenizer = Tokenizer.from_gguf(gguf)
        HalfOracle.vocab = tokenizer.vocab_size
        workloads = {w: bench_prompts.prompts(w, gguf, tokenizer, args) for w in args.workloads}
        _, draft, _ = make_tiny_draft(
            model, Path(tmp) / "draft", seed=1, block_size=args.block_size
        )
        engines: dict[str, Engine] = {}
        try:
            engines["plain"] = await start_engine("plain", owner, model, draft, tokenizer, args)
            for name in [n for n in names if n != "plain"]:
                for rb in rollbacks:  # one engine per rollback when several are compared
                    label = f"{name}/{rb}" if len(rollbacks) > 1 else name
                    engines[label] = await start_engine(
                        name, owner, model, draft, tokenizer, args, label, rb
                    )
            rows: dict[tuple[str, str], list[dict]] = {}
            for workload, prompts in workloads.items():
                for prompt in prompts:
                    # Each engine must reproduce plain greedy; the oracle replays it.
                    script, _, _ = await generate(
                        engines["plain"], prompt, args.tokens + args.block_size + 1
                    )
                    OracleProposer.script = prompt + script  # every oracle kind reads it
                    for _ in range(args.rounds):
                        for name, engine in engines.items():
                            row = await measure(engine, prompt, script, args)
                            rows.setdefault((workload, name), []).append(row)
        finally:
            for engine in engines.values():
                await engine.stop()
                await engine.target.close()
    report(model, rows, args)


async def measure(engine: Engine, prompt: list[int], script: list[int], args: Any) -> dict:
    r, drafts = engine.runner, engine.runner.proposer
    assert isinstance(r, CountingRunner) and isinstance(drafts, TimedProposer)
    drafts.draft_us.clear()
    r.verify_us.clear()
    before, blocks_before = r.forwards, sum(engine.block_sizes.values())
    block_tokens_before = sum(b * n for b, n in engine.block_sizes.items())
    tokens, decode_s, spec = await generate(engine, prompt, args.tokens)
    pairs = zip(tokens, script, strict=False)
    agree = next((i for i, (a, b) in enumerate(pairs) if a != b), len(tokens))
    # Exact where verify and decode round alike; packed weights without batch-invariant
    # mode may follow a near-tie elsewhere (docs/features.md, "Batch-invariant mode"):
    # then report it.
    if agree < len(tokens) and (args.weights == "dequant" or args.batch_invariant):
        raise AssertionError(f"{engine.model.name}: output differs from plain greedy")
    fwd = r.forwards - before - (len(prompt) + 255) // 256  # minus prefill
    steps = sum(engine.block_sizes.values()) - blocks_before
    block_tokens = sum(b * n for b, n in engine.block_sizes.items()) - block_tokens_before
    return {
        "tok_s": (len(tokens) - 1) / decode_s,
        "tok_per_fwd": len(tokens) / max(1, fwd),
        "accept_len": 1 + spec["accepted_tokens"] / spec["drafts"] if spec["drafts"] else 1.0,
        "block": block_tokens / steps if steps else 1.0,
        "draft_us": statistics.median(drafts.draft_us) if drafts.draft_us else 0.0,
        "verify_us": statistics.median(r.verify_us) if r.verify_us else 0.0,
        "agree": agree / max(1, len(tokens)),
    }


def report(model: Path, rows: dict[tuple[str, str], list[dict]], args: Any) -> None:
    # The machine's load at the end: on a shared one, only the ratios to plain compare.
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(
        f"\n{model.name}: {args.tokens} generated per prompt, block {args.block_size}, "
        f"{args.threads} threads, {args.rounds} round(s), weights {args.weights}; means "
        f"over prompts and rounds; load average {load}\n"
    )
    cols = (
        "tok_s", "vs_plain", "tok_per_fwd", "accept_len", "block", "draft_us", "verify_us",
        "agree",
    )  # fmt: skip
    print(f"{'workload':10s}{'engine':17s}" + "".join(f"{c:>12s}" for c in cols))
    for (workload, name), rs in rows.items():
        mean = {c: statistics.fmean(r[c] for r in rs) for c in cols if c != "vs_plain"}
        # Per-prompt ratios against plain's run of the same prompt and round, averaged.
        plain = rows[(workload, "plain")]
        mean["vs_plain"] = statistics.fmean(
            r["tok_s"] / p["tok_s"] for r, p in zip(rs, plain, strict=True)
        )
        print(f"{workload:10s}{name:17s}" + "".join(f"{mean[c]:12.2f}" for c in cols))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2", help="smollm2 | gemma3 | tiny-FAMILY | PATH")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=64, help="tokens of the `repeat` workload")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--prompts", type=int, default=3, help="prompts per workload")
    ap.add_argument(
        "--workloads",
        nargs="+",
        default=["chat", "code", "grounded"],
        choices=bench_prompts.WORKLOADS,
    )
    ap.add_argument(
        "--engines",
        nargs="+",
        choices=list(ENGINES),
        help="plain always runs: it is the baseline (default: all; trained with --trained-draft)",
    )
    ap.add_argument(
        "--trained-draft",
        type=Path,
        help="a draft from `luced train-draft` (OUT_DIR/draft.gguf): the trained engine",
    )
    ap.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    ap.add_argument("--rollbacks", default=ROLLBACK, help="comma-separated: select,replay")
    ap.add_argument("--weights", default="dequant", help="auto | int4 | int8 | dequant")
    ap.add_argument(
        "--batch-invariant", action="store_true", help="the workers in batch-invariant mode"
    )
    asyncio.run(bench(ap.parse_args()))


if __name__ == "__main__":
    main()
