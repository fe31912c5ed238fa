"""The layer split through the real Target: worker subprocesses, shared memory, frames.

Oracle: the whole model in this process (`Model`, `generate`) on CPU float32 with the
same thread count as the workers, i.e. the unsplit result. A split must reproduce it
bitwise (logits, captures, projections) and token for token (greedy and seeded
sampling with penalties, whose history lives on the last shard), for 2 and 3 shards,
in one worker (device shards), across workers (shared-memory boundaries) and both.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
import torch
from engine_harness import split_target

from luced.engine.driver import Driver
from luced.runtime.generate import generate
from luced.runtime.model import Model
from luced.runtime.tiny import make_tiny_gguf
from luced.sampling_params import SamplingParams

KV = 64
PROMPT = [3, 17, 5, 42, 8, 99, 23, 4, 61, 7]
SAMPLED = {"temperature": 0.9, "seed": 11, "repetition_penalty": 1.3}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """llama / qwen3 with 4 layers (3 shards need 3), gemma3 with its 6 (sliding + global)."""
    d = tmp_path_factory.mktemp("split")
    out = {}
    for family in ("llama", "qwen3", "gemma3"):
        extra = {} if family == "gemma3" else {"layers": 4}
        make_tiny_gguf(family, d / f"{family}.gguf", seed=3, **extra)
        out[family] = d / f"{family}.gguf"
    return out


def ref_forward(ref: Model, cache, ids: list[int], start: int, capture) -> tuple:
    h, caps = ref.forward_layers(ref.embed(torch.tensor(ids)), cache, start, capture)
    return ref.logits(h), caps


async def run_tokens(d: Driver, sampling: dict, n: int, logprobs=None) -> list[int]:
    s = await d.prefill(PROMPT, sampling, logprobs)
    out = [s.token]
    while len(out) < n:
        out.append((await d.step(out[-1], sampling, logprobs)).token)
    return out


async def check_split_equals_unsplit(path: Path, devices: tuple[str, ...], **target) -> None:
    """`target`: more arguments of `split_target` (workers on other hosts)."""
    ref = Model.load(path)
    n_layers = ref.cfg.n_layers
    async with split_target(path, devices, **target) as d:
        shards = d.target.describe()
        assert len(shards) == len(devices)
        assert [s["devices"] for s in shards] == [[d] for d in devices]
        assert len({s["pid"] for s in shards}) == len(set(devices))  # one worker per group
        ranges = [tuple(s["layers"]) for s in shards]
        assert ranges[0][0] == 0 and ranges[-1][1] == n_layers
        assert all(a[1] == b[0] and a[0] < a[1] for a, b in itertools.pairwise(ranges))
        b = ranges[1][0]  # the first boundary: capture a layer on either side of it
        capture = tuple(sorted({0, b - 1, b, n_layers - 1}))
        d.target.enable_capture(capture, ring_cap=32)
        ring = d.target.ring(0)
        assert ring is not None

        # Prompt logits, every position, bitwise; captures land in the ring bitwise.
        cache = ref.new_cache(KV)
        want, caps = ref_forward(ref, cache, PROMPT, 0, capture)
        got = await d.logits(PROMPT)
        assert np.array_equal(got, want.numpy())
        n = len(PROMPT)
        expect_ring = torch.stack([caps[layer] for layer in capture], dim=1)  # [n, cap, hidden]
        assert np.array_equal(ring.rows(0, n), expect_ring.numpy())

        # Truncate, then continue: equal to a fresh run that never saw the rolled-back tokens.
        # (Kept positions come in the same chunks as the fresh run's: a K/V row computed
        # in a batch of 3 may differ in the last bit from one computed alone.)
        await d.logits([11])
        await d.logits([12, 13])
        d.truncate(n + 1)  # the next span starts there: the workers roll back
        assert d.position() == n + 1
        got = await d.logits([21, 22])
        fresh = ref.new_cache(KV)
        ref_forward(ref, fresh, PROMPT, 0, ())
        ref_forward(ref, fresh, [11], n, ())
        want, caps = ref_forward(ref, fresh, [21, 22], n + 1, capture)
        assert np.array_equal(got, want.numpy())
        rows = ring.rows(n + 1, n + 3)
        for j, layer in enumerate(capture):  # positions n+1, n+2 were overwritten correctly
            assert np.array_equal(rows[:, j], caps[layer].numpy())

        # Greedy and seeded sampling with penalties, token for token.
        for sampling in ({"temperature": 0}, SAMPLED):
            params = SamplingParams(**sampling)
            expect = generate(ref, PROMPT, params, 12).tokens
            assert await run_tokens(d, sampling, 12, logprobs=2) == expect


@pytest.mark.parametrize(
    ("family", "devices"),
    [
        ("llama", ("cpu", "cpu")),  # 2 shards, one worker
        ("llama", ("cpu", "cpu:1")),  # 2 shards, two workers
        ("llama", ("cpu", "cpu:1", "cpu:2")),  # 3 shards, three workers
        ("llama", ("cpu", "cpu", "cpu")),  # 3 shards, one worker
        ("qwen3", ("cpu", "cpu:1")),
        ("qwen3", ("cpu:1", "cpu:1", "cpu:2")),  # 3 shards: one worker with 2, then another
        ("gemma3", ("cpu", "cpu:1")),
        ("gemma3", ("cpu", "cpu:1", "cpu:1")),
    ],
)
async def test_split_equals_unsplit_tiny(tiny: dict[str, Path], family: str, devices) -> None:
    await check_split_equals_unsplit(tiny[family], devices)


async def test_weights_place_the_boundaries(tiny: dict[str, Path]) -> None:
    async with split_target(tiny["gemma3"], ("cpu", "cpu", "cpu:1"), weights=(1, 3, 2)) as d:
        assert [s["layers"] for s in d.target.describe()] == [[0, 1], [1, 4], [4, 6]]
        ref = Model.load(tiny["gemma3"])
        want = ref.forward(torch.tensor(PROMPT), ref.new_cache(KV), 0)
        assert np.array_equal(await d.logits(PROMPT), want.numpy())


@pytest.mark.real_model
async def test_split_equals_unsplit_smollm2(smollm2_gguf: Path) -> None:
    await check_split_equals_unsplit(smollm2_gguf, ("cpu", "cpu", "cpu:1"))


@pytest.mark.real_model
async def test_split_equals_unsplit_gemma3(gemma3_gguf: Path) -> None:
    ref = Model.load(gemma3_gguf)
    async with split_target(gemma3_gguf, ("cpu", "cpu:1")) as d:
        want = ref.forward(torch.tensor(PROMPT), ref.new_cache(KV), 0)
        assert np.array_equal(await d.logits(PROMPT), want.numpy())
        expect = generate(ref, PROMPT, SamplingParams(temperature=0), 8).tokens
        assert await run_tokens(d, {"temperature": 0}, 8) == expect
