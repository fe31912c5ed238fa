"""Small tensor functions shared by the model families: norms, RoPE, attention, MLPs.

Shapes use `n` for the tokens of one forward, `L` for the attended key length,
`H`/`Hkv` for query/key-value heads and `D` for the head dimension.

Matrix layout depends on the dtype, because CPU GEMV speed does (docs/performance.md, "Measurements
behind the code"): float32 weights are stored transposed, `[in, out]`, and multiplied with
`matmul`, which beats `F.linear` on them; bfloat16 / float16 weights keep `[out, in]` for
`F.linear`, which beats the transposed layout. `store_matrix` / `matrix_rows` / `linear` are the
only places that know this. A stack of matrices (MoE experts, `[E, out, in]`) is stored
the same way per matrix, so `w[e]` is a matrix `linear` takes (packed: a list of them).

Under a compact weights mode (`--weights int4|int8|auto`) a matrix is a `qlinear.PackedLinear`
instead (`QuantRows` while loading): `linear`, `matrix_row_select`, `take_rows` and `cat_rows`
take either, so the families never ask which.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from luced.runtime.qlinear import PackedLinear, QuantRows, quantize
from luced.runtime.ragged import Ragged

Matrix = torch.Tensor | PackedLinear
Norm = tuple[torch.Tensor | None, float]  # an RMSNorm's weight (None: no scale) and epsilon


def store_matrix(rows: torch.Tensor) -> torch.Tensor:
    """An [out, in] weight (or a [..., out, in] stack) in the layout `linear` reads."""
    return rows.mT.contiguous() if rows.dtype == torch.float32 else rows.contiguous()


def matrix_rows(w: torch.Tensor) -> torch.Tensor:
    """The [out, in] ([..., out, in]) view of a stored matrix (a view: no copy)."""
    return w.mT if w.dtype == torch.float32 else w


def linear(
    x: torch.Tensor,
    w: Matrix,
    *,
    norm: Norm | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """x @ W^T for a matrix stored by `store_matrix` or packed by `qlinear`; `norm`: RMSNorm x
    first; `residual`: added to the result. A packed matrix's native kernel does both inside
    its call (`PackedLinear.fused`), which saves a decode step ~10 small torch ops a layer."""
    if isinstance(w, PackedLinear) and w.fuses(x):
        return w.fused(x, norm=norm, residual=residual)
    if norm is not None:
        x = rms_norm(x, *norm)
    y = (
        w(x)
        if isinstance(w, PackedLinear)
        else (torch.matmul(x, w) if w.dtype == torch.float32 else F.linear(x, w))
    )
    return y if residual is None else residual + y


def matrix_row_select(w: Matrix, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of a matrix's [out, in] form, dense (an embedding lookup in a tied head)."""
    return w.rows(ids) if isinstance(w, PackedLinear) else matrix_rows(w)[ids]


def take_rows(w: torch.Tensor | QuantRows, index: torch.Tensor) -> torch.Tensor | QuantRows:
    """A loaded matrix (stored layout, or quantized rows) with its output rows reordered."""
    return w.take(index) if isinstance(w, QuantRows) else store_matrix(matrix_rows(w)[index])


def cat_rows(parts: list[torch.Tensor | QuantRows]) -> torch.Tensor | QuantRows:
    """Loaded matrices stacked along their output rows (one matrix, one matmul). Parts
    held in different forms (the file quantized them differently) meet in the widest:
    dense if any part is, else int8."""
    quant = [p for p in parts if isinstance(p, QuantRows)]
    if len(quant) == len(parts) and len({p.form for p in quant}) == 1:
        return QuantRows.cat(quant)
    if len(quant) == len(parts):
        return quantize(torch.cat([p.dequantize() for p in quant]), "int8")
    dense = next(p for p in parts if not isinstance(p, QuantRows))
    rows = [
        p.dequantize().to(dense.dtype) if isinstance(p, QuantRows) else matrix_rows(p)
        for p in parts
    ]
    return store_matrix(torch.cat(rows))


def fused_key(keys: Sequence[str]) -> str:
    """The weight key of `keys`' matrices stacked into one (`3.attn_q+3.attn_k+3.attn_v`)."""
    return "+".join(keys)


def fuse_rows(weights: dict[str, Any], groups: Iterable[Sequence[str]]) -> None:
    """Stack each group of loaded quantized matrices that share an input (a layer's Q, K and
    V; gate and up) into one under `fused_key`, in place: a decode step then makes one
    packed-kernel call and one pair of bf16 casts where it made three. The kernels compute
    every output row on its own, so the stacked call's rows equal the separate calls'
    bit for bit. Groups in a dense form, or in mixed forms (a K-quant file's Q6_K V beside
    Q4_K Q and K), stay apart: stacking would change their precision."""
    for keys in groups:
        parts = [weights.get(k) for k in keys]
        if all(isinstance(p, QuantRows) for p in parts) and len({p.form for p in parts}) == 1:  # type: ignore[union-attr]
            weights[fused_key(keys)] = QuantRows.cat(parts)  # type: ignore[arg-type]
            for k in keys:
                del weights[k]


