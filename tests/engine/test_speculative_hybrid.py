"""DFlash on a hybrid target (qwen35: Gated DeltaNet layers beside attention layers).

A recurrent state cannot be cut inside a verified block: either the verify keeps the
state after each of its positions and the cut selects one (rollback "select"), or the
target rewinds to the block's start (the state the verify replaced) and replays the
accepted tokens ("replay", ``Target.truncate``). Oracles: plain greedy decoding of the
same target, unsplit and split over two workers, both rollbacks; a seeded sampled run
repeats itself. The random draft accepts almost nothing, so nearly every block is
rolled back.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import pytest_asyncio
from engine_harness import engine_for
from test_speculative_loop import PROMPT, N, run

from luced.runtime.tiny import make_tiny_draft, make_tiny_gguf

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("spec-hybrid")
    target = root / "qwen35.gguf"
    make_tiny_gguf("qwen35", target, seed=7, layers=8, context=512)
    _, draft, _ = make_tiny_draft(target, root / "draft", seed=3, block_size=4)
    return target, draft


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def plain(tiny: tuple[Path, Path]) -> list[int]:
    async with engine_for(tiny[0]) as engine:
        assert engine.target.recurrent
        return (await run(engine))[0]


@pytest.mark.parametrize("rollback", ["select", "replay"])
@pytest.mark.parametrize("devices", [("cpu",), ("cpu", "cpu:1")], ids=["unsplit", "split"])
async def test_greedy_speculative_equals_plain(tiny, plain, devices, rollback) -> None:
    async with engine_for(tiny[0], devices, draft=tiny[1]) as engine:
        engine.target.rollback = rollback
        for block in (2, 4, 16):
            engine.block_size = block
            tokens, spec = await run(engine)
            assert tokens == plain, f"block {block}"
            assert spec["drafts"] > 0
        assert (await run(engine, max_tokens=7))[0] == plain[:7]


@pytest.mark.parametrize("rollback", ["select", "replay"])
async def test_sampled_speculative_is_seeded(tiny, rollback) -> None:
    async with engine_for(tiny[0], ("cpu", "cpu:1"), draft=tiny[1], block_size=4) as engine:
        engine.target.rollback = rollback
        a, spec = await run(engine, temperature=0.8, top_k=20, seed=5)
        b, _ = await run(engine, temperature=0.8, top_k=20, seed=5)
        c, _ = await run(engine, temperature=0.8, top_k=20, seed=6)
        assert a == b and a != c and len(a) == N
        assert spec["drafts"] > 0


@pytest.mark.parametrize("devices", [("cpu",), ("cpu", "cpu:1")], ids=["unsplit", "split"])
async def test_truncate_inside_a_verify_selects_the_kept_state(tiny, devices) -> None:
    """rollback "select": a verify keeps the state after each position, so a cut anywhere
    inside it continues like feeding only the kept tokens, with no forward replayed."""
    async with engine_for(tiny[0], devices) as engine:
        target = engine.target
        target.rollback = "select"
        await target.reset()
        await target.prefill(PROMPT, {"temperature": 0}, None)
        start = target.position
        block = [11, 12, 13, 14, 15]
        fresh = await target.logits(block)
        for kept in (1, 3, 4):
            await target.reset()
            await target.prefill(PROMPT, {"temperature": 0}, None)
            await target.verify(block)
            calls = target.last_wall_us
            await target.truncate(start + kept)
            assert target.last_wall_us == calls  # no forward ran
            after = await target.logits([block[kept]])
            # recurrent form here, chunked form in `fresh`: float32 rounding apart
            np.testing.assert_allclose(after[0], fresh[kept], rtol=1e-4, atol=1e-4)
            assert after[0].argmax() == fresh[kept].argmax()


async def test_truncate_inside_the_last_forward_replays(tiny) -> None:
    """Cutting a recurrent target inside its last forward equals feeding only the kept
    tokens; cutting before that forward's start is refused (its state is gone)."""
    async with engine_for(tiny[0]) as engine:
        target = engine.target
        target.rollback = "replay"
        await target.reset()
        await target.prefill(PROMPT, {"temperature": 0}, None)
        start = target.position
        fresh = await target.logits([11, 12])
        await target.truncate(start)
        await target.logits([11, 12, 13, 14])
        await target.truncate(start + 1)
        assert target.position == start + 1
        replayed = await target.logits([12])
        # to float32 rounding: logits up to ~20, the replay's recurrence in another grouping
        np.testing.assert_allclose(replayed[0], fresh[1], rtol=1e-5, atol=1e-4)
        with pytest.raises(ValueError, match="recurrent"):
            await target.truncate(start - 1)
