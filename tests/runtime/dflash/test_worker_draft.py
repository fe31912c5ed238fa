"""The worker's draft verbs end to end: real worker subprocesses, real shared memory (the test
plays the daemon), a tiny target and a tiny random draft. Oracle: the same draft in this
process (`Draft.forward` + `project_with_target_head`) on the features read back from the
ring the target workers filled through real `forward` frames with captures."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from worker_harness import (  # noqa: F401 - no_segments_left is a module fixture
    TAG,
    Regions,
    WorkerProc,
    forward_frame,
    no_segments_left,
)

from luced.ipc import frames as F
from luced.ipc.channel import RemoteError
from luced.ipc.regions import Region
from luced.ipc.shm import ShmOwner
from luced.runtime.dflash.draft import Draft, project_with_target_head
from luced.runtime.dflash.verbs import draft_seed
from luced.runtime.dflash.writer import DraftSpec, random_weights, write_gguf
from luced.runtime.model import Model
from luced.runtime.sampler import Sampler, probs
from luced.runtime.tiny import make_tiny_draft, make_tiny_gguf
from luced.sampling_params import SamplingParams

KV = 64
RING = 8  # small: 13 fed positions wrap it
BLOCK = 5
PROMPT = [3, 17, 5, 42, 8, 99, 23, 4, 61, 7]
MORE = [11, 12, 13]  # fed one by one after the prompt: committed = 13
SAMPLING = {"temperature": 0.8, "top_k": 40, "seed": 5}


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("draft")
    target = d / "qwen3.gguf"  # untied: the edges loader reads both embedding and head
    make_tiny_gguf("qwen3", target, seed=4, layers=4)
    _, gguf_draft, st_draft = make_tiny_draft(
        target, d / "ok", seed=1, block_size=BLOCK, captures=2, capture_layers=(1, 3)
    )
    # A draft for a target of another width: load_draft must refuse it.
    spec = DraftSpec(hidden=32, target_layers=4, vocab_size=300, captures=2)
    wrong = write_gguf(spec, random_weights(spec), d / "wrong.gguf")
    return {"target": target, "gguf": gguf_draft, "st": st_draft, "wrong": wrong}


@pytest.fixture(scope="module")
def ref(files: dict[str, Path]) -> Model:
    return Model.load(files["target"])


@pytest.fixture(scope="module")
def draft(files: dict[str, Path], ref: Model) -> Draft:
    return Draft.load(files["gguf"], target_hidden=ref.cfg.hidden, target_n_layers=4)


class IO(Regions):
    def __init__(self, owner: ShmOwner, draft: Draft, vocab: int) -> None:
        hidden, n_cap = draft.cfg.hidden, len(draft.capture_layers)
        specs = {
            "tokens": ((32,), "int32"),
            "logits": ((32, vocab), "float32"),
            "ring": ((RING, n_cap, hidden), "float32"),
            "bad_ring": ((RING, n_cap + 1, hidden), "float32"),
            "ids": ((BLOCK,), "int32"),
            "probs": ((BLOCK - 1, vocab), "float32"),
        }
        super().__init__(owner, "io-draft", specs)


@pytest.fixture(scope="module")
def owner() -> Iterator[ShmOwner]:
    with ShmOwner(TAG + "d0") as o:
        yield o


@pytest.fixture(scope="module")
def io(owner: ShmOwner, draft: Draft, ref: Model) -> IO:
    return IO(owner, draft, ref.cfg.vocab)


@pytest.fixture(scope="module")
def target_worker(
    tmp_path_factory: pytest.TempPathFactory, owner: ShmOwner, files: dict[str, Path], io: IO
) -> Iterator[WorkerProc]:
    """The whole target in one worker, the ring filled with positions [0, 13)."""
    w = WorkerProc(tmp_path_factory.mktemp("logs"))
    try:
        w.call(F.Hello(instance=owner.instance))
        load = F.Load(str(files["target"]), (0, 4), "float32", ("cpu",), KV, True, True)
        w.call(load)
        io.a("ring")[:] = np.nan  # every slot the draft reads must have been written
        pos = 0
        # Chunks of at most RING positions (a forward may not lap the ring).
        for chunk in [PROMPT[:6], PROMPT[6:], *([t] for t in MORE)]:
            io.a("tokens")[: len(chunk)] = chunk
            w.call(
                forward_frame(
                    len(chunk),
                    pos,
                    "logits",
                    {"logits": io.r["logits"]},
                    tokens=io.r["tokens"],
                    capture=(1, 3),  # the tiny draft's capture layers (checked below)
                    ring=io.r["ring"],
                )
            )
            pos += len(chunk)
        yield w
    finally:
        w.stop()


def draft_req(io: IO, committed: int = 13, **kw: object) -> F.DraftBlock:
    fields: dict[str, object] = {
        "ring": io.r["ring"],
        "committed": committed,
        "anchor": 29,
        "outputs": {"ids": io.r["ids"]},
    }
    fields.update(kw)
    return F.DraftBlock(**fields)  # type: ignore[arg-type]


def expected_logits(io: IO, ref: Model, draft: Draft, committed: int, ctx: int) -> torch.Tensor:
    """The in-process draft on the ring's rows for positions [committed - ctx, committed)."""
    ring = io.a("ring")
    rows = ring[np.arange(committed - ctx, committed) % RING].copy()
    assert not np.isnan(rows).any()
    features = torch.from_numpy(rows).reshape(ctx, -1)
    noise = draft.noise_embeddings(ref, [29] + [draft.mask_token_id] * (BLOCK - 1))
    hidden = draft.forward(features, noise, committed - ctx)
    return project_with_target_head(ref, hidden[1:])


