"""`luced train-draft` end to end on a tiny random qwen3 target: the target answers token
prompts (in the trainer process), its features are cached, the loss falls, the written GGUF
loads as a `--draft` in the Engine, speculative greedy output equals plain, and on its
training distribution the trained draft is accepted more than the random draft it started
from."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from luced.cli import main, train_draft
from luced.runtime.dflash.trainer import load_sequence
from luced.runtime.tiny import make_tiny_gguf

PROMPTS = 18


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, list[list[int]], dict]:
    root = tmp_path_factory.mktemp("train")
    target = root / "qwen3.gguf"
    make_tiny_gguf("qwen3", target, seed=7, layers=8, context=512)
    rng = random.Random(0)
    prompts = [[rng.randrange(2, 200) for _ in range(rng.randrange(6, 16))] for _ in range(PROMPTS)]
    jsonl = root / "prompts.jsonl"
    jsonl.write_text("".join(json.dumps({"ids": p}) + "\n" for p in prompts))
    flags = "--answer-tokens 48 --eval-prompts 2 --block-size 4 --anchors 48 --epochs 30"
    flags += " --lr 1e-2 --eval-tokens 0 --threads 1"  # eval below, on training prompts
    args = train_draft.parser().parse_args(
        [str(target), str(root / "out"), "--prompts-jsonl", str(jsonl), *flags.split()]
    )
    report = train_draft.run(args)
    return target, root / "out", prompts, report


def test_features_are_cached_in_bf16(trained) -> None:
    _, out, _, report = trained
    files = sorted((out / "data").glob("*.pt"))
    assert len(files) == report["train_sequences"] > 0
    seq = load_sequence(files[0])
    spec = report["spec"]
    assert seq.features.dtype == torch.bfloat16
    assert seq.features.shape == (len(seq.ids), spec["captures"] * spec["hidden"])
    assert 0 < seq.answer_start < len(seq.ids) - 1


def test_loss_falls(trained) -> None:
    report = trained[3]
    assert report["loss_last"] < 0.5 * report["loss_first"]


def test_trained_draft_beats_random_and_keeps_greedy_exact(trained) -> None:
    target, out, prompts, _ = trained
    args = train_draft.parser().parse_args(
        [str(target), str(out), "--block-size", "4", "--eval-tokens", "32", "--threads", "1"]
    )
    drafts = {"random": out / "random.gguf", "trained": out / "draft.gguf"}
    # The training distribution: prompts the draft was trained on (held-out ones excluded).
    seen = [p for p in prompts if p not in prompts[:2]][:4]
    report = asyncio.run(train_draft.evaluate(target, drafts, {"train": seen}, args))["train"]
    assert all(r["greedy_equals_plain"] for r in report.values())
    assert report["trained"]["acceptance_length"] > report["random"]["acceptance_length"] + 0.3


def test_resume_continues_exactly(trained, tmp_path: Path) -> None:
    # Stopped at step 10 and resumed, the run ends with the weights of an unbroken run. Each
    # run answers its prompts first: 4 to train on (20 steps: 5 passes over them) suffice.
    target, _, prompts, _ = trained
    jsonl = tmp_path / "prompts.jsonl"
    jsonl.write_text("".join(json.dumps({"ids": p}) + "\n" for p in prompts[:6]))
    common = [str(target), "--prompts-jsonl", str(jsonl)]
    flags = "--answer-tokens 24 --eval-prompts 2 --block-size 4 --anchors 8 --steps 20"
    common += [*flags.split(), "--eval-tokens", "0", "--threads", "1"]
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    train_draft.run(train_draft.parser().parse_args([*common, str(whole)]))
    train_draft.run(train_draft.parser().parse_args([*common, str(parts), "--stop-at", "10"]))
    first = load_file(parts / "draft" / "model.safetensors")
    train_draft.run(train_draft.parser().parse_args([*common, str(parts), "--resume"]))
    a = load_file(whole / "draft" / "model.safetensors")
    b = load_file(parts / "draft" / "model.safetensors")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], first[k]) for k in a)  # the stop really was midway


def test_bad_prompts_get_one_line_before_any_training(tmp_path: Path, capsys) -> None:
    target = make_tiny_gguf("llama", tmp_path / "llama.gguf", seed=1).path
    jsonl = tmp_path / "prompts.jsonl"
    jsonl.write_text(json.dumps({"ids": [1, 2]}) + "\n" + json.dumps({"text": "hi"}) + "\n")
    out = tmp_path / "out"
    assert main(["train-draft", str(target), str(out), "--prompts-jsonl", str(jsonl)]) == 2
    assert f"{jsonl}:2: needs 'prompt', 'messages' or 'ids'" in capsys.readouterr().err
    assert not (out / "job.json").exists()  # no trainer started
    jsonl.write_text("".join(json.dumps({"ids": [1, 9999]}) + "\n" for _ in range(6)))
    assert main(["train-draft", str(target), str(out), "--prompts-jsonl", str(jsonl)]) == 2
    assert "own: token ids outside the target's vocabulary [0, 512)" in capsys.readouterr().err


def test_a_draft_that_cannot_fit_the_target_fails_before_the_target_answers(
    tmp_path: Path, capfd
) -> None:
    """A 2-layer target has no 3 distinct layers to capture: the trainer says so, in one
    line, before it distills anything."""
    target = make_tiny_gguf("llama", tmp_path / "llama.gguf", seed=1).path  # 2 layers
    jsonl = tmp_path / "prompts.jsonl"
    jsonl.write_text("".join(json.dumps({"ids": [5, 6, 7]}) + "\n" for _ in range(4)))
    out = tmp_path / "out"
    args = ["train-draft", str(target), str(out), "--prompts-jsonl", str(jsonl)]
    assert main([*args, "--eval-prompts", "1", "--threads", "1"]) == 2
    err = capfd.readouterr().err  # the trainer's line, then the command's
    assert "random.gguf: capture layers [0, 0, 1] repeat a layer" in err
    assert "too shallow for 3 captures" in err
    assert "the training process ended with exit status 2" in err
    assert not (out / "data").exists()  # the target answered nothing
