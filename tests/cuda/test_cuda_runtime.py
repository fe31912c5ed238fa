"""The runtime on the GPU, in process: the compact weights' kernels and memory, every family
against the same file on the CPU in float32, the captured decode step, page-locked shared
memory. Skipped without a GPU (see tests/cuda_support.py for the CPU dry run)."""

from __future__ import annotations

import secrets
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from block_lanes import Lanes, forward, forward_batch
from cuda_support import device_under_test, record

from luced.gguf_file import GGUFFile
from luced.ipc.regions import Attachments, RegionAllocator
from luced.ipc.shm import ShmOwner
from luced.runtime.decode_graph import DecodeGraphs
from luced.runtime.device_io import DeviceIO
from luced.runtime.model import Model
from luced.runtime.qlinear import PackedLinear
from luced.runtime.tiny import make_tiny_gguf
from luced.runtime.weights import WeightLoader

pytestmark = pytest.mark.cuda

FAMILIES = ("llama", "qwen3", "gemma3", "gemma4", "qwen3moe", "laguna", "qwen35", "qwen35moe")
POSITIONS = 16  # teacher-forced


@pytest.fixture(scope="module")
def gpu() -> torch.device:
    return torch.device(device_under_test() or "cpu")


@pytest.fixture(scope="module")
def q4(tmp_path_factory) -> dict[str, Path]:
    """Each family in Q4_0 (int4 block for block under `auto`)."""
    root = tmp_path_factory.mktemp("q4")
    return {f: make_tiny_gguf(f, root / f"{f}.gguf", seed=11, qtype="Q4_0").path for f in FAMILIES}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float().cpu(), b.float().cpu()
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_K", "Q6_K", "Q8_0"])
def test_packed_matrices_equal_their_dequantization(gpu, tmp_path, qtype: str) -> None:
    """Every matrix of a file as the kernels hold it: products against the float32
    dequantization of the same codes within bf16's rounding, and rows exactly as the
    dequantization rounded to bf16 (int4: the kernel's own bf16 arithmetic, one ulp)."""
    path = make_tiny_gguf("llama", tmp_path / "m.gguf", seed=3, qtype=qtype).path
    loader = WeightLoader(GGUFFile(path), torch.float32, "cpu", "auto")
    x = torch.randn(37, 256 if qtype.endswith("_K") else 64, generator=torch.Generator())
    for name in ("blk.0.ffn_up.weight", "blk.0.attn_output.weight", "token_embd.weight"):
        rows = loader.tensor(name, matrix=True)
        w = rows.dequantize()
        packed = PackedLinear(rows, torch.float32, device=gpu)
        xs = x[:, : w.shape[1]]
        for m in (1, 5, 37):  # decode, a verify block, a prefill chunk
            got = packed(xs[:m].to(gpu))
            assert rel(got, xs[:m].bfloat16().float() @ w.T) < 1e-2, (name, m)
        ids = torch.tensor([w.shape[0] - 1, 0, 9, 9, 3])
        got = packed.rows(ids.to(gpu)).float().cpu()
        torch.testing.assert_close(got, w[ids].bfloat16().float(), rtol=2**-7, atol=1e-6)
        record("packed", qtype=qtype, matrix=name, form=rows.form, rows_rel=rel(got, w[ids]))


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_K", "Q6_K", "Q8_0"])
def test_device_memory_per_gguf_type(gpu, tmp_path, qtype: str) -> None:
    """A loaded model's matrices hold their `weight_only.held_bits`: 4-bit types within
    1.15x their file size, Q6_K and Q8_0 in int8; the device's allocation grows by the
    weights' bytes (cuda only)."""
    path = make_tiny_gguf(
        "llama", tmp_path / "m.gguf", seed=3, qtype=qtype, hidden=256, ffn=1024, layers=4,
        vocab_size=2048,
    ).path  # fmt: skip
    gguf = GGUFFile(path)
    before = torch.cuda.memory_allocated() if gpu.type == "cuda" else 0
    model = Model.load(path, device=gpu, dtype="bfloat16", weights="auto")
    after = torch.cuda.memory_allocated() if gpu.type == "cuda" else 0
    held = filebytes = 0
    for w in model.weights.values():
        if isinstance(w, PackedLinear):
            held += w.nbytes()
    for info in gguf.tensors.values():
        if len(info.shape) == 2:
            filebytes += info.nbytes
    ratio = held / filebytes
    record("memory", qtype=qtype, held=held, file=filebytes, ratio=ratio, allocated=after - before)
    limit = {"Q4_0": 1.15, "Q4_K": 1.15, "Q6_K": 1.25, "Q8_0": 1.0}[qtype]
    assert ratio <= limit
    if gpu.type == "cuda":  # nothing else stays behind: the weights and the RoPE tables
        dense = sum(
            t.numel() * t.element_size() for t in model.weights.values() if torch.is_tensor(t)
        )
        ropes = {id(r): r for r in model.ropes.values()}.values()
        tables = sum(2 * r.cos.numel() * r.cos.element_size() for r in ropes)
        assert after - before <= held + dense + tables + (64 << 10)


