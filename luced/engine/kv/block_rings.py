"""The DFlash feature-ring rows of the prefix cache's K/V blocks (engine/kv/block_store.py):
where the target captures layer outputs for a draft (engine/feature_ring.py), a block is
its K/V record and the captured rows of its positions, ``[block, n_capture, hidden]``,
kept by the same prefix key: in daemon memory while the store holds the block (given up
with it, counted in --prefix-cache-bytes), and on disk as one more part of the block
files (cache/block_files.py), named for the ring's layout. The rings are the daemon's
shared memory (a remote pipeline stage's cells come back inline too), so the daemon
copies the rows itself: no worker takes part.

Which rows. A slot's ring holds the last ring_cap (C) positions fed, and the draft reads
at most the latest C - (its window) committed ones, never before the prompt's prefill
ends. So after a fresh prefill of a prompt of P tokens the ring holds positions
[max(0, P - C), P), and no row below them is read again; a restore of its first N
positions needs the rows of [max(0, P - C), N) (the prefill computes the rest):

    save     right after the prefill of a prompt of P tokens (nothing fed past P yet) the
             ring holds [max(floor, P - C), P) (floor: the sequence's `ring_floor`, below
             which it wrote nothing); each block the store holds that lies wholly inside
             gets its rows copied, also a block kept earlier without them
    match    block i of a prompt of P tokens needs its rows when it reaches past P - C
             ((i + 1) * block > P - C); a needed block whose rows are neither in memory
             nor on disk ends the match there
    restore  the rows of [max(0, P - C), N) go back into the slot's ring, and its floor
             is set there (at most N): once its prefill ends the ring holds what a fresh
             prefill's would, so the draft reads the same context and proposes the same
             windows (restored == fresh, acceptance included)

A prompt within the ring (P <= C: always up to C = min(4096, the context)) keeps the rows
of every block. A longer one's first blocks lost theirs to the wrap before the save: they
are kept as K/V only, which a later prompt needs only where its own ring would not reach
them (it ends the match there otherwise); a shorter prompt's save adds them.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Container, Sequence

import numpy as np

from luced.cache.block_files import SHORT_DTYPES, BlockFileError, BlockFiles
from luced.engine.target import Target

log = logging.getLogger(__name__)


def ring_bytes(target: Target, block: int) -> int:
    """Bytes of one block's ring rows; 0 while captures are off."""
    if target.capture is None:
        return 0
    layers, _, dtype = target.capture
    return block * len(layers) * target.hidden * np.dtype(dtype).itemsize


def ring_part_name(target: Target, worker_parts: Sequence[str]) -> str:
    """The ring rows' part of the block files: "ring-b16-f32-c3-1a2b3c4d", the block, the
    ring's dtype, the captures, and a hash of the capture layers, the width and every
    worker's part (what the captured values depend on: cache/block_files.py's part names)."""
    assert target.capture is not None
    layers, _, dtype = target.capture
    rest = (layers, target.hidden, tuple(worker_parts))
    digest = hashlib.sha256(repr(rest).encode()).hexdigest()[:8]
    block = target.placement.kv_block
    return f"ring-b{block}-{SHORT_DTYPES.get(dtype, dtype)}-c{len(layers)}-{digest}"


