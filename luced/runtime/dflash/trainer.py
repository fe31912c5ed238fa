"""The training half of `luced train-draft`, a process of its own (it runs torch; the command
line stays torch-free): `python -m luced.runtime.dflash.trainer OUT_DIR/job.json`.

The command writes the job (`TrainJob`'s fields: the target, the training prompts as token
ids, the target's end-of-sequence ids and the options) and reads OUT_DIR/train.json back.

1. OUT_DIR/random.gguf: the draft's initial weights, sized for the target (`make_spec`).
2. Self-distillation: the target answers every prompt in process (greedy unless a
   temperature is given), then one prefill over prompt + answer captures its features at
   the draft's capture layers. Both are cached in OUT_DIR/data (bf16 features), keyed by the
   target, the capture layers, the answer settings and the prompt, so later runs and epochs
   never rerun the target.
3. Training (`train.block_loss`): per step one sequence, `anchors` random anchors in its
   answer, every block in one forward, weighted cross-entropy exp(-(k-1)/gamma); embedding
   and head frozen (the target's own). AdamW, warmup + cosine. bf16 autocast when the CPU
   multiplies bf16 natively, float32 otherwise. OUT_DIR/checkpoint.pt every `save_every`
   steps; `resume` continues from it.
4. OUT_DIR/draft.gguf (the layout `--draft` loads) and OUT_DIR/draft/ (safetensors).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import random
import statistics
import sys
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from luced.runtime.dflash.draft import Draft
from luced.runtime.dflash.train import (
    block_loss,
    cosine_lr,
    export_weights,
    native_bf16,
    sample_anchors,
    trainable,
)
from luced.runtime.dflash.writer import (
    DraftSpec,
    random_weights,
    spec_for_target,
    write_gguf,
    write_safetensors,
)
from luced.runtime.generate import generate
from luced.runtime.model import Model
from luced.sampling_params import SamplingParams

log = logging.getLogger("luced.train_draft")


@dataclasses.dataclass(frozen=True)
class TrainJob:
    """What the command hands this process (job.json); see `luced train-draft --help`."""

    target: str
    out_dir: str
    prompts: list[list[int]]  # the training prompts (the held-out ones stay with the command)
    eos_ids: list[int]
    answer_tokens: int = 256
    temperature: float = 0.0
    layers: int = 1
    captures: int = 3
    ffn: int | None = None
    block_size: int = 8
    mask_token_id: int | None = None
    epochs: int = 2
    steps: int | None = None
    minutes: float | None = None
    anchors: int = 64
    lr: float = 6e-4
    gamma: float | None = None
    float32: bool = False
    save_every: int = 200
    resume: bool = False
    stop_at: int | None = None
    seed: int = 0
    threads: int = 1


# ---------------------------------------------------------------- target features


@dataclasses.dataclass
class Sequence:
    ids: torch.Tensor  # [S] int64, prompt + answer
    answer_start: int
    features: torch.Tensor  # [S, n_capture * hidden] bf16


def distill(model: Model, captures: tuple[int, ...], data_dir: Path, job: TrainJob) -> list[Path]:
    """The target's answers and its features over prompt + answer, one file per prompt."""
    data_dir.mkdir(parents=True, exist_ok=True)
    st = model.path.stat()
    salt = json.dumps(
        [
            model.path.name,
            st.st_size,
            list(captures),
            job.answer_tokens,
            job.temperature,
            job.seed,
            str(model.dtype),
        ]
    )
    params = SamplingParams(temperature=job.temperature, seed=job.seed)
    files, fresh, answered, t0 = [], 0, 0, time.perf_counter()
    for prompt in progress(job.prompts, "target answers"):
        key = hashlib.sha256((salt + json.dumps(prompt)).encode()).hexdigest()[:24]
        path = data_dir / f"{key}.pt"
        files.append(path)
        if path.exists():
            continue
        gen = generate(model, prompt, params, job.answer_tokens, job.eos_ids)
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
    return tqdm(items, desc=desc, total=total, initial=initial, mininterval=2)


def make_spec(model: Model, job: TrainJob) -> DraftSpec:
    """The draft's shape: the target's own attention and FFN geometry, as upstream drafts
    reuse the target's config, with `layers` decoder layers."""
    cfg = model.cfg
    return spec_for_target(
        job.target,
        layers=job.layers,
        heads=cfg.n_heads,
        kv_heads=cfg.n_kv_heads,
        head_dim=cfg.head_dim,
        ffn=job.ffn or cfg.ffn,
        captures=job.captures,
        block_size=job.block_size,
        mask_token_id=job.mask_token_id,
        seed=job.seed,
    )


