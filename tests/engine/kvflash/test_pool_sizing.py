"""`--kv-flash TOKENS|auto` -> pool rows, and the plan fields of the forward frame."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from luced.engine.kvflash.transport import (
    KVFlashSettings,
    model_bytes_per_token,
    pooled_layers,
    resolve_pool,
)
from luced.gguf_file import GGUFFile
from luced.ipc.frames import Forward, FrameError, Load
from luced.ipc.regions import Region
from luced.runtime.tiny import make_tiny_gguf

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


@pytest.mark.parametrize(
    ("family", "layers", "pooled"),
    [("llama", {"layers": 4}, 4), ("qwen35", {"layers": 8}, 2), ("gemma4", {}, 4)],
)
def test_auto_counts_only_the_layers_with_pool_rows(
    family: str, layers: dict, pooled: int, tmp_path: Path
) -> None:
    # qwen35: layers 3 and 7 attend, the rest keep a DeltaNet state; tiny gemma4: layers
    # 4 and 5 of 6 read the rows of layers 3 and 2.
    path = tmp_path / f"{family}.gguf"
    make_tiny_gguf(family, path, seed=1, **layers)
    gguf = GGUFFile(path)
    assert pooled_layers(gguf) == pooled
    # Per-layer KV head counts (tiny gemma4 stores an array) size by the largest.
    heads = gguf.get(f"{gguf.arch}.attention.head_count_kv")
    assert model_bytes_per_token(gguf, 2) % (2 * pooled * 2 * int(np.max(heads))) == 0


def region(shape: tuple[int, ...], dtype: str) -> Region:
    return Region("/luced-x-kvflash", 64, shape, dtype)


def test_forward_plan_fields_are_checked() -> None:
    base = dict(
        n_tokens=4,
        start_pos=0,
        want="hidden",
        outputs={"hidden": region((4, 8), "float32")},
        tokens=region((4,), "int32"),
    )
    Forward(**base, kv_slots=region((4,), "int64"), kv_map=region((512,), "int64"))
    with pytest.raises(FrameError, match="together"):
        Forward(**base, kv_slots=region((4,), "int64"))
    with pytest.raises(FrameError, match="kv_slots must be int64"):
        Forward(**base, kv_slots=region((3,), "int64"), kv_map=region((512,), "int64"))
    with pytest.raises(FrameError, match="kv_map"):
        Forward(**base, kv_slots=region((4,), "int64"), kv_map=region((500,), "int64"))
    with pytest.raises(FrameError, match="kv_moves needs"):
        Forward(
            **base,
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
