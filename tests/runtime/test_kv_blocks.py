"""Paged K/V in a shared block pool: the paged cache against the plain `KVCache` as the
oracle (bit-identical logits on every attention path: SDPA over gathered rows, the native
decode kernel through the row map, verify blocks, ragged batches), prefix sharing with
copy-on-write against each sequence computed alone, and the pool's exact block ids. The
blocks are the daemon's: every write first follows its tables (engine/kv/blocks.py), as a
forward span brings them to a worker."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from block_lanes import Lanes, forward, forward_batch

from luced.runtime import native_attention
from luced.runtime.kv_blocks import BlockPool, KVPoolFull, PagedKVCache
from luced.runtime.kv_cache import ContextOverflow
from luced.runtime.model import Model
from luced.runtime.tiny import make_tiny_gguf

CAPACITY = 256


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Model]:
    """family -> its tiny model, built once: llama, gemma4 (sliding window 8, two shapes,
    layers 3 and 4 reading the KV of 1, layer 5 that of 2), qwen35 (DeltaNet layers 0-2,
    attention 3)."""
    root, models = tmp_path_factory.mktemp("kvblocks"), {}

    def load(family: str) -> Model:
        if family not in models:
            path = make_tiny_gguf(family, root / f"{family}.gguf", seed=5).path
            models[family] = Model.load(path)
        return models[family]

    return load


def new_pool(model: Model, **kw) -> BlockPool:
    cfg, recurrent = model.cfg, model._recurrent_shapes() or {}
    stored = [i for i in model.layers if cfg.kv_source(i) == i and i not in recurrent]
    return BlockPool({i: cfg.kv_shape(i) for i in stored}, model.kv_dtype, **kw)


def paged(model: Model, pool: BlockPool, capacity: int = CAPACITY) -> PagedKVCache:
    """`Model.new_cache`'s geometry over `pool`."""
    return PagedKVCache(
        pool,
        model.layers,
        capacity,
        sources={i: s for i in model.layers if (s := model.cfg.kv_source(i)) != i},
        recurrent=model._recurrent_shapes(),
        state_dtype=model.dtype,
        row_exact=model.batch_invariant,
    )


def ids(model: Model, n: int, seed: int) -> torch.Tensor:
    return torch.randint(3, model.cfg.vocab, (n,), generator=torch.Generator().manual_seed(seed))


def feed(model: Model, caches: list, tokens: torch.Tensor, start: int) -> list[torch.Tensor]:
    return [forward(model, tokens, c, start) for c in caches]


def test_block_pool_bookkeeping() -> None:
    pool = BlockPool(
        {0: (2, 16), 1: (1, 32)}, torch.float32, block=4, initial_blocks=2, max_blocks=5
    )
    assert pool.k[0].shape == (2, 12, 16) and pool.v[1].shape == (1, 12, 32)  # + scratch
    pool.take(0)
    pool.take(1)
    generation = pool.generation
    pool.k[1][:, 4:8] = 7.0
    pool.take(2)  # past the tensors: they double, keeping the rows
    assert pool.n_blocks == 4 and pool.generation == generation + 1 and pool.scratch == 4
    assert pool.k[1].shape == (1, 20, 32) and bool((pool.k[1][:, 4:8] == 7).all())
    pool.take(4)  # up to the daemon's pool, not past it
    assert pool.n_blocks == 5
    with pytest.raises(ValueError, match="block 1 is held already"):
        pool.take(1)
    with pytest.raises(ValueError, match="block 5 is outside the pool of 5"):
        pool.take(5)
    pool.retain(1)
    pool.release(0)
    pool.release(1)
    assert (pool.refs(0), pool.refs(1), pool.refs(2)) == (0, 1, 1)
    assert (pool.used_blocks, pool.free_blocks, pool.mapped_blocks) == (3, 2, 3)
    with pytest.raises(ValueError, match="block 3 is not held"):
        pool.release(3)
    assert pool.block_nbytes() == 4 * 4 * (2 * 16 + 32) * 2
    assert pool.nbytes() == 6 * pool.block_nbytes()


