"""The native decode-attention kernel (csrc/decode_attention.c) against SDPA, and the
properties continuous batching needs from it: a sequence's output does not depend on the
others in its call nor on the thread count."""

from __future__ import annotations

import pytest
import torch

from luced.runtime import native_attention, native_build
from luced.runtime.layers import Rope, attention, attention_mask, rope_inv_freq
from luced.runtime.native_attention import Storage

pytestmark = pytest.mark.skipif(
    native_build.load(native_attention.LIBRARY) is None, reason="no C compiler for native kernels"
)


def _sequence(h_kv: int, rows: int, d: int, seed: int) -> Storage:
    g = torch.Generator().manual_seed(seed)
    return Storage(torch.randn(h_kv, rows, d, generator=g), torch.randn(h_kv, rows, d, generator=g))


def _sdpa(q, k, v, pos: int, window: int | None, scale: float) -> torch.Tensor:
    """The torch path's answer for one query at `pos` over rows [0, pos]."""
    mask = attention_mask(pos, 1, pos + 1, window, q.device)
    return attention(q[None], k[:, : pos + 1], v[:, : pos + 1], mask, scale)[0]


@pytest.mark.parametrize(("heads", "h_kv", "d"), [(9, 3, 64), (4, 4, 32), (8, 1, 128)])
@pytest.mark.parametrize("window", [None, 5])
def test_matches_sdpa_and_stores_rows(heads: int, h_kv: int, d: int, window: int | None):
    positions = [0, 3, 17, 40]
    storage = [_sequence(h_kv, 48, d, seed) for seed in range(len(positions))]
    g = torch.Generator().manual_seed(9)
    q = torch.randn(len(positions), heads, d, generator=g)
    k_new, v_new = torch.randn(2, len(positions), h_kv, d, generator=g)
    expected = []
    for s, kv in enumerate(storage):  # the torch path: write the row, then SDPA
        k2, v2 = kv.k.clone(), kv.v.clone()
        k2[:, positions[s]], v2[:, positions[s]] = k_new[s], v_new[s]
        expected.append(_sdpa(q[s], k2, v2, positions[s], window, 0.3))
    out = native_attention.decode_attention(q, (k_new, v_new), storage, positions, window, 0.3)
    torch.testing.assert_close(out, torch.stack(expected), rtol=1e-5, atol=1e-5)
    for s, kv in enumerate(storage):
        assert torch.equal(kv.k[:, positions[s]], k_new[s])
        assert torch.equal(kv.v[:, positions[s]], v_new[s])


def test_shared_layer_reads_without_writing():
    """A KV-sharing layer passes no new rows: the storage is left as it was."""
    kv = _sequence(2, 16, 32, 0)
    k, v = kv.k, kv.v
    before = k.clone(), v.clone()
    q = torch.randn(1, 4, 32)
    out = native_attention.decode_attention(q, None, [kv], [10], None, 0.2)
    torch.testing.assert_close(out[0], _sdpa(q[0], k, v, 10, None, 0.2), rtol=1e-5, atol=1e-5)
    assert torch.equal(k, before[0]) and torch.equal(v, before[1])


