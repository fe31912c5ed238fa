"""The worker process end to end: a real `python -m luced.runtime.worker` subprocess on a
socketpair, real shared memory (the test plays the daemon), SmolLM2 against the
in-process Model / generate() as the oracle."""

from __future__ import annotations

import os
import secrets
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import msgpack
import numpy as np
import pytest
import torch
from worker_harness import TAG, THREADS, WorkerProc, no_segments_left  # noqa: F401 - fixture

from luced.ipc import codec
from luced.ipc import frames as F
from luced.ipc.channel import RemoteError
from luced.ipc.regions import Region, RegionAllocator, required_bytes
from luced.ipc.shm import SHM_DIR, Segment, ShmOwner
from luced.runtime import native
from luced.runtime.generate import generate
from luced.runtime.model import Model
from luced.runtime.sampler import Sampler
from luced.sampling_params import SamplingParams

pytestmark = pytest.mark.real_model

# "The capital of France is Paris. The capital of Germany is" in SmolLM2's vocabulary.
PROMPT = [504, 3575, 282, 4649, 314, 7042, 30, 378, 3575, 282, 4521, 314]
KV = 64  # the loaded worker's KV capacity (small: the overflow test fills it)
ROWS = 64  # token rows of the io regions
LOGIT_ROWS = 16
TOPK_COLS = 20
RING = 16
CAPTURE = (3, 17)


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("workers")


@pytest.fixture
def spawn(log_dir: Path) -> Iterator[object]:
    procs: list[WorkerProc] = []

    def start(**kw: str) -> WorkerProc:
        procs.append(WorkerProc(log_dir, **kw))
        return procs[-1]

    yield start
    for w in procs:
        w.stop()


@pytest.fixture(scope="module")
def ref(smollm2_gguf: Path) -> Model:
    return Model.load(smollm2_gguf)


class IO:
    """The daemon's io segment for one worker, regions as in the interfaces note."""

    def __init__(self, owner: ShmOwner, vocab: int, hidden: int) -> None:
        specs = {
            "tokens": ((ROWS,), "int32"),
            "ids": ((ROWS,), "int32"),
            "logprobs": ((ROWS,), "float32"),
            "topk_ids": ((ROWS, TOPK_COLS), "int32"),
            "topk_logprobs": ((ROWS, TOPK_COLS), "float32"),
            "logits": ((LOGIT_ROWS, vocab), "float32"),
            "hidden": ((ROWS, hidden), "float32"),
            "ring": ((RING, len(CAPTURE), hidden), "float32"),
        }
        self.seg: Segment = owner.create("io-cpu", required_bytes(specs.values()))
        alloc = RegionAllocator.for_segment(self.seg)
        self.r = {name: alloc.alloc(name, shape, dt) for name, (shape, dt) in specs.items()}

    def a(self, name: str) -> np.ndarray:
        return self.seg.array(self.r[name].offset, self.r[name].shape, self.r[name].dtype)

    def topk(self, name: str, k: int) -> Region:
        """A [ROWS, k] region over the first bytes of the [ROWS, 20] allocation."""
        r = self.r[name]
        return Region(r.segment, r.offset, (ROWS, k), r.dtype)


@pytest.fixture(scope="module")
def owner() -> Iterator[ShmOwner]:
    with ShmOwner(TAG + secrets.token_hex(2)) as o:
        yield o


@pytest.fixture(scope="module")
def io(owner: ShmOwner, ref: Model) -> IO:
    return IO(owner, ref.cfg.vocab, ref.cfg.hidden)


def load_req(path: Path, n_layers: int = 30, **kw: object) -> F.Load:
    fields: dict[str, object] = {
        "model": str(path),
        "layers": (0, n_layers),
        "dtype": "float32",
        "devices": ("cpu",),
        "kv_capacity": KV,
        "owns_embed": True,
        "owns_head": True,
    }
    fields.update(kw)
    return F.Load(**fields)


