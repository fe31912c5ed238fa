"""A remote worker's stand-in for the daemon's shared memory.

A worker on another host is sent the same frames as a local one, naming regions of the
daemon's segments, which it cannot map. It keeps, for each segment named, private
*extents*: byte arrays at the segments' own offsets, covering the regions it was told
about. The carry of a frame (``ipc/frames/remote.py``) fills them (puts, relays in) and
reads them back (gets, relays out); the verbs view them in place, as ``Attachments``
views a mapped segment, so the code that runs a frame is the same on either host::

    segment "/luced-1a2b3c4d-io"      [offset 64 ........ 2112)   [4160 .... 6208)
    segment "/luced-1a2b3c4d-act"     [64 ............................... 1.2 MB)
    segment "/luced-1a2b3c4d-ring0"   [64 ....... 9.4 MB)

Extents never overlap: a region that reaches past one (a longer row range of the same
region) gets a new extent over the union, with the old bytes copied in. A view taken
before such a merge would miss later writes, so the serving loop ``reserve``s every
region of a frame before the frame runs, and nothing merges while it does.

Written only by the serving thread; ``close`` drops everything (the daemon went away),
``forget`` one segment (a prefix snapshot's scratch regions, which are used once).
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Iterable, Iterator

import numpy as np

from luced.ipc.regions import ALIGN, DTYPES, Region, RegionError
from luced.ipc.typed import Record


class Mirror:
    """Private byte extents standing for the daemon's segments (module docstring)."""

    def __init__(self) -> None:
        # segment -> extents sorted by start: (start offset, uint8 array)
        self._extents: dict[str, list[tuple[int, np.ndarray]]] = {}

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for ext in self._extents.values() for _, a in ext)

    def reserve(self, regions: Iterable[Region]) -> None:
        for region in regions:
            self._extent(region)

    def buffer(self, region: Region) -> memoryview:
        start, array = self._extent(region)
        lo = region.offset - start
        return memoryview(array)[lo : lo + region.nbytes]

    def view(self, region: Region) -> np.ndarray:
        if region.offset % region.itemsize:
            raise RegionError(f"region offset {region.offset} is not aligned to its {region.dtype}")
        start, array = self._extent(region)
        lo = region.offset - start
        raw = array[lo : lo + region.nbytes]
        return raw.view(DTYPES[region.dtype]).reshape(region.shape)

    def forget(self, segment: str) -> None:
        self._extents.pop(segment, None)

    def close(self) -> None:
        self._extents.clear()

    def _extent(self, region: Region) -> tuple[int, np.ndarray]:
        """The extent holding `region`, made or merged as needed."""
        a, b = region.offset, region.offset + region.nbytes
        extents = self._extents.setdefault(region.segment, [])
        starts = [s for s, _ in extents]
        i = bisect.bisect_right(starts, a) - 1  # the last extent starting at or before a
        if i >= 0:
            s, arr = extents[i]
            if b <= s + arr.nbytes:
                return s, arr
        lo_i = i if i >= 0 and extents[i][0] + extents[i][1].nbytes > a else i + 1
        hi_i = bisect.bisect_left(starts, b)  # extents starting before b overlap
        merged = extents[lo_i:hi_i]
        lo = min([a - a % ALIGN, *(s for s, _ in merged)])  # starts stay 64-byte aligned
        hi = max([b, *(s + arr.nbytes for s, arr in merged)])
        array = _aligned_zeros(hi - lo)
        for s, arr in merged:
            array[s - lo : s - lo + arr.nbytes] = arr
        extents[lo_i:hi_i] = [(lo, array)]
        return lo, array


def _aligned_zeros(n: int) -> np.ndarray:
    """n zero bytes whose first byte sits at a multiple of ALIGN, as in a segment."""
    raw = np.zeros(n + ALIGN, np.uint8)
    skip = -raw.ctypes.data % ALIGN
    return raw[skip : skip + n]


def regions_of(value: object) -> Iterator[Region]:
    """Every region a frame names, in its fields, lists and maps, nested records too."""
    if isinstance(value, Region):
        yield value
    elif isinstance(value, Record):
        for f in dataclasses.fields(value):
            yield from regions_of(getattr(value, f.name))
    elif isinstance(value, tuple | list):
        for item in value:
            yield from regions_of(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from regions_of(item)