@pytest.mark.parametrize("scattered", [False, True], ids=["consecutive", "scattered"])
@pytest.mark.parametrize("family", ["llama", "gemma4", "qwen35"])
def test_paged_equals_plain(tiny, family: str, scattered: bool) -> None:
    """A prefill chunk (SDPA over the rows), decode steps (the native kernel writing and
    reading through the row map), a verify block, a rollback and a re-feed: the same
    logits as the plain cache, bit for bit, while the pool grows under them."""
    model = tiny(family)
    lanes = Lanes(model, block=8, initial_blocks=4)
    pool = lanes.pool
    if scattered:  # the sequence's blocks are 1, 3, 4, ...: rows are gathered
        others = [lanes.cache() for _ in range(3)]
        for other in others:
            lanes.write(other, 0, 1)
        lanes.free(others[1])
    cache, plain = lanes.cache(), model.new_cache(CAPACITY)
    tokens = ids(model, 90, seed=1)
    steps = [(0, 70)] + [(p, 1) for p in range(70, 76)] + [(76, 4)]
    for start, n in steps:
        got, want = feed(model, [cache, plain], tokens[start : start + n], start)
        assert torch.equal(got, want), (start, n)
    assert cache.table[:3] == ([1, 3, 4] if scattered else [0, 1, 2])
    layer = cache.stored[-1]
    assert cache.decode_storage(layer).readable  # the native kernel takes it
    assert native_attention.supported(torch.zeros(1, 4, 16), [cache.decode_storage(layer)])
    for c in (cache, plain):
        c.truncate(76)  # the verify block is rejected (qwen35: back to the previous commit)
    assert len(cache.table) == 10  # a roll back keeps the blocks: written again next
    other = ids(model, 6, seed=2)
    got, want = feed(model, [cache, plain], other[:3], 76)
    assert torch.equal(got, want)
    for p in range(79, 82):
        got, want = feed(model, [cache, plain], other[p - 76 : p - 75], p)
        assert torch.equal(got, want), p
    assert pool.n_blocks == 16 and len(cache.table) == 11  # 82 positions in blocks of 8


def test_shared_prefix_and_copy_on_write(tiny) -> None:
    """B shares A's first two blocks; A then rewinds into them and rewrites: A moves to a
    copy, B's rows never change, and both equal their sequences computed alone."""
    model = tiny("llama")
    lanes = Lanes(model, block=16, initial_blocks=8)
    pool = lanes.pool
    a_ids, b_ids = ids(model, 40, seed=3), ids(model, 48, seed=4)
    b_ids[:32] = a_ids[:32]  # a common 32-token prompt prefix
    a, a_alone = lanes.cache(), model.new_cache(64)
    feed(model, [a, a_alone], a_ids[:32], 0)
    feed(model, [a, a_alone], a_ids[32:], 32)
    assert a.table == [0, 1, 2]

    b, b_alone = lanes.cache(), model.new_cache(64)
    assert lanes.share(b, a, 32) == 32 and b.pos == 32
    assert b.table == [0, 1] and [pool.refs(i) for i in range(3)] == [2, 2, 1]
    model.forward(b_ids[:32], b_alone, 0)
    got, want = feed(model, [b, b_alone], b_ids[32:40], 32)
    assert torch.equal(got, want)
    for p in range(40, 44):
        got, want = feed(model, [b, b_alone], b_ids[p : p + 1], p)
        assert torch.equal(got, want), p
    assert b.table == [0, 1, 3]  # its own block from position 32: the shared ones are full
    before = {i: torch.empty(*b.shapes[i][:1], 44, b.shapes[i][1]) for i in b.stored}
    for i, k in before.items():
        b.export_rows(i, 44, k, torch.empty_like(k))

    a_alone.truncate(20)
    lanes.truncate(a, 20)  # the truncate verb
    assert a.table == [0, 1] and pool.refs(2) == 0  # its own block past 20 is released
    rewrite = ids(model, 10, seed=5)
    got, want = feed(model, [a, a_alone], rewrite, 20)
    assert torch.equal(got, want)
    assert a.table == [0, 2] and [pool.refs(i) for i in range(4)] == [2, 1, 1, 1]  # a copy
    for p in range(44, 48):
        got, want = feed(model, [b, b_alone], b_ids[p : p + 1], p)
        assert torch.equal(got, want), p
    for i, k in before.items():
        after = torch.empty_like(k)
        b.export_rows(i, 44, after, torch.empty_like(k))
        assert torch.equal(after, k)
    assert pool.used_blocks == 4
    assert a.nbytes() + b.nbytes() == 4 * pool.block_nbytes()  # block 0 counted half each

    with pytest.raises(ValueError, match="only an empty cache"):
        b.share(a, 16)
    with pytest.raises(ValueError, match="the source holds 30"):
        paged(model, pool).share(a, 31)
    with pytest.raises(ValueError, match="another pool"):
        paged(model, new_pool(model)).share(a, 16)
    lanes.free(a)
    lanes.free(b)
    assert pool.used_blocks == 0 and a.table == b.table == [] and a.pos == b.pos == 0


