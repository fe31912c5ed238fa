"""Native integer-dot kernels (luced.runtime.native, csrc/qgemm.c): every variant this CPU
runs against a float64 product of the same quantized activations and weights, the variants
against each other, batch invariance bit for bit, the layouts' round trip, the fallback to
torch's kernels, and SmolLM2's logits against the exact float32 model.

Oracles: `Kernels.quantize` gives the activations the kernels see (checked on its own
against x); float64 matmul of those and `QuantRows.dequantize` is then exact up to float32
accumulation, so the tolerances are tight.
"""

from __future__ import annotations

import ast
import logging
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from luced.gguf_file import GGUFFile
from luced.runtime import native, native_build, qlinear
from luced.runtime.layers import linear, matrix_row_select
from luced.runtime.model import Model
from luced.runtime.qlinear import PackedLinear, QuantRows, quantize
from luced.runtime.tiny import make_tiny_gguf
from luced.runtime.weights import WeightLoader

CPU = torch.device("cpu")
ISAS = [name for name, (_, needs) in native.ISAS.items() if needs <= qlinear.cpu_flags()]
# (out, in): SmolLM2's fused QKV and down projection, a block tail (N % 16), an int8 K
# that is no multiple of 32, and a slice of the tied head's shape.
SHAPES = [(960, 576), (576, 1536), (1000, 96), (50, 48), (4096, 576)]


@pytest.fixture
def kern() -> native.Kernels:
    """The shared kernels object, restored after each test (tests switch variant/levels)."""
    found = native.kernels(CPU, "auto")
    if found is None:
        pytest.skip("native kernels not built here (no gcc?)")
    isa, levels = found.isa, found.levels
    yield found
    found.isa, found.levels = isa, levels


def _matrix(n: int, k: int, form: str, seed: int = 0) -> QuantRows:
    g = torch.Generator().manual_seed(seed)
    return quantize(torch.randn(n, k, generator=g) * 0.05, form)


def _kernel(kern: native.Kernels, rows: QuantRows) -> Callable[[torch.Tensor], torch.Tensor]:
    """x -> y through `rows` packed once, on whichever variant `kern` has selected."""
    n = rows.shape[0]
    if rows.form == "int8":
        codes, scale = native.pack_int8(rows.codes, rows.scales)
        return lambda x: kern.int8(codes, scale, n, x)
    codes, sz = native.pack_int4(rows.codes, rows.scales, rows.zeros)  # type: ignore[arg-type]
    return lambda x: kern.int4(codes, sz, n, x)


def _run(kern: native.Kernels, rows: QuantRows, x: torch.Tensor) -> torch.Tensor:
    return _kernel(kern, rows)(x)


def _reference(kern: native.Kernels, rows: QuantRows, x: torch.Tensor) -> torch.Tensor:
    codes, d, _ = kern.quantize(x)
    m, k = x.shape
    xq = (codes.double().view(m, -1, 32) * d.double()[..., None]).view(m, -1)[:, :k]
    return xq @ rows.dequantize().double().T


@pytest.mark.parametrize("levels", [1, 2])
def test_activation_quantization(kern: native.Kernels, levels: int) -> None:
    """Codes within half a step of x / scale, the step absmax/127 (int8) or /127/256 (two
    levels), sums that match, and the same codes from every variant."""
    kern.levels = levels
    g = torch.Generator().manual_seed(levels)
    x = torch.randn(5, 100, generator=g) * torch.logspace(-3, 2, 100)  # K % 32 != 0
    x[1, 40:64] = 0  # an all-zero block
    got = {}
    for isa in ISAS:
        kern.isa = isa
        got[isa] = kern.quantize(x)
    codes, d, s = got[ISAS[0]]
    for isa in ISAS[1:]:
        assert all(torch.equal(a, b) for a, b in zip(got[isa], got[ISAS[0]], strict=True)), isa
    assert torch.equal(s, codes.view(5, -1, 32).sum(-1))
    padded = torch.nn.functional.pad(x, (0, codes.shape[1] - x.shape[1])).view(5, -1, 32)
    amax = padded.abs().amax(-1)
    torch.testing.assert_close(d * 127 * 256 ** (levels - 1), amax, rtol=1e-6, atol=0)
    err = (codes.view(5, -1, 32).double() * d[..., None].double() - padded.double()).abs()
    # two levels: a residual past 127.5 fine steps clamps to 127 (at most one step off)
    bound = 0.5 + 1e-3 if levels == 1 else 1.01
    assert (err <= d[..., None].double() * bound).all()
    assert codes.abs().max() <= (127 if levels == 1 else 127 * 257)


