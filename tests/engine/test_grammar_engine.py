"""Grammar-constrained decoding through the real Engine and Target on a tiny random model.

Oracles: the schema itself (`jsonschema` validates every output; the tiny model never
writes JSON on its own, so only the masks can make it), and plain constrained decoding
(greedy output under DFlash or `--draft ngram` speculation must equal it token for token).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import jsonschema
import pytest
import pytest_asyncio
from engine_harness import engine_for

from luced.engine.core import Engine, GenerationRequest, InvalidGrammar
from luced.runtime.tiny import make_tiny_draft, make_tiny_gguf
from luced.sampling_params import SamplingParams
from luced.text.grammar import json_schema_grammar
from tools.bench_dflash import HalfOracle

pytestmark = pytest.mark.asyncio(loop_scope="module")

PROMPT = [3, 17, 5, 42, 8, 99, 23, 4, 61, 7] * 3
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "n": {"type": "integer", "minimum": -50, "maximum": 999},
        "tags": {"type": "array", "items": {"enum": ["a", "bc"]}, "maxItems": 3},
    },
    "required": ["name", "n", "tags"],
    "additionalProperties": False,
}
MAX_TOKENS = 120


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("grammar")
    target = root / "qwen3.gguf"
    make_tiny_gguf("qwen3", target, seed=7, layers=8, context=512)
    _, draft, _ = make_tiny_draft(target, root / "draft", seed=3, block_size=4)
    return target, draft


async def run(engine: Engine, grammar: str, **params) -> tuple[list[int], str, str]:
    """(token ids, text, finish reason) of one constrained request; its speculation counts
    go to `engine.last_spec`."""
    sampling = SamplingParams(**{"temperature": 0, **params})
    req = GenerationRequest("r", PROMPT, sampling, MAX_TOKENS, grammar=grammar)
    handle = engine.submit(req)
    tokens, text = [], ""
    async for delta in handle:
        tokens += delta.token_ids
        text += delta.text
    engine.last_spec = handle.spec
    return tokens, text, handle.finish_reason


def assert_valid(text: str, reason: str) -> None:
    assert reason == "stop", text
    jsonschema.validate(json.loads(text), SCHEMA)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def plain(tiny) -> list[int]:
    async with engine_for(tiny[0]) as engine:
        tokens, text, reason = await run(engine, json_schema_grammar(SCHEMA))
        assert_valid(text, reason)
        return tokens


async def test_sampled_output_validates(tiny) -> None:
    async with engine_for(tiny[0]) as engine:
        grammar = json_schema_grammar(SCHEMA)
        for seed in (1, 2):
            _, text, reason = await run(engine, grammar, temperature=1.0, seed=seed)
            assert_valid(text, reason)
        # Penalties and logprobs compose with the mask.
        _, text, reason = await run(engine, grammar, repetition_penalty=1.3, logprobs=2)
        assert_valid(text, reason)
        with pytest.raises(InvalidGrammar, match="grammar"):
            engine.submit(GenerationRequest("bad", PROMPT, SamplingParams(), 4, grammar="start: x"))


class NearOracle(HalfOracle):
    """Proposes the constrained greedy output for half of each block, then other ids: some
    the grammar refuses (the block is cut there), some it allows and the target rejects."""

    vocab = 512  # the tiny model's


@pytest.mark.parametrize("draft", ["dflash", "near-oracle", "ngram"])
async def test_greedy_speculative_equals_plain(tiny, plain, draft: str) -> None:
    kw: dict = {"lookup_drafts": True} if draft == "ngram" else {"draft": tiny[1]}
    if draft == "near-oracle":
        NearOracle.script = PROMPT + plain
        kw["proposer_cls"] = NearOracle
    async with engine_for(tiny[0], block_size=4, **kw) as engine:
        grammar = json_schema_grammar(SCHEMA)
        tokens, text, reason = await run(engine, grammar)
        assert tokens == plain
        assert_valid(text, reason)
        if draft == "near-oracle":
            spec = engine.last_spec
            assert 0 < spec["accepted_tokens"] < spec["draft_tokens"]
        else:  # the oracle drafts no sampled q; the others stay inside the grammar sampled
            _, text, reason = await run(engine, grammar, temperature=1.0, seed=3)
            assert_valid(text, reason)


async def test_grammar_steps_batched_with_plain_ones_equal_each_alone(tiny, plain) -> None:
    """With continuous batching a constrained request steps in the same batch as the
    others, its mask in its own row: its output is plain constrained decoding's, a seeded
    constrained one repeats its own, and the unconstrained neighbour is untouched."""
    grammar = json_schema_grammar(SCHEMA)
    free = GenerationRequest("f", PROMPT[:7], SamplingParams(temperature=0), 40, ignore_eos=True)

    async def free_tokens(engine: Engine) -> list[int]:
        return [t async for d in engine.submit(free) for t in d.token_ids]

    async with engine_for(tiny[0]) as engine:
        seeded = await run(engine, grammar, temperature=1.0, seed=5)
        alone = await free_tokens(engine)
    async with engine_for(tiny[0], max_running=3) as engine:
        got = await asyncio.gather(
            run(engine, grammar),
            run(engine, grammar, temperature=1.0, seed=5),
            free_tokens(engine),
        )
        assert engine.stepped_sequences > engine.steps + MAX_TOKENS // 4
    assert got[0][0] == plain and got[1] == seeded and got[2] == alone
    assert_valid(got[1][1], got[1][2])
