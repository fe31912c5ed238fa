"""KV cache: rollback by truncation equals recomputing from scratch; bounds are enforced."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from luced.runtime.kv_cache import ContextOverflow, KVCache
from luced.runtime.model import Model


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf: Path) -> Model:
    return Model.load(smollm2_gguf)


def test_truncate_then_continue_equals_fresh(smollm2: Model) -> None:
    prompt = torch.tensor([1, 504, 3575, 282, 4649, 314, 253, 2240, 338])
    rejected = torch.tensor([900, 901, 902, 903])  # a "draft" the target rejects
    accepted = torch.tensor([553, 719, 253])

    cache = smollm2.new_cache(64)
    smollm2.forward(prompt, cache, 0)
    smollm2.forward(rejected, cache, len(prompt))
    cache.truncate(len(prompt))
    after_rollback = smollm2.forward(accepted, cache, len(prompt))

    fresh_cache = smollm2.new_cache(64)
    fresh = smollm2.forward(torch.cat([prompt, accepted]), fresh_cache, 0)[len(prompt) :]
    torch.testing.assert_close(after_rollback, fresh, rtol=1e-5, atol=1e-4)
    assert cache.pos == fresh_cache.pos == len(prompt) + len(accepted)


def test_cache_growth_keeps_contents(smollm2: Model) -> None:
    ids = torch.arange(10, 310)
    small = KVCache(smollm2.layers, 3, 64, capacity=400, dtype=torch.float32, initial=16)
    big = KVCache(smollm2.layers, 3, 64, capacity=400, dtype=torch.float32, initial=400)
    for cache in (small, big):
        for start in range(0, 300, 50):  # six chunks: the small cache grows several times
            smollm2.forward(ids[start : start + 50], cache, start)
    for layer in smollm2.layers:
        torch.testing.assert_close(small.k[layer][:, :300], big.k[layer][:, :300])


def test_bounds(smollm2: Model) -> None:
    cache = smollm2.new_cache(8)
    smollm2.forward(torch.arange(5), cache, 0)
    with pytest.raises(ContextOverflow, match="exceeds the KV capacity 8"):
        smollm2.forward(torch.arange(4), cache, 5)
    with pytest.raises(ValueError, match="would leave a gap"):
        smollm2.forward(torch.arange(1), cache, 7)
    with pytest.raises(ValueError, match="cannot truncate to 6"):
        cache.truncate(6)


def test_per_layer_kv_heads() -> None:
    """Layers may hold different KV head counts; rows move in and out per layer's shape."""
    heads = {2: 1, 3: 4, 4: 2}
    cache = KVCache(range(2, 5), heads, 8, capacity=32, dtype=torch.float32, initial=4)
    for layer, h in heads.items():
        cache.write(layer, 0, torch.randn(3, h, 8), torch.randn(3, h, 8))
    cache.commit(3)
    cache.reserve(3, 10)  # grows every layer to 13 rows, each in its own shape
    assert {i: tuple(cache.k[i].shape) for i in heads} == {
        2: (1, 13, 8),
        3: (4, 13, 8),
        4: (2, 13, 8),
    }
    rows = {}
    for layer, h in heads.items():
        k, v = torch.empty(h, 3, 8), torch.empty(h, 3, 8)
        cache.export_rows(layer, 3, k, v)
        rows[layer] = (k, v)
    fresh = KVCache(range(2, 5), heads, 8, capacity=32, dtype=torch.float32)
    fresh.import_rows(3, rows)
    for layer in heads:
        assert torch.equal(fresh.k[layer][:, :3], cache.k[layer][:, :3])
    rows[3] = rows[4]
    with pytest.raises(ValueError, match=r"layer 3: rows must be \[4, >= 3, 8\], got \[2, 3, 8\]"):
        fresh.import_rows(3, rows)
