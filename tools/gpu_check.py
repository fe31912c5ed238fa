#!/usr/bin/env python3
"""The GPU check's stages (run through tools/gpu_check.sh, which installs the carried
wheels first): each stage has a time budget, and the JSON report is rewritten after every
stage, so a run cut short still reports what it measured.

    setup   versions, the device, the packages the image lacks (carried as wheels)
    tests   pytest -m cuda tests/cuda (xdist), each check's numbers collected from
            LUCED_GPU_REPORT into checks.jsonl; junit.xml for the outcome of every test
    model   an 8B-shaped Q4_0 llama built on the machine (tools/make_shaped_gguf.py;
            --quick: 8 of its 32 layers; --device cpu: the tiny shape), or --model PATH
    bench   tools/bench_gpu.py on it -> bench.json
    http    tools/bench_http.py: a daemon on the device, 1, 8, 32, 64 concurrent clients, with
            and without --decode-ahead
            (skipped with --quick)

Output (--out, at most 8 files): report.json, checks.jsonl, junit.xml, tests.log,
bench.json, bench.log, http.log. `--device cpu` runs the same stages on the CPU (tiny shapes,
the `cuda` tests against the CPU: LUCED_CUDA_TESTS_ON=cpu), which proves the script, not
the GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NEEDED = ("torch", "numpy", "gguf", "posix_ipc", "llguidance", "pytest", "pytest_asyncio",
          "xdist", "pytest_timeout", "aiohttp", "uvloop", "msgpack", "tokenizers", "jinja2",
          "transformers", "prometheus_client", "safetensors", "tqdm")  # fmt: skip
# Seconds per stage on a GPU machine: (full, --quick); at most 8.8 minutes in all, 4.5 with
# --quick (a stage that runs out is killed and reported; the next one runs). The bench's
# last section compiles the step (torch.compile): about a minute of its budget.
# A CPU dry run gets CPU_SCALE times as long (2 shared cores run the same tests serially).
BUDGETS = {"setup": (20, 20), "tests": (140, 140), "model": (40, 20), "bench": (170, 90),
           "http": (160, 0)}  # fmt: skip
CPU_SCALE = 4


class Report:
    def __init__(self, out: Path, args: argparse.Namespace) -> None:
        self.path = out / "report.json"
        self.t0 = time.monotonic()
        self.data: dict = {"device": args.device, "quick": args.quick, "stages": {}}
        self.write()

    def stage(self, name: str, **values: object) -> None:
        values["elapsed_s"] = round(time.monotonic() - self.t0, 1)
        self.data["stages"][name] = values
        self.write()
        print(f"[gpu_check] {name}: {json.dumps(values)[:600]}", flush=True)

    def write(self) -> None:
        self.path.write_text(json.dumps(self.data, indent=1))


def run(cmd: list[str], log: Path, budget: float, env: dict | None = None, mode: str = "w") -> dict:
    """Run a stage's command with its output in `log` (and echoed), killed with every
    process it started when it outlasts `budget` seconds."""
    print(f"[gpu_check] $ {' '.join(cmd)}  (budget {budget:.0f} s)", flush=True)
    t0 = time.monotonic()
    with open(log, mode) as f:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}, start_new_session=True,
        )  # fmt: skip
        pump = threading.Thread(target=_echo, args=(proc, f), daemon=True)
        pump.start()
        timed_out = False
        try:
            proc.wait(timeout=budget)
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        pump.join(timeout=10)
    return {"rc": proc.returncode, "timed_out": timed_out, "seconds": time.monotonic() - t0}


def _echo(proc: subprocess.Popen, f) -> None:
    """Copy the stage's output as it comes (pytest's progress dots end no line)."""
    assert proc.stdout is not None
    while chunk := os.read(proc.stdout.fileno(), 65536):
        text = chunk.decode(errors="replace")
        f.write(text)
        f.flush()
        sys.stdout.write(text)
        sys.stdout.flush()


def setup(args: argparse.Namespace) -> dict:
    import importlib

    found, missing = {}, []
    for name in NEEDED:
        try:
            module = importlib.import_module(name)
            found[name] = getattr(module, "__version__", "?")
        except Exception as e:  # report every failure, whatever it is
            missing.append(f"{name}: {type(e).__name__}: {e}")
    info = {"python": platform.python_version(), "modules": found, "missing": missing}
    if "torch" in found:
        import torch

        info["cuda_available"] = torch.cuda.is_available()
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
            info["capability"] = list(torch.cuda.get_device_capability(0))
    info["dev_shm_free"] = shutil.disk_usage("/dev/shm").free
    return info


def junit_summary(path: Path) -> dict:
    if not path.exists():
        return {"junit": "missing"}
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root)
    counts = {
        k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")
    }
    failed = [
        f"{case.get('classname')}::{case.get('name')}"
        for s in suites
        for case in s.iter("testcase")
        if case.find("failure") is not None or case.find("error") is not None
    ]
    return {**counts, "failed": failed}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu-check-out")))
    ap.add_argument("--workers", type=int, default=0, help="pytest-xdist processes (0: auto)")
    ap.add_argument("--skip", default="", help="comma-separated stages to skip")
    ap.add_argument(
        "--model", type=Path, help="benchmark this GGUF instead of building the 8B-shaped one"
    )
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    report = Report(args.out, args)
    skip = set(filter(None, args.skip.split(",")))
    cpu = args.device == "cpu"
    scale = CPU_SCALE if cpu else 1
    budget = {k: scale * (v[1] if args.quick else v[0]) for k, v in BUDGETS.items()}
    py = sys.executable

    report.stage("setup", **setup(args))
    if report.data["stages"]["setup"].get("missing"):
        print("[gpu_check] modules missing: the stages below will say what fails", flush=True)
    if not cpu and not report.data["stages"]["setup"].get("cuda_available"):
        report.stage("abort", reason="no CUDA device visible to torch")
        return 2

    if "tests" not in skip:
        checks = args.out / "checks.jsonl"
        checks.unlink(missing_ok=True)
        workers = args.workers or (2 if cpu else 6)
        env = {"LUCED_GPU_REPORT": str(checks)}
        if cpu:
            env["LUCED_CUDA_TESTS_ON"] = "cpu"
        # pytest-benchmark (in the GPU image) warns under xdist, and warnings are errors here
        cmd = [py, "-m", "pytest", "-m", "cuda", "tests/cuda", "-p", "no:cacheprovider",
               "-p", "no:benchmark",
               "-n", str(workers), "--dist", "load", "-q", "-rfE",
               f"--junitxml={args.out / 'junit.xml'}"]  # fmt: skip
        result = run(cmd, args.out / "tests.log", budget["tests"], env)
        lines = checks.read_text().splitlines() if checks.exists() else []
        result |= junit_summary(args.out / "junit.xml")
        result["checks"] = [json.loads(line) for line in lines]
        report.stage("tests", **result)

    scratch = Path(tempfile.mkdtemp(prefix="luced-gpu-check-"))  # not in --out: GBs
    try:
        return _model_stages(args, report, skip, budget, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _model_stages(
    args: argparse.Namespace, report: Report, skip: set[str], budget: dict, scratch: Path
) -> int:
    cpu, py = args.device == "cpu", sys.executable
    model = scratch / ("tiny.gguf" if cpu else "llama3-8b-q4_0.gguf")
    if args.model is not None:  # a real model brought to the machine
        model = args.model.resolve()
        skip.add("model")
    if "model" not in skip:
        shape = ["--shape", "tiny"] if cpu else (["--layers", "8"] if args.quick else [])
        cmd = [py, "tools/make_shaped_gguf.py", str(model), *shape]
        result = run(cmd, args.out / "bench.log", budget["model"])
        report.stage("model", **result, path=str(model))

    if "bench" not in skip and model.exists():
        device = ["--device", "cpu"] if cpu else []
        quick = ["--quick"] if args.quick else []
        cmd = [py, "tools/bench_gpu.py", str(model), "--out", str(args.out / "bench.json"),
               *device, *quick]  # fmt: skip
        result = run(cmd, args.out / "bench.log", budget["bench"], mode="a")
        bench = args.out / "bench.json"
        result["bench"] = json.loads(bench.read_text()) if bench.exists() else None
        report.stage("bench", **result)

    if "http" not in skip and budget["http"] and model.exists():
        levels = "1,2" if cpu else "1,8,32,64"
        serve = "--target-devices cpu" if cpu else "--target-devices cuda:0 --dtype bfloat16"
        # each level with the worker decoding one step ahead and without (--decode-ahead)
        cmd = [py, "tools/bench_http.py", "--model", str(model), "--concurrency", levels,
               "--max-tokens", "32", "--prompt-tokens", "64", "--threads", "1",
               "--variants", "--decode-ahead off;--decode-ahead on", "--rounds", "1",
               "--serve-args", f"{serve} --max-running 64 --max-queue 128"]  # fmt: skip
        result = run(cmd, args.out / "http.log", budget["http"])
        result["tail"] = (args.out / "http.log").read_text().splitlines()[-16:]
        report.stage("http", **result)

    stages = report.data["stages"]
    ok = all(s.get("rc", 0) == 0 and not s.get("timed_out") for s in stages.values())
    report.stage("done", ok=ok)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
