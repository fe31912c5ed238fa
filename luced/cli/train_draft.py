"""`luced train-draft TARGET.gguf OUT_DIR`: train a DFlash draft for a target on what the
target itself generates.

    luced train-draft TARGET.gguf OUT_DIR [--sharegpt N] [--humaneval [N]]
        [--prompts-jsonl FILE] [--answer-tokens 256] [--eval-prompts 4]
        [--layers 1] [--captures 3] [--block-size 8] [--anchors 64] [--epochs 2] [--lr 6e-4]
        [--resume] [--threads N]

This command stays torch-free, like the daemon: it tokenizes the prompts, runs the training
as a process of its own (`python -m luced.runtime.dflash.trainer OUT_DIR/job.json`: the
target's answers and features, the training loop, OUT_DIR/draft.gguf; see that module), then
evaluates the draft through the Engine, as the daemon serves it.

1. Prompts: a JSONL of the user's own (`{"prompt": text}` completed raw, `{"messages":
   [...]}` through the model's chat template, `{"ids": [...]}` token ids as they are), the
   first human turns of ShareGPT (`--sharegpt N`) and HumanEval's 164 code prompts
   (`--humaneval`; both from `prompt_sets`). A seeded shuffle holds out `--eval-prompts` of
   each source.
2. Training: the trainer process (OUT_DIR/data, OUT_DIR/checkpoint.pt, OUT_DIR/random.gguf,
   OUT_DIR/draft.gguf and OUT_DIR/draft/).
3. Evaluation: the held-out prompts run through the Engine (worker processes) plain, with
   the random draft and with the trained one: acceptance length, decode tok/s (and its ratio
   to plain's on the same prompts), and whether greedy speculative output equals plain.
   OUT_DIR/report.json holds the training's numbers and these.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from luced.cli.prompt_sets import humaneval_prompts, sharegpt_first_turns
from luced.engine.config import ModelInfo, SpeculationConfig
from luced.engine.core import Engine, GenerationRequest
from luced.engine.placement import TargetPlacement
from luced.engine.target import Target
from luced.gguf_file import GGUFFile
from luced.ipc.shm import ShmOwner
from luced.sampling_params import SamplingParams
from luced.text.chat_template import ChatTemplate
from luced.text.prompt import chat_ids
from luced.text.tokenizer import Tokenizer

log = logging.getLogger("luced.train_draft")
TRAINER = "luced.runtime.dflash.trainer"
# The options that stay with this command; the trainer takes the rest (its TrainJob fields).
OWN_OPTIONS = ("prompts_jsonl", "sharegpt", "humaneval", "max_prompt_tokens", "eval_prompts")
OWN_OPTIONS += ("eval_tokens",)


class TrainDraftError(Exception):
    """A run that cannot go on; the message says why (one line for the user)."""


# ---------------------------------------------------------------- prompts


def load_prompts(
    args: argparse.Namespace, gguf: GGUFFile, tok: Tokenizer
) -> dict[str, list[list[int]]]:
    """Token ids by source ("own", "chat", "code"), each shuffled with the seed."""
    template = None

    def chat(messages: list[dict]) -> list[int]:
        nonlocal template
        if template is None:
            template = ChatTemplate.from_gguf(gguf, gguf.arch)
        return chat_ids(template, tok, messages)

    sources: dict[str, list[list[int]]] = {}
    if args.prompts_jsonl:
        own = sources.setdefault("own", [])
        for n, line in enumerate(args.prompts_jsonl.read_text().splitlines(), 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if "ids" in row:
                own.append([int(t) for t in row["ids"]])
            elif "messages" in row:
                own.append(chat(row["messages"]))
            elif "prompt" in row:
                own.append(tok.encode(row["prompt"]))
            else:
                raise TrainDraftError(
                    f"{args.prompts_jsonl}:{n}: needs 'prompt', 'messages' or 'ids'"
                )
    if args.sharegpt:
        turns = sharegpt_first_turns()
        random.Random(args.seed).shuffle(turns)
        sources["chat"] = [chat([{"role": "user", "content": t}]) for t in turns[: args.sharegpt]]
    if args.humaneval:
        code = humaneval_prompts()
        random.Random(args.seed).shuffle(code)
        sources["code"] = [tok.encode(p) for p in code[: args.humaneval]]
    vocab = int(gguf.get(f"{gguf.arch}.vocab_size") or gguf.info("token_embd.weight").shape[0])
    return {name: _checked(name, ps, vocab, args) for name, ps in sources.items()}


def _checked(
    source: str, prompts: list[list[int]], vocab: int, args: argparse.Namespace
) -> list[list[int]]:
    kept = [p for p in prompts if 0 < len(p) <= args.max_prompt_tokens]
    if any(not 0 <= t < vocab for p in kept for t in p):
        raise TrainDraftError(f"{source}: token ids outside the target's vocabulary [0, {vocab})")
    if len(kept) < len(prompts):
        log.info(
            "%s: skipped %d prompts longer than %d tokens",
            source,
            len(prompts) - len(kept),
            args.max_prompt_tokens,
        )
    if len(kept) <= args.eval_prompts:
        raise TrainDraftError(
            f"{source}: {len(kept)} prompts; give more than the {args.eval_prompts} held out "
            "for evaluation"
        )
    random.Random(args.seed).shuffle(kept)
    return kept


# ---------------------------------------------------------------- evaluation


def context_length(gguf: GGUFFile) -> int:
    """2048 tokens, or less for a model that holds less (the tiny test models)."""
    return min(2048, int(gguf.get(f"{gguf.arch}.context_length") or 2048))


async def _start_engine(
    owner: ShmOwner, target: Path, draft: Path | None, tok: Tokenizer, name: str, args: Any
) -> Engine:
    """One engine on one CPU worker, with `draft` loaded (None: plain decoding)."""
    gguf = GGUFFile(target)
    placement = TargetPlacement.one_cpu_worker(
        gguf, threads=args.threads, kv_capacity=context_length(gguf), max_batch_tokens=256
    )
    worker = Target(owner, placement, name=name)
    await worker.start()
    if draft is not None:
        await worker.load_draft(str(draft), block_size=args.block_size)
    engine = Engine(
        worker,
        tok,
        None,
        model=ModelInfo(name, context_length(gguf)),
        speculation=SpeculationConfig(args.block_size),
    )
    engine.start()
    return engine


async def greedy(
    engine: Engine, prompt: list[int], n: int, grammar: str | None = None
) -> tuple[list[int], float, dict]:
    """n tokens, greedy, EOS ignored (a grammar still ends it): (tokens, decode seconds
    after the first token, spec counts)."""
    req = GenerationRequest(
        "eval", prompt, SamplingParams(temperature=0), n, ignore_eos=True, grammar=grammar
    )
    handle = engine.submit(req)
    tokens: list[int] = []
    first = 0.0
    async for delta in handle:
        if not tokens and delta.token_ids:
            first = time.perf_counter()
        tokens += delta.token_ids
    if handle.finish_reason not in ("length", "stop"):
        raise TrainDraftError(f"generation ended with {handle.finish_reason}: {handle.error}")
    return tokens, time.perf_counter() - first, dict(handle.spec)


async def evaluate(
    target: Path,
    drafts: dict[str, Path],
    workloads: dict[str, list[list[int]]],
    args: argparse.Namespace,
) -> dict[str, dict[str, dict]]:
    """Plain and each draft through the Engine (worker processes), interleaved per prompt:
    per workload and engine, acceptance length, decode tok/s (and its ratio to plain's on
    the same prompts), and whether greedy output equals plain's."""
    tok = Tokenizer.from_gguf(GGUFFile(target))
    rows: dict[tuple[str, str], list[dict]] = {}
    with ShmOwner() as owner:
        engines: dict[str, Engine] = {}
        try:
            for name, draft in {"plain": None, **drafts}.items():
                engines[name] = await _start_engine(owner, target, draft, tok, name, args)
            for workload, prompt in [(w, p) for w, ps in workloads.items() for p in ps]:
                plain: list[int] | None = None
                for name, engine in engines.items():
                    toks, decode_s, spec = await greedy(engine, prompt, args.eval_tokens)
                    plain = toks if plain is None else plain
                    row = {
                        "tok_s": (len(toks) - 1) / decode_s if decode_s > 0 else 0.0,
                        "drafts": spec.get("drafts", 0),
                        "accepted": spec.get("accepted_tokens", 0),
                        "equal": toks == plain,
                    }
                    rows.setdefault((workload, name), []).append(row)
        finally:
            for engine in engines.values():
                await engine.stop()
                await engine.target.close()
    report: dict[str, dict[str, dict]] = {}
    for (workload, name), rs in rows.items():
        n_drafts = sum(r["drafts"] for r in rs)
        plain_rs = rows[(workload, "plain")]
        report.setdefault(workload, {})[name] = {
            "acceptance_length": 1 + sum(r["accepted"] for r in rs) / n_drafts if n_drafts else 1.0,
            "decode_tok_s": statistics.fmean(r["tok_s"] for r in rs),
            "vs_plain": statistics.fmean(
                r["tok_s"] / p["tok_s"] for r, p in zip(rs, plain_rs, strict=True)
            ),
            "greedy_equals_plain": all(r["equal"] for r in rs),
        }
    return report