@pytest.mark.parametrize("mode", ["float32-dequant", "bfloat16-auto"])
@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_matches_the_cpu_in_float32(gpu, q4, family: str, mode: str) -> None:
    """The same Q4_0 file teacher-forced over 16 positions (a prefill of 8, then 8 decode
    steps) on the device and on the CPU in float32 with dequantized weights: logits within
    float32 rounding (1e-4) or within bf16 activations and scales (0.1), relative to the
    logits' norm."""
    path = q4[family]
    dtype, weights = mode.split("-")
    torch.backends.cudnn.allow_tf32 = False  # float32 means float32 (qwen35's conv1d)
    ids = torch.tensor([(13 * i + 5) % 400 + 1 for i in range(POSITIONS)])
    ref_model = Model.load(path)
    ref = _teacher_forced(ref_model, ids, torch.device("cpu"))
    model = Model.load(path, device=gpu, dtype=dtype, weights=weights)
    got = _teacher_forced(model, ids, gpu)
    err = rel(got, ref)
    record("family", family=family, mode=mode, rel=err)
    assert err < (1e-4 if dtype == "float32" else 0.1), err


def _teacher_forced(model: Model, ids: torch.Tensor, device: torch.device) -> torch.Tensor:
    cache = model.new_cache(64)
    out = [model.forward(ids[:8].to(device), cache, 0)]
    for i in range(8, POSITIONS):
        out.append(model.forward(ids[i : i + 1].to(device), cache, i))
    return torch.cat(out).float().cpu()


def prefilled_pools(model: Model, prompts: list[list[int]], n: int) -> tuple[list, list]:
    """n block pools under the daemon's tables, each with a paged cache per prompt,
    prefilled -> (lanes, caches)."""
    lanes = [Lanes(model, 16) for _ in range(n)]
    caches = [[pool.cache(512) for _ in prompts] for pool in lanes]
    for p, *each in zip(prompts, *caches, strict=True):
        for c in each:
            forward(model, torch.tensor(p, device=model.device), c, 0)
    return lanes, caches


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_captured_decode_equals_eager(gpu, q4, family: str) -> None:
    """Graph replays of the decode step (buckets of 1 and 4 sequences) against the same
    fixed-shape step run eagerly (the same ops: equal up to the kernels cuBLAS picks under
    capture, recorded),
    and against the model's own batched forward (SDPA over each sequence's rows: within
    bf16's rounding)."""
    model = Model.load(q4[family], device=gpu, dtype="bfloat16", weights="auto")
    prompts = [[5, 6, 7], list(range(20, 45)), [9], list(range(100, 110))]
    lanes, caches = prefilled_pools(model, prompts, 3)
    graphs = DecodeGraphs(model, lanes[0].pool, 512)
    eager = DecodeGraphs(model, lanes[1].pool, 512, capture=False)
    refs = caches[2]
    tokens = [p[-1] for p in prompts]
    replay_err = model_err = 0.0
    for step in range(24):
        n = 1 if step < 8 else 4
        ids = torch.tensor(tokens[:n], device=gpu)
        want = torch.cat(
            forward_batch(
                model, [ids[i : i + 1] for i in range(n)], refs[:n], [c.pos for c in refs[:n]]
            )
        )
        lanes[0].step(caches[0][:n])
        lanes[1].step(caches[1][:n])
        got = graphs.step(caches[0][:n], ids)
        same = eager.step(caches[1][:n], ids)
        replay_err, model_err = max(replay_err, rel(got, same)), max(model_err, rel(got, want))
        tokens[:n] = want.argmax(-1).tolist()
    record("decode_graph", family=family, replay_rel=replay_err, model_rel=model_err,
           captures=graphs.captures)  # fmt: skip
    assert replay_err < 5e-3 and model_err < 2e-2
    if gpu.type == "cuda":
        assert graphs.captures == 2  # buckets (1, 1, 256, ()) and (4, 1, 256, ())


