"""A hybrid's state records through the kv_page verb, in real worker subprocesses over real
shared memory (the test plays the daemon): a lane keeps its recurrent state where a span
ended (`keep_state`), a state save copies it into a state record (runtime/kv_state.py's
layout) beside the blocks' saves, and a new lane that adopts the blocks with that state
loaded computes the rest as the lane that computed them, logits bit for bit, whole and
in two shards of one worker (each shard's part of a record side by side). Bad state moves
are refused, naming what is wrong, and change nothing."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import test_kv_page
from test_kv_page import BLOCK, LANE, OTHER, PROMPT, RECORDS, SHARDS, WHOLE, Lanes
from worker_harness import no_segments_left  # noqa: F401 - fixture

from luced.ipc.channel import RemoteError
from luced.runtime.tiny import make_tiny_gguf

CUT = 2 * BLOCK  # where the lane keeps its state: after blocks 0 and 1
owner, lanes = test_kv_page.owner, test_kv_page.lanes  # its fixtures: `lanes` loads `varied`


@pytest.fixture(scope="module")
def varied(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The model test_kv_page's `lanes` load here: a qwen35 of 4 layers (3 attends)."""
    path = tmp_path_factory.mktemp("kvstate") / "qwen35.gguf"
    return make_tiny_gguf("qwen35", path, seed=7, layers=4, context=256).path


def computed(lanes: Lanes) -> np.ndarray:
    """LANE computes PROMPT, keeping its state at CUT, beside lane 2: the logits of a
    token after it."""
    assert all(s.state_bytes > 0 for s in lanes.stages)
    lanes.forward(LANE, 0, PROMPT[:CUT], keep_state=True)
    lanes.forward(2, 0, OTHER)
    lanes.forward(LANE, CUT, PROMPT[CUT:])
    return lanes.forward(LANE, len(PROMPT), [7])


@pytest.mark.parametrize("lanes", [WHOLE, SHARDS], ids=["whole", "shards"], indirect=True)
def test_a_saved_state_loaded_with_the_adopted_blocks_continues_as_computed(
    lanes: Lanes,
) -> None:
    """LANE's blocks 0 and 1 and its state at CUT are saved (records 1, 2; state record
    3: the other state records are untouched); a new lane 3 adopts the two blocks with
    the state loaded, pages them in with its first span, computes the rest of the prompt
    and a token: its logits are LANE's bit for bit. A lane adopting from the same records
    with the state of another position (the state record of the zero state) does not."""
    before = computed(lanes)
    for s in lanes.stages:
        s.io.a("states")[:] = 0xA5
    saves = ((2, 0, 0, 1), (2, 1, 1, 2))
    assert lanes.page(LANE, saves, states=((0, CUT, 3),)) == [0] * len(lanes.stages)
    for s in lanes.stages:
        rows = s.io.a("states")
        assert (rows[:3] == 0xA5).all() and not (rows[3] == 0xA5).all()
    adopts = ((3, 0, -1, 1), (3, 1, -1, 2))
    tokens = tuple(PROMPT[:CUT])
    assert lanes.page(3, adopts, tokens=tokens, states=((1, CUT, 3),)) == [2] * len(lanes.stages)
    lanes.forward(3, CUT, PROMPT[CUT:], moves=((1, 0, 8, 1), (1, 1, 9, 2)))
    assert lanes.forward(3, len(PROMPT), [7]).tobytes() == before.tobytes()
    for s in lanes.stages:
        s.io.a("states")[0] = 0  # a zero conv window and delta matrix: the state at 0
    lanes.page(4, adopts, tokens=tokens, states=((1, CUT, 0),))
    lanes.forward(4, CUT, PROMPT[CUT:], moves=((1, 0, 12, 1), (1, 1, 13, 2)))
    assert lanes.forward(4, len(PROMPT), [7]).tobytes() != before.tobytes()


@pytest.mark.parametrize("lanes", [WHOLE], ids=["whole"], indirect=True)
def test_bad_state_moves_are_refused_and_change_nothing(lanes: Lanes) -> None:
    """Adopting a hybrid's blocks without their state, loading a state at another position
    than the adopted end, saving a state the lane did not keep, a state record past the
    records, state records of another width: each refused, naming why; the state records
    are as they were, and lane 6 then adopts as if nothing had come."""
    computed(lanes)
    s = lanes.stages[0]
    lanes.page(LANE, ((2, 0, 0, 1),), states=((0, CUT, 0),))
    held = s.io.a("states").copy()
    one = ((3, 0, -1, 1),)
    tokens = tuple(PROMPT[:BLOCK])
    bad = [
        (6, one, tokens, (), "adopts blocks only with their state"),
        (6, one, tokens, ((1, CUT, 0),), f"a state loaded at {CUT}: the adopted blocks end at 8"),
        (LANE, (), (), ((0, BLOCK, 1),), "no recurrent state kept at position 8"),
        (6, one, tokens, ((1, BLOCK, RECORDS),), f"past the {RECORDS} held"),
    ]
    for seq, moves, ids, states, match in bad:
        with pytest.raises(RemoteError, match=match):
            lanes.page(seq, moves, tokens=ids, states=states)
    with pytest.raises(RemoteError, match=f"state records of {s.state_bytes - 16} bytes"):
        lanes.page(6, one, tokens=tokens, states=((1, BLOCK, 1),), state_region="narrow_states")
    assert (s.io.a("states") == held).all()
    assert lanes.page(6, one, tokens=tokens, states=((1, BLOCK, 1),)) == [1]