@pytest.mark.parametrize("levels", [1, 2])
@pytest.mark.parametrize("form", ["int4", "int8"])
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_each_variant_against_float64(
    kern: native.Kernels, form: str, levels: int, n: int, k: int
) -> None:
    """Each variant equals the float64 product of its own quantized inputs up to float32
    accumulation, and the variants agree with each other as closely."""
    if form == "int4" and k % 32:
        pytest.skip("int4 needs K % 32 == 0")
    kern.levels = levels
    rows = _matrix(n, k, form)
    x = torch.randn(7, k)
    outs = {}
    for isa in ISAS:
        kern.isa = isa
        ref = _reference(kern, rows, x)
        outs[isa] = _run(kern, rows, x)
        scale = ref.abs().max().item()
        torch.testing.assert_close(outs[isa].double(), ref, rtol=0, atol=2e-6 * scale)
    for isa in ISAS[1:]:
        torch.testing.assert_close(outs[isa], outs[ISAS[0]], rtol=0, atol=2e-6 * scale)


def test_two_levels_are_closer_to_float(kern: native.Kernels) -> None:
    """int16 activations (two int8 levels) err far less than int8 against the float32
    product with the same weights."""
    rows = _matrix(576, 1536, "int4")
    x = torch.randn(4, 1536)
    exact = x.double() @ rows.dequantize().double().T
    errs = []
    for levels in (1, 2):
        kern.levels = levels
        errs.append((_run(kern, rows, x).double() - exact).norm() / exact.norm())
    assert errs[0] < 0.01 and errs[1] < errs[0] / 50


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("form", ["int4", "int8"])
def test_batch_invariance_bit_exact(kern: native.Kernels, form: str, threads: int) -> None:
    """A row's output is the same bits whatever M is (1..64), wherever the row sits in the
    call (any offset into the 4-row tiles) and with 1 or 2 threads: DFlash verify == decode."""
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for isa in ISAS:
            kern.isa = isa
            for n, k in [(576, 1536), (1000, 96)]:
                run = _kernel(kern, _matrix(n, k, form, seed=n))
                x = torch.randn(70, k)
                alone = torch.cat([run(x[i : i + 1]) for i in range(70)])
                for m in range(1, 65):
                    start = m % 5  # rows land in other tile slots than when alone
                    got = run(x[start : start + m])
                    assert torch.equal(got, alone[start : start + m]), (isa, n, k, m)
    finally:
        torch.set_num_threads(saved)


def _gguf_rows(tmp_path: Path, qtype: str, form: str) -> QuantRows:
    path = make_tiny_gguf("llama", tmp_path / f"{qtype}.gguf", seed=2, qtype=qtype).path
    rows = WeightLoader(GGUFFile(path), torch.float32, "cpu", form).tensor(
        "blk.0.ffn_up.weight", matrix=True
    )
    assert isinstance(rows, QuantRows)
    return rows


@pytest.mark.parametrize(
    ("qtype", "form"), [("Q4_0", "int4"), ("Q4_1", "int4"), ("Q4_K", "int4"), ("Q8_0", "int8")]
)
def test_packed_linear_from_gguf_rows(
    kern: native.Kernels, tmp_path: Path, qtype: str, form: str
) -> None:
    """GGUF int4 blocks (Q4_0 / Q4_1 / Q4_K) and int8 rows through `PackedLinear` on the
    native path: product, dense matrix, embedding rows and size."""
    rows = _gguf_rows(tmp_path, qtype, form)
    packed = PackedLinear(rows, torch.float32, "native")
    assert packed.native is kern
    n, k = rows.shape
    x = torch.randn(3, k)
    ref = _reference(kern, rows, x)
    torch.testing.assert_close(linear(x, packed).double(), ref, rtol=0, atol=2e-6 * ref.abs().max())
    exact = rows.dequantize()
    assert torch.equal(packed.dense(torch.float32), exact)
    ids = torch.tensor([0, 15, 16, n - 1, 3])
    assert torch.equal(matrix_row_select(packed, ids), exact[ids])
    code_bytes = n * k // (2 if form == "int4" else 1)
    assert code_bytes < packed.nbytes() < code_bytes * 1.3
    many = torch.randn(qlinear.GEMV_MAX_ROWS + 3, k)  # the dense path (maybe in bf16)
    want = many @ exact.T
    tol = 2e-2 * want.abs().max().item()
    # as the runtime runs: the shared dense scratch may come from an inference-mode test
    with torch.inference_mode():
        dense = linear(many, packed)
    torch.testing.assert_close(dense, want, rtol=2e-2, atol=tol)
    packed.invariant = True  # every row through the kernel, any M
    one_by_one = torch.cat([linear(many[i : i + 1], packed) for i in range(len(many))])
    assert torch.equal(linear(many, packed), one_by_one)


