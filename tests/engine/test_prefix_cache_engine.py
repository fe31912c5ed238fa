"""The prefix cache through the real Engine and Target (worker subprocesses, the
daemon-owned arena, kv_export / kv_import frames): restore-then-generate == fresh.

For each target (tiny llama / qwen3 / gemma3, both bundled real models), placement
(unsplit, 2-worker split) and decoding (plain, DFlash with a random draft), one engine
with a prefix cache serves a prompt, then prompts that share all of it or part of it,
and a fresh engine without a cache serves the same prompts: the greedy tokens must be
identical, and the cached engine must report the restored prompt tokens.
"""

from __future__ import annotations

from pathlib import Path

import make_tiny_draft
import make_tiny_gguf
import pytest
from engine_harness import engine_for

from luced.engine.core import Engine, GenerationRequest
from luced.gguf_file import GGUFFile
from luced.sampling_params import SamplingParams
from luced.text.tokenizer import Tokenizer

pytestmark = pytest.mark.asyncio(loop_scope="module")

N = 12  # tokens generated per request


def engine_with(path: Path, devices, draft: Path | None, cache: bool):
    return engine_for(
        path,
        devices,
        draft=draft,
        context=1024,
        block_size=4,
        prefix_cache_bytes=(64 << 20) if cache else 0,
    )


async def run(engine: Engine, prompt: list[int]) -> tuple[list[int], int]:
    req = GenerationRequest("r", prompt, SamplingParams(temperature=0), N, ignore_eos=True)
    handle = engine.submit(req)
    tokens = [t async for delta in handle for t in delta.token_ids]
    assert handle.finish_reason == "length", handle.error
    return tokens, handle.cached_tokens


def prompts(vocab: int) -> list[list[int]]:
    """A first prompt; one extending it (a second chat turn); one sharing only its first
    part (another question after the same system prompt); the first again (all but the
    last token restored)."""
    first = [(7 * i + 3) % vocab for i in range(150)]
    turn2 = first + [(11 * i + 5) % vocab for i in range(40)]
    branch = first[:90] + [(13 * i + 1) % vocab for i in range(30)]
    return [first, turn2, branch, first]


async def check_restore_equals_fresh(
    path: Path, devices, draft: Path | None, exact_cut: bool = False
) -> None:
    """exact_cut (a hybrid): a snapshot restores only at its end, so of the prompts only
    the second turn (which extends the whole first prompt) restores anything."""
    vocab = Tokenizer.from_gguf(GGUFFile(path)).vocab_size
    ps = prompts(vocab)
    async with engine_with(path, devices, draft, cache=False) as fresh:
        expected = [(await run(fresh, p))[0] for p in ps]
    async with engine_with(path, devices, draft, cache=True) as cached:
        got = [await run(cached, p) for p in ps]
        stats = cached.prefix_cache.stats()
    assert [tokens for tokens, _ in got] == expected
    if exact_cut:
        assert [n for _, n in got] == [0, 150, 0, 0]
        assert stats.hits == 1 and stats.hit_tokens == 150
        return
    assert [n for _, n in got] == [0, 150, 90, 149]
    assert stats.hits == 3 and stats.hit_tokens == 150 + 90 + 149


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    root = tmp_path_factory.mktemp("prefix")
    out = {}
    for family in ("llama", "qwen3", "gemma3", "qwen35"):
        target = root / f"{family}.gguf"
        extra = {} if family == "gemma3" else {"layers": 8}
        make_tiny_gguf.build(family, target, seed=5, context=1024, **extra)
        _, draft, _ = make_tiny_draft.build(target, root / f"draft-{family}", seed=1)
        out[family] = (target, draft)
    return out


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
@pytest.mark.parametrize("devices", [("cpu",), ("cpu", "cpu:1")], ids=["unsplit", "split"])
async def test_tiny_restore_equals_fresh(tiny, family, devices) -> None:
    await check_restore_equals_fresh(tiny[family][0], devices, None)


@pytest.mark.parametrize("devices", [("cpu",), ("cpu", "cpu:1")], ids=["unsplit", "split"])
async def test_tiny_restore_with_a_draft_equals_fresh(tiny, devices) -> None:
    """DFlash after a restore: the ring's rows come back with the KV, so the draft sees
    the same features and the speculative output (== plain) is unchanged."""
    target, draft = tiny["qwen3"]
    await check_restore_equals_fresh(target, devices, draft)


@pytest.mark.parametrize(
    ("devices", "with_draft"),
    [(("cpu",), False), (("cpu", "cpu:1"), False), (("cpu", "cpu:1"), True)],
    ids=["unsplit", "split", "split+draft"],
)
async def test_hybrid_restore_at_exact_cuts_equals_fresh(tiny, devices, with_draft) -> None:
    """qwen35 (Gated DeltaNet + attention): snapshots carry each recurrent layer's state at
    the prompt's end; a restore there, then plain or speculative decoding, == fresh."""
    target, draft = tiny["qwen35"]
    await check_restore_equals_fresh(target, devices, draft if with_draft else None, True)


@pytest.mark.real_model
@pytest.mark.parametrize(
    ("model", "devices", "with_draft"),
    [
        ("smollm2", ("cpu",), False),
        ("smollm2", ("cpu", "cpu:1"), True),
        ("gemma3", ("cpu", "cpu:1"), False),
    ],
)
async def test_real_models_restore_equals_fresh(
    model, devices, with_draft, request, tmp_path
) -> None:
    target = request.getfixturevalue(f"{model}_gguf")
    draft = None
    if with_draft:
        _, draft, _ = make_tiny_draft.build(target, tmp_path / "draft", seed=2, block_size=4)
    await check_restore_equals_fresh(target, devices, draft)
