"""The prefix cache's set-up helpers: arena sizing, model fingerprint, placement key, and
where the cache keeps K/V blocks (host records, block files) rather than snapshots (the
arena, snapshot files)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from luced.engine.kv.block_store import BlockStore
from luced.engine.metrics import Metrics
from luced.ipc.shm import ShmOwner
from luced.runtime.tiny import make_tiny_draft, make_tiny_gguf
from luced.serve.config import KVOptions, load_config
from luced.serve.loader import LoadedModel, read_spec
from luced.serve.lucectl import render_status
from luced.serve.prefix_setup import arena_bytes, model_fingerprint, reserve_disk_dir


def test_arena_is_capped_at_half_the_free_shm(caplog: pytest.LogCaptureFixture) -> None:
    st = os.statvfs("/dev/shm")
    half = st.f_bavail * st.f_frsize // 2
    assert arena_bytes(1 << 20) == 1 << 20
    got = arena_bytes(half * 4)
    # (free space moves a little while other tests run)
    assert half * 0.9 <= got <= half * 1.1
    assert "exceeds half of the free space" in caplog.text


def test_fingerprint_sees_the_header_and_the_tail(tmp_path: Path) -> None:
    a = tmp_path / "a.gguf"
    data = bytearray(os.urandom(3 << 20))
    a.write_bytes(data)
    base = model_fingerprint(a)
    assert model_fingerprint(a) == base
    for where in (10, len(data) - 10):
        changed = bytearray(data)
        changed[where] ^= 1
        a.write_bytes(changed)
        assert model_fingerprint(a) != base
    a.write_bytes(data + b"x")  # size
    assert model_fingerprint(a) != base


def _kv_options(tmp_path: Path, kv_dir: Path) -> tuple[KVOptions, str]:
    model = tmp_path / "m.gguf"
    model.write_bytes(os.urandom(4096))
    cfg = load_config([str(model), "--kv-cache-dir", str(kv_dir)], env={}, default_config_path=None)
    return cfg.kv, str(model)


def test_an_unusable_cache_dir_is_a_warning_and_memory_only(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    kv = tmp_path / "kv"
    kv.write_text("a file where the directory should be")
    kv_options, model = _kv_options(tmp_path, kv)
    r = reserve_disk_dir(kv_options, model)
    assert r.lock_fd is None and r.problem is not None and str(kv) in r.problem
    assert "serving with the memory tier only" in caplog.text
    stats = {"entries": 0, "disk_budget": None, "disk_problem": r.problem}
    assert "disk tier OFF (memory only)" in render_status({"prefix_cache": stats})


def test_a_held_cache_dir_is_refused_before_the_load(tmp_path: Path) -> None:
    kv_options, model = _kv_options(tmp_path, tmp_path / "kv")
    first = reserve_disk_dir(kv_options, model)
    assert first.lock_fd is not None
    with pytest.raises(ValueError, match="in use by another luced daemon"):
        reserve_disk_dir(kv_options, model)
    first.release()
    reserve_disk_dir(kv_options, model).release()


REMOTE = ("--target-devices", "cpu,tcp://10.0.0.2:7070/cpu", "--worker-key-file", "key")


@pytest.mark.parametrize(
    ("args", "blocks"),
    [
        (("--kv-cache-dir", "kv"), True),  # several running requests share one block pool
        (("--kv-cache-dir", "kv", "--draft", "ngram"), True),  # no feature rings
        (("--kv-cache-dir", "kv", "--draft", "dflash"), True),  # their rows beside the blocks
        (("--kv-cache-dir", "kv", "--max-running", "1"), True),  # one running, same pool
        (("--kv-cache-dir", "kv", "--kv-block-size", "0"), False),  # one cache each, no blocks
        (("--kv-cache-dir", "kv", "--kv-flash", "512"), True),  # KV Flash pages the same blocks
        (("--kv-flash", "512", "--max-running", "1"), True),  # its pool: blocks of 64
        (("--kv-cache-dir", "kv", "--prefix-cache-bytes", "0"), False),
        ((), True),  # no disk tier: blocks in host records only
        (("--max-running", "1"), True),
        (("--kv-block-size", "0"), False),
        # a worker on another host keeps its part of the blocks on its host
        (("--kv-cache-dir", "kv", *REMOTE), True),
        (("--kv-flash", "512", *REMOTE), True),
        (("--draft", "dflash", *REMOTE), True),
    ],
)
def test_the_cache_keeps_blocks_where_it_can(tmp_path: Path, args, blocks: bool) -> None:
    """`ModelSpec.block_store`, decided before the load: blocks (in memory, and on disk
    with a directory; on their own hosts for workers on other hosts) for requests in a
    block pool, --kv-block-size's or KV Flash's; snapshots otherwise."""
    model = make_tiny_gguf("llama", tmp_path / "m.gguf", seed=1, layers=2, context=1024).path
    key = tmp_path / "key"
    key.write_text("k" * 40)
    key.chmod(0o600)
    argv = [str(model), *(_path(a, model, tmp_path) for a in args)]
    cfg = load_config(argv, env={}, default_config_path=None)
    assert read_spec(cfg).block_store is blocks


def _path(arg: str, model: Path, tmp_path: Path) -> str:
    """An argument with "kv" standing for a directory, "key" for the worker key file and
    "dflash" for a draft's file."""
    if arg == "dflash":
        return str(make_tiny_draft(model, tmp_path / "draft", seed=2, block_size=4)[1])
    return str(tmp_path / arg) if arg in ("kv", "key") else arg


@pytest.mark.parametrize(
    ("args", "arena"),
    [
        ((), False),
        (("--draft", "dflash"), False),
        (("--max-running", "1", "--kv-flash", "512"), False),
        (("--kv-block-size", "0"), True),
    ],
    ids=["blocks", "blocks+rings", "kv-flash-blocks", "snapshots"],
)
async def test_the_arena_is_carved_only_for_snapshots(tmp_path: Path, args, arena: bool) -> None:
    """The daemon's model start: where the cache keeps K/V blocks no `prefix-arena`
    segment is created (their memory is the host records of `kvhost`, sized by
    --prefix-cache-bytes, a DFlash draft's ring rows counted in it), with KV Flash too;
    one running request without it keeps snapshots in an arena."""
    model = make_tiny_gguf("llama", tmp_path / "m.gguf", seed=1, layers=8, context=1024).path
    extra = [_path(a, model, tmp_path) for a in args]
    argv = [str(model), "--prefix-cache-bytes", "8M", "--threads", "1", *extra]
    spec = read_spec(load_config(argv, env={}, default_config_path=None))
    with ShmOwner() as owner:
        loaded = LoadedModel.build(spec, owner, Metrics(), "m1")
        try:
            await loaded.start()
            names = {n.split("-", 2)[2] for n in owner.names}  # /luced-<instance>-<name>
            cache = loaded.engine.prefix_cache
            assert cache is not None and (cache.arena is not None) is arena
            assert ("m1-prefix-arena" in names) is arena
            if not arena:
                store = cache.blocks
                assert isinstance(store, BlockStore) and not store.on_disk
                assert "m1-kvhost" in names
                assert (store.rings is not None) is ("dflash" in args)
                block = store.record_bytes + (store.rings.block_bytes if store.rings else 0)
                short = (8 << 20) - cache.stats().memory_capacity  # whole blocks of it
                assert 0 <= short < block
        finally:
            await loaded.close()
