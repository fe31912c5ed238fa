"""The small ops a decode step hands to luced's native calls: an RMSNorm or a gated activation
on a packed matrix's input rows and a residual added to its outputs (csrc/qgemm.c,
`PackedLinear.fused`), RoPE applied by the decode-attention kernel as it stores a row
(csrc/decode_attention.c), and the layers that route a step through them.

Oracles: the same kernel on rows prepared by torch (norm, activation), torch's add (the
residual, bit for bit), torch's `apply_rope` (bit for bit: two rounded products and a
rounded sum), each row computed alone (batch invariance), and the model with fusion off.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from luced.runtime import native, native_attention
from luced.runtime.layers import Rope, apply_rope, gelu_tanh, rms_norm, rope_inv_freq
from luced.runtime.model import Model
from luced.runtime.native_attention import Storage
from luced.runtime.qlinear import PackedLinear, quantize
from luced.runtime.tiny import make_tiny_gguf

pytestmark = pytest.mark.skipif(
    native.kernels(torch.device("cpu"), "auto") is None, reason="native kernels not built here"
)
ACTS = {"silu": F.silu, "gelu_tanh": gelu_tanh}


def _packed(n: int, k: int, form: str, seed: int = 0) -> PackedLinear:
    g = torch.Generator().manual_seed(seed)
    return PackedLinear(quantize(torch.randn(n, k, generator=g) * 0.05, form), torch.float32)


def _rows(m: int, k: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=g) * 3


@pytest.mark.parametrize("form", ["int4", "int8"])
@pytest.mark.parametrize("scaled", [True, False])
def test_norm_inside_the_call_matches_torch_norm(form: str, scaled: bool) -> None:
    """RMSNorm on the input rows in the kernel: the same products as the kernel on rows
    torch normed (the two norms differ by an ulp's rounding in the sum of squares)."""
    w = _packed(96, 576, form)
    x = _rows(5, 576)
    weight = torch.rand(576, generator=torch.Generator().manual_seed(2)) + 0.5 if scaled else None
    got = w.fused(x, norm=(weight, 1e-5))
    want = w.fused(rms_norm(x, weight, 1e-5))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4 * want.abs().max().item())
    # and the norm is really applied: the raw rows give another answer
    assert (w.fused(x) - want).abs().max() > 100 * (got - want).abs().max()


@pytest.mark.parametrize("form", ["int4", "int8"])
@pytest.mark.parametrize("gate", sorted(ACTS))
def test_gate_inside_the_call_matches_torch_activation(form: str, gate: str) -> None:
    """act(gate) * up computed on [gate | up] rows in the kernel, against torch's activation
    (the kernel's exp is a polynomial within float32 rounding)."""
    w = _packed(64, 1536, form)
    gate_up = _rows(4, 2 * 1536)
    got = w.fused(gate_up, gate=gate)
    g, u = gate_up.split(1536, -1)
    want = w.fused((ACTS[gate](g) * u).contiguous())
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4 * want.abs().max().item())
    with pytest.raises(ValueError, match="gate input"):
        w.fused(g.contiguous(), gate=gate)


def test_mismatched_norm_weight_is_refused() -> None:
    """The kernel reads `in` weights: a wrong-sized norm is an error, not a stray read."""
    w = _packed(32, 64, "int4")
    with pytest.raises(ValueError, match="norm weight of 63 for 64"):
        w.fused(_rows(1, 64), norm=(torch.ones(63), 1e-6))


@pytest.mark.parametrize("form", ["int4", "int8"])
def test_residual_is_torchs_add_bit_for_bit(form: str) -> None:
    w = _packed(100, 64, form)  # 100 outputs: a partial last block of 16 rows
    x, r = _rows(3, 64), _rows(3, 100, seed=4)
    assert torch.equal(w.fused(x, residual=r), r + w.fused(x))
    with pytest.raises(ValueError, match="residual"):
        w.fused(x, residual=r[:, :99])


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("op", ["norm", "silu", "gelu_tanh"])
def test_fused_rows_do_not_depend_on_their_batch(op: str, threads: int) -> None:
    """Each row of a 9-row call equals that row alone, bit for bit, at any thread count: a
    decode step in a batch gives what it gives alone, and a verify what decode gives."""
    w = _packed(48, 128, "int4")
    k = 128 if op == "norm" else 256
    x, r = _rows(9, k), _rows(9, 48, seed=5)
    kwargs = {"norm": (torch.rand(128) + 0.5, 1e-6)} if op == "norm" else {"gate": op}
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        batch = w.fused(x, residual=r, **kwargs)
        alone = [w.fused(x[i : i + 1], residual=r[i : i + 1], **kwargs) for i in range(9)]
    finally:
        torch.set_num_threads(before)
    assert torch.equal(batch, torch.cat(alone))


