"""Several sequences in one forward through the real runner (worker subprocesses, shared
memory, frames), unsplit and split, against each sequence decoded alone in process."""

from __future__ import annotations

from pathlib import Path

import pytest
from engine_harness import split_target

from luced.engine.driver import Driver
from luced.engine.scheduler import Work
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


def decode(d: Driver, slot: int, token: int, sampling: dict, logprobs: int | None = None) -> Work:
    seq = d.seq(slot, sampling, logprobs)
    return Work(seq, seq.computed, [token], 1)


async def stepped_alone(d: Driver, slot: int, prompt: list[int]) -> list[int]:
    """The seeded sequence's first token and STEPS more, each a forward of its own."""
    tokens = [(await d.prefill(prompt, SEEDED, slot=slot)).token]
    for _ in range(STEPS):
        tokens.append((await d.step(tokens[-1], SEEDED, slot=slot)).token)
    return tokens


@pytest.mark.parametrize("devices", [("cpu",), ("cpu", "cpu:1")], ids=["unsplit", "split"])
async def test_batched_steps_equal_each_sequence_alone(tiny: Path, devices) -> None:
    async with split_target(tiny, devices) as d:
        tokens = {s: [(await d.prefill(p, GREEDY, slot=s)).token] for s, p in PROMPTS.items()}
        for _ in range(STEPS):
            rows = await d.run([decode(d, s, tokens[s][-1], GREEDY) for s in PROMPTS])
            for s, (sampled,) in zip(PROMPTS, rows, strict=True):
                tokens[s].append(sampled.token)
        for s, prompt in PROMPTS.items():
            assert d.position(s) == len(prompt) + STEPS
    model = Model.load(tiny)
    for s, prompt in PROMPTS.items():
        assert tokens[s] == alone(model, prompt, STEPS + 1), f"sequence {s}"


async def test_a_seeded_sequence_draws_alike_alone_and_batched(tiny: Path) -> None:
    """The workers keep each sequence's sampler: sampled with a seed and penalties, a
    sequence draws the same tokens stepped alone as in a batch beside greedy ones (and
    alone again every other step); each row reports only the logprobs it asked for."""
    prompt = PROMPTS[7]
    async with split_target(tiny, ("cpu",)) as d:
        solo = await stepped_alone(d, 1, prompt)
        mixed = [(await d.prefill(prompt, SEEDED, slot=2)).token]
        other = [(await d.prefill(PROMPTS[3], GREEDY, slot=3)).token]
        for i in range(STEPS):
            mine = decode(d, 2, mixed[-1], SEEDED, 2)
            if i % 2:
                (row,), (theirs,) = await d.run([mine, decode(d, 3, other[-1], GREEDY)])
                other.append(theirs.token)
                assert theirs.logprob is None and theirs.top == ()
            else:
                ((row,),) = await d.run([mine])
            assert len(row.top) == 2 and row.logprob is not None
            mixed.append(row.token)
    assert mixed == solo


async def test_released_sequences_start_over(tiny: Path) -> None:
    async with split_target(tiny, ("cpu",)) as d:
        first = (await d.prefill(PROMPTS[3], GREEDY, slot=4)).token
        await d.release(4)
        assert d.position(4) == 0
        assert (await d.prefill(PROMPTS[3], GREEDY, slot=4)).token == first


@pytest.mark.parametrize("devices", [("cpu",), ("cpu", "cpu:1")], ids=["unsplit", "split"])
async def test_a_verify_window_in_a_batch_equals_verify_alone(tiny: Path, devices) -> None:
    """A sequence's greedy window (token + proposals) runs beside another's decode token:
    its rows are the window's rows alone, logprobs included; the sequence holds the whole
    window until its next span rolls it back."""
    window = PROMPTS[3][:6]
    async with split_target(tiny, devices) as d:
        first = (await d.prefill(PROMPTS[7], GREEDY, slot=1)).token
        n = len(PROMPTS[7])
        want = await d.feed([first, *window], GREEDY, 2, slot=1, n_out=len(window) + 1)
        d.truncate(n, slot=1)
        other = (await d.prefill(PROMPTS[3], GREEDY, slot=2)).token
        seq = d.seq(1, GREEDY, 2)
        verify = Work(seq, n, [first, *window], len(window) + 1, window=len(window) + 1)
        got, (step,) = await d.run([verify, decode(d, 2, other, GREEDY)])
        assert [r.token for r in got] == [r.token for r in want]
        assert [r.logprob for r in got] == pytest.approx([r.logprob for r in want], abs=1e-5)
        assert step.token == alone(Model.load(tiny), PROMPTS[3], 2)[1]
        assert d.position(1) == n + 1 + len(window)
        # Keep the anchor and two proposals: the next span rolls the rest back.
        d.truncate(n + 3, slot=1)
        (nxt,) = await d.feed([window[2]], GREEDY, slot=1)
        assert nxt.token == want[3].token
