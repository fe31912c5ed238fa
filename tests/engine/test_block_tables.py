"""The daemon's K/V block tables (engine/kv/blocks.py): exact block ids, reference counts,
copy-on-write at the first divergent block, host entries (page out / page in, exact
record ids), and a randomized run against a plain model."""

from __future__ import annotations

import random

import pytest

from luced.engine.kv.blocks import (
    ADOPT,
    IN,
    OUT,
    PAGED,
    SAVE,
    BlocksExhausted,
    BlockTables,
    Growth,
    Move,
    RecordsExhausted,
    pool_blocks,
)


def test_write_hands_out_the_lowest_free_blocks_and_covers_the_range() -> None:
    t = BlockTables(8, 4)
    assert t.write(0, 0, 6) == Growth((), (0, 1), 2)
    assert t.write(1, 0, 1) == Growth((), (2,), 1)
    assert t.write(0, 6, 8) == Growth((), (), 2)  # still inside block 1
    assert t.write(0, 8, 9) == Growth((), (3,), 3)
    t.free(1)
    assert t.write(2, 0, 4) == Growth((), (2,), 1)  # the freed block, lowest first
    assert (t.table(0), t.table(2), t.used_blocks, t.free_blocks) == ((0, 1, 3), (2,), 4, 4)


def test_share_retains_and_copy_on_write_moves_the_first_divergent_block() -> None:
    t = BlockTables(8, 4)
    t.write(0, 0, 10)  # blocks 0, 1, 2
    t.share(1, 0, 6)  # positions 0-5: block 0 whole, block 1 in part
    assert t.table(1) == (0, 1)
    assert [t.refs(b) for b in range(4)] == [2, 2, 1, 0]
    # lane 1 writes its own position 6, inside the shared block 1: it moves to a copy
    assert t.write(1, 6, 7) == Growth(((1, 1, 3),), (), 2)
    assert t.table(1) == (0, 3) and [t.refs(b) for b in range(4)] == [2, 1, 1, 1]
    # writing on inside its own block copies nothing; past it, a new block
    assert t.write(1, 7, 9) == Growth((), (4,), 3)
    # the source rewriting its shared first block copies it too
    assert t.write(0, 2, 3) == Growth(((0, 0, 5),), (), 3)
    assert t.table(0) == (5, 1, 2) and t.refs(0) == 1


def test_a_source_writing_first_copies_the_shared_partial_block() -> None:
    t = BlockTables(4, 4)
    t.write(0, 0, 6)
    t.share(1, 0, 6)
    assert t.write(0, 6, 7) == Growth(((1, 1, 2),), (), 2)  # the source moves, not lane 1
    assert t.table(1) == (0, 1) and t.refs(1) == 1  # lane 1 now writes in place
    assert t.write(1, 6, 7) == Growth((), (), 2)


def test_truncate_releases_blocks_wholly_past_and_free_all() -> None:
    t = BlockTables(8, 4)
    t.write(0, 0, 13)  # 0, 1, 2, 3
    t.share(1, 0, 13)
    t.truncate(0, 5)  # keeps positions 0-7: blocks 0, 1
    assert t.table(0) == (0, 1) and [t.refs(b) for b in range(4)] == [2, 2, 1, 1]
    t.truncate(0, 4)
    assert t.table(0) == (0,)
    t.free(1)
    assert [t.refs(b) for b in range(4)] == [1, 0, 0, 0] and t.free_blocks == 7
    t.free(0)
    assert t.lanes == [] and t.free_blocks == 8
    t.free(5)  # a lane that holds nothing: nothing to do


def test_exhaustion_is_a_clear_error_and_changes_nothing() -> None:
    t = BlockTables(3, 4)
    t.write(0, 0, 8)
    t.share(1, 0, 8)
    with pytest.raises(BlocksExhausted, match=r"lane 1's positions \[4, 12\) need 2 more"):
        t.write(1, 4, 12)  # a copy of block 1 and a new block: only one is free
    assert t.table(1) == (0, 1) and t.free_blocks == 1 and t.refs(1) == 2


