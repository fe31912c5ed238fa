"""The worker's KV snapshot verbs (kv_layout / kv_export / kv_import) on an in-process Backend.

The test plays the daemon: it owns the shared memory (an io segment for forwards, snapshot
segments carved from the layout like the arena would) and sends frames to ``Backend.handle``.
Oracle: the same Backend's own computation. A restored prefix continues exactly like the run
it was exported from (bitwise on CPU, float32 and bfloat16), and like a fresh prefill of the
same tokens; a rejected request leaves KV, token history and sampler untouched.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from worker_harness import TAG, forward_frame, no_segments_left  # noqa: F401 - fixture

from luced.ipc import frames as F
from luced.ipc.regions import Region, RegionAllocator, required_bytes
from luced.ipc.shm import SegmentNotFoundError, ShmOwner
from luced.ipc.typed import FrameError
from luced.runtime.backend import Backend
from luced.runtime.kv_cache import ContextOverflow, KVCache
from luced.runtime.model import Model
from luced.runtime.state import SequenceState, WorkerError
from luced.runtime.tiny import make_tiny_gguf

KV = 64
ROWS = 32
PROMPT = [3, 17, 5, 42, 8, 99, 23, 4, 61, 7, 12, 90]
N = len(PROMPT)
SAMPLED = {"temperature": 0.9, "seed": 11, "repetition_penalty": 1.5}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """llama with 4 layers; gemma3 with its 6 (sliding-window and global layers); laguna (MoE,
    per-layer query heads, sliding windows); gemma4 with its 6, of two shapes, layers 3 and 4
    sharing the KV of 1, layer 5 that of 2."""
    d = tmp_path_factory.mktemp("kvsnap")
    make_tiny_gguf("llama", d / "llama.gguf", seed=3, layers=4)
    make_tiny_gguf("gemma3", d / "gemma3.gguf", seed=3)
    make_tiny_gguf("laguna", d / "laguna.gguf", seed=3)
    make_tiny_gguf("gemma4", d / "gemma4.gguf", seed=3)
    return {f: d / f"{f}.gguf" for f in ("llama", "gemma3", "laguna", "gemma4")}


@pytest.fixture
def owner() -> Iterator[ShmOwner]:
    with ShmOwner(TAG + secrets.token_hex(2)) as o:
        yield o


class Snapshot:
    """Regions for every tensor of a layout, `rows` positions long (a recurrent state
    `slots` cut points), in a fresh segment."""

    def __init__(self, owner: ShmOwner, layout: F.KVLayoutReply, rows: int, slots: int = 1) -> None:
        specs = {name: ((h, rows, d), layout.dtype) for name, h, d in layout.tensors}
        specs.update((name, ((slots, *shape), dt)) for name, shape, dt in layout.states)
        self.states = {name for name, _, _ in layout.states}
        specs["tokens"] = ((rows,), "int32")
        self.seg = owner.create(f"snap-{secrets.token_hex(3)}", required_bytes(specs.values()))
        alloc = RegionAllocator.for_segment(self.seg)
        self.all = {name: alloc.alloc(name, shape, dt) for name, (shape, dt) in specs.items()}
        self.regions = {k: r for k, r in self.all.items() if k != "tokens"}
        self.tokens = self.all["tokens"]

    def slot(self, i: int) -> dict[str, Region]:
        """The regions with each state narrowed to slot i (what an import reads)."""
        return {k: r.rows(i, i + 1) if k in self.states else r for k, r in self.regions.items()}

    def a(self, name: str) -> np.ndarray:
        r = self.all[name]
        return self.seg.array(r.offset, r.shape, F_DTYPES[r.dtype])

    def torch(self, name: str) -> torch.Tensor:
        t = torch.from_numpy(self.a(name))
        return t.view(torch.bfloat16) if self.all[name].dtype == "bfloat16" else t


F_DTYPES = {"float32": np.float32, "bfloat16": np.uint16, "float16": np.float16, "int32": np.int32}


class Daemon:
    """One in-process Backend with a loaded tiny model, and the daemon's io regions."""

    def __init__(
        self,
        owner: ShmOwner,
        path: Path,
        dtype: str = "float32",
        devices: tuple[str, ...] = ("cpu",),
    ) -> None:
        self.owner = owner
        cfg = Model.load(path, layers=(0, 1)).cfg
        self.n_layers, self.vocab = cfg.n_layers, cfg.vocab
        self.backend = Backend("cpu", ("cpu",))
        self.call(F.Hello(instance=owner.instance))
        splits = tuple(range(1, len(devices)))  # one layer per extra shard at the front
        self.call(
            F.Load(
                model=str(path),
                layers=(0, cfg.n_layers),
                dtype=dtype,  # type: ignore[arg-type]
                devices=devices,
                kv_capacity=KV,
                owns_embed=True,
                owns_head=True,
                device_splits=splits,
            )
        )
        specs = {"tokens": ((ROWS,), "int32"), "ids": ((ROWS,), "int32")}
        specs["logits"] = ((ROWS, cfg.vocab), "float32")
        self.io = owner.create(f"io-{secrets.token_hex(3)}", required_bytes(specs.values()))
        alloc = RegionAllocator.for_segment(self.io)
        self.r = {name: alloc.alloc(name, shape, dt) for name, (shape, dt) in specs.items()}

    def call(self, req: F.Request) -> F.Reply:
        return self.backend.handle(req)

    @property
    def m(self) -> SequenceState:
        """Sequence 0, which every frame here acts on."""
        assert self.backend.loaded is not None
        return self.backend.loaded.sequence(0)

    def _io(self, name: str) -> np.ndarray:
        r = self.r[name]
        return self.io.array(r.offset, r.shape, F_DTYPES[r.dtype])

    def feed(self, ids: list[int], keep_state: bool = False) -> np.ndarray:
        """Feed ids at the current position; a copy of every position's logits."""
        n = len(ids)
        self._io("tokens")[:n] = ids
        self.call(
            forward_frame(
                n,
                self.m.position,
                "logits",
                {"logits": self.r["logits"].rows(0, n)},
                "all",
                tokens=self.r["tokens"].rows(0, n),
                keep_state=keep_state,
            )
        )
        return self._io("logits")[:n].copy()

    def sample(self, token: int, sampling: dict) -> int:
        self._io("tokens")[0] = token
        self.call(
            forward_frame(
                1,
                self.m.position,
                "sample",
                {"ids": self.r["ids"].rows(0, 1)},
                sampling=sampling,
                tokens=self.r["tokens"].rows(0, 1),
            )
        )
        return int(self._io("ids")[0])

    def greedy(self, token: int, steps: int) -> tuple[list[int], np.ndarray]:
        """Feed token, then each argmax, one at a time: (tokens fed, their logits)."""
        fed, rows = [], []
        for _ in range(steps):
            logits = self.feed([token])[0]
            fed.append(token)
            rows.append(logits)
            token = int(logits.argmax())
        return fed, np.stack(rows)

    def layout(self) -> F.KVLayoutReply:
        reply = self.call(F.KVLayout())
        assert isinstance(reply, F.KVLayoutReply)
        return reply

    def snapshot(self, rows: int, slots: int = 1) -> Snapshot:
        return Snapshot(self.owner, self.layout(), rows, slots)

    def export(
        self, n: int, snap: Snapshot, cuts: tuple[int, ...] = (), **override: Region
    ) -> F.KVExportReply:
        regions = {**snap.regions, **override}
        reply = self.call(F.KVExport(position=n, regions=regions, cuts=cuts))
        assert isinstance(reply, F.KVExportReply)
        return reply

    def import_(
        self, n: int, snap: Snapshot, tokens: list[int] | None = None, slot: int = 0
    ) -> int:
        if tokens is not None:
            snap.a("tokens")[: len(tokens)] = tokens
        frame = F.KVImport(position=n, regions=snap.slot(slot), tokens=snap.tokens)
        reply = self.call(frame)
        assert isinstance(reply, F.KVImportReply)
        return reply.position

    def state(self) -> tuple:
        """Everything an import may change: position, history, sampler, committed K/V."""
        m = self.m
        kv = [
            (c.k[layer][:, : m.position].clone(), c.v[layer][:, : m.position].clone())
            for c in m.caches
            for layer in c.stored
        ]
        return m.position, list(m.tokens), m.sampler, m.sampling, kv

    def same_state(self, before: tuple) -> bool:
        now = self.state()
        kv_same = all(
            torch.equal(a, b) and torch.equal(c, d)
            for (a, c), (b, d) in zip(before[4], now[4], strict=True)
        )
        return before[:2] == now[:2] and before[2] is now[2] and before[3] == now[3] and kv_same


