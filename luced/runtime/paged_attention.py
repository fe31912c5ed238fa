"""Attention of a fixed-shape step (`decode_graph.StepBatch`) over a K/V block pool, read
through each sequence's row map: two ways to the same numbers.

    gather   index_select every sequence's rows into [B, Hkv, L, D], then SDPA under a mask
             (each query sees the keys at or before its position, inside a sliding window).
             Simple, any device; but it copies the whole attended K/V each step, so its
             memory traffic is about three times the K/V's.
    triton   a Triton kernel that reads K and V rows in place through the row map (no copy),
             in the flash-decoding split: the keys are cut into SPLIT-row parts, one program
             per (query token, KV head, part) with all of that head's query heads (GQA),
             each keeping a running max and sum (online softmax); a second kernel merges
             the parts by their log-sum-exp. Static grid per bucket, so a CUDA graph holds it.

Layout (as `StepBatch`): q [N, H, D] with N = B·T tokens, token n in sequence n // T; the
pool's K and V [Hkv, pool rows, D]; rows [B, L] (the pool row of each position < L);
positions [N]. -> [N, H, D] in q's dtype. The Triton kernel runs on CUDA, and on the CPU
under Triton's interpreter (TRITON_INTERPRET=1), which is how it is checked without a GPU.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

try:  # on the GPU machine; not a dependency of the CPU install
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the machine
    triton = None

SPLIT = 256  # keys per part: a part of an attended bucket (L is a multiple of 256 or less)
BLOCK_N = 32  # keys per inner step of a part


def gather_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    rows: torch.Tensor,
    positions: torch.Tensor,
    window: int | None,
    scale: float,
) -> torch.Tensor:
    """Gather each sequence's rows, then SDPA (module docstring)."""
    n, heads, dim = q.shape
    b, length = rows.shape
    t = n // b
    hkv = keys.shape[0]
    flat = rows.view(-1)
    k = keys.index_select(1, flat).view(hkv, b, length, dim).transpose(0, 1)
    v = values.index_select(1, flat).view(hkv, b, length, dim).transpose(0, 1)
    at = positions.view(b, t, 1)
    key = torch.arange(length, device=q.device)
    visible = key <= at  # [B, T, L]
    if window is not None:
        visible &= (at - key) < window
    out = F.scaled_dot_product_attention(
        q.to(k.dtype).view(b, t, heads, dim).transpose(1, 2),  # [B, H, T, D]
        k,
        v,
        attn_mask=visible[:, None],
        scale=scale,
        enable_gqa=heads != hkv,
    )
    return out.transpose(1, 2).reshape(n, heads, dim).to(q.dtype)


def triton_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    rows: torch.Tensor,
    positions: torch.Tensor,
    window: int | None,
    scale: float,
) -> torch.Tensor:
    """The same attention as `gather_attention`, by the Triton kernels (module docstring)."""
    if triton is None:
        raise RuntimeError("the triton decode attention needs the triton package")
    n, heads, dim = q.shape
    b, length = rows.shape
    hkv = keys.shape[0]
    group = heads // hkv
    parts = math.ceil(length / SPLIT)
    q = q.contiguous()
    part_out = torch.empty((n, heads, parts, dim), dtype=torch.float32, device=q.device)
    part_lse = torch.empty((n, heads, parts), dtype=torch.float32, device=q.device)
    _attend_parts[(n, hkv, parts)](
        q, keys, values, rows, positions, part_out, part_lse,
        q.stride(0), q.stride(1), keys.stride(0), keys.stride(1), values.stride(0),
        values.stride(1), rows.stride(0),
        scale, window or 0, n // b, length, dim, group,
        SPLIT=SPLIT, BLOCK_N=BLOCK_N, BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_D=triton.next_power_of_2(dim),
    )  # fmt: skip
    out = torch.empty_like(q)
    _merge_parts[(n, heads)](
        part_out, part_lse, out, out.stride(0), out.stride(1), parts, dim,
        BLOCK_S=triton.next_power_of_2(parts), BLOCK_D=triton.next_power_of_2(dim),
    )  # fmt: skip
    return out