@pytest.mark.parametrize("rotated", [64, 32])  # all of the head, or partial rotary
def test_rope_in_the_attention_kernel_equals_torch_rope(rotated: int) -> None:
    """Queries and new keys rotated by the kernel: the stored K rows and the outputs are
    those of torch's `apply_rope` first, bit for bit, so a row written by a decode step
    equals the row a prefill or a verify writes."""
    heads, h_kv, d, positions = 6, 2, 64, [0, 5, 70]
    rope = Rope(rope_inv_freq(rotated, 10000.0), capacity=16)  # grows to cover position 70
    g = torch.Generator().manual_seed(3)
    q = torch.randn(len(positions), heads, d, generator=g)
    k, v = torch.randn(2, len(positions), h_kv, d, generator=g)
    storage = [Storage(*torch.randn(2, h_kv, 80, d, generator=g)) for _ in positions]
    twins = [Storage(s.k.clone(), s.v.clone()) for s in storage]
    tables = rope.table(max(positions) + 1)
    at = torch.tensor(positions)
    cos, sin = rope.cos[at], rope.sin[at]
    want = native_attention.decode_attention(
        apply_rope(q, cos, sin), (apply_rope(k, cos, sin), v), storage, positions, None, 0.125
    )
    got = native_attention.decode_attention(q, (k, v), twins, positions, None, 0.125, tables)
    assert torch.equal(got, want)
    for s, t in zip(storage, twins, strict=True):
        assert torch.equal(s.k, t.k) and torch.equal(s.v, t.v)


def test_rope_tables_must_fit_the_heads() -> None:
    kv = Storage(torch.zeros(1, 8, 16), torch.zeros(1, 8, 16))
    q, new = torch.randn(1, 2, 16), (torch.randn(1, 1, 16), torch.randn(1, 1, 16))
    wide = Rope(rope_inv_freq(32, 10000.0)).table(8)  # 32 rotated dims for 16-dim heads
    with pytest.raises(ValueError, match="RoPE over 32 of 16"):
        native_attention.decode_attention(q, new, [kv], [3], None, 0.25, wide)
    short = Rope(rope_inv_freq(16, 10000.0), capacity=2)
    with pytest.raises(ValueError, match="do not cover 3"):
        native_attention.decode_attention(
            q, new, [kv], [3], None, 0.25, (short.cos[:, 0], short.sin[:, 0])
        )


def test_attention_reads_views_of_one_projection() -> None:
    """q, k and v may be views into one [B, (H + 2 Hkv) * D] projection output (no copies)."""
    heads, h_kv, d = 4, 2, 32
    qkv = torch.randn(3, (heads + 2 * h_kv) * d)
    q, k, v = (t.view(3, -1, d) for t in qkv.split([heads * d, h_kv * d, h_kv * d], -1))
    a = [Storage(torch.zeros(h_kv, 8, d), torch.zeros(h_kv, 8, d)) for _ in range(3)]
    b = [Storage(torch.zeros(h_kv, 8, d), torch.zeros(h_kv, 8, d)) for _ in range(3)]
    views = native_attention.decode_attention(q, (k, v), a, [1, 2, 3], None, 0.2)
    copies = native_attention.decode_attention(
        q.contiguous(), (k.contiguous(), v.contiguous()), b, [1, 2, 3], None, 0.2
    )
    assert torch.equal(views, copies)


def test_head_dimension_off_16_stays_on_sdpa() -> None:
    q = torch.randn(1, 4, 40)
    kv = Storage(torch.zeros(2, 8, 40), torch.zeros(2, 8, 40))
    assert not native_attention.supported(q, [kv])
    assert native_attention.supported(torch.randn(1, 4, 48), [Storage(*torch.zeros(2, 2, 8, 48))])


@pytest.fixture(scope="module")
def llama_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("fusion")
    return make_tiny_gguf("llama", root / "m.gguf", seed=7, qtype="Q4_0").path


def test_decode_step_runs_the_layer_inside_native_calls(
    llama_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Llama decode step under `auto`: each layer's two norms, its activation and both
    residual adds happen inside the packed calls, and the logits match the same model
    with fusion off (torch's norm, activation and adds around plain kernel calls)."""
    model = Model.load(llama_path, weights="int4")
    ids = torch.arange(3, 40)
    calls: list[tuple[bool, str | None, bool]] = []
    fused = PackedLinear.fused

    def spy(self, x, *, norm=None, gate=None, residual=None):
        calls.append((norm is not None, gate, residual is not None))
        return fused(self, x, norm=norm, gate=gate, residual=residual)

    cache = model.new_cache(64)
    model.forward(ids[:-1], cache, 0)
    monkeypatch.setattr(PackedLinear, "fused", spy)
    got = model.forward(ids[-1:], cache, len(ids) - 1)
    per_layer = [(True, None, False), (False, None, True), (True, None, False)]
    per_layer.append((False, "silu", True))
    assert calls[: 4 * model.cfg.n_layers] == per_layer * model.cfg.n_layers

    monkeypatch.setattr(PackedLinear, "fuses", lambda self, x: False)
    plain = model.new_cache(64)
    model.forward(ids[:-1], plain, 0)
    want = model.forward(ids[-1:], plain, len(ids) - 1)
    torch.testing.assert_close(got, want, rtol=0, atol=2e-3 * want.abs().max().item())