def test_a_prefix_ending_inside_a_block_shares_it_until_a_write(tiny) -> None:
    """C shares A's first 35 positions: blocks 0 and 1 and the block A holds 32..39 in.
    C's first write (position 35) copies that block; A then writes its next positions into
    its own, unchanged block. Both equal their sequences alone."""
    model = tiny("llama")
    lanes = Lanes(model, block=16, initial_blocks=8)
    pool = lanes.pool
    a_ids, c_ids = ids(model, 44, seed=3), ids(model, 44, seed=9)
    c_ids[:35] = a_ids[:35]
    a, a_alone = lanes.cache(), model.new_cache(64)
    feed(model, [a, a_alone], a_ids[:40], 0)
    c, c_alone = lanes.cache(), model.new_cache(64)
    assert lanes.share(c, a, 35) == 35 and c.table == [0, 1, 2]
    assert [pool.refs(i) for i in range(3)] == [2, 2, 2]
    model.forward(c_ids[:35], c_alone, 0)
    got, want = feed(model, [c, c_alone], c_ids[35:38], 35)  # copies the shared block
    assert torch.equal(got, want)
    assert c.table == [0, 1, 3] and [pool.refs(i) for i in range(4)] == [2, 2, 1, 1]
    for p in range(40, 44):
        got, want = feed(model, [a, a_alone], a_ids[p : p + 1], p)
        assert torch.equal(got, want), p
        got, want = feed(model, [c, c_alone], c_ids[p - 2 : p - 1], p - 2)
        assert torch.equal(got, want), p
    assert a.table == [0, 1, 2] and pool.used_blocks == 4


def test_recurrent_caches_do_not_share(tiny) -> None:
    model = tiny("qwen35")
    lanes = Lanes(model, block=4)
    pool = lanes.pool
    a = lanes.cache()
    forward(model, ids(model, 8, seed=6), a, 0)
    with pytest.raises(ValueError, match="recurrent"):
        paged(model, pool).share(a, 8)
    assert pool.used_blocks == 2


