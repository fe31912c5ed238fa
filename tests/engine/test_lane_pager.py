"""KV Flash as an eviction policy over the shared block tables (engine/kv/pager.py):
exact logical block, pool block and record ids derived from the rules (the lowest free
block and record first), and a fake worker that follows the moves and the tables."""

from __future__ import annotations

import dataclasses
import random

import pytest

from luced.engine.kv.blocks import (
    IN,
    OUT,
    PAGED,
    BlocksExhausted,
    BlockTables,
    Move,
    RecordsExhausted,
)
from luced.engine.kv.pager import Pager, PagerConfig, PoolExhausted, PoolTooSmall

C = 64


def lane_pager(cfg: PagerConfig, records: int = 128) -> Pager:
    """Lane 0's pager over tables of exactly its quota."""
    return Pager(cfg, BlockTables(cfg.n_blocks, cfg.block, records), 0)


def step(pager: Pager, start: int, n: int, end: int | None = None) -> tuple[Move, ...]:
    """What the engine does per step: plan, then the span's write over the same range."""
    moves = pager.plan(start, n, end)
    pager.tables.write(pager.lane, start, start + n if end is None else end)
    return moves


def decode(pager: Pager, end: int) -> None:
    """Plan and write one position at a time up to `end` (a decode loop)."""
    while pager.end < end:
        step(pager, pager.end, 1)


def test_a_prompt_that_fits_stays_resident_in_the_lowest_blocks() -> None:
    pager = lane_pager(PagerConfig(pool_tokens=448))
    assert step(pager, 0, 300) == ()
    assert pager.tables.table(0) == (0, 1, 2, 3, 4)
    assert pager.resident() == [0, 1, 2, 3, 4] and pager.paged_out() == []


def test_undersized_pools_are_refused() -> None:
    assert PagerConfig(pool_tokens=448).min_pool_tokens == 448  # (1 + 4 + 2) * 64
    with pytest.raises(PoolTooSmall, match=r"384 tokens is below the minimum 448 = \(sinks 1"):
        PagerConfig(pool_tokens=384)
    with pytest.raises(ValueError, match="not a multiple of the 64-token block"):
        PagerConfig(pool_tokens=500)
    with pytest.raises(ValueError, match="policy 'fifo'"):
        PagerConfig(pool_tokens=448, policy="fifo")  # type: ignore[arg-type]
    assert PagerConfig(pool_tokens=64, block=16, tail_blocks=1).n_blocks == 4  # (1 + 1 + 2)
    with pytest.raises(ValueError, match="tables of 16-row blocks, a pager of 64"):
        Pager(PagerConfig(pool_tokens=448), BlockTables(28, 16), 0)


