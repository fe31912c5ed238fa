"""A worker's sequences and a forward of several of them at once, in a real worker
subprocess over real shared memory (the test plays the daemon), against each sequence
decoded alone in process."""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from worker_harness import TAG, Regions, WorkerProc, no_segments_left  # noqa: F401 - fixture

from luced.engine.kv.blocks import BlockTables
from luced.ipc import frames as F
from luced.ipc.channel import RemoteError
from luced.ipc.shm import ShmOwner
from luced.runtime import kv_blocks
from luced.runtime.generate import generate
from luced.runtime.kv_host import HostTier
from luced.runtime.model import Model
from luced.runtime.tiny import make_tiny_gguf
from luced.sampling_params import SamplingParams

ROWS = 64
SEQS = 8
PROMPTS = {0: [5, 9, 14, 3, 22, 7], 1: [40, 2, 2, 19], 2: [11, 61, 8, 30, 4, 4, 17, 9, 2]}
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("batch") / "llama.gguf"
    return make_tiny_gguf("llama", path, seed=4, layers=4, context=256).path


@pytest.fixture(scope="module")
def owner() -> Iterator[ShmOwner]:
    with ShmOwner(TAG + secrets.token_hex(2)) as o:
        yield o


def load_frame(model: Path, layers: tuple[int, int], kv_block: int = 0, **kw: object) -> F.Load:
    return F.Load(
        model=str(model),
        layers=layers,
        dtype="float32",
        devices=("cpu",),
        kv_capacity=128,
        owns_embed=layers[0] == 0,
        owns_head=layers[1] == 4,
        kv_block=kv_block,
        kv_blocks=64 if kv_block else 0,
        **kw,  # type: ignore[arg-type]
    )


def start_worker(
    tmp: Path,
    owner: ShmOwner,
    model: Path,
    layers: tuple[int, int],
    kv_block: int = 0,
    weights: str = "dequant",
) -> WorkerProc:
    w = WorkerProc(tmp)
    w.call(F.Hello(instance=owner.instance))
    w.call(load_frame(model, layers, kv_block, weights=weights))
    return w


@pytest.fixture(scope="module")
def worker(tmp_path_factory, owner: ShmOwner, tiny: Path) -> Iterator[WorkerProc]:
    w = start_worker(tmp_path_factory.mktemp("w"), owner, tiny, (0, 4))
    yield w
    w.stop()


@pytest.fixture(scope="module")
def io(owner: ShmOwner) -> Regions:
    """The fed ids, the sampled rows, the boundary activations, logits."""
    specs = {
        "tokens": ((4 * ROWS,), "int32"),
        "ids": ((ROWS,), "int32"),
        "hidden": ((4 * ROWS, 64), "float32"),
        "logits": ((SEQS, 512), "float32"),
    }
    return Regions(owner, "batch-io", specs)


def alone(model: Model, prompt: list[int], steps: int) -> list[int]:
    """Greedy continuation of one sequence in process: the oracle."""
    return generate(model, prompt, SamplingParams(temperature=0), steps).tokens


def batch_frame(
    io: Regions,
    feeds: dict[int, tuple[int, list[int]]],
    want: str = "sample",
    every_row: frozenset[int] = frozenset(),
    tables: BlockTables | None = None,
    **kw: object,
) -> F.Forward:
    """feeds: sequence -> (start, ids), in batch order; `every_row`: sequences that get a
    token after each of their rows (a verify window), the others after their last;
    `tables`: the daemon's block tables (a block-pool load), grown for the spans."""
    spans = tuple(
        F.Span(
            sequence=seq,
            start=start,
            n=len(ids),
            n_out=len(ids) if seq in every_row else 1,
            sampling=GREEDY if want == "sample" else {},
            **_grown(tables, seq, start, start + len(ids)),
        )
        for seq, (start, ids) in feeds.items()
    )
    flat = [t for _, ids in feeds.values() for t in ids]
    io.a("tokens")[: len(flat)] = flat
    outputs = {
        "sample": {"ids": io.r["ids"]},
        "hidden": {"hidden": io.r["hidden"]},
        "logits": {"logits": io.r["logits"]},
    }[want]
    fields = {"tokens": io.r["tokens"], "outputs": outputs, **kw}
    return F.Forward(spans, want, **fields)  # type: ignore[arg-type]