@pytest.fixture(scope="module")
def worker(log_dir: Path, owner: ShmOwner, smollm2_gguf: Path) -> Iterator[WorkerProc]:
    w = WorkerProc(log_dir)
    w.call(F.Hello(instance=owner.instance))
    w.call(load_req(smollm2_gguf))
    yield w
    w.stop()


def fwd(
    w: WorkerProc,
    io: IO,
    ids: list[int],
    start: int,
    want: str = "sample",
    positions: str = "last",
    sampling: dict | None = None,
    top_logprobs: int = 0,
    **kw: object,
) -> F.ForwardReply:
    io.a("tokens")[: len(ids)] = ids
    outputs = kw.pop("outputs", None)
    if outputs is None:
        if want == "logits":
            outputs = {"logits": io.r["logits"]}
        elif want == "hidden":
            outputs = {"hidden": io.r["hidden"]}
        else:
            outputs = {"ids": io.r["ids"]}
            if top_logprobs:
                outputs["logprobs"] = io.r["logprobs"]
                outputs["topk_ids"] = io.topk("topk_ids", top_logprobs)
                outputs["topk_logprobs"] = io.topk("topk_logprobs", top_logprobs)
    kw.setdefault("tokens", io.r["tokens"])
    rep = w.call(
        F.Forward(
            n_tokens=len(ids),
            start_pos=start,
            want=want,
            outputs=outputs,
            positions=positions,
            sampling=sampling or {},
            top_logprobs=top_logprobs,
            **kw,
        )
    )
    assert isinstance(rep, F.ForwardReply)
    return rep


def worker_generate(w: WorkerProc, io: IO, n: int, sampling: dict) -> list[int]:
    """Prefill PROMPT, then one frame per token, as the daemon's loop does."""
    rep = fwd(w, io, PROMPT, 0, sampling=sampling)
    assert (rep.n_out, rep.position) == (1, len(PROMPT))
    out = [int(io.a("ids")[0])]
    while len(out) < n:
        rep = fwd(w, io, out[-1:], len(PROMPT) + len(out) - 1, sampling=sampling)
        assert rep.position == len(PROMPT) + len(out)
        out.append(int(io.a("ids")[0]))
    return out


def position(w: WorkerProc) -> int:
    rep = w.call(F.Stats())
    assert isinstance(rep, F.StatsReply)
    return int(rep.stats["kv_position"])


# -- lifecycle ----------------------------------------------------------------------------


def test_handshake(spawn, owner: ShmOwner) -> None:
    w = spawn(group="cpu:1", devices="cpu:1,cpu")
    gpu = spawn(group="cuda", devices="cuda:0")  # this torch has no GPU: a clear error
    # A daemon of another build: the worker answers with both versions named.
    payload = {"op": "hello", "seq": 7, "instance": owner.instance, "protocol": 99}
    w.chan.send(msgpack.packb(payload))
    seq, rep = codec.decode_reply(w.chan.recv(), "hello")
    assert seq == 7 and isinstance(rep, F.ErrorReply)
    assert "protocol version mismatch" in rep.error and "99" in rep.error
    rep = w.call(F.Hello(instance=owner.instance))
    assert isinstance(rep, F.HelloReply)
    assert rep.protocol == F.PROTOCOL_VERSION
    assert rep.pid == w.pid
    assert (rep.group, rep.devices) == ("cpu:1", ("cpu:1", "cpu"))
    assert rep.versions["torch"] == torch.__version__
    assert rep.versions["python"] == ".".join(map(str, sys.version_info[:3]))
    with pytest.raises(RemoteError, match=r"device cuda:0: this torch is a CPU-only build"):
        gpu.call(F.Hello(instance=owner.instance))
    assert f"[worker cpu:1 {w.pid}] INFO" in w.log()