def test_share_and_write_refuse_what_is_not_held() -> None:
    t = BlockTables(4, 4)
    t.write(0, 0, 4)
    with pytest.raises(ValueError, match="not 5 positions"):
        t.share(1, 0, 5)
    t.share(1, 0, 4)
    with pytest.raises(ValueError, match="free it first"):
        t.share(1, 0, 4)
    with pytest.raises(ValueError, match="a write over"):
        t.write(0, 5, 4)


def test_page_out_and_in_take_the_lowest_free_record_and_block() -> None:
    t = BlockTables(6, 4, records=3)
    t.write(0, 0, 12)  # blocks 0, 1, 2
    t.write(1, 0, 8)  # blocks 3, 4
    assert t.page_out(0, 1) == Move(OUT, index=1, block=1, record=0)
    assert (t.table(0), t.host(0), t.refs(1)) == ((0, PAGED, 2), {1: 0}, 0)
    assert (t.free_blocks, t.used_records, t.free_records) == (2, 1, 2)
    assert t.page_out(1, 0) == Move(OUT, 0, 3, 1)
    assert t.write(1, 8, 9) == Growth((), (1,), 3)  # the freed block 1, lowest first
    assert t.page_in(0, 1) == Move(IN, index=1, block=3, record=0)
    assert (t.table(0), t.host(0), t.refs(3)) == ((0, 3, 2), {}, 1)
    assert t.page_out(0, 2) == Move(OUT, 2, 2, 0)  # record 0 is free again
    assert tuple(t.page_out(0, 0)) == (0, 0, 0, 2)  # a tuple of ints on the wire
    assert (t.table(0), t.host(0), t.resident(0), t.resident_prefix(0)) == (
        (PAGED, 3, PAGED),
        {0: 2, 2: 0},
        [1],
        0,
    )
    assert (t.table(1), t.resident(1), t.resident_prefix(1)) == ((PAGED, 4, 1), [1, 2], 0)
    assert (t.used_records, t.free_records, t.used_blocks) == (3, 0, 3)


def test_a_shared_block_paged_out_stays_for_the_tables_sharing_it() -> None:
    t = BlockTables(4, 4, records=2)
    t.write(0, 0, 8)  # blocks 0, 1
    t.share(1, 0, 8)
    assert t.page_out(1, 0) == Move(OUT, 0, 0, 0)
    assert (t.table(1), t.table(0), t.refs(0), t.free_blocks) == ((PAGED, 1), (0, 1), 1, 2)
    assert t.page_in(1, 0) == Move(IN, 0, 2, 0)  # its copy, into a block of its own
    assert (t.table(1), t.refs(0), t.refs(2), t.free_records) == ((2, 1), 1, 1, 2)


def test_paging_refuses_missing_blocks_and_exhaustion_changes_nothing() -> None:
    t = BlockTables(3, 4, records=1)
    t.write(0, 0, 8)
    t.share(1, 0, 4)  # block 0
    with pytest.raises(ValueError, match="lane 0 holds 2 blocks: it has no block 2"):
        t.page_out(0, 2)
    with pytest.raises(ValueError, match="lane 0's block 1 is resident"):
        t.page_in(0, 1)
    t.page_out(0, 1)
    with pytest.raises(ValueError, match="lane 0's block 1 is paged out already"):
        t.page_out(0, 1)
    t.write(1, 4, 8)  # the freed block 1
    t.write(2, 0, 4)  # block 2: the pool is full
    with pytest.raises(RecordsExhausted, match="lane 2's block 0 needs a record, all 1"):
        t.page_out(2, 0)
    assert (t.table(2), t.refs(2), t.free_records) == ((2,), 1, 0)
    with pytest.raises(BlocksExhausted, match="lane 0's paged-out block 1 need 1 more"):
        t.page_in(0, 1)
    assert (t.table(0), t.host(0), t.free_records, t.free_blocks) == ((0, PAGED), {1: 0}, 0, 0)