def cache_rows(d: Daemon, name: str, n: int) -> torch.Tensor:
    kind, layer = name.split(".")
    for cache in d.m.caches:
        if int(layer) in cache.layers:
            store = cache.k if kind == "k" else cache.v
            return store[int(layer)][:, :n]
    raise AssertionError(name)


# -- layout ---------------------------------------------------------------------------------


@pytest.mark.parametrize("devices", [("cpu",), ("cpu", "cpu")])
def test_layout_lists_every_layer_in_order(owner: ShmOwner, tiny, devices) -> None:
    for family, (heads, dim) in (("llama", (2, 16)), ("gemma3", (1, 32))):
        d = Daemon(owner, tiny[family], devices=devices)
        layout = d.layout()
        names = [f"{kind}.{i}" for i in range(d.n_layers) for kind in "kv"]
        assert [t[0] for t in layout.tensors] == names
        assert {t[1:] for t in layout.tensors} == {(heads, dim)}
        assert layout.dtype == "float32"
    d = Daemon(owner, tiny["gemma4"], devices=devices)
    # Layers 3 to 5 read the KV of 1 and 2: no tensors of their own, nothing exported twice.
    shapes = {0: (2, 16), 1: (2, 16), 2: (1, 32)}
    assert d.layout().tensors == tuple(
        (f"{kind}.{i}", *shape) for i, shape in shapes.items() for kind in "kv"
    )


