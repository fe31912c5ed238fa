"""The prefix cache's set-up helpers: arena sizing, model fingerprint, placement key."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from luced.serve.prefix_setup import arena_bytes, model_fingerprint


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
