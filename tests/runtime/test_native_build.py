"""native_build: the kernel cache with and without a C compiler, the ABI check at load,
and what a worker reports about its kernels (`native.describe`). "No compiler" is a real
environment (an empty PATH, $CC naming nothing) or the loader's `cc` argument."""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from luced.runtime import native, native_attention, native_build

CC = native_build.compiler()
CPU = torch.device("cpu")
ROOT = Path(__file__).resolve().parents[2]
LIBRARIES = (native.LIBRARY, native_attention.LIBRARY)

pytestmark = pytest.mark.skipif(CC is None, reason="no C compiler to build the kernels with")


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An XDG_CACHE_HOME holding every library, built once by this machine's compiler."""
    root = tmp_path_factory.mktemp("built")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(root))
        for library in LIBRARIES:
            native_build.build(library.name, CC)  # type: ignore[arg-type]
    return root


@pytest.fixture
def cache(built: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """This test's own copy of `built` as XDG_CACHE_HOME (-> its kernels folder), with no
    library opened yet in this process."""
    root = tmp_path / "cache"
    shutil.copytree(built, root)
    monkeypatch.setenv("XDG_CACHE_HOME", str(root))
    native_build.opened.cache_clear()
    yield root / "luced" / "kernels"
    native_build.opened.cache_clear()


def test_build_is_named_by_source_and_compiler_and_cached(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = native_build.build("qgemm", CC)  # type: ignore[arg-type]
    assert path.parent == tmp_path / "luced" / "kernels" and path.stat().st_size > 0
    assert path.name.startswith(f"qgemm-{native_build.source_key('qgemm')}-")
    mtime = path.stat().st_mtime_ns
    assert native_build.build("qgemm", CC) == path and path.stat().st_mtime_ns == mtime  # type: ignore[arg-type]
    assert native_build.cached("qgemm") == path
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary left


NO_COMPILER_PROBE = """
import logging, sys, torch
from luced.runtime import native, native_build
logging.basicConfig(level=logging.INFO, format="%(message)s")
assert native_build.compiler() is None, native_build.compiler()
print(native.describe(torch.device("cpu"), sys.argv[1]))
if sys.argv[1] == "native":  # raises where the kernels could not be had
    kern = native.kernels(torch.device("cpu"), "native")
    codes, scale = native.pack_int8(torch.ones(16, 32, dtype=torch.int8), torch.ones(16, 1))
    print(kern.int8(codes, scale, 16, torch.ones(1, 32))[0, 0].item())
"""


def without_compiler(cache_home: Path, mode: str, tmp_path: Path) -> subprocess.CompletedProcess:
    """The probe in a Python whose PATH holds no compiler and whose $CC names none."""
    empty = tmp_path / "empty-bin"
    empty.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "CC"}
    env.update(PATH=str(empty), XDG_CACHE_HOME=str(cache_home), PYTHONPATH=str(ROOT))
    return subprocess.run(
        [sys.executable, "-c", NO_COMPILER_PROBE, mode],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


def test_a_cached_build_loads_without_a_compiler(cache: Path, tmp_path: Path) -> None:
    done = without_compiler(cache.parents[1], "native", tmp_path)
    assert done.returncode == 0, done.stderr
    kind, product = done.stdout.split("\n")[:2]
    assert kind == f"native {native.best_isa(native.cpu_flags())}"
    assert float(product) == 32.0  # 32 inputs of 1 times weights of 1
    assert "no C compiler: loading the cached build" in done.stderr


def test_without_compiler_or_cache_the_worker_reports_the_fallback(
    tmp_path: Path,
) -> None:
    done = without_compiler(tmp_path / "empty-cache", "auto", tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("torch fallback: no C compiler (gcc, cc or $CC) and no cached")
    assert "decode runs several times slower" in done.stderr  # the log says what it costs


def test_a_compiler_that_fails_falls_back_to_a_cached_build(
    cache: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, "luced.runtime.native_build"):
        lib = native_build.open_checked(native.LIBRARY, "/bin/false")
    assert lib.luced_abi_version() == native.LIBRARY.abi
    assert "loading the cached build" in caplog.text
    assert "instead: /bin/false failed on csrc/qgemm.c" in caplog.text


def test_build_failure_falls_back_or_raises(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A compiler that fails and nothing cached: auto warns once and returns None (the torch
    path); native raises; torch never builds."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CC", "/bin/false")
    native_build.opened.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="luced.runtime.native_build"):
            assert native_build.load(native_attention.LIBRARY) is None
        assert "unavailable, using torch's: decode runs several times slower" in caplog.text
        native_build.opened.cache_clear()
        monkeypatch.setenv("LUCED_KERNELS", "native")
        with pytest.raises(RuntimeError, match="failed"):
            native_build.load(native_attention.LIBRARY)
        native_build.opened.cache_clear()
        monkeypatch.setenv("LUCED_KERNELS", "torch")
        assert native_build.load(native_attention.LIBRARY) is None
        assert not list(tmp_path.rglob("*.so*"))  # nothing half-written was left behind
    finally:
        native_build.opened.cache_clear()


def test_abi_mismatch_is_rebuilt_with_a_compiler_and_refused_without(
    cache: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # The cached build replaced by one whose C side speaks ABI 999 (same name: a stale or
    # tampered file, or bindings changed without their C side).
    [path] = cache.glob("qgemm-*.so")
    source = tmp_path / "csrc"
    shutil.copytree(native_build.SOURCES, source)
    text = (source / "qgemm.c").read_text()
    assert "#define ABI_VERSION 1\n" in text
    (source / "qgemm.c").write_text(
        text.replace("#define ABI_VERSION 1\n", "#define ABI_VERSION 999\n")
    )
    subprocess.run(
        [CC, *native_build.FLAGS, "-o", str(path), str(source / "qgemm.c"), "-lm"], check=True
    )
    with pytest.raises(native_build.BuildError, match="ABI version 999, its bindings expect 1"):
        native_build.open_checked(native.LIBRARY, None)
    with caplog.at_level(logging.WARNING, "luced.runtime.native_build"):
        lib = native_build.open_checked(native.LIBRARY, CC)
    assert "ABI mismatch: ABI version 999, its bindings expect 1 in" in caplog.text
    assert lib.luced_abi_version() == 1
    assert native_build.cached("qgemm") == path  # rebuilt in place: a later start loads it
    assert native_build.abi_problem(ctypes.CDLL(str(path)), native.LIBRARY) is None


def test_a_cached_build_that_does_not_load_is_rebuilt_or_refused(cache: Path) -> None:
    [path] = cache.glob("qgemm-*.so")
    path.write_bytes(b"")  # what a file system may leave of an unsynced file after a crash
    with pytest.raises(native_build.BuildError, match="a build that does not load"):
        native_build.open_checked(native.LIBRARY, None)
    assert native_build.open_checked(native.LIBRARY, CC).luced_abi_version() == 1
    assert path.stat().st_size > 0


def test_a_struct_mirror_of_another_size_is_refused(cache: Path) -> None:
    lib = native_build.open_checked(native_attention.LIBRARY, None)
    assert native_build.abi_problem(lib, native_attention.LIBRARY) is None

    class SequenceKV(ctypes.Structure):  # a field the C struct lacks
        _fields_ = [*native_attention.SequenceKV._fields_, ("extra", ctypes.c_int64)]

    grown = native_build.Library("decode_attention", 1, (SequenceKV,))
    c_size = ctypes.sizeof(native_attention.SequenceKV)
    with pytest.raises(native_build.BuildError, match=f"SequenceKV is {c_size} bytes in C"):
        native_build.open_checked(grown, None)
    stranger = native_build.Library("qgemm", 1, (SequenceKV,))  # exports no sizes at all
    with pytest.raises(native_build.BuildError, match="a build without ABI checks"):
        native_build.open_checked(stranger, None)


def test_describe_names_the_variant_or_the_choice(cache: Path) -> None:
    isa = native.best_isa(native.cpu_flags())
    assert native.describe(CPU, "native") == f"native {isa}"
    assert native.describe(CPU, "torch") == "torch"
    assert native.describe(torch.device("meta"), "auto") == "torch"  # not a CPU
