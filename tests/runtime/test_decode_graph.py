"""The captured decode step (luced.runtime.decode_graph), checked where a CPU can check it.

On the CPU the step runs eagerly: its values (RoPE from device positions, K/V stored and
gathered through row maps, masks past each position and outside windows, padded slots) are
compared with the model's own batched forward over paged caches. On the fake accelerator
(tests/fake_device.py) the step runs on a non-CPU device with no value computed: a host
sync or a CPU tensor inside it, either of which a CUDA graph cannot hold, raises. Capture
and replay themselves need a GPU (tests/cuda/test_cuda_runtime.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from block_lanes import Lanes, forward, forward_batch
from fake_device import fake_accelerator

from luced.runtime.decode_graph import DecodeGraphs, bucket, row_buckets, supports
from luced.runtime.model import Model
from luced.runtime.tiny import make_tiny_gguf

FAMILIES = {
    "llama": ("llama", {}),
    "qwen3": ("qwen3", {}),
    "gemma3": ("gemma3", {}),  # sliding windows of 8
    "gemma4": ("gemma4", {}),  # KV-sharing layers, per-layer embeddings
}
# The last prompt ends 4 positions before the first row bucket's end (256).
PROMPTS = [list(range(5, 12)), [3] * 2, [(7 * i) % 500 + 1 for i in range(252)]]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def tiny(request, tmp_path_factory) -> Path:
    family, overrides = FAMILIES[request.param]
    path = tmp_path_factory.mktemp("g") / f"{request.param}.gguf"
    return make_tiny_gguf(family, path, seed=4, context=512, **overrides).path


def test_buckets() -> None:
    assert [bucket(n, (1, 2, 4, 8)) for n in (1, 2, 3, 5, 8)] == [1, 2, 4, 8, 8]
    with pytest.raises(ValueError, match="largest bucket"):
        bucket(9, (1, 2, 4, 8))
    assert row_buckets(512) == (256, 512)
    assert row_buckets(1000) == (256, 512, 1000)
    assert row_buckets(100) == (100,)


def _prefilled(lanes: Lanes) -> list:
    caches = []
    for ids in PROMPTS:
        cache = lanes.cache(512)
        forward(lanes.model, torch.tensor(ids), cache, 0)
        caches.append(cache)
    return caches


def test_captured_step_equals_the_batched_forward(tiny: Path) -> None:
    """Three sequences (a bucket of 4: one padded slot) of different lengths decode 12
    tokens greedily, across the 256-row bucket; every step's logits equal the model's
    batched forward over its own pool's caches, to float rounding (SDPA over gathered
    rows against the native kernel)."""
    model = Model.load(tiny)
    ref_caches = _prefilled(Lanes(model, 16))
    lanes = Lanes(model, 16)
    caches = _prefilled(lanes)
    graphs = DecodeGraphs(model, lanes.pool, 512)
    tokens = [ids[-1] for ids in PROMPTS]
    for step in range(12):
        starts = [c.pos for c in ref_caches]
        ref = forward_batch(model, [torch.tensor([t]) for t in tokens], ref_caches, starts)
        ref = torch.cat(ref)
        lanes.step(caches)
        got = graphs.step(caches, torch.tensor(tokens))
        assert [c.pos for c in caches] == [c.pos for c in ref_caches]
        err = float((got - ref).abs().max() / ref.abs().max())
        assert err < 1e-5, (step, err)
        tokens = ref.argmax(-1).tolist()
    assert set(graphs.graphs) == {(4, 1, 256, ()), (4, 1, 512, ())}
    assert graphs.captures == 0  # nothing is captured on the CPU


def test_a_lone_sequence_and_a_truncated_one(tiny: Path) -> None:
    """Batch of one (no padding), after a truncate (a rejected draft): the row map past the
    new position is overwritten, never read."""
    model = Model.load(tiny)
    lanes = Lanes(model, 16)
    cache = lanes.cache(512)
    forward(model, torch.tensor(PROMPTS[2]), cache, 0)
    cache.truncate(10)
    ref = Lanes(model, 16).cache(512)
    forward(model, torch.tensor(PROMPTS[2][:10]), ref, 0)
    graphs = DecodeGraphs(model, lanes.pool, 512)
    token = 7
    for _ in range(4):
        want = forward(model, torch.tensor([token]), ref, ref.pos)[-1]
        lanes.step([cache])
        got = graphs.step([cache], torch.tensor([token]))[0]
        assert float((got - want).abs().max() / want.abs().max()) < 1e-5
        token = int(want.argmax())


def test_a_pool_that_grows_drops_its_graphs(tiny: Path) -> None:
    """A pool of 4 blocks of 16 rows grows while two sequences decode past it: the batch
    tensors (which name the old storage) are made anew, and the steps still equal the
    batched forward."""
    model = Model.load(tiny)
    lanes, ref_lanes = Lanes(model, 16, initial_blocks=4), Lanes(model, 16)
    pool = lanes.pool
    prompts = [list(range(1, 20)), list(range(30, 40))]
    caches, refs = [], []
    for p in prompts:
        for ls, out in ((lanes, caches), (ref_lanes, refs)):
            out.append(ls.cache(512))
            forward(model, torch.tensor(p), out[-1], 0)
    graphs = DecodeGraphs(model, pool, 512)
    tokens, generations, batches = [p[-1] for p in prompts], {pool.generation}, []
    for _ in range(20):
        feeds = [torch.tensor([t]) for t in tokens]
        want = torch.cat(forward_batch(model, feeds, refs, [c.pos for c in refs]))
        lanes.step(caches)
        got = graphs.step(caches, torch.tensor(tokens))
        assert float((got - want).abs().max() / want.abs().max()) < 1e-5
        generations.add(pool.generation)
        batch = graphs.graphs[(2, 1, 256, ())].batch
        if not any(b is batch for b in batches):  # (held: an id could be reused)
            batches.append(batch)
        tokens = want.argmax(-1).tolist()
    assert len(generations) > 1 and len(batches) == len(generations)


def test_the_step_holds_no_host_sync_and_no_cpu_tensor(tiny: Path) -> None:
    """On a non-CPU device, in bf16 with packed weights: the step a graph would capture runs
    on device tensors alone, with nothing read back to the host."""
    with fake_accelerator() as device:
        model = Model.load(tiny, device=device, dtype="bfloat16", weights="auto")
        lanes = Lanes(model, 16)
        caches = _prefilled(lanes)
        graphs = DecodeGraphs(model, lanes.pool, 512)
        lanes.step(caches)
        logits = graphs.step(caches, torch.tensor([1, 2, 3], device=device))
        assert logits.shape == (3, model.cfg.vocab) and logits.device == device


def test_models_a_graph_cannot_hold_are_refused(tmp_path: Path) -> None:
    moe = make_tiny_gguf("qwen3moe", tmp_path / "moe.gguf", seed=1).path
    hybrid = make_tiny_gguf("qwen35", tmp_path / "h.gguf", seed=1).path
    assert "MoE" in supports(Model.load(moe))
    assert "recurrent" in supports(Model.load(hybrid))
    llama = make_tiny_gguf("llama", tmp_path / "l.gguf", seed=1).path
    assert "split" in supports(Model.load(llama, layers=(0, 1)))
    with pytest.raises(ValueError, match="MoE"):
        model = Model.load(moe)
        DecodeGraphs(model, model.new_block_pool(16), 64)


def test_the_compiled_step_equals_the_batched_forward(tmp_path: Path) -> None:
    """`compile=True`: the step goes through torch.compile (Inductor's C++ code on the CPU,
    one whole graph, no break) and still equals the batched forward. One family and one
    bucket: a compile takes tens of seconds on two cores."""
    from torch._dynamo.utils import counters

    path = make_tiny_gguf("llama", tmp_path / "l.gguf", seed=4, context=512).path
    model = Model.load(path)
    ref_caches = _prefilled(Lanes(model, 16))[:2]
    lanes = Lanes(model, 16)
    caches = _prefilled(lanes)[:2]
    graphs = DecodeGraphs(model, lanes.pool, 512, compile=True)
    compiled = counters["stats"]["unique_graphs"]
    tokens = [ids[-1] for ids in PROMPTS[:2]]
    for _ in range(3):
        starts = [c.pos for c in ref_caches]
        ref = torch.cat(
            forward_batch(model, [torch.tensor([t]) for t in tokens], ref_caches, starts)
        )
        lanes.step(caches)
        got = graphs.step(caches, torch.tensor(tokens))
        assert float((got - ref).abs().max() / ref.abs().max()) < 1e-5
        tokens = ref.argmax(-1).tolist()
    assert set(graphs.graphs) == {(2, 1, 256, ())}
    assert counters["stats"]["unique_graphs"] == compiled + 1  # compiled once, then reused


def test_a_step_that_cannot_compile_runs_uncompiled(tmp_path: Path, caplog) -> None:
    """The CPU's packed int4 kernels are ctypes calls torch.compile cannot trace: the step
    says why once and runs as `compile=False` would, with the same logits."""
    path = make_tiny_gguf("llama", tmp_path / "q.gguf", seed=4, qtype="Q4_0", context=512).path
    model = Model.load(path, weights="int4")
    lanes = [Lanes(model, 16) for _ in range(2)]
    plain = DecodeGraphs(model, lanes[0].pool, 512)
    compiled = DecodeGraphs(model, lanes[1].pool, 512, compile=True)
    caches = [_prefilled(pool)[:2] for pool in lanes]
    tokens = [ids[-1] for ids in PROMPTS[:2]]
    for _ in range(2):
        for pool, each in zip(lanes, caches, strict=True):
            pool.step(each)
        want = plain.step(caches[0], torch.tensor(tokens))
        got = compiled.step(caches[1], torch.tensor(tokens))
        assert torch.equal(got, want)
        tokens = want.argmax(-1).tolist()
    assert not compiled.compile and compiled.compile_error
    assert sum("not compiled" in r.message for r in caplog.records) == 1


def test_verify_windows_equal_the_batched_forward(tiny: Path) -> None:
    """Windows of 5 and 2 tokens and a decode token (a bucket of 4 slots of 8 tokens: one
    slot and most tokens padding), then a truncate to drop a window's rejected tail, as a
    verify does: every fed token's logits equal the batched forward's, and the sequences'
    rows stay the forward's (the next steps agree)."""
    model = Model.load(tiny)
    ref_caches = _prefilled(Lanes(model, 16))
    lanes = Lanes(model, 16)
    caches = _prefilled(lanes)
    graphs = DecodeGraphs(model, lanes.pool, 512)
    for sizes in ([5, 2, 1], [1, 1, 1], [3, 4, 2]):
        windows = [[(7 * k + 3 * i) % 400 + 1 for i in range(n)] for k, n in enumerate(sizes)]
        starts = [c.pos for c in ref_caches]
        ref = forward_batch(model, [torch.tensor(w) for w in windows], ref_caches, starts)
        lanes.step(caches, sizes)
        got = graphs.step(caches, torch.tensor([t for w in windows for t in w]), sizes)
        ref = torch.cat(ref)
        assert got.shape == ref.shape
        assert float((got - ref).abs().max() / ref.abs().max()) < 1e-5
        for c, r, n in zip(caches, ref_caches, sizes, strict=True):  # keep half the window
            c.truncate(c.pos - n // 2)
            r.truncate(r.pos - n // 2)
    assert {key[1] for key in graphs.graphs} == {8, 1, 4}