def test_errors_before_hello_and_load(spawn, owner: ShmOwner, io: IO) -> None:
    w = spawn()
    with pytest.raises(RemoteError, match="load before hello"):
        w.call(load_req(Path("/nonexistent.gguf")))
    w.call(F.Hello(instance=owner.instance))
    with pytest.raises(RemoteError, match="forward before load: no model is loaded"):
        fwd(w, io, PROMPT, 0)
    with pytest.raises(RemoteError, match="truncate before load"):
        w.call(F.Truncate(position=0))
    with pytest.raises(RemoteError, match=r"GGUFError: /nonexistent.gguf: cannot open"):
        w.call(load_req(Path("/nonexistent.gguf")))
    with pytest.raises(RemoteError, match="forward before load"):  # a failed load loads nothing
        fwd(w, io, PROMPT, 0)
    assert w.proc.poll() is None


def test_ignores_sigterm_and_sigint_ends_on_shutdown(spawn, owner: ShmOwner) -> None:
    w = spawn()
    w.call(F.Hello(instance=owner.instance))  # torch imported, serving: past startup
    os.kill(w.pid, signal.SIGTERM)
    os.kill(w.pid, signal.SIGINT)
    # Had either signal its default action, the worker would die before running any more
    # of its own code, so an answer now proves it survived both.
    assert isinstance(w.call(F.Stats()), F.StatsReply)
    time.sleep(0.2)
    assert w.proc.poll() is None
    assert isinstance(w.call(F.Shutdown()), F.ShutdownReply)
    assert w.proc.wait(timeout=5) == 0


def test_exits_when_daemon_end_closes_and_never_unlinks(
    spawn, owner: ShmOwner, io: IO, smollm2_gguf: Path
) -> None:
    w = spawn()
    w.call(F.Hello(instance=owner.instance))
    w.call(load_req(smollm2_gguf, kv_capacity=16))
    fwd(w, io, PROMPT[:4], 0)  # attaches the io segment
    t0 = time.monotonic()
    w.chan.close()  # the daemon is gone
    assert w.proc.wait(timeout=5) == 0
    print(f"worker exited {time.monotonic() - t0:.2f} s after the socket closed")
    assert (SHM_DIR / io.seg.name.lstrip("/")).exists()  # attachers never unlink


# -- forward parity -----------------------------------------------------------------------


def test_load_reply(worker: WorkerProc, ref: Model, smollm2_gguf: Path) -> None:
    rep = worker.call(load_req(smollm2_gguf))  # a reload replaces the model
    assert isinstance(rep, F.LoadReply)
    assert (rep.n_layers, rep.hidden, rep.vocab) == (30, 576, 49152)
    assert (rep.layers, rep.dtype, rep.kv_capacity) == ((0, 30), "float32", KV)
    assert 0 < rep.load_s < 30
    assert (ref.cfg.n_layers, ref.cfg.hidden, ref.cfg.vocab) == (30, 576, 49152)
    assert rep.kernels == native.describe(torch.device("cpu"))  # what runs its matrices


def test_greedy_loop_equals_in_process(worker: WorkerProc, io: IO, ref: Model) -> None:
    worker.call(F.Reset())
    got = worker_generate(worker, io, 16, {"temperature": 0})
    want = generate(ref, PROMPT, SamplingParams(temperature=0), 16).tokens
    assert got == want
    assert position(worker) == len(PROMPT) + 15


def test_seeded_sampling_reproducible_across_reset(worker: WorkerProc, io: IO, ref: Model) -> None:
    sampling = {"temperature": 1.0, "top_p": 0.95, "seed": 1234, "repetition_penalty": 1.2}
    worker.call(F.Reset())
    first = worker_generate(worker, io, 16, sampling)
    worker.call(F.Reset())
    second = worker_generate(worker, io, 16, sampling)
    assert first == second
    # The same stream as in-process: one generator across steps, history for the penalty.
    assert first == generate(ref, PROMPT, SamplingParams(**sampling), 16).tokens
    worker.call(F.Reset())
    other = worker_generate(worker, io, 16, {**sampling, "seed": 99})
    greedy = generate(ref, PROMPT, SamplingParams(temperature=0), 16).tokens
    assert other != first and first != greedy  # the sampling map really is applied


