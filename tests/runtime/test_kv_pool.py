"""KV Flash in the worker: the pooled cache against the plain cache, as oracles.

(a) a pool covering the context gives bit-identical logits (attention gathers the pool
rows in position order and runs the plain path's SDPA with the plain mask); (b) the
same holds for a shuffled block order; (c) under eviction the logits equal a plain full
cache whose mask hides exactly the positions the pager reports not resident, step by
step (to float rounding: the pooled SDPA runs over the visible keys only); (d) host-tier
copies are byte-exact; (e) the `qk` scorer's chunk scores equal a direct computation
from a plain cache's keys and queries, and its reselections (with recalls) keep the
eviction oracle exact.
"""

from __future__ import annotations

import random

import pytest
import torch
from kv_oracles import HidingCache, QueryRecorder, chunk_scores

from luced.engine.kvflash import BlockPool, Pager, PagerConfig, StepPlan
from luced.engine.kvflash.pager import UNSCORED
from luced.engine.kvflash.transport import mean_scores
from luced.runtime.kv_pool import (
    HostTier,
    PooledKVCache,
    apply_moves,
    chunk_nbytes,
    page_in,
    page_out,
)
from luced.runtime.model import Model
from luced.runtime.tiny import make_tiny_gguf

FAMILIES = ("llama", "qwen3", "gemma3", "qwen3moe", "laguna", "gemma4", "qwen35", "qwen35moe")
CONTEXT = 1024
# Prefill in three batches, then decode-like steps of mixed sizes (draft blocks among them).
STEPS = [128, 128, 44] + [1, 5, 1, 16, 1, 3, 32] * 6


@pytest.fixture(scope="module", params=FAMILIES)
def model(request, tmp_path_factory) -> Model:
    path = tmp_path_factory.mktemp("tiny") / f"{request.param}.gguf"
    make_tiny_gguf(request.param, path, seed=5, context=CONTEXT)
    return Model.load(path)


