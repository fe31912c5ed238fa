"""sd_notify: datagrams as systemd receives them, on real AF_UNIX sockets."""

from __future__ import annotations

import logging
import os
import secrets
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from luced.serve import sdnotify


def receive(sock: socket.socket) -> bytes:
    sock.settimeout(5)
    return sock.recv(4096)


@pytest.fixture
def path_socket(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[socket.socket]:
    path = tmp_path / "notify"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(path))
        monkeypatch.setenv("NOTIFY_SOCKET", str(path))
        yield sock


@pytest.fixture
def abstract_socket(monkeypatch: pytest.MonkeyPatch) -> Iterator[socket.socket]:
    name = f"luced-test-notify-{os.getpid()}-{secrets.token_hex(4)}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)  # the abstract namespace: no file anywhere
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        yield sock


def test_ready_status_stopping_on_a_path_socket(path_socket: socket.socket) -> None:
    assert sdnotify.ready("model loaded; serving on 127.0.0.1:8000")
    assert receive(path_socket) == b"READY=1\nSTATUS=model loaded; serving on 127.0.0.1:8000"
    assert sdnotify.status("loading SmolLM2 (3/30 layers)")
    assert receive(path_socket) == b"STATUS=loading SmolLM2 (3/30 layers)"
    assert sdnotify.stopping("draining 2 streams")
    assert receive(path_socket) == b"STOPPING=1\nSTATUS=draining 2 streams"
    assert sdnotify.stopping()
    assert receive(path_socket) == b"STOPPING=1"
    assert sdnotify.ready()
    assert receive(path_socket) == b"READY=1"


def test_abstract_socket(abstract_socket: socket.socket) -> None:
    assert sdnotify.ready("up")
    assert receive(abstract_socket) == b"READY=1\nSTATUS=up"


def test_arbitrary_fields_and_one_line_values(path_socket: socket.socket) -> None:
    assert sdnotify.notify(mainpid=1234, status="two\nlines")
    assert receive(path_socket) == b"MAINPID=1234\nSTATUS=two lines"


def test_no_notify_socket_is_a_no_op(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert sdnotify.ready("x") is False
    assert sdnotify.stopping() is False


def test_send_failure_is_logged_not_raised(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "gone"))
    with caplog.at_level(logging.WARNING, logger="luced.serve.sdnotify"):
        assert sdnotify.status("x") is False
    assert "sd_notify" in caplog.text and "gone" in caplog.text
    monkeypatch.setenv("NOTIFY_SOCKET", "vsock:2:1234")
    assert sdnotify.ready() is False
