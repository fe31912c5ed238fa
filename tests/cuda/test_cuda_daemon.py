"""The real daemon on `--target-devices cuda:0`, end to end over HTTP (plain urllib: the GPU
machine has no openai package): a greedy chat against the same daemon on the CPU, the GPU
worker killed with SIGKILL and restarted, and no shared-memory segment left behind.
Skipped without a GPU."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from cuda_support import Run, agree, device_under_test, margins, record

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "e2e"))
from daemon_proc import DaemonProcess

from luced.runtime.tiny import make_tiny_gguf

pytestmark = pytest.mark.cuda

# Packed (int4) on both sides, but each side's own kernels: a near-tie may part them.
TOL = 0.25


def chat(d: DaemonProcess, text: str) -> Run:
    body = {
        "model": d.model_name,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 16,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 2,
        "ignore_eos": True,
    }
    req = urllib.request.Request(
        d.url + "/v1/chat/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        reply = json.loads(r.read())
    content = reply["choices"][0]["logprobs"]["content"]
    tops = [[t["logprob"] for t in c["top_logprobs"]] for c in content]
    return Run([c["token"] for c in content], margins(tops))


def test_chat_kill_and_recover_on_the_gpu(tmp_path: Path) -> None:
    gpu = device_under_test() or "cpu"
    model = make_tiny_gguf("llama", tmp_path / "tiny.gguf", seed=5, context=2048).path
    prompts = ("hello world", "the quick brown fox")
    cpu = DaemonProcess(model, tmp_path / "cpu", "--target-devices", "cpu").start()
    try:
        ref = [chat(cpu, p) for p in prompts]
    finally:
        assert cpu.stop() == 0
    d = DaemonProcess(model, tmp_path / "gpu", "--target-devices", gpu).start()
    try:
        got = [chat(d, p) for p in prompts]
        before = d.worker_pid()
        os.kill(before, signal.SIGKILL)
        deadline = time.monotonic() + 120
        while True:
            assert time.monotonic() < deadline, f"no worker came back:\n{d.log()}"
            time.sleep(0.2)
            try:
                pid = d.worker_pid()
            except Exception:  # the admin socket answers once the worker is listed again
                continue
            if pid != before and d.health()[0] == 200:
                break
        again = [chat(d, p) for p in prompts]
        segments = d.segments
    finally:
        status = d.stop()
    assert status == 0
    assert segments() == []
    record("daemon_vs_cpu", runs=[agree(r, g, TOL) for r, g in zip(ref, got, strict=True)])
    record("daemon_after_kill", runs=[agree(g, a, TOL) for g, a in zip(got, again, strict=True)])
