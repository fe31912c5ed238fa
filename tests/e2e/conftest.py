"""End-to-end tests: a daemon a test started is stopped even when the test fails, so a
failure costs that test, not the processes and /dev/shm segments of the rest of the run."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from daemon_proc import DaemonProcess

from luced.runtime.tiny import make_tiny_gguf


@pytest.fixture(autouse=True)
def stop_leftover_daemons() -> Iterator[None]:
    before = set(DaemonProcess.running)
    yield
    for daemon in DaemonProcess.running - before:
        daemon.stop(timeout=10)  # SIGTERM, then SIGKILL


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    """A tiny random llama (fast): for the queue, disconnect and failure paths."""
    path = tmp_path_factory.mktemp("tiny") / "tiny-llama.gguf"
    make_tiny_gguf("llama", path, seed=5, context=4096)
    return path


@pytest.fixture(scope="module")
def smol(smollm2_gguf, tmp_path_factory):
    """One SmolLM2 daemon with the default options, shared by a module's tests."""
    d = DaemonProcess(smollm2_gguf, tmp_path_factory.mktemp("smol")).start()
    yield d
    assert d.stop() == 0
    assert d.segments() == []


@pytest.fixture(scope="module")
def client(smol) -> openai.OpenAI:
    """The official openai client of `smol`."""
    return openai.OpenAI(base_url=smol.url + "/v1", api_key="none", max_retries=0, timeout=120)
