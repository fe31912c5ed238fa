"""KV cache: rollback by truncation equals recomputing from scratch; bounds are enforced;
recurrent layers rewind only to kept states (the previous commit, saved ones, zero)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from luced.runtime.kv_cache import ContextOverflow, KVCache, RecurrentRollback
from luced.runtime.model import Model
from luced.runtime.tiny import make_tiny_gguf


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
    ids = torch.arange(10, 160)
    small = KVCache(smollm2.layers, 3, 64, capacity=400, dtype=torch.float32, initial=16)
    big = KVCache(smollm2.layers, 3, 64, capacity=400, dtype=torch.float32, initial=400)
    for cache in (small, big):
        for start in range(0, 150, 25):  # six chunks: the small cache grows 4 times (to 256)
            smollm2.forward(ids[start : start + 25], cache, start)
    assert small.k[0].shape[1] == 256
    for layer in smollm2.layers:
        torch.testing.assert_close(small.k[layer][:, :150], big.k[layer][:, :150])


def test_decode_steps_across_growth_equal_a_preallocated_cache(smollm2: Model) -> None:
    # Decode steps attend through the cache's `decode_storage`, which it hands out once per
    # layer: after each reallocation the next step must see (and write) the new rows.
    small = KVCache(smollm2.layers, 3, 64, capacity=64, dtype=torch.float32, initial=8)
    big = KVCache(smollm2.layers, 3, 64, capacity=64, dtype=torch.float32, initial=64)
    first = small.decode_storage(0)
    assert small.decode_storage(0) is first
    for pos, token in enumerate(range(100, 120)):  # grows at 8 and at 16
        got = smollm2.forward(torch.tensor([token]), small, pos)
        want = smollm2.forward(torch.tensor([token]), big, pos)
        assert torch.equal(got, want), pos
    assert small.decode_storage(0) is not first
    assert small.decode_storage(0).k is small.k[0] and small.k[0].shape[1] == 32


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
    shapes = {i: (h, 8) for i, h in heads.items()}
    cache = KVCache(range(2, 5), 2, 8, 32, torch.float32, initial=4, shapes=shapes)
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
    fresh = KVCache(range(2, 5), 2, 8, 32, torch.float32, shapes=shapes)
    fresh.import_rows(3, rows)
    for layer in heads:
        assert torch.equal(fresh.k[layer][:, :3], cache.k[layer][:, :3])
    rows[3] = rows[4]
    with pytest.raises(ValueError, match=r"layer 3: rows must be \[4, >= 3, 8\], got \[2, 3, 8\]"):
        fresh.import_rows(3, rows)


# -- recurrent layers (a tiny qwen35: DeltaNet layers 0-2, attention layer 3) -----------------

PROMPT = torch.tensor([5, 9, 200, 31, 7, 400, 12, 13, 64, 99, 3])
DRAFT = torch.tensor([300, 301, 302, 303])
ACCEPTED = torch.tensor([44, 45, 46])


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> Model:
    path = tmp_path_factory.mktemp("hybrid") / "q.gguf"
    return Model.load(make_tiny_gguf("qwen35", path, seed=2, linear_v_heads=4).path)


def fresh_logits(model: Model, *pieces: torch.Tensor) -> torch.Tensor:
    """The last piece's logits after feeding the pieces in order to a new cache (the same
    forwards, so the same chunking of the delta rule: bitwise comparable)."""
    cache, start = model.new_cache(64), 0
    for piece in pieces:
        logits = model.forward(piece, cache, start)
        start += len(piece)
    return logits


def test_undo_of_the_last_forward(hybrid: Model) -> None:
    """Each commit keeps the state it replaced: a rejected draft is undone by truncation,
    by a forward that starts over it, and a failed forward leaves the state as it was."""
    n = len(PROMPT)
    expected = fresh_logits(hybrid, PROMPT, ACCEPTED)
    cache = hybrid.new_cache(64)
    hybrid.forward(PROMPT, cache, 0)
    hybrid.forward(DRAFT, cache, n)
    cache.truncate(n)
    torch.testing.assert_close(hybrid.forward(ACCEPTED, cache, n), expected, rtol=0, atol=0)

    cache.truncate(n)  # the undo state survives a truncation to it...
    hybrid.forward(DRAFT, cache, n)
    # ...and a forward may start over the last one without a truncate
    torch.testing.assert_close(hybrid.forward(ACCEPTED, cache, n), expected, rtol=0, atol=0)


def test_failed_forward_leaves_the_committed_state(
    hybrid: Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    n = len(PROMPT)
    expected = fresh_logits(hybrid, PROMPT, ACCEPTED)
    cache = hybrid.new_cache(64)
    hybrid.forward(PROMPT, cache, 0)
    block = hybrid.family.block

    def fails_in_layer_2(model, layer, x, start, c):
        if layer == 2:
            raise RuntimeError("boom")
        return block(model, layer, x, start, c)

    monkeypatch.setattr(hybrid.family, "block", fails_in_layer_2)
    with pytest.raises(RuntimeError, match="boom"):
        hybrid.forward(DRAFT, cache, n)  # layers 0 and 1 staged new states
    monkeypatch.undo()
    assert cache.pos == n
    cache.truncate(n)  # what the worker does after a failed forward: drops the staged states
    torch.testing.assert_close(hybrid.forward(ACCEPTED, cache, n), expected, rtol=0, atol=0)


def test_truncation_needs_a_kept_state(hybrid: Model) -> None:
    n = len(PROMPT)
    cache = hybrid.new_cache(64)
    hybrid.forward(PROMPT, cache, 0)
    hybrid.forward(DRAFT[:1], cache, n)
    hybrid.forward(DRAFT[1:2], cache, n + 1)
    assert cache.recurrent is not None
    assert cache.recurrent.kept_positions() == [0, n + 1, n + 2]
    before = cache.recurrent_state(0)
    with pytest.raises(
        RecurrentRollback,
        match=rf"from position {n + 2} to {n}: their state is kept only at positions "
        rf"\[0, {n + 1}, {n + 2}\]",
    ):
        cache.truncate(n)
    assert cache.pos == n + 2 and cache.recurrent_state(0) is before  # nothing changed
    with pytest.raises(RecurrentRollback):
        hybrid.forward(ACCEPTED, cache, n)  # a forward over older positions, too
    assert cache.pos == n + 2
    cache.truncate(0)  # the zero state is always kept
    torch.testing.assert_close(
        hybrid.forward(PROMPT, cache, 0), fresh_logits(hybrid, PROMPT), rtol=0, atol=0
    )


def test_saved_state_restores(hybrid: Model) -> None:
    n = len(PROMPT)
    expected = fresh_logits(hybrid, PROMPT, ACCEPTED)
    cache = hybrid.new_cache(64)
    hybrid.forward(PROMPT, cache, 0)
    snap = cache.save_state()
    assert snap.pos == n
    for i, token in enumerate(DRAFT):  # four commits: the undo state alone would be n + 3
        hybrid.forward(token[None], cache, n + i)
    cache.restore_state(snap)
    assert cache.pos == n
    torch.testing.assert_close(hybrid.forward(ACCEPTED, cache, n), expected, rtol=0, atol=0)

    cache.truncate(0)  # a rewind below the snapshot drops it: its rows are to be rewritten
    hybrid.forward(PROMPT[:3], cache, 0)
    with pytest.raises(RecurrentRollback, match=f"snapshot at position {n} is no longer kept"):
        cache.restore_state(snap)

    cache.reset()
    hybrid.forward(PROMPT, cache, 0)
    snap = cache.save_state()
    hybrid.forward(DRAFT, cache, n)
    cache.release_state(snap)
    hybrid.forward(ACCEPTED, cache, n + len(DRAFT))
    with pytest.raises(RecurrentRollback, match=f"snapshot at position {n} is no longer kept"):
        cache.restore_state(snap)


def test_a_tracked_forward_keeps_a_state_per_position(hybrid: Model) -> None:
    """A verify block (`track_positions`, DFlash rollback "select"): the recurrent form keeps
    the state after each token, so a cut anywhere inside the block continues like a fresh
    run of the kept tokens; an untracked forward keeps none, and the next commit drops them."""
    n, d = len(PROMPT), len(DRAFT)
    cache = hybrid.new_cache(64)
    rec = cache.recurrent
    assert rec is not None
    hybrid.forward(PROMPT, cache, 0)
    hybrid.forward(DRAFT, cache, n)
    assert rec.kept_positions() == [0, n, n + d]
    for k in range(1, d):
        cache.reset()
        hybrid.forward(PROMPT, cache, 0)
        rec.track_positions = True
        hybrid.forward(DRAFT, cache, n)
        rec.track_positions = False
        assert rec.kept_positions() == [0, *range(n, n + d + 1)]
        cache.truncate(n + k)
        got = hybrid.forward(ACCEPTED, cache, n + k)
        # the recurrent form inside the block, the chunked one in the oracle: float32 apart
        expected = fresh_logits(hybrid, PROMPT, DRAFT[:k], ACCEPTED)
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
        assert rec.kept_positions() == [0, n + k, n + k + len(ACCEPTED)]


def test_hybrid_cache_refuses_row_imports(hybrid: Model) -> None:
    cache = hybrid.new_cache(16)
    k = torch.zeros(hybrid.cfg.n_kv_heads, 4, hybrid.cfg.head_dim)
    with pytest.raises(ValueError, match=r"layers \[0, 1, 2\] keep a recurrent state"):
        cache.import_rows(4, {3: (k, k)})
    assert cache.nbytes() > 0 and cache.is_recurrent(0) and not cache.is_recurrent(3)


def test_sharing_layers_read_their_source_and_store_nothing() -> None:
    """Gemma 4's KV sharing cut mid-period (transformers allows it): per-layer shapes,
    layers 4 and 5 reading 3 and 2."""
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


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "float16"])
def test_a_half_precision_cache_holds_half_the_bytes_and_close_logits(
    smollm2: Model, smollm2_gguf: Path, kv_dtype: str
) -> None:
    """--kv-dtype: K/V rows in 16 bits under float32 compute; attention runs in them, and
    the logits stay within that rounding of the float32 cache's (greedy picks agree)."""
    half = Model.load(smollm2_gguf, kv_dtype=kv_dtype)
    prompt = torch.tensor([1, 504, 3575, 282, 4649, 314, 253, 2240, 338, 28, 5165, 30])
    full_cache, half_cache = smollm2.new_cache(64), half.new_cache(64)
    want = smollm2.forward(prompt, full_cache, 0)
    got = half.forward(prompt, half_cache, 0)
    for token in [553, 719, 253]:  # decode steps read the cache back
        want = torch.cat([want, smollm2.forward(torch.tensor([token]), full_cache, full_cache.pos)])
        got = torch.cat([got, half.forward(torch.tensor([token]), half_cache, half_cache.pos)])
    assert got.dtype == torch.float32 and half_cache.k[0].dtype == getattr(torch, kv_dtype)
    assert half_cache.nbytes() * 2 == full_cache.nbytes()
    torch.testing.assert_close(got, want, rtol=0, atol=0.3)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    assert not torch.equal(got, want)  # really computed in 16 bits


def test_recurrent_states_keep_the_compute_dtype(tmp_path: Path) -> None:
    tiny = make_tiny_gguf("qwen35", tmp_path / "h.gguf", seed=3).path
    model = Model.load(tiny, kv_dtype="bfloat16")
    cache = model.new_cache(64)
    assert cache.k[cache.stored[0]].dtype == torch.bfloat16
    assert cache.recurrent is not None
    conv, delta = next(iter(cache.recurrent.current.states.values()))
    assert conv.dtype == delta.dtype == torch.float32
    model.forward(torch.arange(3, 20), cache, 0)  # runs with mixed dtypes