def token_ids(n: int, vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def pooled_step(model: Model, cache: PooledKVCache, host: HostTier, plan: StepPlan, ids):
    apply_moves(cache, plan.moves, host)
    held = torch.frombuffer(plan.slot_positions, dtype=torch.int64)
    cache.set_step(plan.start, plan.write_slots, held)
    return model.forward(ids, cache, plan.start)


def run_pooled(model: Model, ids: torch.Tensor, steps: list[int], pager: Pager, scorer=None):
    """Logits per step and, per step, the positions the pager left visible. `scorer(pager,
    cache)` gives the scores of each due reselection (before the next step, as the daemon
    does with the scores of the step that made it due)."""
    cache = model.new_pool_cache(pager.pool.rows, capacity=CONTEXT)
    host = HostTier(chunk_nbytes(cache))
    logits, visible, start = [], [], 0
    for n in steps:
        if scorer is not None and pager.reselect_due():
            pager.reselect(scorer(pager, cache))
        plan = pager.plan(start, n)
        logits.append(pooled_step(model, cache, host, plan, ids[start : start + n]))
        visible.append({p for p in plan.slot_positions if p >= 0})
        start += n
    return logits, visible


def random_scores(seed: int):
    """A stand-in scorer: a fresh random score for every materialised chunk."""
    rng = random.Random(seed)

    def scorer(p: Pager, cache: PooledKVCache) -> dict[int, float]:
        return {c: rng.uniform(-1, 1) for c in (*p.resident(), *p.paged_out())}

    return scorer


def qk_scores(pager: Pager, cache: PooledKVCache) -> dict[int, float]:
    """The worker's qk scores, through the daemon's mean over layers."""
    sums, counts = cache.qk.scores()
    return mean_scores(sums.numpy()[None], counts.numpy()[None])


def plain_geometry(model: Model) -> dict:
    """The plain cache's arguments for `model` (per-layer shapes, KV-sharing sources)."""
    cfg = model.cfg
    return {
        "layers": model.layers,
        "n_kv_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "capacity": CONTEXT,
        "dtype": model.dtype,
        "shapes": {i: cfg.kv_shape(i) for i in model.layers},
        "sources": {i: s for i in model.layers if (s := cfg.kv_source(i)) != i},
        "recurrent": model._recurrent_shapes(),
    }


def run_plain(model: Model, ids: torch.Tensor, steps: list[int], visible: list[set[int]]):
    cache = HidingCache(**plain_geometry(model))
    logits, start = [], 0
    for i, n in enumerate(steps):
        cache.visible = frozenset(visible[i])
        logits.append(model.forward(ids[start : start + n], cache, start))
        start += n
    return logits


def greedy(model: Model, prompt: torch.Tensor, n: int, pager: Pager | None) -> list[torch.Tensor]:
    """Prefill in 100-token batches, then n greedy steps; the logits of every step."""
    if pager is None:
        cache = model.new_cache(CONTEXT)
    else:
        cache = model.new_pool_cache(pager.pool.rows, capacity=CONTEXT)
        host = HostTier(chunk_nbytes(cache))
    out, ids, start = [], prompt.tolist(), 0
    while start < len(ids):
        batch = torch.tensor(ids[start : start + 100]) if start < len(prompt) else None
        if batch is None:
            batch = torch.tensor(ids[-1:])
        if pager is None:
            logits = model.forward(batch, cache, start)
        else:
            plan = pager.plan(start, len(batch))
            logits = pooled_step(model, cache, host, plan, batch)
        out.append(logits)
        start += len(batch)
        if start >= len(prompt) and len(ids) < len(prompt) + n:
            ids.append(int(logits[-1].argmax()))
    return out


def test_pool_covering_the_context_equals_the_plain_cache(model: Model) -> None:
    prompt = token_ids(300, model.cfg.vocab)
    pager = Pager(PagerConfig(pool_tokens=448))
    plain = greedy(model, prompt, 60, None)
    pooled = greedy(model, prompt, 60, pager)
    assert pager.is_identity and pager.stats().evictions == 0
    assert len(plain) == len(pooled) == 3 + 60
    for a, b in zip(plain, pooled, strict=True):
        assert torch.equal(a, b)  # bit-identical: the same keys, mask and kernel


def test_a_shuffled_block_order_gives_the_same_output(model: Model) -> None:
    prompt = token_ids(300, model.cfg.vocab, seed=1)
    order = random.Random(7).sample(range(7), 7)
    pager = Pager(PagerConfig(pool_tokens=448), BlockPool(7, order=order))
    plain = greedy(model, prompt, 40, None)
    moved = greedy(model, prompt, 40, pager)
    assert pager.table.blocks == dict(enumerate(order[:6]))
    assert [int(x[-1].argmax()) for x in moved] == [int(x[-1].argmax()) for x in plain]
    for a, b in zip(plain, moved, strict=True):
        assert torch.equal(a, b)  # gathered back into position order: the same numbers


def test_under_eviction_logits_equal_a_plain_cache_hiding_the_paged_out_chunks(
    model: Model,
) -> None:
    # qk (eviction by score and recall) on every family, lru (no recall) on one.
    for policy in ("qk", "lru") if model.cfg.arch == "llama" else ("qk",):
        ids = token_ids(sum(STEPS), model.cfg.vocab, seed=2)
        pager = Pager(PagerConfig(pool_tokens=448, policy=policy, tau=32))
        pooled, visible = run_pooled(model, ids, STEPS, pager, qk_scores)
        stats = pager.stats()
        assert stats.evictions > 0 and stats.resident == 7
        assert (stats.recalls > 0) == (policy == "qk")
        assert len(visible[-1]) == 6 * 64 + len(ids) % 64  # six full chunks + the head's
        oracle = run_plain(model, ids, STEPS, visible)
        for a, b in zip(pooled, oracle, strict=True):
            # Equal to float rounding: SDPA over the visible keys vs over all, masked.
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
            assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_page_out_then_page_in_is_byte_exact() -> None:
    heads = {0: 2, 1: 1, 2: 3}
    for dtype in (torch.float32, torch.bfloat16):
        cache = PooledKVCache(range(3), heads, 8, 256, dtype, capacity=1024)
        g = torch.Generator().manual_seed(0)
        for t in (*cache.k.values(), *cache.v.values()):  # arbitrary bit patterns, NaNs too
            t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, generator=g))
        size = chunk_nbytes(cache)
        assert size == sum(2 * h * 64 * 8 * dtype.itemsize for h in heads.values())
        record = torch.empty(size, dtype=torch.uint8)
        page_out(cache, 1, record)
        first = cache.k[0][:, 64:128].contiguous().view(torch.uint8).flatten()
        assert torch.equal(record[: first.numel()], first)  # layer 0's K rows lead
        before = {i: (cache.k[i][:, 64:128].clone(), cache.v[i][:, 64:128].clone()) for i in heads}
        page_in(cache, 3, record)  # into another block
        for i, (k, v) in before.items():
            assert torch.equal(cache.k[i][:, 192:256].view(torch.uint8), k.view(torch.uint8))
            assert torch.equal(cache.v[i][:, 192:256].view(torch.uint8), v.view(torch.uint8))


