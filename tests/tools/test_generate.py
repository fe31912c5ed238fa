"""tools/generate.py: --prompt-ids feeds ids as they are, --json reports the generated ids."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from luced.runtime.generate import generate
from luced.runtime.model import Model
from luced.runtime.tiny import make_tiny_gguf
from luced.sampling_params import SamplingParams

TOOL = Path(__file__).resolve().parents[2] / "tools" / "generate.py"
IDS = [3, 17, 200, 41, 9]


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True)


def test_prompt_ids_equal_in_process_greedy(tmp_path: Path) -> None:
    path = make_tiny_gguf("qwen3", tmp_path / "qwen3.gguf").path
    ids = ",".join(map(str, IDS))
    proc = run("--model", str(path), "--prompt-ids", ids, "--json", "--max-tokens", "12",
               "--ignore-eos", "--threads", "1")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    torch.set_num_threads(1)
    want = generate(Model.load(path), IDS, SamplingParams(temperature=0), 12, eos_ids=())
    assert out["tokens"] == want.tokens and out["prompt_tokens"] == len(IDS)


def test_bad_prompt_ids_are_refused(tmp_path: Path) -> None:
    path = make_tiny_gguf("llama", tmp_path / "llama.gguf").path
    assert "want comma-separated token ids" in run("--prompt-ids", "1,x").stderr
    assert "not allowed with argument" in run("--prompt-ids", "1", "--prompt", "hi").stderr
    bad = run("--model", str(path), "--prompt-ids", "1,99999")
    assert bad.returncode != 0 and "vocabulary size" in bad.stderr
