"""DFlash on a hybrid target (qwen35: Gated DeltaNet layers beside attention layers).

A recurrent state cannot be cut inside a verified block: either the verify keeps the
state after each of its positions and the cut selects one (rollback "select"), or the
target rewinds to the block's start (the state the verify replaced) and replays the
accepted tokens ("replay": the scheduler feeds them again). Oracles: plain greedy decoding of the
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

from luced.engine.driver import Driver
from luced.engine.executor import WorkerReplyError
from luced.runtime.tiny import make_tiny_draft, make_tiny_gguf

pytestmark = pytest.mark.asyncio(loop_scope="module")
GREEDY = {"temperature": 0}


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
            engine.speculation.block_size = block
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
async def test_a_roll_back_inside_a_window_selects_the_kept_state(tiny, devices) -> None:
    """rollback "select": a verify window keeps the state after each position, so the next
    span may start anywhere inside it and continues like feeding only the kept tokens."""
    async with engine_for(tiny[0], devices) as engine:
        target = Driver(engine.target)
        engine.target.rollback = "select"
        await target.prefill(PROMPT, GREEDY)
        start = target.position()
        window = [11, 12, 13, 14, 15]
        fresh = await target.logits(window)
        for kept in (1, 3, 4):
            await target.prefill(PROMPT, GREEDY)
            await target.verify(window)
            target.truncate(start + kept)
            after = await target.logits([window[kept]])
            # recurrent form here, chunked form in `fresh`: float32 rounding apart
            np.testing.assert_allclose(after[0], fresh[kept], rtol=1e-4, atol=1e-4)
            assert after[0].argmax() == fresh[kept].argmax()


async def test_a_recurrent_state_rolls_back_only_where_it_was_kept(tiny) -> None:
    """Without a state per position (rollback "replay"), a recurrent sequence rolls back
    only to its last forward's start, where the state it replaced is kept; the scheduler
    then feeds the kept tokens again (tests/engine/test_scheduler.py). Anywhere else the
    workers refuse, changing nothing."""
    async with engine_for(tiny[0]) as engine:
        target = Driver(engine.target)
        engine.target.rollback = "replay"
        await target.prefill(PROMPT, GREEDY)
        start = target.position()
        fresh = await target.logits([11, 12])
        target.truncate(start)
        await target.logits([11, 12, 13, 14])
        target.truncate(start)  # the last forward's start: kept
        replayed = await target.logits([11, 12])
        np.testing.assert_allclose(replayed, fresh, rtol=1e-5, atol=1e-4)
        target.truncate(start + 1)
        with pytest.raises(WorkerReplyError, match="cannot rewind the recurrent layers"):
            await target.logits([12])
        stats = await target.stats()
        assert [w["kv_position"] for w in stats["workers"]] == [start + 2]  # nothing changed
