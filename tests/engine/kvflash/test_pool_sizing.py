"""`--kv-flash TOKENS|auto` -> pool rows, and the plan fields of the forward frame."""

from __future__ import annotations

from pathlib import Path

import pytest

from luced.engine.kvflash.transport import (
    KVFlashSettings,
    kv_layer_shapes,
    model_bytes_per_token,
    resolve_pool,
)
from luced.gguf_file import GGUFFile
from luced.ipc.frames import FrameError, Load, Span
from luced.ipc.regions import Region
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
        (2000, 1000, 1024),  # the context rounded up to a chunk
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


def region(shape: tuple[int, ...], dtype: str) -> Region:
    return Region("/luced-x-kvflash", 64, shape, dtype)


def test_forward_plan_fields_are_checked() -> None:
    def span(**plan: Region) -> Span:
        return Span(sequence=0, start=0, n=4, kv_plan=plan)

    span(kv_slots=region((4,), "int64"), kv_map=region((512,), "int64"))
    with pytest.raises(FrameError, match="together"):
        span(kv_slots=region((4,), "int64"))
    with pytest.raises(FrameError, match="kv_slots must be int64"):
        span(kv_slots=region((3,), "int64"), kv_map=region((512,), "int64"))
    with pytest.raises(FrameError, match="kv_map"):
        span(kv_slots=region((4,), "int64"), kv_map=region((500,), "int64"))
    with pytest.raises(FrameError, match="kv_moves needs"):
        span(
            kv_slots=region((4,), "int64"),
            kv_map=region((512,), "int64"),
            kv_moves=region((1, 4), "int64"),
        )
    with pytest.raises(FrameError, match="kv_pool"):
        Load(
            model="m",
            layers=(0, 1),
            dtype="float32",
            devices=("cpu",),
            kv_capacity=512,
            owns_embed=True,
            owns_head=True,
            kv_pool=100,
        )
