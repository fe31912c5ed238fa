"""The fixed-shape step's attention through the row map (luced.runtime.paged_attention):
the Triton kernel against the gather + SDPA it may replace.

Without a GPU the kernel runs under Triton's interpreter, which must be switched on before
triton is first imported, so the comparison runs in a child process. Triton is not a
dependency of the CPU install: where it is missing (CI) the test is skipped, and the GPU
check runs the kernel for real (tests/cuda/test_cuda_runtime.py)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from luced.runtime.paged_attention import gather_attention

CHILD = textwrap.dedent(
    """
    import torch
    from luced.runtime.paged_attention import gather_attention, triton_attention

    torch.manual_seed(0)
    # (sequences, tokens each, heads, KV heads, head dim, attended rows, window): GQA
    # groups of 4, 1 (MHA) and 3 (padded to 16), a head dim that is not a power of two,
    # several 256-key parts, a sliding window, verify windows of 3 tokens.
    for b, t, h, hkv, d, length, window in [
        (3, 1, 8, 2, 32, 96, None),
        (2, 3, 4, 4, 48, 300, None),
        (2, 2, 6, 2, 64, 600, 40),
    ]:
        rows_total = b * length + 50
        keys, values = torch.randn(hkv, rows_total, d), torch.randn(hkv, rows_total, d)
        rows = torch.stack([torch.randperm(rows_total)[:length] for _ in range(b)])
        last = [[min(length - 1, 17 * (i + 1) * (j + 1)) for j in range(t)] for i in range(b)]
        positions = torch.tensor(last).view(-1)
        q = torch.randn(b * t, h, d)
        want = gather_attention(q, keys, values, rows, positions, window, 0.125)
        got = triton_attention(q, keys, values, rows, positions, window, 0.125)
        err = float((got - want).abs().max())
        assert err < 1e-5, (b, t, h, hkv, d, length, window, err)
    print("ok")
    """
)


def test_the_gather_attends_each_query_to_its_own_keys() -> None:
    """A query at position p of sequence b attends to rows[b, :p + 1] (the last `window`
    of them): the softmax over exactly those keys, computed here by hand."""
    torch.manual_seed(1)
    keys, values = torch.randn(2, 40, 8), torch.randn(2, 40, 8)
    rows = torch.stack([torch.randperm(40)[:16], torch.randperm(40)[:16]])
    positions = torch.tensor([3, 4, 15, 9])  # 2 sequences x 2 tokens
    q = torch.randn(4, 4, 8)  # 4 heads over 2 KV heads
    for window in (None, 3):
        got = gather_attention(q, keys, values, rows, positions, window, 0.5)
        for i, p in enumerate(positions.tolist()):
            seen = rows[i // 2, max(0, p - window + 1) if window else 0 : p + 1]
            for head in range(4):
                k, v = keys[head // 2, seen], values[head // 2, seen]
                want = torch.softmax(q[i, head] @ k.T * 0.5, -1) @ v
                torch.testing.assert_close(got[i, head], want, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_the_triton_kernel_equals_the_gather() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]