def greedy(w: WorkerProc, io: IO, **kw: object) -> tuple[list[int], F.DraftBlockReply]:
    io.a("ids")[:] = -1
    rep = w.call(draft_req(io, **kw))
    assert isinstance(rep, F.DraftBlockReply)
    return io.a("ids").tolist(), rep


def test_ring_holds_the_targets_captures(target_worker: WorkerProc, io: IO, ref: Model) -> None:
    cache = ref.new_cache(KV)
    ids = PROMPT + MORE
    _, caps = ref.forward_layers(ref.embed(torch.tensor(ids)), cache, 0, (1, 3))
    for p in range(len(ids) - RING, len(ids)):
        for j, layer in enumerate((1, 3)):
            torch.testing.assert_close(
                torch.from_numpy(io.a("ring")[p % RING, j].copy()), caps[layer][p]
            )


def test_draft_in_the_target_worker(
    target_worker: WorkerProc, io: IO, ref: Model, draft: Draft, files: dict[str, Path]
) -> None:
    w = target_worker
    with pytest.raises(RemoteError, match="draft before load_draft"):
        w.call(draft_req(io))
    rep = w.call(F.LoadDraft(str(files["gguf"]), "float32", "cpu"))
    assert isinstance(rep, F.LoadDraftReply)
    assert rep.capture_layers == draft.capture_layers == (1, 3)
    assert (rep.block_size, rep.mask_token_id, rep.hidden) == (BLOCK, 511, ref.cfg.hidden)

    # C = min(13, 4096, 8) = 8: positions [5, 13) are slots 5, 6, 7, 0, ..., 4 (wrapped).
    got, reply = greedy(w, io)
    assert (reply.n, reply.ctx) == (BLOCK - 1, RING)
    want = expected_logits(io, ref, draft, 13, RING).argmax(-1).tolist()
    assert got == [29, *want]
    # A window inside the ring: positions [9, 13), slots 1..4 (the zero-copy view path).
    got4, reply = greedy(w, io, ctx_window=4)
    assert reply.ctx == 4
    assert got4 == [29, *expected_logits(io, ref, draft, 13, 4).argmax(-1).tolist()]
    # Block size below the config's: a prefix of the rows, fewer proposals.
    got3, reply = greedy(w, io, block_size=3)
    assert reply.n == 2 and got3[:3] == [29, *want3(io, ref, draft)]

    # Sampled: q = sampler.probs of the same logits, proposals drawn from q with the seed.
    io.a("probs")[:] = np.nan
    outputs = {"ids": io.r["ids"], "probs": io.r["probs"]}
    w.call(draft_req(io, outputs=outputs, sampling=SAMPLING))
    logits = expected_logits(io, ref, draft, 13, RING)
    params = SamplingParams(**SAMPLING)
    q = torch.from_numpy(io.a("probs").copy())
    torch.testing.assert_close(q, probs(logits, params), rtol=1e-5, atol=1e-7)
    # The draft's generator is seeded apart from the target's (see draft_seed).
    drafts = dataclasses.replace(params, seed=draft_seed(params.seed))
    drawn = Sampler(drafts).sample(logits).tokens.tolist()
    ids = io.a("ids").tolist()
    assert ids == [29, *drawn]
    assert all(q[j, ids[j + 1]] > 0 for j in range(BLOCK - 1))  # each drawn from its row
    # The generator goes on across calls; reset restarts it (same seed -> same draws).
    w.call(F.Reset())
    w.call(draft_req(io, outputs=outputs, sampling=SAMPLING))
    assert io.a("ids").tolist() == ids