def _grown(tables: BlockTables | None, seq: int, start: int, end: int) -> dict:
    if tables is None:
        return {}
    g = tables.write(seq, start, end)
    return {"copies": g.copies, "blocks": g.blocks, "table": g.length}


def forward(
    w: WorkerProc,
    io: Regions,
    seq: int,
    start: int,
    ids: list[int],
    tables: BlockTables | None = None,
) -> int:
    w.call(batch_frame(io, {seq: (start, ids)}, tables=tables))
    return int(io.a("ids")[0])


def test_batched_decode_equals_each_sequence_alone(worker, io, tiny) -> None:
    """Sequences 0 and 1 are prefilled alone (forward with their sequence), sequence 2 joins
    the first batch with its whole prompt; then every step is one batch of three decode
    tokens. Each sequence's tokens are its greedy continuation alone."""
    for seq in PROMPTS:
        worker.call(F.Reset(sequence=seq, release=True))
    steps = 6
    got: dict[int, list[int]] = {seq: [forward(worker, io, seq, 0, PROMPTS[seq])] for seq in (0, 1)}
    feeds = {0: (len(PROMPTS[0]), got[0][-1:]), 1: (len(PROMPTS[1]), got[1][-1:])}
    feeds[2] = (0, PROMPTS[2])
    got[2] = []
    for _ in range(steps):
        reply = worker.call(batch_frame(io, feeds))
        assert isinstance(reply, F.ForwardReply)
        for j, seq in enumerate(feeds):
            got[seq].append(int(io.a("ids")[j]))
        assert reply.positions == tuple(feeds[s][0] + len(feeds[s][1]) for s in feeds)
        feeds = {s: (reply.positions[j], got[s][-1:]) for j, s in enumerate(feeds)}
    model = Model.load(tiny)
    for seq, prompt in PROMPTS.items():
        assert got[seq] == alone(model, prompt, len(got[seq])), f"sequence {seq}"


def test_plain_greedy_spans_beside_penalized_ones_pick_as_alone(worker, io) -> None:
    """The spans whose tokens are their rows' argmax are picked in one call; the spans beside
    them with a repetition penalty or a logit bias keep their own draws, from their own rows.
    Sequences 0-3 decode in one batch, 4-7 (the same prompts and sampling) one span per frame:
    every sequence gets the same tokens as its twin."""
    sampling = [
        GREEDY,
        {"temperature": 0, "repetition_penalty": 3.0, "penalty_window": 8},
        GREEDY,
        {"temperature": 0, "logit_bias": {"7": 100.0}},
    ]
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[2], [3, 3, 8, 1, 9]]

    def step(feeds: dict[int, tuple[int, list[int]]]) -> list[int]:
        spans = tuple(
            F.Span(sequence=seq, start=start, n=len(ids), sampling=sampling[seq % 4])
            for seq, (start, ids) in feeds.items()
        )
        flat = [t for _, ids in feeds.values() for t in ids]
        io.a("tokens")[: len(flat)] = flat
        outputs = {"ids": io.r["ids"]}
        worker.call(F.Forward(spans, "sample", outputs, tokens=io.r["tokens"]))
        return [int(t) for t in io.a("ids")[: len(spans)]]

    got: dict[int, list[int]] = {}
    for seq in range(8):
        worker.call(F.Reset(sequence=seq, release=True))
        got[seq] = step({seq: (0, prompts[seq % 4])})
    for _ in range(5):
        feeds = {s: (len(prompts[s]) + len(got[s]) - 1, got[s][-1:]) for s in range(4)}
        for s, token in zip(range(4), step(feeds), strict=True):
            got[s].append(token)
        for s in range(4, 8):
            got[s] += step({s: (len(prompts[s % 4]) + len(got[s]) - 1, got[s][-1:])})
    assert [got[s] for s in range(4)] == [got[s] for s in range(4, 8)]
    assert 7 in got[3]  # the bias drew its token


