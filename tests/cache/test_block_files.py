"""Block files: keys, round trips, the LRU budget, validation + quarantine, crashes, threads."""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import struct
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest

import luced.cache.block_files as block_files
from luced.cache.block_files import (
    ROOT_KEY,
    STATE_FILES,
    SUFFIX,
    BlockFile,
    BlockFileError,
    BlockFiles,
    block_key,
    prompt_keys,
)
from luced.cache.files import QUARANTINE, SnapshotDirBusy, SnapshotDirError, lock_model_dir

BLOCK = 4
RECORD = 96
PART = "b4-bf16-L0-2"
HEADER = 72 + len(PART) + 4 * BLOCK  # where a file's record starts
FILE_BYTES = HEADER + RECORD
MODEL = "model-sha-1"


def record(seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, RECORD, dtype=np.uint8).tobytes()


def prompt(n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(0, 50_000, n).tolist()


def open_files(root: Path, max_bytes: int = 1 << 20, **kw: object) -> BlockFiles:
    args: dict = {"part": PART, "record_bytes": RECORD, "block": BLOCK, **kw}
    return BlockFiles(root, MODEL, max_bytes=max_bytes, **args)


def write_prompt(files: BlockFiles, tokens: Sequence[int], skip: Sequence[int] = ()) -> list[bytes]:
    """Write every whole block of `tokens` but those in `skip`; returns all their keys."""
    keys = prompt_keys(tokens, BLOCK)
    parent = ROOT_KEY
    for i, key in enumerate(keys):
        if i not in skip:
            assert files.write(parent, tokens[i * BLOCK : (i + 1) * BLOCK], record(i)) == key
        parent = key
    return keys


def read(files: BlockFiles, key: bytes) -> bytes:
    out = bytearray(RECORD)
    files.read_into(key, memoryview(out))
    return bytes(out)


def flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))


def on_disk(files: BlockFiles) -> list[str]:
    return sorted(p.name for p in files.dir.iterdir())


@pytest.fixture
def files(tmp_path: Path) -> Iterator[BlockFiles]:
    f = open_files(tmp_path / "kv", lock_fd=lock_model_dir(tmp_path / "kv", MODEL))
    yield f
    f.close()


def test_keys_are_blake2b_of_the_parent_and_the_tokens_chained() -> None:
    tokens = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]
    want0 = hashlib.blake2b(bytes(16) + struct.pack("<4i", 5, 6, 7, 8), digest_size=16).digest()
    want1 = hashlib.blake2b(want0 + struct.pack("<4i", 9, 10, 11, 12), digest_size=16).digest()
    assert block_key(ROOT_KEY, tokens[:4]) == want0
    assert prompt_keys(tokens, BLOCK) == [want0, want1]  # the partial last block has none
    assert prompt_keys(np.array(tokens, dtype=np.int64), BLOCK, limit=1) == [want0]
    assert prompt_keys(tokens[:3], BLOCK) == [] and prompt_keys(tokens, BLOCK, limit=0) == []
    # A key names the whole prefix: the same block after another one has another key.
    assert prompt_keys([0, 0, 0, 0, 5, 6, 7, 8], BLOCK)[1] != want0
    with pytest.raises(ValueError, match="int32"):
        block_key(ROOT_KEY, [1 << 31, 0, 0, 0])
    with pytest.raises(ValueError, match="16 bytes"):
        block_key(b"short", [1, 2, 3, 4])


