"""The KV budget under KV Flash (engine/kv/holdings.py, engine/kv/budget.py): lanes are
charged what they hold in the block pool, and kept lanes give way by paging out, with
exact positions, blocks and records (torch-free)."""

from __future__ import annotations

from luced.engine.kv.blocks import OUT, PAGED, BlockTables, Move
from luced.engine.kv.budget import KVBudget
from luced.engine.kv.finished import FinishedPrefixes
from luced.engine.kv.holdings import Holdings


def kept_lane(kv: KVBudget, tables: BlockTables, slot: int, lane: int, n: int) -> None:
    """A request in `slot` computes n positions and finishes: kept under `lane`."""
    kv.admit(slot, slot, n)
    tables.write(slot, 0, n)
    kv.keep(slot, lane, n)
    tables.share(lane, slot, n)
    tables.free(slot)


def test_lanes_are_charged_what_they_hold_in_the_pool_and_shares_are_credited() -> None:
    tables = BlockTables(40, 4, 20)
    h = Holdings(tables, cap=24, sink_blocks=1, records=8)
    kv = KVBudget(100, h)
    kept_lane(kv, tables, 1, 9, 20)  # 5 blocks: 0-4
    assert tables.page_out(9, 2) == Move(OUT, 2, 2, 0)
    assert kv.charge(9) == 16 and kv.kept_positions == 16  # 4 resident blocks, not 20
    kv.admit(0, 2, 50)  # a running lane: at most its quota and its step's block
    assert kv.charge(0) == 24 and kv.used == 40
    tables.share(0, 9, 18)  # 5 entries, one paged out
    kv.share(0, 9, 18)
    assert tables.table(0) == (0, 1, PAGED, 3, 4)
    assert kv.charge(0) == 24 - 16 and kv.used == 8 + 16  # its 4 resident ones are lane 9's
    tables.write(0, 18, 22)  # the partly shared block 4 copied: its own now
    assert kv.charge(0) == 24 - 12 and kv.used == 12 + 16
    plain = KVBudget(100)  # without KV Flash: positions
    plain.admit(0, 2, 50)
    plain.admit(1, 3, 20)
    plain.share(0, 1, 18)
    assert plain.charge(0) == 32 and plain.used == 52
    # Growth past the cap costs nothing more; admission asks the cap at most.
    assert kv.grow(0, 90) and kv.charge(0) == 12
    assert kv.admit(2, 4, 1000) and kv.charge(2) == 24 and kv.used == 12 + 16 + 24


def test_kept_lanes_page_out_least_recently_used_first_then_are_given_up() -> None:
    tables = BlockTables(40, 4, 20)
    h = Holdings(tables, cap=24, sink_blocks=1, records=6)
    kv = KVBudget(48, h)
    kept_lane(kv, tables, 0, 8, 16)  # blocks 0-3
    kept_lane(kv, tables, 1, 9, 12)
    assert (tables.table(8), tables.table(9)) == ((0, 1, 2, 3), (4, 5, 6))
    kv.touch(8)  # 9 is the least recently used now
    assert kv.used == 16 + 12
    assert kv.reclaim(24)  # 4 too many: lane 9 pages its blocks but the sink out
    assert h.take() == {9: (Move(OUT, 1, 5, 0), Move(OUT, 2, 6, 1))}
    assert tables.table(9) == (4, PAGED, PAGED) and list(kv.kept) == [9, 8]
    assert kv.charge(9) == 4 and kv.used == 20 and not kv.evicted
    assert kv.admit(0, 1, 30) and kv.used == 44  # charged its cap
    assert kv.reclaim(8)  # lane 9 holds only its sink: lane 8 pages out
    assert h.take() == {8: (Move(OUT, 1, 1, 2), Move(OUT, 2, 2, 3), Move(OUT, 3, 3, 4))}
    assert kv.used == 24 + 4 + 4 and h.host_records(kv.kept) == 5
    assert kv.reclaim(20)  # nothing pages: the least recently used is given up
    assert kv.evicted == [9] and list(kv.kept) == [8] and kv.used == 24 + 4


def test_a_kept_lane_is_given_up_when_the_records_run_out() -> None:
    tables = BlockTables(40, 4, 20)
    h = Holdings(tables, cap=24, sink_blocks=1, records=2)
    kv = KVBudget(40, h)
    kept_lane(kv, tables, 0, 8, 16)  # 3 blocks past its sink: more than 2 records
    kept_lane(kv, tables, 1, 9, 8)
    kv.touch(9)
    assert kv.reclaim(24) and kv.evicted == [8]  # 9 paged out, then 8 given up
    assert h.take() == {9: (Move(OUT, 1, 5, 0),)} and list(kv.kept) == [9]
    assert kv.used == 4


