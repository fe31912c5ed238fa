"""DFlash on a KV Flash pool, through the real Engine and Target: verify writes the
block's proposals into pool slots, and rejected ones are hidden by the slot map (no KV
rollback). A tiny random draft rejects nearly every proposal, which keeps this sharp.

Oracles: with the pool covering the sequence, speculative greedy == plain greedy with the
plain cache; under eviction (lru), speculative greedy == plain greedy with the same pool,
token for token and eviction for eviction (a block never evicts past its first chunk:
`Pager.lookahead`), unsplit and split; the same for a hybrid (qwen35), whose DeltaNet
state is cut by either rollback while its attention layers stay on the pool.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from engine_harness import engine_for
from test_speculative_loop import run

from luced.engine.kvflash import PagerConfig
from luced.runtime.tiny import make_tiny_draft, make_tiny_gguf

pytestmark = pytest.mark.asyncio(loop_scope="module")

LONG = [(13 * i + 5) % 97 + 2 for i in range(560)]


def target_and_draft(tmp_path_factory: pytest.TempPathFactory, family: str) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp(f"spec-pool-{family}")
    target = root / f"{family}.gguf"
    make_tiny_gguf(family, target, seed=7, layers=8, context=1024)
    _, draft, _ = make_tiny_draft(target, root / "draft", seed=3, block_size=4)
    return target, draft


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return target_and_draft(tmp_path_factory, "qwen3")


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return target_and_draft(tmp_path_factory, "qwen35")


async def test_pool_covering_the_sequence_speculative_equals_plain(
    tiny: tuple[Path, Path],
) -> None:
    target, draft = tiny
    async with engine_for(target) as engine:
        plain, _ = await run(engine)
    pool = PagerConfig(pool_tokens=512, policy="lru")
    async with engine_for(target, draft=draft, block_size=4, kv_flash=pool) as engine:
        tokens, spec = await run(engine)
        status = engine.target.flash_status()
    assert tokens == plain
    assert spec["drafts"] > 0 and spec["accepted_tokens"] < spec["draft_tokens"]
    assert status is not None and status["evictions"] == 0


@pytest.mark.parametrize("devices", [("cpu",), ("cpu", "cpu:1")])
async def test_under_eviction_speculative_equals_plain_with_the_same_pool(
    tiny: tuple[Path, Path], devices: tuple[str, ...]
) -> None:
    target, draft = tiny
    pool = PagerConfig(pool_tokens=448, policy="lru")
    async with engine_for(target, devices, context=1024, kv_flash=pool) as engine:
        plain, _ = await run(engine, 70, prompt=LONG)
        plain_status = engine.target.flash_status()
    async with engine_for(
        target, devices, draft=draft, block_size=4, context=1024, kv_flash=pool
    ) as engine:
        tokens, spec = await run(engine, 70, prompt=LONG)
        status = engine.target.flash_status()
    assert tokens == plain
    assert spec["drafts"] > 0
    assert plain_status is not None and status is not None
    assert status["evictions"] == plain_status["evictions"] > 0


@pytest.fixture(scope="module")
def hybrid_plain() -> dict[str, tuple[list[int], dict | None]]:
    """The hybrid's plain run on the pool (tokens, KV Flash status), the same for both
    rollbacks: computed by the first."""
    return {}


@pytest.mark.parametrize("rollback", ["select", "replay"])
async def test_hybrid_under_eviction_speculative_equals_plain_with_the_same_pool(
    hybrid: tuple[Path, Path], hybrid_plain, rollback: str
) -> None:
    # qwen35: the attention layers on the pool, the DeltaNet state cut by the rollback
    # (a kept per-position state, or a rewind to the block's start and a replay).
    target, draft = hybrid
    pool = PagerConfig(pool_tokens=448, policy="lru")
    if not hybrid_plain:
        async with engine_for(target, context=1024, kv_flash=pool) as engine:
            tokens, _ = await run(engine, 40, prompt=LONG)
            hybrid_plain["plain"] = tokens, engine.target.flash_status()
    plain, plain_status = hybrid_plain["plain"]
    async with engine_for(target, draft=draft, block_size=4, context=1024, kv_flash=pool) as engine:
        engine.target.rollback = rollback
        tokens, spec = await run(engine, 40, prompt=LONG)
        status = engine.target.flash_status()
    assert tokens == plain
    assert spec["drafts"] > 0 and spec["accepted_tokens"] < spec["draft_tokens"]
    assert plain_status is not None and status is not None
    assert status["evictions"] == plain_status["evictions"] > 0
