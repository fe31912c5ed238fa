"""Native integer-dot kernels for the packed weights (csrc/qgemm.c), built with gcc on first
use and loaded with ctypes.

The library is compiled once per (source, gcc version) into
`$XDG_CACHE_HOME/luced/kernels/<hash>/` (temp file + rename: workers starting together
race safely), with one target attribute per function instead of -march=native, so the one
.so serves any x86-64 CPU; the variant is chosen at load from the CPU's flags. Without gcc,
or when the build fails, `kernels()` is None (one warning) and `PackedLinear` keeps torch's
kernels.

Layouts (what the C file's header draws), made from `QuantRows` here:
    int4  codes [N/16, K/32, 256] uint8 and sz [N/16, K/32, 2, 16] bf16 (scales, zeros)
    int8  codes [N/16, K/32, 512] int8 (K zero-padded to 32) and scale [N/16 * 16] float32
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
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "qgemm.c"
NR = 16  # output rows per weight block
GROUP = 32
KERNELS_MODES = ("auto", "native", "torch")
# Variant names by the C enum, each with the CPU flags it needs.
ISAS = {
    "scalar": (0, frozenset()),
    "avx2": (1, frozenset({"avx2", "fma", "f16c"})),
    "avx512_vnni": (2, frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_vnni"})),
}
CFLAGS = ["-O3", "-shared", "-fPIC", "-fopenmp", "-ffp-contract=off", "-fno-math-errno"]


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "luced" / "kernels"


def library_path(gcc: str) -> Path:
    """Where the library for this source and this gcc lives (built or not)."""
    version = subprocess.run([gcc, "--version"], capture_output=True, text=True, check=True)
    key = hashlib.sha256(SOURCE.read_bytes() + version.stdout.encode() + " ".join(CFLAGS).encode())
    return _cache_dir() / key.hexdigest()[:16] / "qgemm.so"


def build() -> Path:
    """The compiled library, built now if not cached. Raises if gcc is missing or fails."""
    gcc = os.environ.get("CC") or shutil.which("gcc")
    if gcc is None:
        raise FileNotFoundError("gcc not found")
    path = library_path(gcc)
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".so.tmp")
    os.close(fd)
    try:
        subprocess.run(
            [gcc, *CFLAGS, "-o", tmp, str(SOURCE), "-lm"],
            capture_output=True,
            text=True,
            check=True,
        )
        os.replace(tmp, path)  # atomic: a racing worker sees no .so or a whole one
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    log.info("built native kernels %s", path)
    return path


def best_isa(flags: frozenset[str]) -> str:
    """The widest variant the CPU runs."""
    for name in ("avx512_vnni", "avx2"):
        if ISAS[name][1] <= flags:
            return name
    return "scalar"


@dataclass
class Kernels:
    """The loaded library with one variant chosen; `isa` may be changed (tests, benches) to
    any variant the CPU supports. `levels`: activations as one int8 code per input (1,
    llama.cpp's Q8 activations) or two (2: a second int8 code for the residual, 16-bit
    precision for twice the integer dot products)."""

    lib: ctypes.CDLL
    isa: str
    levels: int = 2

    def int4(self, codes: torch.Tensor, sz: torch.Tensor, n: int, x: torch.Tensor) -> torch.Tensor:
        """float32 x [m, k] -> float32 [m, n] through int4 weights in the native layout."""
        return self._run(self.lib.qg_int4, codes, sz, n, x)

    def int8(
        self, codes: torch.Tensor, scale: torch.Tensor, n: int, x: torch.Tensor
    ) -> torch.Tensor:
        """float32 x [m, k] -> float32 [m, n] through int8 weights in the native layout."""
        return self._run(self.lib.qg_int8, codes, scale, n, x)

    def _run(
        self,
        fn: ctypes._CFuncPtr,
        codes: torch.Tensor,
        scales: torch.Tensor,
        n: int,
        x: torch.Tensor,
    ) -> torch.Tensor:
        m, k = x.shape
        y = torch.empty(m, n, dtype=torch.float32)
        ptrs = codes.data_ptr(), scales.data_ptr()
        isa, threads = ISAS[self.isa][0], torch.get_num_threads()
        if fn(isa, self.levels, *ptrs, n, k, x.data_ptr(), m, y.data_ptr(), threads):
            raise MemoryError("native kernel: out of memory")
        return y

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """float32 x [m, k] -> (codes int32 [m, kp], scales [m, kp/32], sums int32 [m, kp/32]):
        the activations as the kernels see them, x ~ codes * scale per 32-block (two levels
        combined into one 16-bit code)."""
        m, k = x.shape
        groups = -(-k // GROUP)
        q, q2 = (torch.empty(m, groups * GROUP, dtype=torch.int8) for _ in range(2))
        d, ds = torch.empty(m, groups), torch.empty(m, groups)
        s = torch.empty(m, groups, dtype=torch.int32)
        second = q2.data_ptr() if self.levels == 2 else None
        tables = (d.data_ptr(), s.data_ptr(), ds.data_ptr())
        self.lib.qg_quantize(ISAS[self.isa][0], x.data_ptr(), m, k, q.data_ptr(), second, *tables)
        codes = q.int() * 256 + q2.int() if self.levels == 2 else q.int()
        return codes, d, s


def _load(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    for name in ("qg_int4", "qg_int8"):
        fn = getattr(lib, name)
        fn.argtypes = [i32, i32, p, p, i64, i64, p, i64, p, i32]
        fn.restype = i32
    lib.qg_quantize.argtypes = [i32, p, i64, i64, p, p, p, p, p]
    lib.qg_quantize.restype = None
    return lib


@functools.cache
def _loaded() -> ctypes.CDLL | None:
    try:
        return _load(build())
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", "") or e
        log.warning("native kernels unavailable, using torch's: %s", str(detail).strip()[:500])
        return None


def kernels_mode() -> str:
    """`LUCED_KERNELS`: auto (native where built, else torch), native, or torch."""
    mode = os.environ.get("LUCED_KERNELS", "auto")
    if mode not in KERNELS_MODES:
        raise ValueError(f"LUCED_KERNELS={mode!r}; choose one of {', '.join(KERNELS_MODES)}")
    return mode


def activation_levels() -> int:
    """`LUCED_ACTIVATIONS`: int16 (default: two int8 levels, finer than the bf16 activations
    torch's kernels take) or int8 (one level, llama.cpp's Q8 activations: ~15% faster decode,
    a few knife-edge greedy answers flip; see docs/design.md "Compact weights")."""
    name = os.environ.get("LUCED_ACTIVATIONS", "int16")
    if name not in ("int8", "int16"):
        raise ValueError(f"LUCED_ACTIVATIONS={name!r}; choose int8 or int16")
    return 2 if name == "int16" else 1


@functools.cache
def _kernels(flags: frozenset[str]) -> Kernels | None:
    lib = _loaded()
    if lib is None:
        return None
    isa, levels = best_isa(flags), activation_levels()
    log.info("native int4/int8 kernels: %s variant, %d-bit activations", isa, 8 * levels)
    return Kernels(lib, isa, levels)


def kernels(device: torch.device, mode: str | None = None) -> Kernels | None:
    """The native kernels for `device` (CPU only) under `mode` (None: `LUCED_KERNELS`), or
    None for torch's."""
    from luced.runtime.qlinear import cpu_flags

    mode = mode or kernels_mode()
    if mode not in KERNELS_MODES:
        raise ValueError(f"unknown kernels {mode!r}; choose one of {', '.join(KERNELS_MODES)}")
    if mode == "torch" or device.type != "cpu":
        return None
    found = _kernels(cpu_flags())
    if found is None and mode == "native":
        raise RuntimeError("LUCED_KERNELS=native but the native kernels could not be built")
    # The portable variant is ~8x slower than a vector one: a reference and a last resort
    # when asked for, not a default over torch's kernels.
    if found is not None and mode == "auto" and best_isa(cpu_flags()) == "scalar":
        return None
    return found


