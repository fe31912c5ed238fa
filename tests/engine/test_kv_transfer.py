"""Prefix-cache snapshots through the real Target: worker subprocesses, an arena segment.

A sequence's snapshot copies (`Target.mover`) move every shard's K/V (and the feature ring)
between the workers
and daemon-owned shared memory. Oracle: the target's own computation. After a restore the
target continues exactly like the run the snapshot came from (bitwise, f32 and bf16, unsplit
and 2-worker split), a shorter prefix continues like a fresh prefill of it, the ring holds
the same rows, and a bad region is refused with nothing changed (or, when a worker fails
after another one imported, every worker is reset).
"""

from __future__ import annotations

import secrets
from pathlib import Path

import numpy as np
import pytest
from engine_harness import split_target
from test_target_split import PROMPT, tiny  # noqa: F401 (fixture)

from luced.cache.layout import TensorSpec
from luced.engine.driver import Driver
from luced.engine.executor import WorkerReplyError
from luced.ipc.frames import KVExport, KVImport
from luced.ipc.regions import Region, RegionAllocator, required_bytes, view
from luced.runtime.model import Model
from luced.runtime.tiny import make_tiny_draft

N = len(PROMPT)
SAMPLED = {"temperature": 0.9, "seed": 11, "repetition_penalty": 1.5}


class Arena:
    """A daemon-owned segment with one region per spec, `rows` positions long, and token ids
    (what the snapshot store's arena hands the target)."""

    def __init__(self, target, specs: list[TensorSpec], rows: int) -> None:
        shapes = {s.name: (s.shape_for(rows), s.dtype) for s in specs}
        shapes["tokens"] = ((rows,), "int32")
        name = f"arena-{secrets.token_hex(3)}"
        self.seg = target.owner.create(name, required_bytes(shapes.values()))
        alloc = RegionAllocator.for_segment(self.seg)
        every = {k: alloc.alloc(k, shape, dt) for k, (shape, dt) in shapes.items()}
        self.tokens = every.pop("tokens")
        self.regions = every
        self.a("tokens")[: min(rows, N)] = PROMPT[:rows]

    def a(self, name: str) -> np.ndarray:
        return view(self.seg, self.tokens if name == "tokens" else self.regions[name])


async def greedy(target: Driver, token: int, steps: int) -> tuple[list[int], np.ndarray]:
    """Feed token, then each argmax, one at a time: (tokens fed, their logits)."""
    fed, rows = [], []
    for _ in range(steps):
        logits = (await target.logits([token]))[0]
        fed.append(token)
        rows.append(logits)
        token = int(logits.argmax())
    return fed, np.stack(rows)


async def sampled(target: Driver, token: int, steps: int) -> list[int]:
    out = []
    for _ in range(steps):
        token = (await target.step(token, SAMPLED, None)).token
        out.append(token)
    return out


async def kv_positions(target: Driver) -> list[int]:
    return [w["kv_position"] for w in (await target.stats())["workers"]]


def check_layout(target: Driver, specs: list[TensorSpec], dtype: str) -> None:
    cfg = Model.load(target.target.placement.model, layers=(0, 1)).cfg
    kv = [s for s in specs if s.name != "ring"]
    assert [s.name for s in kv] == [f"{c}.{i}" for i in range(cfg.n_layers) for c in "kv"]
    assert {(s.shape, s.dtype, s.token_axis) for s in kv} == {
        ((cfg.n_kv_heads, 1, cfg.head_dim), dtype, 1)
    }