def test_logits_bitwise_equal_in_process(worker: WorkerProc, io: IO, ref: Model) -> None:
    worker.call(F.Reset())
    cache = ref.new_cache(KV)
    rep = fwd(worker, io, PROMPT, 0, want="logits", positions="all")
    assert rep.n_out == len(PROMPT)
    want = ref.forward(torch.tensor(PROMPT), cache, 0)
    got = torch.from_numpy(io.a("logits")[: len(PROMPT)].copy())
    assert got.dtype == want.dtype == torch.float32
    assert torch.equal(got, want)
    token = int(want[-1].argmax())
    rep = fwd(worker, io, [token], len(PROMPT), want="logits")
    assert (rep.n_out, rep.position) == (1, len(PROMPT) + 1)
    want = ref.forward(torch.tensor([token]), cache, len(PROMPT))
    assert torch.equal(torch.from_numpy(io.a("logits")[:1].copy()), want)


def test_truncate_then_continue_equals_in_process(worker: WorkerProc, io: IO, ref: Model) -> None:
    """KV and token history are both cut: penalties and logprobs see the cut history."""
    sampling = {"temperature": 0, "repetition_penalty": 1.3, "penalty_window": -1}
    k = 3
    params = SamplingParams(temperature=0, repetition_penalty=1.3, penalty_window=-1, logprobs=k)
    sampler, cache, history = Sampler(params), ref.new_cache(KV), list(PROMPT)

    def ours(tokens: list[int]) -> tuple[int, float, list[int], list[float]]:
        # The head over the last row only, as the worker does for positions="last" (the
        # head over all rows may differ in the last bits: another GEMM shape).
        h, _ = ref.forward_layers(
            ref.embed(torch.tensor(tokens)), cache, len(history) - len(tokens)
        )
        logits = ref.logits(h[-1:])
        out = sampler.sample(logits, [history])
        assert out.logprobs is not None and out.top_ids is not None
        assert out.top_logprobs is not None
        return (
            int(out.tokens[0]),
            float(out.logprobs[0]),
            out.top_ids[0].tolist(),
            out.top_logprobs[0].tolist(),
        )

    def theirs(tokens: list[int], start: int) -> tuple[int, float, list[int], list[float]]:
        fwd(worker, io, tokens, start, sampling=sampling, top_logprobs=k)
        return (
            int(io.a("ids")[0]),
            float(io.a("logprobs")[0]),
            io.a("topk_ids")[0, :k].tolist(),  # first k of 20 columns hold [0, k) of row 0
            io.a("topk_logprobs")[0, :k].tolist(),
        )

    worker.call(F.Reset())
    got, want = [theirs(PROMPT, 0)], [ours(PROMPT)]
    for _ in range(6):
        history.append(want[-1][0])
        want.append(ours(history[-1:]))
        got.append(theirs([got[-1][0]], len(history) - 1))
    cut = len(PROMPT) + 2
    rep = worker.call(F.Truncate(position=cut))
    assert rep == F.TruncateReply(position=cut)
    cache.truncate(cut)
    del history[cut:]
    history.append(1000)  # a different token at the cut: the continuation must change
    want.append(ours([1000]))
    got.append(theirs([1000], cut))
    for _ in range(6):
        history.append(want[-1][0])
        want.append(ours(history[-1:]))
        got.append(theirs([got[-1][0]], len(history) - 1))
    # topk rows are read with a [ROWS, k] region: rows are k wide, row 0 = first k values.
    assert got == want
    assert position(worker) == len(history)