class BlockRings:
    """The ring rows of a block store's blocks (the module docstring)."""

    def __init__(self, target: Target, block: int, part: BlockFiles | None = None) -> None:
        if target.capture is None:
            raise ValueError("the target captures no features for a draft")
        layers, self.cap, dtype = target.capture
        self.target = target
        self.block = block
        self.shape = (block, len(layers), target.hidden)  # one block's rows
        self.dtype = np.dtype(dtype)
        self.block_bytes = ring_bytes(target, block)
        if part is not None and part.record_bytes != self.block_bytes:
            got, want = part.record_bytes, self.block_bytes
            raise ValueError(f"a ring part of {got} bytes a block, not {want}")
        self.part = part
        self._rows: dict[bytes, np.ndarray] = {}  # the held blocks' rows, by key

    @property
    def memory_bytes(self) -> int:
        return len(self._rows) * self.block_bytes

    def needed(self, i: int, length: int) -> bool:
        """Whether a restore for a prompt of `length` tokens needs block i's rows."""
        return (i + 1) * self.block > length - self.cap

    def floor(self, length: int, n: int) -> int:
        """The ring floor of a sequence restored to n positions for a prompt of `length`."""
        return min(n, max(0, length - self.cap))

    def found(self, key: bytes, parent: bytes, tokens: tuple[int, ...], held: bool) -> bool:
        """Whether block `key` has rows in memory (`held`: the store holds this very block)
        or on disk (its parent and tokens compared)."""
        if held and key in self._rows:
            return True
        f = self.part.get(key) if self.part is not None else None
        return f is not None and f.parent == parent and f.tokens == tokens

    def take(self, slot: int, blocks: Sequence[tuple[int, bytes]], length: int, floor: int) -> None:
        """After the prefill of a prompt of `length` tokens in `slot` (its ring floor
        `floor`): copy the rows of `blocks` ((index, key) the store holds) that the ring
        still holds whole and that have none yet."""
        ring = self.target.ring(slot)
        assert ring is not None
        valid = max(floor, length - self.cap, 0)
        for j, key in blocks:
            if key not in self._rows and j * self.block >= valid:
                self._rows[key] = ring.rows(j * self.block, (j + 1) * self.block)

    async def fetch(self, keys: Sequence[bytes], length: int) -> list[np.ndarray | None]:
        """The rows of a prompt's blocks `keys` for a restore (None where not needed), from
        memory or read from disk (a thread); as many as there are before the first needed
        block whose file fails its checks (quarantined by the part)."""
        rows: list[np.ndarray | None] = [
            self._rows.get(key) if self.needed(i, length) else None for i, key in enumerate(keys)
        ]
        reads = [i for i, r in enumerate(rows) if r is None and self.needed(i, length)]
        if reads:
            got = await asyncio.to_thread(self._read, [keys[i] for i in reads])
            for i, r in zip(reads, got, strict=False):
                rows[i] = r
            if len(got) < len(reads):
                return rows[: reads[len(got)]]
        return rows

    def restore(
        self,
        slot: int,
        keys: Sequence[bytes],
        rows: Sequence[object],
        length: int,
        held: Container[bytes],
    ) -> None:
        """Write the fetched `rows` of the restored blocks `keys` into `slot`'s ring from
        the floor on; rows read from disk stay in memory with their blocks `held`."""
        n = len(keys) * self.block
        lo = self.floor(length, n)
        if lo < n:
            first = lo // self.block
            parts = [r for r in rows[first : len(keys)] if isinstance(r, np.ndarray)]
            assert len(parts) == len(keys) - first, "a needed block's rows are missing"
            whole = np.concatenate(parts)
            self.target.put_ring(slot, lo, whole[lo - first * self.block :])
        for key, r in zip(keys, rows, strict=True):
            if isinstance(r, np.ndarray) and key in held:
                self._rows.setdefault(key, r)

    def drop(self, key: bytes) -> None:
        self._rows.pop(key, None)

    def drop_all(self) -> None:
        self._rows.clear()

    # -- disk -------------------------------------------------------------------------------

    def written(self, key: bytes) -> bool:
        """Whether nothing of block `key`'s rows waits for the disk."""
        return self.part is None or key not in self._rows or self.part.has(key)

    def write(self, key: bytes, parent: bytes, tokens: Sequence[int]) -> None:
        """Write block `key`'s rows, if it has any (a thread: BlockFiles.write)."""
        rows = self._rows.get(key)
        if self.part is not None and rows is not None:
            self.part.write(parent, tokens, rows.reshape(-1).view(np.uint8))

    def _read(self, keys: Sequence[bytes]) -> list[np.ndarray]:
        out: list[np.ndarray] = []
        if self.part is None:  # given up since the match: none to read
            return out
        for key in keys:
            rows = np.empty(self.shape, self.dtype)
            try:
                self.part.read_into(key, memoryview(rows.reshape(-1).view(np.uint8)))
            except BlockFileError as exc:
                n = len(out)
                log.info("prefix cache: ring rows of %d of %d blocks read: %s", n, len(keys), exc)
                break
            self.part.touch(key)
            out.append(rows)
        return out
