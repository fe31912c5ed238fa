"""Embedding requests through a real Engine over real workers, against transformers' pooled
last hidden states on the same tiny random models: decoders (a long input pooled over
several prompt chunks) and encoders (an input in one span), alone and batched with other
requests in the same steps."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
import torch
from engine_harness import embed, engine_for, generate
from tiny_hf import hf_model

from luced.engine.core import ContextTooLong, EmbeddingsOnly, GenerationRequest
from luced.runtime.tiny import ENCODERS, TinyModel, make_tiny_gguf
from luced.sampling_params import SamplingParams

pytestmark = pytest.mark.asyncio

LONG = list(range(5, 155))  # 150 tokens: three prompt chunks of the harness's 64


def pooled(states: torch.Tensor, kind: str) -> np.ndarray:
    """transformers' last_hidden_state [n, hidden] pooled as luced pools it."""
    return {"mean": states.mean(0), "cls": states[0], "last": states[-1]}[kind].numpy()


def hf_states(tiny: TinyModel, ids: list[int]) -> torch.Tensor:
    model = hf_model(tiny)
    if tiny.family not in ENCODERS:
        model = model.model  # the decoder without its head: states after the final norm
    with torch.no_grad():
        return model(torch.tensor([ids])).last_hidden_state[0]


def close(ours: np.ndarray, ref: np.ndarray) -> None:
    np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=1e-4 * float(np.abs(ref).max()))


@pytest.mark.parametrize("family", ["llama", "gemma3"])
async def test_decoder_embeddings_equal_transformers(tmp_path: Path, family: str) -> None:
    """Mean over three chunks (the daemon adds each chunk's sum), the first and the last
    position's state; gemma3's sliding layers see across the chunk boundaries."""
    tiny = make_tiny_gguf(family, tmp_path / "m.gguf", seed=8)
    states = hf_states(tiny, LONG)
    async with engine_for(tiny.path, context=256) as engine:
        for kind in ("mean", "cls", "last"):
            close(await embed(engine, LONG, kind), pooled(states, kind))
        short = LONG[:10]
        close(await embed(engine, short, "mean"), pooled(hf_states(tiny, short), "mean"))


async def test_a_split_target_pools_in_its_last_worker(tmp_path: Path) -> None:
    """Two workers: the first hands its rows on (want="hidden"), the last pools them."""
    tiny = make_tiny_gguf("llama", tmp_path / "m.gguf", seed=8, layers=4)
    async with engine_for(tiny.path, ("cpu", "cpu:1"), context=256) as engine:
        assert len(engine.target.executor.workers()) == 2
        for kind in ("mean", "last"):
            close(await embed(engine, LONG, kind), pooled(hf_states(tiny, LONG), kind))


async def test_embeddings_run_in_the_steps_of_a_generation(tmp_path: Path) -> None:
    """Two embeddings submitted beside a generation share its steps: the generation's
    tokens are the ones it makes alone, each vector is transformers'."""
    tiny = make_tiny_gguf("llama", tmp_path / "m.gguf", seed=9, tied=False)
    async with engine_for(tiny.path, context=256, max_running=4) as engine:
        alone, *_ = await generate(engine, [1, 2, 3, 4], 24)
        steps, sequences = engine.steps, engine.stepped_sequences
        (tokens, *_), long, short = await asyncio.gather(
            generate(engine, [1, 2, 3, 4], 24),
            embed(engine, LONG, "mean"),
            embed(engine, LONG[:30], "last"),
        )
        assert engine.stepped_sequences - sequences > engine.steps - steps  # shared steps
    assert tokens == alone
    close(long, pooled(hf_states(tiny, LONG), "mean"))
    close(short, pooled(hf_states(tiny, LONG[:30]), "last"))


@pytest.mark.parametrize("family", ENCODERS)
async def test_encoder_embeddings_equal_transformers(tmp_path: Path, family: str) -> None:
    """Inputs submitted together run in one step, each in one span (one of them longer than
    a prompt chunk), and each pooling equals transformers' on that input alone."""
    tiny = make_tiny_gguf(family, tmp_path / "m.gguf", seed=10)
    inputs = [[2, *range(10, 10 + n), 3] for n in (3, 20, 98)]
    async with engine_for(tiny.path, context=128, max_running=4) as engine:
        for kind in ("mean", "cls", "last"):
            steps = engine.steps
            got = await asyncio.gather(*(embed(engine, ids, kind) for ids in inputs))
            assert engine.steps - steps == 1
            for ids, vector in zip(inputs, got, strict=True):
                close(vector, pooled(hf_states(tiny, ids), kind))


async def test_an_encoder_refuses_generation_and_inputs_past_its_context(tmp_path: Path) -> None:
    tiny = make_tiny_gguf("bert", tmp_path / "m.gguf", seed=11)
    async with engine_for(tiny.path, context=128, max_running=4) as engine:
        with pytest.raises(EmbeddingsOnly, match="cannot generate text"):
            engine.submit(GenerationRequest("g", [2, 5, 3], SamplingParams(), max_tokens=4))
        whole = [2, *range(10, 136), 3]  # 128 tokens: the whole context
        close(await embed(engine, whole, "cls"), pooled(hf_states(tiny, whole), "cls"))
        with pytest.raises(ContextTooLong, match="at most 128 fit"):
            await embed(engine, [*whole, 3], "cls")
        assert engine.rejected == {"model_not_supported": 1, "context_length_exceeded": 1}
