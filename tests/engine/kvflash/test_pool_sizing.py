"""`--kv-flash TOKENS|auto` -> pool rows, and the target's block pool under KV Flash."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from luced.engine.kv.pager import PagerConfig
from luced.engine.kvflash.transport import (
    KVFlashSettings,
    kv_layer_shapes,
    model_bytes_per_token,
    resolve_pool,
)
from luced.engine.target import Target, TargetPlacement
from luced.gguf_file import GGUFFile
from luced.ipc.shm import ShmOwner
from luced.runtime.model import Model
from luced.runtime.tiny import FAMILIES, make_tiny_gguf

MIB = 2**20


@pytest.mark.parametrize(
    ("pool", "context", "want"),
    [
        (512, 8192, 512),
        (500, 8192, 512),  # rounded up to 256
        (1000, 8192, 1024),
        (9000, 8192, 8192),  # clamped to the context
        (300, 1000, 512),
        (2000, 1000, 1024),  # the context rounded up to a block
    ],
)
def test_tokens_round_up_and_clamp(pool: int, context: int, want: int) -> None:
    assert resolve_pool(KVFlashSettings(pool), context, 46080) == want


def test_auto_sizes_from_free_memory_with_a_cap() -> None:
    auto = KVFlashSettings("auto", max_pool=16384)
    per_token = 46080  # SmolLM2-135M f32
    # Half of 100 MiB / 45 KiB = 1137 tokens -> 1280.
    assert resolve_pool(auto, 8192, per_token, free_bytes=100 * MIB) == 1280
    assert resolve_pool(auto, 8192, per_token, free_bytes=64 << 30) == 8192  # the context
    assert resolve_pool(auto, 32768, per_token, free_bytes=64 << 30) == 16384  # the cap
    with pytest.raises(ValueError, match="positive"):
        KVFlashSettings(0)


@pytest.mark.parametrize("family", FAMILIES)
def test_bytes_per_token_is_what_the_workers_allocate(family: str, tmp_path: Path) -> None:
    # The daemon's header-only count against the runtime's own pool: per-layer head
    # counts (laguna's query heads, gemma4's KV heads), gemma4's two head dims and its
    # KV-sharing layers (no rows), qwen35's DeltaNet layers (a state, no rows).
    path = tmp_path / f"{family}.gguf"
    make_tiny_gguf(family, path, seed=1)
    model = Model.load(path)
    pool = model.new_block_pool(block=1)
    tensors = (*pool.k.values(), *pool.v.values())
    per_row = sum(t.nbytes for t in tensors) // (pool.n_blocks + 1)  # and its scratch block
    assert model_bytes_per_token(GGUFFile(path), model.kv_dtype.itemsize) == per_row
    assert kv_layer_shapes(GGUFFile(path)) == pool.shapes


def test_the_block_pool_holds_each_running_quota_and_the_kept_prompts(tmp_path: Path) -> None:
    """Under KV Flash every running slot keeps at most its quota resident (and may page a
    whole context out to the host records); lanes past them keep finished prompts, whose
    paged-out blocks keep their host records (a context per running slot, and the kept
    resident positions paged out)."""
    path = make_tiny_gguf("llama", tmp_path / "llama.gguf", seed=1).path
    placement = TargetPlacement.split(
        model=str(path),
        n_layers=2,
        dtype="float32",
        kv_capacity=1000,
        max_batch_tokens=64,
        devices=("cpu",),
    )
    cfg = PagerConfig(pool_tokens=512)  # 8 blocks of 64
    with ShmOwner() as owner:
        target = Target(owner, placement, kv_flash=cfg, sequences=3)
        assert target.placement.kv_block == 64  # KV Flash pages the pool's own blocks
        assert target.blocks is not None
        assert (target.blocks.n_blocks, target.blocks.records) == (3 * 9, 3 * 16)
        target.size_blocks(3000, 3 + 64, kept=1000)  # kept lanes: 16 blocks + 2 per lane
        assert target.blocks.n_blocks == 3 * 9 + 16 + 2 * 64
        # the kept lanes' records: a context per running slot and their resident share
        assert target.blocks.records == 3 * 16 + 3 * 16 + 16
        with pytest.raises(ValueError, match="KV Flash pages blocks of 64 rows, not the"):
            Target(owner, dataclasses.replace(placement, kv_block=16), kv_flash=cfg)
