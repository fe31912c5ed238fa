"""KV Flash pager bookkeeping, asserting exact chunk, block, slot and record ids."""

from __future__ import annotations

import pytest

from luced.engine.kvflash import (
    BlockPool,
    Move,
    Pager,
    PagerConfig,
    PoolExhausted,
    PoolTooSmall,
)

C = 64


def decode(pager: Pager, end: int) -> None:
    """Plan one position at a time up to `end` (a decode loop)."""
    while pager.end < end:
        pager.plan(pager.end, 1)


def test_prompt_that_fits_is_the_identity_layout() -> None:
    pager = Pager(PagerConfig(pool_tokens=448))
    plan = pager.plan(0, 300)
    assert plan.write_slots == tuple(range(300))
    assert plan.moves == ()
    assert pager.table.blocks == {0: 0, 1: 1, 2: 2, 3: 3, 4: 4}
    assert list(plan.slot_positions) == list(range(300)) + [-1] * 148
    assert pager.is_identity


def test_undersized_pools_are_refused() -> None:
    assert PagerConfig(pool_tokens=448).min_pool_tokens == 448  # (1 + 4 + 2) * 64
    with pytest.raises(PoolTooSmall, match=r"384 tokens is below the minimum 448 = \(sinks 1"):
        PagerConfig(pool_tokens=384)
    with pytest.raises(ValueError, match="not a multiple of the 64-token chunk"):
        PagerConfig(pool_tokens=500)
    with pytest.raises(ValueError, match="policy 'fifo'"):
        PagerConfig(pool_tokens=448, policy="fifo")  # type: ignore[arg-type]


def test_a_sliding_window_wider_than_the_tail_widens_it() -> None:
    assert PagerConfig(pool_tokens=448, sliding_window=128).tail == 4  # ceil(2) + 1 < 4
    cfg = PagerConfig(pool_tokens=768, sliding_window=512)
    assert (cfg.tail, cfg.min_pool_tokens) == (9, 768)  # Laguna's 768
    with pytest.raises(PoolTooSmall, match="tail widened for a 512-token window"):
        PagerConfig(pool_tokens=704, sliding_window=512)
    pager = Pager(cfg)
    while pager.end < 2000:
        plan = pager.plan(pager.end, 7)
        q = plan.start + plan.n - 1
        window = {p for p in range(max(0, q - 511), q + 1)}
        held = set(plan.slot_positions) - {-1}
        assert window <= held, f"window of position {q} not resident"
    assert pager.evictions > 0


def test_lru_evicts_the_least_recently_touched_unprotected_chunk() -> None:
    pager = Pager(PagerConfig(pool_tokens=448, policy="lru"))
    decode(pager, 7 * C)  # chunks 0..6 fill blocks 0..6
    assert pager.pool.n_free == 0
    pager.table.touch(1)  # chunk 1 used after chunk 2: chunk 2 is the LRU victim
    plan = pager.plan(7 * C, 1)  # chunk 7: protected are 0 (sink) and 3..7 (tail)
    assert plan.moves == (Move("out", chunk=2, block=2, record=0),)
    assert pager.table.blocks[7] == 2
    assert plan.write_slots == (2 * C,)
    plan = pager.plan(7 * C + 1, C)  # reaches chunk 8: protected 0 and 4..8
    assert plan.moves == (Move("out", chunk=3, block=3, record=1),)  # 3 before 1: touched
    assert pager.table.blocks[8] == 3
    plan = pager.plan(pager.end, C)  # chunk 9
    assert plan.moves == (Move("out", chunk=4, block=4, record=2),)
    assert pager.paged_out() == [2, 3, 4]
    # Chunks 10 and 11 evict 5 and 6 (touched before chunk 1 was); chunk 12 finds 1 the
    # least recently touched of {1, 7}.
    decode(pager, 12 * C + 1)
    assert pager.paged_out() == [1, 2, 3, 4, 5, 6]
    assert pager.table.host == {2: 0, 3: 1, 4: 2, 5: 3, 6: 4, 1: 5}


