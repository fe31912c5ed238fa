"""KV Flash bounds the worker's memory: serving a 4x longer context at the same pool, the
worker's RSS less the host tier (daemon shared memory the worker wrote, so it shows in
its RSS) stays within 10% (the issue's proof; tools/bench_kvflash.py measures it on
SmolLM2). The tiny model has wide K/V (8 layers x 8 heads x 128 dims, 32 KiB a token)
and small weights, so the plain cache's growth would be far outside the bound."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_transport import GREEDY, flash_target

from luced.engine.kvflash.transport import bytes_per_token
from luced.runtime.tiny import make_tiny_gguf

MIB = 2**20
POOL = 512


@pytest.fixture(scope="module")
def wide(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("kvflash-rss") / "wide.gguf"
    make_tiny_gguf("llama", path, seed=1, layers=8, heads=8, kv_heads=8, head_dim=128, context=4096)
    return path


async def rss_less_host(path: Path, context: int) -> int:
    # One thread, 256-token steps: the 4096-token prefill in seconds on a shared box.
    flash = flash_target(
        path, ("cpu",), pool=POOL, context=context, max_batch_tokens=256, threads=1
    )
    async with flash as target:
        prompt = [(7 * i + 3) % 500 + 2 for i in range(context - 4)]
        token = (await target.prefill(prompt, GREEDY)).token
        for _ in range(3):
            token = (await target.step(token, GREEDY)).token
        stats = await target.stats()
        status = target.target.flash_status()
    assert status is not None and stats["kv_bytes"] == POOL * bytes_per_token(8, 8, 128, 4)
    return int(stats["rss_bytes"]) - status["host_bytes"]


async def test_worker_rss_at_4x_the_context_stays_within_10_percent(wide: Path) -> None:
    short = await rss_less_host(wide, 1024)
    long = await rss_less_host(wide, 4096)
    assert long <= 1.10 * short, (short / MIB, long / MIB)
    # Sharp: the plain cache would have grown by the whole context's K/V.
    growth = (4096 - POOL) * bytes_per_token(8, 8, 128, 4)
    assert growth > 0.5 * short
