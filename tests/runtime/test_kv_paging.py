"""KV Flash over the block pool: a paged cache whose blocks move out to host records and
back (`PagedKVCache.move`: out, in) against the plain `KVCache` as the oracle.

(a) every block resident, scored or not: bit-identical logits; (b) a page out then in,
into another block, is byte-exact and the logits after stay the plain cache's; (c) with
blocks paged out the logits equal a plain cache whose mask hides exactly their positions
(to float rounding: attention runs over the resident keys only), prefill chunks and
decode steps, sliding windows included; (d) the native decode kernel over the gaps equals
SDPA; (e) the `qk` block scores equal cosines computed from a plain cache's keys and the
recorded queries. The test plays the daemon: it hands out the lowest free blocks, and
picks what pages out and into which block.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest
import torch
from kv_oracles import HidingCache, QueryRecorder, block_scores

from luced.runtime import kv_blocks, native_attention
from luced.runtime.families import common
from luced.runtime.kv_blocks import MOVE_IN, MOVE_OUT, PAGED, PagedKVCache
from luced.runtime.kv_cache import KVCache
from luced.runtime.kv_host import HostTier
from luced.runtime.model import Model
from luced.runtime.tiny import make_tiny_gguf

FAMILIES = ("llama", "qwen3", "gemma3", "qwen3moe", "laguna", "qwen35", "qwen35moe", "gemma4")
CAPACITY = 512
BLOCK = 8


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Model]:
    """family -> its tiny float32 model, built once (gemma3 and gemma4: sliding window 8;
    gemma4: KV-sharing layers; qwen35: DeltaNet layers beside the attention ones)."""
    root, models = tmp_path_factory.mktemp("kvpaging"), {}

    def load(family: str) -> Model:
        if family not in models:
            path = make_tiny_gguf(family, root / f"{family}.gguf", seed=5, context=CAPACITY)
            models[family] = Model.load(path.path)
        return models[family]

    return load


class Daemon:
    """The daemon's part for the paged caches of one pool: growth into the lowest free
    blocks, and host records for the blocks it pages out."""

    def __init__(self, model: Model, block: int = BLOCK) -> None:
        self.model = model
        self.pool = model.new_block_pool(block, initial_blocks=4)
        self.host = HostTier(self.pool.block_nbytes())
        self.records: dict[tuple[int, int], int] = {}  # (cache, logical block) -> record
        self.ids = itertools.count()

    def cache(self, scored: bool = False) -> PagedKVCache:
        return self.model.new_paged_cache(self.pool, CAPACITY, scored=scored)

    def free_block(self, above: int = 0) -> int:
        return next(b for b in itertools.count(above) if self.pool.refs(b) == 0)

    def forward(self, cache: PagedKVCache, tokens: torch.Tensor, start: int) -> torch.Tensor:
        while len(cache.table) * self.pool.block < start + len(tokens):
            cache.follow((), (self.free_block(),))
        return self.model.forward(tokens, cache, start)

    def page_out(self, cache: PagedKVCache, j: int) -> None:
        record = next(self.ids)
        cache.move(MOVE_OUT, j, cache.table[j], self.host.record(record))
        self.records[id(cache), j] = record

    def page_in(self, cache: PagedKVCache, j: int, block: int) -> None:
        cache.move(MOVE_IN, j, block, self.host.record(self.records.pop((id(cache), j))))


def plain_cache(model: Model, cls: type[KVCache] = KVCache) -> KVCache:
    cfg = model.cfg
    return cls(
        model.layers,
        cfg.n_kv_heads,
        cfg.head_dim,
        CAPACITY,
        model.kv_dtype,
        shapes={i: cfg.kv_shape(i) for i in model.layers},
        sources={i: s for i in model.layers if (s := cfg.kv_source(i)) != i},
        recurrent=model._recurrent_shapes(),
        state_dtype=model.dtype,
    )


def token_ids(model: Model, n: int, seed: int) -> torch.Tensor:
    return torch.randint(3, model.cfg.vocab, (n,), generator=torch.Generator().manual_seed(seed))


def rows_of(cache, n: int) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    out = {}
    for i in cache.stored:
        h, d = cache.shapes[i]
        k, v = torch.empty(h, n, d, dtype=cache.dtype), torch.empty(h, n, d, dtype=cache.dtype)
        cache.export_rows(i, n, k, v)
        out[i] = (k, v)
    return out


def hidden_positions(cache: PagedKVCache) -> frozenset[int]:
    b = cache.pool.block
    return frozenset(
        p for j, blk in enumerate(cache.table) if blk == PAGED for p in range(j * b, j * b + b)
    )


# Prefill chunks and decode steps: (start, n)
STEPS = [(0, 30), (30, 26)] + [(p, 1) for p in range(56, 60)] + [(60, 5), (65, 1)]


@pytest.mark.parametrize("scored", [False, True], ids=["plain", "scored"])
@pytest.mark.parametrize("family", FAMILIES)
def test_every_block_resident_equals_plain(tiny, family: str, scored: bool) -> None:
    """Prefill chunks, decode steps (the native kernel through the row map, or store then
    read for a scored cache), a verify block: bit for bit the plain cache's logits."""
    model = tiny(family)
    daemon = Daemon(model)
    first, second = daemon.cache(), daemon.cache()
    for other in (first, second):
        daemon.forward(other, token_ids(model, 9, seed=0), 0)
    first.free()  # the sequence's blocks: 0, 1, 4, 5, ...: its rows are gathered
    cache, plain = daemon.cache(scored), plain_cache(model)
    assert (cache.observes_queries, cache.writes_in_place) == (scored, not scored)
    tokens = token_ids(model, 70, seed=1)
    for start, n in STEPS:
        got = daemon.forward(cache, tokens[start : start + n], start)
        want = model.forward(tokens[start : start + n], plain, start)
        assert torch.equal(got, want), (start, n)
    assert cache.table[:3] == [0, 1, 4]