def test_write_refuses_a_paged_entry_it_would_reach() -> None:
    t = BlockTables(8, 4, records=4)
    t.write(0, 0, 12)  # blocks 0, 1, 2
    t.page_out(0, 1)  # record 0
    with pytest.raises(ValueError, match=r"\[6, 9\) reach its paged-out blocks \[1\]"):
        t.write(0, 6, 9)
    assert (t.table(0), t.free_blocks) == ((0, PAGED, 2), 6)
    assert t.write(0, 8, 13) == Growth((), (1,), 4)  # past it: a paged entry untouched
    assert t.resident_prefix(0) == 1


def test_a_share_retains_the_records_of_paged_entries_too() -> None:
    t = BlockTables(8, 4, records=4)
    t.write(0, 0, 16)  # blocks 0..3
    t.page_out(0, 1)  # record 0
    t.page_out(0, 2)  # record 1
    t.share(1, 0, 10)  # logical 0, 1, 2: block 0, records 0 and 1
    assert (t.table(1), t.host(1), t.refs(0)) == ((0, PAGED, PAGED), {1: 0, 2: 1}, 2)
    assert (t.record_refs(0), t.record_refs(1), t.free_records) == (2, 2, 2)
    # Paging in from a shared record copies it into a fresh block: the record stays.
    assert t.page_in(1, 2) == Move(IN, 2, 1, 1)
    assert (t.table(1), t.host(1), t.record_refs(1), t.free_records) == (
        (0, PAGED, 1),
        {1: 0},
        1,
        2,
    )
    assert t.host(0) == {1: 0, 2: 1}  # the source's entries are as they were
    assert t.page_out(1, 2) == Move(OUT, 2, 1, 2)  # a record of its own, the lowest free
    # A record is free at its last release, whichever table releases it last.
    t.free(0)  # record 1 goes (lane 1 paged it in), record 0 stays for lane 1
    assert (t.free_records, t.record_refs(0), t.record_refs(1), t.refs(0)) == (2, 1, 0, 1)
    t.share(2, 1, 12)  # block 0, records 0 and 2
    t.truncate(1, 4)  # lane 1 keeps block 0 only
    assert (t.host(2), t.record_refs(0), t.record_refs(2), t.free_records) == (
        {1: 0, 2: 2},
        1,
        1,
        2,
    )
    t.free(2)
    assert (t.free_records, t.refs(0), t.table(1)) == (4, 1, (0,))
    t.free(1)
    assert (t.lanes, t.free_records, t.free_blocks) == ([], 4, 8)


def test_truncate_and_free_release_the_records_of_paged_entries() -> None:
    t = BlockTables(8, 4, records=4)
    t.write(0, 0, 16)  # blocks 0..3
    t.page_out(0, 1)  # record 0
    t.page_out(0, 3)  # record 1
    t.truncate(0, 8)  # drops logical 2 (block 2) and 3 (record 1)
    assert (t.table(0), t.host(0), t.free_records) == ((0, PAGED), {1: 0}, 3)
    assert t.page_out(0, 0) == Move(OUT, 0, 0, 1)  # the released record, lowest first
    t.free(0)
    assert (t.lanes, t.host(0), t.free_records, t.free_blocks) == ([], {}, 4, 8)


