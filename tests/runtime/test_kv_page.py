"""The kv_page verb in real worker subprocesses over real shared memory (the test plays
the daemon): a kept lane's blocks page out to the daemon's host records outside a forward,
byte for byte in the record layout (runtime/kv_host.py), and come back through a forward
span's moves, after which the lane computes what it did before, bit for bit. A split's
workers follow the same moves, each through its own host records; a worker holding two
shards (devices) keeps each shard's bytes side by side in each record. The block store's
moves: a saved record holds the block's rows and the lane keeps its blocks; a new lane
adopting the records and paging them in attends as the lane that computed them. Bad
moves are refused, naming what is wrong, and change nothing."""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from test_worker_batch import load_frame
from worker_harness import TAG, Regions, WorkerProc, no_segments_left  # noqa: F401 - fixture

from luced.ipc import frames as F
from luced.ipc.channel import RemoteError
from luced.ipc.shm import ShmOwner
from luced.runtime.tiny import make_tiny_gguf

BLOCK = 8
RECORDS = 4
LANE = 1  # the kept lane; lane 2 runs beside it, so its freed blocks are not the only ones
PROMPT = [(5 * i + 2) % 60 + 1 for i in range(29)]  # blocks 0..3, the last one partly
OTHER = [(3 * i + 1) % 50 + 2 for i in range(12)]
PAGED = -1  # a paged-out entry of the tables here
WHOLE, SPLIT = ((0, 4),), ((0, 2), (2, 4))
SHARDS = ((0, 4, 2),)  # one worker, two shards: layers [0, 2) and [2, 4) on two devices


@pytest.fixture(scope="module")
def owner() -> Iterator[ShmOwner]:
    with ShmOwner(TAG + secrets.token_hex(2)) as o:
        yield o


