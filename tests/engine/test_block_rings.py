"""The prefix cache's K/V blocks with a DFlash draft (engine/kv/block_rings.py): a block
keeps the feature-ring rows of its positions beside its K/V, by the same prefix key, in
memory and on disk, and a restore puts them back into the new sequence's ring.

Oracles, each request against a fresh engine (the same draft, no cache): tokens and
logprobs bit for bit, the speculative counts (windows, proposals, accepted), and every
context the draft read (the ring's rows before each window) bit for bit; and the tokens
equal plain autoregressive decoding's. Unsplit and split over two local workers; from
memory, after a restart from the block files, through a running request's shared prefix;
and with a ring shorter than the prompt, where only the rows the prompt's own ring would
hold are needed (a block without them ends the match, a shorter prompt's save adds them).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from engine_harness import engine_for, stream

from luced.cache.block_files import BLOCKS, SUFFIX, prompt_keys
from luced.cache.files import QUARANTINE
from luced.engine.core import Engine, GenerationRequest, RequestHandle
from luced.engine.scheduler import Work
from luced.engine.spec.proposer import Proposer
from luced.runtime.tiny import make_tiny_draft, make_tiny_gguf
from luced.sampling_params import SamplingParams

pytestmark = pytest.mark.asyncio(loop_scope="module")

BLOCK = 16
PROMPT = [(7 * i + 3) % 120 + 2 for i in range(100)]  # 6 whole blocks and 4 positions
TURN2 = PROMPT + [(11 * i + 5) % 120 + 2 for i in range(30)]  # PROMPT's 6 blocks
BRANCH = PROMPT[:60] + [(13 * i + 1) % 120 + 2 for i in range(20)]  # 3 of them
PROMPTS = {"p": PROMPT, "t": TURN2, "b": BRANCH}
GREEDY = SamplingParams(temperature=0, logprobs=2)
SPLIT = ("cpu", "cpu:1")
TOKENS = 12


class Recording(Proposer):
    """The real draft, recording the context each window reads: the ring's rows of the
    committed positions before it."""

    def __init__(self, target) -> None:
        super().__init__(target)
        self.read: dict[int, list[bytes]] = {}  # by slot

    async def _draft(self, work: Work, sampling: dict | None) -> list[int]:
        slot, end = work.seq.slot, work.seq.computed
        ring = self.target.ring(slot)
        assert ring is not None
        self.read.setdefault(slot, []).append(ring.rows(end - self.context(work), end).tobytes())
        return await super()._draft(work, sampling)


@dataclass(frozen=True)
class Answer:
    tokens: list[int]
    logprobs: list
    spec: dict
    contexts: list[bytes]  # what the draft read, window by window


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("rings")
    target = make_tiny_gguf("qwen3", root / "qwen3.gguf", seed=7, layers=8, context=256).path
    return target, make_tiny_draft(target, root / "draft", seed=3, block_size=4)[1]


@pytest.fixture(scope="module")
def known() -> dict:
    return {}


def engine(
    tiny: tuple[Path, Path],
    devices: tuple[str, ...] = ("cpu",),
    kv: Path | None = None,
    cache: bool = True,
    ring_cap: int = 4096,
):
    """Two running requests (a block pool), the draft in windows of 4, the cache's blocks
    in memory (and in `kv`)."""
    return engine_for(
        tiny[0],
        devices,
        draft=tiny[1],
        ring_cap=ring_cap,
        proposer_cls=Recording,
        context=256,
        block_size=4,
        max_running=2,
        prefix_cache_bytes=(16 << 20) if cache else 0,
        kv_cache_dir=kv,
        block_files=cache,
    )


def submit(
    e: Engine, prompt: list[int], max_tokens: int = TOKENS, wipe: bool = True
) -> RequestHandle:
    """Submit a request, with `wipe` every slot's ring first filled with NaN (none may be
    running): whatever its draft reads was written for it (computed, shared or restored),
    not left there by an earlier request."""
    for slot in range(e.limits.max_running if wipe else 0):
        ring = e.target.ring(slot)
        assert ring is not None
        ring.array.fill(np.nan)
    return e.submit(GenerationRequest("r", prompt, GREEDY, max_tokens, ignore_eos=True))


async def answer(e: Engine, handle: RequestHandle) -> Answer:
    """A request's answer once it ends (the contexts its slot's windows read)."""
    tokens, lps = await stream(handle)
    proposer = e.runner.proposer
    assert isinstance(proposer, Recording)
    contexts = proposer.read.pop(handle.slot, [])
    return Answer(tokens, lps, dict(handle.spec), contexts)


async def served(e: Engine, prompt: list[int]) -> tuple[Answer, int]:
    """(the answer, its cached tokens) of one request alone."""
    handle = submit(e, prompt)
    return await answer(e, handle), handle.cached_tokens


async def fresh(tiny, known: dict, prompts: dict, devices=("cpu",), ring_cap=4096) -> dict:
    """Each prompt's answer from a fresh engine without a cache (once per placement)."""
    todo = {k: p for k, p in prompts.items() if (k, devices, ring_cap) not in known}
    if todo:
        async with engine(tiny, devices, cache=False, ring_cap=ring_cap) as e:
            for name, p in todo.items():
                known[name, devices, ring_cap] = (await served(e, p))[0]
    return {k: known[k, devices, ring_cap] for k in prompts}


