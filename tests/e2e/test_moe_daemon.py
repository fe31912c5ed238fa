"""A real `luced serve --moe-hot-experts 4 --moe-expert-device cpu:1` on a tiny qwen3moe:
half of every layer's experts in an expert worker that the target worker calls directly.

One daemon for the story, its hot experts chosen by a routing profile that
tools/moe_profile.py recorded: greedy text equal to the all-local in-process run, the
expert worker listed by lucectl with its experts and the profile's placement, /metrics
counting its calls; kill -9 of the expert worker mid-decode: the request still finishes
with the same text (in-process fallback), the worker comes back and is called again, no
shared memory survives. With --moe-expert-required the same kill fails the request
cleanly and the daemon serves on. A profile of another model stops the start-up.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest
from daemon_proc import DaemonProcess
from test_daemon import ROOT, client, generate_tool

from luced.runtime import experts
from luced.runtime.tiny import make_tiny_gguf
from luced.serve.routing_profile import RoutingProfile

FLAGS = ("--moe-hot-experts", "4", "--moe-expert-device", "cpu:1")
PROMPT = "hello world"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("moe") / "tiny-qwen3moe.gguf"
    return make_tiny_gguf("qwen3moe", path, seed=5, qtype="Q8_0").path


@pytest.fixture(scope="module")
def profile(tiny: Path) -> Path:
    prompts = tiny.with_suffix(".txt")
    prompts.write_text(f"{PROMPT}\nthe quick brown fox\n")
    path = tiny.with_suffix(".routing.json")
    tool = ROOT / "tools" / "moe_profile.py"
    cmd = [sys.executable, str(tool), str(tiny), str(prompts), "-o", str(path), "--tokens", "8"]
    subprocess.run(cmd, check=True, capture_output=True, timeout=120)
    return path


def expert_worker(d: DaemonProcess) -> dict | None:
    workers = [w for w in d.lucectl_json("status")["placement"] if w.get("role") == "experts"]
    return workers[0] if workers else None


def wait_expert_worker(d: DaemonProcess, not_pid: int, timeout: float = 90) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        w = expert_worker(d)
        if w is not None and w["pid"] != not_pid and w["state"] == "ready":
            return w
        time.sleep(0.2)
    raise AssertionError(f"the expert worker did not come back:\n{d.log()}")


def stream_text(d: DaemonProcess, n: int, kill: int | None = None) -> str:
    """A greedy stream of n tokens; with `kill`, SIGKILL that pid after the first token."""
    stream = client(d).completions.create(
        model=d.model_name,
        prompt=PROMPT,
        max_tokens=n,
        stream=True,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    parts = []
    for chunk in stream:
        parts.append(chunk.choices[0].text if chunk.choices else "")
        if kill is not None:
            os.kill(kill, signal.SIGKILL)
            kill = None
    return "".join(parts)


def test_expert_worker_end_to_end(tiny: Path, profile: Path, tmp_path: Path) -> None:
    expect = generate_tool(tiny, PROMPT)["text"]  # all experts local, in process
    d = DaemonProcess(tiny, tmp_path, *FLAGS, "--moe-routing-profile", str(profile)).start()
    try:
        out = client(d).completions.create(
            model=d.model_name, prompt=PROMPT, max_tokens=24, temperature=0
        )
        assert out.choices[0].text == expect
        w = expert_worker(d)
        assert w is not None and w["devices"] == ["cpu:1"] and w["state"] == "ready"
        assert "cold experts" in w["experts"]
        counts = RoutingProfile.read(profile).counts
        assert w["fingerprint"] == experts.plan_for(tiny, 4, counts).fingerprint()
        assert "experts" in d.lucectl("workers").stdout
        calls = d.metric("luced:moe_remote_calls_total")
        assert calls > 0 and d.metric("luced:moe_remote_bytes_total") > 0
        assert d.metric("luced:moe_fallbacks_total") == 0

        before = stream_text(d, 64)  # remote throughout
        killed = stream_text(d, 64, kill=w["pid"])  # remote, then in process
        assert killed == before
        assert d.metric("luced:moe_fallbacks_total") > 0
        back = wait_expert_worker(d, w["pid"])
        assert back["restarts"] == 1
        calls = d.metric("luced:moe_remote_calls_total")
        assert stream_text(d, 16) == before[: len(stream_text(d, 16))]
        assert d.metric("luced:moe_remote_calls_total") > calls  # linked again
    finally:
        assert d.stop() == 0
    assert d.segments() == []


def test_required_expert_worker_fails_cleanly(tiny: Path, tmp_path: Path) -> None:
    d = DaemonProcess(tiny, tmp_path, *FLAGS, "--moe-expert-required").start()
    try:
        w = expert_worker(d)
        assert w is not None and w["state"] == "ready"  # started before the target's workers
        os.kill(w["pid"], signal.SIGKILL)
        with pytest.raises(openai.APIError):
            stream_text(d, 64)
        wait_expert_worker(d, w["pid"])
        out = client(d).completions.create(
            model=d.model_name, prompt=PROMPT, max_tokens=8, temperature=0
        )
        assert out.choices[0].text
    finally:
        assert d.stop() == 0
    assert d.segments() == []


def start_error(model: Path, tmp_path: Path, *flags: str) -> str:
    """The one `luced:` line of a daemon that refuses to start (exit 2, no worker)."""
    d = DaemonProcess(model, tmp_path, *flags)
    out = subprocess.run(d.args, capture_output=True, text=True, timeout=60, env=d.env)
    assert out.returncode == 2, out.stderr
    errors = [line for line in out.stderr.splitlines() if line.startswith("luced:")]
    assert len(errors) == 1 and "Traceback" not in out.stderr, out.stderr
    assert "serving cpu" not in out.stderr  # no worker started
    return errors[0]


def test_bad_routing_profiles_stop_the_start(tiny: Path, profile: Path, tmp_path: Path) -> None:
    other = make_tiny_gguf("qwen3moe", tmp_path / "other.gguf", seed=6, qtype="Q8_0").path
    flag = ("--moe-routing-profile", str(profile))
    assert start_error(other, tmp_path / "a", *FLAGS, *flag).startswith(
        "luced: --moe-routing-profile: recorded for another model: its routers"
    )
    assert start_error(tiny, tmp_path / "b", *flag).startswith(
        "luced: --moe-routing-profile: every expert is hot"
    )