def test_batch_and_thread_invariant():
    """Each sequence's output in a batch of 8 is bit-equal to its output alone, at 1 and 2
    threads: decoding in a batch cannot change a token."""
    positions = [5, 200, 31, 0, 77, 140, 9, 63]
    storage = [_sequence(3, 256, 64, s) for s in range(8)]
    q = torch.randn(8, 9, 64, generator=torch.Generator().manual_seed(3))
    threads = torch.get_num_threads()
    try:
        results = []
        for n in (1, 2):
            torch.set_num_threads(n)
            batched = native_attention.decode_attention(q, None, storage, positions, None, 0.125)
            alone = [
                native_attention.decode_attention(q[i : i + 1], None, [kv], [p], None, 0.125)
                for i, (kv, p) in enumerate(zip(storage, positions, strict=True))
            ]
            assert torch.equal(batched, torch.cat(alone))
            results.append(batched)
        assert torch.equal(results[0], results[1])
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize(("heads", "h_kv"), [(9, 3), (9, 1), (4, 4)])
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("start", [40, 505])
def test_verify_block_is_its_decode_steps_bit_for_bit(heads, h_kv, window, dtype, paged, start):
    """A block of 11 queries of one sequence at consecutive positions (a verify block: the
    kernel gives them shared tasks, 4 queries at a time) gives, at 1 and 2 threads, each
    query's output alone bit for bit, and the causal SDPA of the block to rounding. Grouped
    head counts of 3, 9 (4 + 4 + 1 per pass) and 1 take every scoring width. From 505 the
    block crosses position 512, where a query's rows are cut into two chunks."""
    n = 11
    rows = start + 24
    g = torch.Generator().manual_seed(11)
    plain = Storage(*(torch.randn(h_kv, rows, 64, generator=g).to(dtype) for _ in range(2)))
    kv = plain
    if paged:  # the rows of a pool, read through its row map
        order = torch.randperm(rows, generator=g)
        kv = Storage(torch.empty_like(plain.k), torch.empty_like(plain.v), order)
        kv.k[:, order], kv.v[:, order] = plain.k, plain.v
    q = torch.randn(n, heads, 64, generator=g)
    each = list(range(start, start + n))
    threads = torch.get_num_threads()
    try:
        results = []
        for t in (1, 2):
            torch.set_num_threads(t)
            block = native_attention.decode_attention(q, None, [kv] * n, each, window, 0.125)
            alone = [
                native_attention.decode_attention(q[i : i + 1], None, [kv], [p], window, 0.125)
                for i, p in enumerate(each)
            ]
            assert torch.equal(block, torch.cat(alone))
            results.append(block)
        assert torch.equal(results[0], results[1])
    finally:
        torch.set_num_threads(threads)
    end = start + n
    mask = attention_mask(start, n, end, window, q.device)
    expected = attention(q, plain.k[:, :end].float(), plain.v[:, :end].float(), mask, 0.125)
    torch.testing.assert_close(results[0], expected, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("window", [None, 700])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_queries_are_cut_into_chunks_and_merged(window: int | None, dtype: torch.dtype):
    """Queries whose rows reach past one chunk (512 positions) are attended chunk by chunk in
    tasks of their own and merged: each matches SDPA, stores its new row in place, and
    gives alone what it gives in the batch, at 1 and 2 threads; one whole chunk beside
    them is untouched by the cut."""
    positions = [511, 512, 1300, 2047, 40]
    g = torch.Generator().manual_seed(12)
    storage = [
        Storage(*(torch.randn(3, 2048, 64, generator=g).to(dtype) for _ in range(2)))
        for _ in positions
    ]
    q = torch.randn(len(positions), 9, 64, generator=g)
    k_new, v_new = torch.randn(2, len(positions), 3, 64, generator=g)
    threads = torch.get_num_threads()
    try:
        results = []
        for t in (1, 2):
            torch.set_num_threads(t)
            copies = [Storage(kv.k.clone(), kv.v.clone()) for kv in storage]
            batched = native_attention.decode_attention(
                q, (k_new, v_new), copies, positions, window, 0.125
            )
            for s, kv in enumerate(copies):
                assert torch.equal(kv.k[:, positions[s]], k_new[s].to(dtype))
                assert torch.equal(kv.v[:, positions[s]], v_new[s].to(dtype))
            for i, (kv, p) in enumerate(zip(storage, positions, strict=True)):
                one = Storage(kv.k.clone(), kv.v.clone())
                new = (k_new[i : i + 1], v_new[i : i + 1])
                alone = native_attention.decode_attention(
                    q[i : i + 1], new, [one], [p], window, 0.125
                )
                assert torch.equal(batched[i : i + 1], alone), f"query at {p}"
            results.append((batched, copies))
        assert torch.equal(results[0][0], results[1][0])
    finally:
        torch.set_num_threads(threads)
    batched, copies = results[0]
    for s, kv in enumerate(copies):
        expected = _sdpa(q[s], kv.k.float(), kv.v.float(), positions[s], window, 0.125)
        torch.testing.assert_close(batched[s], expected.flatten(), rtol=1e-5, atol=2e-6)


def test_more_entries_than_one_call_takes_go_in_slices():
    """A prefill chunk of 150 queries (past `MAX_ENTRIES`, and across position 512) and a
    step of 70 sequences storing their rows: each entry's output is the one it gives alone,
    however the call is sliced."""
    g = torch.Generator().manual_seed(13)
    n, start = 150, 450
    assert n > native_attention.MAX_ENTRIES
    kv = Storage(*(torch.randn(3, start + n, 64, generator=g) for _ in range(2)))
    q = torch.randn(n, 9, 64, generator=g)
    each = list(range(start, start + n))
    chunk = native_attention.decode_attention(q, None, [kv] * n, each, None, 0.125)
    alone = [
        native_attention.decode_attention(q[i : i + 1], None, [kv], [p], None, 0.125)
        for i, p in enumerate(each)
    ]
    assert torch.equal(chunk, torch.cat(alone))
    b = 70
    positions = [(37 * s) % 600 for s in range(b)]
    storage = [Storage(*(torch.randn(3, 600, 64, generator=g) for _ in range(2))) for _ in range(b)]
    q = torch.randn(b, 9, 64, generator=g)
    k_new, v_new = torch.randn(2, b, 3, 64, generator=g)
    copies = [Storage(s.k.clone(), s.v.clone()) for s in storage]
    step = native_attention.decode_attention(q, (k_new, v_new), copies, positions, None, 0.125)
    for i, (s, p) in enumerate(zip(storage, positions, strict=True)):
        assert torch.equal(copies[i].k[:, p], k_new[i]) and torch.equal(copies[i].v[:, p], v_new[i])
        new = (k_new[i : i + 1], v_new[i : i + 1])
        one = native_attention.decode_attention(q[i : i + 1], new, [s], [p], None, 0.125)
        assert torch.equal(step[i : i + 1], one), f"sequence {i}"


def test_long_context_softmax_is_exact_enough():
    """Scores spread over many magnitudes (the exp polynomial's whole range) still match."""
    kv = _sequence(1, 4096, 64, 4)
    q = 4 * torch.randn(1, 2, 64, generator=torch.Generator().manual_seed(5))
    out = native_attention.decode_attention(q, None, [kv], [4095], None, 0.125)
    expected = _sdpa(q[0], kv.k, kv.v, 4095, None, 0.125)
    torch.testing.assert_close(out[0], expected, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("window", [None, 6])
def test_paged_rows_equal_rows_in_position_order(window: int | None):
    """A pool whose positions sit in shuffled rows, read through its row map, gives the bits
    of the same rows in position order; new rows land in the mapped row."""
    plain = _sequence(3, 20, 64, 6)
    order = torch.randperm(20, generator=torch.Generator().manual_seed(8))
    paged = Storage(torch.empty_like(plain.k), torch.empty_like(plain.v), order)
    paged.k[:, order], paged.v[:, order] = plain.k, plain.v
    q = torch.randn(1, 9, 64)
    new = torch.randn(2, 1, 3, 64)
    a = native_attention.decode_attention(q, (new[0], new[1]), [plain], [12], window, 0.125)
    b = native_attention.decode_attention(q, (new[0], new[1]), [paged], [12], window, 0.125)
    assert torch.equal(a, b)
    assert torch.equal(paged.k[:, order[12]], new[0, 0])


@pytest.mark.parametrize("window", [None, 20])
def test_rows_with_gaps_attend_only_the_listed_rows(window: int | None):
    """An evicting KV Flash pool lists the rows its query sees (positions with gaps, in
    order; the query's own row last): the answer is SDPA over those rows alone, masked by
    position for a window."""
    kv = _sequence(3, 64, 64, 7)
    held = torch.tensor([0, 1, 2, 3, 20, 21, 22, 40, 41, 45])  # 4..19 and 23..39 paged out
    rows = torch.randperm(64, generator=torch.Generator().manual_seed(2))[: len(held)]
    q = torch.randn(1, 9, 64, generator=torch.Generator().manual_seed(4))
    gapped = Storage(kv.k, kv.v, rows, held)
    out = native_attention.decode_attention(q, None, [gapped], [45], window, 0.125)
    seen = held >= 45 - window + 1 if window is not None else held >= 0
    keys, values = kv.k[:, rows[seen]], kv.v[:, rows[seen]]
    expected = attention(q, keys, values, None, 0.125)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="do not end at position 44"):
        native_attention.decode_attention(q, None, [gapped], [44], window, 0.125)


SIXTEEN = [t for t in (torch.bfloat16, torch.float16) if t in native_attention.kv_dtypes()]


@pytest.mark.parametrize("dtype", SIXTEEN)
@pytest.mark.parametrize("rotated", [0, 64])
def test_16_bit_rows_are_read_as_float32_and_stored_rounded(dtype: torch.dtype, rotated: int):
    """16-bit K/V (--kv-dtype): the answer is float32 attention over the stored rows read
    exactly; a new row is stored as torch rounds it (after RoPE, when the kernel ropes)."""
    positions = [3, 40]
    wide = [_sequence(3, 48, 64, seed) for seed in range(2)]
    narrow = [Storage(kv.k.to(dtype), kv.v.to(dtype)) for kv in wide]
    for kv, n in zip(wide, narrow, strict=True):  # the float32 twin holds the same values
        kv.k.copy_(n.k), kv.v.copy_(n.v)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 9, 64, generator=g)
    new = torch.randn(2, 2, 3, 64, generator=g)
    rope = None
    if rotated:
        rope = Rope(rope_inv_freq(rotated, 10000.0), capacity=64).table(48)
    args = (None, 0.125, rope)
    got = native_attention.decode_attention(q, (new[0], new[1]), narrow, positions, *args)
    native_attention.decode_attention(q, (new[0], new[1]), wide, positions, *args)
    for kv, n, pos in zip(wide, narrow, positions, strict=True):
        stored_k, stored_v = kv.k[:, pos].to(dtype), kv.v[:, pos].to(dtype)
        assert torch.equal(n.k[:, pos].view(torch.int16), stored_k.view(torch.int16))
        assert torch.equal(n.v[:, pos].view(torch.int16), stored_v.view(torch.int16))
        kv.k[:, pos], kv.v[:, pos] = stored_k.float(), stored_v.float()
    want = native_attention.decode_attention(q, None, wide, positions, *args)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_supported_rows():
    kv = _sequence(2, 8, 16, 0)
    k, v = kv.k, kv.v
    q = torch.randn(1, 2, 16)
    assert native_attention.supported(q, [kv])
    assert not native_attention.supported(q.bfloat16(), [kv])
    bf16 = Storage(k.bfloat16(), v.bfloat16())
    assert native_attention.supported(q, [bf16]) == (torch.bfloat16 in SIXTEEN)
    assert not native_attention.supported(q, [kv, bf16])  # one dtype per call
    assert not native_attention.supported(q, [Storage(k.double(), v.double())])
    assert not native_attention.supported(q, [Storage(k.transpose(1, 2), v)])  # strided rows
    assert not native_attention.supported(q, [Storage(k, v, torch.arange(8).int())])
    with pytest.raises(ValueError, match="cannot hold row"):
        native_attention.decode_attention(q, None, [kv], [8], None, 1.0)