def test_torch_kernels_on_request_and_as_fallback(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """`kernels="torch"` (or LUCED_KERNELS=torch) keeps torch's pack; without a compiler
    `auto` warns once and falls back to it, `native` refuses. (native_build's cache and
    atomic build are tested in test_native_build.py.)"""
    rows = _matrix(64, 64, "int4")
    assert PackedLinear(rows, torch.float32, "torch").native is None
    monkeypatch.setenv("LUCED_KERNELS", "torch")
    assert PackedLinear(rows, torch.float32).native is None
    monkeypatch.setenv("LUCED_KERNELS", "auto")
    monkeypatch.setenv("CC", str(tmp_path / "no-such-gcc"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    native._kernels.cache_clear()
    native_build.opened.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, "luced.runtime.native_build"):
            packed = PackedLinear(rows, torch.float32)
        assert packed.native is None
        assert "native kernels qgemm unavailable, using torch's" in caplog.text
        x = torch.randn(2, 64)
        torch.testing.assert_close(linear(x, packed), x @ rows.dequantize().T, rtol=2e-2, atol=2e-2)
        with pytest.raises(RuntimeError, match="could not be built"):
            native.kernels(CPU, "native")
        with pytest.raises(ValueError, match="unknown kernels"):
            native.kernels(CPU, "fast")
    finally:
        native._kernels.cache_clear()
        native_build.opened.cache_clear()


def test_variant_by_cpu_flags(kern: native.Kernels, monkeypatch: pytest.MonkeyPatch) -> None:
    """The widest variant the flags allow; a CPU with no vector variant gets torch's kernels
    under `auto` and the portable C only when `native` is asked for."""
    flags = qlinear.cpu_flags()
    assert native.best_isa(flags) == ISAS[-1]
    assert native.best_isa(frozenset({"avx2", "fma", "f16c"})) == "avx2"
    monkeypatch.setattr(native, "cpu_flags", lambda: frozenset({"sse2"}))
    assert native.kernels(CPU, "auto") is None
    forced = native.kernels(CPU, "native")
    assert forced is not None and forced.isa == "scalar"


OPENMP_PROBE = """
import torch
from luced.runtime import native, native_build, qlinear

def runtimes():
    maps = open("/proc/self/maps").read().splitlines()
    return sorted({l.split()[-1] for l in maps if "libgomp" in l or "libiomp" in l})

before = runtimes()
kern = native.kernels(torch.device("cpu"), "native")
torch.set_num_threads(2)
codes, scale = native.pack_int8(torch.ones(256, 64, dtype=torch.int8), torch.ones(256, 1))
kern.int8(codes, scale, 256, torch.randn(3, 64))
print(before)
print(runtimes())
"""


def test_one_openmp_runtime(kern: native.Kernels) -> None:
    """The library's -fopenmp resolves (by soname) to the libgomp torch already loaded: its
    parallel calls add no OpenMP runtime (thread pool) to the process. (gguf's import of
    sentencepiece maps a second, private libgomp of its own, idle here.)"""
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-c", OPENMP_PROBE],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": str(root)},
    ).stdout
    before, after = (ast.literal_eval(line) for line in out.strip().splitlines()[-2:])
    assert after == before and any("torch/lib/libgomp" in p for p in after), after


def test_smollm2_logits_close_to_exact(kern: native.Kernels, smollm2_gguf: Path) -> None:
    """The bundled SmolLM2 under `auto` on the native kernels: next-token choices on a short
    text agree with the exact float32 model about as often as torch's kernels do."""
    ids = torch.tensor([1, 504, 3458, 282, 4649, 314, 7042, 30, 378, 3458, 282, 4649, 314])
    ids = torch.cat([ids, torch.arange(1000, 1040)])  # 53 rows: the packed path
    exact = Model.load(smollm2_gguf)
    want = exact.forward(ids, exact.new_cache(64), 0)
    model = Model.load(smollm2_gguf, weights="auto")
    head = model.weights["head"]
    assert isinstance(head, PackedLinear) and head.native is kern
    got = model.forward(ids, model.new_cache(64), 0)
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9
    assert (got - want).norm() / want.norm() < 0.1
