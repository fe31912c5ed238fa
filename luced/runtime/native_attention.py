"""Decode attention in one native call per layer for every sequence of a step
(csrc/decode_attention.c).

A decode step gives each sequence one query. Through SDPA that is, per sequence and layer,
a KV write (two strided copies), the transposes around the call and the flash kernel's own
setup, which outweigh one query's arithmetic and are paid again for each batched sequence
(docs/performance.md, "Measurements behind the code"). The native
kernel stores every sequence's new K/V row (rotating q and k by RoPE first when given the
tables) and attends all of them in one call, threads over (sequence, KV head), and reads
each K and V row once for the head's grouped queries.

Every single-query attention over K/V on the CPU goes through it (a `KVCache`'s rows, or
a KV Flash pool's through its row map, gaps and all once it has evicted), alone or
batched, so a sequence's outputs are the same in a batch as alone (each task's arithmetic
is its own). A verify block or a prefill chunk (queries of one sequence, rows stored
already) goes through it as that many decode steps, one entry per query: its logits are
then its decode steps' own, wherever the prompt was cut. K/V may be float32, bfloat16 or
float16 (`--kv-dtype`): 16-bit rows are read as float32 and the arithmetic is float32's, so
they halve the bytes a step reads. Anything else (head dims off a multiple of 16, other
devices) stays on SDPA.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from luced.runtime import native_build


class SequenceKV(ctypes.Structure):  # the C struct of that name, field for field
    _fields_ = [
        ("k", ctypes.c_void_p),
        ("v", ctypes.c_void_p),
        ("rows", ctypes.c_void_p),
        ("head_stride", ctypes.c_int64),
        ("pos", ctypes.c_int64),
        ("lo", ctypes.c_int64),
        ("cos", ctypes.c_void_p),
        ("sin", ctypes.c_void_p),
    ]


# What these bindings were written for: the C file's ABI_VERSION and its SequenceKV.
LIBRARY = native_build.Library("decode_attention", abi=1, structs=(SequenceKV,))


def _library() -> ctypes.CDLL | None:
    lib = native_build.load(LIBRARY)
    if lib is not None and lib.decode_attention.restype is not ctypes.c_int:
        p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        # fmt: off
        lib.decode_attention.argtypes = [
            i32, i32, i32, i32,                         # B, Hkv, G, D
            p, i64, p, p, i64,                          # q, ldq, k_new, v_new, ldkv
            ctypes.POINTER(SequenceKV), i32, ctypes.c_float, p,  # seqs, rope_dims, scale, out
            i32, i32,                                   # threads, kv_type
        ]
        # fmt: on
        lib.decode_attention.restype = ctypes.c_int
    return lib


# The K/V storage types of the C enum (the arithmetic is float32 for each).
KV_TYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}

# Most entries (queries) one call takes; more go in slices of this many. A query past 512
# positions keeps a partial softmax per chunk of them and KV head until they are merged,
# and a call holds those of all its entries at once: a 512-query prefill chunk at 32k
# positions of an 8-KV-head, 128-dim model would hold ~0.5 GB. Each entry's output is its
# own, so slicing changes no bit.
MAX_ENTRIES = 64


def kv_dtypes() -> frozenset[torch.dtype]:
    """The storage dtypes the built kernel reads (float16 needs a compiler with _Float16)."""
    lib = _library()
    if lib is None:
        return frozenset()
    bits = lib.decode_attention_kv_types()
    return frozenset(t for t, code in KV_TYPES.items() if bits >> code & 1)


@functools.cache
def _kv_dtypes() -> frozenset[torch.dtype]:
    return kv_dtypes()


@dataclass(frozen=True)
class Storage:
    """One sequence's K and V storage of a layer, [Hkv, rows, D], and the row of each
    position (int64 [>= pos + 1], a paged pool's map) or None: position i in row i.
    With `positions` (a KV Flash pool that evicted, so positions have gaps), `rows` lists
    the rows the query sees in position order instead, and `positions` theirs (int64,
    ascending; the query's own last)."""

    k: torch.Tensor
    v: torch.Tensor
    rows: torch.Tensor | None = None
    positions: torch.Tensor | None = None

    @functools.cached_property
    def readable(self) -> bool:
        """Whether the kernel can read this storage: K and V [Hkv, rows, D] CPU tensors of
        one dtype with contiguous rows, and an int64 contiguous row map if any. Checked once
        per Storage; a `KVCache` hands out the same one per layer until it reallocates."""
        if self.rows is not None and (
            self.rows.dtype != torch.int64 or not self.rows.is_contiguous()
        ):
            return False
        for t in (self.k, self.v):
            if t.dtype != self.k.dtype or t.device.type != "cpu" or t.dim() != 3:
                return False
            if t.stride(2) != 1 or t.stride(1) != t.shape[2]:
                return False
        return True


def supported(q: torch.Tensor, storage: Sequence[Storage]) -> bool:
    """Whether `decode_attention` takes these: float32 CPU queries with a head dimension
    that is a multiple of 16, and K/V storage with contiguous rows, all in one dtype the
    kernel reads (float32, bfloat16, float16)."""
    if q.device.type != "cpu" or q.dtype != torch.float32 or _library() is None:
        return False
    if q.shape[-1] % 16:  # the kernel takes 16 head dimensions at a time
        return False
    if not storage or storage[0].k.dtype not in _kv_dtypes():
        return False
    dtype = storage[0].k.dtype
    return all(kv.k.dtype == dtype and kv.readable for kv in storage)


def _heads_view(t: torch.Tensor) -> torch.Tensor:
    """t [B, heads, D] with contiguous heads and rows at any stride (a view into a Q/K/V
    projection's output stays a view); a copy otherwise."""
    return t if t.stride(2) == 1 and t.stride(1) == t.shape[2] else t.contiguous()


def decode_attention(
    q: torch.Tensor,
    new_kv: tuple[torch.Tensor, torch.Tensor] | None,
    storage: Sequence[Storage],
    positions: Sequence[int],
    window: int | None,
    scale: float,
    rope: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """One query per sequence. q: [B, H, D]; new_kv: (k, v) [B, Hkv, D] to store at each
    sequence's position first, or None when the rows are in place already (written by the
    cache, or a layer that reads another's rows); positions: each query's position; rope:
    float32 cos and sin tables [positions, rotated dims] (`layers.Rope.table`) to rotate q
    and the new k by first, as `layers.apply_rope` would. New rows are rounded to the
    storage's dtype as they are stored (as a torch write rounds them). -> [B, H*D] float32."""
    b, n_heads, head_dim = q.shape
    if b > MAX_ENTRIES:
        parts = [slice(i, i + MAX_ENTRIES) for i in range(0, b, MAX_ENTRIES)]
        return torch.cat([
            decode_attention(
                q[part],
                None if new_kv is None else (new_kv[0][part], new_kv[1][part]),
                storage[part],
                positions[part],
                window,
                scale,
                rope,
            )
            for part in parts
        ])  # fmt: skip
    n_kv = storage[0].k.shape[0]
    rope_dims, cos, sin = 0, 0, 0
    if rope is not None:
        rope_dims = rope[0].shape[1]
        if rope_dims > head_dim or rope_dims % 2:
            raise ValueError(f"RoPE over {rope_dims} of {head_dim} head dimensions")
        if rope[0].dtype != torch.float32 or max(positions) >= rope[0].shape[0]:
            raise ValueError(f"RoPE tables {tuple(rope[0].shape)} do not cover {max(positions)}")
        cos, sin = rope[0].data_ptr(), rope[1].data_ptr()
    row_bytes = 4 * rope_dims
    seqs = (SequenceKV * b)()
    for s, (kv, pos) in enumerate(zip(storage, positions, strict=True)):
        k = kv.k
        # the kernel's span of `rows`: [lo, last], the query's own row at `last`
        last, lo = pos, max(0, pos - window + 1) if window is not None else 0
        if kv.positions is not None:
            last = kv.positions.shape[0] - 1
            if kv.rows is None or kv.rows.shape[0] <= last or int(kv.positions[last]) != pos:
                raise ValueError(f"sequence {s}: its listed rows do not end at position {pos}")
            if window is not None:  # the first listed position inside the window
                lo = int(torch.searchsorted(kv.positions, pos - window + 1))
        room = k.shape[1] if kv.rows is None else kv.rows.shape[0]
        if k.shape[0] != n_kv or k.shape[2] != head_dim or last >= room:
            raise ValueError(f"sequence {s}: KV storage {tuple(k.shape)} cannot hold row {pos}")
        rows = None if kv.rows is None else kv.rows.data_ptr()
        at = pos * row_bytes  # RoPE by the true position
        seqs[s] = SequenceKV(k.data_ptr(), kv.v.data_ptr(), rows, k.stride(0), last, lo,
                             cos + at, sin + at)  # fmt: skip
    q = _heads_view(q)
    k_new = v_new = None
    ldkv = 0
    if new_kv is not None:
        k_new, v_new = (_heads_view(t.float()) for t in new_kv)  # rows from float32 math
        if k_new.stride(0) != v_new.stride(0):
            k_new, v_new = k_new.contiguous(), v_new.contiguous()
        ldkv = k_new.stride(0)
    out = torch.empty(b, n_heads, head_dim)
    rc = _library().decode_attention(  # type: ignore[union-attr]
        b,
        n_kv,
        n_heads // n_kv,
        head_dim,
        ctypes.c_void_p(q.data_ptr()),
        ctypes.c_int64(q.stride(0)),
        None if k_new is None else ctypes.c_void_p(k_new.data_ptr()),
        None if v_new is None else ctypes.c_void_p(v_new.data_ptr()),
        ctypes.c_int64(ldkv),
        seqs,
        rope_dims,
        ctypes.c_float(scale),
        ctypes.c_void_p(out.data_ptr()),
        torch.get_num_threads(),
        KV_TYPES.get(storage[0].k.dtype, -1),
    )
    if rc == -2:
        raise ValueError(f"decode attention does not read {storage[0].k.dtype} K/V storage")
    if rc != 0:
        raise MemoryError("decode attention could not allocate its score buffers")
    return out.view(b, n_heads * head_dim)