@pytest.fixture(scope="module")
def varied(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny qwen3 of 4 layers whose greedy tokens vary (so do its rows)."""
    path = tmp_path_factory.mktemp("kvpage") / "qwen3.gguf"
    return make_tiny_gguf("qwen3", path, seed=7, layers=4, context=256).path


class Stage:
    """One worker holding layers [a, b) of a paged, scored load (as KV Flash's; (a, b, c):
    in two shards, [a, c) and [c, b)), its regions: its own host records (its record
    width), the exported K/V rows ("k.<layer>", "v.<layer>"), and the rows it passes on or
    the logits it returns."""

    def __init__(self, tmp: Path, owner: ShmOwner, model: Path, layers: tuple[int, ...]):
        self.w = WorkerProc(tmp)
        self.w.call(F.Hello(instance=owner.instance))
        load = load_frame(model, layers[:2], kv_block=BLOCK, kv_scored=True)
        if len(layers) == 3:
            load = dataclasses.replace(load, devices=("cpu", "cpu"), device_splits=layers[2:])
        self.load = load
        reply = self.w.call(load)
        assert isinstance(reply, F.LoadReply) and reply.kv_record_bytes > 0
        layout = self.w.call(F.KVLayout())
        assert isinstance(layout, F.KVLayoutReply)
        self.tensors = [name for name, *_ in layout.tensors]  # k.a, v.a, k.a+1, ...
        self.record_bytes = reply.kv_record_bytes
        specs: dict[str, tuple] = {
            "host": ((RECORDS, self.record_bytes), "uint8"),
            "narrow": ((RECORDS, self.record_bytes - 4), "uint8"),
            "tokens": ((64,), "int32"),
            "hidden": ((64, reply.hidden), "float32"),
            "logits": ((1, reply.vocab), "float32"),
            "scores": ((2, 16), "float32"),  # qk: per block, summed cosines and layers
        }
        specs |= {name: ((h, 64, d), "float32") for name, h, d in layout.tensors}
        self.state_bytes = reply.kv_state_bytes  # a hybrid's state records (kv_state.py)
        if self.state_bytes:
            specs["states"] = ((RECORDS, self.state_bytes), "uint8")
            specs["narrow_states"] = ((RECORDS, self.state_bytes - 16), "uint8")
        self.io = Regions(owner, f"kvpage-{layers[0]}-{secrets.token_hex(2)}", specs)
        self.io.a("host")[:] = 0xA5  # what no page-out wrote

    def rows(self, n: int, seq: int = LANE) -> dict[str, np.ndarray]:
        """Its K/V rows [0, n) of lane `seq`, each stored tensor [Hkv, n, D]."""
        regions = {name: self.io.r[name] for name in self.tensors}
        self.w.call(F.KVExport(position=n, regions=regions, sequence=seq))
        return {name: self.io.a(name)[:, :n].copy() for name in self.tensors}

    def blocks_used(self) -> int:
        """Blocks used in each of its shards' pools (the same in each)."""
        reply = self.w.call(F.Stats())
        assert isinstance(reply, F.StatsReply)
        used, shards = int(reply.stats["kv_blocks_used"]), len(self.load.devices)
        assert used % shards == 0
        return used // shards


class Lanes:
    """The daemon's part over the stages, in layer order: the lanes' block tables (growth
    into the lowest free blocks) and one forward of a span through every stage."""

    def __init__(self, stages: list[Stage]) -> None:
        self.stages = stages
        self.tables: dict[int, list[int]] = {}

    def forward(
        self,
        seq: int,
        start: int,
        ids: list[int],
        moves=(),
        scored: bool = False,
        keep_state: bool = False,
    ) -> np.ndarray:
        """Feed `ids` at `start` after `moves` (then grown as needed): the logits after;
        `scored`: each stage writes the lane's qk block scores into its "scores";
        `keep_state`: a hybrid keeps its recurrent state at the span's end."""
        table = self.follow(seq, moves)
        held = {b for t in self.tables.values() for b in t}
        free = (b for b in range(64) if b not in held)
        blocks = []
        while (len(table) + len(blocks)) * BLOCK < start + len(ids):
            blocks.append(next(free))
        table += blocks
        span = F.Span(
            sequence=seq,
            start=start,
            n=len(ids),
            blocks=tuple(blocks),
            table=len(table),
            moves=tuple(moves),
            keep_state=keep_state,
        )
        for i, s in enumerate(self.stages):
            s.io.a("tokens")[: len(ids)] = ids
            fields: dict = {"tokens": s.io.r["tokens"]}
            if moves:
                fields["kv_host"] = s.io.r["host"]  # its own records
            if i > 0:  # the rows the stage before passed on
                s.io.a("hidden")[: len(ids)] = self.stages[i - 1].io.a("hidden")[: len(ids)]
                fields["hidden_in"] = s.io.r["hidden"]
            out = "logits" if i == len(self.stages) - 1 else "hidden"
            mine = dataclasses.replace(span, kv_scores=s.io.r["scores"]) if scored else span
            s.w.call(F.Forward((mine,), out, {out: s.io.r[out]}, **fields))
        return self.stages[-1].io.a("logits")[0].copy()

    def page(
        self,
        seq: int,
        moves: tuple,
        region: str = "host",
        tokens: tuple[int, ...] = (),
        states: tuple = (),
        state_region: str = "states",
    ) -> list[int]:
        """kv_page on every stage, each through its own host records (and a hybrid's
        `states` through its state records): their PAGED counts; the lane's table follows
        once every stage took them."""
        paged = []
        for s in self.stages:
            kept = {"states": states, "kv_states": s.io.r[state_region]} if states else {}
            frame = F.KVPage(
                sequence=seq, moves=moves, kv_host=s.io.r[region], tokens=tokens, **kept
            )
            reply = s.w.call(frame)
            assert isinstance(reply, F.KVPageReply)
            paged.append(reply.paged)
        self.follow(seq, moves)
        return paged

    def follow(self, seq: int, moves) -> list[int]:
        """The lane's table after `moves` (PAGED where a block went out or was adopted; a
        save changes nothing)."""
        table = self.tables.setdefault(seq, [])
        for kind, j, block, _ in moves:
            if kind == 3:
                table.append(PAGED)
            elif kind != 2:
                table[j] = block if kind == 1 else PAGED
        return table

    def stop(self) -> None:
        for s in self.stages:
            s.w.stop()


@pytest.fixture
def lanes(request, tmp_path, owner, varied) -> Iterator[Lanes]:
    stages = [Stage(tmp_path, owner, varied, layers) for layers in request.param]
    lanes = Lanes(stages)
    try:
        yield lanes
    finally:
        lanes.stop()


def record_of(rows: dict[str, np.ndarray], j: int) -> bytes:
    """Logical block j's record, by the layout: each stored layer's K rows, then its V."""
    cut = slice(j * BLOCK, (j + 1) * BLOCK)
    return b"".join(np.ascontiguousarray(r[:, cut]).tobytes() for r in rows.values())


def prefill(lanes: Lanes) -> np.ndarray:
    """LANE holds PROMPT (blocks 0..3) beside lane 2: the logits of LANE's next token at
    29 (then rolled back, so that the lane holds the prompt alone)."""
    lanes.forward(LANE, 0, PROMPT)
    lanes.forward(2, 0, OTHER)
    assert lanes.tables == {LANE: [0, 1, 2, 3], 2: [4, 5]}
    before = lanes.forward(LANE, len(PROMPT), [7])
    for s in lanes.stages:
        s.w.call(F.Truncate(position=len(PROMPT), sequence=LANE))
    return before


@pytest.mark.parametrize(
    "lanes", [WHOLE, SPLIT, SHARDS], ids=["whole", "split", "shards"], indirect=True
)
def test_a_kept_lane_pages_out_byte_exact_and_back_in_through_a_span(lanes: Lanes) -> None:
    """Blocks 1 and 2 page out to records 0 and 3: each worker's records hold their rows
    in its layers, as kv_export gave them, and the records no move named are untouched.
    The next span's moves bring them back into other blocks (6, 7): the rows are as
    before, and the logits of the same token at the same position bit for bit."""
    before = prefill(lanes)
    rows = [s.rows(len(PROMPT)) for s in lanes.stages]
    assert lanes.page(LANE, ((0, 1, 1, 0), (0, 2, 2, 3))) == [2] * len(lanes.stages)
    for s, held in zip(lanes.stages, rows, strict=True):
        host = s.io.a("host")
        assert host[0].tobytes() == record_of(held, 1)
        assert host[3].tobytes() == record_of(held, 2)
        assert (host[1:3] == 0xA5).all()
        assert s.blocks_used() == 4  # 0, 3, and lane 2's
    with pytest.raises(RemoteError, match=r"cannot export .* blocks \[1, 2\]"):
        lanes.stages[0].rows(len(PROMPT))
    after = lanes.forward(LANE, len(PROMPT), [7], moves=((1, 1, 6, 0), (1, 2, 7, 3)))
    assert lanes.tables[LANE] == [0, 6, 7, 3]
    assert after.tobytes() == before.tobytes()
    for s, held in zip(lanes.stages, rows, strict=True):
        assert s.blocks_used() == 6
        for name, r in s.rows(len(PROMPT)).items():
            assert r.tobytes() == held[name].tobytes(), name


@pytest.mark.parametrize("lanes", [WHOLE], ids=["whole"], indirect=True)
def test_bad_page_moves_are_refused_and_change_nothing(lanes: Lanes) -> None:
    """Each refusal names what is wrong and leaves the tables, the pool and the records as
    they were: a block the lane does not hold there, a logical block past its table, a
    block paged out already, a move in to a held block, a record past the host records,
    records of another width, a lane with no K/V; a bad move after a good one (the good
    one is not made either). Then the lane pages as if none had come."""
    before = prefill(lanes)
    s = lanes.stages[0]
    assert lanes.page(LANE, ((0, 1, 1, 0),)) == [1]
    host = s.io.a("host").copy()
    out_of_step = "kv_page: sequence 1 is out of step with the daemon's block table: "
    bad = [
        (
            ((0, 2, 5, 1),),
            out_of_step + "move out of logical block 2 from block 5: the table has 2",
        ),
        (
            ((0, 4, 3, 1),),
            out_of_step + "move out of logical block 4 from block 3: the table has None",
        ),
        (((0, 1, 1, 1),), out_of_step + ".* block 1: the table has a paged-out block"),
        (((1, 1, 4, 1),), out_of_step + "block 4 is held already"),
        (((0, 2, 2, 1), (0, 1, 1, 2)), out_of_step + ".* the table has a paged-out block"),
        (((0, 2, 2, RECORDS),), f"a move names a host record past the {RECORDS} of kv_host"),
    ]
    for moves, match in bad:
        with pytest.raises(RemoteError, match=match):
            lanes.page(LANE, moves)
    with pytest.raises(RemoteError, match=f"host records of {s.record_bytes - 4} bytes"):
        lanes.page(LANE, ((0, 2, 2, 1),), region="narrow")
    for seq in (5, 2):  # never ran; ran, then released
        if seq == 2:
            s.w.call(F.Reset(sequence=2, release=True))
            del lanes.tables[2]
        with pytest.raises(RemoteError, match=f"kv_page: sequence {seq} holds no"):
            lanes.page(seq, ((0, 0, 0, 1),))
    assert (s.io.a("host") == host).all()
    assert lanes.tables[LANE] == [0, PAGED, 2, 3] and s.blocks_used() == 3
    assert lanes.page(LANE, ((0, 2, 2, 1),)) == [2]
    assert s.blocks_used() == 2
    after = lanes.forward(LANE, len(PROMPT), [7], moves=((1, 1, 1, 0), (1, 2, 5, 1)))
    assert after.tobytes() == before.tobytes()


@pytest.mark.parametrize(
    "lanes", [WHOLE, SPLIT, SHARDS], ids=["whole", "split", "shards"], indirect=True
)
def test_saved_records_adopted_by_a_new_lane_attend_as_the_computed_blocks(lanes: Lanes) -> None:
    """The block store's two moves: LANE's whole blocks 0..2 are saved to records 1, 2, 0
    (each worker's record holds its layers' rows of the block, by the layout, and the
    lane keeps its blocks: nothing is paged out, its rows still export). A new lane 3
    adopts the records as its blocks 0..2 with their token ids, pages them in with its
    first span and computes the rest of the prompt and a token as LANE did: its rows
    equal LANE's and its logits are LANE's bit for bit."""
    lanes.forward(LANE, 0, PROMPT[:24])  # blocks 0..2, whole
    lanes.forward(2, 0, OTHER)
    lanes.forward(LANE, 24, PROMPT[24:])
    before = lanes.forward(LANE, len(PROMPT), [7])
    assert lanes.tables == {LANE: [0, 1, 2, 5], 2: [3, 4]}
    rows = [s.rows(len(PROMPT) + 1) for s in lanes.stages]
    saves = ((2, 0, 0, 1), (2, 1, 1, 2), (2, 2, 2, 0))
    assert lanes.page(LANE, saves) == [0] * len(lanes.stages)
    for s, held in zip(lanes.stages, rows, strict=True):
        host = s.io.a("host")
        for _, j, _, record in saves:
            assert host[record].tobytes() == record_of(held, j)
        assert (host[3] == 0xA5).all() and s.blocks_used() == 6
        for name, r in s.rows(len(PROMPT) + 1).items():
            assert r.tobytes() == held[name].tobytes(), name
    adopts = ((3, 0, -1, 1), (3, 1, -1, 2), (3, 2, -1, 0))
    assert lanes.page(3, adopts, tokens=tuple(PROMPT[:24])) == [3] * len(lanes.stages)
    assert lanes.tables[3] == [PAGED] * 3
    lanes.forward(3, 24, PROMPT[24:], moves=((1, 0, 6, 1), (1, 1, 7, 2), (1, 2, 8, 0)))
    after = lanes.forward(3, len(PROMPT), [7])
    assert lanes.tables[3] == [6, 7, 8, 9]
    assert after.tobytes() == before.tobytes()
    for s, held in zip(lanes.stages, rows, strict=True):
        for name, r in s.rows(len(PROMPT) + 1, seq=3).items():
            assert r.tobytes() == held[name].tobytes(), name


@pytest.mark.parametrize("lanes", [WHOLE, SPLIT], ids=["whole", "split"], indirect=True)
def test_adopted_records_are_scored_as_the_computed_blocks(lanes: Lanes) -> None:
    """KV Flash's qk block keys of adopted blocks come from their records' K rows: lane 3
        adopts LANE's saved blocks 0..2, pages them in, computes block 3 as LANE did, and then
        both page block 1 out; the scores of the next step (block 1's from its key alone, as
        reselection ranks paged-out blocks) are LANE's bit for bit, in every stage (block 3,
    partial, is not scored)."""
    lanes.forward(LANE, 0, PROMPT[:24])
    lanes.forward(LANE, 24, PROMPT[24:])
    saves = ((2, 0, 0, 1), (2, 1, 1, 2), (2, 2, 2, 0))
    lanes.page(LANE, saves)
    adopts = ((3, 0, -1, 1), (3, 1, -1, 2), (3, 2, -1, 0))
    lanes.page(3, adopts, tokens=tuple(PROMPT[:24]))
    lanes.forward(3, 24, PROMPT[24:], moves=((1, 0, 5, 1), (1, 1, 6, 2), (1, 2, 7, 0)))
    assert lanes.tables == {LANE: [0, 1, 2, 3], 3: [5, 6, 7, 4]}
    scores, logits = [], []
    for seq, block, record in ((LANE, 1, 3), (3, 6, 3)):  # record 3: free once more
        lanes.page(seq, ((0, 1, block, record),))
        logits.append(lanes.forward(seq, len(PROMPT), [7], scored=True))
        scores.append([s.io.a("scores").copy() for s in lanes.stages])
    assert logits[0].tobytes() == logits[1].tobytes()
    for mine, theirs in zip(*scores, strict=True):
        assert (mine[1, :3] > 0).all() and mine[1, 3] == 0  # 0..2 sealed, 3 partial
        assert mine.tobytes() == theirs.tobytes()


@pytest.mark.parametrize("lanes", [WHOLE], ids=["whole"], indirect=True)
def test_bad_saves_and_adopts_are_refused_and_change_nothing(lanes: Lanes) -> None:
    """A save of a block the lane does not hold there or of a paged-out one, an adopt at
    a logical block other than the table's next, onto a lane whose last block is partial,
    or with token ids that do not cover the adopted blocks (or past the vocabulary): each
    refused, naming why, and nothing changes: the records, the tables, the positions."""
    prefill(lanes)  # LANE: 29 positions in blocks 0..3
    s = lanes.stages[0]
    lanes.page(LANE, ((0, 1, 1, 0),))  # block 1 to record 0
    host = s.io.a("host").copy()
    out_of_step = "kv_page: sequence {} is out of step with the daemon's block table: "
    bad = [
        (LANE, ((2, 2, 5, 1),), (), out_of_step.format(LANE) + "save of logical block 2 from "
         "block 5: the table has 2"),
        (LANE, ((2, 1, 1, 1),), (), out_of_step.format(LANE) + ".* the table has a paged-out"),
        (6, ((3, 1, -1, 1),), tuple(PROMPT[:8]), out_of_step.format(6) + "adopt as logical "
         "block 1: the table holds 0 blocks"),
        (LANE, ((3, 4, -1, 1),), tuple(PROMPT[:8]), out_of_step.format(LANE) + "adopt after "
         "position 29: only a cache of whole blocks"),
        (6, ((3, 0, -1, 1),), tuple(PROMPT[:7]), "1 adopted blocks hold 8 positions, the "
         "frame names 7 token ids"),
        (6, ((3, 0, -1, 1),), (10_000,) * 8, r"token ids must lie in \[0, "),
    ]  # fmt: skip
    for seq, moves, tokens, match in bad:
        with pytest.raises(RemoteError, match=match):
            lanes.page(seq, moves, tokens=tokens)
    assert (s.io.a("host") == host).all()
    assert lanes.tables[LANE] == [0, PAGED, 2, 3] and s.blocks_used() == 5
    # Lane 6 is as empty as before the refusals: it adopts from its first block.
    assert lanes.page(6, ((3, 0, -1, 0),), tokens=tuple(PROMPT[:8])) == [1]
