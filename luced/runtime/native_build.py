"""luced's C kernels (luced/runtime/csrc): compiled on first use with the system C compiler
into a per-user cache, loaded with ctypes.

One build serves every CPU of its architecture: the sources pick their vector paths per
function at load (GCC `target_clones` / `target` attributes), never by `-march=native`, so
a cache shared between machines stays correct. The cache key is the source (with csrc's
headers), the flags and the compiler's version; a build goes to a temporary name and is
renamed into place, so workers starting together never load a half-written library. Where
no compiler works the caller gets None and keeps its torch path (correct everywhere, only
slower); set `LUCED_KERNELS=torch` to choose that path on purpose.

The kernels use OpenMP. torch's CPU wheel ships and has already loaded its own
`libgomp.so.1`, so the libraries resolve to that runtime and share torch's thread pool.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

SOURCES = Path(__file__).with_name("csrc")
FLAGS = ("-O3", "-shared", "-fPIC", "-fopenmp", "-std=c11", "-Wall")
KERNEL_CHOICES = ("auto", "native", "torch")


def kernel_choice() -> str:
    """`LUCED_KERNELS`: auto (native where it builds, torch elsewhere), native (a build
    failure is an error), torch (never build)."""
    choice = os.environ.get("LUCED_KERNELS", "auto")
    if choice not in KERNEL_CHOICES:
        raise ValueError(f"LUCED_KERNELS={choice!r}: choose one of {', '.join(KERNEL_CHOICES)}")
    return choice


def cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "luced" / "kernels"


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")


def build(name: str) -> Path:
    """Compile csrc/<name>.c (if its build is not cached) and return the library's path.
    Raises RuntimeError with the compiler's message when it fails."""
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler (gcc or cc) on PATH")
    # the shared headers are part of every source
    source = b"".join(p.read_bytes() for p in [SOURCES / f"{name}.c", *sorted(SOURCES.glob("*.h"))])
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256(source + " ".join(FLAGS).encode() + version.encode()).hexdigest()
    target = cache_dir() / f"{name}-{key[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run(
            [cc, *FLAGS, "-o", tmp, str(SOURCES / f"{name}.c"), "-lm"],
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            raise RuntimeError(f"{cc} failed on csrc/{name}.c:\n{done.stderr.strip()}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    log.info("built native kernels %s -> %s", name, target)
    return target


def load(name: str) -> ctypes.CDLL | None:
    """The library of csrc/<name>.c, or None where native kernels are off (`LUCED_KERNELS`,
    read on every call, as `native.kernels` reads it) or cannot be built (one warning;
    callers then take their torch path). `LUCED_KERNELS=native` makes a failure an error."""
    choice = kernel_choice()
    if choice == "torch":
        return None
    library, error = opened(name)
    if error is not None and choice == "native":
        raise RuntimeError(f"LUCED_KERNELS=native but kernels {name} failed: {error}")
    return library


@functools.cache
def opened(name: str) -> tuple[ctypes.CDLL | None, Exception | None]:
    """csrc/<name>.c built and loaded once per process: (library, None), or (None, why)."""
    try:
        library = ctypes.CDLL(str(build(name)))
    except (OSError, RuntimeError) as exc:
        log.warning("native kernels %s unavailable, using torch's: %s", name, exc)
        return None, exc
    log.info("native kernels %s loaded", name)
    return library, None


if __name__ == "__main__":  # tools/install.sh: build every kernel ahead of the first start
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for path in sorted(SOURCES.glob("*.c")):
        print(build(path.stem))