def test_a_verify_block_in_a_batch_samples_every_row_as_alone(worker, io, tiny) -> None:
    """Sequence 1 feeds a block and gets the greedy token after each of its rows (a
    speculative verify) while sequence 0 takes a decode step, in one batch; the rows
    equal the block's greedy predictions alone."""
    for seq in (0, 1):
        worker.call(F.Reset(sequence=seq, release=True))
    first = forward(worker, io, 0, 0, PROMPTS[0])
    block = PROMPTS[1][:5]
    frame = batch_frame(io, {0: (len(PROMPTS[0]), [first]), 1: (0, block)}, every_row={1})
    worker.call(frame)
    model = Model.load(tiny)
    want = model.forward(torch.tensor(block), model.new_cache(64), 0).argmax(-1).tolist()
    assert io.a("ids")[1 : 1 + len(block)].tolist() == want
    assert int(io.a("ids")[0]) == alone(model, PROMPTS[0], 2)[1]


def test_a_bad_batch_changes_nothing(worker, io, tiny) -> None:
    for seq in (0, 1):
        worker.call(F.Reset(sequence=seq, release=True))
    nxt = forward(worker, io, 0, 0, PROMPTS[0])
    n0 = len(PROMPTS[0])
    with pytest.raises(F.FrameError, match="appears twice"):
        frame = batch_frame(io, {0: (n0, [nxt]), 1: (0, PROMPTS[1])})
        F.Forward.from_wire({**frame.to_wire(), "spans": [frame.spans[0]] * 2})
    with pytest.raises(RemoteError, match="sequence 0 holds 6 positions; a span cannot start"):
        worker.call(batch_frame(io, {1: (0, PROMPTS[1]), 0: (n0 + 1, [nxt])}))
    frame = batch_frame(io, {0: (n0, [nxt]), 1: (0, PROMPTS[1])})
    io.a("tokens")[2] = 10_000  # the second span feeds an id outside the vocabulary
    with pytest.raises(RemoteError, match="token ids must lie in"):
        worker.call(frame)
    # Neither sequence moved: 0 goes on alone as if nothing happened, 1 is still empty.
    second = forward(worker, io, 0, n0, [nxt])
    assert [nxt, second] == alone(Model.load(tiny), PROMPTS[0], 2)
    assert forward(worker, io, 1, 0, PROMPTS[1]) == alone(Model.load(tiny), PROMPTS[1], 1)[0]


def test_a_span_below_the_committed_length_rolls_back(worker, io, tiny) -> None:
    """A verify window's rejected rows are rolled back by the next span's start: sequence 0
    feeds a window of 4 beside sequence 1's decode step, then goes on from inside it,
    exactly as after an explicit truncate; the tokens after it are its own greedy ones."""
    for seq in (0, 1):
        worker.call(F.Reset(sequence=seq, release=True))
    model = Model.load(tiny)
    want0, want1 = alone(model, PROMPTS[0], 4), alone(model, PROMPTS[1], 3)
    n0, n1 = len(PROMPTS[0]), len(PROMPTS[1])
    assert forward(worker, io, 0, 0, PROMPTS[0]) == want0[0]
    assert forward(worker, io, 1, 0, PROMPTS[1]) == want1[0]
    window = [want0[0], want0[1], 1, 2]  # the first proposal right, the next two wrong
    reply = worker.call(batch_frame(io, {0: (n0, window), 1: (n1, want1[:1])}, every_row={0}))
    assert reply.positions == (n0 + 4, n1 + 1)
    assert io.a("ids")[:2].tolist() == want0[1:3]  # the rows after the two right ones
    # Keep anchor + 1 accepted: 0 goes on from n0 + 2, beside 1's next step.
    feeds = {1: (n1 + 1, [int(io.a("ids")[4])]), 0: (n0 + 2, want0[2:3])}
    reply = worker.call(batch_frame(io, feeds))
    assert reply.positions == (n1 + 2, n0 + 3)
    assert io.a("ids")[:2].tolist() == [want1[2], want0[3]]
    with pytest.raises(RemoteError, match="cannot start at"):  # above it is still refused
        worker.call(batch_frame(io, {0: (n0 + 5, [1])}))


