"""Prefix cache end to end over a numpy "model": restored == fresh prefill, tiers, LRU, disk.

``NumpyModel`` stands in for the target: its KV is one array per layout tensor whose row at
position i depends on all tokens [0, i] (like real K/V), and it moves rows in and out of the
arena through ``Attachments`` exactly as a worker does. So every restore is checked byte for
byte against a fresh prefill of the same prompt.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest
import safetensors

from luced.cache.arena import TOKENS_SPEC, SnapshotArena, layout_bytes
from luced.cache.backoff import DISK_RETRY_S
from luced.cache.disk import QUARANTINE, DiskIdentity, SnapshotDisk, model_dir_name
from luced.cache.layout import TensorSpec
from luced.cache.prefix_cache import PrefixCache
from luced.ipc.regions import Attachments, Region, numpy_dtype
from luced.ipc.shm import ShmOwner

LAYOUT = [
    *(TensorSpec(f"{kv}.{layer}", (2, 1, 4), "bfloat16", 1) for layer in range(2) for kv in "kv"),
    TensorSpec("ring", (1, 2, 3), "float32", 0),
]
IDENT = DiskIdentity("fp", "tmpl", "cpu:[0,2)", "bfloat16")
CAP = 1024


class NumpyModel:
    """A KV holder with a fill position; prefill computes rows, export/import copy them."""

    def __init__(self) -> None:
        self.kv = {s.name: np.full(s.shape_for(CAP), 0xAB, numpy_dtype(s.dtype)) for s in LAYOUT}
        self.tokens = np.zeros(CAP, np.int32)
        self.position = 0
        self.computed = 0  # prompt tokens prefilled in total
        self.att = Attachments()
        self.gate: asyncio.Event | None = None  # when set, import_kv waits for it
        self.fail_export = False

    def rows(self, name: str) -> np.ndarray:
        """The tensor with its token axis first (a view)."""
        axis = next(s.token_axis for s in LAYOUT if s.name == name)
        return np.moveaxis(self.kv[name], axis, 0)

    def prefill(self, prompt: np.ndarray) -> None:
        """Compute positions [position, len): each row a function of the whole prefix."""
        prompt = np.asarray(prompt, np.int32)
        start = self.position
        assert np.array_equal(self.tokens[:start], prompt[:start]), "KV of another prompt"
        self.tokens[start : len(prompt)] = prompt[start:]
        pos = np.arange(len(prompt), dtype=np.int64)
        h = np.cumsum(prompt.astype(np.int64) * (pos + 1) * 2654435761 % 65521) % 65521
        for i, s in enumerate(LAYOUT):
            rows = self.rows(s.name)
            k = np.arange(int(np.prod(rows.shape[1:]))).reshape(rows.shape[1:])
            vals = (h[start:, None, None] * 31 + k[None] * 7 + i * 101) % 65536
            rows[start : len(prompt)] = vals.astype(rows.dtype)
        self.computed += len(prompt) - start
        self.position = len(prompt)

    def state(self) -> dict[str, bytes]:
        return {s.name: self.rows(s.name)[: self.position].tobytes() for s in LAYOUT} | {
            "tokens": self.tokens[: self.position].tobytes()
        }

    async def kv_layout(self) -> list[TensorSpec]:
        return list(LAYOUT)

    async def export_kv(
        self, n: int, regions: dict[str, Region], cuts: Sequence[int], entry: str
    ) -> None:
        assert set(regions) == {s.name for s in LAYOUT} and n <= self.position
        assert cuts[-1] == n
        if self.fail_export:
            raise RuntimeError("worker died")
        for s in LAYOUT:
            dst = np.moveaxis(self.att.view(regions[s.name]), s.token_axis, 0)
            assert dst.shape[0] == n
            dst[:] = self.rows(s.name)[:n]

    async def import_kv(
        self, n: int, regions: dict[str, Region], tokens: Region, entry: str
    ) -> None:
        assert set(regions) == {s.name for s in LAYOUT}
        if self.gate is not None:
            await self.gate.wait()
        for s in LAYOUT:
            src = np.moveaxis(self.att.view(regions[s.name]), s.token_axis, 0)
            assert src.shape[0] >= n
            self.rows(s.name)[:n] = src[:n]
        self.tokens[:n] = self.att.view(tokens)[:n]
        self.position = n


def fresh_state(prompt: np.ndarray) -> dict[str, bytes]:
    m = NumpyModel()
    m.prefill(prompt)
    return m.state()


async def serve(cache: PrefixCache, prompt: np.ndarray, save: bool = True) -> NumpyModel:
    """What the engine does for one request: lookup, restore, prefill the rest, save."""
    model = NumpyModel()
    hit = cache.lookup(prompt)
    if hit is not None:
        assert await cache.restore(hit, model) in (0, hit.n)
    model.prefill(prompt)
    assert model.state() == fresh_state(prompt)  # restored + rest == fresh prefill
    if save:
        await cache.save(prompt, len(prompt), model)
    return model


def toks(*parts: tuple[int, int]) -> np.ndarray:
    """Concatenated deterministic token runs: (seed, length) each."""
    return np.concatenate(
        [np.random.default_rng(seed).integers(0, 30_000, n, dtype=np.int32) for seed, n in parts]
    )


def ticking_clock() -> object:
    c = itertools.count(1000)
    return lambda: float(next(c))


@pytest.fixture
def owner() -> Iterator[ShmOwner]:
    own = ShmOwner("tpcache" + secrets.token_hex(3))
    yield own
    own.close_all()
    assert not list(Path("/dev/shm").glob(f"luced-{own.instance}-*"))


def files_of(root: Path) -> Path:
    """The model's directory inside --kv-cache-dir, where its snapshot files live."""
    return root / model_dir_name(IDENT.fingerprint)


