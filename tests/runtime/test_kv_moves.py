"""A frame's moves applied in runs (`PagedKVCache.apply_moves`, `kv_host.runs`: one gather
and one scatter per stored layer for many blocks) against a plain reference written here,
which copies one block of one layer at a time by the record layout (kv_host's docstring),
and against the same moves applied one by one: every pool row, every record byte, the
table, the reference counts, the positions, the row map and the `qk` block keys come out
the same. The moves are random mixed lists (out, in, save, adopt) for a lane that shares
two blocks with another, with records and blocks named again within a list (an OUT of
block b then an IN into b, a record written twice) and pool growth, on one shard and on a
split worker's shards, side by side in each record. A bad move anywhere in a list changes
nothing."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

from luced.runtime.kv_blocks import (
    MOVE_ADOPT,
    MOVE_IN,
    MOVE_OUT,
    MOVE_SAVE,
    PAGED,
    BlockPool,
    PagedKVCache,
)
from luced.runtime.kv_host import SharedHostTier, _stretches, runs

BLOCK = 4
CAPACITY = 24 * BLOCK
MAX_BLOCKS = 20
RECORDS = 40
# Per shard: stored layer -> (Hkv, D), shapes that differ so that a layout slip shows.
WHOLE = ({0: (2, 4), 1: (1, 8), 2: (3, 2)},)
SPLIT = ({0: (2, 4), 1: (1, 8)}, {2: (3, 2), 3: (2, 6), 4: (1, 4)})
Moves = list[tuple[int, int, int, int]]


@dataclass
class Shard:
    pool: BlockPool
    lane: PagedKVCache  # the moves' lane: blocks 0..5, its qk keys kept on shard 0
    other: PagedKVCache  # shares the lane's blocks 0 and 1, holds 6 and 7
    host: SharedHostTier


def worker(shapes: tuple[dict[int, tuple[int, int]], ...], dtype: torch.dtype) -> list[Shard]:
    """A worker's shards, each a pool with room for 8 blocks (up to MAX_BLOCKS) of random
    rows and its two lanes, over host records of random bytes (the shards side by side,
    then 8 bytes no shard owns). The same every call."""
    gen = torch.Generator().manual_seed(3)
    made, offsets = [], [0]
    for i, layers in enumerate(shapes):
        pool = BlockPool(layers, dtype, block=BLOCK, initial_blocks=8, max_blocks=MAX_BLOCKS)
        for t in (*pool.k.values(), *pool.v.values()):
            t.copy_(torch.randn(t.shape, generator=gen))
        span = range(min(layers), max(layers) + 1)
        lane = PagedKVCache(pool, span, CAPACITY, scored=i == 0)
        other = PagedKVCache(pool, span, CAPACITY)
        lane.follow((), range(6))
        lane.reserve(0, 6 * BLOCK)
        for layer in lane.stored:  # its rows as they are, which seals its blocks' keys
            k, v = (t[layer][:, : 6 * BLOCK].transpose(0, 1).clone() for t in (pool.k, pool.v))
            lane.store(layer, 0, k, v)
        lane.commit(6 * BLOCK)
        other.share(lane, 2 * BLOCK)
        other.follow((), (6, 7))
        made.append((pool, lane, other))
        offsets.append(offsets[-1] + pool.block_nbytes())
    records = torch.randint(0, 256, (RECORDS, offsets[-1] + 8), generator=gen, dtype=torch.uint8)
    return [
        Shard(pool, lane, other, SharedHostTier(records, at, pool.block_nbytes()))
        for (pool, lane, other), at in zip(made, offsets, strict=False)
    ]


def random_moves(rng: random.Random, n: int) -> Moves:
    """n moves valid in order for the lane as `worker` makes it, in bursts of one kind (a
    frame's page-outs, page-ins, saves, adopts): outs (of shared blocks too), ins (more
    often than not into a block an out of the list released), saves, adopts (the lane's
    positions are whole blocks). Half the bursts take the next blocks and records, as the
    daemon's lowest free ones come (copied as slices), the others random ones (some named
    again; copied by gather and scatter)."""
    table = list(range(6))
    refs = dict.fromkeys(range(8), 1) | {0: 2, 1: 2}
    released: list[int] = []
    moves: Moves = []
    while len(moves) < n:
        kind, ordered = rng.choice((MOVE_OUT, MOVE_IN, MOVE_SAVE, MOVE_ADOPT)), rng.random() < 0.5
        record, j, block = rng.randrange(RECORDS), -1, -1
        for _ in range(rng.randint(1, 6)):
            record = (record + 1) % RECORDS if ordered else rng.randrange(RECORDS)
            resident = [i for i, b in enumerate(table) if b != PAGED]
            paged = [i for i, b in enumerate(table) if b == PAGED]
            after = [i for i in resident if i > j]
            if kind in (MOVE_OUT, MOVE_SAVE) and resident:
                if ordered and j >= 0 and not (after and table[after[0]] == table[j] + 1):
                    break  # the next block is not the next logical one's
                j = after[0] if ordered and after else rng.choice(resident)
                moves.append((kind, j, table[j], record))
                if kind == MOVE_OUT:
                    refs[table[j]] -= 1
                    released += [table[j]] * (not refs[table[j]])
                    table[j] = PAGED
            elif kind == MOVE_IN and paged:
                free = [b for b in range(MAX_BLOCKS) if not refs.get(b)]
                again = [b for b in released if not refs.get(b)]
                if ordered and block >= 0:
                    if block + 1 not in free:
                        break
                    block += 1
                else:
                    block = rng.choice(again if again and rng.random() < 0.6 else free)
                j = rng.choice(paged)
                moves.append((kind, j, block, record))
                refs[block], table[j] = 1, block
            elif kind == MOVE_ADOPT and len(table) < CAPACITY // BLOCK:
                moves.append((kind, len(table), PAGED, record))
                table.append(PAGED)
    return moves


def reference(shard: Shard, moves: Moves) -> tuple[dict, dict, torch.Tensor, list[int]]:
    """The moves made by hand, one block of one layer at a time, by the record layout (per
    stored layer in order: K rows [Hkv, BLOCK, D], then V, raw bytes): the pool's K and V
    (rows for every block the pool may hold), the shard's bytes of the records, the table."""
    pool = shard.pool
    k, v = {}, {}
    for kv, out in ((pool.k, k), (pool.v, v)):
        for layer, t in kv.items():
            out[layer] = torch.zeros((t.shape[0], MAX_BLOCKS * BLOCK, t.shape[2]), dtype=t.dtype)
            out[layer][:, : pool.n_blocks * BLOCK] = t[:, : pool.n_blocks * BLOCK]
    records = shard.host.rows.clone()
    table = list(shard.lane.table)
    for kind, j, block, record in moves:
        cut, at = slice(block * BLOCK, (block + 1) * BLOCK), 0
        for layer in pool.shapes:
            for t in (k[layer], v[layer]):
                size = t[:, cut].numel() * t.element_size()
                if kind in (MOVE_OUT, MOVE_SAVE):
                    records[record, at : at + size] = (
                        t[:, cut].contiguous().view(-1).view(torch.uint8)
                    )
                elif kind == MOVE_IN:
                    t[:, cut] = records[record, at : at + size].view(t.dtype).view(t[:, cut].shape)
                at += size
        if kind == MOVE_ADOPT:
            table.append(PAGED)
        elif kind != MOVE_SAVE:
            table[j] = block if kind == MOVE_IN else PAGED
    return k, v, records, table


