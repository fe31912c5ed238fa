"""Decoding one step ahead (`--decode-ahead`, runtime/lookahead.py): the worker runs the
next decode step before the daemon asks, and answers it from that when it is asked. Every
output stays the same as without it, token for token (logprobs within 1e-4: how requests
arriving at set delays group into steps varies from run to run, with or without decoding
ahead, and the log-softmax of a step's rows rounds its far tail by the rows it holds): alone and
batched, greedy and seeded sampling, requests joining while others decode (the step ahead
is rolled back), requests ending on a stop token before their budget (the step ahead is
dropped with the sequence) and preempted ones (their generator is rolled back too, so they
resume with the same draws)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

import pytest
from engine_harness import engine_for

from luced.engine.core import Engine, GenerationRequest
from luced.runtime.tiny import make_tiny_gguf
from luced.sampling_params import SamplingParams

PROMPTS = [
    [3, 17, 5, 42, 8, 99, 23, 4, 61, 7],
    [(7 * i + 3) % 300 + 2 for i in range(90)],  # prompt chunks beside running decodes
    [11, 12, 13] * 6,
    [200, 1, 200, 2],
]
N = 24


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("ahead") / "llama.gguf"
    make_tiny_gguf("llama", path, seed=5, layers=2, context=512)
    return path


@dataclass
class First:
    """The first request of a batch: how many tokens it has produced, and whether it ended."""

    tokens: int = 0
    done: bool = False


async def generate(
    engine: Engine, req: GenerationRequest, after: int = 0, first: First | None = None
) -> tuple:
    """`req`'s tokens, logprobs and finish reason; with `first`, submitted once the first
    request produced `after` tokens (or ended): it joins while that one decodes."""
    while first is not None and after and first.tokens < after and not first.done:
        await asyncio.sleep(0.001)
    handle = engine.submit(req)
    tokens, logprobs = [], []
    async for delta in handle:
        tokens += delta.token_ids
        logprobs += [(lp.logprob, lp.top) for lp in delta.logprobs or []]
        if first is not None and not after:
            first.tokens = len(tokens)
    if first is not None and not after:
        first.done = True
    return tokens, logprobs, handle.finish_reason


def requests(sampling: SamplingParams, stop: int | None = None) -> list[GenerationRequest]:
    stops = (stop,) if stop is not None else ()
    return [
        GenerationRequest(f"r{i}", p, sampling, N - 3 * i, stop_token_ids=stops, ignore_eos=True)
        for i, p in enumerate(PROMPTS)
    ]


async def serve(engine: Engine, reqs: list[GenerationRequest]) -> list[tuple]:
    alone = [await generate(engine, r) for r in reqs]
    first = First()
    together = await asyncio.gather(
        *(generate(engine, r, 4 * i, first) for i, r in enumerate(reqs))
    )
    return [*alone, *together]


async def outputs(model: Path, ahead: str, **kw) -> tuple[list[tuple], dict]:
    greedy = SamplingParams(temperature=0, logprobs=2)
    sampled = SamplingParams(temperature=0.9, seed=3, logprobs=2)
    async with engine_for(model, max_running=4, decode_ahead=ahead, **kw) as engine:
        got = [*await serve(engine, requests(greedy)), *await serve(engine, requests(sampled))]
        # a stop token some request samples early on: it ends before its budget
        stop = got[0][0][5]
        got += await serve(engine, requests(greedy, stop))
        (worker,) = (await engine.target.stats())["workers"]
        worker["preemptions"] = engine.totals["preemptions"]
    return got, worker


def assert_same(plain: list[tuple], ahead: list[tuple]) -> None:
    assert [(t, r) for t, _, r in ahead] == [(t, r) for t, _, r in plain]
    for (_, lps, _), (_, ref, _) in zip(ahead, plain, strict=True):
        for (lp, top), (ref_lp, ref_top) in zip(lps, ref, strict=True):
            assert lp == pytest.approx(ref_lp, abs=1e-4)
            assert [t[0] for t in top] == [t[0] for t in ref_top]
            assert [t[1] for t in top] == pytest.approx([t[1] for t in ref_top], abs=1e-4)


async def test_decoding_ahead_changes_no_output(model: Path) -> None:
    plain, plain_worker = await outputs(model, ahead="off")
    ahead, worker = await outputs(model, ahead="on")
    assert_same(plain, ahead)
    assert plain_worker["ahead_served"] == plain_worker["ahead_dropped"] == 0
    assert worker["ahead_served"] > 100 and worker["ahead_dropped"] >= 6
    assert any(reason == "stop" for _, _, reason in plain)


async def test_a_preempted_request_resumes_with_the_same_draws(model: Path) -> None:
    # a pool of about two contexts for four requests: the last to arrive are preempted
    plain, plain_worker = await outputs(model, ahead="off", kv_pool_tokens=160, context=160)
    ahead, worker = await outputs(model, ahead="on", kv_pool_tokens=160, context=160)
    assert_same(plain, ahead)
    assert worker["ahead_served"] > 0 and worker["ahead_dropped"] > 0
    assert plain_worker["preemptions"] > 0 and worker["preemptions"] > 0