async def plain_tokens(tiny, prompts: dict) -> dict:
    """Autoregressive greedy tokens, no draft."""
    async with engine_for(tiny[0], context=256) as e:
        return {k: (await stream(submit(e, p, wipe=False)))[0] for k, p in prompts.items()}


def rows(context: bytes) -> np.ndarray:
    return np.frombuffer(context, dtype=np.float32)


def check(got: Answer, want: Answer) -> None:
    assert got.tokens == want.tokens
    assert got.logprobs == want.logprobs
    assert got.spec == want.spec and got.spec["drafts"] > 0
    assert len(got.contexts) == got.spec["drafts"]
    assert got.contexts == want.contexts


@pytest.mark.parametrize("devices", [("cpu",), SPLIT], ids=["unsplit", "split"])
async def test_a_restored_prompt_drafts_as_a_fresh_one(tiny, known, devices) -> None:
    """From memory: a second turn restores the first prompt's 6 blocks, a branch 3 of
    them; each answers as a fresh engine does (its draft reading the same contexts), and
    speculative equals autoregressive. The memory counts each block's ring rows."""
    want = await fresh(tiny, known, PROMPTS, devices)
    if devices == ("cpu",):
        plain = await plain_tokens(tiny, PROMPTS)
        assert {k: a.tokens for k, a in want.items()} == plain
    async with engine(tiny, devices) as e:
        got = {k: await served(e, p) for k, p in PROMPTS.items()}
        store = e.prefix_cache.blocks
        stats = e.prefix_cache.stats()
    assert {k: n for k, (_, n) in got.items()} == {"p": 0, "t": 96, "b": 48}
    for k, (a, _) in got.items():
        check(a, want[k])
    assert store.rings is not None
    # PROMPT's 6 blocks, TURN2's 2 more, BRANCH's 2 of its own: K/V and rows each.
    assert stats.memory_blocks == 10
    assert stats.memory_bytes == 10 * (store.record_bytes + store.rings.block_bytes)
    assert stats.memory_capacity % (store.record_bytes + store.rings.block_bytes) == 0


def ring_files(kv: Path, model: Path) -> list[Path]:
    parts = [p for p in (kv / model.name / BLOCKS).iterdir() if p.name.startswith("ring-")]
    assert len(parts) == 1
    return sorted(parts[0].glob(f"*{SUFFIX}"))


@pytest.mark.parametrize("devices", [("cpu",), SPLIT], ids=["unsplit", "split"])
async def test_a_restart_restores_the_blocks_and_their_rows_from_disk(
    tiny, known, devices, tmp_path: Path
) -> None:
    """One engine serves PROMPT and writes its 6 blocks to every worker's part and their
    ring rows to the rings' part; the next one on the directory restores the second turn's
    6 blocks from disk, rows included, and answers as fresh."""
    want = await fresh(tiny, known, PROMPTS, devices)
    kv = tmp_path / "kv"
    async with engine(tiny, devices, kv) as e:
        assert (await served(e, PROMPT)) == (want["p"], 0)
        await e.prefix_cache.save_all()
        assert e.prefix_cache.stats().disk_blocks == 6
    assert len(ring_files(kv, tiny[0])) == 6
    async with engine(tiny, devices, kv) as e:
        a, cached = await served(e, TURN2)
        assert cached == 96
        check(a, want["t"])