def test_a_finished_prompt_over_the_kept_limit_keeps_its_sinks_resident() -> None:
    """Under KV Flash the kept limit bounds what kept lanes hold resident: a prompt whose
    resident blocks pass it alone is kept with its blocks but the sink paged out first;
    a kept lane that holds only its sink is given up to make room."""
    tables = BlockTables(40, 4, 20)
    h = Holdings(tables, cap=24, sink_blocks=1, records=8)
    kv = KVBudget(1000, h)
    kept = FinishedPrefixes(kv, 8, limit=12)
    tokens = list(range(1, 21))
    kv.admit(0, 0, 20)
    tables.write(0, 0, 20)  # 5 blocks, 20 positions: more than the limit
    lane = kept.lane_for(tokens, 0)
    assert lane == 8 and tables.table(0) == (0, PAGED, PAGED, PAGED, PAGED)
    assert [m.block for m in h.take()[0]] == [1, 2, 3, 4]
    kv.keep(0, lane, 20)
    tables.share(lane, 0, 20)
    tables.free(0)
    assert kv.charge(lane) == 4 and kept.match([*tokens, 99]) == (8, 20)
    kv.admit(1, 1, 20)
    tables.write(1, 0, 20)
    other = kept.lane_for([t + 50 for t in tokens], 1)  # lane 8 holds only its sink
    assert other == 9 and kv.evicted == [8] and tables.table(1) == (1, PAGED, PAGED, PAGED, PAGED)


# -- without KV Flash: host records for the kept lanes only ----------------------------------


def test_without_kv_flash_running_lanes_pay_their_positions_and_kept_ones_what_is_resident() -> (
    None
):
    tables = BlockTables(40, 4, 8)
    h = Holdings(tables, cap=None, sink_blocks=1, records=8)
    kv = KVBudget(100, h)
    kept_lane(kv, tables, 1, 9, 18)  # 5 blocks: 0-4, the last one partly
    assert kv.charge(9) == 18  # whole: its positions, as without host records
    assert kv.reclaim(100 - 4)  # 14 too many: lane 9 pages its blocks but the first out
    assert h.take() == {9: tuple(Move(OUT, j, j, j - 1) for j in range(1, 5))}
    assert tables.table(9) == (0, PAGED, PAGED, PAGED, PAGED) and kv.charge(9) == 4
    assert kv.kept_positions == 18 and not kv.evicted  # the kept limit counts them all
    kv.admit(0, 2, 50)  # a running lane: its positions, however many
    assert kv.charge(0) == 50 and kv.used == 54
    tables.share(0, 9, 18)
    kv.share(0, 9, 18)
    # Credited only its first block: it pages the other four in, its own blocks.
    assert kv.charge(0) == 50 - 4 and kv.used == 50
    assert kv.grow(0, 60) and kv.charge(0) == 60 + 16 - 4


def test_without_kv_flash_kept_lanes_page_out_then_are_given_up_when_records_run_out() -> None:
    tables = BlockTables(40, 4, 4)
    h = Holdings(tables, cap=None, sink_blocks=1, records=4)
    kv = KVBudget(40, h)
    kept_lane(kv, tables, 0, 8, 16)  # blocks 0-3
    kept_lane(kv, tables, 1, 9, 12)  # blocks 4-6
    assert kv.used == 28 and kv.reclaim(20)  # lane 8 (least recently used) pages 3 out
    assert h.take() == {8: (Move(OUT, 1, 1, 0), Move(OUT, 2, 2, 1), Move(OUT, 3, 3, 2))}
    assert kv.used == 4 + 12 and list(kv.kept) == [8, 9]
    assert kv.reclaim(28)  # lane 9's two would pass the 4 records: lane 8 is given up
    assert kv.evicted == [8] and not h.take() and kv.used == 12
    tables.free(8)  # the workers free it: its records too
    assert kv.reclaim(36) and h.take() == {9: (Move(OUT, 1, 5, 0), Move(OUT, 2, 6, 1))}
    assert kv.used == 4 and list(kv.kept) == [9]


def test_without_kv_flash_the_kept_limit_counts_paged_out_positions() -> None:
    """The kept limit bounds the positions kept, paged out or not (the host records are
    sized by it): paging out makes no room under it, so a lane is given up instead."""
    tables = BlockTables(40, 4, 8)
    h = Holdings(tables, cap=None, sink_blocks=1, records=8)
    kv = KVBudget(1000, h)
    kept = FinishedPrefixes(kv, 8, limit=30)
    first = list(range(1, 21))
    kv.admit(0, 0, 20)
    tables.write(0, 0, 20)
    assert kept.lane_for(first, 0) == 8 and not h.take()  # kept whole, nothing paged
    kv.keep(0, 8, 20)
    tables.share(8, 0, 20)
    tables.free(0)
    assert h.page_out(8, kv.kept) and kept.paged == 16 and kv.kept_positions == 20
    kv.admit(1, 1, 20)
    tables.write(1, 0, 20)
    assert kept.lane_for([t + 50 for t in first], 1) == 9  # 40 > 30: lane 8 given up
    assert kv.evicted == [8] and tables.table(1) == (1, 2, 3, 4, 5)  # the slot stays whole