# -- restore == fresh -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("family", "devices"),
    [
        ("llama", ("cpu",)),
        ("llama", ("cpu", "cpu")),
        ("gemma3", ("cpu",)),
        ("laguna", ("cpu", "cpu")),
        ("gemma4", ("cpu", "cpu")),  # shards [0, 1) and [1, 6): the second embeds for its PLE
    ],
)
def test_restore_continues_like_the_fresh_prefill(owner: ShmOwner, tiny, family, devices) -> None:
    d = Daemon(owner, tiny[family], devices=devices)
    first = int(d.feed(PROMPT)[-1].argmax())
    snap = d.snapshot(N + 4)  # longer than the snapshot: rows past N stay untouched
    for name in snap.regions:
        snap.a(name)[:] = 7.0
    reply = d.export(N, snap)
    assert reply.position == N
    for name in snap.regions:
        assert torch.equal(snap.torch(name)[:, :N], cache_rows(d, name, N))
        assert (snap.a(name)[:, N:] == 7.0).all()
    fresh = d.greedy(first, 6)  # this state *is* a fresh prefill of PROMPT

    d.feed([100, 101, 102])  # the worker holds something else (and stale rows) now
    assert d.import_(N, snap, PROMPT) == N
    assert d.m.position == N and d.m.tokens == PROMPT
    restored = d.greedy(first, 6)
    assert restored[0] == fresh[0]
    assert np.array_equal(restored[1], fresh[1])  # bitwise: the same rows, the same math


def test_restore_a_shorter_prefix(owner: ShmOwner, tiny) -> None:
    d = Daemon(owner, tiny["llama"])
    m = 5
    d.feed(PROMPT)
    snap = d.snapshot(N)
    d.export(N, snap)

    # Oracle 1 (bitwise): the very same rows, reached by truncating the long prefill.
    d.call(F.Truncate(position=m))
    want = d.greedy(PROMPT[m], 6)
    # Oracle 2: a fresh prefill of the first m tokens (rows computed in a batch of m
    # rather than N may differ in the last bits: close, same tokens).
    d.call(F.Reset())
    d.feed(PROMPT[:m])
    fresh = d.greedy(PROMPT[m], 6)

    d.call(F.Reset())
    assert d.import_(m, snap, PROMPT) == m
    assert d.m.tokens == PROMPT[:m]
    got = d.greedy(PROMPT[m], 6)
    assert got[0] == want[0] == fresh[0]
    assert np.array_equal(got[1], want[1])
    np.testing.assert_allclose(got[1], fresh[1], rtol=1e-5, atol=1e-5)


def test_bfloat16_round_trip(owner: ShmOwner, tiny) -> None:
    d = Daemon(owner, tiny["llama"], dtype="bfloat16", devices=("cpu", "cpu"))
    layout = d.layout()
    assert layout.dtype == "bfloat16"
    first = int(d.feed(PROMPT)[-1].argmax())
    snap = d.snapshot(N)
    assert snap.a("k.0").dtype == np.uint16  # the daemon sees raw bits
    d.export(N, snap)
    for name in snap.regions:
        assert torch.equal(snap.torch(name), cache_rows(d, name, N))
    fresh = d.greedy(first, 6)
    d.call(F.Reset())
    d.import_(N, snap, PROMPT)
    restored = d.greedy(first, 6)
    assert restored[0] == fresh[0]
    assert np.array_equal(restored[1], fresh[1])