def test_visibility_in_slot_space() -> None:
    cache = PooledKVCache(range(1), 1, 4, 128, torch.float32, capacity=1024)
    held = torch.full((128,), -1, dtype=torch.int64)
    held[:5] = torch.arange(5)  # committed positions 0..4 in rows 0..4
    held[70] = 9  # a stale row (a rejected draft's position): never visible
    held[[64, 65]] = torch.tensor([5, 6])  # this step writes positions 5, 6 at rows 64, 65
    cache.set_step(5, [64, 65], held)
    k = torch.randn(2, 1, 4)
    keys, _ = cache.write(0, 5, k, k)
    assert keys.shape == (1, 7, 4)
    assert torch.equal(keys[0, 5:], k[:, 0])  # own rows gathered in position order
    assert cache.mask(5, 2, None, torch.device("cpu")).tolist() == [
        [True] * 6 + [False],
        [True] * 7,
    ]
    assert cache.mask(5, 2, 3, torch.device("cpu")).tolist() == [
        [False] * 3 + [True] * 3 + [False],
        [False] * 4 + [True] * 3,
    ]
    with pytest.raises(ValueError, match=r"do not hold positions \[5, 7\)"):
        cache.set_step(5, [64, 66], held)
    with pytest.raises(ValueError, match=r"no pool rows set for positions \[7, 8\)"):
        cache.reserve(7, 1)


def test_qk_scores_equal_cosines_of_the_plain_caches_keys(model: Model) -> None:
    cfg = model.cfg
    ids = token_ids(330, cfg.vocab, seed=4)
    plain = QueryRecorder(**plain_geometry(model))
    plain.queries = {}
    pager = Pager(PagerConfig(pool_tokens=448), BlockPool(7, order=[3, 0, 6, 2, 5, 1, 4]))
    cache = model.new_pool_cache(448, capacity=CONTEXT)
    host = HostTier(chunk_nbytes(cache))
    for start, n in ((0, 100), (100, 100), (200, 100), (300, 29), (329, 1)):
        model.forward(ids[start : start + n], plain, start)
        pooled_step(model, cache, host, pager.plan(start, n), ids[start : start + n])
        if start + n == 300 and cache.recurrent is not None:
            cache.save_state()  # so that the truncate below may come back here
    assert plain.queries, "every family has full-attention layers"
    want = chunk_scores(plain, 64, 330 // 64)  # sealed chunks; the head chunk 5 is not
    got = qk_scores(pager, cache)
    assert got.keys() == want.keys()
    for c in want:
        assert abs(got[c] - want[c]) < 1e-5
    # A rollback into chunk 4 unseals it (a rejected draft's rows are not its keys).
    cache.truncate(300)
    assert qk_scores(pager, cache).keys() == {0, 1, 2, 3}


def test_qk_reselection_keeps_the_top_chunks_and_is_idempotent(model: Model) -> None:
    ids = token_ids(sum(STEPS), model.cfg.vocab, seed=6)
    pager = Pager(PagerConfig(pool_tokens=448, policy="qk", tau=32))
    cache = model.new_pool_cache(448, capacity=CONTEXT)
    host = HostTier(chunk_nbytes(cache))
    start = 0
    for n in STEPS:
        pooled_step(model, cache, host, pager.plan(start, n), ids[start : start + n])
        start += n
    scores = qk_scores(pager, cache)
    pager.reselect(scores)
    chunks = [*pager.resident(), *pager.paged_out()]
    free = [c for c in chunks if not pager.protected(c)]
    keep = sorted(free, key=lambda c: scores.get(c, UNSCORED), reverse=True)[
        : 7 - (len(chunks) - len(free))
    ]
    assert set(pager.resident()) == {c for c in chunks if pager.protected(c)} | set(keep)
    pooled_step(model, cache, host, pager.plan(start, 1), ids[:1])  # runs the moves
    again = qk_scores(pager, cache)
    pager.reselect(scores)
    assert pager._pending == []  # the same scores move nothing
    assert again.keys() >= scores.keys()


def test_pool_rows_do_not_grow_with_the_context(model: Model) -> None:
    # The bound is in the allocation: K/V is pool rows whatever the context; only the qk
    # chunk keys (one [Hkv, D] float32 row per 64 positions and layer) follow the context.
    small = model.new_pool_cache(448, capacity=CONTEXT)
    large = model.new_pool_cache(448, capacity=4 * CONTEXT)
    assert small.nbytes() == large.nbytes()
    assert all(t.shape[1] == 448 for t in (*large.k.values(), *large.v.values()))
    keys = sum(t.numel() * 4 for t in large.qk.keys.values())
    assert keys * 64 <= 4 * CONTEXT * large.nbytes() / 448  # 1/64 of a float32 K of the context