def make(
    owner: ShmOwner,
    arena_bytes: int = 1 << 20,
    disk_dir: Path | None = None,
    budget: int | None = None,
    name: str = "prefix-arena",
    **kw: object,
) -> PrefixCache:
    arena = SnapshotArena(owner, arena_bytes, name=name)
    disk = SnapshotDisk(disk_dir, IDENT, LAYOUT) if disk_dir is not None else None
    return PrefixCache(LAYOUT, arena, disk, disk_budget=budget, clock=ticking_clock(), **kw)  # type: ignore[arg-type]


async def test_restore_then_prefill_equals_a_fresh_prefill(owner: ShmOwner) -> None:
    cache = make(owner)
    a = toks((1, 40))
    await serve(cache, a)
    b = np.concatenate([a[:30], toks((2, 25))])  # shares 30 tokens with a
    hit = cache.lookup(b)
    assert hit is not None and (hit.n, hit.tier) == (30, "memory")
    model = await serve(cache, b)
    assert model.computed == 25  # only the new part was computed
    # The same prompt again: everything but the last token comes from the cache.
    again = await serve(cache, a, save=False)
    assert again.computed == 1
    st = cache.stats()
    assert (st.queries, st.hits, st.hit_tokens) == (4, 2, 30 + 39)  # 3 serves + 1 lookup
    assert st.entries == 2 and st.memory_entries == 2 and st.disk_entries == 0
    await cache.close()


async def test_short_matches_and_prompts_are_not_worth_it(owner: ShmOwner) -> None:
    cache = make(owner, min_tokens=16, min_reuse=4)
    a = toks((1, 40))
    await serve(cache, a)
    assert cache.lookup(np.concatenate([a[:3], toks((3, 30))])) is None  # 3 < 4
    assert cache.lookup(np.concatenate([a[:4], toks((3, 30))])).n == 4  # type: ignore[union-attr]
    assert cache.lookup(np.concatenate([a[:15], toks((3, 30))])).n == 15  # type: ignore[union-attr]
    assert cache.lookup(a[:4]) is None  # 4 tokens leave 3 to reuse
    assert cache.lookup(a[:5]).n == 4  # type: ignore[union-attr]
    assert await cache.save(a[:10], 10, NumpyModel()) is None  # too short to keep
    assert len(cache.entries()) == 1
    await cache.close()


