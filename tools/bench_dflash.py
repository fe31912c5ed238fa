"""DFlash cost and ceiling: plain vs speculative decoding on one target, in one run.

    python tools/bench_dflash.py [--model smollm2|gemma3|tiny-qwen35|tiny-qwen35moe|PATH]
                                 [--block-size 16] [--prompt 64] [--tokens 128]
                                 [--rounds 3] [--threads N] [--rollbacks select,replay]

Engines over real Targets (worker subprocesses, shared memory, frames), all loaded at
once and measured interleaved so drift on a shared machine hits them alike:

    plain     no draft: one target forward per token
    random    a random-weight draft sized for the target (tools/make_tiny_draft.py):
              acceptance ~ 0, so every step costs a draft + a B-token verify and yields
              one token: the overhead of speculation
    half      the same draft loaded, its proposals replaced by the target's own greedy
              continuation for the first half of the block and wrong after it
              (`HalfOracle`): every block is cut in the middle
    oracle    proposals all from the target's own greedy continuation (`OracleTarget`):
              every proposal is accepted, B tokens per verify: the ceiling of the loop

`--rollbacks`: for a hybrid target (recurrent state), one set of drafted engines per
rollback of a rejected suffix (`Target.rollback`): "select" keeps the state after each
verified position, "replay" rewinds to the block's start and re-feeds the accepted
tokens. `tiny-qwen35` / `tiny-qwen35moe` build an 8-layer tiny random hybrid.

Reported per engine (medians over rounds): decode tok/s (after the first token), tokens
per target forward, mean acceptance length (1 + accepted / drafts), and the cost of one
draft step and one verify step (wall µs, measured around the target calls).
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

import make_tiny_draft
import make_tiny_gguf

from luced.engine.core import Engine, GenerationRequest
from luced.engine.placement import WorkerSpec
from luced.engine.target import ROLLBACK, Sampled, Target, TargetPlacement
from luced.gguf_file import GGUFFile
from luced.ipc.shm import ShmOwner
from luced.sampling_params import SamplingParams
from luced.serve.bundled import gemma3_path, smollm2_path
from luced.text.tokenizer import Tokenizer

MODELS = {"smollm2": smollm2_path, "gemma3": gemma3_path}


class OracleTarget(Target):
    """A target whose draft proposes `script[pos + 1 : pos + B]`: the continuation the target
    itself produces greedily (computed beforehand with plain decoding). This perfect draft
    shows the ceiling of the speculative loop: everything else is real (verify forwards,
    captures into the ring, acceptance, KV rollback); only the draft forward is skipped."""

    script: ClassVar[list[int]] = []

    async def draft_block(
        self, anchor: int, block_size: int, sampling: dict | None = None
    ) -> list[int]:
        pos = self.position  # the anchor's position: everything before it is committed
        if self.script[pos] != anchor:
            raise AssertionError(f"oracle script disagrees with the anchor at {pos}")
        ahead = self.script[pos + 1 : pos + block_size]
        return [anchor, *ahead, *[anchor] * (block_size - 1 - len(ahead))]


class HalfOracle(OracleTarget):
    """The oracle's proposals for the first half of the block, wrong ones after it."""

    vocab: ClassVar[int] = 1

    async def draft_block(
        self, anchor: int, block_size: int, sampling: dict | None = None
    ) -> list[int]:
        block = await super().draft_block(anchor, block_size, sampling)
        keep = block_size // 2
        return block[:keep] + [(t + 1) % self.vocab for t in block[keep:]]


