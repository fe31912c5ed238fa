"""Compact matrices for aten's weight-only GPU kernels (luced.runtime.weight_only).

What a CPU can check: the layout code through aten's CPU int4 and int8 kernels, which share
the scales and zeros layout and the int8 layout with the CUDA ones (padding, tile selection,
the identity that dequantizes rows, the cut outputs), against the float32 dequantization;
the CUDA int4 kernel's shape contract (its meta functions, under fake tensors); the bytes a
matrix holds. What the GPU checks (tests/cuda): the CUDA kernels' values against the same
oracle, and the device memory a loaded model takes.
"""

from __future__ import annotations

import pytest
import torch
from fake_device import fake_accelerator
from gguf.constants import GGMLQuantizationType as Q

from luced.runtime import qlinear, weight_only
from luced.runtime.qlinear import PackedLinear, quantize
from luced.runtime.weight_only import CPU_INT4, TINYGEMM, Int4Tiles, Int8Rows

CPU = torch.device("cpu")


def _rows(n: int, k: int, form: str, seed: int = 0) -> qlinear.QuantRows:
    g = torch.Generator().manual_seed(seed)
    return quantize(torch.randn(n, k, generator=g), form)


def test_nibbles_put_the_even_column_high() -> None:
    codes = torch.tensor([[1, 2, 15, 0], [7, 8, 9, 10]], dtype=torch.uint8)
    packed = weight_only.nibbles(codes)
    assert packed.tolist() == [[0x12, 0xF0], [0x78, 0x9A]]
    wide = torch.randint(0, 16, (5, 64), dtype=torch.uint8)
    back = torch.stack([weight_only.nibbles(wide) >> 4, weight_only.nibbles(wide) & 15], -1)
    assert torch.equal(back.view(5, 64), wide)


def test_inner_k_tiles_is_the_widest_that_divides() -> None:
    assert [weight_only.inner_k_tiles(k) for k in (4096, 576, 64, 96, 32)] == [8, 4, 4, 2, 2]
    with pytest.raises(ValueError, match="multiple of 32"):
        weight_only.inner_k_tiles(48)


@pytest.mark.parametrize(("n", "k"), [(100, 96), (64, 64), (130, 256)])
def test_int4_tiles_on_the_cpu_kernel_equal_the_dequantized_matrix(n: int, k: int) -> None:
    """Products within the bf16 activations' rounding; rows (any order, repeats, the padded
    last tile) and the whole matrix as the kernel dequantizes them: the float32 weights
    rounded to bf16."""
    rows = _rows(n, k, "int4")
    tiles = Int4Tiles(rows.codes, rows.scales, rows.zeros, CPU)
    assert tiles.kernel is CPU_INT4
    w = rows.dequantize()
    x = torch.randn(7, k)
    ref = x.bfloat16().float() @ w.T
    got = tiles.mm(x)
    assert got.shape == (7, n) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())
    ids = torch.tensor([n - 1, 3, min(64, n - 1), 3, 0])
    torch.testing.assert_close(tiles.rows(ids).float(), w[ids].bfloat16().float(), rtol=0, atol=0)
    torch.testing.assert_close(tiles.dense().float(), w.bfloat16().float(), rtol=0, atol=0)


def test_int8_rows_on_the_cpu_kernel_equal_the_dequantized_matrix() -> None:
    rows = _rows(50, 80, "int8")
    int8 = Int8Rows(rows.codes, rows.scales, CPU)
    w = rows.dequantize()
    x = torch.randn(3, 80)
    ref = x.bfloat16().float() @ w.T
    torch.testing.assert_close(int8.mm(x).float(), ref, rtol=2e-2, atol=1e-2 * ref.abs().max())
    ids = torch.tensor([49, 0, 7])
    torch.testing.assert_close(int8.rows(ids).float(), w[ids], rtol=2**-7, atol=0)
    int8.aten = False  # the dequantizing path a torch without the CUDA int8 kernel takes
    torch.testing.assert_close(int8.mm(x).float(), ref, rtol=2e-2, atol=1e-2 * ref.abs().max())