def test_captured_verify_windows_equal_eager(gpu, q4) -> None:
    """Verify windows (16 and 3 tokens, a bucket of 2 x 16) through the graph against the
    same step run eagerly, in bfloat16 with packed weights, each window rolled back to its
    first half after, as a rejection would."""
    model = Model.load(q4["llama"], device=gpu, dtype="bfloat16", weights="auto")
    prompts = [list(range(20, 45)), [9, 10, 11]]
    lanes, caches = prefilled_pools(model, prompts, 2)
    graphs = DecodeGraphs(model, lanes[0].pool, 512)
    eager = DecodeGraphs(model, lanes[1].pool, 512, capture=False)
    sizes, err = [16, 3], 0.0
    for r in range(4):
        ids = torch.arange(1, 20, device=gpu) * (r + 3) % 300 + 1
        for pool, each in zip(lanes, caches, strict=True):
            pool.step(each, sizes)
        got, want = graphs.step(caches[0], ids, sizes), eager.step(caches[1], ids, sizes)
        assert got.shape == (19, model.cfg.vocab)
        err = max(err, rel(got, want))
        for each in caches:
            for c, n in zip(each, sizes, strict=True):
                c.truncate(c.pos - n // 2)
    record("graph_verify_window", replay_rel=err, captures=graphs.captures)
    assert err < 5e-3
    if gpu.type == "cuda":
        assert graphs.captures == 1  # one bucket (2, 16, 256, ()), replayed


def test_triton_attention_equals_the_gather(gpu, q4) -> None:
    """The Triton decode attention against gather + SDPA, in bfloat16 at an 8B model's head
    shapes (32 heads over 8, dim 128) over 2048 pooled rows, and as the attention of the
    captured step on tiny llama (tests/runtime/test_paged_attention.py checks the kernel on
    the CPU, under Triton's interpreter)."""
    if gpu.type != "cuda":
        pytest.skip("the Triton kernel runs on a GPU here")
    from luced.runtime.paged_attention import gather_attention, triton_attention

    torch.manual_seed(0)
    keys = torch.randn(8, 4096, 128, device=gpu, dtype=torch.bfloat16)
    values = torch.randn_like(keys)
    rows = torch.stack([torch.randperm(4096, device=gpu)[:2048] for _ in range(4)])
    positions = torch.tensor([2047, 100, 1500, 0, 700, 701, 702, 703], device=gpu)  # T = 2
    q = torch.randn(8, 32, 128, device=gpu, dtype=torch.bfloat16)
    kernel_err = max(
        rel(triton_attention(q, keys, values, rows, positions, w, 0.088),
            gather_attention(q, keys, values, rows, positions, w, 0.088))
        for w in (None, 512)
    )  # fmt: skip
    model = Model.load(q4["llama"], device=gpu, dtype="bfloat16", weights="auto")
    lanes, caches = prefilled_pools(model, [list(range(20, 45)), [9, 10, 11]], 2)
    gather = DecodeGraphs(model, lanes[0].pool, 512)
    triton_step = DecodeGraphs(model, lanes[1].pool, 512, attention="triton")
    step_err = greedy_steps_apart(gather, triton_step, lanes, caches, [44, 11], 6)
    record("triton_attention", kernel_rel=kernel_err, step_rel=step_err)
    assert kernel_err < 1e-2 and step_err < 1e-2


def greedy_steps_apart(
    ref: DecodeGraphs, other: DecodeGraphs, lanes: list, caches: list, tokens: list[int], n: int
) -> float:
    """n greedy decode steps of the same sequences through two steps, each over its own
    pool (`prefilled_pools`), fed `ref`'s tokens -> the largest relative logit difference."""
    err = 0.0
    for _ in range(n):
        ids = torch.tensor(tokens, device=ref.pool.device)
        for pool, each in zip(lanes, caches, strict=True):
            pool.step(each)
        want = ref.step(caches[0], ids)
        err = max(err, rel(other.step(caches[1], ids), want))
        tokens = want.argmax(-1).tolist()
    return err


def test_the_compiled_step_follows_the_captured_one(gpu, q4) -> None:
    """`--decode-graphs compile`: the step compiled by torch.compile (Triton on the GPU) and
    captured, against the uncompiled graph, on tiny llama in bfloat16 with packed weights:
    fused kernels round otherwise, so within bf16's rounding, not bit for bit."""
    model = Model.load(q4["llama"], device=gpu, dtype="bfloat16", weights="auto")
    prompts = [list(range(20, 45)), [9, 10]]
    lanes, caches = prefilled_pools(model, prompts, 2)
    plain = DecodeGraphs(model, lanes[0].pool, 512)
    compiled = DecodeGraphs(model, lanes[1].pool, 512, compile=True)
    err = greedy_steps_apart(plain, compiled, lanes, caches, [p[-1] for p in prompts], 8)
    record("compiled_decode", rel=err, compile_error=compiled.compile_error)
    if gpu.type == "cuda":
        assert compiled.compile_error is None
    assert err < 1e-2


def test_page_locked_segments_copy_by_dma(gpu) -> None:
    """A worker's mapping of a daemon segment is registered with CUDA: its views are pinned
    memory, copies to and from the device are exact; a refused registration (the same
    mapping twice) leaves no error behind for the next kernel and stages its copies."""
    io = DeviceIO((str(gpu),))
    rates = {}
    with ShmOwner(secrets.token_hex(4)) as owner:
        seg = owner.create("act", 64 << 20)
        region = RegionAllocator.for_segment(seg).alloc("rows", (4096, 4096), "float32")
        att = Attachments(
            on_attach=lambda s: io.attach(s.name, s.address(), s.size),
            on_close=lambda s: io.detach(s.name),
        )
        host = torch.from_numpy(att.view(region))
        host.copy_(torch.randn(4096, 4096))
        if gpu.type == "cuda":
            assert host.is_pinned() and seg.name in io.pins.pinned
        assert torch.equal(io.upload(host, gpu, seg.name).cpu(), host)
        rates["registered"] = _rate(lambda: host.to(gpu), host, gpu)
        if gpu.type == "cuda":
            mapping = att.segment(seg.name)
            twice = DeviceIO((str(gpu),))  # the same range again: CUDA refuses it
            twice.attach(seg.name, mapping.address(), mapping.size)
            assert seg.name in twice.pins.refused
            assert (torch.ones(8, device=gpu) * 2).sum().item() == 16  # no stale error
            assert torch.equal(twice.upload(host, gpu, seg.name).cpu(), host)
            assert twice.staging.copies == 1
            rates["staged"] = _rate(lambda: twice.upload(host, gpu, seg.name), host, gpu)
            twice.close()
        host = None  # the last view: the mapping can go
        att.close()
        assert io.pins.pinned == {}
    pageable = torch.randn(4096, 4096)
    rates["pageable"] = _rate(lambda: pageable.to(gpu), pageable, gpu)
    record("transfer", gb_per_s=rates)


def _rate(copy, host: torch.Tensor, device: torch.device) -> float:
    """GB/s of a host -> device copy (median of 5)."""
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        copy()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return host.numel() * host.element_size() / float(np.median(times)) / 1e9
