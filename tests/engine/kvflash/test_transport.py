"""KV Flash through the real Target: worker subprocesses, the moves in the spans, the host
tier and the qk scores in shared memory.

Oracles: with pool >= prompt + completion, greedy output equals the plain cache's
(in-process `generate`, which the split tests tie bitwise to the plain Target), unsplit
and split across workers; under eviction, the Target equals the same pager over the same
block tables and a paged cache run in this process (the moves and the host-tier copies
cross processes unchanged).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch
from engine_harness import Driver

from luced.engine.kv.blocks import BlockTables
from luced.engine.kv.pager import Pager
from luced.engine.kvflash.transport import KVFlashSettings, mean_scores, pager_config
from luced.engine.target import Target, TargetPlacement
from luced.gguf_file import GGUFFile
from luced.ipc.shm import ShmOwner, scan
from luced.runtime import kv_blocks
from luced.runtime.generate import generate
from luced.runtime.kv_host import HostTier
from luced.runtime.model import Model
from luced.runtime.tiny import make_tiny_gguf
from luced.sampling_params import SamplingParams

THREADS = torch.get_num_threads()
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("kvflash")
    out = {}
    for family in ("llama", "qwen3", "gemma3", "gemma4", "qwen35"):
        # qwen35: layers 3 and 7 attend, so each half of a split pools one.
        extra = {"gemma3": {}, "gemma4": {}, "qwen35": {"layers": 8}}.get(family, {"layers": 4})
        make_tiny_gguf(family, d / f"{family}.gguf", seed=5, **extra)
        out[family] = d / f"{family}.gguf"
    make_tiny_gguf("llama", d / "long.gguf", seed=5, layers=3, context=1024)
    out["long"] = d / "long.gguf"
    return out


@contextlib.asynccontextmanager
async def flash_target(
    path: Path,
    devices: tuple[str, ...],
    pool: int,
    context: int,
    policy: str = "lru",
    *,
    max_batch_tokens: int = 32,
    threads: int = THREADS,
) -> AsyncIterator[Driver]:
    gguf = GGUFFile(path)
    cfg = pager_config(KVFlashSettings(pool, policy=policy), pool, gguf)
    with ShmOwner() as owner:
        placement = TargetPlacement.split(
            model=str(path),
            n_layers=int(gguf.require(f"{gguf.arch}.block_count")),
            dtype="float32",
            kv_capacity=context,
            max_batch_tokens=max_batch_tokens,
            devices=devices,
            threads=threads,
            kv_sources=gguf.kv_sources(),  # as the daemon: gemma4's sharing pairs stay together
        )
        target = Target(owner, placement, kv_flash=cfg, step_tokens=max_batch_tokens)
        try:
            await target.start()
            yield Driver(target)
        finally:
            await target.close()
        instance = owner.instance
    assert not [s for s in scan() if instance in s.name]  # every segment unlinked


async def greedy(target: Driver, prompt: list[int], n: int) -> list[int]:
    s = await target.prefill(prompt, GREEDY)
    out = [s.token]
    while len(out) < n:
        out.append((await target.step(out[-1], GREEDY, None)).token)
    return out


PROMPT = [(7 * i + 3) % 97 + 2 for i in range(150)]  # spans 3 chunks, 5 prefill steps


@pytest.mark.parametrize(
    ("family", "devices"),
    [
        ("llama", ("cpu",)),
        ("llama", ("cpu", "cpu:1")),
        ("qwen3", ("cpu",)),
        ("qwen3", ("cpu", "cpu:1")),
        ("gemma3", ("cpu",)),
        ("gemma3", ("cpu", "cpu:1")),
        ("gemma4", ("cpu",)),
        ("gemma4", ("cpu", "cpu:1")),
        ("qwen35", ("cpu",)),
        ("qwen35", ("cpu", "cpu:1")),
    ],
)
async def test_pool_covering_the_sequence_equals_the_plain_cache(
    tiny: dict[str, Path], family: str, devices: tuple[str, ...]
) -> None:
    ref = Model.load(tiny[family])
    want = generate(ref, PROMPT, SamplingParams(temperature=0), 20).tokens
    async with flash_target(tiny[family], devices, pool=512, context=512) as target:
        assert await greedy(target, PROMPT, 20) == want
        assert target.target.resident(0, 169) == 169
        status = target.target.flash_status()
        assert status is not None and status["evictions"] == 0
        assert status["resident_blocks"] == 3  # positions 0..169


def in_process(
    path: Path, prompt: list[int], n: int, pool: int, step: int, policy: str = "lru"
) -> list[int]:
    """The same pager over the same tables, and a paged cache, in this process: the oracle
    for the transport. Each step as the runner and a worker run it: the pager's plan, the
    moves, the table's growth, the layers, and (qk) the scores when the plan made a
    reselection due. (The runner asks for a reselection at the end of a prompt longer
    than the pool; the Driver's sequences carry no prompt of their own, so neither does
    this.)"""
    context = 1024
    model = Model.load(path)
    cfg = pager_config(KVFlashSettings(pool, policy=policy), pool, GGUFFile(path))
    tables = BlockTables(cfg.n_blocks + 1, cfg.block, records=-(-context // cfg.block))
    pager = Pager(cfg, tables, 0)
    blocks = model.new_block_pool(cfg.block, max_blocks=tables.n_blocks)
    cache = model.new_paged_cache(blocks, context, scored=policy == "qk")
    host = HostTier(blocks.block_nbytes())
    scores = torch.zeros(2, -(-context // cfg.block))

    @torch.inference_mode()
    def feed(ids: list[int], start: int) -> int:
        for kind, j, block, record in pager.plan(start, len(ids)):
            cache.move(kind, j, block, host.record(record))
        due = pager.reselect_due()
        grown = tables.write(0, start, start + len(ids))
        cache.follow(grown.copies, grown.blocks)
        h, _ = model.forward_layers(model.embed(torch.tensor(ids)), cache, start)
        if due:
            kv_blocks.write_scores([cache], scores)
            pager.score(mean_scores(scores[0:1].numpy(), scores[1:2].numpy()))
        return int(model.logits(h[-1:]).argmax())

    for start in range(0, len(prompt), step):
        token = feed(prompt[start : start + step], start)
    out = [token]
    while len(out) < n:
        out.append(feed([out[-1]], len(prompt) + len(out) - 1))
    return out


@pytest.mark.parametrize("devices", [("cpu",), ("cpu", "cpu:1")])
async def test_eviction_across_processes_equals_the_in_process_pager(
    tiny: dict[str, Path], devices: tuple[str, ...]
) -> None:
    prompt = [(13 * i + 5) % 97 + 2 for i in range(700)]
    want = in_process(tiny["long"], prompt, 12, pool=512, step=32)
    async with flash_target(tiny["long"], devices, pool=512, context=1024) as target:
        assert await greedy(target, prompt, 12) == want
        status = target.target.flash_status()
        assert status is not None
        assert status["evictions"] >= 3 and status["paged_out_blocks"] >= 3
        assert status["resident_blocks"] == 8 and status["host_bytes"] > 0
        assert target.target.resident(0, 700) < 700  # paged out: no snapshot of it
        # A second request starts afresh.
        assert await greedy(target, prompt[:100], 3) == in_process(
            tiny["long"], prompt[:100], 3, pool=512, step=32
        )


@pytest.mark.parametrize("devices", [("cpu",), ("cpu", "cpu:1")])
async def test_qk_scores_cross_processes_and_recall_as_in_process(
    tiny: dict[str, Path], devices: tuple[str, ...]
) -> None:
    # Scores travel back in shared memory (split: each worker's layers, meaned in the
    # daemon); the reselections they drive, recalls included, match the in-process run.
    prompt = [(13 * i + 5) % 97 + 2 for i in range(700)]
    want = in_process(tiny["long"], prompt, 80, pool=512, step=32, policy="qk")
    async with flash_target(tiny["long"], devices, pool=512, context=1024, policy="qk") as target:
        assert await greedy(target, prompt, 80) == want
        status = target.target.flash_status()
        assert status is not None and status["policy"] == "qk"
        assert status["recalls"] > 0 and status["evictions"] > status["recalls"]