def linears(
    x: torch.Tensor,
    weights: dict[str, Any],
    keys: Sequence[str],
    *,
    norm: Norm | None = None,
) -> list[torch.Tensor]:
    """x (RMS-normed first by `norm`) through each of `keys`' matrices: one call on their
    stack when `fuse_rows` made one (the results are views into its output), else one call
    each."""
    fused = weights.get(fused_key(keys))
    if fused is None:
        each = [weights[k] for k in keys]
        # Normed once here, unless every call norms in its kernel (as a stacked call would,
        # so both give the same bits)
        if norm is not None and not all(isinstance(w, PackedLinear) and w.fuses(x) for w in each):
            x, norm = rms_norm(x, *norm), None
        return [linear(x, w, norm=norm) for w in each]
    return list(linear(x, fused, norm=norm).split_with_sizes(fused.splits, -1))


def gated_ffn(
    x: torch.Tensor,
    weights: dict[str, Any],
    prefix: str,
    act: Callable[[torch.Tensor], torch.Tensor] = F.silu,
    *,
    norm: Norm | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """down(act(gate(x)) * up(x)) with `prefix`'s ffn_gate / ffn_up (fused or not) and
    ffn_down: SwiGLU by default; `norm` and `residual` as in `linear`. With a native
    down matrix, `act(gate) * up` is computed inside the down call."""
    keys, down = (prefix + "ffn_gate", prefix + "ffn_up"), weights[prefix + "ffn_down"]
    gate_kind = GATES.get(act)
    if gate_kind and isinstance(down, PackedLinear) and down.fuses(x):
        stacked = weights.get(fused_key(keys))
        if stacked is not None:
            gate_up = linear(x, stacked, norm=norm)
        else:  # the same input rows as a stacked call's, so the same bits
            gate_up = torch.cat(linears(x, weights, keys, norm=norm), -1)
        return down.fused(gate_up, gate=gate_kind, residual=residual)
    gate, up = linears(x, weights, keys, norm=norm)
    return linear(act(gate) * up, down, residual=residual)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32 (as the reference implementations do), cast back;
    `weight` None normalizes without a scale (Gemma 4's v-norm)."""
    if x.dtype == torch.float32 and (weight is None or weight.dtype == torch.float32):
        # The same float32 arithmetic as below, bit for bit, in five ops where a decode step
        # runs two norms per layer: no casts, the intermediates updated in place
        # (F.rms_norm's composite measured slower here: it copies its input).
        r = (x * x).mean(-1, keepdim=True).add_(eps).rsqrt_()
        return x * r if weight is None else x * r * weight
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf if weight is None else xf * weight.float()).to(x.dtype)


def layer_norm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float
) -> torch.Tensor:
    """LayerNorm over the last dimension in float32 (the encoders' norm), cast back."""
    shape = x.shape[-1:]
    if x.dtype == torch.float32:
        return F.layer_norm(x, shape, weight, bias, eps)
    return F.layer_norm(x.float(), shape, weight.float(), bias.float(), eps).to(x.dtype)


