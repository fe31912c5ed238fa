"""The prefix cache's blocks on disk (engine/kv/block_store.py) through the real Engine and
Target: a prompt's whole blocks saved by one engine are restored by the next one on the
same directory (a restart) as a page-in, and its output equals a fresh engine's, tokens and
logprobs bit for bit, unsplit and split over two local workers; the blocks read stay in
memory. A corrupt block file is quarantined and the prompt restored up to it; host records
running short restore and save fewer blocks; snapshot files of the older format are moved
aside with one log line. (The memory tier alone: test_block_records.py.)"""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path

import pytest
from engine_harness import engine_for, stream

from luced.cache.block_files import BLOCKS, SUFFIX, BlockFiles, prompt_keys
from luced.cache.files import QUARANTINE, QUARANTINE_KEEP
from luced.engine.core import Engine, GenerationRequest
from luced.engine.kv.block_store import retire_snapshots
from luced.runtime.tiny import make_tiny_gguf
from luced.sampling_params import SamplingParams

BLOCK = 16
PROMPT = [(7 * i + 3) % 120 + 2 for i in range(100)]  # 6 whole blocks and 4 positions
OTHER = PROMPT[:60] + [(13 * i + 1) % 120 + 2 for i in range(20)]  # 3 of PROMPT's blocks
THIRD = PROMPT[:60] + [(17 * i + 5) % 120 + 2 for i in range(20)]
GREEDY = SamplingParams(temperature=0, logprobs=2)
SPLIT = ("cpu", "cpu:1")

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("blocks") / "llama.gguf"
    return make_tiny_gguf("llama", path, seed=5, layers=4, context=512).path


@pytest.fixture(scope="module")
def known() -> dict[str, tuple[list[int], list]]:
    return {}


async def fresh_answers(tiny: Path, known: dict) -> dict[str, tuple[list[int], list]]:
    """Each prompt's greedy tokens and logprobs from an engine without a cache (once)."""
    if not known:
        async with engine_for(tiny, context=512) as plain:
            for name, p in (("p", PROMPT), ("o", OTHER), ("t", THIRD)):
                known[name] = (await served(plain, p))[0]
    return known


def engine(path: Path, kv: Path, devices: tuple[str, ...] = ("cpu",)):
    """Two running requests (a block pool), blocks in memory and on disk in `kv`."""
    return engine_for(
        path,
        devices,
        context=512,
        max_running=2,
        prefix_cache_bytes=16 << 20,
        kv_cache_dir=kv,
        block_files=True,
    )


async def served(e: Engine, prompt: list[int]) -> tuple[tuple[list[int], list], int]:
    """(tokens and logprobs, cached tokens) of one request."""
    handle = e.submit(GenerationRequest("r", prompt, GREEDY, 8, ignore_eos=True))
    out = await stream(handle)
    return out, handle.cached_tokens


def parts(kv: Path, path: Path) -> list[Path]:
    return sorted((kv / path.name / BLOCKS).iterdir())


async def save_prompt(path: Path, kv: Path, devices: tuple[str, ...]) -> tuple[list[int], list]:
    """One engine serves PROMPT (computed: its output is the fresh one) and writes its 6
    whole blocks to every worker's part."""
    async with engine(path, kv, devices) as e:
        out, cached = await served(e, PROMPT)
        assert cached == 0
        await e.prefix_cache.save_all()  # the block writes landed
        status = e.status()["prefix_cache"]
        assert (status["disk_blocks"], status["disk_entries"]) == (6, 0)
        assert status["disk_block_bytes"] > 0
    found = parts(kv, path)
    assert len(found) == len(devices)
    for part in found:
        assert len(list(part.glob(f"*{SUFFIX}"))) == 6
    return out


