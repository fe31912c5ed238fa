"""Native integer-dot kernels for the packed weights (csrc/qgemm.c), built by `native_build`
(cached per source and compiler, prebuilt by tools/install.sh) and called with ctypes.

One library holds every variant, each function with its own target attribute, so the same
build serves any x86-64 CPU; the variant is chosen here from the CPU's flags and logged.
Where the library cannot be built `kernels()` is None (one warning) and `PackedLinear` keeps
torch's kernels.

Layouts (what the C file's header draws), made from `QuantRows` here:
    int4  codes [N/16, K/32, 256] uint8 and sz [N/16, K/32, 2, 16] bf16 (scales, zeros)
    int8  codes [N/16, K/32, 512] int8 (K zero-padded to 32) and scale [N/16 * 16] float32
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from luced.ipc.frames import KERNELS_FALLBACK
from luced.runtime import native_attention, native_build

log = logging.getLogger(__name__)

NR = 16  # output rows per weight block
GROUP = 32
# Variant names by the C enum, each with the CPU flags it needs.
ISAS = {
    "scalar": (0, frozenset()),
    "avx2": (1, frozenset({"avx2", "fma", "f16c"})),
    "avx512_vnni": (2, frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_vnni"})),
}


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (Linux /proc/cpuinfo); empty where unknown."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


def best_isa(flags: frozenset[str]) -> str:
    """The widest variant the CPU runs."""
    for name in ("avx512_vnni", "avx2"):
        if ISAS[name][1] <= flags:
            return name
    return "scalar"


# The input transforms a call may apply before its products (the C enum), and what a call
# takes besides x: (transform, RMSNorm weight or None, epsilon, residual [m, n] or None).
INPUTS = {"plain": 0, "rms_norm": 1, "silu": 2, "gelu_tanh": 3}
InputOp = tuple[str, torch.Tensor | None, float, torch.Tensor | None] | None


@dataclass
class Kernels:
    """The loaded library with one variant chosen; `isa` may be changed (tests, benches) to
    any variant the CPU supports. `levels`: activations as one int8 code per input (1,
    llama.cpp's Q8 activations) or two (2: a second int8 code for the residual, 16-bit
    precision for twice the integer dot products)."""

    lib: ctypes.CDLL
    isa: str
    levels: int = 2

    def int4(
        self, codes: torch.Tensor, sz: torch.Tensor, n: int, x: torch.Tensor, op: InputOp = None
    ) -> torch.Tensor:
        """float32 x [m, k] -> float32 [m, n] through int4 weights in the native layout."""
        return self._run(self.lib.qg_int4, codes, sz, n, x, op)

    def int8(
        self, codes: torch.Tensor, scale: torch.Tensor, n: int, x: torch.Tensor, op: InputOp = None
    ) -> torch.Tensor:
        """float32 x [m, k] -> float32 [m, n] through int8 weights in the native layout."""
        return self._run(self.lib.qg_int8, codes, scale, n, x, op)

    def _run(
        self,
        fn: ctypes._CFuncPtr,
        codes: torch.Tensor,
        scales: torch.Tensor,
        n: int,
        x: torch.Tensor,
        op: InputOp,
    ) -> torch.Tensor:
        """`op`: None, or (input, norm, eps, residual) as `InputOp` says; x and a residual
        are contiguous float32."""
        m, k = x.shape
        y = torch.empty(m, n, dtype=torch.float32)
        ptrs = codes.data_ptr(), scales.data_ptr()
        isa, threads = ISAS[self.isa][0], torch.get_num_threads()
        extra = (INPUTS["plain"], None, 0.0, None)
        if op is not None:
            kind, norm, eps, residual = op
            if kind in ("silu", "gelu_tanh"):
                k //= 2  # rows are [gate | up]
            extra = (
                INPUTS[kind],
                None if norm is None else norm.data_ptr(),
                eps,
                None if residual is None else residual.data_ptr(),
            )
        if fn(isa, self.levels, *ptrs, n, k, x.data_ptr(), m, y.data_ptr(), threads, *extra):
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


# What these bindings were written for: the C file's ABI_VERSION.
LIBRARY = native_build.Library("qgemm", abi=1)


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    for name in ("qg_int4", "qg_int8"):
        fn = getattr(lib, name)
        fn.argtypes = [i32, i32, p, p, i64, i64, p, i64, p, i32, i32, p, f32, p]
        fn.restype = i32
    lib.qg_quantize.argtypes = [i32, p, i64, i64, p, p, p, p, p]
    lib.qg_quantize.restype = None
    return lib


def activation_levels() -> int:
    """`LUCED_ACTIVATIONS`: int16 (default: two int8 levels, finer than the bf16 activations
    torch's kernels take) or int8 (one level, llama.cpp's Q8 activations: faster decode, but
    a few knife-edge greedy answers flip; see docs/design.md "Compact weights")."""
    name = os.environ.get("LUCED_ACTIVATIONS", "int16")
    if name not in ("int8", "int16"):
        raise ValueError(f"LUCED_ACTIVATIONS={name!r}; choose int8 or int16")
    return 2 if name == "int16" else 1


@functools.cache
def _kernels(flags: frozenset[str]) -> Kernels | None:
    # native_build.opened, not .load: load's LUCED_KERNELS check would override an explicit
    # `kernels=` argument (a failed build has been warned about there, once)
    library, _ = native_build.opened(LIBRARY)
    if library is None:
        return None
    lib = _bind(library)
    isa, levels = best_isa(flags), activation_levels()
    log.info("native int4/int8 kernels: %s variant, %d-bit activations", isa, 8 * levels)
    return Kernels(lib, isa, levels)


def kernels(device: torch.device, mode: str | None = None) -> Kernels | None:
    """The native kernels for `device` (CPU only) under `mode` (auto, native or torch; None:
    `LUCED_KERNELS`), or None for torch's."""
    mode = mode or native_build.kernel_choice()
    if mode not in native_build.KERNEL_CHOICES:
        choices = ", ".join(native_build.KERNEL_CHOICES)
        raise ValueError(f"unknown kernels {mode!r}; choose one of {choices}")
    if mode == "torch" or device.type != "cpu":
        return None
    found = _kernels(cpu_flags())
    if found is None and mode == "native":
        raise RuntimeError("LUCED_KERNELS=native but the native kernels could not be built")
    # The portable variant is several times slower than a vector one (docs/performance.md,
    # "Measurements behind the code"): a reference and a last resort when asked for, not a
    # default over torch's kernels.
    if found is not None and mode == "auto" and best_isa(cpu_flags()) == "scalar":
        return None
    return found