def test_a_sliding_window_wider_than_the_tail_widens_it() -> None:
    assert PagerConfig(pool_tokens=448, sliding_window=128).tail == 4  # ceil(2) + 1 < 4
    cfg = PagerConfig(pool_tokens=768, sliding_window=512)
    assert (cfg.tail, cfg.min_pool_tokens) == (9, 768)  # Laguna's 768
    with pytest.raises(PoolTooSmall, match="tail widened for a 512-token window"):
        PagerConfig(pool_tokens=704, sliding_window=512)
    pager = lane_pager(cfg)
    while pager.end < 2000:
        step(pager, pager.end, 7)
        q = pager.end - 1
        window = set(range(max(0, q - 511) // C, q // C + 1))
        assert window <= set(pager.resident()), f"window of position {q} not resident"
    assert pager.evictions > 0


def test_lru_evicts_the_least_recently_touched_unprotected_block() -> None:
    pager = lane_pager(PagerConfig(pool_tokens=448, policy="lru"))
    decode(pager, 7 * C)  # blocks 0..6 fill pool blocks 0..6
    assert pager.tables.free_blocks == 0
    pager.touch(1)  # block 1 used after block 2: block 2 is the LRU victim
    moves = step(pager, 7 * C, 1)  # block 7: protected are 0 (sink) and 3..7 (tail)
    assert moves == (Move(OUT, index=2, block=2, record=0),)
    assert pager.tables.entry(0, 7) == 2  # the freed block, the lowest free
    moves = step(pager, 7 * C + 1, C)  # reaches block 8: protected 0 and 4..8
    assert moves == (Move(OUT, index=3, block=3, record=1),)  # 3 before 1: touched
    assert pager.tables.entry(0, 8) == 3
    moves = step(pager, pager.end, C)  # block 9
    assert moves == (Move(OUT, index=4, block=4, record=2),)
    assert pager.paged_out() == [2, 3, 4]
    # Blocks 10 and 11 evict 5 and 6 (touched before block 1 was); block 12 finds 1 the
    # least recently touched of {1, 7}.
    decode(pager, 12 * C + 1)
    assert pager.paged_out() == [1, 2, 3, 4, 5, 6]
    assert pager.tables.host(0) == {2: 0, 3: 1, 4: 2, 5: 3, 6: 4, 1: 5}
    assert pager.tables.table(0) == (0, *[PAGED] * 6, 2, 3, 4, 5, 6, 1)


def test_sinks_and_tail_are_never_evicted() -> None:
    pager = lane_pager(PagerConfig(pool_tokens=512, policy="lru"))
    while pager.end < 3000:
        step(pager, pager.end, 1 + pager.end % 13)
        resident = set(pager.resident())
        assert 0 in resident
        assert set(range(max(0, pager.cur_block - 4), pager.cur_block + 1)) <= resident
        for move in step(pager, pager.end, 1):
            assert move.kind == OUT and move.index != 0
            assert move.index < pager.cur_block - 4
    stats = pager.stats()
    assert stats.resident == 8 and stats.paged_out == pager.cur_block + 1 - 8
    assert stats.evictions == stats.paged_out and stats.recalls == 0


def test_a_lane_takes_whichever_blocks_the_shared_pool_has_free() -> None:
    cfg = PagerConfig(pool_tokens=448)
    tables = BlockTables(10, C, 8)
    tables.write(1, 0, 3 * C)  # another lane holds pool blocks 0..2
    pager = Pager(cfg, tables, 0)
    step(pager, 0, 200)
    assert tables.table(0) == (3, 4, 5, 6)
    tables.free(1)  # 0, 1, 2, 7, 8, 9 free: the lowest go first
    step(pager, 200, 2 * C)
    assert tables.table(0) == (3, 4, 5, 6, 0, 1)


def test_a_shorter_replay_moves_nothing_and_rewinds_the_end() -> None:
    pager = lane_pager(PagerConfig(pool_tokens=448))
    step(pager, 0, 100)
    step(pager, 100, 16)  # a draft block of 16
    assert step(pager, 105, 2) == ()  # 5 accepted: the target's token and the next anchor
    assert pager.end == 107 and pager.tables.table(0) == (0, 1)
    with pytest.raises(ValueError, match="a write at 108 would leave a gap after position 107"):
        pager.plan(108, 1)


def test_a_step_that_cannot_be_resident_at_once_changes_nothing() -> None:
    pager = lane_pager(PagerConfig(pool_tokens=448))
    step(pager, 0, 448)
    with pytest.raises(PoolExhausted, match=r"\[448, 896\) need 7 more blocks: 0 free, 6"):
        pager.plan(448, 448)
    assert (pager.cur_block, pager.end, pager.evictions) == (6, 448, 0)
    assert pager.tables.table(0) == tuple(range(7)) and pager.tables.used_records == 0
    moves = step(pager, 448, 5 * C)  # five blocks: 1..5 are evicted in LRU order
    assert moves == tuple(Move(OUT, j, j, j - 1) for j in range(1, 6))
    assert pager.resident() == [0, 6, 7, 8, 9, 10, 11]
    assert pager.tables.table(0)[7:] == (1, 2, 3, 4, 5)


def test_reselect_keeps_the_top_blocks_and_is_idempotent() -> None:
    pager = lane_pager(PagerConfig(pool_tokens=640, block_bytes=1000))  # 10 blocks, qk
    decode(pager, 1000)  # block 15; protected: 0 and 11..15
    # Blocks 10..15 took pool blocks 1..6 as 1..6 went out to records 0..5.
    assert pager.resident() == [0, 7, 8, 9, 10, 11, 12, 13, 14, 15]
    assert pager.tables.table(0)[10:] == (1, 2, 3, 4, 5, 6)
    scores = {1: 0.5, 2: 0.1, 3: 0.9, 4: -0.3, 5: 0.2, 7: 0.8, 8: 0.0, 9: 0.4, 10: -0.9}
    assert pager.reselect_due()
    pager.score(scores)
    moves = step(pager, 1000, 1)  # the reselection rides with this step
    assert pager.resident() == [0, 1, 3, 7, 9, 11, 12, 13, 14, 15]
    # out first, to the lowest free records (0..5 are held); their blocks take 1 and 3
    assert moves == (
        Move(OUT, index=8, block=8, record=6),
        Move(OUT, index=10, block=1, record=7),
        Move(IN, index=1, block=1, record=0),
        Move(IN, index=3, block=8, record=2),
    )
    assert (pager.tables.entry(0, 1), pager.tables.entry(0, 3)) == (1, 8)
    stats = pager.stats()
    assert (stats.recalls, stats.paged_out, stats.host_bytes) == (2, 6, 6000)
    assert not pager.reselect_due()

    pager.ask_reselect()
    pager.score(scores)  # same scores: nothing moves
    assert step(pager, 1001, 1) == ()
    assert pager.resident() == [0, 1, 3, 7, 9, 11, 12, 13, 14, 15]
    assert not pager.reselect_due()


def test_qk_eviction_takes_the_lowest_score() -> None:
    pager = lane_pager(PagerConfig(pool_tokens=448))
    decode(pager, 7 * C)
    pager.score({1: 0.7, 2: 0.3})  # everything fits: no move, scores remembered
    assert step(pager, pager.end, 1) == (Move(OUT, 2, 2, 0),)
    pager.ask_reselect()
    pager.score({1: 0.7, 2: 0.9})
    moves = step(pager, pager.end, C)  # 2 swaps in for 1; block 8 then evicts unscored 3
    assert moves == (Move(OUT, 1, 1, 1), Move(IN, 2, 1, 0), Move(OUT, 3, 3, 0))
    assert pager.tables.table(0) == (0, PAGED, 1, PAGED, 4, 5, 6, 2, 3)


def test_page_out_then_page_in_round_trips_the_bookkeeping() -> None:
    pager = lane_pager(PagerConfig(pool_tokens=448), records=2)
    decode(pager, 7 * C + 10)  # block 1 went out to record 0
    assert pager.tables.host(0) == {1: 0}
    pager.score({1: 1.0, 2: -1.0})  # 2 out (record 1), 1 back in
    assert step(pager, pager.end, 1) == (Move(OUT, 2, 2, 1), Move(IN, 1, 2, 0))
    assert pager.tables.host(0) == {2: 1} and pager.tables.entry(0, 1) == 2
    assert pager.tables.free_records == 1
    pager.reset()
    pager.tables.free(0)
    assert pager.tables.free_records == 2
    assert step(pager, 0, 130) == () and pager.tables.table(0) == (0, 1, 2)


def test_lru_never_recalls_and_reselection_is_due_every_tau() -> None:
    lru = lane_pager(PagerConfig(pool_tokens=448, policy="lru"))
    decode(lru, 600)
    lru.score({1: 1.0})
    lru.ask_reselect()
    assert all(m.kind == OUT for m in step(lru, 600, C))
    assert lru.stats().recalls == 0 and not lru.reselect_due()

    qk = lane_pager(PagerConfig(pool_tokens=448, tau=64))
    step(qk, 0, 63)
    assert not qk.reselect_due()
    step(qk, 63, 1)
    assert qk.reselect_due()
    qk.score({})
    decode(qk, 4500)  # reselected at 64
    assert qk.reselect_due()
    qk.score({})
    decode(qk, 4601)  # reselected at 4500; 101 positions, interval 4601 // 45 = 102
    assert not qk.reselect_due()
    decode(qk, 4602)
    assert qk.reselect_due()


def test_a_draft_block_evicts_no_further_than_its_first_block() -> None:
    pager = lane_pager(PagerConfig(pool_tokens=448))
    decode(pager, 300)  # blocks 0..4 resident; 2 of the quota free
    assert pager.lookahead(300, 16) == 16
    assert pager.lookahead(380, 200) == 4 + 64  # 5 and 6 take the free room, 7 would evict
    decode(pager, 448)  # the quota is full
    assert pager.lookahead(440, 16) == 8  # block 6's rest; block 7 would evict
    assert pager.lookahead(448, 16) == 16  # its first block may evict: plain decoding would
    assert pager.lookahead(500, 16) == 12


def test_reselection_counts_kept_positions_not_rejected_drafts() -> None:
    pager = lane_pager(PagerConfig(pool_tokens=448, tau=64))
    step(pager, 0, 50)
    for start in range(50, 54):  # four 16-token blocks, one position kept each
        step(pager, start, 16)
        pager.truncate(start + 1)
        pager.tables.truncate(0, start + 1)
    assert not pager.reselect_due()  # 54 kept positions; 114 were planned
    step(pager, 54, 10)
    assert pager.reselect_due()  # 64 kept


def test_a_reselection_can_be_asked_for_at_the_end_of_a_prompt() -> None:
    for policy in ("qk", "lru"):
        pager = lane_pager(PagerConfig(pool_tokens=448, policy=policy))
        step(pager, 0, 10)
        assert not pager.reselect_due()
        pager.ask_reselect()
        assert pager.reselect_due() == (policy == "qk")  # lru never reselects
        pager.score({})
        step(pager, 10, 1)  # the reselection runs here
        assert not pager.reselect_due()


def test_a_full_host_tier_or_pool_refuses_the_step_and_changes_nothing() -> None:
    pager = lane_pager(PagerConfig(pool_tokens=448), records=1)
    decode(pager, 8 * C)  # logical 1 went out to the only record
    before = pager.tables.table(0)
    with pytest.raises(RecordsExhausted, match=r"\[512, 513\) need more than the 0 free of 1"):
        pager.plan(8 * C, 1)
    assert pager.tables.table(0) == before and (pager.end, pager.evictions) == (8 * C, 1)
    tables = BlockTables(8, C, 8)
    tables.write(1, 0, 6 * C)  # another lane holds six of the eight blocks
    pager = Pager(PagerConfig(pool_tokens=448), tables, 0)
    step(pager, 0, 2 * C)
    with pytest.raises(BlocksExhausted, match=r"need more than the 0 free of 8 blocks"):
        pager.plan(2 * C, 1)  # within the lane's quota, but the pool is full
    assert tables.table(0) == (6, 7) and pager.end == 2 * C


# -- over shared tables -----------------------------------------------------------------

SMALL = PagerConfig(pool_tokens=16, block=4, sink_blocks=1, tail_blocks=1)  # unscored: LRU


def test_two_lanes_share_one_pool_each_within_its_quota() -> None:
    tables = BlockTables(8, 4, 64)  # quota 4 blocks each
    a, b = Pager(SMALL, tables, 0), Pager(SMALL, tables, 1)
    step(a, 0, 16)
    step(b, 0, 16)
    assert (tables.table(0), tables.table(1), tables.free_blocks) == ((0, 1, 2, 3), (4, 5, 6, 7), 0)
    # block 4: protected 0 (sink), 3 and 4 (tail 1, the step); 1 is the LRU of {1, 2}
    assert step(a, 16, 1) == (Move(OUT, 1, 1, 0),)
    assert tables.table(0) == (0, PAGED, 2, 3, 1)
    assert step(b, 16, 1) == (Move(OUT, 1, 5, 1),)
    assert tables.table(1) == (4, PAGED, 6, 7, 5)
    assert step(a, 17, 4) == (Move(OUT, 2, 2, 2),)  # blocks 4 and 5: 2 of {2, 3} goes
    assert tables.table(0) == (0, PAGED, PAGED, 3, 1, 2)
    for _ in range(40):
        for pager in (a, b):
            step(pager, pager.end, 3)
            assert len(pager.resident()) == 4
    assert tables.used_blocks == 8 and tables.used_records == a.cur_block - 3 + b.cur_block - 3


def test_a_shared_block_is_paged_out_like_any_other_and_stays_for_its_sharers() -> None:
    tables = BlockTables(12, 4, 16)
    source, lane = Pager(SMALL, tables, 0), Pager(SMALL, tables, 1)
    step(source, 0, 12)  # pool blocks 0, 1, 2
    tables.share(1, 0, 8)  # blocks 0 and 1
    lane.sync(8)
    assert step(lane, 8, 4) == ()  # logical 2 in pool block 3
    assert step(lane, 12, 4) == ()  # logical 3 in 4: the quota is full
    # logical 4: protected 0, 3, 4; of 1 (shared) and 2, 1 was touched least recently
    assert step(lane, 16, 1) == (Move(OUT, 1, 1, 0),)
    assert tables.table(1) == (0, PAGED, 3, 4, 5)  # a new block: 1 stays with the source
    assert tables.table(0) == (0, 1, 2) and tables.refs(1) == 1
    # A lane sharing its whole quota grows all the same: its shared blocks make room.
    third = Pager(SMALL, tables, 2)
    tables.share(2, 0, 12)  # the source's blocks 0, 1, 2
    third.sync(12)
    assert step(third, 12, 4) == ()  # logical 3 in pool block 6: the quota is full
    assert step(third, 16, 4) == (Move(OUT, 1, 1, 1),)  # logical 4: 1 (shared) goes
    assert tables.table(2) == (0, PAGED, 2, 6, 7) and tables.refs(1) == 1


def test_an_import_past_the_quota_is_brought_back_to_it_by_the_next_step() -> None:
    tables = BlockTables(8, 4, 8)
    pager = Pager(SMALL, tables, 0)
    assert tables.grow(0, 23) == (0, 1, 2, 3, 4, 5)  # a snapshot's 23 positions
    pager.sync(23)  # planned in order: 0..5 touched, cur_block 5
    # the next step decodes one ahead: blocks 5 and 6, protected with the sink and tail;
    # two out to reach the quota, one more for block 6, least recently touched first
    assert step(pager, 23, 1, 25) == (
        Move(OUT, 1, 1, 0),
        Move(OUT, 2, 2, 1),
        Move(OUT, 3, 3, 2),
    )
    assert tables.table(0) == (0, PAGED, PAGED, PAGED, 4, 5, 1)
    assert (pager.end, pager.cur_block, pager.resident()) == (24, 6, [0, 4, 5, 6])


LRU = dataclasses.replace(SMALL, policy="lru")


def test_a_lane_sharing_a_paged_prefix_adopts_a_fresh_lanes_residency() -> None:
    """A finished lane's prompt, paged-out entries included, is kept (shared into lane 9,
    its records retained) and a later lane starts on it: its first plan pages in what a
    lane that planned those positions itself would hold (the sink and the newest blocks
    within the quota), in position order for LRU."""
    tables = BlockTables(12, 4, 16)
    source = Pager(LRU, tables, 0)
    for start in range(0, 20, 4):
        step(source, start, 4)  # block 4: 1 out (record 0), into pool block 1
    decode(source, 28)  # blocks 5, 6: 2 and 3 out (records 1, 2)
    assert (tables.table(0), tables.host(0)) == (
        (0, PAGED, PAGED, PAGED, 1, 2, 3),
        {1: 0, 2: 1, 3: 2},
    )
    tables.share(9, 0, 20)  # the kept prompt: 5 entries, 3 of them paged out
    tables.free(0)
    source.reset()
    assert (tables.table(9), [tables.record_refs(r) for r in range(3)]) == (
        (0, PAGED, PAGED, PAGED, 1),
        [1, 1, 1],
    )
    lane = Pager(LRU, tables, 1)
    tables.share(1, 9, 18)
    lane.sync(18)
    assert tables.host(1) == {1: 0, 2: 1, 3: 2} and tables.record_refs(0) == 2
    # A fresh lane at 18 holds 0, 2, 3, 4: 2 and 3 come in (their records stay for lane
    # 9), block 4 (shared, partly) is copied on write.
    assert step(lane, 18, 2) == (Move(IN, 2, 2, 1), Move(IN, 3, 3, 2))
    assert (tables.table(1), tables.host(1)) == ((0, PAGED, 2, 3, 4), {1: 0})
    assert (tables.table(9), tables.host(9), tables.free_records) == (
        (0, PAGED, PAGED, PAGED, 1),
        {1: 0, 2: 1, 3: 2},
        13,
    )
    assert lane.recalls == 2
    # Then LRU in position order: 2 goes first, to a record of its own.
    assert step(lane, 20, 1) == (Move(OUT, 2, 2, 3),)
    assert tables.table(1) == (0, PAGED, PAGED, 3, 4, 2)
    tables.free(9)  # records 1, 2 go; 0 stays for lane 1
    assert (tables.free_records, tables.record_refs(0)) == (14, 1)


def test_a_lane_rolled_back_before_its_first_step_adopts_what_is_left() -> None:
    """A lane started on a kept prefix and truncated before its first step (a failed
    step undone) adopts what a lane that planned the positions left would keep."""
    tables = BlockTables(12, 4, 16)
    source = Pager(LRU, tables, 0)
    for start in range(0, 24, 4):
        step(source, start, 4)  # 1 and 2 paged out (records 0, 1)
    tables.share(1, 0, 24)
    lane = Pager(LRU, tables, 1)
    lane.sync(24)  # adopts 0, 3, 4, 5 as they are
    lane.truncate(6)
    tables.truncate(1, 6)  # logical 0 (pool block 0) and 1 (record 0)
    assert (tables.table(1), tables.host(1)) == ((0, PAGED), {1: 0})
    assert step(lane, 6, 1) == (Move(IN, 1, 4, 0),)  # the lowest free block
    assert tables.table(1) == (0, 4) and tables.record_refs(0) == 1
    # Kept whole and resident: truncated to 2 blocks, the lane keeps both (a sync to 24
    # alone would page 1 and 2 out).
    tables.write(5, 0, 24)
    tables.share(2, 5, 24)
    third = Pager(LRU, tables, 2)
    third.sync(24)
    third.truncate(6)
    tables.truncate(2, 6)
    assert step(third, 6, 1) == () and tables.table(2) == (5, 11)  # 1 copied on write


def test_an_adopted_lane_pages_as_a_lane_that_computed_its_prefix() -> None:
    """Under LRU a lane started on any prefix of a kept lane (resident or paged out)
    keeps, step after step, the blocks a lane that computed that prefix itself keeps,
    and pages out the same logical blocks."""
    rng = random.Random(3)
    for _ in range(40):
        tables = BlockTables(40, 4, 64)
        source = Pager(LRU, tables, 0)
        while source.end < rng.randrange(8, 40):
            step(source, source.end, rng.choice((1, 3, 8)))
        decode(source, source.end + rng.randrange(20))
        n = rng.randrange(1, min(source.end, 30) + 1)
        tables.share(9, 0, n)
        tables.free(0)
        lane, fresh = Pager(LRU, tables, 1), Pager(LRU, tables, 2)
        tables.share(1, 9, n)
        lane.sync(n)
        while fresh.end < n:  # computed in other chunks: the residency is the same
            step(fresh, fresh.end, min(rng.choice((1, 4, 8)), n - fresh.end))
        for _ in range(12):
            k = rng.choice((1, 2, 5))
            outs = [m.index for m in step(lane, lane.end, k) if m.kind == OUT]
            assert outs == [m.index for m in step(fresh, fresh.end, k) if m.kind == OUT]
            assert lane.resident() == fresh.resident()


class HeldRecords:
    """Records held to be reused later and given up on demand, the oldest first (the
    tables' `Reclaimer`, as the prefix cache's block store is)."""

    def __init__(self, tables: BlockTables, n: int) -> None:
        self.tables = tables
        self.records = [tables.hold_record() for _ in range(n)]
        tables.reclaimer = self

    def spare(self) -> int:
        return sum(self.tables.record_refs(r) == 1 for r in self.records)

    def reclaim(self, n: int) -> int:
        gone = [r for r in self.records if self.tables.record_refs(r) == 1][:n]
        for r in gone:
            self.records.remove(r)
            self.tables.release_record(r)
        return len(gone)


def test_a_page_out_takes_a_record_the_prefix_cache_gives_up() -> None:
    """Every host record is held by the prefix cache's blocks: a step that must page a
    block out is not refused, it takes the record the cache gives up first; a record
    held elsewhere too is not given up."""
    tables = BlockTables(8, 4, 3)
    held = HeldRecords(tables, 3)
    tables.adopt(0, [2])  # the lane's first block: the cache's record 2
    pager = Pager(LRU, tables, 0)
    pager.sync(4)
    assert step(pager, 4, 12) == (Move(IN, 0, 0, 2),)  # blocks 1..3 new: the quota
    assert tables.free_records == 0 and held.spare() == 3
    assert step(pager, 16, 1) == (Move(OUT, 1, 1, 0),)  # record 0, given up by the cache
    assert held.records == [1, 2] and tables.host(0) == {1: 0}
    for r in held.records:  # held elsewhere too (a write to disk): not to be given up
        tables.retain_record(r)
    with pytest.raises(RecordsExhausted, match=r"need more than the 0 free of 3 records"):
        pager.plan(17, 4)
    assert held.records == [1, 2] and tables.host(0) == {1: 0}


class FakeWorker:
    """A worker that follows the daemon: pool blocks and host records hold rows (here
    the token each position saw), moved and copied only as the moves and growth say."""

    def __init__(self, block: int) -> None:
        self.block = block
        self.pool: dict[int, list[int | None]] = {}
        self.host: dict[int, list[int | None]] = {}

    def span(self, tables: BlockTables, lane: int, moves, start: int, tokens: list[int], end):
        for move in moves:
            if move.kind == OUT:  # a copy: a shared block stays for the others
                self.host[move.record] = list(self.pool[move.block])  # KeyError: nothing there
            else:  # a copy: a shared record stays for the others
                self.pool[move.block] = list(self.host[move.record])
        growth = tables.write(lane, start, end)
        for _, src, dst in growth.copies:
            self.pool[dst] = list(self.pool[src])
        for b in growth.blocks:
            self.pool[b] = [None] * self.block
        for p, token in enumerate(tokens, start):
            self.pool[tables.entry(lane, p // self.block)][p % self.block] = token

    def rows(self, tables: BlockTables, lane: int, n: int) -> list[int | None]:
        """What the lane's positions [0, n) hold, wherever each block is."""
        host = tables.host(lane)
        out: list[int | None] = []
        for j in range(-(-n // self.block)):
            b = tables.entry(lane, j)
            out += self.host[host[j]] if b == PAGED else self.pool[b]
        return out[:n]


def test_the_moves_and_the_tables_keep_every_lanes_rows() -> None:
    """Three lanes over one pool and two kept lanes (finished prompts, no pager): prefill,
    decode (one ahead or not), draft windows rolled back, prompts kept and dropped,
    prefixes shared from running and kept lanes (paged-out entries too) and resets, under
    both policies; after each step every lane's logical blocks hold exactly the tokens it
    wrote, resident or paged out."""
    rng = random.Random(11)
    block, lanes, kept = 4, 3, (3, 4)
    for policy in ("qk", "lru"):
        cfg = PagerConfig(pool_tokens=32, block=block, tail_blocks=2, policy=policy)
        tables = BlockTables(lanes * (cfg.n_blocks + 2) + 2 * cfg.n_blocks, block, 512)
        pagers = [Pager(cfg, tables, lane) for lane in range(lanes)]
        worker = FakeWorker(block)
        tokens: list[list[int]] = [[] for _ in range(lanes + len(kept))]  # each lane's rows
        shared_paged = 0
        for _ in range(1000):
            lane = rng.randrange(lanes)
            pager = pagers[lane]
            op = rng.random()
            if op < 0.04 and tokens[lane]:  # a finished prompt kept (its slot goes on)
                keep, n = rng.choice(kept), rng.randrange(1, len(tokens[lane]) + 1)
                tables.free(keep)
                tables.share(keep, lane, n)
                tokens[keep] = tokens[lane][:n]
                if rng.random() < 0.3:  # a kept lane given up
                    gone = rng.choice(kept)
                    tables.free(gone)
                    tokens[gone] = []
                continue
            if op < 0.1 and tokens[lane]:  # restart the lane on a running or kept prefix
                source = rng.choice([s for s in (*range(lanes), *kept) if s != lane])
                n = rng.randrange(len(tokens[source]) + 1)
                pager.reset()
                tables.free(lane)
                tables.share(lane, source, n)
                shared_paged += tables.paged(lane)
                pager.sync(n)
                tokens[lane] = tokens[source][:n]
                continue
            if op < 0.14 and tokens[lane]:  # a failed step undone
                keep = rng.randrange(len(tokens[lane]) + 1)
                pager.truncate(keep)
                tables.truncate(lane, keep)
                del tokens[lane][keep:]
                continue
            if rng.random() < 0.1:
                pager.ask_reselect()
            if pager.reselect_due() and rng.random() < 0.8:
                length = tables.length(lane)
                pager.score({j: rng.uniform(-1, 1) for j in range(length) if rng.random() < 0.7})
            start = len(tokens[lane])
            if start and rng.random() < 0.3:
                start -= rng.randrange(min(start, 5) + 1)  # a draft's rejected rows again
            n = rng.choice((1, 1, 1, 2, 5, 9))
            end = start + n + (rng.random() < 0.3)  # the worker decodes one ahead
            fed = [rng.randrange(1000) for _ in range(end - start)]
            before = tables.table(lane)
            try:
                moves = pager.plan(start, n, end)
            except PoolExhausted:
                assert tables.table(lane) == before
                continue
            worker.span(tables, lane, moves, start, fed, end)
            tokens[lane][start:] = fed
            # the row decoded ahead is the next step's first: it is rewritten there
            del tokens[lane][start + n :]
            assert len(pager.resident()) <= cfg.n_blocks
            for other in (*range(lanes), *kept):
                held = tokens[other]
                assert worker.rows(tables, other, len(held)) == held, (policy, other)
        assert pagers[0].evictions and (policy == "lru" or pagers[0].recalls)
        assert shared_paged  # lanes did start on paged-out entries