def test_save_copies_a_resident_block_to_a_record_the_caller_holds() -> None:
    """A save takes the lowest free record for the caller (refcount 1) and leaves the table
    and its blocks as they were; the record is free at the caller's release only."""
    t = BlockTables(6, 4, records=3)
    t.write(0, 0, 12)  # blocks 0, 1, 2
    t.page_out(0, 2)  # record 0
    assert t.save(0, 1) == Move(SAVE, index=1, block=1, record=1)
    assert t.save(0, 0) == Move(SAVE, 0, 0, 2)
    assert (t.table(0), t.host(0), t.refs(0), t.refs(1)) == ((0, 1, PAGED), {2: 0}, 1, 1)
    assert [t.record_refs(r) for r in range(3)] == [1, 1, 1] and t.free_records == 0
    t.release_record(1)
    assert (t.record_refs(1), t.free_records, t.hold_record()) == (0, 1, 1)
    t.free(0)  # the table's record goes; the held ones stay
    assert [t.record_refs(r) for r in range(3)] == [0, 1, 1] and t.free_records == 1


def test_save_refuses_what_it_cannot_and_changes_nothing() -> None:
    t = BlockTables(4, 4, records=1)
    t.write(0, 0, 8)
    t.page_out(0, 1)  # record 0: none is free now
    with pytest.raises(RecordsExhausted, match="all 1 records are used"):
        t.save(0, 0)
    with pytest.raises(RecordsExhausted):
        t.hold_record()
    with pytest.raises(ValueError, match="lane 0's block 1 is paged out: nothing to save"):
        t.save(0, 1)
    with pytest.raises(ValueError, match="lane 0 holds 2 blocks: it has no block 2"):
        t.save(0, 2)
    with pytest.raises(ValueError, match="host record 3 is not held"):
        t.release_record(3)  # past the records
    assert (t.table(0), t.host(0), t.record_refs(0), t.free_records) == ((0, PAGED), {1: 0}, 1, 0)


def test_adopt_appends_paged_entries_that_retain_held_records() -> None:
    """Records held by the caller (read from disk) become an empty lane's logical blocks
    0 and 1, PAGED; the caller's release leaves them to the table, whose page-ins take
    the lowest free blocks and free the records. A lane holding blocks appends after them."""
    t = BlockTables(6, 4, records=4)
    held = [t.hold_record(), t.hold_record()]
    assert held == [0, 1]
    assert t.adopt(3, held) == [Move(ADOPT, 0, PAGED, 0), Move(ADOPT, 1, PAGED, 1)]
    assert (t.table(3), t.host(3), t.record_refs(0), t.record_refs(1)) == (
        (PAGED, PAGED), {0: 0, 1: 1}, 2, 2,
    )  # fmt: skip
    for r in held:
        t.release_record(r)
    assert (t.record_refs(0), t.free_records, t.lanes) == (1, 2, [3])
    assert t.page_in(3, 0) == Move(IN, 0, 0, 0)
    assert t.page_in(3, 1) == Move(IN, 1, 1, 1)
    assert (t.table(3), t.free_records, t.used_blocks) == ((0, 1), 4, 2)
    # A lane with blocks of its own appends after them; a shared record is counted twice.
    t.write(4, 0, 4)  # block 2
    r = t.hold_record()
    assert t.adopt(4, [r]) == [Move(ADOPT, 1, PAGED, r)]
    assert t.adopt(5, [r]) == [Move(ADOPT, 0, PAGED, r)]
    assert (t.table(4), t.record_refs(r)) == ((2, PAGED), 3)
    t.release_record(r)
    t.free(4)
    t.free(5)
    assert (t.record_refs(r), t.free_records) == (0, 4)


class HeldForLater:
    """Records held only to be reused later, given up on demand, least recently held
    first (as the block store's memory tier): the tables' `reclaimer`."""

    def __init__(self, tables: BlockTables, n: int) -> None:
        self.tables = tables
        self.records = [tables.hold_record() for _ in range(n)]

    def spare(self) -> int:
        return sum(1 for r in self.records if self.tables.record_refs(r) == 1)

    def reclaim(self, n: int) -> int:
        gone = [r for r in self.records if self.tables.record_refs(r) == 1][:n]
        for r in gone:
            self.records.remove(r)
            self.tables.release_record(r)
        return len(gone)