async def test_save_reuses_covering_entries_and_drops_redundant_ones(owner: ShmOwner) -> None:
    cache = make(owner)
    t1 = toks((1, 40))
    m = await serve(cache, t1)
    (e1,) = cache.entries()
    assert await cache.save(t1, 30, m) == e1.id  # a prefix of e1: e1 covers it
    assert len(cache.entries()) == 1 and cache.entries()[0].last_used > e1.last_used
    used = cache.arena.used
    t2 = np.concatenate([t1, toks((2, 20))])  # the next chat turn
    await serve(cache, t2)
    (e2,) = cache.entries()  # e1 (a prefix of e2) left memory, and had no disk copy
    assert e2.n_tokens == 60 and e2.id != e1.id and e2.tokens.tolist() == t2.tolist()
    assert cache.arena.used == cache.layout_bytes(60) and used == cache.layout_bytes(40)
    await serve(cache, t1)  # t1 is still served (from e2's first 39 rows)
    await cache.close()


async def test_memory_eviction_is_lru_by_bytes(owner: ShmOwner) -> None:
    size = make_size(40)
    cache = make(owner, arena_bytes=3 * size)
    prompts = [toks((seed, 40)) for seed in (1, 2, 3)]
    for p in prompts:
        await serve(cache, p)
    e0, e1, e2 = (e.id for e in sorted(cache.entries(), key=lambda e: e.created))
    await serve(cache, prompts[0], save=False)  # a hit: e0 is now more recent than e1, e2
    await serve(cache, toks((4, 40)))  # needs one block: evicts e1, the least recently used
    (e3,) = {e.id for e in cache.entries()} - {e0, e2}
    assert {e.id for e in cache.entries()} == {e0, e2, e3} and e1 not in {e0, e2, e3}
    # Arena: [e0 | e3 | e2]. Touch e0: LRU order is now e2, e3, e0.
    await serve(cache, prompts[0], save=False)
    assert make_size(80) <= 2 * size
    await serve(cache, toks((5, 80)))  # two blocks: evicts e2, then e3 (adjacent to it)
    assert {e.n_tokens for e in cache.entries()} == {40, 80}
    assert e0 in {e.id for e in cache.entries()}
    assert cache.arena.used == size + cache.layout_bytes(80)
    big = toks((6, 200))
    assert await cache.save(big, 200, _filled(big)) is None  # larger than the arena
    assert len(cache.entries()) == 2  # and nothing was evicted for it
    await cache.close()


async def test_each_entry_leaving_the_index_is_told_once(owner: ShmOwner) -> None:
    """What a worker on another host drops: every id the index forgets, and only those."""
    cache = make(owner, arena_bytes=2 * make_size(40))
    told: list[str] = []
    cache.on_drop = told.append
    a, b = toks((1, 40)), toks((2, 40))
    await serve(cache, a)
    await serve(cache, b)
    ea, eb = sorted(cache.entries(), key=lambda e: e.created)
    await serve(cache, toks((3, 40)))  # the arena holds two: a's entry (LRU) is evicted
    assert told == [ea.id]
    (ec,) = {e.id for e in cache.entries()} - {eb.id}
    # b's next turn: its restore makes c's entry the LRU one, evicted for the new entry,
    # which makes b's redundant.
    await serve(cache, np.concatenate([b, toks((4, 8))]))
    assert told == [ea.id, ec, eb.id]
    (newest,) = cache.entries()
    assert await cache.drop(newest.id) and told == [ea.id, ec, eb.id, newest.id]
    await cache.close()


def _filled(prompt: np.ndarray) -> NumpyModel:
    m = NumpyModel()
    m.prefill(prompt)
    return m


