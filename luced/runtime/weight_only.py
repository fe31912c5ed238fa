"""Compact matrices for torch's weight-only quantized matmuls on a GPU: the codes and scales
`qlinear.QuantRows` holds, packed for aten's int4 (tinygemm) and int8 kernels, so a GGUF
matrix is quantized alike on the CPU and on a CUDA device and stays compact there.

    int4  aten._weight_int4pack_mm, the tinygemm kernel gpt-fast and torchao use: bf16
          activations x [M, K] against a weight that aten._convert_weight_to_int4pack makes
          from nibbles [N, K/2] uint8, byte j = code(2j) << 4 | code(2j + 1):

              int32 [N / 8, K / (16 · inner_k_tiles), 32, inner_k_tiles / 2]

          opaque but for its first axis, which counts tiles of 8 output rows (the kernel
          reads each tile on its own, so the tiles of chosen rows are a packed weight of
          those rows: `Int4Tiles.rows`). scales_and_zeros [K / 32, N, 2] bf16, and
          w = (q - 8) · scale + zero, as qlinear's CPU form. N is padded to whole tiles
          (zero codes and scales); the padded outputs are cut off.
    int8  aten._weight_int8pack_mm: codes [N, K] int8, one bf16 scale per row. Its CUDA
          kernel exists since torch 2.9; where this torch has none (or LUCED_CUDA_INT8=dequant)
          a call dequantizes the matrix a slab of rows at a time and runs bf16 matmuls.

Held bytes per weight: int4 0.5 + 4 / 32 = 0.625 (5 bits), int8 1 + 2 / K. `device_ratio`
gives the device bytes over the GGUF file's bytes for each stored type.

The same classes run on the CPU through aten's CPU twins (`_convert_weight_to_int4pack_for_cpu`,
tiles of 64 rows; the CPU int8 kernel takes this very layout), which is how the layout code
(padding, scales, tile selection) is tested without a GPU. On the CPU luced's matrices use
`qlinear.PackedLinear`'s own paths; these classes serve CUDA devices there.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from gguf.constants import GGML_QUANT_SIZES
from gguf.constants import GGMLQuantizationType as Q

GROUP = 32  # int4 group width: GGUF's Q4_0 / Q4_1 block, one of tinygemm's group sizes
INNER_K_TILES = (8, 4, 2)  # tinygemm's choices, the widest that divides K / 16 first
ROWS_SLAB = 1 << 24  # elements an int8 dequantizing call expands at a time (32 MB in bf16)


def nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Codes [N, K] (0..15) as the CUDA int4 converter's input: [N, K / 2] uint8, the even
    column in the high nibble."""
    codes = codes.to(torch.uint8)
    return (codes[:, 0::2] << 4) | codes[:, 1::2]


def inner_k_tiles(k: int) -> int:
    """tinygemm's tiles along K for an input width k (a multiple of 32)."""
    for tiles in INNER_K_TILES:
        if k % (16 * tiles) == 0:
            return tiles
    raise ValueError(f"int4 needs an input width that is a multiple of 32, got {k}")


@dataclass(frozen=True)
class Int4Kernel:
    """One device's int4 weight-only kernel: `convert` packs codes [N, K] (N a multiple of
    `tile`), `mm` multiplies bf16 rows by the packed weight; the packed weight's first axis
    holds `tile` output rows per `tile` of them (CUDA: one entry per 8 rows, CPU: 64 entries
    per 64 rows), each tile packed on its own."""

    name: str
    tile: int
    convert: Callable[[torch.Tensor], torch.Tensor]
    mm: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


TINYGEMM = Int4Kernel(
    "tinygemm",
    8,
    lambda codes: torch.ops.aten._convert_weight_to_int4pack(
        nibbles(codes), inner_k_tiles(codes.shape[1])
    ),
    lambda x, w, sz: torch.ops.aten._weight_int4pack_mm(x, w, GROUP, sz),
)
CPU_INT4 = Int4Kernel(
    "cpu",
    64,
    lambda codes: torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.int(), 1),
    lambda x, w, sz: torch.ops.aten._weight_int4pack_mm_for_cpu(x, w, GROUP, sz),
)


def int4_kernel(device: torch.device) -> Int4Kernel:
    return CPU_INT4 if device.type == "cpu" else TINYGEMM


@functools.cache
def _identity(k: int, device: torch.device) -> torch.Tensor:
    with torch.inference_mode(False):  # usable inside and outside a forward
        return torch.eye(k, dtype=torch.bfloat16, device=device)