def test_positions_all_samples_every_row(worker: WorkerProc, io: IO, ref: Model) -> None:
    worker.call(F.Reset())
    fwd(worker, io, PROMPT, 0, positions="all", sampling={"temperature": 0})
    want = ref.forward(torch.tensor(PROMPT), ref.new_cache(KV), 0).argmax(-1)
    assert io.a("ids")[: len(PROMPT)].tolist() == want.tolist()


def test_capture_ring_slots(worker: WorkerProc, io: IO, ref: Model) -> None:
    worker.call(F.Reset())
    io.a("ring")[:] = np.nan
    cache = ref.new_cache(KV)
    seq = list(PROMPT)
    ring = {"capture": CAPTURE, "ring": io.r["ring"]}
    fwd(worker, io, PROMPT, 0, want="logits", positions="all", **ring)
    want: dict[int, torch.Tensor] = {}  # position -> [len(CAPTURE), hidden]

    def ours(tokens: list[int], start: int) -> int:
        h, caps = ref.forward_layers(ref.embed(torch.tensor(tokens)), cache, start, CAPTURE)
        for i in range(len(tokens)):
            want[start + i] = torch.stack([caps[layer][i] for layer in CAPTURE])
        return int(ref.logits(h[-1:]).argmax())

    nxt = ours(PROMPT, 0)
    while len(seq) < RING + 2:  # past the ring's end: slots wrap to 0, 1
        seq.append(nxt)
        fwd(worker, io, [nxt], len(seq) - 1, want="logits", **ring)
        nxt = ours([nxt], len(seq) - 1)
    got = torch.from_numpy(io.a("ring").copy())
    for p in range(len(seq) - RING, len(seq)):
        assert torch.equal(got[p % RING], want[p]), p


def test_topk_without_sampling(worker: WorkerProc, io: IO, ref: Model) -> None:
    worker.call(F.Reset())
    outputs = {
        "topk_ids": io.topk("topk_ids", 5),
        "topk_logprobs": io.topk("topk_logprobs", 5),
    }
    fwd(worker, io, PROMPT, 0, want="topk", top_logprobs=5, outputs=outputs)
    logits = ref.forward(torch.tensor(PROMPT), ref.new_cache(KV), 0)[-1]
    vals, ids = torch.log_softmax(logits, -1).topk(5)
    assert io.a("topk_ids")[0, :5].tolist() == ids.tolist()
    assert np.allclose(io.a("topk_logprobs")[0, :5], vals.numpy(), atol=1e-5)


def test_stats_counts(worker: WorkerProc, io: IO, smollm2_gguf: Path) -> None:
    worker.call(F.Reset())
    before = worker.call(F.Stats()).stats
    fwd(worker, io, PROMPT, 0, sampling={"temperature": 0})
    fwd(worker, io, [int(io.a("ids")[0])], len(PROMPT), sampling={"temperature": 0})
    s = worker.call(F.Stats()).stats
    assert s["forward_count"] == before["forward_count"] + 2
    assert s["tokens_processed"] == before["tokens_processed"] + len(PROMPT) + 1
    assert s["kv_position"] == len(PROMPT) + 1 and s["kv_capacity"] == KV
    assert s["kv_bytes"] == 30 * 2 * 3 * 64 * KV * 4  # layers, K+V, kv heads, head dim, fp32
    assert s["model"] == str(smollm2_gguf) and s["pid"] == worker.pid
    assert s["kernels"] == native.describe(torch.device("cpu"))
    assert 100e6 < s["rss_bytes"] < 4e9