async def test_a_corrupt_ring_file_ends_the_restore_before_its_block(
    tiny, known, tmp_path: Path
) -> None:
    """A flipped byte in the rows of PROMPT's block 2 on disk: the branch restores only
    the 2 blocks before it (the file quarantined), and still answers as fresh."""
    want = await fresh(tiny, known, PROMPTS)
    kv = tmp_path / "kv"
    async with engine(tiny, ("cpu",), kv) as e:
        await served(e, PROMPT)
        await e.prefix_cache.save_all()
    key = prompt_keys(PROMPT, BLOCK)[2]
    (bad,) = [f for f in ring_files(kv, tiny[0]) if f.name == f"{key.hex()}{SUFFIX}"]
    raw = bytearray(bad.read_bytes())
    raw[-5] ^= 0xFF
    bad.write_bytes(bytes(raw))
    async with engine(tiny, ("cpu",), kv) as e:
        a, cached = await served(e, BRANCH)
        assert cached == 32
        check(a, want["b"])
        assert e.prefix_cache.blocks.restore_errors == 1
    assert (kv / tiny[0].name / QUARANTINE / bad.name).exists()


async def test_a_ring_shorter_than_the_prompt_needs_only_its_window(tiny, known) -> None:
    """A ring of 64 positions: PROMPT's save keeps the rows of its blocks from 48 on (the
    ring held [36, 100)). PROMPT again needs rows from 36: block 2 has none, so 2 blocks
    are restored; the second turn needs them from 66 only and restores all 6; a short
    prompt on PROMPT's first 40 tokens needs its 2 blocks' rows and restores nothing, but
    its save adds them, so the next such prompt restores both. Each answers as fresh."""
    short = {
        "s1": PROMPT[:40] + [(5 * i + 2) % 120 + 2 for i in range(10)],
        "s2": PROMPT[:40] + [(3 * i + 9) % 120 + 2 for i in range(10)],
    }
    order = [("p", PROMPT), ("p", PROMPT), ("t", TURN2), *short.items()]
    want = await fresh(tiny, known, {**PROMPTS, **short}, ring_cap=64)
    async with engine(tiny, ring_cap=64) as e:
        got = [await served(e, p) for _, p in order]
    assert [n for _, n in got] == [0, 32, 96, 0, 32]
    for (name, _), (a, _) in zip(order, got, strict=True):
        check(a, want[name])


async def test_a_sharer_of_a_restored_prefix_drafts_as_fresh(tiny, known) -> None:
    """Prefix sharing and the cache through one block table: the second turn restores
    PROMPT's blocks and their rows, and while it decodes a third request shares 120 of
    its prompt positions (more than the cache's 112), taking those rows from its ring;
    both answer as fresh. Its first window reads its prompt's rows, the shared ones
    included, bit for bit; later ones read rows its batched decode steps computed, which
    (without --batch-invariant) may differ in their last bits, as its logprobs may."""
    third = TURN2[:120] + [(9 * i + 4) % 120 + 2 for i in range(12)]
    want = await fresh(tiny, known, {"x": third})
    async with engine(tiny) as e:
        await served(e, PROMPT)
        long = submit(e, TURN2, 64)
        await anext(aiter(long))  # its prompt is in its K/V now
        sharer = submit(e, third, wipe=False)  # its slot's ring was wiped with the other
        got = await answer(e, sharer)
        long.cancel()
        assert e.totals["shared_prompt_tokens"] == 120
    assert long.cached_tokens == 96 and sharer.cached_tokens == 120
    assert got.tokens == want["x"].tokens and got.spec == want["x"].spec
    assert got.contexts[0] == want["x"].contexts[0]
    for ours, theirs in zip(got.contexts, want["x"].contexts, strict=True):
        np.testing.assert_allclose(rows(ours), rows(theirs), rtol=1e-5, atol=1e-5)


async def test_clear_gives_up_the_rows_with_their_blocks(tiny) -> None:
    async with engine(tiny) as e:
        await served(e, PROMPT)
        store = e.prefix_cache.blocks
        assert store.rings.memory_bytes == 6 * store.rings.block_bytes
        assert await e.prefix_cache.clear() == 6
        assert store.rings.memory_bytes == 0