class Int4Tiles:
    """An [N, K] int4 g32 matrix packed for `kernel` (module docstring)."""

    def __init__(
        self,
        codes: torch.Tensor,
        scales: torch.Tensor,
        zeros: torch.Tensor,
        device: torch.device,
        kernel: Int4Kernel | None = None,
    ) -> None:
        """codes [N, K] uint8 0..15, scales and zeros [N, K / 32] float32 (any device)."""
        self.kernel = kernel or int4_kernel(device)
        self.out_features, self.in_features = n, k = codes.shape
        if k % GROUP:
            raise ValueError(f"int4 needs an input width that is a multiple of {GROUP}, got {k}")
        pad = -n % self.kernel.tile
        codes = F.pad(codes.to(device), (0, 0, 0, pad))
        scales, zeros = (F.pad(t.to(device), (0, 0, 0, pad)) for t in (scales, zeros))
        self.weight = self.kernel.convert(codes)
        # [K / 32, N, 2] bf16: the kernel's scales_and_zeros
        self.scales_zeros = torch.stack([scales, zeros], -1).transpose(0, 1)
        self.scales_zeros = self.scales_zeros.to(torch.bfloat16).contiguous()
        self.n_tiles = (n + pad) // self.kernel.tile

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.weight, self.scales_zeros))

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] -> [M, N] bf16."""
        y = self.kernel.mm(x.to(torch.bfloat16).contiguous(), self.weight, self.scales_zeros)
        return y[:, : self.out_features] if y.shape[1] != self.out_features else y

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` [m] of the matrix as the kernel dequantizes them, [m, K] bf16: the
        identity times the tiles that hold them. Fixed shapes, no host sync (a captured
        decode step embeds through it), 64 ids a call."""
        ids = ids.reshape(-1).to(self.weight.device, torch.int64)
        return torch.cat([self._rows(part) for part in ids.split(64)])

    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        tile, groups = self.kernel.tile, self.in_features // GROUP
        tiles = torch.div(ids, tile, rounding_mode="floor")  # [m]
        slabs = self.weight.view(self.n_tiles, -1, *self.weight.shape[1:])
        weight = slabs.index_select(0, tiles).flatten(0, 1)
        sz = self.scales_zeros.view(groups, self.n_tiles, tile, 2).index_select(1, tiles)
        sz = sz.view(groups, -1, 2)  # [K / 32, m · tile, 2]
        k = self.in_features
        cols = self.kernel.mm(_identity(k, ids.device), weight, sz)  # [K, m · tile]: W rows
        picked = torch.arange(ids.shape[0], device=ids.device) * tile + ids % tile
        return cols.index_select(1, picked).t()

    def dense(self) -> torch.Tensor:
        """The whole matrix [N, K] bf16, as the kernel dequantizes it."""
        return self.rows(torch.arange(self.out_features, device=self.weight.device))


def int8_aten(device: torch.device) -> bool:
    """Whether int8 calls on `device` take aten's int8 kernel (else they dequantize)."""
    if os.environ.get("LUCED_CUDA_INT8", "aten") == "dequant" and device.type != "cpu":
        return False
    key = "CPU" if device.type == "cpu" else "CUDA"
    return torch._C._dispatch_has_kernel_for_dispatch_key("aten::_weight_int8pack_mm", key)


class Int8Rows:
    """An [N, K] int8 matrix with one scale per row (module docstring)."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, device: torch.device) -> None:
        """codes [N, K] int8, scales [N, 1] float32 (any device)."""
        self.out_features, self.in_features = codes.shape
        self.codes = codes.to(device).contiguous()
        self.scales = scales.reshape(-1).to(device, torch.bfloat16).contiguous()
        self.aten = int8_aten(device)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales))

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] -> [M, N] bf16."""
        x = x.to(torch.bfloat16).contiguous()
        if self.aten:
            return torch.ops.aten._weight_int8pack_mm(x, self.codes, self.scales).to(x.dtype)
        step = max(1, ROWS_SLAB // self.in_features)
        parts = [
            F.linear(x, self.codes[i : i + step].to(torch.bfloat16)) * self.scales[i : i + step]
            for i in range(0, self.out_features, step)
        ]
        return parts[0] if len(parts) == 1 else torch.cat(parts, -1)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` dequantized, [m, K] bf16."""
        ids = ids.reshape(-1).to(self.codes.device, torch.int64)
        return self.codes[ids].to(torch.bfloat16) * self.scales[ids, None]

    def dense(self) -> torch.Tensor:
        return self.codes.to(torch.bfloat16) * self.scales[:, None]


# ---------------------------------------------------------------- sizes


def held_bits(form: str, k: int) -> float:
    """Bits per weight a matrix of input width k holds on the device in `form` (before the
    row padding): int4 codes and a bf16 scale and zero per 32, int8 codes and a bf16 scale
    per row, bf16 for a dense one."""
    return {"int4": 4 + 32 / GROUP, "int8": 8 + 16 / k, "bfloat16": 16.0, "float32": 32.0}[form]


def file_bits(ggml_type: int) -> float:
    """Bits per weight of a GGUF tensor type as stored."""
    block, size = GGML_QUANT_SIZES[Q(ggml_type)]
    return 8 * size / block


def device_ratio(ggml_type: int, form: str, k: int) -> float:
    """Device bytes over file bytes of a matrix of this type held in `form`."""
    return held_bits(form, k) / file_bits(ggml_type)
