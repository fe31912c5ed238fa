"""The real daemon with its second stage on host B (`luced worker --listen`, tests/
remote_harness.py): it serves through the openai client as unsplit, `lucectl status` shows
the remote worker (address, link, round trip, bytes) and the hop's bytes per token; a
remote worker killed makes /health and new requests 503 with Retry-After until the worker
is back, and the daemon reconnects on its own; each host keeps its part of the prefix
cache's K/V blocks on its own disk, and a restarted daemon restores a prompt from both; a
daemon without the worker's key does not start, and says why."""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest
from daemon_proc import DaemonProcess
from remote_harness import WorkerProc, key_file

PROMPT = "the quick brown fox"
LONG = "the quick brown fox jumps over the lazy dog, and the dog sleeps on. " * 5


def completion(d: DaemonProcess, prompt: str = PROMPT, max_tokens: int = 12):
    client = openai.OpenAI(base_url=d.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    return client.completions.create(
        model=d.model_name, prompt=prompt, max_tokens=max_tokens, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip


def complete(d: DaemonProcess, prompt: str = PROMPT) -> str:
    return completion(d, prompt).choices[0].text


@pytest.fixture(scope="module")
def unsplit(tiny_gguf: Path, tmp_path_factory) -> dict[str, str]:
    """Each prompt's text from one daemon on one host, without a prefix cache."""
    tmp = tmp_path_factory.mktemp("unsplit")
    d = DaemonProcess(tiny_gguf, tmp, "--prefix-cache-bytes", "0").start()
    try:
        return {p: complete(d, p) for p in (PROMPT, LONG)}
    finally:
        d.stop()


def test_a_daemon_with_a_remote_stage_serves_shows_and_survives_its_loss(
    host, key: Path, tiny_gguf: Path, unsplit: dict[str, str], tmp_path: Path
) -> None:
    worker = WorkerProc(host, key, [tiny_gguf], 7370).start()
    d = DaemonProcess(
        tiny_gguf, tmp_path, "--target-devices", f"cpu,{worker.device()}",
        "--worker-key-file", str(key), "--worker-timeout", "3",
    ).start()  # fmt: skip
    try:
        assert complete(d) == unsplit[PROMPT]
        time.sleep(2.5)  # a heartbeat measures the round trip
        status = d.lucectl_json("status")
        remote = [w for w in status["placement"] if w["group"] == f"tcp://{worker.address}"]
        assert len(remote) == 1 and remote[0]["state"] == "ready"
        assert remote[0]["address"] == worker.address and remote[0]["link"] == "tcp"
        assert remote[0]["rtt_ms"] > 0 and remote[0]["sent_bytes"] > 0
        assert remote[0]["received_bytes"] > 0 and remote[0]["devices"] == [worker.device()]
        (hop,) = status["hops"]
        assert hop["link"] == "torch.distributed gloo" and hop["bytes_per_token"] > 0
        shown = d.lucectl("status").stdout
        assert worker.address in shown and "B/token" in shown

        worker.kill()
        d.wait_health(503, timeout=60)
        assert d.health()[1]["status"] == "degraded"
        request = urllib.request.Request(
            d.url + "/v1/completions", method="POST", headers={"Content-Type": "application/json"},
            data=b'{"model": "%s", "prompt": "x", "max_tokens": 2}' % d.model_name.encode(),
        )  # fmt: skip
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=30)
        assert refused.value.code == 503 and refused.value.headers["Retry-After"] == "1"

        worker.start()  # the daemon reconnects on its own
        d.wait_health(200, timeout=120)
        assert complete(d) == unsplit[PROMPT]
        assert "reconnecting to worker" in d.log()
    finally:
        assert d.stop() == 0
        worker.stop()
    assert d.segments() == []
    worker.wait_log("daemon disconnected")


def test_each_host_keeps_its_blocks_and_a_restarted_daemon_restores_from_both(
    host, key: Path, tiny_gguf: Path, unsplit: dict[str, str], tmp_path: Path
) -> None:
    """The default options (several running requests) with both hosts' --kv-cache-dir:
    each keeps its layers' part of the prompt's whole K/V blocks in its own files, by the
    same names; a restarted daemon restores them from both hosts, with the unsplit text."""
    a_dir, b_dir = tmp_path / "host-a", tmp_path / "host-b"
    worker = WorkerProc(host, key, [tiny_gguf], 7372, args=("--kv-cache-dir", str(b_dir))).start()
    args = ("--target-devices", f"cpu,{worker.device()}", "--worker-key-file", str(key),
            "--kv-cache-dir", str(a_dir))  # fmt: skip
    try:
        for run in ("one", "two"):
            d = DaemonProcess(tiny_gguf, tmp_path / run, *args).start()
            try:
                out = completion(d, LONG)
                n, cached = out.usage.prompt_tokens, out.usage.prompt_tokens_details.cached_tokens
                assert out.choices[0].text == unsplit[LONG]
                assert cached == (0 if run == "one" else (n - 1) // 16 * 16)
                d.lucectl_json("snapshot", "save")  # the daemon's writes landed
                assert d.lucectl_json("status")["prefix_cache"]["disk_blocks"] == n // 16
            finally:
                assert d.stop() == 0
            deadline = time.monotonic() + 60  # host B writes in the background
            while len(list(b_dir.glob("*/blocks/*/*.kvb"))) < n // 16:
                assert time.monotonic() < deadline, worker.lines[-20:]
                time.sleep(0.1)
        names = [sorted(p.name for p in r.glob("*/blocks/*/*.kvb")) for r in (a_dir, b_dir)]
        assert names[0] == names[1] and len(names[0]) == n // 16
    finally:
        worker.stop()


def test_a_daemon_without_the_key_does_not_start(
    host, key: Path, tiny_gguf: Path, tmp_path: Path
) -> None:
    worker = WorkerProc(host, key, [tiny_gguf], 7371).start()
    wrong = key_file(tmp_path, "w" * 40)
    d = DaemonProcess(
        tiny_gguf, tmp_path, "--target-devices", f"cpu,{worker.device()}",
        "--worker-key-file", str(wrong),
    )  # fmt: skip
    try:
        with pytest.raises(RuntimeError, match="daemon exited with 2"):
            d.start(timeout=120)
        assert "refused this daemon's key" in d.log()
        worker.wait_log("refused unauthenticated peer")
    finally:
        d.stop()
        worker.stop()
