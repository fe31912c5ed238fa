"""The model registry without workers: which models a config serves and with what settings,
the memory budget's choice of models to unload, and the HTTP answers of models not loaded
(the loads themselves: tests/e2e/test_models_daemon.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from luced.api.fields import APIError
from luced.ipc.shm import ShmOwner
from luced.serve.admin import CommandError
from luced.serve.config import Config, load_config
from luced.serve.models import Holder, ModelRegistry, plan_room
from luced.serve.options import ConfigError


def load(argv: list[str], toml: str | None = None, tmp_path: Path | None = None) -> Config:
    if toml is not None:
        assert tmp_path is not None
        (tmp_path / "luced.toml").write_text(toml)
        argv = ["--config", str(tmp_path / "luced.toml"), *argv]
    return load_config(argv, env={}, default_config_path=None)


@pytest.fixture
def models_dir(tmp_path: Path) -> Path:
    """A directory of three model files (their contents are never read here)."""
    d = tmp_path / "models"
    d.mkdir()
    for name in ("alpha", "beta", "qwen3:8b"):
        (d / f"{name}.gguf").write_bytes(b"GGUF")
    (d / "notes.txt").write_text("not a model")
    return d


# --- the memory budget --------------------------------------------------------------------


def test_plan_room_unloads_the_least_recently_used_idle_models() -> None:
    held = [
        Holder("a", 40, last_used=3.0, idle=True),
        Holder("b", 30, last_used=1.0, idle=True),
        Holder("c", 20, last_used=2.0, idle=False),  # serving: never chosen
    ]
    assert plan_room(held, need=10, budget=100) == []  # 90 + 10 fits
    assert plan_room(held, need=20, budget=100) == ["b"]  # the oldest idle one
    assert plan_room(held, need=60, budget=100) == ["b", "a"]  # 20 held by c + 60 fit
    assert plan_room(held, need=90, budget=100) is None  # c must finish first
    assert plan_room([], need=100, budget=100) == []


# --- which models, with which settings ---------------------------------------------------


def test_a_models_directory_serves_each_gguf_by_its_stem(models_dir: Path) -> None:
    registry = ModelRegistry(load(["--models-dir", str(models_dir)]), ShmOwner())
    assert list(registry.models) == ["alpha", "beta", "qwen3:8b"]
    assert not registry.single
    qwen = registry.models["qwen3:8b"]
    assert qwen.config.model.model == models_dir / "qwen3:8b.gguf"
    assert qwen.config.model.served_model_name() == "qwen3:8b"
    # each model's segments have a prefix of their own, made of safe characters
    assert [m.segments for m in registry.models.values()] == [
        "m1-alpha",
        "m2-beta",
        "m3-qwen3_8b",
    ]
    # a file put there later is found when a request names it
    (models_dir / "gamma.gguf").write_bytes(b"GGUF")
    assert registry.named("gamma").segments == "m4-gamma"


def test_per_model_tables_override_the_top_level(models_dir: Path, tmp_path: Path) -> None:
    toml = f"""
max_running = 2
context_length = 1024
models_dir = "{models_dir}"
model_keep_alive = 60

[models.alpha]
context_length = 512
kv_dtype = "bfloat16"
model_keep_alive = 0

