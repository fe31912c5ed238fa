"""luced's C kernels (luced/runtime/csrc): compiled on first use with the system C compiler
into a per-user cache, loaded with ctypes and checked against their Python bindings.

One build serves every CPU of its architecture: the sources pick their vector paths per
function at load (GCC `target_clones` / `target` attributes), never by `-march=native`, so
a cache shared between machines stays correct. A build is named by its source (with
csrc's headers) and flags, then by the compiler that made it:

    $XDG_CACHE_HOME/luced/kernels/<name>-<source key>-<compiler key>.so

With a compiler, the build of that compiler is used (made when missing). Without one (gcc
removed after install, a PATH that lacks it) the newest build of the same source and flags
is used, whichever compiler made it: the compiler changes the code, never what it computes.
A build goes to a temporary name and is renamed into place, so workers starting together
never load a half-written library.

Each library exports `luced_abi_version()` and, when its bindings mirror C structs,
`luced_sizeof(name)`; both are checked against the binding's `Library` at load. A cached
build that disagrees is rebuilt where a compiler exists and refused otherwise. Where no
build can be had the caller gets None and keeps its torch path (correct everywhere,
several times slower at decode; one warning per library); set `LUCED_KERNELS=torch` to
choose that path on purpose.

The kernels use OpenMP. torch's CPU wheel ships and has already loaded its own
`libgomp.so.1`, so the libraries resolve to that runtime and share torch's thread pool.
"""

from __future__ import annotations

import _ctypes
import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

SOURCES = Path(__file__).with_name("csrc")
FLAGS = ("-O3", "-shared", "-fPIC", "-fopenmp", "-std=c11", "-Wall")
KERNEL_CHOICES = ("auto", "native", "torch")


@dataclass(frozen=True)
class Library:
    """csrc/<name>.c as its Python module binds it: the ABI version the bindings were
    written for (the C side's `luced_abi_version()`), and the ctypes structures that mirror
    C structs of the same name (each `ctypes.sizeof` must equal `luced_sizeof(name)`)."""

    name: str
    abi: int
    structs: tuple[type[ctypes.Structure], ...] = ()


class BuildError(RuntimeError):
    """No usable build: the first line says why in a few words (worker status shows it),
    further lines carry the details (a compiler's messages)."""


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


def compiler() -> str | None:
    """The C compiler's path: $CC (a name on PATH or a path), else gcc or cc on PATH; None
    when none of them is an executable."""
    cc = os.environ.get("CC")
    if cc:
        return shutil.which(cc)
    return shutil.which("gcc") or shutil.which("cc")


def source_key(name: str) -> str:
    """What a build of csrc/<name>.c computes: its source, the shared headers, the flags."""
    source = b"".join(p.read_bytes() for p in [SOURCES / f"{name}.c", *sorted(SOURCES.glob("*.h"))])
    return hashlib.sha256(source + " ".join(FLAGS).encode()).hexdigest()[:16]


def _compiler_key(cc: str) -> str:
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    return hashlib.sha256(version.encode()).hexdigest()[:8]


def build(name: str, cc: str) -> Path:
    """csrc/<name>.c built by `cc` (compiled unless cached) -> the library's path. Raises
    BuildError with the compiler's messages when it fails."""
    target = cache_dir() / f"{name}-{source_key(name)}-{_compiler_key(cc)}.so"
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
            raise BuildError(f"{cc} failed on csrc/{name}.c\n{done.stderr}".strip())
        with open(tmp, "rb") as f:  # on disk before its name is: a crash leaves no stub
            os.fsync(f.fileno())
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    log.info("built native kernels %s -> %s", name, target)
    return target


def cached(name: str) -> Path | None:
    """The newest build of csrc/<name>.c's current source and flags, by any compiler."""
    builds = cache_dir().glob(f"{name}-{source_key(name)}-*.so")
    return max(builds, key=lambda p: p.stat().st_mtime_ns, default=None)