@pytest.mark.parametrize("devices", [("cpu",), SPLIT], ids=["unsplit", "split"])
async def test_blocks_saved_by_one_engine_restore_in_the_next_as_fresh(
    tiny: Path, known, devices, tmp_path: Path
) -> None:
    """A restart on the same directory: a prompt sharing the saved prompt's first 60
    tokens gets its first 3 blocks from disk (48 cached tokens), the prompt itself its 6
    whole blocks (96: the first 3 from memory, where the first restore left them, the
    rest from disk), and both answer with the fresh tokens and logprobs, bit for bit; the
    first one's 2 blocks of its own are saved too. Then, the memory emptied, the prompt
    and a third one sharing its first 60 tokens arrive together: the third does not share
    the prompt's blocks before they are paged in, it restores its own 3 from disk.
    `clear(disk=True)` deletes every block, in memory and on disk."""
    fresh = await fresh_answers(tiny, known)
    kv = tmp_path / "kv"
    assert await save_prompt(tiny, kv, devices) == fresh["p"]
    async with engine(tiny, kv, devices) as e:
        assert await served(e, OTHER) == (fresh["o"], 48)
        assert await served(e, PROMPT) == (fresh["p"], 96)
        cache = e.prefix_cache
        await cache.save_all()
        stats = cache.stats()
        assert (stats.hits, stats.hit_tokens, stats.disk_blocks) == (2, 48 + 96, 8)
        assert (stats.memory_blocks, stats.entries) == (8, 0)  # no snapshot, no arena
        assert await cache.clear() == 8  # in memory: the first's 5, the prompt's 3 read
        handles = [
            e.submit(GenerationRequest(name, p, GREEDY, 8, ignore_eos=True))
            for name, p in (("p", PROMPT), ("t", THIRD))
        ]
        # Batched, the logprobs may differ in their last bits (no --batch-invariant).
        got = [(await stream(h))[0] for h in handles]
        assert got == [fresh["p"][0], fresh["t"][0]]
        assert [h.cached_tokens for h in handles] == [96, 48]
        assert e.totals["shared_prompt_tokens"] == 0
        await cache.save_all()
        # The records in use are the memory's: the prompt's 6 blocks, the third's 2 own.
        assert e.target.blocks.used_records == cache.stats().memory_blocks == 8
        assert await cache.clear(disk=True) == 10  # every block, each once
        assert cache.stats().disk_blocks == 0
    assert all(not list(p.glob(f"*{SUFFIX}")) for p in parts(kv, tiny))


async def test_a_corrupt_block_file_is_quarantined_and_the_prompt_restored_before_it(
    tiny: Path, known, tmp_path: Path
) -> None:
    """Flipped bytes in the data of block 3's file of the second worker's part (they pass
    the scan, which reads headers and tokens): the restore reads blocks 0..2, finds block
    3 corrupt, moves its file to quarantine/ and restores 48 positions; the answer is the
    fresh one, and the prompt's save writes block 3 of that part again."""
    fresh = await fresh_answers(tiny, known)
    kv = tmp_path / "kv"
    await save_prompt(tiny, kv, SPLIT)
    name = prompt_keys(PROMPT, BLOCK)[3].hex() + SUFFIX
    bad = parts(kv, tiny)[1] / name
    data = bytearray(bad.read_bytes())
    data[-100:-50] = bytes(b ^ 0xFF for b in data[-100:-50])
    bad.write_bytes(bytes(data))
    async with engine(tiny, kv, SPLIT) as e:
        assert e.prefix_cache.stats().disk_blocks == 6  # the scan passed it
        assert await served(e, PROMPT) == (fresh["p"], 48)
        assert e.prefix.store is not None and e.prefix.store.restore_errors == 1
        await e.prefix_cache.save_all()
        assert e.target.blocks.used_records == e.prefix_cache.stats().memory_blocks == 6
    assert (kv / tiny.name / QUARANTINE / name).read_bytes() == bytes(data)
    assert bad.read_bytes() != bytes(data) and len(bad.read_bytes()) == len(data)