class Rope:
    """Rotate-half (NEOX-style) rotary embedding with a cached cos/sin table.

    `inv_freq` already holds any frequency factors (Llama-3 scaling, linear
    scaling, YaRN); positions index the table directly. `scale` multiplies cos and
    sin (YaRN's magnitude correction), so it scales the rotated dimensions only.

    The sin table has its first half negated, so rotate-half is one roll (`apply_rope`).
    """

    def __init__(self, inv_freq: torch.Tensor, capacity: int = 4096, scale: float = 1.0) -> None:
        self.inv_freq = inv_freq.float()
        self.scale = scale
        self.cos = self.sin = torch.empty(0)  # [capacity, 1, D]: broadcast over heads
        # The last (start, n, dtype) asked and its tables: the layers of one forward share
        # a Rope and ask the same, so each step slices once, not once per layer.
        self._last: tuple[tuple[int, int, torch.dtype], tuple[torch.Tensor, torch.Tensor]] | None
        self._last = None
        self._grow(capacity)

    def _grow(self, capacity: int) -> None:
        pos = torch.arange(capacity, dtype=torch.float32, device=self.inv_freq.device)
        freqs = torch.outer(pos, self.inv_freq)  # [capacity, D/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [capacity, D]
        sign = torch.ones_like(emb[0])
        sign[: emb.shape[1] // 2] = -1
        self.cos = (emb.cos() * self.scale)[:, None, :]
        self.sin = (emb.sin() * self.scale * sign)[:, None, :]
        self._last = None
        self._table: tuple[torch.Tensor, torch.Tensor] | None = None

    def table(self, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The float32 cos and sin tables [capacity >= end, rotated dims] (sin's first half
        negated), for a kernel that reads each position's row itself."""
        if end > self.cos.shape[0]:
            self._grow(max(end, 2 * self.cos.shape[0]))
        if self._table is None:  # every layer of every step asks: two views made once
            self._table = self.cos[:, 0], self.sin[:, 0]
        return self._table

    def tables(
        self, start: int | Ragged, n: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [n, 1, D] of positions start..start+n-1, or of a ragged batch's tokens,
        for `apply_rope` (sin's first half negated)."""
        end = start.end if isinstance(start, Ragged) else start + n
        if end > self.cos.shape[0]:
            self._grow(max(end, 2 * self.cos.shape[0]))
        if isinstance(start, Ragged):
            at = start.positions.to(self.cos.device)
            return self.cos[at].to(dtype), self.sin[at].to(dtype)
        key = (start, n, dtype)
        if self._last is None or self._last[0] != key:
            cos, sin = self.cos[start:end].to(dtype), self.sin[start:end].to(dtype)
            self._last = key, (cos, sin)
        return self._last[1]


def rope_inv_freq(
    dim: int,
    base: float,
    *,
    factors: torch.Tensor | None = None,
    linear_scale: float = 1.0,
) -> torch.Tensor:
    """Inverse frequencies for `dim` rotary dimensions; `factors` divide them (llama.cpp's
    rope_freqs tensor), `linear_scale` divides positions (linear RoPE scaling)."""
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if factors is not None:
        inv = inv / factors.float().to(inv.device)
    return inv / linear_scale


def yarn_inv_freq(
    dim: int,
    base: float,
    factor: float,
    original_context: int,
    beta_fast: float = 32.0,
    beta_slow: float = 1.0,
) -> torch.Tensor:
    """YaRN inverse frequencies: interpolated (divided by `factor`) for the slow dimensions,
    extrapolated (kept) for the fast ones, blended linearly between the dimensions that turn
    `beta_fast` and `beta_slow` times over `original_context` positions (ggml's
    rope_yarn_corr_dims, with the same floor/ceil)."""

    def turning_dim(rotations: float) -> float:
        return dim * math.log(original_context / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(turning_dim(beta_fast)), 0)
    high = min(math.ceil(turning_dim(beta_slow)), dim - 1)
    powers = base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    extrapolated, interpolated = 1.0 / powers, 1.0 / (factor * powers)
    pair = torch.arange(dim // 2, dtype=torch.float32)
    span = high - low if high != low else 0.001
    keep = 1 - ((pair - low) / span).clamp(0, 1)  # 1: extrapolate, 0: interpolate
    return interpolated * (1 - keep) + extrapolated * keep


def yarn_mscale(factor: float) -> float:
    """YaRN's cos/sin magnitude correction for a context stretched `factor` times."""
    return 1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [n, heads, D]; cos/sin: [n, 1, D] from `Rope.tables`. Rotates the first
    cos.shape[-1] dimensions: x·cos + rotate_half(x)·sin, where rotate_half(x) =
    [-x2, x1] is the roll [x2, x1] times the sign that `Rope`'s sin table carries (the
    same products, so the same bits)."""
    d = cos.shape[-1]
    if d == x.shape[-1]:
        return x * cos + x.roll(d // 2, -1) * sin
    rot, rest = x[..., :d], x[..., d:]
    return torch.cat([rot * cos + rot.roll(d // 2, -1) * sin, rest], dim=-1)


def attention_mask(
    start: int, n: int, total: int, window: int | None, device: torch.device
) -> torch.Tensor | None:
    """Boolean [n, total] mask (True = attend) for queries at start..start+n-1 over keys
    0..total-1: causal, and within `window` positions when given. None when every query
    may see every key (single-token decode without a window in reach)."""
    if n == 1 and (window is None or start < window):
        return None
    q_pos = torch.arange(start, start + n, device=device)[:, None]
    k_pos = torch.arange(total, device=device)[None, :]
    allowed = k_pos <= q_pos
    if window is not None:
        allowed &= (q_pos - k_pos) < window
    return allowed


def positions_mask(
    start: int, n: int, positions: torch.Tensor, window: int | None, device: torch.device
) -> torch.Tensor | None:
    """`attention_mask` over keys at `positions` (int64 [L], ascending) rather than 0..L-1:
    a cache that holds only some of the positions before its queries (KV Flash evicted or
    paged out the rest). None for one query that may see every key."""
    q = torch.arange(start, start + n, device=device)[:, None]
    p = positions.to(device)[None, :]
    allowed = p <= q
    if window is not None:
        allowed &= (q - p) < window
    return None if n == 1 and bool(allowed.all()) else allowed


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """q: [n, H, D]; k, v: [Hkv, L, D] (the cache layout); returns [n, H*D]."""
    n, n_heads, head_dim = q.shape
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),  # [1, H, n, D]
        k.unsqueeze(0),
        v.unsqueeze(0),
        attn_mask=mask,
        scale=scale,
        enable_gqa=n_heads != k.shape[0],
    )
    return out[0].transpose(0, 1).reshape(n, n_heads * head_dim)


def swiglu(
    x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    return linear(F.silu(linear(x, gate)) * linear(x, up), down)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


# The gate activations a native down projection computes on its input (`gated_ffn`).
GATES: dict[Callable[[torch.Tensor], torch.Tensor], str] = {F.silu: "silu", gelu_tanh: "gelu_tanh"}


def geglu_tanh(
    x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    return linear(gelu_tanh(linear(x, gate)) * linear(x, up), down)
