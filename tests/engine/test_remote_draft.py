"""DFlash with the draft on another host (its feature rings' rows relayed to it by a local
worker over the hop "draft", engine/ring_relay.py), and with the target split across hosts
(the remote stage's captured cells come back inline): remote draft == plain decoding,
token for token, and == the same draft on this host, sampled requests included."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterator
from pathlib import Path

import pytest
from engine_harness import engine_for
from remote_harness import WorkerProc, settings

from luced.engine.core import Engine, GenerationRequest, RequestHandle
from luced.runtime.tiny import make_tiny_draft, make_tiny_gguf
from luced.sampling_params import SamplingParams

PORTS = itertools.count(7470)
PROMPTS = [[(7 * i + 3) % 120 + 2 for i in range(40)], [11, 12, 13, 14, 15, 16, 17, 18], [50, 2, 9]]


@pytest.fixture(scope="module")
def drafted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("rd")
    target = make_tiny_gguf("qwen3", root / "qwen3.gguf", seed=7, layers=8, context=512)
    return target.path, make_tiny_draft(target.path, root / "draft", seed=3, block_size=4)[1]


@pytest.fixture(scope="module")
def worker(host, key: Path, drafted: tuple[Path, Path]) -> Iterator[WorkerProc]:
    w = WorkerProc(host, key, list(drafted), next(PORTS)).start()
    yield w
    assert w.stop() == 0


def requests() -> list[GenerationRequest]:
    greedy = SamplingParams(temperature=0)
    reqs = [
        GenerationRequest(f"g{i}", p, greedy, 30, ignore_eos=True) for i, p in enumerate(PROMPTS)
    ]
    sampled = SamplingParams(temperature=0.8, seed=11)
    return [*reqs, GenerationRequest("s", PROMPTS[2], sampled, 30, ignore_eos=True)]


async def served(engine: Engine, together: bool) -> tuple[list[list[int]], list[int]]:
    """Each request's tokens and drafts: all at once, or one after another."""

    async def drain(handle: RequestHandle) -> list[int]:
        tokens = [t async for delta in handle for t in delta.token_ids]
        assert handle.finish_reason == "length", handle.error
        return tokens

    if together:
        handles = [engine.submit(r) for r in requests()]
        tokens = await asyncio.gather(*(drain(h) for h in handles))
    else:
        handles, tokens = [], []
        for r in requests():
            handles.append(engine.submit(r))
            tokens.append(await drain(handles[-1]))
    return list(tokens), [h.spec["drafts"] for h in handles]


@pytest.fixture(scope="module")
def references(drafted: tuple[Path, Path]) -> dict[str, list[list[int]]]:
    target, draft = drafted

    async def run() -> dict[str, list[list[int]]]:
        async with engine_for(target, context=256) as engine:
            plain, _ = await served(engine, together=False)
        async with engine_for(target, context=256, draft=draft, block_size=4) as engine:
            local, _ = await served(engine, together=False)
        return {"plain": plain, "local": local}

    return asyncio.run(run())


async def test_a_remote_draft_equals_plain_decoding_and_the_local_draft(
    worker: WorkerProc, key: Path, drafted: tuple[Path, Path], references: dict
) -> None:
    target, draft = drafted
    async with engine_for(
        target, context=256, draft=draft, draft_device=worker.device(), block_size=4,
        max_running=4, remote=settings(key, target, draft),
    ) as engine:  # fmt: skip
        tokens, drafts = await served(engine, together=True)
        relay = engine.target.ring_relay
        hops = {h["hop"]: h for h in engine.target.hops.describe()}
    assert min(drafts) > 0
    assert tokens[:3] == references["plain"][:3]  # greedy: plain decoding's, token for token
    assert tokens == references["local"]  # the sampled one too: the same draws
    assert relay is not None and relay.bytes > 0
    assert hops["draft"]["bytes"] == relay.bytes  # every ring row went over the hop


async def test_a_target_split_across_hosts_feeds_a_local_draft(
    worker: WorkerProc, key: Path, drafted: tuple[Path, Path], references: dict
) -> None:
    """The remote stage holds capture layers: their cells come back inline into the rings,
    which the draft (in its own local worker) reads in place."""
    target, draft = drafted
    async with engine_for(
        target, ("cpu", worker.device()), context=256, draft=draft, draft_device="cpu:1",
        block_size=4, max_running=4, remote=settings(key, target, draft),
    ) as engine:  # fmt: skip
        captures = engine.target.capture
        tokens, drafts = await served(engine, together=True)
    assert captures is not None and max(captures[0]) >= 4  # some on the remote half
    assert min(drafts) > 0
    assert tokens[:3] == references["plain"][:3]
    assert tokens == references["local"]