@pytest.mark.parametrize("family", FAMILIES)
def test_page_out_then_in_is_byte_exact_and_continues_as_plain(tiny, family: str) -> None:
    model = tiny(family)
    daemon = Daemon(model)
    pool = daemon.pool
    cache, plain = daemon.cache(scored=True), plain_cache(model)
    tokens = token_ids(model, 50, seed=2)
    daemon.forward(cache, tokens[:40], 0)
    model.forward(tokens[:40], plain, 0)
    before = rows_of(cache, 40)
    block = cache.table[1]
    daemon.page_out(cache, 1)
    assert cache.table[1] == PAGED and pool.refs(block) == 0 and cache.paged_blocks == 1
    record = daemon.host.record(daemon.records[id(cache), 1])
    first = cache.stored[0]
    k_rows = pool.k[first][:, block * BLOCK : (block + 1) * BLOCK].contiguous()
    assert torch.equal(record[: k_rows.numel() * 4], k_rows.view(torch.uint8).flatten())
    assert record.numel() == cache.record.nbytes == pool.block_nbytes()
    target = daemon.free_block(above=pool.n_blocks)  # another block, past the tensors: grows
    daemon.page_in(cache, 1, target)
    assert cache.table[1] == target != block and cache.paged_blocks == 0
    after = rows_of(cache, 40)
    for i, (k, v) in before.items():
        assert torch.equal(after[i][0].view(torch.uint8), k.view(torch.uint8))
        assert torch.equal(after[i][1].view(torch.uint8), v.view(torch.uint8))
    for start, n in [(40, 3), (43, 1), (44, 1), (45, 5)]:
        got = daemon.forward(cache, tokens[start : start + n], start)
        want = model.forward(tokens[start : start + n], plain, start)
        assert torch.equal(got, want), (start, n)


