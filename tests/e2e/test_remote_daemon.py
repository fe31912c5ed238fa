"""The real daemon with its second stage on host B (`luced worker --listen`, tests/
remote_harness.py): it serves through the openai client as unsplit, `lucectl status` shows
the remote worker (address, link, round trip, bytes) and the hop's bytes per token; a
remote worker killed makes /health and new requests 503 with Retry-After until the worker
is back, and the daemon reconnects on its own; a daemon without the worker's key does not
start, and says why."""

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


def complete(d: DaemonProcess, max_tokens: int = 12) -> str:
    client = openai.OpenAI(base_url=d.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    out = client.completions.create(
        model=d.model_name, prompt=PROMPT, max_tokens=max_tokens, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    return out.choices[0].text


@pytest.fixture(scope="module")
def unsplit(tiny_gguf: Path, tmp_path_factory) -> str:
    d = DaemonProcess(tiny_gguf, tmp_path_factory.mktemp("unsplit")).start()
    try:
        return complete(d)
    finally:
        d.stop()


def test_a_daemon_with_a_remote_stage_serves_shows_and_survives_its_loss(
    host, key: Path, tiny_gguf: Path, unsplit: str, tmp_path: Path
) -> None:
    worker = WorkerProc(host, key, [tiny_gguf], 7370).start()
    d = DaemonProcess(
        tiny_gguf, tmp_path, "--target-devices", f"cpu,{worker.device()}",
        "--worker-key-file", str(key), "--worker-timeout", "3",
    ).start()  # fmt: skip
    try:
        assert complete(d) == unsplit
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
        assert complete(d) == unsplit
        assert "reconnecting to worker" in d.log()
    finally:
        assert d.stop() == 0
        worker.stop()
    assert d.segments() == []
    worker.wait_log("daemon disconnected")


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
