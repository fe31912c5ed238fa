"""Disk tier: durable safetensors files, validation + quarantine, checksums, LRU budget."""

from __future__ import annotations

import json
import logging
import os
import re
import struct
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import safetensors

from luced.cache.disk import (
    QUARANTINE,
    QUARANTINE_KEEP,
    DiskIdentity,
    SnapshotDirBusy,
    SnapshotDirError,
    SnapshotDisk,
    SnapshotFileError,
    model_dir_name,
)
from luced.cache.layout import TensorSpec

LAYOUT = [
    TensorSpec("k.0", (2, 1, 8), "bfloat16", 1),
    TensorSpec("v.0", (2, 1, 8), "bfloat16", 1),
    TensorSpec("ring", (1, 3, 4), "float32", 0),
]
IDENT = DiskIdentity("model-sha-1", "tmpl-1", "cpu:[0,2)", "bfloat16")
OTHER_MODEL = DiskIdentity("model-sha-2", "tmpl-1", "cpu:[0,2)", "bfloat16")


def arrays(
    n: int, seed: int = 0, layout: list[TensorSpec] = LAYOUT, n_cuts: int = 1
) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {}
    for s in layout:
        shape = list(s.shape_for(n, n_cuts))
        if s.dtype == "bfloat16":  # any 16-bit pattern, NaN payloads included
            out[s.name] = rng.integers(0, 1 << 16, size=shape, dtype=np.uint16)
        else:
            out[s.name] = rng.standard_normal(shape).astype(np.float32)
    out["tokens"] = rng.integers(0, 50_000, size=n, dtype=np.int32)
    return out


def empty_like(src: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k: np.zeros_like(v) for k, v in src.items()}


def spans(path: Path) -> tuple[int, dict[str, tuple[int, int]]]:
    """(data start, name -> [begin, end) relative to it) from the file's header."""
    raw = path.read_bytes()
    (hlen,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + hlen])
    header.pop("__metadata__")
    return 8 + hlen, {k: tuple(v["data_offsets"]) for k, v in header.items()}


