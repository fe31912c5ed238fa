"""Regions: exact offsets from the bump allocator, overflow, wire form, views."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from luced.ipc.regions import (
    ALIGN,
    Attachments,
    Region,
    RegionAllocator,
    RegionError,
    buffer,
    required_bytes,
    view,
)
from luced.ipc.shm import HEADER_SIZE, SegmentError, ShmOwner

SEG = "/luced-0123abcd-act"


def test_offsets_are_aligned_and_exact() -> None:
    alloc = RegionAllocator(SEG, 10_000)
    a = alloc.alloc("a", (3,), "uint8")  # 3 bytes -> next at 128
    b = alloc.alloc("b", (5, 4), "float32")  # 80 bytes -> next at 256
    c = alloc.alloc("c", (0,), "int64")  # empty: takes no space
    d = alloc.alloc("d", (2,), "bfloat16")
    assert [r.offset for r in (a, b, c, d)] == [64, 128, 256, 256]
    assert all(r.offset % ALIGN == 0 for r in (a, b, c, d))
    assert (b.nbytes, d.nbytes, d.itemsize) == (80, 4, 2)
    assert alloc.used == 320 and alloc.free == 10_000 - 320
    assert alloc["b"] == b and "c" in alloc and "z" not in alloc
    assert list(alloc.regions) == ["a", "b", "c", "d"]


def test_overflow_and_duplicates_leave_the_allocator_unchanged() -> None:
    specs = [((7,), "float32"), ((100, 3), "int32")]
    size = HEADER_SIZE + required_bytes(specs)
    assert size == 64 + 64 + 1216
    alloc = RegionAllocator(SEG, size)
    for i, (shape, dt) in enumerate(specs):
        alloc.alloc(f"r{i}", shape, dt)  # exactly fits
    assert alloc.free == 0
    with pytest.raises(RegionError, match=r"region 'more' \(1,\) uint8 needs 1 bytes.* 0 of"):
        alloc.alloc("more", (1,), "uint8")
    with pytest.raises(RegionError, match="already allocated"):
        alloc.alloc("r0", (1,), "uint8")
    alloc.reset()
    assert alloc.alloc("fresh", (1,), "uint8").offset == HEADER_SIZE
    big = RegionAllocator(SEG, 1000)
    with pytest.raises(RegionError, match="needs 1200 bytes at offset 64, but only 936"):
        big.alloc("x", (300,), "float32")
    assert big.used == HEADER_SIZE


def test_wire_roundtrip_through_msgpack() -> None:
    r = Region(SEG, 4096, (16, 576), "bfloat16")
    wire = msgpack.unpackb(msgpack.packb(r.to_wire(), use_bin_type=True), raw=False)
    assert wire == {"segment": SEG, "offset": 4096, "shape": [16, 576], "dtype": "bfloat16"}
    assert Region.from_wire(wire) == r


@pytest.mark.parametrize(
    ("wire", "match"),
    [
        ({"segment": SEG, "offset": 64, "shape": [1]}, r"missing \['dtype'\]"),
        ({"segment": SEG, "offset": 64, "shape": [1], "dtype": "int32", "x": 1}, "unexpected"),
        ({"segment": SEG, "offset": 8, "shape": [1], "dtype": "int32"}, "offset must be"),
        ({"segment": SEG, "offset": True, "shape": [1], "dtype": "int32"}, "offset must be"),
        ({"segment": SEG, "offset": 64, "shape": [-1], "dtype": "int32"}, "shape must be"),
        ({"segment": SEG, "offset": 64, "shape": "1", "dtype": "int32"}, "shape must be"),
        ({"segment": SEG, "offset": 64, "shape": [1.0], "dtype": "int32"}, "shape must be"),
        ({"segment": SEG, "offset": 64, "shape": [1], "dtype": "complex64"}, "unknown dtype"),
        ({"segment": "act", "offset": 64, "shape": [1], "dtype": "int32"}, "'/name'"),
        ([SEG, 64, [1], "int32"], "must be a map"),
    ],
)
def test_from_wire_rejects(wire: object, match: str) -> None:
    with pytest.raises(RegionError, match=match):
        Region.from_wire(wire)


def test_rows_are_subregions_of_the_same_bytes(instance: str) -> None:
    with ShmOwner(instance) as owner:
        seg = owner.create("act", 4096)
        r = RegionAllocator.for_segment(seg).alloc("h", (10, 6), "float32")
        full = view(seg, r)
        full[:] = np.arange(60, dtype=np.float32).reshape(10, 6)
        sub = r.rows(3, 7)
        assert sub.shape == (4, 6) and sub.offset == r.offset + 3 * 6 * 4
        np.testing.assert_array_equal(view(seg, sub), full[3:7])
        with pytest.raises(RegionError, match="outside region"):
            r.rows(5, 11)


def test_views_check_segment_bounds_alignment(instance: str) -> None:
    with ShmOwner(instance) as owner:
        seg = owner.create("act", 256)
        with pytest.raises(RegionError, match="viewed in"):
            view(seg, Region("/luced-other-x", 64, (1,), "int32"))
        with pytest.raises(SegmentError, match="outside the data area"):
            view(seg, Region(seg.name, 64, (100,), "float32"))  # 400 > 256 bytes
        with pytest.raises(RegionError, match="not aligned to its int32"):
            view(seg, Region(seg.name, 66, (1,), "int32"))
        bf = Region(seg.name, 128, (4,), "bfloat16")
        assert view(seg, bf).dtype == np.uint16  # raw bits; torch sees bfloat16
        raw = buffer(seg, bf)
        assert raw.nbytes == 8 and not raw.readonly


def test_attachments_attach_once_and_never_unlink(instance: str) -> None:
    with ShmOwner(instance) as owner:
        seg = owner.create("act", 256)
        r = RegionAllocator.for_segment(seg).alloc("ids", (8,), "int32")
        with Attachments() as att:
            att.view(r)[:] = np.arange(8)
            assert att.segment(seg.name) is att.segment(seg.name)
            assert bytes(att.buffer(r)) == np.arange(8, dtype=np.int32).tobytes()
        np.testing.assert_array_equal(view(seg, r), np.arange(8))
        assert owner.names == [seg.name]