def test_write_then_read_round_trips_the_bytes(files: BlockFiles, tmp_path: Path) -> None:
    tokens = prompt(8)
    data = record(7)
    key = files.write(ROOT_KEY, tokens[:4], memoryview(data))
    path = tmp_path / "kv" / MODEL / "blocks" / PART / f"{key.hex()}{SUFFIX}"
    assert on_disk(files) == [path.name]
    f = files.get(key)
    assert f is not None and f.key == key and f.parent == ROOT_KEY
    assert f.tokens == tuple(tokens[:4]) and f.nbytes == FILE_BYTES == path.stat().st_size
    assert f.used == path.stat().st_mtime_ns / 1e9
    assert len(files) == 1 and files.used_bytes == FILE_BYTES and files.has(key)
    assert read(files, key) == data
    rows = np.zeros((3, RECORD), dtype=np.uint8)  # a host record: one row of a region
    files.read_into(key, memoryview(rows[1]))
    assert rows[1].tobytes() == data and not rows[0].any() and not rows[2].any()
    with pytest.raises(ValueError, match="96 writable"):
        files.read_into(key, memoryview(bytearray(RECORD - 1)))
    with pytest.raises(ValueError, match="read-only"):
        files.read_into(key, memoryview(bytes(RECORD)))
    with pytest.raises(ValueError, match="a record is 96 bytes"):
        files.write(ROOT_KEY, tokens[:4], data[:-1])
    with pytest.raises(ValueError, match="holds 4 tokens"):
        files.write(ROOT_KEY, tokens[:5], data)
    assert len(files) == 1 and on_disk(files) == [path.name]


def test_chain_stops_at_the_first_missing_block(files: BlockFiles) -> None:
    tokens = prompt(22)
    keys = write_prompt(files, tokens, skip=[2])
    assert len(keys) == 5 and all(files.has(k) for k in keys if k != keys[2])
    assert files.chain(tokens) == keys[:2]
    assert files.chain(tokens, limit=1) == keys[:1]
    # A prompt that differs in block 1 (one token) shares block 0 only.
    other = list(tokens)
    other[6] += 1
    assert files.chain(other) == keys[:1]
    assert files.chain([tokens[0] + 1, *tokens[1:]]) == []
    files.write(keys[1], tokens[8:12], record(2))
    assert files.chain(tokens) == keys
    assert files.chain(tokens[:15]) == keys[:3]  # whole blocks only