@pytest.mark.parametrize("weights", ["int4", "int8"])
def test_a_long_prompt_chunk_beside_decodes_leaves_each_as_alone(
    tmp_path, owner, io, tiny, weights: str
) -> None:
    """A prompt chunk longer than the packed kernels' 64 rows runs on its own path (dense),
    the decode rows beside it on theirs: every span's logits equal its sequence's alone, bit
    for bit (the rows of one matrix call would have taken the dense path together)."""
    w = start_worker(tmp_path, owner, tiny, (0, 4), weights=weights)
    try:
        prompts = {seq: PROMPTS[seq] for seq in (0, 1)}
        for seq, prompt in prompts.items():
            w.call(batch_frame(io, {seq: (0, prompt)}))
        long = [(7 * i + 3) % 60 + 1 for i in range(100)]
        feeds = {0: (len(prompts[0]), [4]), 5: (0, long), 1: (len(prompts[1]), [9])}
        w.call(batch_frame(io, feeds, "logits"))
        together = io.a("logits")[:3].copy()
        alone_rows = []
        for seq, (start, ids) in feeds.items():  # each again, alone, from where it was
            if start:
                w.call(F.Truncate(position=start, sequence=seq))
            else:
                w.call(F.Reset(sequence=seq, release=True))
            w.call(batch_frame(io, {seq: (start, ids)}, "logits"))
            alone_rows.append(io.a("logits")[0].copy())
        for j, row in enumerate(alone_rows):
            assert (together[j] == row).all(), f"span {j}"
    finally:
        w.stop()


def test_released_sequences_start_over(worker, io) -> None:
    worker.call(F.Reset(sequence=3, release=True))
    first = forward(worker, io, 3, 0, PROMPTS[1])
    worker.call(F.Reset(sequence=3, release=True))
    with pytest.raises(RemoteError, match="holds 0 positions; a span cannot start"):
        forward(worker, io, 3, len(PROMPTS[1]), [first])
    assert forward(worker, io, 3, 0, PROMPTS[1]) == first


def test_a_split_batch_flows_through_the_shards(tmp_path, owner, io, tiny) -> None:
    """Two workers, layers [0, 2) and [2, 4): the first passes hidden rows on, the second
    samples; the tokens equal the unsplit ones."""
    head = start_worker(tmp_path, owner, tiny, (0, 2))
    tail = start_worker(tmp_path, owner, tiny, (2, 4))
    try:
        feeds = {seq: (0, PROMPTS[seq]) for seq in (2, 0)}
        model, got = Model.load(tiny), {2: [], 0: []}
        for _ in range(4):
            head.call(batch_frame(io, feeds, "hidden"))
            frame = batch_frame(io, feeds, hidden_in=io.r["hidden"])
            reply = tail.call(frame)
            for j, seq in enumerate(feeds):
                got[seq].append(int(io.a("ids")[j]))
            feeds = {s: (reply.positions[j], got[s][-1:]) for j, s in enumerate(feeds)}
        for seq, tokens in got.items():
            assert tokens == alone(model, PROMPTS[seq], 4)
    finally:
        head.stop()
        tail.stop()


def blocks_used(w: WorkerProc) -> int:
    reply = w.call(F.Stats())
    assert isinstance(reply, F.StatsReply)
    return int(reply.stats["kv_blocks_used"])