def describe(device: torch.device, mode: str | None = None) -> str:
    """Which kernels run `device`'s packed matrices and decode attention, as a worker
    reports them: "native <variant>"; "torch" (chosen, or not a CPU); "torch fallback: why"
    where native kernels were wanted but could not be had (decode runs several times
    slower); "matrices ...; attention ..." when the two differ."""
    mode = mode or native_build.kernel_choice()
    if mode == "torch" or device.type != "cpu":
        return "torch"
    parts = {}
    for part, library in (("matrices", LIBRARY), ("attention", native_attention.LIBRARY)):
        _, error = native_build.opened(library)
        parts[part] = f"native {best_isa(cpu_flags())}"
        if error is not None:
            parts[part] = f"{KERNELS_FALLBACK}: {str(error).splitlines()[0]}"
        elif part == "matrices" and mode == "auto" and best_isa(cpu_flags()) == "scalar":
            parts[part] = "torch (no vector variant for this CPU)"  # as `kernels` decides
    if len(set(parts.values())) == 1:
        return parts["matrices"]
    return "; ".join(f"{part} {how}" for part, how in parts.items())


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
    b = codes.view(-1, groups, 4, NR, 4)  # [block, g, v, r, i]
    if ids is None:
        b, sz_rows = b.permute(0, 3, 1, 2, 4).flatten(0, 1), sz.permute(0, 3, 1, 2).flatten(0, 1)
    else:  # only the rows' own bytes: an embedding lookup of a few tokens reads little
        blocks, r = ids // NR, ids % NR
        b, sz_rows = b[blocks, :, :, r], sz[blocks, :, :, r]  # [len, g, v, i], [len, g, 2]
    q = torch.stack([b & 15, b >> 4], 2)  # [row, g, half, v, i]: input 16 * half + 4v + i
    return q.reshape(q.shape[0], groups * GROUP), sz_rows[..., 0], sz_rows[..., 1]


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
    b = codes.view(-1, groups, 8, NR, 4)  # [block, g, j, r, i]
    # [row, g, j, i]; for ids, only the rows' own bytes
    b = b.permute(0, 3, 1, 2, 4).flatten(0, 1) if ids is None else b[ids // NR, :, :, ids % NR]
    return b.reshape(b.shape[0], groups * GROUP)[:, :k]