def test_import_restores_history_and_drops_the_sampler(owner: ShmOwner, tiny) -> None:
    """Penalties read the restored history; a seeded sampler starts over as after reset."""
    d = Daemon(owner, tiny["llama"])
    first = int(d.feed(PROMPT)[-1].argmax())
    snap = d.snapshot(N)
    d.export(N, snap)
    want, token = [], first
    for _ in range(10):
        token = d.sample(token, SAMPLED)
        want.append(token)
    # The kept sampler's generator has advanced; the history holds 10 more ids.
    d.import_(N, snap, PROMPT)
    assert d.m.sampler is None and d.m.tokens == PROMPT
    got, token = [], first
    for _ in range(10):
        token = d.sample(token, SAMPLED)
        got.append(token)
    assert got == want


# -- rejected requests change nothing -------------------------------------------------------


def test_rejected_requests_change_nothing(owner: ShmOwner, tiny) -> None:
    d = Daemon(owner, tiny["llama"], devices=("cpu", "cpu"))
    first = int(d.feed(PROMPT)[-1].argmax())
    d.sample(first, SAMPLED)  # a kept sampler, and history N + 1
    n = d.m.position
    snap = d.snapshot(KV + 2)
    d.export(n, snap)
    for name in snap.regions:
        snap.a(name)[:] = 3.0
    before = d.state()
    k3 = snap.regions["k.3"]
    junk = owner.create("junk", 16384)  # misshaped regions live here: no overlaps

    def bad(shape: tuple[int, ...], dtype: str = "float32") -> Region:
        return Region(junk.name, 64, shape, dtype)

    def rejected_import(match: str, n: int = n, exc: type = WorkerError, **edit) -> None:
        regions = {**snap.regions, **{k.replace("_", "."): r for k, r in edit.items()}}
        regions = {k: r for k, r in regions.items() if r is not None}
        with pytest.raises(exc, match=match):
            d.call(F.KVImport(position=n, regions=regions, tokens=snap.tokens))
        assert d.same_state(before)

    rejected_import(r"missing \['v.3'\], unknown \[\]", v_3=None)
    rejected_import(r"missing \[\], unknown \['k.9'\]", k_9=k3)
    shape = r"must be float32 \[2, >= 13, 16\], got float32 \[3, 20, 16\]"
    rejected_import(rf"region k.3 {shape}", k_3=bad((3, 20, 16)))
    rejected_import(r"region v.0 must be float32 .*float16", v_0=bad((2, 20, 16), "float16"))
    foreign = Region("/luced-zzzz-arena", k3.offset, k3.shape, "float32")
    rejected_import("does not belong to daemon instance", k_3=foreign)
    absent = Region(f"/luced-{owner.instance}-absent", k3.offset, k3.shape, "float32")
    rejected_import("does not exist", exc=SegmentNotFoundError, k_3=absent)
    rejected_import("exceeds the KV capacity of 64", n=KV + 1, exc=ContextOverflow)
    snap.a("tokens")[:n] = d.vocab  # out of the vocabulary
    rejected_import(r"token ids must lie in \[0, 512\)")

    # A rejected export writes nothing either (the regions keep their 3.0).
    with pytest.raises(WorkerError, match=f"kv_export of {n + 1} positions, but the KV holds"):
        d.export(n + 1, snap)
    without_k0 = {k: r for k, r in snap.regions.items() if k != "k.0"}
    with pytest.raises(WorkerError, match=r"missing \['k.0'\]"):
        d.call(F.KVExport(position=n, regions=without_k0))
    with pytest.raises(WorkerError, match=r"region v\.2 must be"):
        d.export(n, snap, **{"v.2": bad((2, 20, 8))})
    assert all((snap.a(name) == 3.0).all() for name in snap.regions)
    assert d.same_state(before)

    # Frames refuse what they can judge alone.
    with pytest.raises(FrameError, match="overlap"):
        F.KVExport(position=n, regions={**snap.regions, "v.3": k3})
    with pytest.raises(FrameError, match=r"must be float \[n_kv_heads, >= 14, head_dim\]"):
        F.KVExport(position=14, regions={"k.0": bad((2, 13, 16))})
    with pytest.raises(FrameError, match="is not"):
        F.KVExport(position=1, regions={"q.0": k3})
    with pytest.raises(FrameError, match=r"tokens must be int32 \[>= 11\], got int32 \[10\]"):
        F.KVImport(position=11, regions={"k.0": k3}, tokens=bad((10,), "int32"))