def test_records_held_for_later_are_given_up_when_none_is_free() -> None:
    """Every record held by a reclaimer: they count as available but those someone else
    holds too (`retain_record`); a page-out, a save and a hold each take the oldest spare
    one, and with none spare a hold is refused."""
    t = BlockTables(8, 4, records=3)
    held = HeldForLater(t, 3)
    t.reclaimer = held
    assert (t.free_records, t.available_records) == (0, 3)
    t.retain_record(0)  # e.g. a lane adopting it: not given up
    assert (t.record_refs(0), t.available_records) == (2, 2)
    t.write(1, 0, 8)  # blocks 0, 1
    assert t.page_out(1, 1) == Move(OUT, 1, 1, 1) and held.records == [0, 2]
    assert t.save(1, 0) == Move(SAVE, 0, 0, 2) and held.records == [0]
    with pytest.raises(RecordsExhausted, match="all 3 records are used"):
        t.hold_record()
    t.release_record(0)  # the reclaimer's hold only: spare again
    assert (t.available_records, t.hold_record(), held.records) == (1, 0, [])
    with pytest.raises(ValueError, match="host record 7 is not held"):
        t.retain_record(7)


def test_records_are_resized_before_any_is_used() -> None:
    t = BlockTables(4, 4, records=2)
    t.resize_records(5)
    assert (t.records, t.free_records, t.hold_record()) == (5, 5, 0)
    with pytest.raises(ValueError, match="1 host records are in use: too late to resize"):
        t.resize_records(2)


def test_adopt_refuses_records_not_held_and_changes_nothing() -> None:
    t = BlockTables(4, 4, records=3)
    r = t.hold_record()
    with pytest.raises(ValueError, match="host record 1 is not held"):
        t.adopt(0, [r, 1])
    with pytest.raises(ValueError, match="host record 7 is not held"):
        t.adopt(0, [7])
    with pytest.raises(ValueError, match=r"records \[0, 0\] name one twice"):
        t.adopt(0, [r, r])
    assert (t.table(0), t.host(0), t.record_refs(r), t.lanes) == ((), {}, 1, [])
    assert t.adopt(0, []) == [] and t.lanes == []


def test_pool_blocks_bound_holds_for_shared_lanes_at_their_charge() -> None:
    """Lanes charged as the KV account charges them never exhaust `pool_blocks`: each
    shares an odd prefix of the one before (a partly shared block each), decodes ahead
    one position past its charge, and the partial last blocks all round up."""
    block, lanes, prompt = 16, 4, 37
    positions = prompt + (lanes - 1) * 3  # the first pays the prompt, each sharer 3 more
    t = BlockTables(pool_blocks(positions, lanes, block), block)
    t.write(0, 0, prompt + 1)
    for lane in range(1, lanes):
        n = prompt - lane  # its source's first n
        t.share(lane, lane - 1, n)
        t.write(lane, n, n + 3 + 1)  # its own 3, and one decoded ahead: BlocksExhausted if short