def test_pool_growth_refreshes_decode_storage(tiny) -> None:
    """Two sequences decode in turns, so their blocks interleave, while the pool doubles
    twice: each sequence's steps equal a plain cache's, and its decode Storage is handed
    out once per pool generation."""
    model = tiny("llama")
    lanes = Lanes(model, block=4, initial_blocks=2)
    pool = lanes.pool
    caches = [lanes.cache() for _ in range(2)]
    plains = [model.new_cache(64) for _ in range(2)]
    streams = [ids(model, 24, seed=s) for s in (7, 8)]
    first = caches[0].decode_storage(0)
    assert caches[0].decode_storage(0) is first
    for p in range(24):
        for cache, plain, tokens in zip(caches, plains, streams, strict=True):
            got, want = feed(model, [cache, plain], tokens[p : p + 1], p)
            assert torch.equal(got, want), p
    assert pool.n_blocks == 16 and pool.generation == 4  # 2 -> 4 -> 8 -> 16 blocks
    assert caches[0].table == [0, 2, 4, 6, 8, 10] and caches[1].table == [1, 3, 5, 7, 9, 11]
    storage = caches[0].decode_storage(0)
    assert storage is not first and storage.k is pool.k[0] and storage.rows is caches[0].rows
    assert caches[0].decode_storage(0) is storage
    assert caches[1].rows[:9].tolist() == [4, 5, 6, 7, 12, 13, 14, 15, 20]


def test_a_cache_out_of_step_with_the_daemon_refuses_before_writing(tiny) -> None:
    """The worker follows, and checks: a table length other than the daemon's, a block it
    holds already, a copy of a block the table does not hold, a write past the table or
    into a shared block are refused, and nothing changes."""
    model = tiny("llama")
    lanes = Lanes(model, block=4, n_blocks=8)
    pool = lanes.pool
    a, b = lanes.cache(), lanes.cache()
    forward(model, ids(model, 10, seed=9), a, 0)
    assert a.table == [0, 1, 2]
    with pytest.raises(ValueError, match="holds 3 blocks, \\+ 1 new makes 4; the daemon's holds 5"):
        a.check_follow((), (3,), 5)
    with pytest.raises(ValueError, match="block 2 is held already"):
        b.follow((), (2,))
    with pytest.raises(ValueError, match="copy of logical block 1 from 2: the table has 1"):
        a.follow(((1, 2, 3),), ())
    with pytest.raises(ValueError, match=r"positions \[10, 13\) are past the 3 blocks"):
        model.forward(ids(model, 3, seed=10), a, 10)  # the daemon did not grow it
    assert (a.pos, a.table, pool.used_blocks) == (10, [0, 1, 2], 3)
    lanes.share(b, a, 8)
    with pytest.raises(ValueError, match=r"would write shared blocks \[1\]"):
        a.reserve(6, 2)  # no copy-on-write came first
    forward(model, ids(model, 2, seed=11), a, 6)  # it did now: a copy of block 1
    assert a.table == [0, 3, 2] and [pool.refs(i) for i in range(4)] == [2, 1, 1, 1]
    with pytest.raises(ContextOverflow, match="capacity 16"):
        paged(model, pool, capacity=16).reserve(0, 17)
    with pytest.raises(ContextOverflow, match="5 blocks exceed the KV capacity 16"):
        paged(model, pool, capacity=16).check_follow((), (4, 5, 6, 7, 8), 5)
    assert issubclass(KVPoolFull, ContextOverflow)  # the worker reports it as such


