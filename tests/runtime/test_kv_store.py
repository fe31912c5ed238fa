"""A worker on another host's own block files (runtime/kv_store.py `ShardBlocks`), driven by
`kv_files` frames over its host records: writes copied at once and landing in the
background, reads in order up to the first block missing, the listing a page at a time,
what the part lost reported once (`gone`), and no disk tier without a usable directory."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import numpy as np
import pytest

import luced.runtime.kv_store as kv_store
from luced.cache.block_files import BLOCKS, ROOT_KEY, SUFFIX, prompt_keys
from luced.cache.files import lock_model_dir
from luced.ipc import frames as F
from luced.ipc.regions import Region
from luced.runtime.kv_store import ShardBlocks

BLOCK = 4
RECORD = 64
MODEL, PART = "model-1", "b4-f32-L2-4-0a1b2c3d"
HOST = Region("/luced-0a1b2c3d-t-kvhost", 64, (8, RECORD), "uint8")
TOKENS = list(range(3, 3 + 5 * BLOCK))  # 5 blocks
KEYS = prompt_keys(TOKENS, BLOCK)


def records(seed: int) -> np.ndarray:
    """A worker's host records: uint8 [8, RECORD]."""
    return np.random.default_rng(seed).integers(0, 256, (8, RECORD), dtype=np.uint8)


def frame(action: str, **kw) -> F.KVFiles:
    return F.KVFiles(action=action, model=MODEL, part=PART, **kw)  # type: ignore[arg-type]


def write(store: ShardBlocks, rows: np.ndarray, blocks: range, at: int = 0) -> F.KVFilesReply:
    """Blocks `blocks` of TOKENS from records at.. of `rows`."""
    parents = b"".join(KEYS[i - 1] if i else ROOT_KEY for i in blocks)
    ids = np.array([TOKENS[i * BLOCK : (i + 1) * BLOCK] for i in blocks], "<i4").tobytes()
    req = frame("write", kv_host=HOST, records=tuple(range(at, at + len(blocks))),
                parents=parents, tokens=ids)  # fmt: skip
    return store.serve(req, rows, RECORD, BLOCK)


def read(store: ShardBlocks, rows: np.ndarray, keys: list[bytes]) -> F.KVFilesReply:
    req = frame("read", kv_host=HOST, records=tuple(range(len(keys))), keys=b"".join(keys))
    return store.serve(req, rows, RECORD, BLOCK)


def part_files(root: Path) -> list[Path]:
    return sorted((root / MODEL / BLOCKS / PART).glob(f"*{SUFFIX}"))


@pytest.fixture
def store(tmp_path: Path):
    s = ShardBlocks(tmp_path, budget=1 << 20)
    yield s
    s.close()


def test_written_blocks_are_read_back_in_order_up_to_the_first_missing(
    store: ShardBlocks, tmp_path: Path
) -> None:
    saved = records(1)
    reply = write(store, saved, range(5))
    assert (reply.disk, reply.done) == (True, 5)
    saved[:] = 0  # the record copies were taken with the frame
    store.flush()
    assert [p.stem for p in part_files(tmp_path)] == sorted(k.hex() for k in KEYS)
    into = np.zeros((8, RECORD), np.uint8)
    assert read(store, into, KEYS).done == 5
    assert np.array_equal(into[:5], records(1)[:5])
    (tmp_path / MODEL / BLOCKS / PART / f"{KEYS[2].hex()}{SUFFIX}").unlink()
    reply = read(store, np.zeros((8, RECORD), np.uint8), KEYS)  # gone behind its back
    assert (reply.done, reply.gone) == (2, KEYS[2])  # reported once
    assert store.serve(frame("list"), None, RECORD, BLOCK).gone == b""


def test_the_listing_comes_a_page_at_a_time_in_key_order(
    store: ShardBlocks, monkeypatch: pytest.MonkeyPatch
) -> None:
    write(store, records(2), range(5))
    store.flush()
    monkeypatch.setattr(kv_store, "LIST_BYTES", 2 * (32 + 4 * BLOCK))  # two keys a page
    keys, parents, tokens, after = b"", b"", b"", b""
    pages = 0
    while True:
        reply = store.serve(frame("list", after=after), None, RECORD, BLOCK)
        keys, parents, tokens = keys + reply.keys, parents + reply.parents, tokens + reply.tokens
        pages += 1
        if not reply.more:
            break
        after = reply.keys[-16:]
    assert pages == 3
    listed = [keys[i : i + 16] for i in range(0, len(keys), 16)]
    assert listed == sorted(KEYS)
    for i, key in enumerate(listed):
        j = KEYS.index(key)
        assert parents[16 * i : 16 * i + 16] == (KEYS[j - 1] if j else ROOT_KEY)
        got = np.frombuffer(tokens[4 * BLOCK * i : 4 * BLOCK * (i + 1)], "<i4").tolist()
        assert got == TOKENS[j * BLOCK : (j + 1) * BLOCK]


def test_blocks_evicted_for_room_are_reported_gone(tmp_path: Path) -> None:
    one = len(PART) + 72 + 4 * BLOCK + RECORD  # a file's bytes
    store = ShardBlocks(tmp_path, budget=3 * one)
    try:
        write(store, records(3), range(5))
        store.flush()
        assert len(part_files(tmp_path)) == 3
        reply = store.serve(frame("list"), None, RECORD, BLOCK)
        gone = {reply.gone[i : i + 16] for i in range(0, len(reply.gone), 16)}
        assert gone == set(KEYS[:2]) and reply.done == 3
    finally:
        store.close()


def test_writes_past_the_pending_bytes_are_not_taken(
    store: ShardBlocks, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While the disk holds the writer thread up, a frame takes what fits, in order."""
    monkeypatch.setattr(kv_store, "PENDING_BYTES", 2 * RECORD)
    files = store.open(MODEL, PART, RECORD, BLOCK)
    assert files is not None
    disk = threading.Event()
    write_file = files.write

    def slow_write(*args):
        disk.wait(30)
        return write_file(*args)

    monkeypatch.setattr(files, "write", slow_write)
    assert write(store, records(4), range(5)).done == 2
    disk.set()
    store.flush()
    assert len(part_files(tmp_path)) == 2


def test_clear_deletes_the_part_after_the_writes(store: ShardBlocks, tmp_path: Path) -> None:
    write(store, records(5), range(3))
    assert store.serve(frame("clear"), None, RECORD, BLOCK).done == 3
    assert part_files(tmp_path) == []


def test_no_usable_directory_keeps_no_files(tmp_path: Path) -> None:
    """Without --kv-cache-dir, or with the model directory locked by another process, the
    worker says it keeps no disk tier and takes nothing."""
    held = lock_model_dir(tmp_path, MODEL)
    try:
        for store in (ShardBlocks(None), ShardBlocks(tmp_path)):
            reply = write(store, records(6), range(2))
            assert (reply.disk, reply.done) == (False, 0)
            assert not store.serve(frame("list"), None, RECORD, BLOCK).disk
            store.close()
    finally:
        os.close(held)
    assert part_files(tmp_path) == []