# ---------------------------------------------------------------- layouts


def pack_int4(
    codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """codes uint8 [N, K] (0..15), scales and zeros [N, K/32] -> (codes, sz) in the native
    layout; scales and zeros rounded to bf16 (what torch's kernel reads too)."""
    n, k = codes.shape
    pad = -n % NR
    nb, groups = (n + pad) // NR, k // GROUP
    q = F.pad(codes, (0, 0, 0, pad)).view(nb, NR, groups, 2, 4, 4)  # [.., half, v, i]
    byte = q[:, :, :, 0] | (q[:, :, :, 1] << 4)  # [nb, r, g, v, i]
    packed = byte.permute(0, 2, 3, 1, 4).contiguous().view(nb, groups, 256)
    sz = torch.stack([scales, zeros]).to(torch.bfloat16)  # [2, N, G]
    sz = F.pad(sz, (0, 0, 0, pad)).view(2, nb, NR, groups).permute(1, 3, 0, 2).contiguous()
    return packed, sz


def unpack_int4(
    codes: torch.Tensor, sz: torch.Tensor, ids: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes uint8 [len, K], scale [len, K/32], zero [len, K/32] in bf16) of rows `ids`
    (all padded rows when None)."""
    groups = codes.shape[1]
    blocks, sz_rows = (codes, sz) if ids is None else (codes[ids // NR], sz[ids // NR])
    b = blocks.view(-1, groups, 4, NR, 4)  # [block, g, v, r, i]
    q = torch.stack([b & 15, b >> 4], 2)  # [block, g, half, v, r, i]
    q = q.permute(0, 4, 1, 2, 3, 5).reshape(-1, NR, groups * GROUP)  # [block, r, K]
    sz_rows = sz_rows.permute(0, 3, 1, 2)  # [block, r, g, 2]
    if ids is None:
        q, sz_rows = q.flatten(0, 1), sz_rows.flatten(0, 1)
    else:
        at, r = torch.arange(len(ids)), ids % NR
        q, sz_rows = q[at, r], sz_rows[at, r]
    return q, sz_rows[..., 0], sz_rows[..., 1]


def pack_int8(codes: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """codes int8 [N, K], scales [N, 1] -> (codes [N/16, K/32, 512], scale [Np] float32 of the
    bf16-rounded scales)."""
    n, k = codes.shape
    pad, kpad = -n % NR, -k % GROUP
    nb, groups = (n + pad) // NR, (k + kpad) // GROUP
    q = F.pad(codes, (0, kpad, 0, pad)).view(nb, NR, groups, 8, 4)  # [nb, r, g, j, i]
    packed = q.permute(0, 2, 3, 1, 4).contiguous().view(nb, groups, 512)
    scale = F.pad(scales[:, 0].to(torch.bfloat16).float(), (0, pad))
    return packed, scale


def unpack_int8(codes: torch.Tensor, k: int, ids: torch.Tensor | None = None) -> torch.Tensor:
    """codes int8 [len, K] of rows `ids` (all padded rows when None)."""
    groups = codes.shape[1]
    blocks = codes if ids is None else codes[ids // NR]
    q = blocks.view(-1, groups, 8, NR, 4).permute(0, 3, 1, 2, 4).reshape(-1, NR, groups * GROUP)
    if ids is None:
        return q.reshape(-1, groups * GROUP)[:, :k]
    return q[torch.arange(len(ids)), ids % NR, :k]
