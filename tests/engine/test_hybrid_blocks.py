"""A hybrid's prefix cache as K/V blocks and recurrent states by prefix key
(engine/kv/block_store.py, engine/kv/state_store.py) through the real Engine and Target:
a tiny qwen35 (Gated DeltaNet beside attention) keeps the state after the block ends where
its prefill stopped (turn starts snapped down to block ends, each prompt's last whole
block), and a prompt restores its blocks up to the deepest kept state, both loaded by one
`kv_page`. Its output equals a fresh computation's, tokens and logprobs bit for bit,
unsplit and split over two workers, from memory and after a restart from block and state
files. A corrupt state file is quarantined and the restore falls back to a shallower cut,
or to a prefill; a small memory gives up its least recently used states.

"Fresh" is the same engine computing the prompt with nothing cached: its prefill stops at
the same cuts (a DeltaNet chunk's rounding depends on where it starts), so the rows after
a restored cut are computed as the fresh ones; its greedy tokens equal a plain engine's."""

from __future__ import annotations

from pathlib import Path

import pytest
from engine_harness import engine_for, stream

from luced.cache.block_files import BLOCKS, STATE_FILES, prompt_keys
from luced.cache.files import QUARANTINE
from luced.engine.core import Engine, GenerationRequest
from luced.engine.kv.state_store import StateStore
from luced.engine.kvflash import PagerConfig
from luced.gguf_file import GGUFFile
from luced.runtime.tiny import make_tiny_draft, make_tiny_gguf
from luced.sampling_params import SamplingParams
from luced.text.tokenizer import Tokenizer
from luced.text.turns import TurnMarker

BLOCK = 16
GREEDY = SamplingParams(temperature=0, logprobs=2)
SPLIT = ("cpu", "cpu:1")
N = 8  # tokens generated per request

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("hybrid") / "qwen35.gguf"
    return make_tiny_gguf("qwen35", path, seed=5, layers=8, context=512).path


@pytest.fixture(scope="module")
def chat(tiny: Path) -> tuple[int, dict[str, list[int]]]:
    """A turn marker (the token opening each message) and conversations: `first` (turns
    start at 61 and 102: states at 48, 96 and its last whole block, 128); `second` sharing
    its first two turns (and 2 tokens more: 6 blocks); `third` sharing its first turn (3
    blocks); `fourth` extending it by a turn (its 8 whole blocks)."""
    marker = Tokenizer.from_gguf(GGUFFile(tiny)).vocab_size - 1

    def turn(seed: int, n: int) -> list[int]:
        return [marker] + [(seed * i + 3) % marker for i in range(n)]

    a, b = turn(7, 60), turn(11, 40)
    first = a + b + turn(13, 30)
    return marker, {
        "first": first,
        "second": a + b + turn(17, 25),
        "third": a + turn(19, 30),
        "fourth": first + turn(23, 20),
    }


@pytest.fixture(scope="module")
def known() -> dict[str, tuple[list[int], list]]:
    return {}


def engine(path: Path, marker: int, devices: tuple[str, ...] = ("cpu",), kv: Path | None = None):
    """Two running requests (a block pool), the prefix cache's blocks and states in memory,
    and on disk in `kv`."""
    return engine_for(
        path,
        devices,
        context=512,
        max_running=2,
        prefix_cache_bytes=16 << 20,
        kv_cache_dir=kv,
        block_files=True,
    )


async def served(e: Engine, marker: int, prompt: list[int]) -> tuple[tuple[list[int], list], int]:
    """(tokens and logprobs, cached tokens) of one greedy request."""
    e.turns = TurnMarker(marker)  # the template's marker (the harness has no template)
    handle = e.submit(GenerationRequest("r", prompt, GREEDY, N, ignore_eos=True))
    out = await stream(handle)
    return out, handle.cached_tokens


async def fresh(tiny: Path, chat, known: dict) -> dict[str, tuple[list[int], list]]:
    """Each conversation computed with nothing cached (once), and the greedy tokens of a
    plain engine (no prefix cache, chunks at multiples of 64 only) alike."""
    marker, prompts = chat
    if not known:
        async with engine(tiny, marker) as e:
            for name, p in prompts.items():
                await e.prefix_cache.clear()
                out, cached = await served(e, marker, p)
                assert cached == 0
                known[name] = out
        async with engine_for(tiny, context=512) as plain:
            for name, p in prompts.items():
                handle = plain.submit(GenerationRequest("r", p, GREEDY, N, ignore_eos=True))
                assert (await stream(handle))[0] == known[name][0]
    return known


