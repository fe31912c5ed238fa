"""Compact linear layers: GGUF matrices kept quantized in memory for weight-only kernels,
instead of expanded to float32 at load.

Forms (`--weights`):
    int4     32-wide groups along the input, asymmetric: w = (q - 8)·scale + zero, q in 0..15
             -> aten._weight_int4pack_mm_for_cpu (bf16 activations; AVX2 and AVX512 paths)
    int8     one symmetric scale per output row: w = q·scale, q in -127..127
             -> aten._weight_int8pack_mm (bf16 activations; AVX2 and AVX512 paths)
    dequant  a float tensor, as `layers.linear` always took (the exact float32 path)

GGUF -> form: Q4_0 (w = (q - 8)·d), Q4_1 (w = q·d + m) and Q4_K (w = d·sc·q - dmin·m per
32-wide group) are int4 g32 block for block, exact up to rounding the scales and zero points
to bf16 (the kernel's scale dtype). Every other type is
dequantized and requantized (int4: per-group min/max; int8: per-row absmax); the error is
measured in tests/runtime/test_qlinear.py and by tools/perplexity.py.

Load: the loader yields `QuantRows` (codes and scales per row, so row operations such as
llama's Q/K unpermute or stacking projections work on them), and for a MoE expert stack one
per expert; `pack_weights` turns each into a `PackedLinear` after the family's `prepare`.

Kernels (`LUCED_KERNELS=auto|native|torch`): on a CPU where `native` built its library
(csrc/qgemm.c: int8 activations, integer dot products, AVX512-VNNI / AVX2 / C variants chosen
at run time), the matrix is held in that library's layout and its calls run there; with
`torch` (or no gcc) it is held in torch's int4/int8 pack for the aten kernels above. On a
CUDA device it is held for aten's GPU kernels (`weight_only`: tinygemm int4, int8), which take
any number of rows.

Dispatch by rows (M = tokens in the call): the native kernels take calls of any M, and a
row's result never depends on the rows that came with it (each output sums its groups in the
same order whatever M is): a prefill row is computed as its decode step would be, so a prompt
restored at any position continues exactly as the fresh prompt does, a verify block gives
plain decoding's logits, and a batched row its result alone (docs/features.md, "Exactness": what it
costs against the dense path). torch's kernels (no native build, or `LUCED_KERNELS=torch`)
are compute-bound per row, so past GEMV_MAX_ROWS rows they dequantize the matrix into one
scratch buffer shared by every layer, in the CPU's fast dense dtype, and run a dense matmul,
which rounds apart from them (batch-invariant mode keeps them on the kernel, 64 rows at a
time).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from gguf import quants as gguf_quants
from gguf.constants import GGMLQuantizationType as Q

from luced.ipc.frames import WEIGHT_MODES
from luced.runtime import native, weight_only
from luced.runtime.native import cpu_flags

log = logging.getLogger(__name__)

GROUP = weight_only.GROUP  # int4 group width: GGUF's Q4_0 / Q4_1 block
# Most rows a call runs on torch's packed kernels; more go dense, near the crossover measured
# by tools/bench_qlinear.py (docs/design.md "Compact weights"). 64 is also the largest DFlash
# block, so every verify takes the packed path, as decode does. (The native kernels take any
# number of rows.)
GEMV_MAX_ROWS = 64
_PACK_N = 64  # int4 packing pads rows to this (the AVX512 kernel's block of output rows)

# GGUF types whose values sit on at most 16 levels per 32-wide group: int4 loses little.
FOUR_BIT = frozenset({Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q3_K, Q.Q2_K})
FLOAT = frozenset({Q.F32, Q.F16, Q.BF16})


def kernels_vectorized(device: torch.device) -> bool:
    """Whether packed int4/int8 kernels run fast on this device: a CUDA device (aten's GPU
    kernels), a CPU with AVX2 or AVX512 (elsewhere they are scalar loops or absent)."""
    if device.type == "cuda":
        return True
    return device.type == "cpu" and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


@functools.cache
def dense_dtype(device_type: str = "cpu") -> torch.dtype:
    """The dtype of the dense (many-row) path: bf16 where the CPU multiplies it natively
    (AVX512-BF16, AMX), float32 where bf16 is emulated (AVX2 only: several times slower)."""
    if device_type != "cpu":
        return torch.bfloat16
    native = {"avx512_bf16", "amx_bf16"} & cpu_flags()
    return torch.bfloat16 if native else torch.float32


def choose_form(mode: str, ggml_type: int, shape: tuple[int, ...], device: torch.device) -> str:
    """The form of one GGUF tensor under `mode`: "int4", "int8" or "dequant"."""
    if mode not in WEIGHT_MODES:
        raise ValueError(f"unknown weights mode {mode!r}; choose one of {', '.join(WEIGHT_MODES)}")
    # A matrix stored in float32 stays exact in every mode: converters keep in float32 the
    # ones quantization hurts (MoE routers, small gates), and they are small.
    if mode == "dequant" or len(shape) != 2 or ggml_type == Q.F32:
        return "dequant"
    if device.type not in ("cpu", "cuda"):  # no weight-only kernels (MPS): the exact path
        return "dequant"
    int4_fits = shape[1] % GROUP == 0
    if mode == "int4":
        return "int4" if int4_fits else "int8"
    if mode == "int8":
        return "int8"
    # auto: compact only where the kernels are vectorized, and never widen a float file's
    # precision loss: float tensors stay exact.
    if not kernels_vectorized(device) or ggml_type in FLOAT:
        return "dequant"
    return "int4" if ggml_type in FOUR_BIT and int4_fits else "int8"


# ---------------------------------------------------------------- rows before packing


@dataclass
class QuantRows:
    """A quantized [N, K] matrix as codes and per-row scales: what the loader yields and
    `prepare` may permute or stack before packing. int4: codes uint8 0..15, scales and
    zeros [N, K / 32]; int8: codes int8, scales [N, 1], zeros None."""

    form: str
    codes: torch.Tensor
    scales: torch.Tensor  # float32
    zeros: torch.Tensor | None  # float32, int4 only
    # Rows of the matrices stacked into this one by `cat` (Q, K, V -> one QKV call): the
    # packed layer's output splits back into them; () = one matrix.
    splits: tuple[int, ...] = ()

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)  # type: ignore[return-value]

    def take(self, index: torch.Tensor) -> QuantRows:
        """The rows `index` picks, in that order."""
        zeros = None if self.zeros is None else self.zeros[index]
        return QuantRows(self.form, self.codes[index], self.scales[index], zeros)

    @staticmethod
    def cat(parts: list[QuantRows]) -> QuantRows:
        """The parts' rows stacked (all in one form)."""
        zeros = None if parts[0].zeros is None else torch.cat([p.zeros for p in parts])  # type: ignore[misc]
        return QuantRows(
            parts[0].form,
            torch.cat([p.codes for p in parts]),
            torch.cat([p.scales for p in parts]),
            zeros,
            tuple(p.shape[0] for p in parts),
        )

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K], with the scales rounded to bf16 as the kernels read them."""
        n, k = self.shape
        g = k // self.scales.shape[1]
        scale = self.scales.to(torch.bfloat16).float()[..., None]
        q = self.codes.float().view(n, -1, g)
        if self.zeros is None:
            return (q * scale).view(n, k)
        zero = self.zeros.to(torch.bfloat16).float()[..., None]
        return ((q - 8) * scale + zero).view(n, k)


EXACT_INT4 = frozenset({Q.Q4_0, Q.Q4_1, Q.Q4_K})


def int4_from_blocks(raw: np.ndarray, ggml_type: int, shape: tuple[int, int]) -> QuantRows:
    """A Q4_0, Q4_1 or Q4_K matrix (raw bytes, [N, bytes per row]) as int4 g32, block for
    block."""
    n, k = shape
    if ggml_type == Q.Q4_K:
        return _int4_from_q4_k(raw, n, k)
    head = 4 if ggml_type == Q.Q4_1 else 2  # d (and m), f16
    blocks = raw.reshape(n, k // GROUP, head + GROUP // 2)
    d = blocks[..., 0:2].copy().view(np.float16).astype(np.float32)[..., 0]
    qs = blocks[..., head:]
    codes = np.concatenate([qs & 15, qs >> 4], axis=-1).reshape(n, k)  # lo: 0..15, hi: 16..31
    if ggml_type == Q.Q4_1:  # w = q·d + m = (q - 8)·d + (m + 8·d)
        zeros = blocks[..., 2:4].copy().view(np.float16).astype(np.float32)[..., 0] + 8 * d
    else:  # w = (q - 8)·d
        zeros = np.zeros_like(d)
    return QuantRows("int4", torch.from_numpy(codes), torch.from_numpy(d), torch.from_numpy(zeros))


def _int4_from_q4_k(raw: np.ndarray, n: int, k: int) -> QuantRows:
    """Q4_K: 256-wide super-blocks of eight 32-wide groups, w = d·sc·q - dmin·m with 6-bit
    sc and m per group: int4 g32 with scale d·sc and zero 8·d·sc - dmin·m."""
    blocks = raw.reshape(-1, 144)  # d, dmin (f16), 12 bytes of scales/mins, 128 of nibbles
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, m = gguf_quants.Q4_K.get_scale_min(blocks[:, 4:16])  # [blocks, 8] each
    scale, mins = d * sc.astype(np.float32), dmin * m.astype(np.float32)
    # 32 bytes feed two groups: low nibbles the first, high nibbles the second.
    qs = blocks[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    codes = (qs & 15).reshape(n, k)
    zeros = 8 * scale - mins
    return QuantRows(
        "int4",
        torch.from_numpy(np.ascontiguousarray(codes)),
        torch.from_numpy(scale.reshape(n, k // GROUP)),
        torch.from_numpy(zeros.reshape(n, k // GROUP)),
    )


def quantize(w: torch.Tensor, form: str) -> QuantRows:
    """Requantize a float [N, K] matrix; scales are rounded to bf16 before the codes are
    chosen, so the codes fit the scales the kernel reads."""
    w = w.float()
    n, k = w.shape
    if form == "int8":
        scale = (w.abs().amax(1, keepdim=True) / 127).clamp_min(1e-30)
        scale = scale.to(torch.bfloat16).float()
        codes = torch.round(w / scale).clamp_(-127, 127).to(torch.int8)
        return QuantRows("int8", codes, scale, None)
    groups = w.view(n, k // GROUP, GROUP)
    lo, hi = groups.amin(-1), groups.amax(-1)
    scale = ((hi - lo) / 15).clamp_min(1e-30).to(torch.bfloat16).float()
    zero = (lo + 8 * scale).to(torch.bfloat16).float()
    codes = torch.round((groups - zero[..., None]) / scale[..., None] + 8).clamp_(0, 15)
    return QuantRows("int4", codes.to(torch.uint8).view(n, k), scale, zero)


# ---------------------------------------------------------------- packed


class _Scratch:
    """One dense buffer per (device, dtype), grown to the largest matrix: the many-row path
    dequantizes into it one matrix at a time instead of holding a second full copy."""

    buffers: ClassVar[dict[tuple[torch.device, torch.dtype], torch.Tensor]] = {}

    @classmethod
    def get(cls, n: int, k: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        key = (device, dtype)
        buf = cls.buffers.get(key)
        if buf is None or buf.numel() < n * k:
            # A normal tensor even when first asked for under inference_mode: an inference
            # tensor could not be written outside it, a normal one can be written anywhere.
            with torch.inference_mode(False):
                buf = cls.buffers[key] = torch.empty(n * k, dtype=dtype, device=device)
        return buf[: n * k].view(n, k)


# Inside `row_exact()`, calls of any size stay on the packed kernels, as in batch-invariant
# mode: a forward of several sequences' short spans keeps each row's result what its own
# sequence would get alone, however many rows the spans add up to (runtime/forward.py).
_ROW_EXACT: contextvars.ContextVar[bool] = contextvars.ContextVar("luced_row_exact", default=False)


@contextlib.contextmanager
def row_exact() -> Iterator[None]:
    """Every packed call in the body takes the kernel, whatever its number of rows."""
    token = _ROW_EXACT.set(True)
    try:
        yield
    finally:
        _ROW_EXACT.reset(token)


class PackedLinear:
    """A linear layer's weight [out, in] held packed for a weight-only kernel; `layers.linear`
    calls it. `dtype` is the model's compute dtype: outputs and `rows` come back in it.
    `kernels`: "auto" (native where available), "native" or "torch"; None reads
    `LUCED_KERNELS`. `device`: where the matrix lives (default: where the rows are); a CUDA
    device holds it for aten's GPU kernels (`gpu`)."""

    def __init__(
        self,
        rows: QuantRows,
        dtype: torch.dtype,
        kernels: str | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        self.form = rows.form
        self.out_features, self.in_features = rows.shape
        self.splits = rows.splits or (self.out_features,)
        self.dtype = dtype
        # Batch-invariant mode (`Model.load(batch_invariant=True)`): torch's kernels too take
        # calls of any size, 64 rows at a time, so no row depends on how many came with it.
        self.invariant = False
        self._codes: torch.Tensor | None = None  # kept only if the int4 layout is unknown
        self.gpu: weight_only.Int4Tiles | weight_only.Int8Rows | None = None
        target = torch.device(device) if device is not None else rows.codes.device
        if target.type != "cpu":  # every call, of any size, takes the GPU kernel
            self.native = None
            if rows.form == "int8":
                self.gpu = weight_only.Int8Rows(rows.codes, rows.scales, target)
            else:
                self.gpu = weight_only.Int4Tiles(rows.codes, rows.scales, rows.zeros, target)  # type: ignore[arg-type]
            return
        # Native layout: `codes` with `sz` (int4) or `scale` (int8); torch's pack otherwise.
        self.native = native.kernels(rows.codes.device, kernels)
        if self.native is not None:
            if rows.form == "int8":
                self.codes, self.scale = native.pack_int8(rows.codes, rows.scales)
            else:
                self.codes, self.sz = native.pack_int4(rows.codes, rows.scales, rows.zeros)  # type: ignore[arg-type]
            return
        if rows.form == "int8":
            self.weight = rows.codes.contiguous()
            self.scales = rows.scales[:, 0].to(torch.bfloat16).contiguous()
            return
        n, k = rows.shape
        pad = -n % _PACK_N
        codes = F.pad(rows.codes, (0, 0, 0, pad)) if pad else rows.codes
        scales, zeros = (F.pad(t, (0, 0, 0, pad)) for t in (rows.scales, rows.zeros))  # type: ignore[arg-type]
        self.weight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.int(), 1)
        # [K / 32, N, 2] bf16: the kernel's scales_and_zeros
        self.scales_zeros = torch.stack([scales, zeros], -1).transpose(0, 1).to(torch.bfloat16)
        self.scales_zeros = self.scales_zeros.contiguous()
        probe = min(codes.shape[0], _PACK_N)
        if not torch.equal(_unpack_int4(self.weight, torch.arange(probe), k), codes[:probe]):
            log.warning("unknown int4 pack layout on this CPU: keeping the codes beside it")
            self._codes = rows.codes.contiguous()

    @property
    def shape(self) -> tuple[int, int]:
        return self.out_features, self.in_features

    def nbytes(self) -> int:
        if self.gpu is not None:
            return self.gpu.nbytes()
        names = ("weight", "_codes", "scales", "scales_zeros", "codes", "sz", "scale")
        parts = (getattr(self, n, None) for n in names)
        return sum(t.numel() * t.element_size() for t in parts if t is not None)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> [..., out] in x's dtype."""
        if self.gpu is not None:
            lead = x.shape[:-1]
            y = self.gpu.mm(x.reshape(-1, self.in_features))
            return y.to(x.dtype).view(*lead, self.out_features)
        if x.dim() == 2 and x.shape[0] <= GEMV_MAX_ROWS:  # decode's call: no reshapes
            return self.gemv(x).to(x.dtype)
        lead, k = x.shape[:-1], self.in_features
        x2 = x.reshape(-1, k)
        invariant = self.invariant or _ROW_EXACT.get()
        if x2.shape[0] <= GEMV_MAX_ROWS or self.native is not None:
            y = self.gemv(x2)  # the native kernels are row-invariant at any M
        elif invariant:
            y = torch.cat([self.gemv(part) for part in x2.split(GEMV_MAX_ROWS)])
        else:
            dt = dense_dtype(x.device.type)
            y = F.linear(x2.to(dt), self.dense(dt))
        return y.to(x.dtype).view(*lead, self.out_features)

    def fuses(self, x: torch.Tensor) -> bool:
        """Whether a call on x goes to the native kernel, which can also transform its input
        and add a residual (`fused`): float32 rows x [m, ...], any m. Every call that could
        take the kernel takes this path, so a row's value never depends on how many came
        with it."""
        return self.native is not None and x.dtype == torch.float32 and x.dim() == 2

    def fused(
        self,
        x: torch.Tensor,
        *,
        norm: tuple[torch.Tensor | None, float] | None = None,
        gate: str | None = None,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The native call (`fuses(x)` must hold) with the layer's small ops inside it:
        `norm`: RMSNorm x by (weight, eps) first; `gate`: "silu" or "gelu_tanh", x is
        [m, 2 * in] = [gate | up] and the input is act(gate) * up; `residual` [m, out]: added
        to the result. -> float32 [m, out]."""
        assert self.native is not None and not (norm and gate)
        if gate is not None and x.shape[1] != 2 * self.in_features:
            raise ValueError(f"gate input {tuple(x.shape)} for {self.in_features} inputs")
        kind = gate or ("rms_norm" if norm is not None else "plain")
        weight, eps = norm if norm is not None else (None, 0.0)
        if weight is not None and weight.numel() != self.in_features:
            raise ValueError(f"norm weight of {weight.numel()} for {self.in_features} inputs")
        if weight is not None and weight.dtype != torch.float32:  # (a no-op `to` is a call)
            weight = weight.float()
        if residual is not None:
            if residual.shape != (x.shape[0], self.out_features):
                raise ValueError(f"residual {tuple(residual.shape)} for {x.shape[0]} rows")
            residual = residual.contiguous()  # float32, as x is
        op = (kind, None if weight is None else weight.contiguous(), eps, residual)
        x = x.contiguous()
        if self.form == "int8":
            return self.native.int8(self.codes, self.scale, self.out_features, x, op)
        return self.native.int4(self.codes, self.sz, self.out_features, x, op)

    def gemv(self, x: torch.Tensor) -> torch.Tensor:
        """x [m, in] -> [m, out] on the packed kernel: float32 out of the native kernels
        (which quantize x to int8 per 32 inputs), bf16 out of torch's (bf16 activations)."""
        if self.gpu is not None:
            return self.gpu.mm(x)
        if self.native is not None:
            return self.fused(x.to(torch.float32))  # the native call, nothing fused
        x = x.to(torch.bfloat16)
        if self.form == "int8":
            return torch.ops.aten._weight_int8pack_mm(x, self.weight, self.scales)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.weight, GROUP, self.scales_zeros)
        return y[:, : self.out_features] if y.shape[1] != self.out_features else y

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        """The whole matrix [out, in] dequantized into the shared scratch buffer (valid until
        the next call; on a GPU a tensor of its own)."""
        n, k = self.shape
        if self.gpu is not None:
            return self.gpu.dense().to(dtype)
        if self.native is not None:
            return self._native_dense(dtype)
        if self.form == "int8" or self._codes is not None:
            out = _Scratch.get(n, k, dtype, self.weight.device)
            self._dequantize_into(torch.arange(n, device=self.weight.device), out)
            return out
        # Whole pack blocks at once (no gather): row b·64 + h·32 + r is nibble h of byte
        # [b, :, r]; padded rows are dequantized too and cut off.
        padded = self.weight.shape[0]
        out = _Scratch.get(padded, k, dtype, self.weight.device)
        packed = self.weight.view(-1, k, _PACK_N // 2)
        halves = out.view(-1, 2, _PACK_N // 2, k)
        halves[:, 0].copy_((packed & 15).transpose(1, 2))
        halves[:, 1].copy_((packed >> 4).transpose(1, 2))
        groups = out.view(padded, k // GROUP, GROUP).sub_(8)
        sz = self.scales_zeros.transpose(0, 1)  # [N, K / 32, 2]
        groups.mul_(sz[..., 0:1]).add_(sz[..., 1:2])
        return out[:n]

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Dequantized rows [len(ids), in] in the compute dtype: the embedding lookup of a
        head tied to the embedding, without a float copy of the table."""
        ids = ids.reshape(-1)
        if self.gpu is not None:
            return self.gpu.rows(ids).to(self.dtype)
        out = torch.empty(ids.shape[0], self.in_features, dtype=self.dtype, device=ids.device)
        self._dequantize_into(ids, out)
        return out

    def _native_dense(self, dtype: torch.dtype) -> torch.Tensor:
        n, k = self.shape
        if self.form == "int8":
            out = _Scratch.get(n, k, dtype, self.codes.device)
            torch.mul(native.unpack_int8(self.codes, k)[:n], self.scale[:n, None], out=out)
            return out
        codes, scale, zero = native.unpack_int4(self.codes, self.sz)
        out = _Scratch.get(codes.shape[0], k, dtype, self.codes.device)
        groups = out.view(-1, k // GROUP, GROUP)
        groups.copy_(codes.view(groups.shape)).sub_(8)
        groups.mul_(scale[..., None]).add_(zero[..., None])
        return out[:n]

    def _dequantize_into(self, ids: torch.Tensor, out: torch.Tensor) -> None:
        if self.native is not None:
            if self.form == "int8":
                codes = native.unpack_int8(self.codes, self.in_features, ids)
                torch.mul(codes, self.scale[ids, None], out=out)
                return
            codes, scale, zero = native.unpack_int4(self.codes, self.sz, ids)
            groups = out.view(-1, self.in_features // GROUP, GROUP)
            groups.copy_(codes.view(groups.shape)).sub_(8)
            groups.mul_(scale[..., None]).add_(zero[..., None])
            return
        if self.form == "int8":
            torch.mul(self.weight[ids], self.scales[ids, None], out=out)
            return
        k = self.in_features
        codes = self._codes[ids] if self._codes is not None else _unpack_int4(self.weight, ids, k)
        sz = self.scales_zeros[:, ids].transpose(0, 1)  # [len, K / 32, 2]
        view = out.view(-1, k // GROUP, GROUP)
        view.copy_(codes.view(view.shape)).sub_(8)
        view.mul_(sz[..., 0:1]).add_(sz[..., 1:2])


def _unpack_int4(packed: torch.Tensor, ids: torch.Tensor, k: int) -> torch.Tensor:
    """Codes [len(ids), K] uint8 of rows `ids` from the CPU int4 pack: blocks of 64 rows,
    each [K, 32] bytes whose low nibble holds row r and high nibble row r + 32."""
    half = _PACK_N // 2
    blocks = packed.view(-1, k, half)
    r = ids % _PACK_N
    byte = blocks[ids // _PACK_N, :, r % half]  # [len, K]
    return torch.where((r < half)[:, None], byte & 15, byte >> 4)


def pack(value: object, dtype: torch.dtype, device: torch.device | str | None = None) -> object:
    """`QuantRows` as its `PackedLinear` on `device` (default: the rows'), a list of them (a
    compact expert stack) as a list of those; anything else as it is."""
    if isinstance(value, QuantRows):
        return PackedLinear(value, dtype, device=device)
    if isinstance(value, list) and value and isinstance(value[0], QuantRows):
        return [PackedLinear(rows, dtype, device=device) for rows in value]
    return value


def pack_weights(
    weights: dict[str, object], dtype: torch.dtype, device: torch.device | str | None = None
) -> None:
    """Pack every `QuantRows` in a loaded weight dict (in place), onto `device`."""
    for key, value in weights.items():
        weights[key] = pack(value, dtype, device)