async def test_pinned_entries_survive_eviction_and_drop(owner: ShmOwner) -> None:
    size = make_size(40)
    cache = make(owner, arena_bytes=2 * size)
    a, b = toks((1, 40)), toks((2, 40))
    await serve(cache, a)
    await serve(cache, b)
    hit = cache.lookup(np.concatenate([a, toks((9, 5))]))
    assert hit is not None
    model = NumpyModel()
    model.gate = asyncio.Event()
    restoring = asyncio.create_task(cache.restore(hit, model))
    await asyncio.sleep(0)  # the restore is now pinned, waiting inside import_kv
    assert [e.pinned for e in cache.entries() if e.id == hit.entry_id] == [True]
    # New entries can only take the unpinned block: each evicts the previous one.
    c = await cache.save(toks((3, 40)), 40, _filled(toks((3, 40))))
    d = await cache.save(toks((4, 40)), 40, _filled(toks((4, 40))))
    assert {e.id for e in cache.entries()} == {hit.entry_id, d} and c != d
    # Two blocks' worth cannot fit beside the pinned entry: skipped, nothing evicted.
    assert await cache.save(toks((5, 80)), 80, _filled(toks((5, 80)))) is None
    assert {e.id for e in cache.entries()} == {hit.entry_id, d}
    assert await cache.drop(hit.entry_id)  # in use: gone from the index, block kept
    assert hit.entry_id not in {e.id for e in cache.entries()}
    assert cache.arena.used == 2 * size
    model.gate.set()
    assert await restoring == 40
    model.prefill(np.concatenate([a, toks((9, 5))]))
    assert model.state() == fresh_state(np.concatenate([a, toks((9, 5))]))
    assert cache.arena.used == size  # released at the unpin
    await cache.close()


def make_size(n: int) -> int:
    """Arena bytes of an n-token entry: the layout plus the token ids."""
    return layout_bytes((*LAYOUT, TOKENS_SPEC), n)


async def test_a_pinned_redundant_entry_stays(owner: ShmOwner) -> None:
    cache = make(owner)
    t1 = toks((1, 40))
    await serve(cache, t1)
    hit = cache.lookup(t1)
    assert hit is not None
    model = NumpyModel()
    model.gate = asyncio.Event()
    restoring = asyncio.create_task(cache.restore(hit, model))
    await asyncio.sleep(0)
    t2 = np.concatenate([t1, toks((2, 20))])  # makes t1's entry redundant, but it is in use
    await cache.save(t2, 60, _filled(t2))
    assert sorted(e.n_tokens for e in cache.entries()) == [40, 60]
    model.gate.set()
    assert await restoring == 39
    await cache.close()


async def test_export_errors_propagate_and_leave_nothing_behind(owner: ShmOwner) -> None:
    cache = make(owner)
    m = _filled(toks((1, 40)))
    m.fail_export = True
    with pytest.raises(RuntimeError, match="worker died"):
        await cache.save(toks((1, 40)), 40, m)
    assert cache.entries() == [] and cache.arena.used == 0
    await cache.close()


async def test_disk_tier_survives_a_restart(owner: ShmOwner, tmp_path: Path) -> None:
    kv = tmp_path / "kv"
    cache = make(owner, disk_dir=kv)
    a = toks((1, 300))
    await serve(cache, a)
    await cache.flush()
    (e,) = cache.entries()
    assert e.tier == "both" and e.disk_bytes > 0
    assert sorted(p.name for p in files_of(kv).iterdir()) == [".lock", f"{e.id}.safetensors"]
    await cache.close()

    cache = make(owner, disk_dir=kv, name="prefix-arena-2")  # a restarted daemon
    (d,) = cache.entries()
    assert (d.id, d.tier, d.n_tokens, d.disk_bytes) == (e.id, "disk", 300, e.disk_bytes)
    b = np.concatenate([a[:250], toks((2, 30))])
    hit = cache.lookup(b)
    assert hit is not None and (hit.n, hit.tier) == (250, "disk")
    model = await serve(cache, b, save=False)
    assert model.computed == 30
    assert cache.entries()[0].tier == "both" and cache.stats().hits == 1
    await cache.close()


