"""A remote worker's own snapshot store (runtime/snapshot_store.py): its memory tier within its
budget, least recently used first; its disk tier in the daemon's file format, found again
by a new store (a restarted worker); forget; a corrupt file is a miss, quarantined."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from luced.cache.layout import TensorSpec
from luced.runtime.snapshot_store import Held, ShardSnapshots

LAYOUT = [
    TensorSpec("k.2", (2, 1, 4), "bfloat16", 1),
    TensorSpec("v.2", (2, 1, 4), "bfloat16", 1),
    TensorSpec("conv.3", (3, 5), "float32", None),
]


def held(seed: int, n: int = 10, cuts: tuple[int, ...] | None = None) -> Held:
    rng = np.random.default_rng(seed)
    cuts = cuts or (n,)
    arrays = {
        "k.2": rng.integers(0, 2**16, (2, n, 4), dtype=np.uint16),
        "v.2": rng.integers(0, 2**16, (2, n, 4), dtype=np.uint16),
        "conv.3": rng.standard_normal((len(cuts), 3, 5), dtype=np.float32),
    }
    return Held(arrays, rng.integers(0, 1000, n, dtype=np.int32), cuts)


def same(a: Held | None, b: Held) -> bool:
    return (
        a is not None
        and a.cuts == b.cuts
        and np.array_equal(a.tokens, b.tokens)
        and all(np.array_equal(a.arrays[k], b.arrays[k]) for k in b.arrays)
    )


def opened(memory: int, directory: Path | None = None) -> ShardSnapshots:
    store = ShardSnapshots(memory, directory)
    store.open("model-sha", "bfloat16", "2-4", LAYOUT)
    return store


def test_memory_keeps_the_most_recently_used_within_its_budget() -> None:
    size = held(0).nbytes
    store = opened(2 * size + size // 2)
    a, b, c = held(1), held(2), held(3)
    store.put("a1", a)
    store.put("b2", b)
    assert same(store.get("a1"), a)  # a is now the most recently used
    store.put("c3", c)  # over budget: b goes
    assert store.get("b2") is None and same(store.get("a1"), a) and same(store.get("c3"), c)
    assert store.forget(["a1", "ff"]) == 1 and store.get("a1") is None
    store.put("big", held(4, n=200))  # larger than the budget: not kept
    assert store.get("big") is None
    store.close()


def test_the_disk_tier_outlives_the_store_and_forget_deletes(tmp_path: Path) -> None:
    store = opened(1 << 20, tmp_path)
    a, b = held(1, cuts=(4, 10)), held(2)
    store.put("a1", a)
    store.put("b2", b)
    store.close()  # a restarted worker: memory gone, files flushed
    again = opened(1 << 20, tmp_path)
    assert same(again.get("a1"), a) and same(again.get("b2"), b)  # read back from disk
    assert again.forget(["a1"]) == 1
    again.flush()
    assert [p.stem for p in tmp_path.rglob("*.safetensors")] == ["b2"]
    again.close()


def test_another_load_gets_its_own_directory_and_an_empty_memory(tmp_path: Path) -> None:
    store = opened(1 << 20, tmp_path)
    store.put("a1", held(1))
    store.flush()
    store.open("model-sha", "bfloat16", "0-2", LAYOUT)  # other layers: other rows
    assert store.get("a1") is None
    store.open("model-sha", "bfloat16", "2-4", LAYOUT)  # back: its files are found again
    assert same(store.get("a1"), held(1))
    store.close()


def test_a_corrupt_file_is_a_miss_and_is_quarantined(tmp_path: Path) -> None:
    store = opened(0, tmp_path)  # no memory: every get reads the file
    store.put("a1", held(1))
    store.flush()
    (path,) = tmp_path.rglob("*.safetensors")
    raw = bytearray(path.read_bytes())
    raw[-5] ^= 0xFF  # a flipped bit in the last tensor's data
    path.write_bytes(bytes(raw))
    assert store.get("a1") is None
    assert not list(tmp_path.glob("*/*.safetensors"))
    assert list(tmp_path.rglob("quarantine/*"))
    store.close()