def test_before_load(owner: ShmOwner) -> None:
    b = Backend("cpu", ("cpu",))
    b.handle(F.Hello(instance=owner.instance))
    with pytest.raises(WorkerError, match="kv_layout before load"):
        b.handle(F.KVLayout())


@pytest.mark.parametrize("devices", [("cpu",), ("cpu", "cpu")])
def test_recurrent_states_restore_at_each_cut(owner: ShmOwner, tmp_path: Path, devices) -> None:
    """A qwen35 (DeltaNet layers 0-2, attention layer 3): the snapshot carries each DeltaNet
    layer's conv window and delta matrix at each cut point, slot by slot: the prompt's end
    and a position where a forward stopped with keep_state. Restoring either == the fresh
    prefill of that prefix, bitwise. A state exists only where it was kept: exporting any
    other cut is refused, with nothing written."""
    path = make_tiny_gguf("qwen35", tmp_path / "q.gguf", seed=3).path
    d = Daemon(owner, path, devices=devices)
    layout = d.layout()
    assert [t[0] for t in layout.tensors] == ["k.3", "v.3"]
    assert [(name, dt) for name, _, dt in layout.states] == [
        (f"{kind}.{i}", dt)
        for i in range(3)
        for kind, dt in (("conv", "float32"), ("delta", "float32"))
    ]
    c = 5
    first_c = int(d.feed(PROMPT[:c], keep_state=True)[-1].argmax())
    fresh_c = d.greedy(first_c, 6)
    d.call(F.Reset())
    d.feed(PROMPT[:c], keep_state=True)
    first = int(d.feed(PROMPT[c:])[-1].argmax())
    snap = d.snapshot(N, slots=2)
    with pytest.raises(WorkerError, match=f"recurrent state is held at {N} only"):
        d.export(N - 1, snap, (c, N - 1))
    for name in snap.states:
        snap.a(name)[:] = 7.0
    with pytest.raises(WorkerError, match="no recurrent state kept at position 4"):
        d.export(N, snap, (4, N))
    assert all((snap.a(name) == 7.0).all() for name in snap.states)  # nothing written
    d.export(N, snap, (c, N))
    fresh = d.greedy(first, 6)

    d.feed([100, 101, 102])
    assert d.import_(N, snap, PROMPT, slot=1) == N
    restored = d.greedy(first, 6)
    assert restored[0] == fresh[0]
    assert np.array_equal(restored[1], fresh[1])
    assert d.import_(c, snap, PROMPT, slot=0) == c  # the turn-boundary cut, same entry
    restored_c = d.greedy(first_c, 6)
    assert restored_c[0] == fresh_c[0]
    assert np.array_equal(restored_c[1], fresh_c[1])

    # The restored cut is kept: a snapshot taken after more tokens names it again.
    d.import_(c, snap, PROMPT, slot=0)
    d.feed(PROMPT[c:])
    again = d.snapshot(N, slots=2)
    d.export(N, again, (c, N))
    for name in snap.states:
        assert np.array_equal(again.a(name), snap.a(name))


# -- KVCache helpers ------------------------------------------------------------------------


def test_cache_import_rows_grows_and_checks(tiny) -> None:
    model = Model.load(tiny["llama"])
    src = model.new_cache(KV)
    model.forward(torch.tensor(PROMPT), src, 0)
    small = KVCache(model.layers, 2, 16, capacity=KV, dtype=torch.float32, initial=4)
    model.forward(torch.tensor([1, 2]), small, 0)
    rows = {layer: (src.k[layer], src.v[layer]) for layer in model.layers}
    with pytest.raises(ValueError, match="import needs layers"):
        small.import_rows(N, {0: rows[0]})
    with pytest.raises(ValueError, match=r"layer 1: rows must be \[2, >= 13, 16\]"):
        small.import_rows(N + 1, {**rows, 1: (src.k[1][:, :N], src.v[1])})
    assert small.pos == 2
    small.import_rows(N, rows)  # grows from 4 rows, keeps none of the old ones
    assert small.pos == N
    for layer in model.layers:
        assert torch.equal(small.k[layer][:, :N], src.k[layer][:, :N])
        assert torch.equal(small.v[layer][:, :N], src.v[layer][:, :N])
    out = torch.full((2, N + 3, 16), 5.0)
    out_v = out.clone()
    small.export_rows(2, N, out, out_v)
    assert torch.equal(out[:, :N], src.k[2][:, :N]) and (out[:, N:] == 5.0).all()
    with pytest.raises(ValueError, match="cannot export 13 rows"):
        small.export_rows(2, N + 1, out, out_v)
