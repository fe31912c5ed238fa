"""MoE cold experts through the whole engine (real workers, shared memory): greedy tokens
with half the experts in an expert worker equal the all-local ones, unsplit, with a 2-worker
layer split, and under DFlash verify; the counters show the expert worker answered."""

from __future__ import annotations

from pathlib import Path

import pytest
from engine_harness import engine_for
from test_speculative_loop import run

from luced.runtime.tiny import make_tiny_draft, make_tiny_gguf

pytestmark = pytest.mark.asyncio(loop_scope="module")

HOT = 4  # of 8 experts per layer


@pytest.mark.parametrize("family", ["qwen3moe", "qwen35moe", "laguna"])
async def test_remote_experts_equal_all_local(tmp_path: Path, family: str) -> None:
    target = tmp_path / f"{family}.gguf"
    make_tiny_gguf(family, target, seed=7, context=512, layers=8)
    _, draft, _ = make_tiny_draft(target, tmp_path / "draft", seed=3, block_size=4)
    async with engine_for(target) as engine:
        plain, _ = await run(engine)
    remote = {"moe_hot": HOT, "moe_expert_device": "cpu:2"}
    async with engine_for(target, **remote) as engine:
        tokens, _ = await run(engine)
        totals = engine.target.moe_status()
    assert tokens == plain
    assert totals["remote_calls"] > 0 and totals["fallbacks"] == 0
    async with engine_for(target, ("cpu", "cpu:1"), **remote) as engine:
        tokens, _ = await run(engine)
        assert len(engine.target.executor.slots) == 2
        totals = engine.target.moe_status()
    assert tokens == plain
    assert totals["remote_calls"] > 0 and totals["fallbacks"] == 0
    async with engine_for(target, draft=draft, block_size=4, **remote) as engine:
        tokens, spec = await run(engine)
        totals = engine.target.moe_status()
    assert tokens == plain and spec["drafts"] > 0
    assert totals["remote_calls"] > 0 and totals["fallbacks"] == 0