def state(shard: Shard) -> dict:
    """What the moves may change, besides the rows: the lanes' tables, positions and row
    maps, the pool's counts and size, the lane's qk keys."""
    lane, qk = shard.lane, shard.lane.qk
    return {
        "tables": (list(lane.table), list(shard.other.table)),
        "pos": (lane.pos, lane.paged_blocks, shard.other.pos),
        "rows": lane.rows.tolist(),
        "refs": [shard.pool.refs(b) for b in range(MAX_BLOCKS)],
        "n_blocks": shard.pool.n_blocks,
        # As bits: an adopted block's key is sealed from its record's bytes (random here,
        # so some are NaN, which equals nothing).
        "qk": None
        if qk is None
        else ({i: t.view(torch.int32).tolist() for i, t in qk.keys.items()}, qk.sealed.tolist()),
    }


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def check(moves: Moves, shapes, dtype: torch.dtype) -> None:
    batched, one_by_one = worker(shapes, dtype), worker(shapes, dtype)
    expect = [reference(s, moves) for s in batched]
    for s in batched:
        s.lane.apply_moves(moves, s.host.rows)
    for s in one_by_one:
        for kind, j, block, record in moves:
            s.lane.move(kind, j, block, s.host.rows[record])
    assert torch.equal(batched[0].host.records, one_by_one[0].host.records)
    for a, b, (k, v, records, table) in zip(batched, one_by_one, expect, strict=True):
        assert state(a) == state(b)
        assert a.lane.table == table
        assert torch.equal(a.host.rows, records)
        rows = a.pool.n_blocks * BLOCK  # the scratch block past them is no block's
        for layer in a.pool.shapes:
            for got, one, want in ((a.pool.k, b.pool.k, k), (a.pool.v, b.pool.v, v)):
                assert torch.equal(bits(got[layer]), bits(one[layer])), layer
                assert torch.equal(bits(got[layer][:, :rows]), bits(want[layer][:, :rows]))


