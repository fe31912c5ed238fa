"""Decode attention in one native call per layer for every sequence of a step
(csrc/decode_attention.c).

A decode step gives each sequence one query. Through SDPA that is, per sequence and layer,
a KV write (two strided copies), the transposes around the call and the flash kernel's own
setup: ~70 us for one query over 256 keys, and 8x that for 8 batched sequences. The native
kernel stores every sequence's new K/V row and attends all of them in one call, threads over
(sequence, KV head), and reads each K and V row once for the head's grouped queries.

Every single-query attention over a float32 `KVCache` on the CPU goes through it, alone or
batched, so a sequence's outputs are the same in a batch as alone (each task's arithmetic
is its own). Anything else (prefill, verify blocks, KV Flash's pool, 16-bit KV, other
devices) stays on SDPA.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from luced.runtime import native_build


class _SequenceKV(ctypes.Structure):
    _fields_ = [
        ("k", ctypes.c_void_p),
        ("v", ctypes.c_void_p),
        ("rows", ctypes.c_void_p),
        ("head_stride", ctypes.c_int64),
        ("pos", ctypes.c_int64),
        ("lo", ctypes.c_int64),
    ]


def _library() -> ctypes.CDLL | None:
    lib = native_build.load("decode_attention")
    if lib is not None and lib.decode_attention.restype is not ctypes.c_int:
        lib.decode_attention.restype = ctypes.c_int
    return lib


@dataclass(frozen=True)
class Storage:
    """One sequence's K and V storage of a layer, [Hkv, rows, D], and the row of each
    position (int64 [>= pos + 1], a paged pool's map) or None: position i in row i."""

    k: torch.Tensor
    v: torch.Tensor
    rows: torch.Tensor | None = None


def supported(q: torch.Tensor, storage: Sequence[Storage]) -> bool:
    """Whether `decode_attention` takes these: float32 CPU queries, and K/V storage in
    float32 with contiguous rows."""
    if q.device.type != "cpu" or q.dtype != torch.float32 or _library() is None:
        return False
    for kv in storage:
        if kv.rows is not None and (kv.rows.dtype != torch.int64 or not kv.rows.is_contiguous()):
            return False
        for t in (kv.k, kv.v):
            if t.dtype != torch.float32 or t.device.type != "cpu" or t.dim() != 3:
                return False
            if t.stride(2) != 1 or t.stride(1) != t.shape[2]:
                return False
    return True


def decode_attention(
    q: torch.Tensor,
    new_kv: tuple[torch.Tensor, torch.Tensor] | None,
    storage: Sequence[Storage],
    positions: Sequence[int],
    window: int | None,
    scale: float,
) -> torch.Tensor:
    """One query per sequence. q: [B, H, D]; new_kv: (k, v) [B, Hkv, D] to store at each
    sequence's position first, or None when the rows are in place already (written by the
    cache, or a layer that reads another's rows); positions: each query's position.
    -> [B, H*D]."""
    b, n_heads, head_dim = q.shape
    n_kv = storage[0].k.shape[0]
    seqs = (_SequenceKV * b)()
    for s, (kv, pos) in enumerate(zip(storage, positions, strict=True)):
        k = kv.k
        room = k.shape[1] if kv.rows is None else kv.rows.shape[0]
        if k.shape[0] != n_kv or k.shape[2] != head_dim or pos >= room:
            raise ValueError(f"sequence {s}: KV storage {tuple(k.shape)} cannot hold row {pos}")
        lo = max(0, pos - window + 1) if window is not None else 0
        rows = None if kv.rows is None else kv.rows.data_ptr()
        seqs[s] = _SequenceKV(k.data_ptr(), kv.v.data_ptr(), rows, k.stride(0), pos, lo)
    q = q.contiguous()
    k_new = v_new = None
    if new_kv is not None:
        k_new, v_new = (t.contiguous() for t in new_kv)
    out = torch.empty_like(q)
    rc = _library().decode_attention(  # type: ignore[union-attr]
        b,
        n_kv,
        n_heads // n_kv,
        head_dim,
        ctypes.c_void_p(q.data_ptr()),
        None if k_new is None else ctypes.c_void_p(k_new.data_ptr()),
        None if v_new is None else ctypes.c_void_p(v_new.data_ptr()),
        seqs,
        ctypes.c_float(scale),
        ctypes.c_void_p(out.data_ptr()),
        torch.get_num_threads(),
    )
    if rc != 0:
        raise MemoryError("decode attention could not allocate its score buffers")
    return out.view(b, n_heads * head_dim)