def test_sinks_and_tail_are_never_evicted() -> None:
    pager = Pager(PagerConfig(pool_tokens=512, policy="lru"))
    while pager.end < 3000:
        pager.plan(pager.end, 1 + pager.end % 13)
        resident = set(pager.resident())
        assert 0 in resident
        assert set(range(max(0, pager.cur_chunk - 4), pager.cur_chunk + 1)) <= resident
        for move in pager.plan(pager.end, 1).moves:
            assert move.kind == "out" and move.chunk != 0
            assert move.chunk < pager.cur_chunk - 4
    stats = pager.stats()
    assert stats.resident == 8 and stats.paged_out == pager.cur_chunk + 1 - 8
    assert stats.evictions == stats.paged_out and stats.recalls == 0


def test_slot_arithmetic_follows_the_block_order() -> None:
    order = [3, 6, 0, 5, 1, 4, 2]
    pager = Pager(PagerConfig(pool_tokens=448), BlockPool(7, order=order))
    plan = pager.plan(0, 200)
    assert pager.table.blocks == {0: 3, 1: 6, 2: 0, 3: 5}
    assert plan.write_slots[10] == 3 * C + 10
    assert plan.write_slots[64 + 5] == 6 * C + 5
    assert plan.write_slots[199] == 5 * C + 199 % C
    assert plan.slot_positions[5 * C + 7] == 3 * C + 7
    assert not pager.is_identity


def test_a_shorter_replay_hides_the_rejected_positions() -> None:
    pager = Pager(PagerConfig(pool_tokens=448))
    pager.plan(0, 100)
    pager.plan(100, 16)  # a draft block of 16
    plan = pager.plan(105, 2)  # 5 accepted: the target's token and the next anchor
    held = [p for p in plan.slot_positions if p >= 0]
    assert held == list(range(107))
    assert plan.write_slots == (105, 106)


def test_a_step_that_cannot_be_resident_at_once_changes_nothing() -> None:
    pager = Pager(PagerConfig(pool_tokens=448))
    pager.plan(0, 448)
    with pytest.raises(PoolExhausted, match=r"\[448, 896\) need 7 more blocks: 0 free, 6"):
        pager.plan(448, 448)
    assert (pager.cur_chunk, pager.end, pager.evictions) == (6, 448, 0)
    plan = pager.plan(448, 5 * C)  # five chunks: 1..5 are evicted in LRU order
    assert [m.chunk for m in plan.moves] == [1, 2, 3, 4, 5]
    assert pager.resident() == [0, 6, 7, 8, 9, 10, 11]


def test_reselect_keeps_the_top_chunks_and_is_idempotent() -> None:
    pager = Pager(PagerConfig(pool_tokens=640, chunk_bytes=1000))  # 10 blocks, qk
    decode(pager, 1000)  # chunk 15; protected: 0 and 11..15
    assert pager.resident() == [0, 7, 8, 9, 10, 11, 12, 13, 14, 15]
    scores = {1: 0.5, 2: 0.1, 3: 0.9, 4: -0.3, 5: 0.2, 7: 0.8, 8: 0.0, 9: 0.4, 10: -0.9}
    pager.reselect(scores)
    assert pager.resident() == [0, 1, 3, 7, 9, 11, 12, 13, 14, 15]
    plan = pager.plan(1000, 1)
    outs = [(m.chunk, m.block) for m in plan.moves if m.kind == "out"]
    ins = [(m.chunk, m.record) for m in plan.moves if m.kind == "in"]
    # Chunks 10..15 took blocks 1..6 as 1..6 went out to records 0..5.
    assert outs == [(8, 8), (10, 1)]  # out first: their blocks take chunks 1 and 3
    assert ins == [(1, 0), (3, 2)]
    assert (pager.table.blocks[1], pager.table.blocks[3]) == (8, 1)
    # The recalled chunk's rows map back to its positions wherever it landed.
    b = pager.table.blocks[3]
    assert list(plan.slot_positions[b * C : (b + 1) * C]) == list(range(3 * C, 4 * C))
    stats = pager.stats()
    assert (stats.recalls, stats.paged_out, stats.host_bytes) == (2, 6, 6000)

    pager.reselect(scores)  # same scores: nothing moves
    assert pager.plan(1001, 1).moves == ()
    assert pager.resident() == [0, 1, 3, 7, 9, 11, 12, 13, 14, 15]