async def test_corrupt_file_on_restore_is_quarantined_and_prefill_still_works(
    owner: ShmOwner, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    kv = tmp_path / "kv"
    cache = make(owner, disk_dir=kv)
    a = toks((1, 100))
    await serve(cache, a)
    await cache.close()
    (path,) = files_of(kv).glob("*.safetensors")
    data = bytearray(path.read_bytes())
    data[-500] ^= 0xFF  # inside the K/V data: only the checksum can tell
    path.write_bytes(bytes(data))

    cache = make(owner, disk_dir=kv, name="prefix-arena-2")
    assert len(cache.entries()) == 1  # the scan checks shapes, not every data byte
    with caplog.at_level(logging.WARNING):
        model = await serve(cache, a, save=False)  # restore fails -> full prefill
    assert model.computed == 100
    assert "fails its checksum" in caplog.text and path.name in caplog.text
    assert cache.entries() == [] and cache.stats().restore_errors == 1
    assert (files_of(kv) / QUARANTINE / path.name).exists() and not path.exists()
    assert cache.arena.used == 0
    await cache.close()


async def test_disk_budget_evicts_lru_files_and_keeps_pinned(
    owner: ShmOwner, tmp_path: Path
) -> None:
    kv = tmp_path / "kv"
    probe = make(owner, disk_dir=kv, name="probe")
    await serve(probe, toks((9, 50)))
    await probe.flush()
    file_size = probe.entries()[0].disk_bytes
    await probe.clear(disk=True)
    await probe.close()

    cache = make(owner, disk_dir=kv, budget=2 * file_size + 10)
    ps = [toks((seed, 50)) for seed in (1, 2, 3)]
    await serve(cache, ps[0])
    await serve(cache, ps[1])
    await cache.flush()
    await serve(cache, ps[0], save=False)  # touch entry 0: entry 1 is now the LRU
    await serve(cache, ps[2])
    await cache.flush()
    tiers = {int(e.tokens[0]): e.tier for e in cache.entries()}
    assert tiers == {ps[0][0]: "both", ps[1][0]: "memory", ps[2][0]: "both"}
    assert len(list(files_of(kv).glob("*.safetensors"))) == 2
    assert cache.stats().disk_bytes <= 2 * file_size + 10
    # Entry 0 is now the LRU file, but a restore holds it: the next write evicts entry 2.
    model = NumpyModel()
    model.gate = asyncio.Event()
    hit = cache.lookup(ps[0])
    assert hit is not None
    restoring = asyncio.create_task(cache.restore(hit, model))
    await asyncio.sleep(0)
    await serve(cache, toks((4, 50)))
    await cache.flush()
    tiers = {int(e.tokens[0]): e.tier for e in cache.entries()}
    assert tiers[ps[0][0]] == "both" and tiers[ps[2][0]] == "memory"
    model.gate.set()
    assert await restoring == 49
    await cache.drop(hit.entry_id)
    assert await cache.restore(hit, NumpyModel()) == 0  # a stale hit restores nothing
    await cache.close()


async def test_restart_indexes_only_valid_files(
    owner: ShmOwner, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    kv = tmp_path / "kv"
    cache = make(owner, disk_dir=kv)
    good, trunc = toks((1, 60)), toks((2, 60))
    await serve(cache, good)
    await serve(cache, trunc)
    await cache.flush()
    ids = {int(e.tokens[0]): e.id for e in cache.entries()}
    await cache.close()
    with (files_of(kv) / f"{ids[trunc[0]]}.safetensors").open("r+b") as f:
        f.truncate(1000)
    other = SnapshotDisk(
        tmp_path / "other", DiskIdentity("fp", "tmpl", "cpu:[0,1) cpu:1:[1,2)", "bfloat16"), LAYOUT
    )
    arrays = {
        s.name: np.zeros(s.shape_for(20), numpy_dtype(s.dtype)) for s in (*LAYOUT, TOKENS_SPEC)
    }
    other.write("0bad", arrays).path.rename(files_of(kv) / "0bad.safetensors")
    other.close()
    (files_of(kv) / "0dead.safetensors.tmp").write_bytes(b"crash")

    with caplog.at_level(logging.WARNING):
        cache = make(owner, disk_dir=kv, name="prefix-arena-2")
    assert [e.id for e in cache.entries()] == [ids[good[0]]]
    assert sorted(p.name for p in (files_of(kv) / QUARANTINE).iterdir()) == sorted(
        ["0bad.safetensors", f"{ids[trunc[0]]}.safetensors"]
    )
    assert "placement" in caplog.text and "truncated" in caplog.text and "0dead" in caplog.text
    assert not list(files_of(kv).glob("*.tmp"))
    assert (await serve(cache, trunc, save=False)).computed == 60  # no hit: a full prefill
    assert (await serve(cache, good, save=False)).computed == 1  # a disk hit
    await cache.close()


async def test_writes_run_in_the_background(
    owner: ShmOwner, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cache = make(owner, disk_dir=tmp_path / "kv")
    assert cache.disk is not None
    release = threading.Event()
    real_write = cache.disk.write

    def slow_write(*args: object, **kw: object) -> object:
        assert release.wait(10)
        return real_write(*args, **kw)  # type: ignore[arg-type]

    cache.disk.write = slow_write  # type: ignore[method-assign]
    eid = await cache.save(toks((1, 40)), 40, _filled(toks((1, 40))))
    (e,) = cache.entries()
    assert e.id == eid and e.tier == "memory" and e.pinned  # saved; the file is pending
    release.set()
    await cache.flush()
    (e,) = cache.entries()
    assert e.tier == "both" and not e.pinned

    def failing_write(*args: object, **kw: object) -> object:
        raise OSError(28, "No space left on device")

    cache.disk.write = failing_write  # type: ignore[method-assign]
    with caplog.at_level(logging.WARNING):  # a warning (no traceback): disk writes pause
        await cache.save(toks((2, 40)), 40, _filled(toks((2, 40))))
        await cache.flush()
    assert "No space left" in caplog.text and cache.stats().disk_write_errors == 1
    assert {e.tier for e in cache.entries()} == {"both", "memory"}
    assert not list(files_of(tmp_path / "kv").glob("*.tmp"))
    await cache.close()


async def test_redundant_files_go_once_the_longer_snapshot_is_written(
    owner: ShmOwner, tmp_path: Path
) -> None:
    kv = tmp_path / "kv"
    cache = make(owner, disk_dir=kv)
    t1 = toks((1, 40))
    await serve(cache, t1)
    await cache.flush()
    t2 = np.concatenate([t1, toks((2, 20))])
    await serve(cache, t2)
    await cache.flush()
    (e,) = cache.entries()
    assert e.n_tokens == 60 and e.tier == "both"
    assert [p.name for p in files_of(kv).glob("*.safetensors")] == [f"{e.id}.safetensors"]
    await cache.close()


async def test_admin_drop_clear_save_all(owner: ShmOwner, tmp_path: Path) -> None:
    kv = tmp_path / "kv"
    cache = make(owner, disk_dir=kv, budget=None)
    assert cache.disk is not None
    real_write = cache.disk.write
    cache.disk.write = lambda *a, **k: (_ for _ in ()).throw(OSError("disk off"))  # type: ignore[method-assign]
    for seed in (1, 2, 3):
        await serve(cache, toks((seed, 40)))
    await cache.flush()
    assert {e.tier for e in cache.entries()} == {"memory"}
    cache.disk.write = real_write  # type: ignore[method-assign]
    assert await cache.save_all() == 3
    assert {e.tier for e in cache.entries()} == {"both"} and len(
        list(files_of(kv).glob("*.sa*"))
    ) == 3
    first = cache.entries()[-1]
    assert await cache.drop(first.id) and not await cache.drop(first.id)
    assert not (files_of(kv) / f"{first.id}.safetensors").exists() and len(cache.entries()) == 2
    assert await cache.clear(disk=False) == 2
    assert {e.tier for e in cache.entries()} == {"disk"} and cache.arena.used == 0
    await serve(cache, toks((2, 40)), save=False)  # still served, from disk
    assert await cache.clear(disk=True) == 2
    assert cache.entries() == [] and not list(files_of(kv).glob("*.safetensors"))
    st = cache.stats()
    assert (st.entries, st.memory_bytes, st.disk_bytes) == (0, 0, 0)
    await cache.close()


async def test_a_full_disk_pauses_writes_with_one_warning(
    owner: ShmOwner,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A full filesystem: safetensors' own error at the OS boundary, as it raises it."""
    now = [1000.0]
    disk = SnapshotDisk(tmp_path / "kv", IDENT, LAYOUT)
    cache = PrefixCache(LAYOUT, SnapshotArena(owner, 1 << 20), disk, clock=lambda: now[0])
    tries: list[str] = []

    def full(specs: object, path: str, metadata: object) -> None:
        tries.append(path)
        raise safetensors.SafetensorError(
            "Error while serializing: I/O error: No space left on device (os error 28)"
        )

    monkeypatch.setattr(safetensors, "serialize_file", full)
    for seed in (1, 2, 3):
        await serve(cache, toks((seed, 40)))
        await cache.flush()
        now[0] += 1
    assert len(tries) == 1  # then no writes for DISK_RETRY_S
    st = cache.stats()
    assert (st.disk_error, st.disk_write_errors) == ("No space left on device (ENOSPC)", 1)
    assert {e.tier for e in cache.entries()} == {"memory"}
    assert [p.name for p in files_of(tmp_path / "kv").iterdir()] == [".lock"]  # no temp left
    said = [r for r in caplog.records if r.name == "luced.cache.prefix_cache"]
    assert [(r.levelno, r.exc_info) for r in said] == [(logging.WARNING, None)]
    assert "No space left on device" in said[0].getMessage()

    monkeypatch.undo()  # space again; the next write after the pause lands
    now[0] += DISK_RETRY_S
    await serve(cache, toks((4, 40)))
    await cache.flush()
    assert cache.stats().disk_error is None and cache.entries()[0].tier == "both"
    await cache.close()


async def test_exact_cuts_reuse_only_whole_snapshots(owner: ShmOwner) -> None:
    cache = make(owner, exact_cuts=True)
    t1 = toks((1, 40))
    await serve(cache, t1)
    t2 = np.concatenate([t1, toks((2, 20))])
    hit = cache.lookup(t2)
    assert hit is not None and hit.n == 40  # the snapshot's own end
    assert cache.lookup(np.concatenate([t1[:39], toks((3, 20))])) is None  # no shorter prefix
    assert cache.lookup(t1) is None  # would leave nothing to compute
    await serve(cache, t2)
    assert sorted(e.n_tokens for e in cache.entries()) == [40, 60]  # t1's cut is not in t2's
    m = await serve(cache, np.concatenate([t1, toks((4, 5))]), save=False)
    assert m.computed == 5
    await cache.close()


# -- a hybrid: recurrent states at cut points -------------------------------------------------

HYBRID = [
    TensorSpec("k.1", (2, 1, 4), "float32", 1),
    TensorSpec("v.1", (2, 1, 4), "float32", 1),
    TensorSpec("conv.0", (4, 8), "float32", None),  # states: one slot per cut
    TensorSpec("delta.0", (16,), "float32", None),
]


def summary(prefix: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """A recurrent state: a function of every token of the prefix."""
    h = float(np.sum(prefix.astype(np.int64) * np.arange(1, len(prefix) + 1)) % 65521)
    return np.full(shape, h + len(prefix), np.float32)


class StateModel:
    """A hybrid stand-in: K/V rows (the token at each position) and a state that sums up
    the prefix, which exists only where a prefill stopped (`keep`), as a real one."""

    def __init__(self) -> None:
        self.tokens = np.zeros(0, np.int32)
        self.kept: dict[int, dict[str, np.ndarray]] = {}
        self.att = Attachments()

    def states(self, n: int) -> dict[str, np.ndarray]:
        specs = [s for s in HYBRID if s.token_axis is None]
        return {s.name: summary(self.tokens[:n], s.shape) for s in specs}

    def prefill(self, prompt: np.ndarray, keep: Sequence[int] = ()) -> None:
        for stop in [*keep, len(prompt)]:
            self.tokens = np.asarray(prompt[:stop], np.int32)
            self.kept[stop] = self.states(stop)

    async def export_kv(
        self, n: int, regions: dict[str, Region], cuts: Sequence[int], entry: str
    ) -> None:
        assert n == len(self.tokens) == cuts[-1]
        for s in HYBRID:
            dst = self.att.view(regions[s.name])
            if s.token_axis is None:
                assert dst.shape == (len(cuts), *s.shape)
                for i, c in enumerate(cuts):
                    dst[i] = self.kept[c][s.name]  # KeyError: a cut whose state is gone
            else:
                dst[:] = self.tokens[None, :, None]

    async def import_kv(
        self, n: int, regions: dict[str, Region], tokens: Region, entry: str
    ) -> None:
        self.tokens = self.att.view(tokens)[:n].copy()
        for s in HYBRID:
            src = self.att.view(regions[s.name])
            if s.token_axis is None:
                assert src.shape == (1, *s.shape)
                assert np.array_equal(src[0], self.states(n)[s.name]), "the state of another cut"
            else:
                assert np.array_equal(
                    src[:, :n], np.broadcast_to(self.tokens[None, :, None], (2, n, 4))
                )
        self.kept = {n: self.states(n)}


async def test_hybrid_restores_the_state_of_the_last_shared_cut(
    owner: ShmOwner, tmp_path: Path
) -> None:
    """Two conversations share their first turn: the second restores at the first one's
    turn cut, from memory and from disk, with that cut's state; a lookup never restores
    a hybrid between cuts."""
    arena = SnapshotArena(owner, 1 << 20)
    disk = SnapshotDisk(tmp_path / "kv", IDENT, HYBRID)
    cache = PrefixCache(HYBRID, arena, disk, exact_cuts=True, clock=ticking_clock())
    turn1, turn2 = toks((1, 40)), toks((2, 30))
    first = np.concatenate([turn1, turn2])
    m = StateModel()
    m.prefill(first, keep=[40])
    await cache.save(first, len(first), m, cuts=[40])
    (entry,) = cache.entries()
    assert cache.layout_bytes(70, 2) == entry.nbytes > cache.layout_bytes(70)

    other = np.concatenate([turn1, toks((3, 25))])
    for tier in ("memory", "disk"):
        hit = cache.lookup(other)
        assert hit is not None and hit.n == 40 and hit.tier in (tier, "both")
        m2 = StateModel()
        assert await cache.restore(hit, m2) == 40  # import_kv checks the slot's state
        await cache.flush()
        await cache.clear()  # memory dropped: the next round reads the file
    assert cache.stats().hits == 2

    # Between cuts: the longest shared prefix (50) is no cut, so the turn cut (40) it is.
    hit = cache.lookup(np.concatenate([first[:50], toks((4, 10))]))
    assert hit is not None and hit.n == 40
    assert cache.lookup(np.concatenate([turn1[:39], toks((5, 10))])) is None
    # The end is a cut too: the next turn restores the whole first conversation.
    hit = cache.lookup(np.concatenate([first, toks((6, 10))]))
    assert hit is not None and hit.n == 70
    await cache.close()