if triton is not None:

    @triton.jit
    def _attend_parts(
        q_ptr, k_ptr, v_ptr, rows_ptr, pos_ptr, out_ptr, lse_ptr,
        q_sn, q_sh, k_sh, k_sr, v_sh, v_sr, rows_sb,
        scale, window, tokens, length, dim, group,
        SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
    ):  # fmt: skip
        """One (query token, KV head, part): its heads' softmax-weighted V over the part's
        visible keys, normalised, and its log-sum-exp (-inf for a part with none)."""
        n = tl.program_id(0)
        h = tl.program_id(1)
        part = tl.program_id(2)
        parts = tl.num_programs(2)
        seq = n // tokens
        pos = tl.load(pos_ptr + n)
        lo = part * SPLIT
        hi = tl.minimum(lo + SPLIT, pos + 1)  # keys past the query's position are hidden
        if window > 0:
            lo = tl.maximum(lo, pos - window + 1)
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, BLOCK_D)
        heads = h * group + g
        q_mask = (g < group)[:, None] & (d < dim)[None, :]
        q = tl.load(q_ptr + n * q_sn + heads[:, None] * q_sh + d[None, :], mask=q_mask, other=0.0)
        q = q.to(tl.float32)
        m = tl.full((BLOCK_G,), -1.0e30, dtype=tl.float32)
        total = tl.zeros((BLOCK_G,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_G, BLOCK_D), dtype=tl.float32)
        start = lo - lo % BLOCK_N
        for first in range(start, hi, BLOCK_N):
            keys = first + tl.arange(0, BLOCK_N)
            seen = (keys >= lo) & (keys < hi)
            row = tl.load(rows_ptr + seq * rows_sb + keys, mask=keys < length, other=0)
            kv_mask = seen[:, None] & (d < dim)[None, :]
            k = tl.load(
                k_ptr + h * k_sh + row[:, None] * k_sr + d[None, :], mask=kv_mask, other=0.0
            )
            v = tl.load(
                v_ptr + h * v_sh + row[:, None] * v_sr + d[None, :], mask=kv_mask, other=0.0
            )
            s = tl.dot(q, tl.trans(k.to(tl.float32))) * scale  # [BLOCK_G, BLOCK_N]
            s = tl.where(seen[None, :], s, -1.0e30)
            m_new = tl.maximum(m, tl.max(s, axis=1))
            p = tl.where(seen[None, :], tl.exp(s - m_new[:, None]), 0.0)
            alpha = tl.exp(m - m_new)
            total = total * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32))
            m = m_new
        has = total > 0.0
        o = acc / tl.where(has, total, 1.0)[:, None]
        lse = tl.where(has, m + tl.log(tl.where(has, total, 1.0)), float("-inf"))
        at = n * (parts * group * tl.num_programs(1)) + heads * parts + part
        tl.store(out_ptr + at[:, None] * dim + d[None, :], o, mask=q_mask)
        tl.store(lse_ptr + at, lse, mask=g < group)

    @triton.jit
    def _merge_parts(
        part_ptr, lse_ptr, out_ptr, out_sn, out_sh, parts, dim,
        BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
    ):  # fmt: skip
        """One (query token, head): the parts weighted by exp(their lse - the largest)."""
        n = tl.program_id(0)
        head = tl.program_id(1)
        heads = tl.num_programs(1)
        s = tl.arange(0, BLOCK_S)
        d = tl.arange(0, BLOCK_D)
        base = (n * heads + head) * parts
        lse = tl.load(lse_ptr + base + s, mask=s < parts, other=float("-inf"))
        top = tl.max(lse, axis=0)
        weight = tl.exp(lse - top)
        mask = (s < parts)[:, None] & (d < dim)[None, :]
        o = tl.load(part_ptr + (base + s)[:, None] * dim + d[None, :], mask=mask, other=0.0)
        merged = tl.sum(o * weight[:, None], axis=0) / tl.sum(weight, axis=0)
        tl.store(out_ptr + n * out_sn + head * out_sh + d, merged, mask=d < dim)