# ---------------------------------------------------------------- main


def run(args: argparse.Namespace) -> dict:
    """Prompts, the trainer process, the evaluation; returns (and writes) the report."""
    out: Path = args.out_dir
    out.mkdir(parents=True, exist_ok=True)
    gguf = GGUFFile(args.target)
    tok = Tokenizer.from_gguf(gguf)
    sources = load_prompts(args, gguf, tok)
    if not sources:
        raise TrainDraftError("no prompts: give --prompts-jsonl, --sharegpt N and/or --humaneval")
    held_out = {name: ps[: args.eval_prompts] for name, ps in sources.items()}
    job = {k: v for k, v in vars(args).items() if k not in OWN_OPTIONS}
    job |= {"target": str(args.target), "out_dir": str(out), "eos_ids": sorted(tok.eos_ids)}
    job["prompts"] = [p for ps in sources.values() for p in ps[args.eval_prompts :]]
    job_path = out / "job.json"
    job_path.write_text(json.dumps(job) + "\n")
    (out / "train.json").unlink(missing_ok=True)  # only this run's result is read below
    trainer = subprocess.run([sys.executable, "-m", TRAINER, str(job_path)])
    if trainer.returncode != 0:  # it has said why on stderr
        raise TrainDraftError(f"the training process ended with exit status {trainer.returncode}")
    trained = json.loads((out / "train.json").read_text())
    report: dict[str, Any] = {"target": str(args.target), **trained}
    report["eval_prompts"] = {name: len(ps) for name, ps in held_out.items()}
    if args.eval_tokens > 0:
        drafts = {"random": Path(trained["random"]), "trained": Path(trained["draft"])}
        report["eval"] = asyncio.run(evaluate(args.target, drafts, held_out, args))
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="luced train-draft",
        description="Train a DFlash draft for a target GGUF on what the target generates.",
    )
    ap.add_argument("target", type=Path)
    ap.add_argument("out_dir", type=Path)
    src = ap.add_argument_group("prompts")
    src.add_argument("--prompts-jsonl", type=Path, help="{prompt|messages|ids} per line")
    src.add_argument("--sharegpt", type=int, default=0, metavar="N", help="N ShareGPT turns")
    src.add_argument(
        "--humaneval", type=int, nargs="?", const=164, default=0, metavar="N", help="N of 164"
    )
    src.add_argument("--max-prompt-tokens", type=int, default=512)
    src.add_argument("--eval-prompts", type=int, default=4, help="per source, held out")
    gen = ap.add_argument_group("self-distillation")
    gen.add_argument("--answer-tokens", type=int, default=256)
    gen.add_argument("--temperature", type=float, default=0.0, help="0: greedy answers")
    arch = ap.add_argument_group("draft")
    arch.add_argument("--layers", type=int, default=1)
    arch.add_argument("--captures", type=int, default=3, help="target layers captured")
    arch.add_argument("--ffn", type=int, help="FFN width (default: the target's)")
    arch.add_argument("--block-size", type=int, default=8)
    arch.add_argument("--mask-token-id", type=int, help="default: the last vocabulary id")
    opt = ap.add_argument_group("training")
    opt.add_argument("--epochs", type=int, default=2)
    opt.add_argument("--steps", type=int, help="overrides --epochs (one sequence per step)")
    opt.add_argument("--minutes", type=float, help="train this long (plans the schedule)")
    opt.add_argument("--anchors", type=int, default=64, help="blocks per sequence")
    opt.add_argument("--lr", type=float, default=6e-4)
    opt.add_argument("--gamma", type=float, help="loss decay (default 4 for B<=8, else 7)")
    opt.add_argument("--float32", action="store_true", help="no bf16 autocast")
    opt.add_argument("--save-every", type=int, default=200)
    opt.add_argument("--resume", action="store_true", help="continue OUT_DIR/checkpoint.pt")
    opt.add_argument("--stop-at", type=int, help="checkpoint and stop after this step")
    opt.add_argument("--seed", type=int, default=0)
    ev = ap.add_argument_group("evaluation")
    ev.add_argument("--eval-tokens", type=int, default=128, help="0: skip the evaluation")
    ap.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    return ap


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    args = parser().parse_args(argv)
    try:
        report = run(args)
    except (TrainDraftError, OSError, ValueError) as exc:
        print(f"luced train-draft: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=2))
    return 0