def test_qk_eviction_takes_the_lowest_score() -> None:
    pager = Pager(PagerConfig(pool_tokens=448))
    decode(pager, 7 * C)
    pager.reselect({1: 0.7, 2: 0.3})  # everything fits: no move, scores remembered
    assert pager.plan(pager.end, 1).moves == (Move("out", 2, 2, 0),)
    pager.reselect({1: 0.7, 2: 0.9})
    plan = pager.plan(pager.end, C)  # 2 swaps in for 1; chunk 8 then evicts unscored 3
    assert [m[:2] for m in plan.moves] == [("out", 1), ("in", 2), ("out", 3)]


def test_page_out_then_page_in_round_trips_the_bookkeeping() -> None:
    pager = Pager(PagerConfig(pool_tokens=448))
    decode(pager, 7 * C + 10)  # chunk 1 went out to record 0
    assert pager.table.host == {1: 0}
    before = {p: None for p in range(C, 2 * C)}
    pager.reselect({1: 1.0, 2: -1.0})  # 2 out (record 1 is fresh), 1 back in
    plan = pager.plan(pager.end, 1)
    assert plan.moves == (Move("out", 2, 2, 1), Move("in", 1, 2, 0))
    assert pager.table.host == {2: 1} and pager.table.blocks[1] == 2
    held = {p: s for s, p in enumerate(plan.slot_positions) if p >= 0}
    assert {held[p] for p in before} == set(range(2 * C, 3 * C))
    assert held[C + 17] == 2 * C + 17
    pager.reset()
    assert pager.plan(0, 130).write_slots == tuple(range(130)) and pager.is_identity


def test_lru_never_recalls_and_reselection_is_due_every_tau() -> None:
    lru = Pager(PagerConfig(pool_tokens=448, policy="lru"))
    decode(lru, 600)
    lru.reselect({1: 1.0})
    assert lru.stats().recalls == 0 and not lru.reselect_due()

    qk = Pager(PagerConfig(pool_tokens=448, tau=64))
    qk.plan(0, 63)
    assert not qk.reselect_due()
    qk.plan(63, 1)
    assert qk.reselect_due()
    qk.reselect({})
    decode(qk, 4500)
    assert qk.reselect_due()
    qk.reselect({})
    decode(qk, 4601)  # 101 positions, interval 4601 // 45 = 102
    assert not qk.reselect_due()
    decode(qk, 4602)
    assert qk.reselect_due()


def test_a_draft_block_evicts_no_further_than_its_first_chunk() -> None:
    pager = Pager(PagerConfig(pool_tokens=448))
    decode(pager, 300)  # chunks 0..4 in blocks 0..4; 2 blocks free
    assert pager.lookahead(300, 16) == 16
    assert pager.lookahead(380, 200) == 4 + 64  # chunk 5 and 6 take the free blocks, 7 would evict
    decode(pager, 448)  # the pool is full
    assert pager.lookahead(440, 16) == 8  # chunk 7's rest; chunk 7 would evict
    assert pager.lookahead(448, 16) == 16  # its first chunk may evict: plain decoding would
    assert pager.lookahead(500, 16) == 12


def test_reselection_counts_kept_positions_not_rejected_drafts() -> None:
    pager = Pager(PagerConfig(pool_tokens=448, tau=64))
    pager.plan(0, 50)
    for start in range(50, 54):  # four 16-token blocks, one position kept each
        pager.plan(start, 16)
        pager.truncate(start + 1)
    assert not pager.reselect_due()  # 54 kept positions; 114 were planned
    pager.plan(54, 10)
    assert pager.reselect_due()  # 64 kept


def test_a_reselection_can_be_asked_for_at_the_end_of_a_prompt() -> None:
    for policy in ("qk", "lru"):
        pager = Pager(PagerConfig(pool_tokens=448, policy=policy))
        pager.plan(0, 10)
        assert not pager.reselect_due()
        pager.ask_reselect()
        assert pager.reselect_due() == (policy == "qk")  # lru never reselects
        pager.reselect({})
        assert not pager.reselect_due()
