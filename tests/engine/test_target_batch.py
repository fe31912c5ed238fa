"""Sequences and batched steps through the real Target (worker subprocesses, shared memory,
frames), unsplit and split, against each sequence decoded alone in process."""

from __future__ import annotations

from pathlib import Path

import pytest
from engine_harness import split_target

from luced.engine.target import BatchStep, Target
from luced.runtime.generate import generate
from luced.runtime.model import Model
from luced.runtime.tiny import make_tiny_gguf
from luced.sampling_params import SamplingParams

PROMPTS = {0: [5, 9, 14, 3, 22, 7], 3: [40, 2, 2, 19], 7: [11, 61, 8, 30, 4, 4, 17, 9, 2]}
GREEDY = {"temperature": 0}
SEEDED = {"temperature": 0.9, "seed": 5, "repetition_penalty": 1.2}
STEPS = 5


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tb") / "llama.gguf"
    return make_tiny_gguf("llama", path, seed=4, layers=4, context=256).path


def alone(model: Model, prompt: list[int], steps: int) -> list[int]:
    """Greedy continuation of one sequence in process: the oracle."""
    return generate(model, prompt, SamplingParams(temperature=0), steps).tokens


async def prefill(target: Target, seq: int, prompt: list[int], sampling: dict) -> int:
    async with target.lane(seq):
        await target.reset()
        first = await target.prefill(prompt, sampling, None)
        assert first is not None
        return first.token


async def stepped_alone(target: Target, seq: int, prompt: list[int]) -> list[int]:
    """The seeded sequence's first token and STEPS more, each from its own `step`."""
    tokens = [await prefill(target, seq, prompt, SEEDED)]
    async with target.lane(seq):
        for _ in range(STEPS):
            tokens.append((await target.step(tokens[-1], SEEDED, None)).token)
    return tokens


@pytest.mark.parametrize("devices", [("cpu",), ("cpu", "cpu:1")], ids=["unsplit", "split"])
async def test_batched_steps_equal_each_sequence_alone(tiny: Path, devices) -> None:
    async with split_target(tiny, devices) as target:
        tokens = {seq: [await prefill(target, seq, p, GREEDY)] for seq, p in PROMPTS.items()}
        for _ in range(STEPS):
            steps = [BatchStep(seq, tokens[seq][-1], GREEDY) for seq in PROMPTS]
            for seq, (sampled,) in zip(PROMPTS, await target.step_batch(steps), strict=True):
                tokens[seq].append(sampled.token)
        for seq, prompt in PROMPTS.items():
            async with target.lane(seq):
                assert target.position == len(prompt) + STEPS
    model = Model.load(tiny)
    for seq, prompt in PROMPTS.items():
        assert tokens[seq] == alone(model, prompt, STEPS + 1), f"sequence {seq}"


async def test_a_seeded_sequence_draws_alike_alone_and_batched(tiny: Path) -> None:
    """The workers keep each sequence's sampler: sampled with a seed and penalties, a
    sequence draws the same tokens stepped alone as in a batch beside greedy ones; each
    row reports only the logprobs its step asked for."""
    prompt = PROMPTS[7]
    async with split_target(tiny, ("cpu",)) as target:
        solo = await stepped_alone(target, 1, prompt)
        mixed = [await prefill(target, 2, prompt, SEEDED)]
        other = [await prefill(target, 3, PROMPTS[3], GREEDY)]
        for _ in range(STEPS):
            (mine,), (others,) = await target.step_batch(
                [BatchStep(2, mixed[-1], SEEDED, 2), BatchStep(3, other[-1], GREEDY)]
            )
            rows = [mine, others]
            mixed.append(rows[0].token)
            other.append(rows[1].token)
            assert len(rows[0].top) == 2 and rows[0].logprob is not None
            assert rows[1].logprob is None and rows[1].top == ()
    assert mixed == solo


async def test_a_batch_of_one_plain_step_is_the_sequences_own_step(
    tiny: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch holding one plain step (the only request decoding) goes through the
    workers' single-sequence forward, not a batch of one; a seeded sequence stepped so,
    with its steps in batches of two between, draws what it draws stepped alone, and
    reports the logprobs it asked for."""
    prompt = PROMPTS[7]
    async with split_target(tiny, ("cpu",)) as target:
        solo = await stepped_alone(target, 1, prompt)
        batched = 0
        pipeline = target._batch_pipeline

        async def counted(*args, **kwargs):
            nonlocal batched
            batched += 1
            return await pipeline(*args, **kwargs)

        monkeypatch.setattr(target, "_batch_pipeline", counted)
        mixed = [await prefill(target, 2, prompt, SEEDED)]
        other = [await prefill(target, 3, PROMPTS[3], GREEDY)]
        for i in range(STEPS):
            if i % 2:
                (mine,), (theirs,) = await target.step_batch(
                    [BatchStep(2, mixed[-1], SEEDED, 2), BatchStep(3, other[-1], GREEDY)]
                )
                other.append(theirs.token)
            else:
                ((mine,),) = await target.step_batch([BatchStep(2, mixed[-1], SEEDED, 2)])
            assert len(mine.top) == 2 and mine.logprob is not None
            mixed.append(mine.token)
        assert batched == STEPS // 2  # only the batches of two
    assert mixed == solo


async def test_bad_batches_are_refused_and_released_lanes_start_over(tiny: Path) -> None:
    async with split_target(tiny, ("cpu",)) as target:
        first = await prefill(target, 4, PROMPTS[3], GREEDY)
        with pytest.raises(ValueError, match="distinct sequences"):
            await target.step_batch([BatchStep(4, first, GREEDY), BatchStep(4, first, GREEDY)])
        await target.release(4)
        async with target.lane(4):
            assert target.position == 0
        assert await prefill(target, 4, PROMPTS[3], GREEDY) == first
        with pytest.raises(ValueError, match="default lane"):
            await target.release(0)


@pytest.mark.parametrize("devices", [("cpu",), ("cpu", "cpu:1")], ids=["unsplit", "split"])
async def test_a_verify_block_in_a_batch_equals_verify_alone(tiny: Path, devices) -> None:
    """A lane's greedy verify block (token + proposals) steps beside another lane's decode
    token: its rows are `verify`'s rows alone, logprobs included, and the lane moves past
    the whole block."""
    block = PROMPTS[3][:6]
    async with split_target(tiny, devices) as target:
        first = await prefill(target, 1, PROMPTS[7], GREEDY)
        async with target.lane(1):
            want = await target.verify([first, *block], GREEDY, 2)
            await target.truncate(len(PROMPTS[7]))
        other = await prefill(target, 2, PROMPTS[3], GREEDY)
        got, (step,) = await target.step_batch(
            [BatchStep(1, first, GREEDY, 2, proposals=tuple(block)), BatchStep(2, other, GREEDY)]
        )
        assert [r.token for r in got] == [r.token for r in want]
        assert [r.logprob for r in got] == pytest.approx([r.logprob for r in want], abs=1e-5)
        assert step.token == alone(Model.load(tiny), PROMPTS[3], 2)[1]
        async with target.lane(1):
            assert target.position == len(PROMPTS[7]) + 1 + len(block)