SHAPES = pytest.mark.parametrize("shapes", [WHOLE, SPLIT], ids=["whole", "split"])


@SHAPES
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_list_with_blocks_and_records_named_again_equals_one_by_one(shapes, dtype) -> None:
    """Blocks 2 and 3 out to record 0 (written twice: the second wins), back in crosswise
    (an IN into the block the list just released), a save, an adopt paged in past the
    pool's 8 blocks (it grows), then shared block 0 out (the other lane keeps it): cut into
    runs where a kind changes or a record comes again."""
    moves = [
        (MOVE_OUT, 2, 2, 0),
        (MOVE_OUT, 3, 3, 0),
        (MOVE_OUT, 4, 4, 1),
        (MOVE_IN, 2, 3, 0),
        (MOVE_IN, 3, 2, 1),
        (MOVE_IN, 4, 9, 1),
        (MOVE_SAVE, 5, 5, 4),
        (MOVE_ADOPT, 6, PAGED, 5),
        (MOVE_ADOPT, 7, PAGED, 6),
        (MOVE_IN, 6, 15, 5),
        (MOVE_IN, 7, 11, 6),
        (MOVE_OUT, 0, 0, 7),
    ]
    assert [len(run) for run in runs(moves)] == [1, 2, 2, 1, 1, 2, 2, 1]
    check(moves, shapes, dtype)


@SHAPES
def test_stretches_of_blocks_and_records_copy_as_slices_and_equal_one_by_one(shapes) -> None:
    """Runs of the next blocks to the next records, as the daemon's lowest free ones come:
    all six out to records 30..35 (one stretch: slices), eight adopted records paged into
    blocks 8..11 and 14..17 (two stretches of four: slices), a save, the six back into
    blocks 2..5 and 18, 19 (stretches too short: gather and scatter)."""
    out = [(MOVE_OUT, j, j, 30 + j) for j in range(6)]
    stored = (10, 11, 12, 13, 20, 21, 22, 23)
    adopt = [(MOVE_ADOPT, 6 + i, PAGED, r) for i, r in enumerate(stored)]
    into = (8, 9, 10, 11, 14, 15, 16, 17)
    ins = [(MOVE_IN, 6 + i, b, r) for i, (b, r) in enumerate(zip(into, stored, strict=True))]
    back = [(MOVE_IN, j, b, 30 + j) for j, b in enumerate((2, 3, 4, 5, 18, 19))]
    moves = [*out, *adopt, *ins, (MOVE_SAVE, 6, 8, 36), *back]
    assert [len(run) for run in runs(moves)] == [6, 8, 8, 1, 6]
    assert _stretches(range(6), range(30, 36)) == [(0, 30, 6)]
    assert _stretches(into, stored) == [(8, 10, 4), (14, 20, 4)]
    assert _stretches([2, 3, 4, 5, 18, 19], range(30, 36)) is None
    check(moves, shapes, torch.float32)


@SHAPES
@pytest.mark.parametrize("seed", range(8))
def test_random_mixed_lists_equal_one_by_one_and_the_reference(shapes, seed: int) -> None:
    check(random_moves(random.Random(seed), 32), shapes, torch.float32)


@SHAPES
@pytest.mark.parametrize(
    ("last", "match"),
    [
        ((MOVE_IN, 3, 9, 1), "block 9 is held already"),
        ((MOVE_SAVE, 0, 0, RECORDS), rf"host records \[{RECORDS}\] outside"),
        ((7, 0, 0, 1), "unknown move kind 7"),
    ],
    ids=["held", "record", "kind"],
)
def test_a_bad_move_after_good_ones_changes_nothing(shapes, last, match) -> None:
    """Good moves (out, in, save, out), then one that is not: into a block the list took
    already, a record past the host records, an unknown kind. Refused before any copy:
    the rows, the records, the tables as they were."""
    good = [(MOVE_OUT, 2, 2, 0), (MOVE_IN, 2, 9, 0), (MOVE_SAVE, 1, 1, 3), (MOVE_OUT, 3, 3, 1)]
    shards, fresh = worker(shapes, torch.float32), worker(shapes, torch.float32)
    for s in shards:
        with pytest.raises(ValueError, match=match):
            s.lane.apply_moves([*good, last], s.host.rows)
    assert torch.equal(shards[0].host.records, fresh[0].host.records)
    for a, b in zip(shards, fresh, strict=True):
        assert state(a) == state(b)
        for layer in a.pool.shapes:
            assert torch.equal(a.pool.k[layer], b.pool.k[layer])
            assert torch.equal(a.pool.v[layer], b.pool.v[layer])
