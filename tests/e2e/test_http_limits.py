"""The HTTP listener's limits on a real daemon: clients that open connections and send
nothing whole, or trickle a body, or send a huge one, cannot hold the daemon or its
other clients (the hardening issue's "bodies that stall everyone"), and one client
holding every connection cannot keep another out (the resilience issue)."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
import urllib.request

import make_tiny_gguf
import pytest
from daemon_proc import DaemonProcess
from test_daemon import raw_post


def _daemon(tmp_path_factory, http_timeout: str, max_connections: str):
    root = tmp_path_factory.mktemp("limits")
    model = root / "tiny-llama.gguf"
    make_tiny_gguf.build("llama", model, seed=5, context=4096)
    flags = ("--http-timeout", http_timeout, "--max-connections", max_connections)
    d = DaemonProcess(model, root, *flags).start()
    yield d
    assert d.stop() == 0
    assert d.segments() == []


CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def limited(tmp_path_factory):
    yield from _daemon(tmp_path_factory, "1.5", "4")


@pytest.fixture(scope="module")
def crowded(tmp_path_factory):
    """A daemon of 64 connections whose timeouts never free one during a test."""
    yield from _daemon(tmp_path_factory, "600", "64")


def connect(d: DaemonProcess) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", d.port), timeout=20)
    return s


# Another client: all of 127.0.0.0/8 is loopback (Linux), and the daemon sees the source.
OTHER_PEER = "127.0.0.2"


def ask_from(
    d: DaemonProcess, source: str, method: str, path: str, body: dict | None = None
) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", d.port, timeout=120, source_address=(source, 0))
    try:
        data = json.dumps(body).encode() if body is not None else None
        conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, json.loads(r.read())
    finally:
        conn.close()


def read_all(s: socket.socket) -> bytes:
    """Everything until the daemon closes the connection."""
    got = b""
    while True:
        try:
            chunk = s.recv(65536)
        except ConnectionResetError:
            return got
        if not chunk:
            return got
        got += chunk


def head(d: DaemonProcess, length: int) -> bytes:
    return (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{d.port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n"
    ).encode()


def test_half_headers_are_closed_and_extra_connections_refused(limited) -> None:
    d = limited
    half = [connect(d) for _ in range(4)]
    for s in half:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Le")
    time.sleep(0.2)
    extra = connect(d)  # over --max-connections: a 503 in the API's shape, then closed
    answer = read_all(extra)
    assert answer.startswith(b"HTTP/1.1 503")
    assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "too_many_connections"
    # The half-sent headers are dropped after --http-timeout, not kept forever.
    began = time.monotonic()
    assert all(read_all(s) == b"" for s in half)
    assert time.monotonic() - began < 15
    status, _, body = raw_post(d, "/v1/completions", b'{"prompt": "ok", "max_tokens": 2}')
    assert status == 200 and body["usage"]["completion_tokens"] == 2


def test_a_trickled_body_gets_408(limited) -> None:
    s = connect(limited)
    s.sendall(head(limited, 1000) + b'{"prompt": ')  # and never the rest
    answer = read_all(s)
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    error = json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]
    assert "did not arrive within 1.5 s" in error["message"]


def test_a_30mb_body_does_not_hold_up_a_small_request(limited) -> None:
    d = limited
    big = json.dumps({"prompt": "word " * 6_000_000, "max_tokens": 1}).encode()
    result: dict = {}

    def send_big() -> None:
        result["big"] = raw_post(d, "/v1/completions", big)

    t = threading.Thread(target=send_big)
    t.start()
    status, _, body = raw_post(d, "/v1/completions", b'{"prompt": "hi", "max_tokens": 2}')
    assert status == 200 and body["usage"]["completion_tokens"] == 2
    t.join(120)
    status, _, body = result["big"]  # more bytes than any request of 4096 tokens has
    assert status == 413 and "a context of 4096 tokens takes no more" in body["error"]["message"]
    assert d.health()[0] == 200


def test_oversized_headers_are_a_json_400(limited) -> None:
    s = connect(limited)
    s.sendall(
        f"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1:{limited.port}\r\n".encode()
        + b"X-Big: "
        + b"a" * 20000
        + b"\r\n\r\n"
    )
    answer = read_all(s)
    assert answer.split(b" ", 2)[1] == b"400", answer[:300]  # (HTTP/1.0: it never parsed)
    assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["type"] == "invalid_request_error"


def post_polling_health(d: DaemonProcess, body: bytes) -> tuple[int, dict]:
    """POST `body` to the chat route while /health is polled: every poll must be answered
    (a generous bound: once, a large request held the event loop for minutes)."""
    result: dict = {}
    sender = threading.Thread(target=lambda: result.update(big=raw_post(d, CHAT, body)))
    sender.start()
    polls = 0
    while sender.is_alive() or polls == 0:
        with urllib.request.urlopen(d.url + "/health", timeout=10) as r:
            assert r.status == 200
        polls += 1
        time.sleep(0.05)
    sender.join()
    status, _, reply = result["big"]
    return status, reply


def test_huge_tool_descriptions_are_refused_and_health_answers_meanwhile(limited) -> None:
    """The issue's body, 128 tools of 234 KB descriptions (30 MB), has more bytes than any
    request the context takes (413); one of 4 MB has fewer, but its text is still past the
    bound: a 400 naming tools, before any schema compiles or any template renders."""
    user = [{"role": "user", "content": "hi"}]
    for description_chars, answer in ((234_000, 413), (32_000, 400)):
        text = ("lorem ipsum dolor sit amet " * 8_700)[:description_chars]
        tools = [{"type": "function", "function": {"name": f"t{i}", "description": text}}
                 for i in range(128)]  # fmt: skip
        body = json.dumps({"messages": user, "tools": tools}).encode()
        status, reply = post_polling_health(limited, body)
        assert status == answer, reply
        if answer == 400:
            assert reply["error"]["param"] == "tools", reply


def test_a_corrupt_gzip_body_is_a_400_without_a_traceback(limited) -> None:
    d = limited
    for data in (b"not gzip at all", b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\x03garbage"):
        s = connect(d)
        s.sendall(
            f"POST {CHAT} HTTP/1.1\r\nHost: 127.0.0.1:{d.port}\r\n"
            "Content-Type: application/json\r\nContent-Encoding: gzip\r\n"
            f"Content-Length: {len(data)}\r\n\r\n".encode()
            + data
        )
        answer = read_all(s)  # answered, then closed: the rest of the stream is unreadable
        assert answer.startswith(b"HTTP/1.1 400"), answer[:200]
        error = json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]
        assert "cannot be decoded" in error["message"]
    assert d.health()[0] == 200
    log = d.log()
    assert "Traceback" not in log and "Unhandled exception" not in log, log[-3000:]


@pytest.mark.parametrize("held", ["kept-alive", "half-sent"])
def test_one_peer_holding_every_connection_cannot_keep_another_out(crowded, held) -> None:
    d = crowded
    conns = []
    try:
        for _ in range(80):  # from 127.0.0.1, past --max-connections 64
            s = connect(d)
            conns.append(s)
            if held == "kept-alive":  # one request answered, then idle
                s.sendall(f"GET /health HTTP/1.1\r\nHost: 127.0.0.1:{d.port}\r\n\r\n".encode())
                answer = b""
                while not answer.endswith(b"}") and (chunk := s.recv(65536)):
                    answer += chunk
            else:
                s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Le")
        # Another client: /health, a chat, and the admin socket are all answered.
        assert ask_from(d, OTHER_PEER, "GET", "/health") == (200, {"status": "ok"})
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        status, body = ask_from(d, OTHER_PEER, "POST", "/v1/chat/completions", chat)
        assert status == 200 and body["usage"]["completion_tokens"] == 2, body
        assert d.lucectl_json("status")["state"] == "ready"
    finally:
        for s in conns:
            s.close()