class CountingTarget(Target):
    """Times the draft and verify calls of the loop (wall µs)."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.draft_us: list[float] = []
        self.verify_us: list[float] = []
        self.forwards = 0

    async def draft_block(self, *args: Any, **kw: Any) -> list[int]:
        t0 = time.perf_counter()
        out = await super().draft_block(*args, **kw)
        self.draft_us.append((time.perf_counter() - t0) * 1e6)
        return out

    async def verify(self, *args: Any, **kw: Any) -> list[Sampled]:
        t0 = time.perf_counter()
        out = await super().verify(*args, **kw)
        self.verify_us.append((time.perf_counter() - t0) * 1e6)
        return out

    async def _forward(self, *args: Any, **kw: Any) -> Any:
        self.forwards += 1
        return await super()._forward(*args, **kw)


class TimedOracle(OracleTarget, CountingTarget):
    pass


class TimedHalf(HalfOracle, CountingTarget):
    pass


DRAFTED = {"random": CountingTarget, "half": TimedHalf, "oracle": TimedOracle}


def model_path(name: str, tmp: Path) -> Path:
    if name in MODELS:
        return MODELS[name]()
    if name.startswith("tiny-"):
        path = tmp / f"{name}.gguf"
        make_tiny_gguf.build(name.removeprefix("tiny-"), path, seed=1, layers=8, context=2048)
        return path
    return Path(name)


def make_target(cls: type[Target], owner: ShmOwner, model: Path, threads: int, name: str) -> Target:
    gguf = GGUFFile(model)
    placement = TargetPlacement(
        model=str(model),
        n_layers=int(gguf.require(f"{gguf.arch}.block_count")),
        dtype="float32",
        kv_capacity=2048,
        max_batch_tokens=256,
        worker=WorkerSpec("cpu", ("cpu",), threads=threads),
    )
    return cls(owner, placement, name=name)


async def generate(engine: Engine, prompt: list[int], n: int) -> tuple[list[int], float, dict]:
    """Greedy, EOS ignored; (tokens, decode seconds after the first token, spec counts)."""
    req = GenerationRequest("bench", prompt, SamplingParams(temperature=0), n, ignore_eos=True)
    handle = engine.submit(req)
    tokens: list[int] = []
    first = 0.0
    async for delta in handle:
        if not tokens and delta.token_ids:
            first = time.perf_counter()
        tokens += delta.token_ids
    if handle.finish_reason not in ("length", "stop"):
        raise RuntimeError(f"generation ended with {handle.finish_reason}: {handle.error}")
    return tokens, time.perf_counter() - first, dict(handle.spec)


async def bench(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp, ShmOwner() as owner:
        model = model_path(args.model, Path(tmp))
        tokenizer = Tokenizer.from_gguf(GGUFFile(model))
        HalfOracle.vocab = tokenizer.vocab_size
        words = "The history of the printing press begins in the fifteenth century. " * 40
        prompt = tokenizer.encode(words)[: args.prompt]
        _, draft, _ = make_tiny_draft.build(
            model, Path(tmp) / "draft", seed=1, block_size=args.block_size
        )
        targets = {"plain": make_target(CountingTarget, owner, model, args.threads, "plain")}
        for rollback in args.rollbacks.split(","):
            for kind, cls in DRAFTED.items():
                name = f"{kind}/{rollback}"
                targets[name] = make_target(cls, owner, model, args.threads, name.replace("/", "-"))
                targets[name].rollback = rollback
        engines = {}
        try:
            for name, target in targets.items():
                await target.start()
                if name != "plain":
                    await target.load_draft(str(draft), block_size=args.block_size)
                engines[name] = Engine(
                    target,
                    tokenizer,
                    None,
                    model_name=name,
                    context_length=2048,
                    block_size=args.block_size,
                )
                engines[name].start()
            # The oracle's script: the target's greedy continuation, with room for a block.
            script, _, _ = await generate(
                engines["plain"], prompt, args.tokens + args.block_size + 1
            )
            OracleTarget.script = prompt + script  # read by every oracle subclass
            rows: dict[str, list[dict]] = {name: [] for name in engines}
            for _ in range(args.rounds):
                for name, engine in engines.items():
                    r = targets[name]
                    assert isinstance(r, CountingTarget)
                    r.draft_us.clear()
                    r.verify_us.clear()
                    before = r.forwards
                    tokens, decode_s, spec = await generate(engine, prompt, args.tokens)
                    if tokens != script[: args.tokens]:
                        raise AssertionError(f"{name}: output differs from plain greedy")
                    fwd = r.forwards - before - (args.prompt + 255) // 256  # minus prefill
                    rows[name].append(
                        {
                            "tok_s": (len(tokens) - 1) / decode_s,
                            "tok_per_fwd": len(tokens) / max(1, fwd),
                            "accept_len": 1 + spec["accepted_tokens"] / spec["drafts"]
                            if spec["drafts"]
                            else 1.0,
                            "draft_us": statistics.median(r.draft_us) if r.draft_us else 0.0,
                            "verify_us": statistics.median(r.verify_us) if r.verify_us else 0.0,
                        }
                    )
        finally:
            for engine in engines.values():
                await engine.stop()
            for target in targets.values():
                await target.close()
    print(
        f"\n{model.name}: prompt {len(prompt)} tokens, {args.tokens} generated, block "
        f"{args.block_size}, {args.threads} threads, medians of {args.rounds} rounds\n"
    )
    cols = ("tok_s", "tok_per_fwd", "accept_len", "draft_us", "verify_us")
    print(f"{'engine':16s}" + "".join(f"{c:>13s}" for c in cols))
    for name, rs in rows.items():
        med = {c: statistics.median(r[c] for r in rs) for c in cols}
        print(f"{name:16s}" + "".join(f"{med[c]:13.1f}" for c in cols))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    ap.add_argument("--rollbacks", default=ROLLBACK, help="comma-separated: select,replay")
    asyncio.run(bench(ap.parse_args()))


if __name__ == "__main__":
    main()