@pytest.mark.parametrize("family", FAMILIES)
def test_with_blocks_paged_out_logits_equal_a_plain_cache_hiding_them(tiny, family) -> None:
    """Blocks page out between steps (and one comes back): every later step, a prefill
    chunk or a decode token, equals the plain cache that hides exactly the paged-out
    positions; the sliding layers keep their window over the positions."""
    model = tiny(family)
    daemon = Daemon(model)
    cache, plain = daemon.cache(), plain_cache(model, HidingCache)
    tokens = token_ids(model, 120, seed=3)
    schedule = {40: [("out", 1), ("out", 3)], 60: [("out", 5)], 70: [("in", 3)], 80: [("out", 0)]}
    start = 0
    for n in [24, 16, 9, 1, 1, 9, 1, 1, 1, 7, 1, 1, 8, 1, 1, 1]:
        for kind, j in schedule.get(start, []):
            if kind == "out":
                daemon.page_out(cache, j)
            else:
                daemon.page_in(cache, j, daemon.free_block())
        plain.visible = frozenset(range(start + n)) - hidden_positions(cache)
        got = daemon.forward(cache, tokens[start : start + n], start)
        want = model.forward(tokens[start : start + n], plain, start)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        assert torch.equal(got.argmax(-1), want.argmax(-1)), start
        start += n
    assert cache.table[0] == cache.table[1] == cache.table[5] == PAGED != cache.table[3]


@pytest.mark.parametrize("family", ["llama", "gemma4"])  # head dims of 16: the kernel's
def test_the_native_decode_kernel_over_gaps_equals_sdpa(tiny, monkeypatch, family) -> None:
    """Decode steps over paged-out blocks through the native kernel (the resident rows
    listed with their positions) against the same steps on SDPA over the gathered rows."""
    model = tiny(family)
    daemon = Daemon(model)
    cache = daemon.cache()
    tokens = token_ids(model, 40, seed=4)
    daemon.forward(cache, tokens[:32], 0)
    daemon.page_out(cache, 1)
    daemon.page_out(cache, 2)
    cache.follow((), (daemon.free_block(),))
    cache.reserve(32, 1)
    storage = cache.decode_storage(cache.stored[0])
    assert storage.positions is not None and storage.readable
    assert storage.positions.tolist() == [*range(8), *range(24, 33)]
    assert native_attention.supported(torch.zeros(1, 2, 16), [storage])
    calls = []
    native = native_attention.decode_attention

    def counted(*args, **kw):
        calls.append(args[2][0].positions is not None)  # the storage of the gaps
        return native(*args, **kw)

    monkeypatch.setattr(native_attention, "decode_attention", counted)
    got = [daemon.forward(cache, tokens[p : p + 1], p) for p in range(32, 36)]
    assert calls and all(calls), "the native kernel read the gaps"
    cache.truncate(32)
    monkeypatch.setattr(common, "_native_decode", lambda *a: None)  # SDPA
    calls.clear()
    want = [daemon.forward(cache, tokens[p : p + 1], p) for p in range(32, 36)]
    assert not calls
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
        assert torch.equal(a.argmax(-1), b.argmax(-1))


