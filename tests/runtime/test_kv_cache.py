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


def test_sharing_layers_read_their_source_and_store_nothing() -> None:
    """Gemma 4's layout: per-layer shapes, layers 4 and 5 reading 3 and 2."""
    shapes = {0: (2, 8), 1: (2, 8), 2: (1, 16), 3: (2, 8), 4: (2, 8), 5: (1, 16)}
    cache = KVCache(
        range(6), 2, 8, 32, torch.float32, initial=4, shapes=shapes, sources={4: 3, 5: 2}
    )
    assert cache.stored == (0, 1, 2, 3) and set(cache.k) == {0, 1, 2, 3}
    assert cache.k[2].shape == (1, 4, 16) and cache.v[0].shape == (2, 4, 8)
    k, v = torch.randn(6, 1, 16), torch.randn(6, 1, 16)
    cache.reserve(0, 6)  # grows past `initial`, keeping each layer's shape
    cache.write(2, 0, k, v)
    keys, values = cache.read(5, 6)
    assert keys.data_ptr() == cache.k[2].data_ptr()  # a view of layer 2's rows, no copy
    torch.testing.assert_close(keys, k.transpose(0, 1))
    torch.testing.assert_close(values, v.transpose(0, 1))
    cache.commit(6)
    rows = {i: (cache.k[i], cache.v[i]) for i in cache.stored}
    with pytest.raises(ValueError, match=r"import needs layers \[0, 1, 2, 3\]"):
        cache.import_rows(6, {**rows, 5: rows[2]})
    with pytest.raises(ValueError, match=r"layer 2: rows must be \[1, >= 6, 16\]"):
        cache.import_rows(6, {**rows, 2: rows[0]})
    with pytest.raises(ValueError, match="layer 5 cannot read the KV of layer 2"):
        KVCache(range(3, 6), 2, 8, 32, torch.float32, sources={4: 3, 5: 2})
