"""The daemon's options reach the engine's groups (engine/config.py): each option group
builds its engine group (``for_engine``), and the loader gives them to the Engine."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from luced.engine.config import KVConfig, ModelInfo, SchedulingLimits, SpeculationConfig
from luced.engine.metrics import Metrics
from luced.ipc.shm import ShmOwner
from luced.runtime.tiny import make_tiny_gguf
from luced.serve.config import Config, load_config
from luced.serve.loader import LoadedModel, read_spec

# Every option an engine group takes, none at its default (the daemon's or the engine's).
ARGS = [
    "--model-name", "named", "--context-length", "300", "--pooling", "cls",
    "--max-running", "2", "--max-queue", "3", "--max-queued-tokens", "99",
    "--default-max-tokens", "7",
    "--kv-pool-tokens", "700", "--kv-keep-tokens", "40", "--prefix-cache-bytes", "8M",
    "--draft", "ngram", "--block-size", "5", "--adaptive-block-size", "true",
]  # fmt: skip


def engine_groups(cfg: Config, block_store: bool = True) -> list:
    """The engine groups of `cfg`, as the loader builds them (the GGUF's part given)."""
    return [
        cfg.model.for_engine(300, encoder=True, pooling="cls"),
        cfg.scheduler.for_engine(),
        cfg.kv.for_engine(300, 700, block_store),
        cfg.speculation.for_engine(),
    ]


def test_each_engine_group_takes_every_option_of_its_own() -> None:
    """A field the mapping dropped would keep the engine's default: none does."""
    cfg = load_config(["m.gguf", *ARGS], env={}, default_config_path=None)
    model, limits, kv, speculation = engine_groups(cfg)
    assert model == ModelInfo("named", 300, encoder=True, pooling="cls")
    assert limits == SchedulingLimits(
        max_running=2, max_queue=3, max_queued_tokens=99, default_max_tokens=7
    )
    assert kv == KVConfig(pool_tokens=700, keep_tokens=40, block_store=8 << 20)
    assert speculation == SpeculationConfig(block_size=5, lookup_drafts=True, adaptive_blocks=True)
    defaults = [ModelInfo("", 1), SchedulingLimits(), KVConfig(), SpeculationConfig()]
    for group, default in zip(engine_groups(cfg), defaults, strict=True):
        for f in dataclasses.fields(group):
            assert getattr(group, f.name) != getattr(default, f.name), (type(group), f.name)


def test_resolved_kv_values() -> None:
    """kv_keep_tokens auto keeps one context, at most a quarter of the pool; a model that
    keeps snapshots has no block store's bytes."""
    cfg = load_config(["m.gguf"], env={}, default_config_path=None)
    assert cfg.kv.for_engine(300, 700, block_store=False) == KVConfig(700, 175, 0)
    assert cfg.kv.for_engine(100, 700, block_store=True) == KVConfig(700, 100, 1 << 30)


async def test_the_loader_gives_the_engine_its_groups(tmp_path: Path) -> None:
    """The daemon's model build: what the options say is what the engine holds."""
    model = make_tiny_gguf("llama", tmp_path / "m.gguf", seed=1, layers=2, context=1024).path
    argv = [str(model), *ARGS, "--threads", "1"]
    cfg = load_config(argv, env={}, default_config_path=None)
    spec = read_spec(cfg)
    with ShmOwner() as owner:
        loaded = LoadedModel.build(spec, owner, Metrics(), "m1")
        try:
            engine = loaded.engine
            model_info, limits, _, _ = engine_groups(cfg)
            assert engine.model == dataclasses.replace(model_info, encoder=False)
            assert engine.limits == limits == engine.intake.limits
            windows = engine.speculation
            assert (windows.block_size, windows.lookup_drafts, windows.adaptive_blocks) == (
                5,
                True,
                True,
            )
            assert engine.kv.positions == 700
            assert engine.finished is not None and engine.finished.limit == 40
            assert engine.target.store_bytes == 8 << 20
        finally:
            await loaded.close()