@pytest.fixture(scope="module")
def varied(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model whose greedy continuations vary from token to token."""
    path = tmp_path_factory.mktemp("share") / "qwen3.gguf"
    return make_tiny_gguf("qwen3", path, seed=7, layers=4, context=256).path


def test_kv_share_starts_a_sequence_on_anothers_blocks(tmp_path, owner, io, varied) -> None:
    """With a block pool (load kv_block 8), its blocks handed out by the daemon's tables:
    sequence 2 shares sequence 1's first 20 of 21 prompt positions (its 3 blocks, the last
    one partly), feeds the last, and decodes its fresh continuation, holding only its own
    blocks besides: a copy of the block it wrote into, and new ones. Refusals change
    nothing."""
    w = start_worker(tmp_path, owner, varied, (0, 4), kv_block=8)
    tables = BlockTables(64, 8)
    try:
        prompt = [(5 * i + 2) % 60 + 1 for i in range(21)]
        with pytest.raises(RemoteError, match="sequence 1 holds no KV"):
            w.call(F.KVShare(sequence=2, source=1, position=8))
        first = forward(w, io, 1, 0, prompt, tables)
        assert blocks_used(w) == 3  # positions 0..20
        with pytest.raises(RemoteError, match="holds 21 positions, not 24"):
            w.call(F.KVShare(sequence=2, source=1, position=24))
        tables.share(2, 1, 20)
        reply = w.call(F.KVShare(sequence=2, source=1, position=20))
        assert isinstance(reply, F.KVShareReply) and reply.position == 20
        assert blocks_used(w) == 3  # nothing copied
        got = [forward(w, io, 2, 20, prompt[20:], tables)]
        assert blocks_used(w) == 4  # its copy of the block of positions 16..23
        for _ in range(4):
            got.append(forward(w, io, 2, len(prompt) + len(got) - 1, got[-1:], tables))
        model = Model.load(varied)
        want = alone(model, prompt, 5)
        assert got == want and first == want[0] and len(set(want)) > 2
        # The source goes: the shared blocks stay with sequence 2, which decodes on.
        assert blocks_used(w) == 5  # and a new one for positions 24..
        tables.free(1)
        w.call(F.Reset(sequence=1, release=True))
        assert blocks_used(w) == 2 + 2  # the 2 shared, its own 2 (positions 16..31)
        got.append(forward(w, io, 2, len(prompt) + len(got) - 1, got[-1:], tables))
        assert got == alone(model, prompt, 6)
        tables.free(2)
        w.call(F.Reset(sequence=2, release=True))
        assert blocks_used(w) == 0
    finally:
        w.stop()


def test_a_span_out_of_step_with_the_daemons_table_is_refused(tmp_path, owner, io, varied):
    """The worker checks each span's table against its own before anything changes: a
    length other than the daemon's, a block it holds already, a copy of a block the
    sequence does not hold, no table at all. Each refusal names the sequence and leaves
    the sequence as it was: the right frame then continues it as if none had come. A
    truncate releases the blocks past it on both sides alike."""
    w = start_worker(tmp_path, owner, varied, (0, 4), kv_block=8)
    tables = BlockTables(64, 8)
    try:
        prompt = [(3 * i + 1) % 50 + 2 for i in range(12)]
        got = [forward(w, io, 1, 0, prompt, tables)]  # blocks 0, 1
        step = {1: (12, got)}
        bad = [
            ({"blocks": (2,), "table": 4}, "sequence 1 is out of step .* the daemon's holds 4"),
            ({"blocks": (0,), "table": 3}, "block 0 is held already"),
            ({"copies": ((1, 5, 6),), "table": 2}, "copy of logical block 1 from 5"),
            ({}, "sequence 1: its span carries no block table"),
        ]
        for fields, match in bad:
            frame = batch_frame(io, step)
            frame = dataclasses.replace(
                frame, spans=(dataclasses.replace(frame.spans[0], **fields),)
            )
            with pytest.raises(RemoteError, match=match):
                w.call(frame)
            assert blocks_used(w) == 2
        for _ in range(5):  # 12 .. 16: a new block at 16
            got.append(forward(w, io, 1, len(prompt) + len(got) - 1, got[-1:], tables))
        assert got == alone(Model.load(varied), prompt, 6) and blocks_used(w) == 3
        # The truncate verb releases the blocks wholly past its position, as the
        # daemon's table does; the sequence then grows again from there.
        tables.truncate(1, 8)
        w.call(F.Truncate(position=8, sequence=1))
        assert blocks_used(w) == 1
        fed = (prompt + got)[8:17]
        assert forward(w, io, 1, 8, fed, tables) == got[5] and blocks_used(w) == 3
    finally:
        w.stop()


def test_kv_share_needs_a_block_pool(worker) -> None:
    with pytest.raises(RemoteError, match="needs a load with kv_block"):
        worker.call(F.KVShare(sequence=2, source=1, position=8))


class PagingOracle:
    """The daemon's part for a paged, scored worker, and that worker's caches in process:
    each span's moves are applied here and its growth picked (the lowest free blocks), in
    span order as the daemon makes them; its logits computed here are the oracle's."""

    def __init__(self, model: Model) -> None:
        self.model = model
        self.pool = model.new_block_pool(8, max_blocks=64)
        self.host = HostTier(self.pool.block_nbytes())
        self.caches: dict[int, kv_blocks.PagedKVCache] = {}

    def span(
        self, seq: int, start: int, ids: list[int], moves=(), scores=None
    ) -> tuple[F.Span, torch.Tensor]:
        cache = self.caches.setdefault(seq, self.model.new_paged_cache(self.pool, 128, scored=True))
        for kind, j, block, record in moves:
            cache.move(kind, j, block, self.host.record(record))
        blocks: list[int] = []
        while (len(cache.table) + len(blocks)) * 8 < start + len(ids):
            blocks.append(next(b for b in range(64) if not self.pool.refs(b) and b not in blocks))
        cache.follow((), blocks)
        logits = self.model.forward(torch.tensor(ids), cache, start)[-1]
        span = F.Span(
            sequence=seq,
            start=start,
            n=len(ids),
            blocks=tuple(blocks),
            table=len(cache.table),
            moves=tuple(moves),
            kv_scores=scores,
        )
        return span, logits


