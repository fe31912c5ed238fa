"""Snapshot arena: exact block offsets, first fit, coalescing, region layout, shared views."""

from __future__ import annotations

import itertools
import random
import secrets
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from luced.cache.arena import Block, SnapshotArena, layout_bytes
from luced.cache.layout import TensorSpec
from luced.ipc.regions import Region
from luced.ipc.shm import HEADER_SIZE, Segment, ShmOwner

SPECS = [
    TensorSpec("k.0", (2, 1, 8), "bfloat16", 1),  # [kv_heads, tokens, head_dim]
    TensorSpec("v.0", (2, 1, 8), "bfloat16", 1),
    TensorSpec("ring", (1, 3, 5), "float32", 0),  # [tokens, n_capture, hidden]
    TensorSpec("tokens", (1,), "int32", 0),
]


@pytest.fixture
def owner() -> Iterator[ShmOwner]:
    own = ShmOwner("tarena" + secrets.token_hex(3))
    yield own
    own.close_all()
    assert not list(Path("/dev/shm").glob(f"luced-{own.instance}-*"))


def test_blocks_are_first_fit_aligned_and_exact(owner: ShmOwner) -> None:
    arena = SnapshotArena(owner, 1000)
    assert arena.capacity == 960 and arena.free_spans() == [(HEADER_SIZE, 960)]
    a = arena.alloc(1)  # -> 64 bytes
    b = arena.alloc(100)  # -> 128
    c = arena.alloc(64)
    assert (a, b, c) == (Block(64, 64), Block(128, 128), Block(256, 64))
    assert arena.used == 256 and arena.largest_free == 960 - 256 and arena.n_blocks == 3
    arena.free(b)
    assert arena.free_spans() == [(128, 128), (320, 704)]
    d = arena.alloc(64)  # first fit: the hole b left
    assert d == Block(128, 64)
    e = arena.alloc(65)  # 128 bytes: the hole has only 64 left -> after c
    assert e == Block(320, 128)
    assert arena.alloc(10_000) is None and arena.alloc(961) is None
    with pytest.raises(ValueError):
        arena.alloc(0)
    arena.close()


def test_free_coalesces_with_both_neighbours(owner: ShmOwner) -> None:
    arena = SnapshotArena(owner, 64 * 10)
    blocks = [arena.alloc(64) for _ in range(10)]
    assert arena.alloc(1) is None and arena.largest_free == 0
    for i in (1, 3, 2):  # 1 and 3 are separate holes; freeing 2 joins them
        arena.free(blocks[i])  # type: ignore[arg-type]
    assert arena.free_spans() == [(64 + 64, 192)]
    assert arena.alloc(192) == Block(128, 192)
    with pytest.raises(ValueError, match="double free"):
        arena.free(blocks[2])  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        arena.free(Block(64, 128))  # wrong size for the live block at 64
    arena.close()


def test_random_alloc_free_never_overlaps_and_fully_coalesces(owner: ShmOwner) -> None:
    rng = random.Random(7)
    arena = SnapshotArena(owner, 64 * 500)
    live: list[Block] = []
    for _ in range(3000):
        if live and rng.random() < 0.45:
            arena.free(live.pop(rng.randrange(len(live))))
        else:
            blk = arena.alloc(rng.randint(1, 64 * 40))
            if blk is not None:
                live.append(blk)
        spans = sorted([(b.offset, b.nbytes) for b in live] + arena.free_spans())
        pos = HEADER_SIZE
        for off, size in spans:  # live blocks and free spans tile the data area exactly
            assert off == pos and off % 64 == 0 and size % 64 == 0
            pos += size
        assert pos == HEADER_SIZE + arena.capacity
        assert arena.used == sum(b.nbytes for b in live)
        free = arena.free_spans()
        assert all(a[0] + a[1] < b[0] for a, b in itertools.pairwise(free))
    for b in live:
        arena.free(b)
    assert arena.free_spans() == [(HEADER_SIZE, arena.capacity)] and arena.used == 0
    arena.close()


def test_regions_lay_out_each_tensor_with_its_token_axis_sized_n(owner: ShmOwner) -> None:
    arena = SnapshotArena(owner, 1 << 16)
    n = 5
    assert SPECS[0].shape_for(n) == (2, 5, 8) and SPECS[2].shape_for(n) == (5, 3, 5)
    need = layout_bytes(SPECS, n)
    # k, v: 2*5*8*2 = 160 -> 192 each; ring 5*3*5*4 = 300 -> 320; tokens 20 -> 64
    assert need == 192 + 192 + 320 + 64
    arena.alloc(64)  # so the block does not start at the first data byte
    blk = arena.alloc(need)
    assert blk is not None
    regs = arena.regions(blk, SPECS, n)
    name = arena.segment_name
    assert regs == {
        "k.0": Region(name, blk.offset, (2, 5, 8), "bfloat16"),
        "v.0": Region(name, blk.offset + 192, (2, 5, 8), "bfloat16"),
        "ring": Region(name, blk.offset + 384, (5, 3, 5), "float32"),
        "tokens": Region(name, blk.offset + 704, (5,), "int32"),
    }
    with pytest.raises(ValueError, match="need"):
        arena.regions(blk, SPECS, n + 1)
    views = arena.views(blk, SPECS, n)
    assert views["k.0"].dtype == np.uint16 and views["ring"].dtype == np.float32
    assert views["k.0"].shape == (2, 5, 8)
    arena.close()


def test_a_worker_attaching_by_name_sees_the_same_bytes(owner: ShmOwner) -> None:
    arena = SnapshotArena(owner, 1 << 16, name="prefix-arena")
    assert arena.segment_name == f"/luced-{owner.instance}-prefix-arena"
    blk = arena.alloc(layout_bytes(SPECS, 4))
    assert blk is not None
    views = arena.views(blk, SPECS, 4)
    views["ring"][:] = np.arange(60, dtype=np.float32).reshape(4, 3, 5)
    with Segment.attach(arena.segment_name) as worker:  # what a worker does (never unlinks)
        r = arena.regions(blk, SPECS, 4)["ring"]
        assert np.array_equal(worker.array(r.offset, r.shape, "<f4"), views["ring"])
        worker.array(r.offset, r.shape, "<f4")[0, 0, 0] = -1.0
    assert views["ring"][0, 0, 0] == -1.0
    del views
    arena.close()
    assert not Path(f"/dev/shm{arena.segment_name}").exists()
