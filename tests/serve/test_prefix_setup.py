"""The prefix cache's set-up helpers: arena sizing, model fingerprint, placement key."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from luced.serve.config import KVOptions, load_config
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
