"""Placement flags -> workers and layer ranges: pure integers, every error names its flag."""

from __future__ import annotations

import itertools
import subprocess
import sys
from pathlib import Path

import pytest

from luced.engine.placement import (
    PlacementError,
    WorkerPlan,
    check_interpreters,
    layer_ranges,
    parse_devices,
    plan_workers,
)
from luced.runtime.tiny import make_tiny_gguf
from luced.serve.config import ConfigError, load_config


@pytest.mark.parametrize(
    ("n", "g", "w", "want"),
    [
        (64, 2, (1, 1), [(0, 32), (32, 64)]),
        (64, 2, (1, 3), [(0, 16), (16, 64)]),
        (30, 3, (), [(0, 10), (10, 20), (20, 30)]),
        (30, 3, (0.08, 0.46, 0.46), [(0, 2), (2, 16), (16, 30)]),
        (4, 3, (), [(0, 1), (1, 3), (3, 4)]),
        (3, 3, (100, 1, 1), [(0, 1), (1, 2), (2, 3)]),  # clamped: each keeps one layer
        (3, 3, (1, 1, 100), [(0, 1), (1, 2), (2, 3)]),
        (2, 1, (), [(0, 2)]),
    ],
)
def test_layer_ranges(n: int, g: int, w: tuple, want: list) -> None:
    assert layer_ranges(n, g, w) == want


def test_ranges_are_contiguous_nonempty_and_deterministic() -> None:
    for n in range(1, 40):
        for g in range(1, min(n, 6) + 1):
            for w in [(), tuple(range(1, g + 1)), tuple(range(g, 0, -1))]:
                r = layer_ranges(n, g, w)
                assert r == layer_ranges(n, g, w)
                assert r[0][0] == 0 and r[-1][1] == n
                assert all(a < b for a, b in r)
                assert all(x[1] == y[0] for x, y in itertools.pairwise(r))


def test_groups_become_workers() -> None:
    plans = plan_workers(["cuda:0", "cuda:1", "hip:0"], (0.08, 0.46, 0.46), 30)
    assert plans == [
        WorkerPlan("cuda", ("cuda:0", "cuda:1"), (0, 16), (2,), 30),
        WorkerPlan("hip", ("hip:0",), (16, 30), (), 30),
    ]
    assert plans[0].owns_embed and not plans[0].owns_head and plans[1].owns_head
    assert plans[0].shard_ranges() == [(0, 2), (2, 16)]
    # cpu, cpu:1, cpu:2 are distinct CPU workers; a repeated device is a second shard.
    cpus = plan_workers(["cpu", "cpu:1", "cpu:1", "cpu:2"], (), 8)
    assert [(p.group, p.devices, p.layers) for p in cpus] == [
        ("cpu", ("cpu",), (0, 2)),
        ("cpu:1", ("cpu:1", "cpu:1"), (2, 6)),
        ("cpu:2", ("cpu:2",), (6, 8)),
    ]


# Gemma 4's KV sharing cut mid-period (transformers allows it): layer 4 reads layer 3's KV,
# layer 5 layer 2's: boundaries 1 and 2 only.
MID_PERIOD = {4: 3, 5: 2}
# The tiny gemma4 (a whole period shared, as the released models): 3 and 4 read 1, 5 reads 2.
TINY_GEMMA4 = {3: 1, 4: 1, 5: 2}


@pytest.mark.parametrize(
    ("n", "g", "w", "sources", "want"),
    [
        (6, 2, (), MID_PERIOD, [(0, 2), (2, 6)]),  # 3 would cut 4 from 3 and 5 from 2
        (6, 2, (1, 5), MID_PERIOD, [(0, 1), (1, 6)]),  # already legal: unchanged
        (6, 3, (), MID_PERIOD, [(0, 1), (1, 2), (2, 6)]),  # 2, 4 -> 1 (room for one more), 2
        (6, 2, (5, 1), MID_PERIOD, [(0, 2), (2, 6)]),
        (6, 2, (), TINY_GEMMA4, [(0, 1), (1, 6)]),  # only 1 keeps every pair together
        (6, 2, (), {}, [(0, 3), (3, 6)]),
        # Sharing in the middle (not Gemma's, but the rule is general): 3 reads 1.
        (8, 2, (), {3: 1}, [(0, 4), (4, 8)]),
        (8, 4, (), {3: 1}, [(0, 1), (1, 4), (4, 6), (6, 8)]),  # 2 -> 1, nearer than 4
    ],
)
def test_layer_ranges_keep_kv_sharing_layers_with_their_source(
    n: int, g: int, w: tuple, sources: dict, want: list
) -> None:
    ranges = layer_ranges(n, g, w, kv_sources=sources)
    assert ranges == want
    assert all(a <= sources[i] < b for a, b in ranges for i in range(a, b) if i in sources)


def test_a_moved_boundary_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING", logger="luced.engine.placement"):
        plans = plan_workers(["cpu", "cpu:1"], (), 6, kv_sources=MID_PERIOD)
    assert [p.layers for p in plans] == [(0, 2), (2, 6)]
    assert "moved a shard boundary from layer 3 to 2" in caplog.text
    with pytest.raises(PlacementError, match="--target-devices: 4 shards for a model whose KV"):
        layer_ranges(6, 4, kv_sources=MID_PERIOD)