def locate(name: str, cc: str | None) -> Path:
    """A build of csrc/<name>.c: `cc`'s (made when missing), or without a compiler, or
    when it fails, a cached build by another one."""
    if cc is not None:
        try:
            return build(name, cc)
        except (BuildError, OSError) as exc:  # OSError: an unwritable cache, say
            if (found := cached(name)) is None:
                raise
            log.warning("loading the cached build %s instead: %s", found, exc)
            return found
    if (found := cached(name)) is None:
        raise BuildError(f"no C compiler (gcc, cc or $CC) and no cached build in {cache_dir()}")
    log.info("no C compiler: loading the cached build %s", found)
    return found


def abi_problem(lib: ctypes.CDLL, expected: Library) -> str | None:
    """How the loaded library disagrees with its bindings, or None."""
    try:
        version = lib.luced_abi_version
        sizeof = lib.luced_sizeof if expected.structs else None
    except AttributeError as exc:
        return f"a build without ABI checks ({exc})"
    version.restype = ctypes.c_int
    if (found := version()) != expected.abi:
        return f"ABI version {found}, its bindings expect {expected.abi}"
    for struct in expected.structs:
        assert sizeof is not None
        sizeof.argtypes, sizeof.restype = [ctypes.c_char_p], ctypes.c_int64
        if (size := sizeof(struct.__name__.encode())) != ctypes.sizeof(struct):
            return (
                f"struct {struct.__name__} is {size} bytes in C, "
                f"{ctypes.sizeof(struct)} in its ctypes mirror"
            )
    return None


def open_checked(expected: Library, cc: str | None) -> ctypes.CDLL:
    """Load a build of `expected` and check its ABI; a build that does not load or fails
    the check is rebuilt with `cc` or, without one, refused (BuildError)."""
    path = locate(expected.name, cc)
    lib, problem = _open(path, expected)
    if problem is not None and cc is not None:
        log.warning("native kernels %s: %s in %s; rebuilding", expected.name, problem, path)
        path.unlink(missing_ok=True)
        path = build(expected.name, cc)
        lib, problem = _open(path, expected)
    if lib is None:
        raise BuildError(f"{problem}\nin {path}")
    log.info("native kernels %s loaded from %s", expected.name, path)
    return lib


def _open(path: Path, expected: Library) -> tuple[ctypes.CDLL | None, str | None]:
    """(the library at `path`, None) if it loads and agrees with its bindings, else
    (None, why)."""
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        return None, f"a build that does not load ({exc})"
    problem = abi_problem(lib, expected)
    if problem is None:
        return lib, None
    # closed again, else dlopen would hand this library back for the path once rebuilt
    _ctypes.dlclose(lib._handle)
    return None, f"ABI mismatch: {problem}"


def load(expected: Library) -> ctypes.CDLL | None:
    """The checked library, or None where native kernels are off (`LUCED_KERNELS`, read on
    every call, as `native.kernels` reads it) or cannot be had (one warning; callers then
    take their torch path). `LUCED_KERNELS=native` makes a failure an error."""
    choice = kernel_choice()
    if choice == "torch":
        return None
    library, error = opened(expected)
    if error is not None and choice == "native":
        raise RuntimeError(f"LUCED_KERNELS=native but kernels {expected.name} failed: {error}")
    return library


@functools.cache
def opened(expected: Library) -> tuple[ctypes.CDLL | None, Exception | None]:
    """`expected` built, loaded and checked once per process: (library, None), or
    (None, why)."""
    try:
        library = open_checked(expected, compiler())
    except (OSError, BuildError) as exc:
        log.warning(
            "native kernels %s unavailable, using torch's: decode runs several times slower. "
            'Install gcc and restart, or set kernels = "torch" to choose this. Cause: %s',
            expected.name,
            exc,
        )
        return None, exc
    return library, None


if __name__ == "__main__":  # tools/install.sh: build every kernel ahead of the first start
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    cc = compiler()
    if cc is None:
        raise SystemExit("no C compiler (gcc, cc or $CC)")
    for path in sorted(SOURCES.glob("*.c")):
        print(build(path.stem, cc))