def flip(path: Path, offset: int, to: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    data[offset] = data[offset] ^ 0x10 if to is None else to
    path.write_bytes(bytes(data))


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[SnapshotDisk]:
    d = SnapshotDisk(tmp_path / "kv", IDENT, LAYOUT)
    yield d
    d.close()


def test_write_then_scan_and_read_round_trips_bytes(disk: SnapshotDisk) -> None:
    src = arrays(7, seed=1)
    entry = disk.write("ab12", src, cuts=[3, 99])
    assert entry.path == disk.dir / "ab12.safetensors" and entry.cuts == (3, 7)
    assert entry.nbytes == entry.path.stat().st_size
    assert sorted(p.name for p in disk.dir.iterdir()) == [".lock", "ab12.safetensors"]
    found = disk.scan()
    assert [e.entry_id for e in found] == ["ab12"]
    assert found[0].tokens.tolist() == src["tokens"].tolist() and found[0].cuts == (3, 7)
    dest = empty_like(src)
    disk.read_into(entry.path, dest)
    for k in src:
        assert dest[k].dtype == src[k].dtype and dest[k].tobytes() == src[k].tobytes(), k
    assert disk.used == entry.nbytes


def test_files_are_standard_safetensors_with_bf16(disk: SnapshotDisk) -> None:
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file

    src = arrays(5, seed=2)
    entry = disk.write("cafe", src)
    with safetensors.safe_open(entry.path, framework="numpy") as f:
        meta = f.metadata()
        assert np.array_equal(f.get_tensor("ring"), src["ring"])
    assert meta["fingerprint"] == IDENT.fingerprint and meta["placement"] == IDENT.placement
    assert (meta["n_tokens"], meta["format_version"], meta["dtype"]) == ("5", "3", "bfloat16")
    loaded = load_file(entry.path)
    assert loaded["k.0"].dtype == torch.bfloat16 and tuple(loaded["k.0"].shape) == (2, 5, 8)
    assert np.array_equal(loaded["k.0"].view(torch.int16).numpy().view(np.uint16), src["k.0"])
    assert loaded["tokens"].tolist() == src["tokens"].tolist()


HYBRID = [
    TensorSpec("k.3", (2, 1, 8), "bfloat16", 1),
    TensorSpec("v.3", (2, 1, 8), "bfloat16", 1),
    TensorSpec("conv.0", (3, 12), "bfloat16", None),  # a recurrent state: no token axis
    TensorSpec("delta.0", (2, 4, 4), "float32", None),
]


def test_recurrent_states_round_trip_one_slot_per_cut(tmp_path: Path) -> None:
    """A hybrid's entry holds each state at each cut: the slots travel in cut order, and a
    file whose state slots do not match its cuts is refused."""
    d = SnapshotDisk(tmp_path / "kv", IDENT, HYBRID)
    try:
        src = arrays(9, seed=4, layout=HYBRID, n_cuts=3)
        assert src["conv.0"].shape == (3, 3, 12) and src["k.3"].shape == (2, 9, 8)
        entry = d.write("beef", src, cuts=(2, 5))
        assert entry.cuts == (2, 5, 9)
        assert [(e.entry_id, e.cuts) for e in d.scan()] == [("beef", (2, 5, 9))]
        dest = empty_like(src)
        d.read_into(entry.path, dest)
        assert all(dest[k].tobytes() == src[k].tobytes() for k in src)
        with pytest.raises(ValueError, match=r"conv.0 must be C-contiguous .* \[2, 3, 12\]"):
            d.write("f00d", src, cuts=(5,))  # three slots, two cuts
    finally:
        d.close()


def test_files_of_the_old_format_version_are_quarantined(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Version 2 files hold a hybrid's state at the end only, without a slot axis: never
    read, moved aside with a warning."""
    import luced.cache.disk as disk_mod

    d = SnapshotDisk(tmp_path / "kv", IDENT, LAYOUT)
    try:
        monkeypatch.setattr(disk_mod, "FORMAT_VERSION", 2)
        old = d.write("0123", arrays(4)).path
        monkeypatch.undo()
        with caplog.at_level(logging.WARNING):
            assert d.scan() == []
        assert not old.exists()
        assert [p.name for p in (d.dir / QUARANTINE).iterdir()] == ["0123.safetensors"]
        assert "format version 2, this build reads 3" in caplog.text
    finally:
        d.close()


def test_a_failed_write_leaves_no_file(disk: SnapshotDisk, monkeypatch: pytest.MonkeyPatch) -> None:
    real = safetensors.serialize_file

    def half_then_fail(specs: object, filename: str, metadata: object) -> None:
        real(specs, filename, metadata)
        with open(filename, "r+b") as f:
            f.truncate(100)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors, "serialize_file", half_then_fail)
    with pytest.raises(OSError, match="No space"):
        disk.write("dead", arrays(4))
    assert sorted(p.name for p in disk.dir.iterdir()) == [".lock"]
    assert disk.entries() == []


def foreign_file(tmp_path: Path, name: str, ident: DiskIdentity, layout: list[TensorSpec]) -> Path:
    other = SnapshotDisk(tmp_path / f"other-{name}", ident, layout)
    try:
        return other.write(name, arrays(6, layout=layout)).path
    finally:
        other.close()


def test_scan_quarantines_every_bad_file_with_a_warning(
    disk: SnapshotDisk, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    good = disk.write("0001", arrays(6, seed=1)).path
    trunc = disk.write("0002", arrays(6, seed=2)).path
    with trunc.open("r+b") as f:
        f.truncate(trunc.stat().st_size - 3)
    bad_tokens = disk.write("0003", arrays(6, seed=3)).path
    start, sp = spans(bad_tokens)
    flip(bad_tokens, start + sp["tokens"][0] + 5)
    bad_header = disk.write("0004", arrays(6, seed=4)).path
    flip(bad_header, 8, to=ord("X"))  # the JSON header's opening brace
    cases = {
        "0005": DiskIdentity("model-sha-2", "tmpl-1", "cpu:[0,2)", "bfloat16"),
        "0006": DiskIdentity("model-sha-1", "tmpl-1", "cpu:[0,1) cpu:1:[1,2)", "bfloat16"),
        "0007": DiskIdentity("model-sha-1", "tmpl-2", "cpu:[0,2)", "bfloat16"),
    }
    for name, ident in cases.items():
        os.replace(foreign_file(tmp_path, name, ident, LAYOUT), disk.dir / f"{name}.safetensors")
    wider = [TensorSpec("k.0", (4, 1, 8), "bfloat16", 1), *LAYOUT[1:]]  # another head count
    os.replace(foreign_file(tmp_path, "0008", IDENT, wider), disk.dir / "0008.safetensors")
    (disk.dir / "0009.safetensors").write_bytes(b"\x05\x00")  # no header at all
    (disk.dir / "NotHex.safetensors").write_bytes(good.read_bytes())
    (disk.dir / "000a.safetensors.tmp").write_bytes(b"half a write")
    (disk.dir / "README.txt").write_text("not ours: left alone")

    with caplog.at_level(logging.WARNING, logger="luced.cache.disk"):
        found = disk.scan()
    assert [e.entry_id for e in found] == ["0001"]
    quarantined = sorted(p.name for p in (disk.dir / QUARANTINE).iterdir())
    assert quarantined == [f"000{i}.safetensors" for i in range(2, 10)] + ["NotHex.safetensors"]
    assert sorted(p.name for p in disk.dir.iterdir()) == [
        ".lock",
        "0001.safetensors",
        "README.txt",
        QUARANTINE,
    ]
    text = caplog.text
    for needle in (
        "0002.safetensors (truncated",
        "0003.safetensors (tensor tokens fails its checksum",
        "0004.safetensors (header is not JSON",
        "0005.safetensors (fingerprint 'model-sha-2' is not this daemon's 'model-sha-1'",
        "0006.safetensors (placement",
        "0007.safetensors (template_hash",
        "0008.safetensors (tensor k.0",
        "0009.safetensors (truncated",
        "NotHex.safetensors (not a snapshot name",
        "000a.safetensors.tmp, a write interrupted by a crash",
    ):
        assert needle in text, needle
    # Quarantining the same name twice keeps both files.
    again = disk.write("0002", arrays(6)).path
    disk.quarantine(again, "test")
    assert (disk.dir / QUARANTINE / "0002.safetensors.1").exists()


def test_quarantine_keeps_only_the_newest_files(disk: SnapshotDisk) -> None:
    for i in range(QUARANTINE_KEEP + 5):
        disk.quarantine(disk.write(f"{i:04x}", arrays(4)).path, "test")
    kept = sorted(p.name for p in (disk.dir / QUARANTINE).iterdir())
    assert kept == [f"{i:04x}.safetensors" for i in range(5, QUARANTINE_KEEP + 5)]


def test_read_detects_flipped_data_and_wrong_destinations(disk: SnapshotDisk) -> None:
    src = arrays(6, seed=5)
    path = disk.write("beef", src).path
    start, sp = spans(path)
    flip(path, start + sp["v.0"][0] + 17)
    assert [e.entry_id for e in disk.scan()] == ["beef"]  # shapes are fine: scan cannot tell
    with pytest.raises(SnapshotFileError, match=r"tensor v\.0 fails its checksum"):
        disk.read_into(path, empty_like(src))
    path = disk.write("f00d", src).path
    short = empty_like(arrays(5))
    with pytest.raises(SnapshotFileError, match=r"k\.0 must be"):
        disk.read_into(path, short)
    dest = empty_like(src)
    del dest["ring"]
    with pytest.raises(SnapshotFileError, match="missing"):
        disk.read_into(path, dest)
    path.unlink()
    with pytest.raises(SnapshotFileError, match="cannot read"):
        disk.read_into(path, empty_like(src))


def test_evict_to_removes_least_recently_used_first(tmp_path: Path) -> None:
    disk = SnapshotDisk(tmp_path / "kv", IDENT, LAYOUT)
    for i, eid in enumerate(["a1", "a2", "a3", "a4"]):
        disk.write(eid, arrays(8, seed=i))
        disk.touch(eid, 1000.0 + i)
    disk.touch("a1", 2000.0)  # a1 is now the most recent; a2 the least
    size = disk.get("a1").nbytes  # type: ignore[union-attr]
    assert disk.plan_eviction(4 * size, lambda _: False) == []
    assert disk.evict_to(2 * size, in_use=lambda i: i == "a2") == ["a3", "a4"]
    assert sorted(e.entry_id for e in disk.entries()) == ["a1", "a2"]
    assert not (disk.dir / "a3.safetensors").exists()
    disk.close()
    # The order survives a restart: last use is the file's mtime.
    disk = SnapshotDisk(tmp_path / "kv", IDENT, LAYOUT)
    assert {e.entry_id: e.last_used for e in disk.scan()} == {"a1": 2000.0, "a2": 1001.0}
    assert disk.evict_to(size) == ["a2"]
    disk.close()


def test_one_daemon_per_model_directory(disk: SnapshotDisk) -> None:
    with pytest.raises(SnapshotDirBusy, match="in use"):
        SnapshotDisk(disk.root, IDENT, LAYOUT)
    other = SnapshotDisk(disk.root, OTHER_MODEL, LAYOUT)  # another model shares the root
    other.close()
    disk.close()
    again = SnapshotDisk(disk.root, IDENT, LAYOUT)
    again.close()


def test_bad_ids_and_arrays_are_refused(disk: SnapshotDisk) -> None:
    with pytest.raises(ValueError, match="bad snapshot id"):
        disk.write("../x", arrays(3))
    bad = arrays(3)
    bad["k.0"] = bad["k.0"].astype(np.float32)
    with pytest.raises(ValueError, match=r"k\.0 must be"):
        disk.write("abc", bad)
    assert sorted(p.name for p in disk.dir.iterdir()) == [".lock"]


# --- hostile directories (issue 19 item 3) ------------------------------------------------


def with_header(path: Path, edit) -> None:
    """Rewrite the JSON header of a snapshot file with edit(header text) -> text."""
    raw = path.read_bytes()
    (hlen,) = struct.unpack("<Q", raw[:8])
    text = edit(raw[8 : 8 + hlen].decode()).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + hlen :])


HOSTILE = {
    # the whole header nested 100k deep: json.loads raised RecursionError
    "0010": lambda h: "[" * 100_000 + "]" * 100_000,
    # a deep value inside the metadata map
    "0011": lambda h: h.replace(
        '"__metadata__":{', '"__metadata__":{"x":' + "[" * 50_000 + "]" * 50_000 + ",", 1
    ),
    # 1e999 in the cut list: int(inf) raised OverflowError
    "0012": lambda h: re.sub(r'"cuts":"\[[^"]*\]"', '"cuts":"[1e999]"', h),
    "0013": lambda h: re.sub(r'"cuts":"\[[^"]*\]"', '"cuts":"[NaN]"', h),
    "0014": lambda h: re.sub(r'"cuts":"\[[^"]*\]"', '"cuts":"{\\"a\\": 1}"', h),
    "0015": lambda h: h.replace('"crc32":"{', '"crc32":"{\\"x\\": -1, ', 1),
    "0016": lambda h: re.sub(r'"n_tokens":"\d+"', '"n_tokens":"' + "9" * 5000 + '"', h),
    "0017": lambda h: re.sub(r'"created":"[^"]*"', '"created":"1e999"', h),
    "0018": lambda h: re.sub(r'"cuts":"\[[^"]*\]"', '"cuts":"[' + "1" * 5000 + ']"', h),
}


def test_scan_survives_hostile_headers(
    disk: SnapshotDisk, caplog: pytest.LogCaptureFixture
) -> None:
    for name, edit in HOSTILE.items():
        with_header(disk.write(name, arrays(6)).path, edit)
    (disk.dir / "0019.safetensors").write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with caplog.at_level(logging.WARNING, logger="luced.cache.disk"):
        assert disk.scan() == []
    quarantined = sorted(p.name for p in (disk.dir / QUARANTINE).iterdir())
    assert quarantined == [f"{n}.safetensors" for n in [*HOSTILE, "0019"]]
    # and a restart does not meet them again
    assert disk.scan() == []


def test_scan_survives_random_bytes(disk: SnapshotDisk) -> None:
    rng = np.random.default_rng(0)
    good = disk.write("0001", arrays(6)).path.read_bytes()
    for i in range(40):
        data = bytearray(good)
        for _ in range(int(rng.integers(1, 6))):  # flip a few bytes of the header
            data[int(rng.integers(0, 400))] = int(rng.integers(0, 256))
        (disk.dir / f"{0x100 + i:04x}.safetensors").write_bytes(bytes(data))
    found = disk.scan()  # never raises; every file is either valid or quarantined
    names = {p.name for p in disk.dir.iterdir() if p.name.endswith(".safetensors")}
    assert names == {f"{e.entry_id}.safetensors" for e in found}


def test_a_symlinked_quarantine_is_never_followed(disk: SnapshotDisk, tmp_path: Path) -> None:
    victim_dir = tmp_path / "victim"
    victim_dir.mkdir()
    for i in range(QUARANTINE_KEEP + 4):
        (victim_dir / f"precious-{i}").write_text("keep me")
    (disk.dir / QUARANTINE).symlink_to(victim_dir)
    (disk.dir / "0009.safetensors").write_bytes(b"\x05\x00")
    assert disk.scan() == []
    assert len(list(victim_dir.iterdir())) == QUARANTINE_KEEP + 4  # nothing deleted or added


def test_symlinked_snapshot_files_are_not_read(disk: SnapshotDisk, tmp_path: Path) -> None:
    outside = tmp_path / "outside.safetensors"
    outside.write_bytes(disk.write("0001", arrays(6)).path.read_bytes())
    disk.remove("0001")
    (disk.dir / "0002.safetensors").symlink_to(outside)
    (disk.dir / "0003.safetensors.tmp").symlink_to(outside)
    assert disk.scan() == []
    assert outside.exists() and len(outside.read_bytes()) > 100  # neither read nor deleted
    assert (disk.dir / QUARANTINE / "0002.safetensors").is_symlink()


def test_a_symlinked_model_directory_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "kv"
    root.mkdir()
    (tmp_path / "elsewhere").mkdir()
    (root / model_dir_name(IDENT.fingerprint)).symlink_to(tmp_path / "elsewhere")
    with pytest.raises(SnapshotDirError, match="symlink"):
        SnapshotDisk(root, IDENT, LAYOUT)


def test_a_read_only_directory_is_a_dir_error(tmp_path: Path) -> None:
    root = tmp_path / "kv"
    root.mkdir()
    root.chmod(0o500)
    try:
        if os.access(root, os.W_OK):
            pytest.skip("running as root: permissions do not apply")
        with pytest.raises(SnapshotDirError):
            SnapshotDisk(root, IDENT, LAYOUT)
    finally:
        root.chmod(0o700)


def test_a_file_where_the_directory_should_be_is_a_dir_error(tmp_path: Path) -> None:
    (tmp_path / "kv").write_text("not a directory")
    with pytest.raises(SnapshotDirError):
        SnapshotDisk(tmp_path / "kv", IDENT, LAYOUT)


def test_other_models_keep_their_snapshots(tmp_path: Path) -> None:
    """A, then B, then A again: A's snapshots are still there, nothing quarantined."""
    a = SnapshotDisk(tmp_path / "kv", IDENT, LAYOUT)
    a.write("0a", arrays(6))
    a.close()
    b = SnapshotDisk(tmp_path / "kv", OTHER_MODEL, LAYOUT)
    b.write("0b", arrays(6))
    assert [e.entry_id for e in b.scan()] == ["0b"]
    b.close()
    a = SnapshotDisk(tmp_path / "kv", IDENT, LAYOUT)
    assert [e.entry_id for e in a.scan()] == ["0a"]
    assert not (a.dir / QUARANTINE).exists() and not (b.dir / QUARANTINE).exists()
    a.close()


def test_flat_layout_files_move_to_their_model(tmp_path: Path) -> None:
    root = tmp_path / "kv"
    mine = foreign_file(tmp_path, "0001", IDENT, LAYOUT)
    theirs = foreign_file(tmp_path, "0002", OTHER_MODEL, LAYOUT)
    root.mkdir()
    os.replace(mine, root / "0001.safetensors")  # as the flat layout kept them
    os.replace(theirs, root / "0002.safetensors")
    (root / "0003.safetensors").write_bytes(b"junk")
    disk = SnapshotDisk(root, IDENT, LAYOUT)
    assert [e.entry_id for e in disk.scan()] == ["0001"]
    assert (root / model_dir_name(OTHER_MODEL.fingerprint) / "0002.safetensors").exists()
    assert [p.name for p in (disk.dir / QUARANTINE).iterdir()] == ["0003.safetensors"]
    assert not list(root.glob("*.safetensors"))
    disk.close()