def test_error_replies_leave_the_worker_serving(
    worker: WorkerProc, io: IO, owner: ShmOwner
) -> None:
    worker.call(F.Reset())
    fwd(worker, io, PROMPT, 0, sampling={"temperature": 0})
    n = len(PROMPT)

    def fails(match: str, ids: list[int] = PROMPT[:1], start: int = n, **kw: object) -> None:
        with pytest.raises(RemoteError, match=match):
            fwd(worker, io, ids, start, **kw)
        assert position(worker) == n  # nothing of a failed request stays in the KV

    seg = io.seg.name
    fails("does not exist", tokens=Region(f"/luced-{owner.instance}-nope", 64, (ROWS,), "int32"))
    fails("outside the data area", tokens=Region(seg, io.seg.size - 64, (ROWS,), "int32"))
    fails("does not belong to daemon instance", tokens=Region("/luced-zz-io", 64, (8,), "int32"))
    bad_logits = Region(seg, io.r["logits"].offset, (LOGIT_ROWS, 1000), "float32")
    fails("must have 49152 columns", want="logits", outputs={"logits": bad_logits})
    fails(r"token ids must lie in \[0, 49152\)", ids=[49152])
    fails("start_pos 3, but the KV holds 12 positions", start=3)
    # A sampling map SamplingParams refuses is refused by the frame itself, at either end.
    with pytest.raises(F.FrameError, match="temperature must be >= 0"):
        fwd(worker, io, PROMPT[:1], n, sampling={"temperature": -1.0})
    fails("hidden_in", hidden_in=io.r["hidden"], tokens=None)
    with pytest.raises(RemoteError, match="cannot truncate to 13: the KV holds 12"):
        worker.call(F.Truncate(position=13))
    # Overflow: KV holds 64; 12 + 40 fit, 12 more do not.
    fwd(worker, io, (PROMPT * 4)[:40], n, sampling={"temperature": 0})
    n += 40
    with pytest.raises(RemoteError, match=r"context overflow: positions \[52, 65\) exceed"):
        fwd(worker, io, [*PROMPT, 1], n)
    assert position(worker) == n
    fwd(worker, io, PROMPT, n, sampling={"temperature": 0})  # exactly full still works
    assert position(worker) == KV
    assert worker.proc.poll() is None


# -- layer range (the split itself is a later issue; the worker side is ready) ----------


def test_layer_range_and_device_split_equal_whole(
    spawn, owner: ShmOwner, io: IO, ref: Model, smollm2_gguf: Path
) -> None:
    """Worker A: layers [0, 12); worker B: [12, 30) as two shards cut at 20 in one process.
    Hidden states cross A -> B in shared memory; logits equal the whole model bitwise."""
    a, b = spawn(group="cpu:0"), spawn(group="cpu:1", devices="cpu:1,cpu:2")
    for w in (a, b):
        w.call(F.Hello(instance=owner.instance))
    a.call(load_req(smollm2_gguf, layers=(0, 12), owns_head=False))
    rep = b.call(
        load_req(
            smollm2_gguf,
            layers=(12, 30),
            owns_embed=False,
            devices=("cpu:1", "cpu:2"),
            device_splits=(20,),
        )
    )
    assert rep.layers == (12, 30) and rep.n_layers == 30
    with pytest.raises(RemoteError, match="needs the LM head"):
        fwd(a, io, PROMPT, 0, want="logits")
    cache = ref.new_cache(KV)
    want = ref.forward(torch.tensor(PROMPT), cache, 0)
    fwd(a, io, PROMPT, 0, want="hidden")
    io.a("tokens")[:] = -1  # B must not read token ids
    fwd(b, io, PROMPT, 0, want="logits", positions="all", tokens=None, hidden_in=io.r["hidden"])
    assert torch.equal(torch.from_numpy(io.a("logits")[: len(PROMPT)].copy()), want)
    token = int(want[-1].argmax())
    want = ref.forward(torch.tensor([token]), cache, len(PROMPT))
    fwd(a, io, [token], len(PROMPT), want="hidden")
    fwd(b, io, [token], len(PROMPT), want="logits", tokens=None, hidden_in=io.r["hidden"])
    assert torch.equal(torch.from_numpy(io.a("logits")[:1].copy()), want)
