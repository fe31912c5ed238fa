"""A worker killed while requests wait: the real daemon on loopback, a tiny model.

Only the requests whose tokens were in the dead worker (the running ones) fail; the queued
ones wait for the restart and then give exactly what they give alone. A worker that cannot
come back ends the queue with a 503 instead of leaving it waiting.
"""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from daemon_proc import DaemonProcess

QUEUED = ("one two three", "the cat sat", "four five six")


def client(d: DaemonProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=d.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def complete(d: DaemonProcess, prompt: str, max_tokens: int = 12):
    return client(d).completions.create(
        model=d.model_name,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        extra_body={"ignore_eos": True},
    )


def streamed(d: DaemonProcess, prompt: str, max_tokens: int = 12) -> tuple[str, list[str]]:
    """A streamed completion's text and its chunks' finish reasons."""
    stream = client(d).completions.create(
        model=d.model_name,
        prompt=prompt,
        max_tokens=max_tokens,
        stream=True,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    with stream:
        chunks = [c.choices[0] for c in stream if c.choices]
    return "".join(c.text for c in chunks), [c.finish_reason for c in chunks if c.finish_reason]


def wait_for(cond, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def start_running(d: DaemonProcess, n: int) -> list[openai.Stream]:
    """n long greedy streams, each past its first token: they run until the crash (4000
    tokens take the tiny model seconds; the crash comes within a fraction of one)."""
    streams = []
    for _ in range(n):
        stream = client(d).completions.create(
            model=d.model_name,
            prompt="hello world",
            max_tokens=4000,
            stream=True,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        streams.append(stream)
        next(iter(stream))
    wait_for(lambda: d.metric("luced:num_requests_running") == n)
    return streams


def read_to_error(stream: openai.Stream) -> None:
    """A running stream ends with the error event once its worker died."""
    with stream, pytest.raises(openai.APIError, match="model worker failed"):
        for _ in stream:
            pass


def queue(d: DaemonProcess, pool: ThreadPoolExecutor, send=complete) -> list:
    """The QUEUED prompts sent behind the running streams; returns when all wait."""
    futures = [pool.submit(send, d, p) for p in QUEUED]
    wait_for(lambda: d.metric("luced:num_requests_waiting") == len(QUEUED))
    return futures


def finished(d: DaemonProcess, reason: str) -> float:
    return d.metric("luced:request_success_total", f'finished_reason="{reason}"')


@pytest.mark.parametrize("running", [1, 2])
def test_crash_fails_only_the_running_requests(tiny_gguf, tmp_path, running) -> None:
    d = DaemonProcess(
        tiny_gguf, tmp_path, "--max-running", str(running), "--max-queue", str(len(QUEUED))
    ).start()
    try:
        pid = d.worker_pid()
        with ThreadPoolExecutor(len(QUEUED)) as pool:
            streams = start_running(d, running)
            futures = queue(d, pool, streamed)
            os.kill(pid, signal.SIGKILL)
            for stream in streams:
                read_to_error(stream)
            crashed = [f.result(timeout=120) for f in futures]
        assert d.worker_pid() != pid
        assert [reasons for _, reasons in crashed] == [["length"]] * len(QUEUED)
        assert finished(d, "error") == running
        assert finished(d, "length") == len(QUEUED)
        alone = [complete(d, p).choices[0].text for p in QUEUED]
        assert [text for text, _ in crashed] == alone
    finally:
        assert d.stop() == 0
    assert d.segments() == []


def test_worker_that_cannot_restart_fails_the_queue(tiny_gguf, tmp_path) -> None:
    """The model file gone, the restarted worker cannot load it: the queued requests end
    with a 503 saying so (not a wait without end), /health says degraded and new requests
    get a 503; once the file is back, a later restart attempt serves again."""
    model = tmp_path / tiny_gguf.name
    model.write_bytes(tiny_gguf.read_bytes())
    d = DaemonProcess(model, tmp_path, "--max-running", "1").start()
    moved = model.with_suffix(".away")
    try:
        pid = d.worker_pid()
        with ThreadPoolExecutor(len(QUEUED)) as pool:
            (stream,) = start_running(d, 1)
            futures = queue(d, pool)
            model.rename(moved)
            os.kill(pid, signal.SIGKILL)
            read_to_error(stream)
            for f in futures:
                with pytest.raises(openai.APIStatusError) as refused:
                    f.result(timeout=120)
                assert refused.value.status_code == 503
                assert "could not be restarted" in refused.value.message
        assert d.health() == (503, {"status": "degraded"})
        with pytest.raises(openai.APIStatusError) as new:
            complete(d, "new")
        assert new.value.status_code == 503 and new.value.body["code"] == "unavailable"
        assert finished(d, "abort") == len(QUEUED)
        moved.rename(model)
        d.wait_health(200, 120)
        assert complete(d, "again").usage.completion_tokens == 12
    finally:
        if moved.exists():
            moved.rename(model)
        assert d.stop() == 0
    assert d.segments() == []
