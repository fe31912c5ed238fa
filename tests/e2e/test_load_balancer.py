"""Scale out by copies: two daemons behind HAProxy (Debian's package), configured by
systemd/haproxy.cfg.example with this machine's ports. Draining one node while clients
keep sending (plain and streamed) fails no request: the node's running requests finish,
what reached it after the drain began (its 503) or after it exited (a refused
connection) is retried on the other node, which serves everything from then on."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from daemon_proc import DaemonProcess, free_port

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "systemd" / "haproxy.cfg.example"
NAME = "llm.internal"  # the balancer's host name in the example: its checks send it

pytestmark = pytest.mark.skipif(
    shutil.which("haproxy") is None,
    reason="HAProxy is not installed (Debian: apt-get install haproxy; .ci/run installs it)",
)


@dataclass
class Outcome:
    node: str  # the balancer's X-Luced-Node: which daemon answered
    status: int
    finish: str  # the choice's finish_reason; the body when there is none
    error: str = ""


def haproxy_config(port: int, nodes: dict[str, int]) -> str:
    """The example with this machine's frontend port and daemons, checked every 3 s: a
    drained node gets requests before its check notices, which must be retried."""
    text = EXAMPLE.read_text()
    assert f"hdr Host {NAME}" in text
    text = re.sub(r"(?m)^    bind :8080$", f"    bind 127.0.0.1:{port}", text)
    text = re.sub(r"(?m)^    server .*\n", "", text)
    text = text.replace("inter 1s", "inter 3s")
    servers = "".join(f"    server {n} 127.0.0.1:{p}\n" for n, p in nodes.items())
    return text.rstrip("\n") + "\n" + servers


@pytest.fixture
def balanced(tiny_gguf: Path, tmp_path: Path) -> Iterator[tuple[str, dict[str, DaemonProcess]]]:
    """Daemons node1 and node2 behind a running HAProxy; its URL and the daemons."""
    nodes = {
        name: DaemonProcess(
            tiny_gguf, tmp_path / name, "--allowed-hosts", NAME, "--trusted-proxies", "127.0.0.1"
        ).start()
        for name in ("node1", "node2")
    }
    port = free_port()
    cfg = tmp_path / "haproxy.cfg"
    cfg.write_text(haproxy_config(port, {n: d.port for n, d in nodes.items()}))
    check = subprocess.run(["haproxy", "-c", "-f", str(cfg)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    log = (tmp_path / "haproxy.log").open("w")
    proc = subprocess.Popen(["haproxy", "-db", "-f", str(cfg)], stdout=log, stderr=log)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while {ask(url, stream=False, max_tokens=1).node for _ in range(4)} != set(nodes):
            assert time.monotonic() < deadline, "HAProxy never sent to both nodes"
            time.sleep(0.2)
        yield url, nodes
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()
        for d in nodes.values():
            d.stop()


def ask(url: str, stream: bool, max_tokens: int = 12) -> Outcome:
    """One chat completion through the balancer; the streamed one read to [DONE]."""
    body = {
        "messages": [{"role": "user", "content": "Tell me about the sea."}],
        "max_tokens": max_tokens,
        "stream": stream,
    }
    req = urllib.request.Request(
        url + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            node, raw = r.headers.get("X-Luced-Node", "?"), r.read().decode()
            status = r.status
    except urllib.error.HTTPError as e:
        return Outcome(e.headers.get("X-Luced-Node", "?"), e.code, e.read().decode())
    except OSError as e:
        return Outcome("?", 0, "", f"{type(e).__name__}: {e}")
    if not stream:
        return Outcome(node, status, json.loads(raw)["choices"][0]["finish_reason"] or raw)
    events = [line[6:] for line in raw.splitlines() if line.startswith("data: ")]
    if not events or events[-1] != "[DONE]":
        return Outcome(node, status, raw, "the stream did not end with [DONE]")
    chunks = [json.loads(e) for e in events[:-1]]
    if any("error" in c for c in chunks):
        return Outcome(node, status, raw, "an error event")
    ends = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    return Outcome(node, status, next((e for e in ends if e), raw))


def test_draining_a_node_behind_haproxy_fails_no_request(
    balanced: tuple[str, dict[str, DaemonProcess]],
) -> None:
    url, nodes = balanced
    outcomes: list[tuple[float, Outcome]] = []
    stop = threading.Event()

    def client(stream: bool) -> None:
        while not stop.is_set():
            sent = time.monotonic()
            # Long streams keep the drained node draining for a while: requests reach it
            # meanwhile and get its 503, before the next health check (every 3 s here).
            outcomes.append((sent, ask(url, stream, max_tokens=300 if stream else 12)))

    clients = [threading.Thread(target=client, args=(i % 2 == 1,)) for i in range(4)]
    for t in clients:
        t.start()
    try:
        while {o.node for _, o in outcomes} != set(nodes):  # both serve before the drain
            time.sleep(0.1)
        drained = nodes["node1"]
        drained.lucectl("drain", "--no-wait")
        assert drained.proc is not None
        drained.proc.wait(120)  # its running requests finished; it exited
        gone = time.monotonic()
        while len([1 for sent, _ in outcomes if sent > gone]) < 8:  # more, to node2 alone
            time.sleep(0.1)
    finally:
        stop.set()
        for t in clients:
            t.join(180)
    assert drained.proc.returncode == 0
    assert drained.segments() == []
    failed = [o for _, o in outcomes if o.status != 200 or o.error]
    assert failed == [], failed
    assert {o.finish for _, o in outcomes} <= {"length", "stop"}
    assert {o.node for sent, o in outcomes if sent > gone} == {"node2"}
