"""Typed regions inside shared-memory segments, and the allocator that carves them.

A region is a ``[shape]`` array of ``dtype`` at an absolute byte ``offset`` of a segment.
It travels in control frames as a small map and the other side turns it back into a
view of the same bytes::

    {"segment": "/luced-1a2b3c4d-act", "offset": 128, "shape": [512, 576], "dtype": "float32"}

Segment layout with a ``RegionAllocator`` (every region starts 64-byte aligned, which
suits cache lines and any SIMD / torch alignment requirement)::

    0        64            64+a          64+a+b
    +--------+-------------+-------------+------ ... ------+---------------+
    | header | region 0    | region 1    |                 | free          |
    |        | (a bytes,   | (b bytes,   |                 |               |
    |        |  padded)    |  padded)    |                 |               |
    +--------+-------------+-------------+------ ... ------+---------------+

Allocation policy: a bump allocator with ``reset``. The regions we need are fixed per
loaded model (token ids, boundary activations, results, the feature ring), sized from
the model config and ``--max-batch-tokens``, allocated once after load and dropped all
together on reload; nothing is freed one by one, so first-fit would buy nothing. The
allocator is daemon-side bookkeeping only (plain integers, no mapping needed); the
daemon is the single writer of the layout and tells workers regions by frame.

``bfloat16`` has no numpy dtype: numpy views of such regions are ``uint16`` holding the
raw bits; the worker views the same bytes as ``torch.bfloat16`` by the dtype name.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Self

import numpy as np

from luced.ipc.shm import HEADER_SIZE, Segment

ALIGN = 64

# Wire dtype name -> numpy dtype of the view. Names follow torch / numpy spelling.
DTYPES: dict[str, np.dtype] = {
    "float32": np.dtype("<f4"),
    "float16": np.dtype("<f2"),
    "bfloat16": np.dtype("<u2"),  # raw bits; torch reads them as bfloat16
    "float64": np.dtype("<f8"),
    "int8": np.dtype("i1"),
    "uint8": np.dtype("u1"),
    "int16": np.dtype("<i2"),
    "uint16": np.dtype("<u2"),
    "int32": np.dtype("<i4"),
    "uint32": np.dtype("<u4"),
    "int64": np.dtype("<i8"),
}

_WIRE_KEYS = frozenset({"segment", "offset", "shape", "dtype"})


class RegionError(ValueError):
    """A region description is malformed, does not fit, or names the wrong segment."""


def align_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


def numpy_dtype(name: str) -> np.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise RegionError(f"unknown dtype {name!r}; known: {', '.join(DTYPES)}") from None


@dataclass(frozen=True)
class Region:
    segment: str  # POSIX segment name, "/luced-<instance>-<name>"
    offset: int  # absolute byte offset in the segment, >= HEADER_SIZE
    shape: tuple[int, ...]
    dtype: str  # a key of DTYPES

    def __post_init__(self) -> None:
        if not isinstance(self.segment, str) or not self.segment.startswith("/"):
            raise RegionError(f"region segment must be a '/name' string, got {self.segment!r}")
        if type(self.offset) is not int or self.offset < HEADER_SIZE:
            raise RegionError(f"region offset must be an int >= {HEADER_SIZE}, got {self.offset!r}")
        if not isinstance(self.shape, tuple) or not all(
            type(d) is int and d >= 0 for d in self.shape
        ):
            raise RegionError(f"region shape must be a tuple of ints >= 0, got {self.shape!r}")
        numpy_dtype(self.dtype)

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype].itemsize

    @property
    def count(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.count * self.itemsize

    def rows(self, start: int, stop: int) -> Region:
        """The sub-region of rows ``[start, stop)`` along the first axis (same bytes)."""
        if not self.shape or not 0 <= start <= stop <= self.shape[0]:
            raise RegionError(f"rows [{start}, {stop}) outside region of shape {self.shape}")
        row = math.prod(self.shape[1:]) * self.itemsize
        shape = (stop - start, *self.shape[1:])
        return Region(self.segment, self.offset + start * row, shape, self.dtype)

    def to_wire(self) -> dict[str, Any]:
        return {
            "segment": self.segment,
            "offset": self.offset,
            "shape": list(self.shape),
            "dtype": self.dtype,
        }

    @classmethod
    def from_wire(cls, d: object) -> Region:
        """Strict inverse of ``to_wire``: exactly the four keys with the right types."""
        if not isinstance(d, Mapping):
            raise RegionError(f"region must be a map, got {type(d).__name__}")
        keys = set(d)
        if keys != _WIRE_KEYS:
            missing, extra = _WIRE_KEYS - keys, keys - _WIRE_KEYS
            raise RegionError(
                f"region keys: missing {sorted(missing)}, unexpected {sorted(map(str, extra))}"
            )
        shape = d["shape"]
        if not isinstance(shape, list | tuple):
            raise RegionError(f"region shape must be a list, got {type(shape).__name__}")
        if not isinstance(d["dtype"], str):
            raise RegionError(f"region dtype must be a string, got {d['dtype']!r}")
        return cls(d["segment"], d["offset"], tuple(shape), d["dtype"])


def view(segment: Segment, region: Region) -> np.ndarray:
    """The numpy view of ``region`` in ``segment`` (no copy; writable)."""
    if region.segment != segment.name:
        raise RegionError(f"region of {region.segment} viewed in {segment.name}")
    if region.offset % region.itemsize:  # allocator regions are 64-aligned, rows() itemsize
        raise RegionError(f"region offset {region.offset} is not aligned to its {region.dtype}")
    return segment.array(region.offset, region.shape, DTYPES[region.dtype])


def buffer(segment: Segment, region: Region) -> memoryview:
    """The raw bytes of ``region`` (for ``torch.frombuffer(buf, dtype=...)``; no copy)."""
    if region.segment != segment.name:
        raise RegionError(f"region of {region.segment} viewed in {segment.name}")
    return segment.buffer(region.offset, region.nbytes)


def required_bytes(specs: Iterable[tuple[Iterable[int], str]]) -> int:
    """Data bytes a segment needs to hold regions of these (shape, dtype) in order."""
    return sum(align_up(math.prod(shape) * numpy_dtype(dt).itemsize) for shape, dt in specs)


class RegionAllocator:
    """Bump allocator over one segment's data area (see the module docstring)."""

    def __init__(self, segment: str, size: int) -> None:
        self.segment = segment  # full POSIX name
        self.size = size  # total segment size, header included
        self._next = HEADER_SIZE
        self._regions: dict[str, Region] = {}

    @classmethod
    def for_segment(cls, segment: Segment) -> RegionAllocator:
        return cls(segment.name, segment.size)

    def alloc(self, name: str, shape: Iterable[int], dtype: str) -> Region:
        if name in self._regions:
            raise RegionError(f"{self.segment}: region {name!r} already allocated")
        region = Region(self.segment, self._next, tuple(int(s) for s in shape), dtype)
        end = region.offset + region.nbytes
        if end > self.size:
            raise RegionError(
                f"{self.segment}: region {name!r} {region.shape} {dtype} needs "
                f"{region.nbytes} bytes at offset {region.offset}, but only "
                f"{self.size - region.offset} of {self.size} bytes are left"
            )
        self._regions[name] = region
        self._next = min(align_up(end), self.size)
        return region

    def __getitem__(self, name: str) -> Region:
        return self._regions[name]

    def __contains__(self, name: object) -> bool:
        return name in self._regions

    @property
    def regions(self) -> dict[str, Region]:
        return dict(self._regions)

    @property
    def used(self) -> int:
        """Bytes taken, header and padding included."""
        return self._next

    @property
    def free(self) -> int:
        return self.size - self._next

    def reset(self) -> None:
        """Forget every region. Only when no peer still uses them (e.g. a model reload)."""
        self._regions.clear()
        self._next = HEADER_SIZE


class Attachments:
    """Worker side: segments attached on first use, by name, and closed together.

    Never unlinks (attachers don't); ``close`` only unmaps. ``on_attach(segment)`` runs after
    a segment is mapped and ``on_close(segment)`` before it is unmapped (a GPU worker
    page-locks the mapping in between: runtime/device_io.py).
    """

    def __init__(
        self,
        on_attach: Callable[[Segment], object] | None = None,
        on_close: Callable[[Segment], object] | None = None,
    ) -> None:
        self._segments: dict[str, Segment] = {}
        self._on_attach, self._on_close = on_attach, on_close

    def segment(self, name: str) -> Segment:
        seg = self._segments.get(name)
        if seg is None:
            seg = self._segments[name] = Segment.attach(name)
            if self._on_attach is not None:
                self._on_attach(seg)
        return seg

    def view(self, region: Region) -> np.ndarray:
        return view(self.segment(region.segment), region)

    def buffer(self, region: Region) -> memoryview:
        return buffer(self.segment(region.segment), region)

    def close(self) -> None:
        for seg in self._segments.values():
            if self._on_close is not None:
                self._on_close(seg)
            seg.close()
        self._segments.clear()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
