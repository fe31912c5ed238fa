"""Supervision end to end: a daemon stopped (SIGSTOP) far past its workers' deadlines
kills none of them when it continues; a worker start that never reports, or a port that
is taken, ends the daemon with one clear line naming what failed and what to change."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import time
from pathlib import Path

import openai
import pytest
from daemon_proc import DaemonProcess

from luced.runtime.tiny import make_tiny_gguf


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny") / "tiny-llama.gguf"
    make_tiny_gguf("llama", path, seed=5, context=4096)
    return path


def waiting_for_a_frame(pid: int, timeout: float = 30) -> None:
    """Until the worker's main thread sleeps (blocked reading its socket) for 0.3 s."""
    deadline, since = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
        if state != "S":
            since = None
        elif since is None:
            since = time.monotonic()
        elif time.monotonic() - since > 0.3:
            return
        time.sleep(0.01)
    raise AssertionError(f"worker {pid} did not answer within {timeout} s")


def test_a_stopped_daemon_kills_no_worker(tiny: Path, tmp_path: Path) -> None:
    """Mid-stream, the worker and then the daemon are stopped for 3 s, far past the
    0.5 s deadlines; the worker continues first and answers into the socket. When the
    daemon continues, that answer is read: the stream ends normally and the worker lives."""
    d = DaemonProcess(tiny, tmp_path, "--worker-timeout", "0.5", "--max-running", "1").start()
    pid = d.worker_pid()
    try:
        client = openai.OpenAI(base_url=d.url + "/v1", api_key="-", max_retries=0, timeout=120)
        stream = client.completions.create(
            model=d.model_name,
            prompt="hello world",
            max_tokens=2000,
            stream=True,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        chunks = iter(stream)
        next(chunks)
        os.kill(pid, signal.SIGSTOP)  # a call is in flight: the daemon waits for it
        os.kill(d.proc.pid, signal.SIGSTOP)
        time.sleep(3)
        os.kill(pid, signal.SIGCONT)
        waiting_for_a_frame(pid)  # it answered (on a loaded machine that takes a while)
        os.kill(d.proc.pid, signal.SIGCONT)
        rest = list(chunks)
        assert rest[-1].choices[0].finish_reason == "length"
        assert d.worker_pid() == pid
        log = d.log()
        assert "missed its deadline" not in log and "restarting worker" not in log
        assert "event loop stalled for" in log  # the watchdog's line
        lag, now = "luced:event_loop_lag_seconds", d.metrics()  # one scrape: ticks go on
        count, under = (
            d.metric(lag + "_count", scraped=now),
            d.metric(lag + "_bucket", 'le="1.0"', now),
        )
        assert count > under  # one lag over 1 s
    finally:
        for p in (pid, d.proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGCONT)
        assert d.stop() == 0
    assert d.segments() == []


def test_a_silent_worker_start_ends_the_daemon_with_a_clear_line(
    tiny: Path, tmp_path: Path
) -> None:
    d = DaemonProcess(
        tiny,
        tmp_path,
        "--worker-start-timeout",
        "2",
        env={"LUCED_TEST_WORKER_SLOW_START": "silent:60"},
    )
    with pytest.raises(RuntimeError, match="daemon exited with 2"):
        d.start()
    last = d.log().strip().splitlines()[-1]
    assert last.startswith("luced: loading the model: worker cpu (pid ")
    assert "did not start" in last and "raise --worker-start-timeout (now 2 s)" in last
    worker = int(re.search(r"\(pid (\d+)\)", last).group(1))
    assert not Path(f"/proc/{worker}").exists()  # killed, not left sleeping
    assert d.segments() == []


def test_a_taken_port_ends_the_daemon_with_a_clear_line(tiny: Path, tmp_path: Path) -> None:
    d = DaemonProcess(tiny, tmp_path)
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", d.port))
        holder.listen()
        with pytest.raises(RuntimeError, match="daemon exited with 2"):
            d.start()
    last = d.log().strip().splitlines()[-1]
    assert last == (
        f"luced: cannot listen on 127.0.0.1:{d.port}: Address already in use (choose "
        "another with --port or --host, or stop what holds it)"
    )
    assert d.segments() == []
