"""The daemon's K/V block tables (engine/kv/blocks.py): exact block ids, reference counts,
copy-on-write at the first divergent block, and a randomized run against a plain model."""

from __future__ import annotations

import random

import pytest

from luced.engine.kv.blocks import BlocksExhausted, BlockTables, Growth, pool_blocks


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
    lane's positions to blocks no other lane writes, refcounts count the tables, and the
    free blocks are exactly those no table holds."""
    rng = random.Random(7)
    block, n_blocks = 4, 40
    t = BlockTables(n_blocks, block)
    held: dict[int, int] = {}  # lane -> positions it holds (its table covers them)
    for _ in range(3000):
        lane = rng.randrange(6)
        op = rng.random()
        try:
            if op < 0.5:
                start = rng.randrange(held.get(lane, 0) + 1)
                end = start + rng.randrange(1, 9)
                before = t.table(lane)
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
                t.share(lane, source, n)
                assert t.table(lane) == t.table(source)[: -(-n // block)]
                held[lane] = n
            elif op < 0.8 and lane in held:
                n = rng.randrange(held[lane] + 1)
                t.truncate(lane, n)
                assert t.length(lane) == min(-(-n // block), -(-held[lane] // block))
                held[lane] = min(held[lane], t.length(lane) * block)
            else:
                t.free(lane)
                held.pop(lane, None)
        except BlocksExhausted:
            pass
        counts = [0] * n_blocks
        for other in range(6):
            for b in t.table(other):
                counts[b] += 1
        assert counts == [t.refs(b) for b in range(n_blocks)]
        assert t.free_blocks == counts.count(0)