def test_split_plans_come_from_the_gguf_header(tmp_path: Path) -> None:
    """The daemon's path: the sharing pattern read torch-free from the file."""
    from luced.engine.target import TargetPlacement
    from luced.gguf_file import GGUFFile

    model = tmp_path / "g4.gguf"
    make_tiny_gguf("gemma4", model)
    sources = GGUFFile(model).kv_sources()
    assert sources == TINY_GEMMA4
    p = TargetPlacement.split(
        model=str(model),
        n_layers=6,
        dtype="float32",
        kv_capacity=64,
        max_batch_tokens=8,
        devices=["cpu", "cpu:1"],
        kv_sources=sources,
    )
    assert [plan.layers for _, plan in p.workers] == [(0, 1), (1, 6)]


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: parse_devices("cpu,gpu:0"), "--target-devices: unknown device 'gpu:0'"),
        (lambda: parse_devices("cpu,,cpu:1"), "--target-devices: empty device"),
        (lambda: parse_devices("cuda:x"), "--target-devices: unknown device"),
        (lambda: parse_devices("cpu,cpu:1,cpu"), "--target-devices: the devices of group 'cpu'"),
        (lambda: layer_ranges(2, 3), "--target-devices: 3 shards for a model of 2 layers"),
        (lambda: layer_ranges(8, 2, (1,)), "--target-layer-split: 1 weights for 2 devices"),
        (lambda: plan_workers(["cpu"], (), 0), "--target-devices: 1 shards for a model of 0"),
    ],
)
def test_placement_errors_name_the_flag(call, match: str) -> None:
    with pytest.raises(PlacementError, match=match):
        call()


def test_missing_interpreter_is_refused(tmp_path: Path) -> None:
    plans = plan_workers(["cpu", "cpu:1"], (), 4)
    check_interpreters(plans, {"cpu:1": sys.executable})
    with pytest.raises(PlacementError, match="--target-devices: group 'cpu:1' runs under"):
        check_interpreters(plans, {"cpu:1": str(tmp_path / "nope" / "python")})


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--target-devices", "tpu"], "--target-devices: unknown device 'tpu'"),
        (["--target-layer-split", "1,-2", "--target-devices", "cpu,cpu:1"], "positive"),
        (["--target-layer-split", "1,x"], "--target-layer-split: not a number"),
        (["--target-devices", "cpu,cpu:1", "--target-layer-split", "1,1,1"], "3 weights for 2"),
    ],
)
def test_config_errors(argv: list[str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        load_config(argv, env={}, default_config_path=None)


def test_config_values() -> None:
    cfg = load_config(
        ["--target-devices", "cpu, cpu:1", "--target-layer-split", "1,3"],
        env={},
        default_config_path=None,
    )
    assert cfg.model.target_devices == ("cpu", "cpu:1")
    assert cfg.model.target_layer_split == (1.0, 3.0)
    cfg = load_config([], env={"LUCED_TARGET_DEVICES": "cpu,cpu"}, default_config_path=None)
    assert cfg.model.target_devices == ("cpu", "cpu") and cfg.model.target_layer_split is None


def serve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "luced.cli", "serve", *args, "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_daemon_refuses_bad_placements_at_startup(tmp_path: Path) -> None:
    model = tmp_path / "tiny.gguf"
    make_tiny_gguf("llama", model)  # 2 layers
    out = serve(str(model), "--target-devices", "cpu,cpu:1,cpu:2")
    assert out.returncode == 2
    assert "--target-devices: 3 shards for a model of 2 layers" in out.stderr
    missing = tmp_path / "no-python"
    out = serve(str(model), "--target-devices", "cpu,cpu:1", "--backend-python", f"cpu:1={missing}")
    assert out.returncode == 2 and f"group 'cpu:1' runs under {missing}" in out.stderr
    out = serve(str(model), "--target-devices", "cpu:1,cpu", "--target-layer-split", "1,0")
    assert out.returncode == 2 and "--target-layer-split: weights must be positive" in out.stderr


def test_workers_share_the_cores_unless_threads_is_given() -> None:
    from luced.engine.target import TargetPlacement

    def threads(devices: list[str], cores: int, given: int | None = None) -> list[int | None]:
        p = TargetPlacement.split(
            model="m.gguf",
            n_layers=6,
            dtype="float32",
            kv_capacity=64,
            max_batch_tokens=8,
            devices=devices,
            threads=given,
            cores=cores,
        )
        return [spec.threads for spec, _ in p.workers]

    assert threads(["cpu"], cores=2) == [2]
    assert threads(["cpu", "cpu:1"], cores=2) == [1, 1]
    assert threads(["cpu", "cpu:1", "cpu:2"], cores=2) == [1, 1, 1]
    assert threads(["cpu", "cpu:1"], cores=8) == [4, 4]
    assert threads(["cpu", "cpu:1"], cores=2, given=2) == [2, 2]