def paged_step(w: WorkerProc, io: Regions, spans: list[tuple[F.Span, list[int]]], **kw) -> None:
    flat = [t for _, ids in spans for t in ids]
    io.a("tokens")[: len(flat)] = flat
    frame = F.Forward(
        tuple(s for s, _ in spans),
        "logits",
        {"logits": io.r["logits"]},
        tokens=io.r["tokens"],
        **kw,
    )
    w.call(frame)


def test_a_worker_pages_blocks_as_its_spans_move_them(tmp_path, owner, io, varied) -> None:
    """A load with kv_block 8 and kv_scored: spans page blocks out to the host tier and back
    (a block one span pages out is the next span's growth in the same frame), and ask for
    block scores. Logits, host records and scores equal an in-process paged cache given
    the same moves. Moves out of step are refused before anything changes, naming the
    sequence: the frame's other spans' moves are not made either."""
    w = WorkerProc(tmp_path)
    w.call(F.Hello(instance=owner.instance))
    try:
        oracle = PagingOracle(Model.load(varied))
        reply = w.call(load_frame(varied, (0, 4), kv_block=8, kv_scored=True))
        assert isinstance(reply, F.LoadReply)
        size = reply.kv_record_bytes
        assert size == oracle.pool.block_nbytes() == 2 * 4 * 2 * 8 * 32 * 4  # 4 layers, K and V
        paging = Regions(
            owner,
            "paging-io",
            {
                "host": ((4, size), "uint8"),
                "wrong": ((4, size + 4), "uint8"),
                "s1": ((2, 16), "float32"),
                "s2": ((2, 16), "float32"),
                "k0": ((2, 64, 32), "float32"),
            },
        )
        host = {"kv_host": paging.r["host"]}
        prompts = {
            1: [(5 * i + 2) % 60 + 1 for i in range(20)],
            2: [(3 * i + 1) % 50 + 2 for i in range(12)],
        }
        pos = {1: 0, 2: 0}
        last: dict[int, int] = {}

        def step(feeds: dict[int, tuple[list[int], tuple, str | None]]) -> None:
            spans, want = [], []
            for seq, (ids, moves, scores) in feeds.items():
                region = paging.r[scores] if scores else None
                span, logits = oracle.span(seq, pos[seq], ids, moves, region)
                spans.append((span, ids))
                want.append(logits)
            paged_step(w, io, spans, **host)
            got = torch.from_numpy(io.a("logits")[: len(spans)].copy())
            for j, (seq, (ids, _, scores)) in enumerate(feeds.items()):
                torch.testing.assert_close(got[j], want[j], rtol=1e-5, atol=1e-5)
                assert int(got[j].argmax()) == int(want[j].argmax())
                last[seq] = int(want[j].argmax())
                pos[seq] += len(ids)
                if scores:
                    expected = torch.empty(2, 16)
                    kv_blocks.write_scores([oracle.caches[seq]], expected)
                    written = torch.from_numpy(paging.a(scores).copy())
                    torch.testing.assert_close(written, expected, rtol=1e-5, atol=1e-5)
                    assert written[1].count_nonzero() == pos[seq] // 8  # its complete blocks

        step({1: (prompts[1], (), None), 2: (prompts[2], (), None)})
        assert blocks_used(w) == 5  # 0-2 and 3-4
        # Sequence 1 pages block 0 out; sequence 2's growth (position 16) takes it.
        step({1: ([last[1]], ((0, 0, 0, 0),), "s1"), 2: ([1, 2, 3, 4, 5], (), None)})
        assert oracle.caches[2].table == [3, 4, 0] and blocks_used(w) == 5
        record = torch.from_numpy(paging.a("host")[0].copy()).view(torch.float32)
        torch.testing.assert_close(record, oracle.host.record(0).view(torch.float32))
        # Block 0 comes back into block 5, then logical 1 goes out.
        step({1: ([last[1]], ((1, 0, 5, 0), (0, 1, 1, 1)), "s1"), 2: ([last[2]], (), "s2")})
        assert oracle.caches[1].table == [5, kv_blocks.PAGED, 2] and blocks_used(w) == 5

        def refused(feeds: dict[int, tuple], match: str, **kw: object) -> None:
            spans = []
            for seq, (ids, moves) in feeds.items():
                cache = oracle.caches[seq]
                span = F.Span(seq, pos[seq], len(ids), table=len(cache.table), moves=moves)
                spans.append((span, ids))
            with pytest.raises(RemoteError, match=match):
                paged_step(w, io, spans, **{**host, **kw})
            assert blocks_used(w) == 5

        refused(
            {1: ([last[1]], ((0, 2, 7, 2),))},
            "sequence 1 is out of step .* logical block 2 from block 7: the table has 2",
        )
        refused(
            {1: ([last[1]], ((1, 1, 3, 2),))},
            "sequence 1 is out of step .* block 3 is held already",
        )
        refused(  # a move out of step in the second span: the first span's is not made either
            {2: ([last[2]], ((0, 0, 3, 2),)), 1: ([last[1]], ((0, 1, 1, 2),))},
            "sequence 1 is out of step .* the table has a paged-out block",
        )
        refused(
            {1: ([last[1]], ((0, 0, 5, 2),))},
            f"host records of {size + 4} bytes, this worker's are {size}",
            kv_host=paging.r["wrong"],
        )
        refused({1: ([last[1]], ((0, 0, 5, 9),))}, "names a host record past the 4 of kv_host")
        with pytest.raises(F.FrameError, match="a span with moves needs kv_host"):
            paged_step(w, io, [(F.Span(1, pos[1], 1, table=3, moves=((0, 0, 5, 2),)), [last[1]])])
        for _ in range(3):  # then on, with logical block 1 paged out, as if none had come
            step({1: ([last[1]], (), "s1"), 2: ([last[2]], (), None)})
        # The verbs on a table with a paged-out block: an export of it is refused, a
        # truncate drops it with the blocks past it, a release frees the rest.
        export = F.KVExport(position=pos[1], regions={"k.0": paging.r["k0"]}, sequence=1)
        with pytest.raises(RemoteError, match=r"kv_export: cannot export .* blocks \[1\] are"):
            w.call(export)
        w.call(F.Truncate(position=8, sequence=1))
        assert blocks_used(w) == 1 + 3  # its block 5, sequence 2's
        w.call(F.Reset(sequence=1, release=True))
        assert blocks_used(w) == 3
    finally:
        w.stop()
