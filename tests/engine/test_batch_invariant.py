"""Batch-invariant mode on the bundled SmolLM2 under its served weights (`auto`: Q4_1 layers
on the int4 kernel, the Q8_0 head on int8, bf16 activations): greedy speculative decoding
and a prompt restored from the prefix cache give plain decoding's very logprobs."""

from __future__ import annotations

from pathlib import Path

from engine_harness import engine_for, generate

from luced.text.tokenizer import Tokenizer

# Input-grounded, so prompt lookup proposes and the verify blocks accept; long enough
# (> 64 tokens) that the prefill spans two calls.
TEXT = (
    "Copy this list exactly: apples, pears, plums, cherries, grapes, lemons, limes, figs, "
    "dates, melons, peaches, apricots, oranges, kiwis, mangoes, papayas, guavas, quinces, "
    "olives, berries, currants. Again, the same list: apples, pears, plums,"
)


async def test_speculative_and_restored_equal_plain_bit_for_bit(smollm2_gguf: Path) -> None:
    prompt = Tokenizer.from_gguf(smollm2_gguf).encode(TEXT)
    assert len(prompt) > 64
    common = {"weights": "auto", "batch_invariant": True, "context": 256}
    async with engine_for(smollm2_gguf, prefix_cache_bytes=64 << 20, **common) as engine:
        plain, first, plain_lps = await generate(engine, prompt, 24, logprobs=2)
        again, second, again_lps = await generate(engine, prompt, 24, logprobs=2)
    assert (first.cached_tokens, second.cached_tokens) == (0, len(prompt) - 1)
    assert (again, again_lps) == (plain, plain_lps)
    async with engine_for(smollm2_gguf, lookup_drafts=True, **common) as engine:
        spec, handle, spec_lps = await generate(engine, prompt, 24, logprobs=2)
    assert handle.spec["accepted_tokens"] > 0
    assert (spec, spec_lps) == (plain, plain_lps)


async def test_speculative_equals_plain_bit_for_bit_by_default(smollm2_gguf: Path) -> None:
    """Without the mode too: a verify block (up to 64 tokens) attends query by query, as
    its decode steps do, and the packed kernels take it whole, so greedy speculation gives
    plain decoding's tokens and logprobs. (On the native kernels every call does: the mode
    is for the paths they do not take.)"""
    prompt = Tokenizer.from_gguf(smollm2_gguf).encode(TEXT)
    common = {"weights": "auto", "context": 256}
    async with engine_for(smollm2_gguf, **common) as engine:
        plain, _, plain_lps = await generate(engine, prompt, 24, logprobs=2)
    async with engine_for(smollm2_gguf, lookup_drafts=True, block_size=8, **common) as engine:
        spec, handle, spec_lps = await generate(engine, prompt, 24, logprobs=2)
    assert handle.spec["accepted_tokens"] > 0
    assert (spec, spec_lps) == (plain, plain_lps)