def want3(io: IO, ref: Model, draft: Draft) -> list[int]:
    ring = io.a("ring")
    rows = torch.from_numpy(ring[np.arange(5, 13) % RING].copy()).reshape(RING, -1)
    noise = draft.noise_embeddings(ref, [29, draft.mask_token_id, draft.mask_token_id])
    return project_with_target_head(ref, draft.forward(rows, noise, 5)[1:]).argmax(-1).tolist()


def test_draft_only_worker(
    target_worker: WorkerProc,
    tmp_path_factory: pytest.TempPathFactory,
    owner: ShmOwner,
    io: IO,
    ref: Model,
    draft: Draft,
    files: dict[str, Path],
) -> None:
    """Its own worker, no target layers, the safetensors layout: the same proposals."""
    w = WorkerProc(tmp_path_factory.mktemp("logs"), group="cpu:1", devices="cpu:1")
    try:
        w.call(F.Hello(instance=owner.instance))
        with pytest.raises(RemoteError, match="draft before load_draft"):
            w.call(draft_req(io))
        with pytest.raises(RemoteError, match="without a target needs this worker to hold"):
            w.call(F.LoadDraft(str(files["st"]), "float32", "cpu:1"))
        target = str(files["target"])
        with pytest.raises(RemoteError, match=r"DraftError: .*wrong\.gguf: draft hidden size 32"):
            w.call(F.LoadDraft(str(files["wrong"]), "float32", "cpu:1", target=target))
        with pytest.raises(RemoteError, match="nowhere"):
            w.call(F.LoadDraft(str(files["st"].parent / "nowhere"), "float32", "cpu:1", target))
        with pytest.raises(RemoteError, match=r"nowhere\.gguf"):
            w.call(F.LoadDraft(str(files["gguf"]), "float32", "cpu:1", target + ".nowhere.gguf"))
        with pytest.raises(RemoteError, match="this worker drives"):
            w.call(F.LoadDraft(str(files["st"]), "float32", "cuda:0", target))
        rep = w.call(F.LoadDraft(str(files["st"]), "float32", "cpu:1", target=target))
        assert isinstance(rep, F.LoadDraftReply) and rep.capture_layers == (1, 3)

        want = [29, *expected_logits(io, ref, draft, 13, RING).argmax(-1).tolist()]
        assert greedy(w, io)[0] == want
        target_worker.call(F.LoadDraft(str(files["gguf"]), "float32", "cpu"))
        assert greedy(target_worker, io)[0] == want  # the draft in the target's worker agrees

        # Bad requests: refused before any compute, the worker serves on.
        bad_ring = draft_req(io, ring=io.r["bad_ring"])
        with pytest.raises(RemoteError, match=r"ring rows must be \[2, 64\]"):
            w.call(bad_ring)
        foreign = Region("/luced-someoneelse-io", 64, (RING, 2, 64), "float32")
        with pytest.raises(RemoteError, match="does not belong to daemon instance"):
            w.call(draft_req(io, ring=foreign))
        with pytest.raises(F.FrameError, match=r"outputs.ids must be int32 .* >= 6 rows"):
            draft_req(io, block_size=6)  # refused by the frame itself, at the sender
        r = io.r["ids"]
        short = {"ids": Region(r.segment, r.offset, (BLOCK - 1,), "int32")}
        with pytest.raises(RemoteError, match=r"outputs\.ids holds 4 rows, block_size is 5"):
            w.call(draft_req(io, outputs=short))  # the config's block: checked by the worker
        with pytest.raises(RemoteError, match=r"anchor 5000 outside the target's vocabulary"):
            w.call(draft_req(io, anchor=5000))
        # Penalties are the target's business: the draft's q is the one without them.
        pen = {"ids": io.r["ids"], "probs": io.r["probs"]}
        w.call(draft_req(io, outputs=pen, sampling={"temperature": 0.7}))
        q = io.a("probs").copy()
        w.call(draft_req(io, outputs=pen, sampling={"temperature": 0.7, "repetition_penalty": 2.0}))
        np.testing.assert_array_equal(io.a("probs"), q)
        assert greedy(w, io)[0] == want
        w.call(F.Reset())  # a draft-only worker resets too (its draft's sampler)
    finally:
        w.stop()
