"""DFlash greedy == plain greedy on every family beyond the ones test_speculative_loop
covers in depth: a tiny random target and a tiny random draft, block 4, unsplit."""

from __future__ import annotations

from pathlib import Path

import pytest
from engine_harness import engine_for
from test_speculative_loop import run

from luced.runtime.tiny import make_tiny_draft, make_tiny_gguf

pytestmark = pytest.mark.asyncio(loop_scope="module")

# Each target deep enough for the draft's three capture layers.
FAMILIES = {
    "gemma4": {},
    "qwen3moe": {"layers": 8},
    "laguna": {"layers": 8},
    "qwen35moe": {"layers": 8},
}


@pytest.mark.parametrize("family", list(FAMILIES))
async def test_greedy_speculative_equals_plain(tmp_path: Path, family: str) -> None:
    target = tmp_path / f"{family}.gguf"
    make_tiny_gguf(family, target, seed=7, context=512, **FAMILIES[family])
    _, draft, _ = make_tiny_draft(target, tmp_path / "draft", seed=3, block_size=4)
    async with engine_for(target) as engine:
        plain, _ = await run(engine)
    async with engine_for(target, draft=draft, block_size=4) as engine:
        tokens, spec = await run(engine)
    assert tokens == plain
    assert spec["drafts"] > 0