@pytest.mark.parametrize(
    ("family", "devices"),
    [("llama", ("cpu",)), ("llama", ("cpu", "cpu:1")), ("gemma3", ("cpu", "cpu:1"))],
)
async def test_restore_equals_fresh(tiny: dict[str, Path], family: str, devices) -> None:  # noqa: F811
    async with split_target(tiny[family], devices) as target:
        specs = await target.kv_layout()
        check_layout(target, specs, "float32")
        first = int((await target.logits(PROMPT))[-1].argmax())
        arena = Arena(target.target, specs, N + 3)
        await target.export_kv(N, arena.regions)
        assert target.position() == N
        want = await greedy(target, first, 5)  # this state *is* a fresh prefill of PROMPT
        m = 6
        target.truncate(m)  # the same rows as a restored prefix of m: bitwise oracle
        want_m = await greedy(target, PROMPT[m], 5)
        await target.reset()
        await target.logits(PROMPT[:m])  # a fresh prefill of m: rows from a batch of m
        fresh_m = await greedy(target, PROMPT[m], 5)
        await target.reset()
        await target.logits(PROMPT[:m])
        want_sampled = await sampled(target, PROMPT[m], 8)  # penalties read the history

        await target.reset()
        await target.logits([1, 2, 3, 4])  # something else in the KV: import replaces it
        await target.import_kv(N, arena.regions, arena.tokens)
        assert target.position() == N and await kv_positions(target) == [N] * len(devices)
        got = await greedy(target, first, 5)
        assert got[0] == want[0]
        assert np.array_equal(got[1], want[1])

        await target.import_kv(m, arena.regions, arena.tokens)  # a prefix of the snapshot
        assert await kv_positions(target) == [m] * len(devices)
        got_m = await greedy(target, PROMPT[m], 5)
        assert got_m[0] == want_m[0] == fresh_m[0]
        assert np.array_equal(got_m[1], want_m[1])
        np.testing.assert_allclose(got_m[1], fresh_m[1], rtol=1e-5, atol=1e-5)
        await target.import_kv(m, arena.regions, arena.tokens)
        assert await sampled(target, PROMPT[m], 8) == want_sampled


async def test_bfloat16_split(tiny: dict[str, Path]) -> None:  # noqa: F811
    async with split_target(tiny["llama"], ("cpu", "cpu:1"), dtype="bfloat16") as target:
        specs = await target.kv_layout()
        check_layout(target, specs, "bfloat16")
        first = int((await target.logits(PROMPT))[-1].argmax())
        arena = Arena(target.target, specs, N)
        await target.export_kv(N, arena.regions)
        assert arena.a("k.0").dtype == np.uint16 and arena.a("k.0").any()
        want = await greedy(target, first, 5)
        await target.reset()
        await target.import_kv(N, arena.regions, arena.tokens)
        got = await greedy(target, first, 5)
        assert got[0] == want[0]
        assert np.array_equal(got[1], want[1])


async def test_ring_rows_restored(tiny: dict[str, Path]) -> None:  # noqa: F811
    """ring_cap < N: the snapshot carries ring rows of its last ring_cap positions (the slots
    wrap once); after an import the ring holds what the fresh prefill left there."""
    cap = 8
    async with split_target(tiny["llama"], ("cpu", "cpu:1")) as target:
        t = target.target
        b = t.executor.slots[1].plan.layers[0]
        t.enable_capture((0, b - 1, b, t.n_layers - 1), ring_cap=cap)
        ring = t.ring(0)
        assert ring is not None
        specs = await target.kv_layout()
        assert specs[-1] == TensorSpec("ring", (1, 4, t.hidden), "float32", 0)
        await target.logits(PROMPT[:5])  # a forward feeds at most ring_cap tokens
        first = int((await target.logits(PROMPT[5:]))[-1].argmax())
        fresh_rows = ring.rows(N - cap, N)
        arena = Arena(target.target, specs, N)
        arena.a("ring")[:] = -1.0
        await target.export_kv(N, arena.regions)
        assert np.array_equal(arena.a("ring")[N - cap :], fresh_rows)
        assert (arena.a("ring")[: N - cap] == -1.0).all()  # older positions: not in the ring
        want = await greedy(target, first, 4)
        want_rows = ring.rows(N + 4 - cap, N + 4)

        await target.reset()
        for chunk in ([20, 21, 22, 23, 24], [25, 26, 27, 28, 29]):
            await target.logits(chunk)  # other features in every slot
        assert not np.array_equal(ring.rows(N - cap, N), fresh_rows)
        await target.import_kv(N, arena.regions, arena.tokens)
        assert np.array_equal(ring.rows(N - cap, N), fresh_rows)
        got = await greedy(target, first, 4)
        assert got[0] == want[0] and np.array_equal(got[1], want[1])
        assert np.array_equal(ring.rows(N + 4 - cap, N + 4), want_rows)


