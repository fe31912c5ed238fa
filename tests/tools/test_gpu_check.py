"""tools/gpu_check.sh on the CPU (`--device cpu --quick`): the script a GPU session runs, so
it is known to work before one does. Its tests stage (the `cuda` tests against the CPU, a
few minutes) is skipped here; `tools/gpu_check.sh --device cpu` runs it. This checks the
script and the benchmark's plumbing on tiny shapes, nothing about a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SECTIONS = {"env", "bandwidth", "load", "decode", "matmul", "transfer", "verify", "batch",
            "compiled", "attention"}  # fmt: skip


def test_the_gpu_check_runs_on_the_cpu(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHON": sys.executable}
    proc = subprocess.run(
        ["tools/gpu_check.sh", "--device", "cpu", "--quick", "--skip", "tests", "--out",
         str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    report = json.loads((tmp_path / "report.json").read_text())
    stages = report["stages"]
    assert list(stages) == ["setup", "model", "bench", "done"]  # --quick: no http stage
    assert stages["setup"]["missing"] == [] and stages["done"]["ok"]
    bench = stages["bench"]["bench"]
    assert set(bench) == SECTIONS
    assert bench["env"]["device"] == "cpu"
    assert bench["decode"]["tok_per_s"]["graph"] > 0 and bench["decode"]["graph_captures"] == 0
    assert set(bench["batch"]["tok_per_s"]["graph"]) == {"1", "8"}
    assert bench["verify"]["graph_verify16_over_graph_step"] > 0
    assert set(bench["attention"]["us"]) == {"gather_b1_l512", "gather_b32_l512"}
    # The CPU's packed kernels are not traceable: the compiled section runs uncompiled.
    assert bench["compiled"]["tok_per_s"]["1"] > 0 and bench["compiled"]["compile_error"]
    assert {(s["out"], s["in"]) for s in bench["matmul"]["shapes"]} >= {(128, 128), (512, 128)}
    assert 4.5 <= bench["load"]["packed_bits_per_weight"] <= 5.5
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["bench.json", "bench.log", "report.json"]
    assert not list(Path("/tmp").glob(f"luced-gpu-check-*/{'tiny.gguf'}"))  # scratch removed
