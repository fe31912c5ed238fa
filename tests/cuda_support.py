"""What the tests marked `cuda` share: the device they run on, the greedy-parity rule for
near-ties, and the report a GPU check collects (tools/gpu_check.py).

Device: the first CUDA GPU. Without one the tests skip, unless LUCED_CUDA_TESTS_ON=cpu asks
for a dry run on the CPU: then "the GPU" is the CPU, every comparison is the CPU against
itself, and a pass proves the tests and the script run, nothing about a GPU. The report
says which device ran.

Near-ties: two runs whose kernels round differently (the GPU against the CPU, a batch
against a single sequence on the GPU, bf16 against float32) may pick different greedy
tokens where the reference's two most likely tokens are closer than the rounding. So a
comparison walks the tokens: equal, go on; different, the reference's top-2 logprob margin
at that position must be under the tolerance, and the two sequences are free to differ
after it. `Agreement` says how many positions agreed and whether the runs were identical.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass

import torch

from luced.engine.core import Engine, GenerationRequest
from luced.sampling_params import SamplingParams


def device_under_test() -> str | None:
    """'cuda:0' with a GPU; 'cpu' under LUCED_CUDA_TESTS_ON=cpu (a dry run); else None."""
    if torch.cuda.is_available():
        return "cuda:0"
    return "cpu" if os.environ.get("LUCED_CUDA_TESTS_ON") == "cpu" else None


@dataclass
class Run:
    """A greedy run: its tokens and, per token, the top-2 logprob margin."""

    tokens: list[int]
    margins: list[float]


@dataclass
class Agreement:
    compared: int  # positions checked
    agreed: int  # leading positions with the same token
    identical: bool  # every token equal
    tie_at: int | None  # where they parted at a near-tie, if they did
    margin: float | None  # the reference's margin there


def agree(ref: Run, got: Run, tol: float) -> Agreement:
    """Compare `got` with the reference `ref` (module docstring); AssertionError where they
    part at a position whose margin is not a near-tie."""
    n = min(len(ref.tokens), len(got.tokens))
    for i in range(n):
        if ref.tokens[i] != got.tokens[i]:
            margin = ref.margins[i]
            assert margin < tol, (
                f"token {i}: {got.tokens[i]} where the reference has {ref.tokens[i]}, whose "
                f"lead over the runner-up is {margin:.3g} (a near-tie is under {tol:g})"
            )
            return Agreement(n, i, False, i, margin)
    return Agreement(n, n, len(ref.tokens) == len(got.tokens), None, None)


async def run_length(engine: Engine, prompt: list[int], sampling: SamplingParams, n: int) -> Run:
    """n tokens of `prompt` through an engine (EOS ignored), with each position's top-2
    margin (`sampling` must ask for logprobs=2)."""
    handle = engine.submit(GenerationRequest("r", prompt, sampling, n, ignore_eos=True))
    tokens, tops = [], []
    async for delta in handle:
        tokens += delta.token_ids
        tops += [[t[1] for t in lp.top] for lp in delta.logprobs or []]
    assert handle.finish_reason == "length", handle.error
    return Run(tokens, margins(tops))


def margins(top: list[list[float]]) -> list[float]:
    """Top-2 margins from each position's sorted top logprobs."""
    return [t[0] - t[1] if len(t) > 1 else float("inf") for t in top]


def record(check: str, **fields: object) -> None:
    """Append one line to the GPU check's report (LUCED_GPU_REPORT, a JSON-lines file), with
    the device that ran it; nothing when no report is being collected."""
    path = os.environ.get("LUCED_GPU_REPORT")
    if not path:
        return
    device = device_under_test()
    name = torch.cuda.get_device_name(0) if device and device.startswith("cuda") else "cpu"
    line = {"check": check, "device": name, **fields}
    with open(path, "a") as f:
        f.write(json.dumps(line, default=_plain) + "\n")


def _plain(value: object) -> object:
    if isinstance(value, Agreement):
        return asdict(value)
    return str(value)