@pytest.mark.parametrize("family", ["llama", "gemma4"])
def test_export_import_round_trip(tiny, family: str) -> None:
    """Rows exported from a paged cache are the plain cache's; imported into a paged cache
    that held other blocks (released first) they continue as the plain import does."""
    model = tiny(family)
    lanes = Lanes(model, block=8, initial_blocks=4)
    pool = lanes.pool
    cache, plain = lanes.cache(), model.new_cache(64)
    other = lanes.cache()
    forward(model, ids(model, 5, seed=12), other, 0)  # interleaves the blocks
    feed(model, [cache, plain], ids(model, 30, seed=13), 0)
    rows = {}
    for i in cache.stored:
        h, d = cache.shapes[i]
        got = torch.empty(h, 32, d), torch.empty(h, 32, d)
        want = torch.empty(h, 32, d), torch.empty(h, 32, d)
        cache.export_rows(i, 30, *got)
        plain.export_rows(i, 30, *want)
        assert torch.equal(got[0][:, :30], want[0][:, :30])
        assert torch.equal(got[1][:, :30], want[1][:, :30])
        rows[i] = got
    used = pool.used_blocks
    restored, plain_restored = lanes.cache(), model.new_cache(64)
    forward(model, ids(model, 12, seed=14), restored, 0)
    with pytest.raises(ValueError, match="30 positions need 4 blocks"):
        restored.import_rows(30, rows, None, (9, 10))
    lanes.import_rows(restored, 30, rows)
    plain_restored.import_rows(30, rows)
    assert restored.pos == 30 and pool.used_blocks == used + 4  # its 2 old blocks released
    tokens = ids(model, 3, seed=15)
    for p in range(30, 33):
        got, want = feed(model, [restored, plain_restored], tokens[p - 30 : p - 29], p)
        assert torch.equal(got, want), p
    with pytest.raises(ValueError, match="cannot export 31 rows"):
        cache.export_rows(cache.stored[0], 31, *rows[cache.stored[0]])


@pytest.mark.parametrize("family", ["llama", "gemma4"])
def test_ragged_batch_of_paged_caches(tiny, family: str) -> None:
    """Two paged caches of one pool (the second sharing the first's prompt prefix) in ragged
    batches: a verify block beside a decode token, two decode tokens, a long prefill chunk
    beside a decode token. The same logits as plain caches in the same batches, bit for
    bit, and each sequence's alone (to the dense matmuls' rounding)."""
    model = tiny(family)
    lanes = Lanes(model, block=16, initial_blocks=2)
    pool = lanes.pool
    a_ids, b_ids = ids(model, 120, seed=16), ids(model, 120, seed=17)
    b_ids[:32] = a_ids[:32]
    a, b = lanes.cache(), lanes.cache()
    plain = [model.new_cache(CAPACITY) for _ in range(2)]
    alone = [Lanes(model, block=16).cache() for _ in range(2)]
    for c in (a, plain[0], alone[0], plain[1], alone[1]):
        forward(model, a_ids[:32], c, 0)
    for c in (a, plain[0], alone[0]):
        forward(model, a_ids[32:37], c, 32)
    assert lanes.share(b, a, 32) == 32
    for c in (b, plain[1], alone[1]):
        forward(model, b_ids[32:44], c, 32)
    pos = [37, 44]
    for sizes in ([6, 1], [1, 1], [1, 70]):
        feeds = [t[p : p + n] for t, p, n in zip((a_ids, b_ids), pos, sizes, strict=True)]
        got = forward_batch(model, feeds, [a, b], pos)
        want = model.forward_batch(feeds, plain, pos)
        single = [forward(model, f, c, p) for f, c, p in zip(feeds, alone, pos, strict=True)]
        for g, w, s in zip(got, want, single, strict=True):
            assert torch.equal(g, w), sizes
            torch.testing.assert_close(g, s, rtol=1e-4, atol=1e-4)
        pos = [p + n for p, n in zip(pos, sizes, strict=True)]
    assert pool.refs(a.table[0]) == pool.refs(a.table[1]) == 2
    lanes.free(a)
    lanes.free(b)
    assert pool.used_blocks == 0


def test_cache_geometry_matches_the_pool(tiny) -> None:
    model = tiny("gemma4")
    cache = paged(model, new_pool(model))
    assert cache.stored == (0, 1, 2) and set(cache.sources) == {3, 4, 5}
    assert cache.k is cache.pool.k and cache.k[2].shape[0] == model.cfg.kv_shape(2)[0]
    with pytest.raises(ValueError, match="the pool stores layers"):
        PagedKVCache(new_pool(model), model.layers, 64)  # no sources: 3 to 5 would store