@pytest.mark.parametrize(("n", "k"), [(4096, 4096), (100, 96), (49152, 576)])
def test_the_cuda_int4_contract_holds_for_the_packed_matrix(n: int, k: int) -> None:
    """Under fake tensors a PackedLinear on a non-CPU device goes through tinygemm's own
    shape checks: the packed tiles [N / 8, K / (16·t), 32, t / 2], products [M, N], rows
    [m, K], and 5 bits a weight (plus the padding to 8 rows)."""
    rows = _rows(n, k, "int4") if n * k < 10**7 else None
    with fake_accelerator() as device:
        if rows is None:  # big shapes: only the layout matters, not the values
            codes = torch.zeros(n, k, dtype=torch.uint8, device=device)
            scales = torch.zeros(n, k // 32, device=device)
            rows = qlinear.QuantRows("int4", codes, scales, scales)
        packed = PackedLinear(rows, torch.float32, device=device)
        assert isinstance(packed.gpu, Int4Tiles) and packed.gpu.kernel is TINYGEMM
        t = weight_only.inner_k_tiles(k)
        assert tuple(packed.gpu.weight.shape) == (-(-n // 8), k // (16 * t), 32, t // 2)
        x = torch.zeros(5, k, device=device)
        assert packed(x).shape == (5, n) and packed(x).dtype == torch.float32
        assert packed(x.view(1, 5, k)).shape == (1, 5, n)
        assert packed.rows(torch.zeros(3, dtype=torch.int64, device=device)).shape == (3, k)
        padded = n + -n % 8
        assert packed.nbytes() == padded * k // 2 + (k // 32) * padded * 2 * 2


def test_int8_holds_a_byte_and_a_bf16_scale_per_row() -> None:
    rows = _rows(96, 64, "int8")
    with fake_accelerator() as device:
        packed = PackedLinear(rows, torch.float32, device=device)
        assert isinstance(packed.gpu, Int8Rows)
        assert packed.nbytes() == 96 * 64 + 96 * 2


def test_device_ratios_per_gguf_type() -> None:
    """The auto mode's forms on a GPU over the file's bytes: 4-bit types within 1.15x
    (Q4_1 1.0, Q4_0 and Q4_K 1.11), 5/6-bit ones in int8 (Q6_K 1.22, Q5_K 1.45), Q8_0 below
    its file size; none near bf16's 2.9x of a Q5_K."""
    cuda = torch.device("cuda")
    ratios = {}
    for t in (Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q5_0, Q.Q5_K, Q.Q6_K, Q.Q8_0):
        form = qlinear.choose_form("auto", t, (4096, 4096), cuda)
        ratios[t.name] = round(weight_only.device_ratio(t, form, 4096), 3)
    assert ratios == {
        "Q4_0": 1.111,
        "Q4_1": 1.0,
        "Q4_K": 1.111,
        "Q5_0": 1.455,
        "Q5_K": 1.455,
        "Q6_K": 1.22,
        "Q8_0": 0.942,
    }


def test_auto_on_a_gpu_packs_as_on_a_vectorized_cpu() -> None:
    cuda = torch.device("cuda")
    choose = qlinear.choose_form
    assert choose("auto", Q.Q4_K, (64, 64), cuda) == "int4"
    assert choose("auto", Q.Q6_K, (64, 64), cuda) == "int8"
    assert choose("auto", Q.Q4_0, (64, 48), cuda) == "int8"  # K not a multiple of 32
    assert choose("auto", Q.F16, (64, 64), cuda) == "dequant"  # float files stay exact
    assert choose("int4", Q.F32, (64, 64), cuda) == "dequant"  # routers, gates
    assert choose("auto", Q.Q4_K, (64, 64), torch.device("mps")) == "dequant"
