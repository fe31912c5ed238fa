"""A real Engine over a real Target (worker subprocesses, shared memory) for
loop-level tests: `async with engine_for(model, devices, ...) as engine`."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import torch

from luced.cache.arena import SnapshotArena
from luced.cache.disk import DiskIdentity, SnapshotDisk
from luced.cache.prefix_cache import PrefixCache
from luced.engine.config import KVConfig, ModelInfo, SchedulingLimits, SpeculationConfig
from luced.engine.core import Engine, GenerationRequest, RequestHandle
from luced.engine.driver import Driver
from luced.engine.executor import Deadlines
from luced.engine.kv.block_store import BlockStore
from luced.engine.kvflash import PagerConfig
from luced.engine.pooling import is_encoder
from luced.engine.remote import RemoteSettings
from luced.engine.spec.proposer import Proposer
from luced.engine.target import Target, TargetPlacement
from luced.gguf_file import GGUFFile
from luced.ipc.shm import ShmOwner
from luced.sampling_params import SamplingParams
from luced.serve.prefix_setup import uses_blocks
from luced.text.tokenizer import Tokenizer


@contextlib.asynccontextmanager
async def split_target(
    path: Path,
    devices: tuple[str, ...],
    weights: tuple[float, ...] = (),
    rows: int = 16,
    dtype: str = "float32",
    kv_capacity: int = 64,
    threads: int = torch.get_num_threads(),  # as in process: the float math is identical
    sequences: int = 8,
    remote: RemoteSettings | None = None,  # workers on other hosts (tcp:// devices)
) -> AsyncIterator[Driver]:
    """A bare Target over `devices` (layers shared by `weights`), `threads` per worker,
    driven by hand (`Driver`)."""
    gguf = GGUFFile(path)
    n_layers = int(gguf.require(f"{gguf.arch}.block_count"))
    with ShmOwner() as owner:
        placement = TargetPlacement.split(
            model=str(path),
            n_layers=n_layers,
            dtype=dtype,
            kv_capacity=kv_capacity,
            max_batch_tokens=32,
            devices=devices,
            weights=weights,
            threads=threads,
            logit_rows=rows,
        )
        target = Target(owner, placement, step_tokens=64, sequences=sequences, remote=remote)
        try:
            await target.start()
            yield Driver(target)
        finally:
            await target.close()


@contextlib.asynccontextmanager
async def engine_for(
    path: Path,
    devices: tuple[str, ...] = ("cpu",),
    *,
    draft: Path | None = None,
    draft_device: str | None = None,
    ring_cap: int = 4096,
    proposer_cls: type[Proposer] | None = None,
    context: int = 512,
    block_size: int = 16,
    prefix_cache_bytes: int = 0,
    lookup_drafts: bool = False,
    adaptive_blocks: bool = False,
    moe_hot: int | None = None,
    moe_expert_device: str | None = None,
    kv_flash: PagerConfig | None = None,
    kv_cache_dir: Path | None = None,
    block_files: bool = False,
    weights: str = "dequant",
    batch_invariant: bool = False,
    max_running: int = 1,
    kv_pool_tokens: int | None = None,
    kv_keep_tokens: int = 0,
    kv_dtype: str = "",
    kv_block: int | None = None,
    decode_graphs: str = "auto",
    decode_ahead: str = "auto",
    dtype: str = "float32",
    max_batch_tokens: int = 64,
    remote: RemoteSettings | None = None,
    deadlines: Deadlines | None = None,
) -> AsyncIterator[Engine]:
    """One worker thread each (2 cores, shared with the test); prompts longer than
    `max_batch_tokens` (64; the daemon's default is 512) span several prefill chunks. A
    draft (or the n-gram lookup) is set up for blocks up to 16, its feature rings of
    `ring_cap` positions (at most the context); adaptive blocks are calibrated before the
    first request. `kv_block` None: KV Flash's blocks, else blocks of 16 when several
    requests run, else one contiguous cache (the daemon's `--kv-block-size 0`; its one
    running request keeps blocks of 16 too). `block_files`: the prefix cache keeps K/V
    blocks by prefix key (engine/kv/block_store.py: `prefix_cache_bytes` of host records,
    and files in `kv_cache_dir`) instead of snapshots (the arena and snapshot files), as
    the daemon's does wherever it can (`ModelSpec.block_store`; once started,
    where the target gave it records: `uses_blocks`)."""
    if kv_block is None:
        kv_block = kv_flash.block if kv_flash is not None else 16 if max_running > 1 else 0
    gguf = GGUFFile(path)
    with ShmOwner() as owner:
        placement = TargetPlacement.split(
            model=str(path),
            n_layers=int(gguf.require(f"{gguf.arch}.block_count")),
            dtype=dtype,
            kv_capacity=context,
            max_batch_tokens=max_batch_tokens,
            devices=devices,
            threads=1,
            moe_hot=moe_hot,
            moe_expert_device=moe_expert_device,
            moe_dims=(
                int(gguf.get(f"{gguf.arch}.embedding_length", 0)),
                int(gguf.get(f"{gguf.arch}.expert_used_count", 0)),
            ),
            kv_sources=gguf.kv_sources(),  # as the daemon: a split keeps gemma4's pairs together
            weights_mode=weights,
            batch_invariant=batch_invariant,
            kv_dtype=kv_dtype,
            kv_block=kv_block,
            decode_graphs=decode_graphs,
        )
        target = Target(
            owner,
            placement,
            kv_flash=kv_flash,
            step_tokens=max_batch_tokens + max_running * block_size,
            sequences=max_running,
            remote=remote,
            deadlines=deadlines,
        )
        tokenizer = Tokenizer.from_gguf(gguf)
        engine = Engine(
            target,
            tokenizer,
            None,
            model=ModelInfo("t", context, encoder=is_encoder(gguf)),
            limits=SchedulingLimits(max_running=max_running),
            kv=KVConfig(kv_pool_tokens, kv_keep_tokens, prefix_cache_bytes if block_files else 0),
            speculation=SpeculationConfig(block_size, lookup_drafts, adaptive_blocks),
        )
        engine.runner.decode_ahead = decode_ahead
        if proposer_cls is not None:  # drafts of the test's own making
            engine.runner.proposer = proposer_cls(target)
        try:
            await target.start()
            if draft is not None:
                await target.load_draft(
                    str(draft), device=draft_device, ring_cap=ring_cap, block_size=16
                )
            if lookup_drafts:
                target.enable_lookup_drafts(16)
            if adaptive_blocks:
                await engine.calibrate()
            if prefix_cache_bytes:
                layout = await target.kv_layout()
                block_files = block_files and uses_blocks(target)
                arena, disk, blocks = None, None, None
                if block_files and kv_cache_dir is not None:  # K/V blocks, on disk too
                    blocks = await BlockStore.open(target, kv_cache_dir, path.name, 1 << 30)
                elif block_files:  # in host records only
                    blocks = BlockStore(target)
                else:
                    arena = SnapshotArena(owner, prefix_cache_bytes)
                if kv_cache_dir is not None and not block_files:  # snapshot files
                    ident = DiskIdentity(path.name, "none", f"{devices}", dtype)
                    disk = SnapshotDisk(kv_cache_dir, ident, layout)
                cache = PrefixCache(layout, arena, disk, exact_cuts=target.recurrent)
                cache.blocks = blocks
                engine.prefix_cache = cache
            engine.start()
            yield engine
        finally:
            await engine.stop()
            if engine.prefix_cache is not None:
                await engine.prefix_cache.close()
            await target.close()


async def generate(
    engine: Engine, prompt: list[int], max_tokens: int, **params
) -> tuple[list[int], RequestHandle, list]:
    """Greedy unless params say otherwise, to max_tokens (EOS ignored): (tokens, the finished
    handle, [(logprob, top ids)] per token when logprobs were asked)."""
    req = GenerationRequest(
        "r", prompt, SamplingParams(**{"temperature": 0, **params}), max_tokens, ignore_eos=True
    )
    handle = engine.submit(req)
    tokens, lps = [], []
    async for delta in handle:
        tokens += delta.token_ids
        lps += [(lp.logprob, [t[0] for t in lp.top]) for lp in delta.logprobs or []]
    assert handle.finish_reason == "length", handle.error
    return tokens, handle, lps


async def stream(handle: RequestHandle) -> tuple[list[int], list]:
    """A running request's tokens and [(logprob, top)] per token, once it ends by length."""
    ids, lps = [], []
    async for delta in handle:
        ids += delta.token_ids
        lps += [(lp.logprob, lp.top) for lp in delta.logprobs or []]
    assert handle.finish_reason == "length", handle.error
    return ids, lps


async def embed(engine: Engine, prompt: list[int], pooling: str = "mean") -> np.ndarray:
    """An embedding request's pooled vector (float32 [hidden]), once it ends."""
    handle = engine.submit(GenerationRequest("e", prompt, SamplingParams(), pooling=pooling))
    async for _ in handle:
        raise AssertionError("an embedding request streams no deltas")
    assert handle.finish_reason == "stop" and handle.embedding is not None, handle.error
    return handle.embedding
