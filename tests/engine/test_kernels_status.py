"""What the engine says about its workers' kernels: a worker that has neither a C compiler
nor a cached build runs torch's kernels, and its load reply, its stats, the engine's
status (`lucectl status`) and the daemon's log all say so."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from engine_harness import engine_for

from luced.engine.executor import kernels_summary
from luced.runtime.tiny import make_tiny_gguf


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("ks") / "llama.gguf"
    return make_tiny_gguf("llama", path, seed=4, layers=2, context=512).path


async def test_a_worker_without_compiler_or_cache_reports_torch_fallback(
    tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # The workers inherit this environment: no compiler on PATH, none in $CC, an empty cache.
    (tmp_path / "bin").mkdir()
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("LUCED_KERNELS", "auto")
    with caplog.at_level(logging.WARNING, "luced.engine.executor"):
        async with engine_for(tiny, weights="int4") as engine:
            status = engine.status()
            stats = await engine.target.stats()
    [worker] = status["placement"]
    assert worker["kernels"].startswith("torch fallback: no C compiler (gcc, cc or $CC)")
    assert status["kernels"] == stats["kernels"] == worker["kernels"]
    assert "decode runs several times slower" in caplog.text


def test_the_summary_names_each_group_when_workers_differ() -> None:
    cpu = {"group": "cpu", "kernels": "native avx2"}
    assert kernels_summary([cpu, {**cpu, "layers": [2, 4]}]) == "native avx2"
    mixed = [cpu, {"group": "cuda", "kernels": "torch"}]
    assert kernels_summary(mixed) == "cpu: native avx2, cuda: torch"
    assert kernels_summary([{"group": "cpu", "kernels": None}]) is None  # not loaded yet