def test_chain_compares_tokens_so_a_key_collision_never_matches(
    files: BlockFiles, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A weak hash (the parent and the first token only) makes real collisions.
    monkeypatch.setattr(block_files, "_hash", lambda parent, raw: (parent + raw[:4])[-16:])
    files.write(ROOT_KEY, [1, 2, 3, 4], record(0))
    assert prompt_keys([1, 9, 9, 9], BLOCK) == prompt_keys([1, 2, 3, 4], BLOCK)
    assert files.chain([1, 9, 9, 9]) == []
    assert files.chain([1, 2, 3, 4]) == prompt_keys([1, 2, 3, 4], BLOCK)


def test_scan_after_reopen_rebuilds_the_index_and_the_lru_order(tmp_path: Path) -> None:
    first = open_files(tmp_path / "kv")
    a, b, c = (first.write(ROOT_KEY, [i] * BLOCK, record(i)) for i in range(3))
    base = 1_700_000_000
    for key, age in ((a, 3), (b, 1), (c, 2)):  # least recently used first: a, c, b
        os.utime(first.dir / f"{key.hex()}{SUFFIX}", (base - age, base - age))
    again = open_files(tmp_path / "kv")
    assert len(again) == 0 and again.scan() == 3
    assert [f.key for f in again.files()] == [a, c, b]
    assert again.get(c) == BlockFile(c, ROOT_KEY, (2,) * BLOCK, FILE_BYTES, base - 2)
    assert again.used_bytes == 3 * FILE_BYTES
    assert read(again, b) == record(1) and read(again, c) == record(2)
    again.touch(a)  # its mtime: the order survives the next restart
    third = open_files(tmp_path / "kv", max_bytes=2 * FILE_BYTES)
    assert third.scan() == 2  # past the budget: the least recently used goes
    assert [f.key for f in third.files()] == [b, a] and not third.has(c)
    assert on_disk(third) == sorted(f"{k.hex()}{SUFFIX}" for k in (a, b))


def test_max_bytes_evicts_the_least_recently_used_never_the_newest(tmp_path: Path) -> None:
    files = open_files(tmp_path / "kv", max_bytes=2 * FILE_BYTES)
    a = files.write(ROOT_KEY, [1] * BLOCK, record(1))
    b = files.write(ROOT_KEY, [2] * BLOCK, record(2))
    files.touch(a)
    c = files.write(ROOT_KEY, [3] * BLOCK, record(3))
    assert [f.key for f in files.files()] == [a, c]
    assert on_disk(files) == sorted(f"{k.hex()}{SUFFIX}" for k in (a, c))
    assert files.write(ROOT_KEY, [1] * BLOCK, record(1)) == a  # present: only touched
    assert [f.key for f in files.files()] == [c, a] and len(on_disk(files)) == 2
    files.max_bytes = FILE_BYTES - 1  # smaller than one file: the newest stays anyway
    d = files.write(ROOT_KEY, [4] * BLOCK, record(4))
    assert [f.key for f in files.files()] == [d] and files.used_bytes == FILE_BYTES
    assert on_disk(files) == [f"{d.hex()}{SUFFIX}"] and not files.has(b)


def test_scan_quarantines_every_bad_file_with_one_warning(
    files: BlockFiles, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    keys = [files.write(ROOT_KEY, [i] * BLOCK, record(i)) for i in range(6)]
    path = {k: files.dir / f"{k.hex()}{SUFFIX}" for k in keys}
    good, trunc, token, data, renamed, linked = keys
    with path[trunc].open("r+b") as f:
        f.truncate(FILE_BYTES - 3)
    flip(path[token], HEADER - 2)  # a token's byte: the tokens' CRC
    flip(path[data], HEADER + 5)  # a record's byte: seen by the read
    wrong_name = f"{'ab' * 16}{SUFFIX}"
    os.rename(path[renamed], files.dir / wrong_name)
    outside = tmp_path / "outside.kvb"
    os.rename(path[linked], outside)
    path[linked].symlink_to(outside)
    other_root = tmp_path / "other"
    wider = open_files(other_root, record_bytes=RECORD + 8)  # the same part, another record
    odd = wider.write(ROOT_KEY, [9] * BLOCK, bytes(RECORD + 8))
    os.rename(wider.dir / f"{odd.hex()}{SUFFIX}", files.dir / f"{odd.hex()}{SUFFIX}")
    other_part = open_files(other_root, part="b4-bf16-L2-4")
    moved = other_part.write(ROOT_KEY, [8] * BLOCK, record(8))
    os.rename(other_part.dir / f"{moved.hex()}{SUFFIX}", files.dir / f"{moved.hex()}{SUFFIX}")
    garbage = f"{'cd' * 16}{SUFFIX}"
    (files.dir / garbage).write_bytes(os.urandom(FILE_BYTES))
    (files.dir / f"NotHex{SUFFIX}").write_bytes(path[good].read_bytes())
    (files.dir / "README.txt").write_text("not ours: left alone")
    (files.dir / f"{'ef' * 16}{SUFFIX}").mkdir()  # a directory: not ours either

    with caplog.at_level(logging.WARNING):
        assert files.scan() == 2
    assert [f.key for f in files.files()] == [good, data]
    bad = {
        trunc: "(truncated",
        token: "(the tokens fail their checksum",
        linked: "(not a regular file",
        odd: "(a record of 104 bytes, this part's is 96",
        moved: "(part 'b4-bf16-L2-4' (length 12) is not this directory's 'b4-bf16-L0-2'",
    }
    names = {f"{k.hex()}{SUFFIX}": why for k, why in bad.items()}
    names[wrong_name] = "(named for another key than its own"
    names[garbage] = "(not a block file (magic"
    names[f"NotHex{SUFFIX}"] = "(not a block file name"
    assert sorted(p.name for p in (files.model_dir / QUARANTINE).iterdir()) == sorted(names)
    for name, why in names.items():
        said = [r.getMessage() for r in caplog.records if name in r.getMessage()]
        assert len(said) == 1 and f"{name} {why}" in said[0], (name, said)
    assert outside.stat().st_size == FILE_BYTES  # the symlink moved, its target untouched
    assert on_disk(files) == sorted(
        [f"{good.hex()}{SUFFIX}", f"{data.hex()}{SUFFIX}", "README.txt", f"{'ef' * 16}{SUFFIX}"]
    )
    # The flipped record byte: the read fails its CRC, quarantines it, the index forgets it.
    caplog.clear()
    with caplog.at_level(logging.WARNING), pytest.raises(BlockFileError, match="checksum"):
        read(files, data)
    assert not files.has(data) and len(files) == 1 and files.used_bytes == FILE_BYTES
    assert (files.model_dir / QUARANTINE / path[data].name).exists()
    assert len(caplog.records) == 1 and "the data fails its checksum" in caplog.text
    assert read(files, good) == record(0)
    assert files.scan() == 1  # a restart meets none of them again


def test_a_gone_file_is_forgotten(files: BlockFiles) -> None:
    key = files.write(ROOT_KEY, [1] * BLOCK, record(1))
    (files.dir / f"{key.hex()}{SUFFIX}").unlink()
    with pytest.raises(BlockFileError, match="gone"):
        read(files, key)
    assert not files.has(key) and files.used_bytes == 0


def test_a_file_deleted_behind_the_index_is_written_again(tmp_path: Path) -> None:
    """A write of a key whose file is gone writes it, not only touches it; `on_drop` hears
    each key the index loses on its own (evicted, found gone), not a removal."""
    dropped: list[bytes] = []
    files = open_files(tmp_path / "kv", max_bytes=2 * FILE_BYTES, on_drop=dropped.append)
    key = files.write(ROOT_KEY, [1] * BLOCK, record(1))
    (files.dir / f"{key.hex()}{SUFFIX}").unlink()
    assert not files.touch(key) and dropped == [key]
    assert files.write(ROOT_KEY, [1] * BLOCK, record(1)) == key
    assert read(files, key) == record(1)
    b = files.write(ROOT_KEY, [2] * BLOCK, record(2))
    files.write(ROOT_KEY, [3] * BLOCK, record(3))  # past max_bytes: the oldest goes
    files.remove(b)
    assert dropped == [key, key]


def test_scan_deletes_temp_files_of_a_crash(files: BlockFiles, tmp_path: Path) -> None:
    key = files.write(ROOT_KEY, [1] * BLOCK, record(1))
    (files.dir / f"{key.hex()}-0badf00d.kvb.tmp").write_bytes(b"half a write")
    target = tmp_path / "target"
    target.write_bytes(b"not ours")
    (files.dir / f"{'ab' * 16}-12345678.kvb.tmp").symlink_to(target)
    assert files.scan() == 1
    assert on_disk(files) == [f"{key.hex()}{SUFFIX}"] and target.read_bytes() == b"not ours"


def test_a_full_disk_leaves_no_file_and_no_entry(
    files: BlockFiles, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = block_files._write_all

    def half_then_full(fd: int, chunks: Sequence[bytes | memoryview]) -> None:
        os.write(fd, b"x" * 50)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(block_files, "_write_all", half_then_full)
    with pytest.raises(OSError) as failed:
        files.write(ROOT_KEY, [1] * BLOCK, record(1))
    assert failed.value.errno == errno.ENOSPC
    assert on_disk(files) == [] and len(files) == 0 and files.used_bytes == 0
    monkeypatch.setattr(block_files, "_write_all", real)
    key = files.write(ROOT_KEY, [1] * BLOCK, record(1))  # the disk has room again
    assert read(files, key) == record(1)


def test_concurrent_writes_from_threads(files: BlockFiles) -> None:
    """Eight threads write 160 blocks, each block by two threads at once; then every file
    is indexed once, complete, and no temp file is left. A budget under the total makes
    the same threads evict each other's files."""
    tokens = prompt(80 * BLOCK, seed=3)
    keys = prompt_keys(tokens, BLOCK)
    errors: list[BaseException] = []

    def writer(t: int) -> None:
        try:
            for i in range(t % 4 * 20, t % 4 * 20 + 20):
                parent = keys[i - 1] if i else ROOT_KEY
                files.write(parent, tokens[i * BLOCK : (i + 1) * BLOCK], record(i))
        except BaseException as e:  # re-raised on the test's thread
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(t,)) for t in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    assert files.chain(tokens) == keys and len(files) == 80
    assert files.used_bytes == 80 * FILE_BYTES
    assert on_disk(files) == sorted(f"{k.hex()}{SUFFIX}" for k in keys)
    assert all(read(files, k) == record(i) for i, k in enumerate(keys))


def test_concurrent_writes_past_the_budget_keep_index_and_disk_equal(tmp_path: Path) -> None:
    files = open_files(tmp_path / "kv", max_bytes=30 * FILE_BYTES)
    tokens = prompt(80 * BLOCK, seed=4)
    keys = prompt_keys(tokens, BLOCK)

    def writer(t: int) -> None:
        for i in range(t, 80, 4):
            parent = keys[i - 1] if i else ROOT_KEY
            files.write(parent, tokens[i * BLOCK : (i + 1) * BLOCK], record(i))

    threads = [threading.Thread(target=writer, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert len(files) == 30 and files.used_bytes == 30 * FILE_BYTES
    assert on_disk(files) == sorted(f"{f.key.hex()}{SUFFIX}" for f in files.files())


def test_remove_and_clear_leave_other_files_alone(files: BlockFiles) -> None:
    snapshot = files.model_dir / "0123.safetensors"  # the snapshot tier's: never touched
    snapshot.write_bytes(b"a snapshot")
    keys = write_prompt(files, prompt(16))
    files.remove(keys[0])
    files.remove(keys[0])  # missing is fine
    assert not files.has(keys[0]) and len(files) == 3
    assert files.used_bytes == 3 * FILE_BYTES
    assert files.clear() == 3
    assert len(files) == 0 and files.used_bytes == 0 and on_disk(files) == []
    assert files.scan() == 0 and snapshot.read_bytes() == b"a snapshot"


def test_directories_and_the_lock(tmp_path: Path) -> None:
    root = tmp_path / "kv"
    with pytest.raises(ValueError, match="bad part name"):
        open_files(root, part="../escape")
    lock = lock_model_dir(root, MODEL)
    files = open_files(root, lock_fd=lock)  # it owns the lock from here on
    with pytest.raises(SnapshotDirBusy):
        lock_model_dir(root, MODEL)
    files.close()
    os.close(lock_model_dir(root, MODEL))  # released
    (tmp_path / "elsewhere").mkdir()
    (root / MODEL / "blocks" / "b4-bf16-L4-6").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(SnapshotDirError, match="symlink"):
        open_files(root, part="b4-bf16-L4-6")


def test_state_files_sit_beside_the_blocks_and_each_kind_keeps_its_own(
    files: BlockFiles, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A hybrid's recurrent states (`STATE_FILES`) in the same part directory, named by the
    keys of the blocks they follow: each kind indexes, reads, clears and cleans up only its
    own files (a crash's temp files too); a state file named as a block is quarantined by
    the blocks' scan (its magic is not theirs)."""
    tokens = prompt(12)
    keys = write_prompt(files, tokens)
    states = open_files(tmp_path / "kv", record_bytes=2 * RECORD, kind=STATE_FILES)
    data = record(3) + record(4)
    assert states.write(keys[0], tokens[4:8], data) == keys[1]  # the state after block 1
    (states.dir / f"{keys[2].hex()}-dead{STATE_FILES.tmp_suffix}").write_bytes(b"partial")
    assert states.scan() == 1 and files.scan() == 3
    assert on_disk(files) == sorted([*(k.hex() + SUFFIX for k in keys), f"{keys[1].hex()}.kvs"])
    out = bytearray(2 * RECORD)
    states.read_into(keys[1], memoryview(out))
    assert bytes(out) == data and states.chain(tokens) == []  # no state after block 0
    name = f"{keys[1].hex()}{SUFFIX}"
    os.replace(states.dir / f"{keys[1].hex()}.kvs", states.dir / name)
    with caplog.at_level(logging.WARNING):
        assert files.scan() == 2
    assert f"{name} (not a block file (magic b'LUCEKVS1')" in caplog.text
    assert (files.model_dir / QUARANTINE / name).exists()
    assert states.clear() == 0 and files.clear() == 2
    states.close()