def train(draft: Draft, edges: Model, files: list[Path], out: Path, job: TrainJob) -> list[float]:
    params = trainable(draft)
    opt = torch.optim.AdamW(params, lr=job.lr, weight_decay=0.01, betas=(0.9, 0.95))
    # The schedule's length; with `minutes` it is re-planned from the measured step time.
    plan = {"total": job.steps or job.epochs * len(files)}
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: cosine_lr(s, plan["total"], max(1, plan["total"] // 30))
    )
    gen = torch.Generator().manual_seed(job.seed)
    step, ckpt = 0, out / "checkpoint.pt"
    if job.resume and ckpt.exists():
        state = torch.load(ckpt, weights_only=False)
        with torch.no_grad():
            for name, w in state["weights"].items():
                draft.weights[name].copy_(w)
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        gen.set_state(state["gen"])
        step, plan["total"] = state["step"], state["total"]
        log.info("resumed at step %d of %d", step, plan["total"])
    bf16 = native_bf16() and not job.float32
    log.info(
        "training %d steps on %d sequences; %s",
        plan["total"],
        len(files),
        "bf16 autocast (native bf16 on this CPU)" if bf16 else "float32",
    )
    gamma = job.gamma or (4.0 if job.block_size <= 8 else 7.0)
    losses: list[float] = []
    seen, tokens, t0 = 0, 0, time.perf_counter()
    bar = progress(_steps(step, plan), "train", total=plan["total"], initial=step)
    recent: deque[tuple[float, float]] = deque(maxlen=50)  # (loss, acceptance)
    for step in bar:
        epoch, i = divmod(step, len(files))
        order = random.Random(job.seed + epoch).sample(range(len(files)), len(files))
        seq = load_sequence(files[order[i]])
        anchors = sample_anchors(len(seq.ids), seq.answer_start, job.anchors, gen)
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
        bar.set_postfix_str(
            f"loss {statistics.fmean(r[0] for r in recent):.3f} "
            f"tau~{statistics.fmean(r[1] for r in recent):.2f} {tok_s:.0f} tok/s"
        )
        if job.minutes and seen == 10 and not job.resume:
            per_step = (time.perf_counter() - t0) / seen
            plan["total"] = max(seen, int(job.minutes * 60 / per_step))
            log.info("%.2f s/step: %d steps in %g min", per_step, plan["total"], job.minutes)
            bar.total = plan["total"]
        stop = job.stop_at is not None and step + 1 >= job.stop_at
        if (step + 1) % job.save_every == 0 or step + 1 == plan["total"] or stop:
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


def write_draft(spec: DraftSpec, draft: Draft, out: Path) -> Path:
    weights = {k: v.numpy() for k, v in export_weights(draft).items()}
    write_safetensors(spec, weights, out / "draft")
    return write_gguf(spec, weights, out / "draft.gguf")


# ---------------------------------------------------------------- main


def run(job: TrainJob) -> dict[str, Any]:
    """Steps 1-4 (module docstring); returns what train.json holds."""
    out = Path(job.out_dir)
    torch.set_num_threads(job.threads)
    bf16 = native_bf16() and not job.float32
    model = Model.load(job.target, dtype="bfloat16" if bf16 else "float32")
    spec = make_spec(model, job)
    init = write_gguf(spec, random_weights(spec), out / "random.gguf")
    # Loaded before the target answers anything: a draft that cannot fit it fails at once.
    draft = Draft.load(init, target_hidden=model.cfg.hidden, target_n_layers=model.cfg.n_layers)
    files = distill(model, tuple(spec.target_layer_ids), out / "data", job)
    if not files:
        raise ValueError("the target answered no prompt with 2 or more tokens")
    t0 = time.perf_counter()
    losses = train(draft, model, files, out, job)
    train_s = time.perf_counter() - t0
    return {
        "draft": str(write_draft(spec, draft, out)),
        "random": str(init),
        "spec": dataclasses.asdict(spec),
        "train_sequences": len(files),
        "steps": len(losses),
        "train_s": train_s,
        "loss_first": statistics.fmean(losses[:10]) if losses else None,
        "loss_last": statistics.fmean(losses[-10:]) if losses else None,
    }


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    for chatty in ("gguf", "luced.runtime.weights"):  # per-file writer / loader progress
        logging.getLogger(chatty).setLevel(logging.WARNING)
    (job_path,) = sys.argv[1:] if argv is None else argv
    job = TrainJob(**json.loads(Path(job_path).read_text()))
    try:
        result = run(job)
    except (ValueError, OSError) as exc:  # a target, draft shape or file the run cannot use
        print(f"luced train-draft: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    tmp = Path(job.out_dir) / "train.tmp"
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    tmp.replace(Path(job.out_dir) / "train.json")


if __name__ == "__main__":
    main()