def states_of(e: Engine) -> StateStore:
    assert e.prefix.store is not None and e.prefix.store.states is not None
    assert e.prefix_cache is not None and e.prefix_cache.arena is None  # no snapshots
    return e.prefix.store.states


def state_files(kv: Path, path: Path) -> list[list[Path]]:
    parts = sorted((kv / path.name / BLOCKS).iterdir())
    return [sorted(p.glob(f"*{STATE_FILES.suffix}")) for p in parts]


@pytest.mark.parametrize("devices", [("cpu",), SPLIT], ids=["unsplit", "split"])
async def test_a_hybrid_restores_blocks_and_state_from_memory_as_fresh(
    tiny: Path, chat, known, devices
) -> None:
    """No disk: the first conversation keeps its 8 whole blocks and the states at 48, 96
    and 128. Again, it restores 128 positions; the second (6 blocks in common) restores at
    96, the third (3) at 48, the fourth at 128; every answer is the fresh one, tokens and
    logprobs bit for bit. The status counts the states."""
    want = await fresh(tiny, chat, known)
    marker, prompts = chat
    async with engine(tiny, marker, devices) as e:
        got = {}
        for name in ("first", "first again", "second", "third", "fourth"):
            got[name] = await served(e, marker, prompts[name.split()[0]])
        for name, (out, _) in got.items():
            assert out == want[name.split()[0]], name
        assert [n for _, n in got.values()] == [0, 128, 96, 48, 128]
        stats = e.prefix_cache.stats()
        assert stats.hits == 4 and stats.hit_tokens == 128 + 96 + 48 + 128
        # first: 48, 96, 128; second: its 128 (its 96 is first's); third: 80; fourth: 144
        assert stats.memory_states == len(states_of(e)._held) == 6
        assert stats.memory_bytes > stats.memory_blocks * e.prefix.store.record_bytes


@pytest.mark.parametrize("devices", [("cpu",), SPLIT], ids=["unsplit", "split"])
async def test_a_restart_restores_from_block_and_state_files_as_fresh(
    tiny: Path, chat, known, devices, tmp_path: Path
) -> None:
    """One engine serves the first conversation and writes its blocks and its 3 states to
    every worker's part; the next one on the same directory restores the fourth at 128
    and the second at 96 from disk, == fresh; then `clear(disk=True)` deletes them all."""
    want = await fresh(tiny, chat, known)
    marker, prompts = chat
    kv = tmp_path / "kv"
    async with engine(tiny, marker, devices, kv) as e:
        assert await served(e, marker, prompts["first"]) == (want["first"], 0)
        await e.prefix_cache.save_all()
        stats = e.prefix_cache.stats()
        assert (stats.disk_blocks, stats.disk_states) == (8, 3)
    files = state_files(kv, tiny)
    assert [len(f) for f in files] == [3] * len(devices)
    async with engine(tiny, marker, devices, kv) as e:
        assert e.prefix_cache.stats().disk_states == 3  # the scan found them
        assert await served(e, marker, prompts["fourth"]) == (want["fourth"], 128)
        assert await served(e, marker, prompts["second"]) == (want["second"], 96)
        await e.prefix_cache.save_all()
        await e.prefix_cache.clear(disk=True)
        assert e.prefix_cache.stats().disk_states == 0
    assert all(not f for f in state_files(kv, tiny))