[models.extra]
model = "/elsewhere/extra.gguf"
max_running = 4
"""
    registry = ModelRegistry(load([], toml, tmp_path), ShmOwner())
    assert list(registry.models) == ["alpha", "extra", "beta", "qwen3:8b"]
    alpha, extra, beta = (registry.models[n].config for n in ("alpha", "extra", "beta"))
    assert (alpha.model.context_length, alpha.kv.kv_dtype, alpha.scheduler.max_running) == (
        512,
        "bfloat16",
        2,
    )
    assert alpha.registry.model_keep_alive == 0 and beta.registry.model_keep_alive == 60
    assert extra.model.model == Path("/elsewhere/extra.gguf")
    assert (extra.scheduler.max_running, extra.model.context_length) == (4, 1024)
    assert alpha.model.model == models_dir / "alpha.gguf"  # the table took the dir's file
    assert alpha.sources["kv_dtype"] == f"{tmp_path / 'luced.toml'}: models.alpha.kv_dtype"
    assert not alpha.registry.several  # each model's config serves it alone


@pytest.mark.parametrize(
    ("argv", "toml", "message"),
    [
        (["--model", "a=/m/a.gguf", "/m/b.gguf"], None, "MODEL: not with --model"),
        (["--model", "a=/m/a.gguf", "--model-name", "x"], None, "--model-name: not with"),
        (["--model", "a=/x", "--model", "a=/y"], None, "--model: model 'a' given twice"),
        (["--model", "a b=/x"], None, "--model: bad model name 'a b'"),
        ([], "[models.a]\nmodel = '/a'\nport = 1", "models.a: 'port' is not a per-model"),
        ([], "[models.a]\nmodel = '/a'\nkernels = 'torch'", "'kernels' is not a per-model"),
        ([], "[models.a]\nmodel = '/a'\nmax_running = 0", "models.a.max_running: must be >= 1"),
        (
            [], "[models.a]\nmodel = '/a'\ncontext_length = 100\ndefault_max_tokens = 200",
            "models.a.default_max_tokens: 200 exceeds context_length 100",
        ),
        ([], "[models.a]\nmax_running = 2", "no model file for a"),
        (["--model", "a=/m/a.gguf", "--preload", "b"], None, "--preload: 'b' not served"),
    ],
)  # fmt: skip
def test_bad_model_settings_name_the_option(
    argv: list[str], toml: str | None, message: str, tmp_path: Path
) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        ModelRegistry(load(argv, toml, tmp_path), ShmOwner())


# --- what the HTTP side and lucectl see of models not loaded ------------------------------


def test_models_not_loaded_answer_without_loading(models_dir: Path) -> None:
    registry = ModelRegistry(load(["--models-dir", str(models_dir)]), ShmOwner())
    assert registry.health() == (
        200,
        {
            "status": "ok",
            "models": {"alpha": "unloaded", "beta": "unloaded", "qwen3:8b": "unloaded"},
        },
    )
    card = registry.card("beta")
    assert (card["id"], card["object"], card["state"]) == ("beta", "model", "unloaded")
    assert "max_model_len" not in card  # not known before its GGUF is read
    with pytest.raises(APIError) as exc:
        registry.card("gpt-4")
    assert (exc.value.status, exc.value.code) == (404, "model_not_found")
    assert "this server serves 'alpha', 'beta', 'qwen3:8b'" in exc.value.message
    assert registry.peek(None) is None and registry.peek("alpha") is None
    row = registry.rows()[0]
    assert (row["name"], row["state"], row["requests"], row["memory_bytes"]) == (
        "alpha",
        "unloaded",
        0,
        None,
    )
    with pytest.raises(CommandError, match="no model 'gpt-4'"):
        registry.named("gpt-4")


def test_a_request_must_name_one_of_several_models(models_dir: Path) -> None:
    registry = ModelRegistry(load(["--models-dir", str(models_dir)]), ShmOwner())

    async def lease(name: str | None) -> None:
        async with registry.lease(name):
            raise AssertionError("no lease for a name not served")

    with pytest.raises(APIError) as exc:
        asyncio.run(lease(None))
    assert (exc.value.status, exc.value.param) == (400, "model")
    with pytest.raises(APIError) as exc:
        asyncio.run(lease("gpt-4"))
    assert exc.value.status == 404
    assert all(m.leases == 0 for m in registry.models.values())


def test_draining_refuses_before_loading(models_dir: Path) -> None:
    registry = ModelRegistry(load(["--models-dir", str(models_dir)]), ShmOwner())
    registry.draining = True

    async def lease() -> None:
        async with registry.lease("alpha"):
            raise AssertionError("a draining daemon loads nothing")

    with pytest.raises(Exception, match="luced is draining") as exc:
        asyncio.run(lease())
    assert getattr(exc.value, "status", None) == 503
    assert registry.models["alpha"].state == "unloaded" and registry.models["alpha"].leases == 0
    assert registry.health()[0] == 503


def test_one_model_daemon_keeps_its_model(tmp_path: Path) -> None:
    registry = ModelRegistry(load([str(tmp_path / "solo.gguf")]), ShmOwner())
    assert registry.single and registry.only.pinned and registry.only.name == "solo"
    assert registry.only.segments == "target"  # the historical segment names
    with pytest.raises(CommandError, match="this daemon's only model"):
        asyncio.run(registry.unload("solo"))