def test_matches_a_plain_model_under_random_operations() -> None:
    """Every operation against a model of lists of positions' owners: the tables map each
    lane's positions to blocks no other lane writes, refcounts count the tables, the free
    blocks are exactly those no table holds, and a record's count is the PAGED entries
    naming it (shares retain records as they retain blocks) plus the holds of the caller
    (the block store's saves, adopted into lanes as a restore adopts them)."""
    rng = random.Random(7)
    block, n_blocks, records = 4, 40, 12
    t = BlockTables(n_blocks, block, records)
    held: dict[int, int] = {}  # lane -> positions it holds (its table covers them)
    store: list[int] = []  # records the caller holds
    for _ in range(4000):
        lane = rng.randrange(6)
        op = rng.random()
        try:
            if op < 0.5:
                start = rng.randrange(held.get(lane, 0) + 1)
                end = start + rng.randrange(1, 9)
                before = t.table(lane)
                if PAGED in before[start // block : -(-end // block)]:
                    with pytest.raises(ValueError, match="page them in first"):
                        t.write(lane, start, end)
                    assert t.table(lane) == before
                    continue
                g = t.write(lane, start, end)
                after = t.table(lane)
                assert g.length == len(after) == max(len(before), -(-end // block))
                assert after[len(before) :] == g.blocks
                for j, src, dst in g.copies:
                    assert before[j] == src and after[j] == dst
                    assert start // block <= j < -(-end // block)
                held[lane] = max(held.get(lane, 0), end)
                for j in range(start // block, -(-end // block)):  # writable alone
                    assert t.refs(after[j]) == 1
            elif op < 0.65 and held:
                source = rng.choice(list(held))
                if source == lane:
                    continue
                n = rng.randrange(held[source] + 1)
                t.free(lane)
                held.pop(lane, None)
                t.share(lane, source, n)  # paged entries too: their records retained
                assert t.table(lane) == t.table(source)[: -(-n // block)]
                assert t.host(lane) == {
                    j: r for j, r in t.host(source).items() if j < -(-n // block)
                }
                held[lane] = n
            elif op < 0.8 and lane in held:
                n = rng.randrange(held[lane] + 1)
                t.truncate(lane, n)
                assert t.length(lane) == min(-(-n // block), -(-held[lane] // block))
                held[lane] = min(held[lane], t.length(lane) * block)
            elif op < 0.84 and t.length(lane):
                j = rng.randrange(t.length(lane))
                before = t.table(lane)
                if before[j] == PAGED:
                    with pytest.raises(ValueError, match="nothing to save"):
                        t.save(lane, j)
                    continue
                move = t.save(lane, j)
                assert move == Move(SAVE, j, before[j], move.record) and t.table(lane) == before
                store.append(move.record)
            elif op < 0.87 and store:
                if held.get(lane, 0) != t.length(lane) * block:
                    continue  # a restore adopts onto whole blocks
                some = rng.sample(store, rng.randrange(1, min(3, len(store)) + 1))
                n = t.length(lane)
                moves = t.adopt(lane, some)
                assert moves == [Move(ADOPT, n + i, PAGED, r) for i, r in enumerate(some)]
                held[lane] = t.length(lane) * block
            elif op < 0.88 and store:
                t.release_record(store.pop(rng.randrange(len(store))))
            elif op < 0.9 and t.length(lane):
                j = rng.randrange(t.length(lane))
                before, entry = t.table(lane), t.entry(lane, j)
                if entry == PAGED:
                    record = t.host(lane)[j]
                    move = t.page_in(lane, j)
                    assert move == Move(IN, j, move.block, record) and t.entry(lane, j) >= 0
                else:
                    refs = t.refs(entry)
                    move = t.page_out(lane, j)
                    assert move == Move(OUT, j, entry, t.host(lane)[j])
                    assert t.refs(entry) == refs - 1  # a shared block stays for the others
                after = t.table(lane)
                assert [x for i, x in enumerate(after) if i != j] == [
                    x for i, x in enumerate(before) if i != j
                ]
            else:
                t.free(lane)
                held.pop(lane, None)
        except (BlocksExhausted, RecordsExhausted):
            pass
        counts = [0] * n_blocks
        record_counts = [0] * records
        for r in store:
            record_counts[r] += 1
        for other in range(6):
            host = t.host(other)
            assert sorted(host) == [j for j, b in enumerate(t.table(other)) if b == PAGED]
            for r in host.values():
                record_counts[r] += 1
            for b in t.table(other):
                if b != PAGED:
                    counts[b] += 1
        assert counts == [t.refs(b) for b in range(n_blocks)]
        assert t.free_blocks == counts.count(0)
        assert t.free_blocks + t.used_blocks == n_blocks
        assert record_counts == [t.record_refs(r) for r in range(records)]
        assert t.free_records == record_counts.count(0)
        assert t.free_records + t.used_records == records
