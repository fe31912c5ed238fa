"""A real Engine over a real Target (worker subprocesses, shared memory) for
loop-level tests: `async with engine_for(model, devices, ...) as engine`."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

from luced.cache.arena import SnapshotArena
from luced.cache.prefix_cache import PrefixCache
from luced.engine.core import Engine
from luced.engine.target import Target, TargetPlacement
from luced.gguf_file import GGUFFile
from luced.ipc.shm import ShmOwner
from luced.text.tokenizer import Tokenizer


@contextlib.asynccontextmanager
async def engine_for(
    path: Path,
    devices: tuple[str, ...] = ("cpu",),
    *,
    draft: Path | None = None,
    draft_device: str | None = None,
    target_cls: type[Target] = Target,
    context: int = 512,
    block_size: int = 16,
    prefix_cache_bytes: int = 0,
    weights: str = "dequant",
) -> AsyncIterator[Engine]:
    """One worker thread each (2 cores, shared with the test); prompts longer than 64
    tokens span several prefill chunks. A draft is loaded for blocks up to 16."""
    gguf = GGUFFile(path)
    with ShmOwner() as owner:
        placement = TargetPlacement.split(
            model=str(path),
            n_layers=int(gguf.require(f"{gguf.arch}.block_count")),
            dtype="float32",
            kv_capacity=context,
            max_batch_tokens=64,
            devices=devices,
            threads=1,
            weights_mode=weights,
        )
        target = target_cls(owner, placement)
        tokenizer = Tokenizer.from_gguf(gguf)
        engine = Engine(
            target, tokenizer, None, model_name="t", context_length=context, block_size=block_size
        )
        try:
            await target.start()
            if draft is not None:
                await target.load_draft(str(draft), device=draft_device, block_size=16)
            if prefix_cache_bytes:
                arena = SnapshotArena(owner, prefix_cache_bytes)
                engine.prefix_cache = PrefixCache(
                    await target.kv_layout(), arena, exact_cuts=target.recurrent
                )
            engine.start()
            yield engine
        finally:
            await engine.stop()
            if engine.prefix_cache is not None:
                await engine.prefix_cache.close()
            await target.close()