async def test_a_corrupt_state_file_is_quarantined_and_a_shallower_cut_restored(
    tiny: Path, chat, known, tmp_path: Path
) -> None:
    """Flipped bytes in the data of the state at 128 (they pass the scan, which reads
    headers and tokens): the first conversation restores at 96 instead, the bad file moves
    to quarantine/, and the answer is the fresh one. With the states at 96 and 48 bad too,
    the third conversation finds none left and is prefilled."""
    want = await fresh(tiny, chat, known)
    marker, prompts = chat
    kv = tmp_path / "kv"
    async with engine(tiny, marker, ("cpu",), kv) as e:
        await served(e, marker, prompts["first"])
        await e.prefix_cache.save_all()
    keys = prompt_keys(prompts["first"], BLOCK)
    names = {c: keys[c // BLOCK - 1].hex() + STATE_FILES.suffix for c in (48, 96, 128)}
    (part,) = (kv / tiny.name / BLOCKS).iterdir()

    def corrupt(c: int) -> bytes:
        data = bytearray((part / names[c]).read_bytes())
        data[-64:-32] = bytes(x ^ 0xFF for x in data[-64:-32])
        (part / names[c]).write_bytes(bytes(data))
        return bytes(data)

    bad = corrupt(128)
    async with engine(tiny, marker, ("cpu",), kv) as e:
        assert e.prefix_cache.stats().disk_states == 3
        assert await served(e, marker, prompts["first"]) == (want["first"], 96)
        assert states_of(e).restore_errors == 1
    assert (kv / tiny.name / QUARANTINE / names[128]).read_bytes() == bad
    corrupt(96)
    corrupt(48)
    async with engine(tiny, marker, ("cpu",), kv) as e:
        assert await served(e, marker, prompts["second"]) == (want["second"], 0)
        assert states_of(e).restore_errors == 2  # 96, then 48: nothing left to restore
    quarantined = {p.name for p in (kv / tiny.name / QUARANTINE).iterdir()}
    assert {names[48], names[96]} <= quarantined


async def test_states_are_given_up_least_recently_used(tiny: Path, chat, known) -> None:
    """Three state records free: the first conversation saves its 3 states (128, 96, 48:
    the deepest used last); again, it touches 128; the third restores at 48 and saves its
    80 into the record of the least recently used, 96; so the second restores at 48, not
    96. Every answer is the fresh one."""
    want = await fresh(tiny, chat, known)
    marker, prompts = chat
    async with engine(tiny, marker) as e:
        records = e.target.states
        assert records is not None
        held = [records.hold() for _ in range(records.free - 3)]
        order = ("first", "first", "third", "second")
        got = [await served(e, marker, prompts[name]) for name in order]
        assert [out for out, _ in got] == [want[name] for name in order]
        assert [n for _, n in got] == [0, 128, 48, 48]
        for record in held:
            records.release(record)


async def test_a_hybrid_with_a_draft_restores_blocks_states_and_ring_rows(
    tiny: Path, chat, known, tmp_path: Path
) -> None:
    """A DFlash draft on the hybrid: each block keeps its feature-ring rows beside the
    K/V and the states (engine/kv/block_rings.py), so the restores land at the same cuts
    and the speculative greedy tokens are the fresh ones."""
    want = await fresh(tiny, chat, known)
    marker, prompts = chat
    _, draft, _ = make_tiny_draft(tiny, tmp_path / "draft", seed=1, block_size=4)
    async with engine_for(
        tiny,
        context=512,
        max_running=2,
        prefix_cache_bytes=16 << 20,
        block_files=True,
        draft=draft,
        block_size=4,
    ) as e:
        assert e.prefix.store is not None and e.prefix.store.rings is not None
        got = {}
        for name in ("first", "first again", "second", "third", "fourth"):
            got[name] = await served(e, marker, prompts[name.split()[0]])
    for name, ((tokens, _), _) in got.items():
        assert tokens == want[name.split()[0]][0], name
    assert [n for _, n in got.values()] == [0, 128, 96, 48, 128]


@pytest.mark.parametrize("devices", [("cpu",), SPLIT], ids=["unsplit", "split"])
async def test_a_hybrid_under_kv_flash_restores_past_its_pool_as_fresh(
    tmp_path: Path, devices
) -> None:
    """KV Flash over a 448-position pool: a 502-token conversation pages blocks out as it
    prefills and saves its blocks (the paged-out ones held as their records are) and its
    states at 256 and 448; the next turn restores at 448, its pager paging in what a lane
    that computed the prompt holds, and answers as the same engine does with nothing
    cached, tokens and logprobs bit for bit."""
    tiny = make_tiny_gguf("qwen35", tmp_path / "q.gguf", seed=5, layers=4, context=1024).path
    marker = Tokenizer.from_gguf(GGUFFile(tiny)).vocab_size - 1

    def turn(seed: int, n: int) -> list[int]:
        return [marker] + [(seed * i + 3) % marker for i in range(n)]

    first = turn(7, 300) + turn(11, 200)
    second = first + turn(13, 60)
    pager = PagerConfig(pool_tokens=448, policy="lru")  # type: ignore[arg-type]
    opts = dict(context=1024, kv_flash=pager, prefix_cache_bytes=16 << 20, block_files=True)
    async with engine_for(tiny, devices, **opts) as e:
        assert e.prefix.store is not None and e.prefix.store.states is not None
        assert e.prefix_cache is not None and e.prefix_cache.arena is None
        got = [await served(e, marker, p) for p in (first, second)]
        assert e.target.flash_status()["recalls"] > 0  # the restore paged blocks in
        want = []
        for p in (first, second):
            await e.prefix_cache.clear()
            want.append(await served(e, marker, p))
    assert [n for _, n in got] == [0, 448] and [n for _, n in want] == [0, 0]
    assert [out for out, _ in got] == [out for out, _ in want]