@pytest.mark.parametrize("family", FAMILIES)
def test_qk_scores_equal_cosines_of_the_plain_caches_keys(tiny, family: str) -> None:
    model = tiny(family)
    daemon = Daemon(model, block=16)
    ids = token_ids(model, 330, seed=5)
    plain = plain_cache(model, QueryRecorder)
    plain.queries = {}
    cache = daemon.cache(scored=True)
    for start, n in ((0, 100), (100, 100), (200, 100), (300, 29), (329, 1)):
        model.forward(ids[start : start + n], plain, start)
        daemon.forward(cache, ids[start : start + n], start)
        if start + n == 300 and cache.recurrent is not None:
            cache.save_state()  # so that the truncate below may come back here
        if start == 100:
            daemon.page_out(cache, 2)  # the keys stay: the block's rows did not change
            daemon.page_in(cache, 2, daemon.free_block(above=30))
    assert plain.queries, "every family has full-attention layers"
    want = block_scores(plain, 16, 330 // 16)  # sealed blocks; the head block 20 is not
    out = torch.full((2, 24), 7.0)
    kv_blocks.write_scores([cache], out)
    assert out[1].nonzero().squeeze(1).tolist() == list(want)
    assert out[:, len(want) :].eq(0).all()
    for c, score in want.items():
        assert abs(float(out[0, c] / out[1, c]) - score) < 1e-5
    # A rollback into block 18 unseals it (a rejected draft's rows are not its keys).
    cache.truncate(300)
    kv_blocks.write_scores([cache], out)
    assert out[1].nonzero().squeeze(1).tolist() == list(range(18))
    # An import seals its complete blocks (keys of the same rows).
    keys = {i: k.clone() for i, k in cache.qk.keys.items()}
    if cache.recurrent is None:
        restored = daemon.cache(scored=True)
        restored.import_rows(
            300, rows_of(cache, 300), None, [daemon.free_block(above=60 + i) for i in range(19)]
        )
        assert restored.qk.sealed.nonzero().squeeze(1).tolist() == list(range(18))
        for i, k in keys.items():
            torch.testing.assert_close(restored.qk.keys[i][:18], k[:18])
    with pytest.raises(ValueError, match="keeps no block keys"):
        kv_blocks.write_scores([daemon.cache()], out)


def test_out_of_step_moves_and_paged_blocks_are_refused(tiny) -> None:
    """Each refusal names what is wrong and changes nothing: a move out of a block the
    table does not hold there; a move into a resident entry or into a
    held block; a record of the wrong size; a write or an export of a paged-out block.
    Releases drop the paged-out entries (their records are the daemon's)."""
    model = tiny("llama")
    daemon = Daemon(model)
    pool = daemon.pool
    a, b = daemon.cache(), daemon.cache()
    daemon.forward(a, token_ids(model, 30, seed=6), 0)
    assert a.table == [0, 1, 2, 3]
    record = daemon.host.record(99)
    with pytest.raises(
        ValueError, match="move out of logical block 1 from block 2: the table has 1"
    ):
        a.move(MOVE_OUT, 1, 2, record)
    b.share(a, 16)
    b.move(MOVE_OUT, 0, 0, daemon.host.record(98))  # shared: the block stays with `a`
    assert (b.table[0], a.table[0], pool.refs(0)) == (PAGED, 0, 1)
    with pytest.raises(ValueError, match="a host record is uint8"):
        a.move(MOVE_OUT, 2, 2, record[:-1])
    with pytest.raises(ValueError, match="move into logical block 2: the table has 2"):
        a.move(MOVE_IN, 2, 5, record)
    assert (a.table, pool.used_blocks) == ([0, 1, 2, 3], 4)
    daemon.page_out(a, 2)
    with pytest.raises(
        ValueError,
        match="move out of logical block 2 from block 2: the table has a paged-out block",
    ):
        a.move(MOVE_OUT, 2, 2, record)
    with pytest.raises(ValueError, match="block 3 is held already"):
        a.move(MOVE_IN, 2, 3, record)
    with pytest.raises(ValueError, match="unknown move kind 7"):
        a.move(7, 2, 5, record)
    assert (a.table, pool.used_blocks) == ([0, 1, PAGED, 3], 3)
    with pytest.raises(ValueError, match=r"would write paged-out blocks \[2\]"):
        a.reserve(20, 1)
    with pytest.raises(
        ValueError, match=r"cannot export positions \[0, 20\): logical blocks \[2\]"
    ):
        rows_of(a, 20)
    rows_of(a, 16)  # below the paged-out block
    size = pool.block_nbytes()
    assert a.nbytes() == size + size // 2 + size  # 1 shared with b; 0 (b paged it out), 3
    a.truncate(8)
    a.release_past(8)  # drops the paged-out entry and releases blocks 1 and 3
    assert a.table == [0] and pool.used_blocks == 2  # 0 and 1, b's
    daemon.page_out(b, 1)
    b.free()
    assert b.table == [] and pool.used_blocks == 1


@pytest.mark.parametrize("family", ["llama", "gemma4"])
def test_a_share_takes_paged_out_entries_and_pages_them_in_byte_exact(tiny, family) -> None:
    """A share of a table with PAGED entries (a kept prompt's): the sharer takes them as
    they are (their block keys from the source), pages each in from the source's record,
    which stays for the source, byte for byte; then it continues as a cache that held
    those rows all along."""
    model = tiny(family)
    daemon = Daemon(model)
    a = daemon.cache(scored=True)
    tokens = token_ids(model, 48, seed=9)
    daemon.forward(a, tokens[:40], 0)
    before = rows_of(a, 40)
    keys = {i: k[:4].clone() for i, k in a.qk.keys.items()}
    daemon.page_out(a, 1)
    daemon.page_out(a, 3)
    records = {j: daemon.host.record(daemon.records[id(a), j]) for j in (1, 3)}
    b = daemon.cache(scored=True)
    assert b.share(a, 36) == 36  # logical blocks 0..4, the last one partly
    assert b.table == [a.table[0], PAGED, a.table[2], PAGED, a.table[4]] == [0, PAGED, 2, PAGED, 4]
    assert (b.paged_blocks, daemon.pool.refs(0), daemon.pool.refs(4)) == (2, 2, 2)
    assert b.qk.sealed.nonzero().squeeze(1).tolist() == [0, 1, 2, 3]  # 4 is incomplete
    for i, k in keys.items():
        assert torch.equal(b.qk.keys[i][:4], k)
    b.move(MOVE_IN, 1, 1, records[1])  # the record stays for `a`, which pages its own copy in
    b.move(MOVE_IN, 3, 3, records[3])
    a.move(MOVE_IN, 1, 5, records[1])
    a.move(MOVE_IN, 3, 6, records[3])
    for cache, n in ((a, 40), (b, 36)):
        for i, (k, v) in rows_of(cache, n).items():
            assert torch.equal(k.view(torch.uint8), before[i][0][:, :n].view(torch.uint8))
            assert torch.equal(v.view(torch.uint8), before[i][1][:, :n].view(torch.uint8))
    b.follow(((4, 4, 7),), ())  # the daemon's copy-on-write of the shared partial block
    plain = plain_cache(model)
    model.forward(tokens[:40], plain, 0)
    plain.truncate(36)
    for start, n in [(36, 5), (41, 1), (42, 6)]:
        got = daemon.forward(b, tokens[start : start + n], start)
        want = model.forward(tokens[start : start + n], plain, start)
        assert torch.equal(got, want), start


def test_a_step_checks_its_moves_with_the_pool_its_earlier_spans_leave(tiny) -> None:
    """`check_follow` with a step's `refs`: a block paged out by one span may be taken by
    the next span's growth, and a block two spans take is refused at the second."""
    model = tiny("llama")
    daemon = Daemon(model)
    a, b = daemon.cache(), daemon.cache()
    daemon.forward(a, token_ids(model, 16, seed=7), 0)
    daemon.forward(b, token_ids(model, 8, seed=8), 0)
    assert (a.table, b.table) == ([0, 1], [2])
    refs: dict[int, int] = {}
    a.check_follow((), (3,), 3, [(0, 1, 1, 0)], refs)  # block 1 out, block 3 new
    assert refs == {1: 0, 3: 1}
    with pytest.raises(ValueError, match="block 3 is held already"):
        b.check_follow((), (3,), 2, (), dict(refs))
    b.check_follow((), (1,), 2, (), refs)  # the block a's span paged out
    with pytest.raises(ValueError, match="move into logical block 0: the table has 2"):
        b.check_follow((), (), 1, [(1, 0, 4, 0)], {})
    assert (a.table, b.table, daemon.pool.used_blocks) == ([0, 1], [2], 3)  # nothing moved