async def test_bad_regions_change_nothing(tiny: dict[str, Path]) -> None:  # noqa: F811
    async with split_target(tiny["llama"], ("cpu", "cpu:1")) as target:
        specs = await target.kv_layout()
        prompt_logits = await target.logits(PROMPT)
        first = int(prompt_logits[-1].argmax())
        arena = Arena(target.target, specs, N)
        await target.export_kv(N, arena.regions)
        want = await greedy(target, first, 4)
        target.truncate(N)
        k3 = arena.regions["k.3"]
        short = Region(k3.segment, k3.offset, (k3.shape[0], N - 1, k3.shape[2]), k3.dtype)
        wide = Region(k3.segment, k3.offset, (k3.shape[0] + 1, N, k3.shape[2]), k3.dtype)
        no_v3 = {k: r for k, r in arena.regions.items() if k != "v.3"}

        # The target checks every region against the layout before any worker moves.
        with pytest.raises(ValueError, match=r"missing \['v.3'\]"):
            await target.import_kv(N, no_v3, arena.tokens)
        widened = r"k.3 must be float32 \[2, 10, 16\] .*got float32 \[3, 10, 16\]"
        with pytest.raises(ValueError, match=widened):
            await target.import_kv(N, {**arena.regions, "k.3": wide}, arena.tokens)
        with pytest.raises(ValueError, match=r"region k.3 must be .*got float32 \[2, 9, 16\]"):
            await target.export_kv(N, {**arena.regions, "k.3": short})
        with pytest.raises(ValueError, match="cannot export 11 positions: 10 are committed"):
            await target.export_kv(N + 1, arena.regions)
        # A worker asked directly checks too, and refuses with nothing changed.
        w1 = target.target.executor.slots[1].handle
        assert w1 is not None and target.target.executor.slots[1].plan.layers == (2, 4)
        theirs = {k: r for k, r in arena.regions.items() if int(k[2:]) >= 2}
        with pytest.raises(WorkerReplyError, match=r"region k.3 must be float32 \[2, >= 10, 16\]"):
            frame = KVImport(position=N, regions={**theirs, "k.3": wide}, tokens=arena.tokens)
            await w1.call(frame)
        with pytest.raises(WorkerReplyError, match=r"missing \['v.3'\], unknown \['k.0'\]"):
            bad = {**theirs, "k.0": arena.regions["k.0"]}
            bad.pop("v.3")
            await w1.call(KVExport(position=N, regions=bad))
        # Nothing changed: the workers hold what they held (4 tokens past N, rolled back
        # to N by the next span), and the sequence goes on as before.
        assert target.position() == N and await kv_positions(target) == [N + 4, N + 4]
        got = await greedy(target, first, 4)
        assert got[0] == want[0] and np.array_equal(got[1], want[1])

        # Worker 0 imports, worker 1 cannot map its regions: all or nothing, so all reset.
        gone = f"/luced-{target.target.owner.instance}-gone"
        late = {k: Region(gone, r.offset, r.shape, r.dtype) for k, r in theirs.items()}
        with pytest.raises(WorkerReplyError, match="does not exist"):
            await target.import_kv(N, {**arena.regions, **late}, arena.tokens)
        assert target.position() == 0 and await kv_positions(target) == [0, 0]
        assert np.array_equal(await target.logits(PROMPT), prompt_logits)  # healthy


async def test_draft_reads_no_ring_row_below_a_restored_snapshot_floor(
    tiny: dict[str, Path],  # noqa: F811
    tmp_path: Path,
) -> None:
    """A snapshot of 20 positions with a ring of 8 holds valid ring rows for [12, 20) only.
    Restored to 15, the draft's context must stay inside [12, 15): poisoning the ring rows
    of the positions below (7..11, still in the ring's slots) changes nothing."""
    _, draft, _ = make_tiny_draft(tiny["gemma3"], tmp_path / "d", seed=1, captures=2)
    prompt = PROMPT * 2
    async with split_target(tiny["gemma3"], ("cpu",)) as target:
        await target.target.load_draft(str(draft), ring_cap=8, block_size=4)
        for start in range(0, len(prompt), 8):  # a forward may not outrun the ring
            await target.feed(prompt[start : start + 8], {"temperature": 0})
        arena = Arena(target.target, await target.kv_layout(), len(prompt))
        await target.export_kv(len(prompt), arena.regions)
        await target.reset()
        await target.import_kv(15, arena.regions, arena.tokens)
        ring = target.target.ring(0)
        assert ring is not None
        below = np.arange(7, 12) % 8
        proposals = []
        for poison in (np.nan, 0.0):
            ring.array[below] = poison
            proposals.append(await target.draft_block(prompt[15], 4))
        assert proposals[0] == proposals[1]