async def test_short_host_records_save_and_restore_fewer_blocks(
    tiny: Path, known, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The model's directory holds two snapshot files of the older format: they move to
    quarantine/ with one log line. With 2 host records free the prompt saves its first 2
    blocks only; after a restart, with none free nothing is restored, with 1 free its first
    block is (and stays in memory: no record is left to save the rest); every answer is
    the fresh one."""
    fresh = await fresh_answers(tiny, known)
    kv = tmp_path / "kv"
    old = kv / tiny.name
    old.mkdir(parents=True)
    for n in ("3f9a0c12d4e1", "aaaa0001"):
        (old / f"{n}.safetensors").write_bytes(b"an older daemon's snapshot")
    with caplog.at_level(logging.INFO):
        async with engine(tiny, kv) as e:
            said = [r.getMessage() for r in caplog.records if "older format" in r.getMessage()]
            assert len(said) == 1 and "2 snapshot files" in said[0]
            tables = e.target.blocks
            held = [tables.hold_record() for _ in range(tables.free_records - 2)]
            assert await served(e, PROMPT) == (fresh["p"], 0)
            await e.prefix_cache.save_all()
            assert e.prefix_cache.stats().disk_blocks == 2
            for record in held:
                tables.release_record(record)
    assert sorted(p.name for p in (old / QUARANTINE).iterdir()) == [
        "3f9a0c12d4e1.safetensors",
        "aaaa0001.safetensors",
    ]
    async with engine(tiny, kv) as e:
        tables = e.target.blocks
        held = [tables.hold_record() for _ in range(tables.free_records)]
        assert await served(e, OTHER) == (fresh["o"], 0)
        tables.release_record(held.pop())
        assert await served(e, PROMPT) == (fresh["p"], 16)
        for record in held:
            tables.release_record(record)
        assert tables.used_records == e.prefix_cache.stats().memory_blocks == 1


async def test_a_full_disk_pauses_block_writes_with_one_warning(
    tiny: Path,
    known,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The OS refuses the first block's write: one warning, the status says why, the
    blocks stay in memory only (a prompt sharing 3 of them restores them from there), the
    prompts after it write nothing while the pause lasts, and the answers are the fresh
    ones."""
    fresh = await fresh_answers(tiny, known)
    tries: list[bytes] = []

    def full(self: BlockFiles, parent: bytes, tokens, data) -> bytes:
        tries.append(parent)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(BlockFiles, "write", full)
    async with engine(tiny, tmp_path / "kv") as e:
        assert await served(e, PROMPT) == (fresh["p"], 0)
        await e.prefix_cache.save_all()
        assert await served(e, THIRD) == (fresh["t"], 48)  # PROMPT's blocks in memory
        await e.prefix_cache.save_all()
        stats = e.prefix_cache.stats()
        assert (stats.disk_error, stats.disk_blocks) == ("No space left on device (ENOSPC)", 0)
        assert len(tries) == 1 and e.target.blocks.used_records == stats.memory_blocks == 8
    said = [r for r in caplog.records if r.name == "luced.engine.kv.block_store"]
    assert [r.levelno for r in said] == [logging.WARNING]
    assert "cannot write K/V blocks to disk: No space left on device" in said[0].getMessage()


async def test_blocks_restored_from_memory_are_marked_used_on_disk(
    tiny: Path, known, tmp_path: Path
) -> None:
    """A prompt restored from memory marks its blocks used in the files too (their mtimes,
    the disk tier's LRU across restarts), so blocks kept hot in memory are not the first
    the files give up."""
    fresh = await fresh_answers(tiny, known)
    kv = tmp_path / "kv"
    async with engine(tiny, kv) as e:
        assert await served(e, PROMPT) == (fresh["p"], 0)
        await e.prefix_cache.save_all()
        (part,) = parts(kv, tiny)
        files = sorted(part.glob(f"*{SUFFIX}"))
        assert len(files) == 6
        for f in files:
            os.utime(f, (1_000_000_000, 1_000_000_000))  # long unused
        assert await served(e, PROMPT) == (fresh["p"], 96)  # from memory: no file read
        await e.prefix_cache.save_all()
    assert all(f.stat().st_mtime > 1_000_000_000 for f in files)


async def test_retired_snapshot_files_keep_the_quarantine_bounded(tmp_path: Path, caplog) -> None:
    """More old snapshot files than quarantine/ keeps: all leave the model's directory,
    one log line says so, and only the newest QUARANTINE_KEEP stay in quarantine/."""
    for i in range(QUARANTINE_KEEP + 4):
        (tmp_path / f"{i:08x}.safetensors").write_bytes(b"an older daemon's snapshot")
    with caplog.at_level(logging.WARNING):
        assert retire_snapshots(tmp_path) == QUARANTINE_KEEP + 4
    assert not list(tmp_path.glob("*.safetensors"))
    assert len(list((tmp_path / QUARANTINE).iterdir())) == QUARANTINE_KEEP
    assert sum("older format" in r.message for r in caplog.records) == 1
