"""Admin socket server and lucectl: real unix sockets, real SO_PEERCRED, real processes."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import uvloop

from luced.serve import lucectl
from luced.serve.admin import (
    AdminSocketError,
    peer_credentials,
    same_uid_or_root,
    start_admin_server,
)
from luced.serve.options import default_admin_socket
from luced.serve.prefix_setup import snapshot_handlers

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def sock_path() -> Iterator[Path]:
    # Short: unix socket paths are limited to 107 bytes, pytest's tmp_path can be longer.
    d = Path(tempfile.mkdtemp(prefix="luced-adm-"))
    yield d / "admin.sock"
    shutil.rmtree(d, ignore_errors=True)


async def ask(path: Path, *requests: bytes) -> list[dict[str, Any]]:
    """Send request lines on one connection; one parsed reply per line."""
    reader, writer = await asyncio.open_unix_connection(str(path))
    try:
        out = []
        for line in requests:
            writer.write(line + b"\n")
            await writer.drain()
            out.append(json.loads(await asyncio.wait_for(reader.readline(), 5)))
        return out
    finally:
        writer.close()
        await writer.wait_closed()


def cmd(name: str, **args: Any) -> bytes:
    return json.dumps({"cmd": name, **args}).encode()


# --- the server ---------------------------------------------------------------------------


async def test_socket_mode_is_0600_whatever_the_umask(sock_path: Path) -> None:
    old = os.umask(0)  # the most permissive umask must not leak into the socket's mode
    try:
        server = await start_admin_server(sock_path, {"status": lambda a: {}})
    finally:
        os.umask(old)
    async with server:
        st = sock_path.lstat()
        assert stat.S_ISSOCK(st.st_mode)
        assert stat.S_IMODE(st.st_mode) == 0o600
        assert st.st_uid == os.getuid()
    assert not sock_path.exists(), "close() must remove the socket file"


async def test_missing_directory_is_created_private(sock_path: Path) -> None:
    path = sock_path.parent / "run" / "luced" / "admin.sock"
    async with await start_admin_server(path, {}):
        assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700


async def test_unsafe_directory_is_refused(sock_path: Path) -> None:
    d = sock_path.parent / "open"
    d.mkdir()
    d.chmod(0o777)  # anyone could swap our socket here
    with pytest.raises(AdminSocketError, match="writable by others"):
        await start_admin_server(d / "admin.sock", {})
    d.chmod(0o1777)  # sticky, like /tmp: fine
    async with await start_admin_server(d / "admin.sock", {}):
        pass


async def test_protocol_replies_and_errors(sock_path: Path) -> None:
    seen: list[dict[str, Any]] = []

    async def status(args: dict[str, Any]) -> dict[str, Any]:
        seen.append(args)
        return {"state": "ready", "model": "m", "path": Path("/x.gguf")}

    def workers(args: dict[str, Any]) -> dict[str, Any]:  # plain functions are fine too
        return {"workers": [{"group": "cpu", "pid": 7}]}

    async def broken(args: dict[str, Any]) -> dict[str, Any]:
        raise RuntimeError("engine exploded")

    handlers = {"status": status, "workers": workers, "broken": broken, "bad": lambda a: [1]}
    async with await start_admin_server(sock_path, handlers):
        replies = await ask(
            sock_path,
            cmd("status", verbose=True),
            cmd("nope"),
            b"{not json",
            b"[1, 2]",
            cmd("broken"),
            cmd("bad"),
            cmd("workers"),  # the connection survived every error above
        )
    assert replies[0] == {"ok": True, "state": "ready", "model": "m", "path": "/x.gguf"}
    assert seen == [{"verbose": True}]
    assert replies[1]["ok"] is False
    assert replies[1]["error"] == "unknown command 'nope' (known: bad, broken, status, workers)"
    assert replies[2]["ok"] is False and replies[2]["error"].startswith("malformed JSON")
    assert replies[3] == {"ok": False, "error": 'a request is a JSON object with a string "cmd"'}
    assert replies[4] == {"ok": False, "error": "broken failed: engine exploded"}
    assert replies[5] == {"ok": False, "error": "bad returned list, not a mapping"}
    assert replies[6] == {"ok": True, "workers": [{"group": "cpu", "pid": 7}]}


async def test_overlong_request_is_refused(sock_path: Path) -> None:
    async with await start_admin_server(sock_path, {"status": lambda a: {}}):
        [reply] = await ask(sock_path, cmd("status", pad="x" * 70_000))
    assert reply == {"ok": False, "error": "request longer than 65536 bytes"}


async def test_a_number_python_will_not_read_is_an_error_reply(
    sock_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with await start_admin_server(sock_path, {"status": lambda a: {"state": "ready"}}):
        huge = b'{"cmd": "status", "n": ' + b"9" * 5000 + b"}"
        replies = await ask(sock_path, huge, cmd("status"))
    assert replies[0]["ok"] is False and replies[0]["error"].startswith("malformed JSON")
    assert replies[1] == {"ok": True, "state": "ready"}  # the same connection, still served
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


class Tiers:
    """The prefix cache as cache_clear sees it: what it was asked to clear."""

    def __init__(self) -> None:
        self.disk = None
        self.cleared: list[bool] = []

    async def clear(self, disk: bool = False) -> int:
        self.cleared.append(disk)
        return 0


async def test_cache_clear_takes_only_a_boolean_disk(sock_path: Path) -> None:
    tiers = Tiers()
    # What the verbs read; clearing also drops the finished requests' kept blocks.
    engine = SimpleNamespace(prefix_cache=tiers, tokenizer=None, drop_kept=lambda: 2)
    handlers = snapshot_handlers(lambda _: engine)  # type: ignore[arg-type, return-value]
    async with await start_admin_server(sock_path, handlers):
        replies = await ask(
            sock_path,
            cmd("cache_clear", disk="no"),
            cmd("cache_clear", disk=1),
            cmd("cache_clear", disk=False),
            cmd("cache_clear"),
            cmd("cache_clear", disk=True),
            cmd("snapshot_drop", id=12),
        )
    assert replies[0] == {"ok": False, "error": "disk must be true or false, got 'no'"}
    assert replies[1] == {"ok": False, "error": "disk must be true or false, got 1"}
    assert [r["ok"] for r in replies[2:5]] == [True, True, True]
    assert [r["kept_dropped"] for r in replies[2:5]] == [2, 2, 2]
    assert tiers.cleared == [False, False, True]  # "no" and 1 cleared nothing
    assert replies[5] == {"ok": False, "error": "id must be a string, got int"}


def test_lucectl_shows_paused_disk_writes() -> None:
    status = {"entries": 1, "memory_entries": 1, "disk_entries": 0, "disk_budget": None}
    line = lucectl._prefix_cache({**status, "disk_error": "No space left on device (ENOSPC)"})
    assert ", disk writes PAUSED: No space left on device (ENOSPC);" in line


def test_lucectl_shows_blocks_on_disk() -> None:
    status = {"entries": 1, "memory_entries": 1, "disk_entries": 0, "disk_bytes": 0}
    blocks = {"disk_budget": 8 << 30, "disk_blocks": 12, "disk_block_bytes": 3 << 20}
    line = lucectl._prefix_cache({**status, **blocks})
    assert ", disk 3.0 MiB of 8.0 GiB (12 K/V blocks);" in line


def test_lucectl_shows_blocks_in_memory() -> None:
    """A model that keeps prompts as K/V blocks: no snapshots, its blocks in host records."""
    status = {"entries": 0, "memory_entries": 0, "disk_entries": 0, "disk_budget": None}
    blocks = {"memory_blocks": 40, "memory_bytes": 10 << 20, "memory_capacity": 1 << 30}
    line = lucectl._prefix_cache({**status, **blocks})
    assert line.startswith("40 K/V blocks in memory, memory 10.0 MiB of 1.0 GiB;")
    listed = lucectl.render_snapshots({"snapshots": [], "blocks": {"memory": 40, "disk": 7}})
    assert (
        listed == "(no snapshots: this model keeps prompts as K/V blocks, 40 in memory, 7 on disk)"
    )


def test_lucectl_shows_a_hybrids_states_beside_its_blocks() -> None:
    """A hybrid keeps its recurrent states at block ends beside the blocks: counted too."""
    status = {"entries": 0, "memory_entries": 0, "disk_entries": 0, "disk_bytes": 0}
    blocks = {"memory_blocks": 40, "memory_states": 3, "memory_bytes": 10 << 20}
    disk = {"disk_budget": 8 << 30, "disk_blocks": 12, "disk_states": 2, "disk_block_bytes": 1}
    line = lucectl._prefix_cache({**status, **blocks, "memory_capacity": 1 << 30, **disk})
    assert line.startswith("40 K/V blocks, 3 recurrent states in memory, memory 10.0 MiB")
    assert "(12 K/V blocks, 2 recurrent states);" in line


async def test_concurrent_connections_do_not_wait_for_a_slow_command(sock_path: Path) -> None:
    release = asyncio.Event()

    async def drain(args: dict[str, Any]) -> dict[str, Any]:
        await release.wait()
        return {"state": "drained"}

    async with await start_admin_server(sock_path, {"drain": drain, "status": lambda a: {}}):
        slow = asyncio.create_task(ask(sock_path, cmd("drain")))
        assert await asyncio.wait_for(ask(sock_path, cmd("status")), 5) == [{"ok": True}]
        assert not slow.done()
        release.set()
        assert await asyncio.wait_for(slow, 5) == [{"ok": True, "state": "drained"}]


def test_peer_credentials_come_from_the_kernel() -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with a, b:
        assert peer_credentials(a) == (os.getpid(), os.getuid(), os.getgid())
    assert same_uid_or_root(os.getuid()) and same_uid_or_root(0)
    assert not same_uid_or_root(os.getuid() + 4242) or os.getuid() + 4242 == 0


async def test_same_uid_peer_is_served(sock_path: Path) -> None:
    # The real rule judges the uid the kernel reports; the wrapper only records it.
    judged: list[int] = []

    def check(uid: int) -> bool:
        judged.append(uid)
        return same_uid_or_root(uid)

    async with await start_admin_server(sock_path, {"status": lambda a: {}}, peer_allowed=check):
        assert await ask(sock_path, cmd("status")) == [{"ok": True}]
    assert judged == [os.getuid()]


async def test_foreign_uid_peer_is_refused(sock_path: Path) -> None:
    called = []
    only_someone_else = os.getuid() + 1000  # stands in for "the daemon's user"
    async with await start_admin_server(
        sock_path,
        {"status": lambda a: called.append(1) or {}},
        peer_allowed=lambda uid: uid == only_someone_else,
    ):
        reader, writer = await asyncio.open_unix_connection(str(sock_path))
        writer.write(cmd("status") + b"\n")
        reply = json.loads(await asyncio.wait_for(reader.readline(), 5))
        assert await asyncio.wait_for(reader.read(), 5) == b"", "connection must be closed"
        writer.close()
    assert reply["ok"] is False
    assert reply["error"].startswith(f"permission denied: uid {os.getuid()} may not use")
    assert called == [], "a refused peer's command must never run"


def _nobody_python() -> str | None:
    """An interpreter the nobody user can run (root only; the venv may sit under /root)."""
    if os.getuid() != 0:
        return None
    for exe in (sys.executable, shutil.which("python3"), "/usr/bin/python3"):
        if not exe:
            continue
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            r = subprocess.run(
                [exe, "-c", "pass"], user=65534, group=65534, extra_groups=[], timeout=10
            )
            if r.returncode == 0:
                return exe
    return None


CLIENT = """
import json, socket, sys
s = socket.socket(socket.AF_UNIX)
try:
    s.connect(sys.argv[1])
except OSError as e:
    print(type(e).__name__); sys.exit()
s.sendall(b'{"cmd": "status"}\\n')
print(s.makefile().readline().strip())
"""


async def test_a_real_foreign_user_cannot_get_in(sock_path: Path) -> None:
    python = _nobody_python()
    if python is None:
        pytest.skip("needs root and an interpreter the nobody user can run")
    sock_path.parent.chmod(0o755)  # let nobody reach the socket file itself

    async def as_nobody() -> str:
        proc = await asyncio.create_subprocess_exec(
            python, "-c", CLIENT, str(sock_path),
            stdout=subprocess.PIPE, user=65534, group=65534, extra_groups=[],
        )  # fmt: skip
        out, _ = await asyncio.wait_for(proc.communicate(), 10)
        return out.decode().strip()

    async with await start_admin_server(sock_path, {"status": lambda a: {"state": "ready"}}):
        # Mode 0600 alone keeps other users out ...
        assert await as_nobody() == "PermissionError"
        # ... and were the mode wrong, SO_PEERCRED would still refuse them.
        sock_path.chmod(0o666)
        reply = json.loads(await as_nobody())
    assert reply == {
        "ok": False,
        "error": f"permission denied: uid 65534 may not use this socket (only uid {os.getuid()} "
        "and root)",
    }


async def test_stale_socket_is_replaced_live_one_is_not(sock_path: Path) -> None:
    sock_path.parent.mkdir(exist_ok=True)
    dead = socket.socket(socket.AF_UNIX)
    dead.bind(str(sock_path))
    dead.close()  # the file stays: a daemon killed with -9 leaves exactly this
    assert sock_path.exists()
    async with await start_admin_server(sock_path, {"status": lambda a: {"n": 1}}):
        assert await ask(sock_path, cmd("status")) == [{"ok": True, "n": 1}]
        with pytest.raises(AdminSocketError, match="another luced is listening"):
            await start_admin_server(sock_path, {})
        assert await ask(sock_path, cmd("status")) == [{"ok": True, "n": 1}]


async def test_non_socket_file_is_never_replaced(sock_path: Path) -> None:
    sock_path.write_text("precious")
    with pytest.raises(AdminSocketError, match="not a socket"):
        await start_admin_server(sock_path, {})
    assert sock_path.read_text() == "precious"


# --- lucectl against a server on a uvloop in a background thread ----------------------------

# Shaped like luced.engine.core.Engine.status() / workers().
WORKERS = [
    {
        "group": "cpu",
        "devices": ["cpu"],
        "pid": 41234,
        "state": "ready",
        "layers": [0, 30],
        "uptime_s": 3720.1,
        "python": "/usr/bin/python3",
        "restarts": 1,
    }
]
# Shaped like a worker's stats frame (luced.runtime.backend.Backend.stats), which the
# daemon's `workers` verb adds to each row.
WORKER_STATS = {
    "pid": 41234,
    "group": "cpu",
    "rss_bytes": 612 * 2**20,
    "uptime_s": 3720.0,
    "forward_count": 1830,
    "tokens_processed": 20512,
    "busy_s": 41.25,
    "kv_position": 90,
    "decode_graph_steps": 1700,
    "ahead_served": 1650,
    "ahead_dropped": 12,
    "kernels": "native",
}
STATUS = {
    "model": "SmolLM2-135M-Instruct.Q4_1",
    "state": "ready",
    "context_length": 8192,
    "uptime_s": 3723.5,
    "queue": {
        "waiting": 2,
        "queued_tokens": 340,
        "running": 1,
        "max_queue": 16,
        "max_queued_tokens": 32768,
    },
    "totals": {"requests": 12, "prompt_tokens": 1234, "generation_tokens": 5678, "errors": 0},
    "placement": WORKERS,
    "prefix_cache": {
        "entries": 3,
        "memory_entries": 2,
        "disk_entries": 2,
        "memory_bytes": 3 * 2**20,
        "memory_capacity": 2**30,
        "disk_bytes": 5 * 2**20,
        "disk_budget": 8 * 2**30,
        "queries": 40,
        "hits": 7,
        "hit_tokens": 3500,
    },
}
SNAPSHOTS = [
    {
        "id": "a1b2c3",
        "tokens": 512,
        "bytes": 3 * 2**20,
        "tier": "memory",
        "hits": 4,
        "last_used_ago": 75,  # seconds; made absolute when the handler answers
        "prefix": "<|im_start|>system\nYou are a helpful AI assistant named SmolLM",
        "suffix": "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n",
    }
]


METRICS_TEXT = (
    "# HELP luced:num_requests_running Number of requests in model execution.\n"
    "# TYPE luced:num_requests_running gauge\n"
    'luced:num_requests_running{model_name="smol"} 1.0\n'
)


class FakeDaemon:
    """An admin server with realistic handlers, served from a uvloop in another thread."""

    def __init__(self, path: Path, snapshots: list[dict[str, Any]]) -> None:
        self.path = path
        self.calls: list[str] = []
        self.snapshots = snapshots

    def handlers(self) -> dict[str, Any]:
        async def status(args: dict[str, Any]) -> dict[str, Any]:
            self.calls.append("status")
            return STATUS

        async def workers(args: dict[str, Any]) -> dict[str, Any]:
            self.calls.append("workers")
            return {"workers": [{**w, "stats": WORKER_STATS} for w in WORKERS]}

        async def drain(args: dict[str, Any]) -> dict[str, Any]:
            self.calls.append("drain")
            await asyncio.sleep(0.05)
            return {"state": "draining", "in_flight": 1}

        async def snapshot_list(args: dict[str, Any]) -> dict[str, Any]:
            self.calls.append("snapshot_list")
            # Last use is relative to the moment of the call, so the age printed is stable.
            now = time.time()
            return {
                "snapshots": [
                    {k: v for k, v in s.items() if k != "last_used_ago"}
                    | {"last_used": now - s["last_used_ago"]}
                    for s in self.snapshots
                ]
            }

        async def metrics(args: dict[str, Any]) -> dict[str, Any]:
            self.calls.append("metrics")
            return {"text": METRICS_TEXT}

        return {
            "status": status,
            "workers": workers,
            "metrics": metrics,
            "drain": drain,
            "snapshot_list": snapshot_list,
        }


def _serve(path: Path, snapshots: list[dict[str, Any]], **kwargs: Any) -> Iterator[FakeDaemon]:
    fake = FakeDaemon(path, snapshots)
    loop = uvloop.new_event_loop()
    server = loop.run_until_complete(start_admin_server(path, fake.handlers(), **kwargs))
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield fake
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        server.close()
        loop.run_until_complete(server.wait_closed())
        loop.close()


@pytest.fixture
def daemon(sock_path: Path) -> Iterator[FakeDaemon]:
    yield from _serve(sock_path, [])


@pytest.fixture
def daemon_with_snapshots(sock_path: Path) -> Iterator[FakeDaemon]:
    yield from _serve(sock_path, SNAPSHOTS)


def run_ctl(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = lucectl.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_lucectl_status_table(daemon: FakeDaemon, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_ctl(capsys, "--socket", str(daemon.path), "status")
    assert (code, err) == (0, "")
    head, workers = out.split("\n\nworkers\n")
    fields = dict(re.split(r"\s{2,}", line, maxsplit=1) for line in head.splitlines())
    assert fields == {
        "model": "SmolLM2-135M-Instruct.Q4_1",
        "state": "ready",
        "placement": "cpu [cpu]: [0, 30)",
        "uptime": "1h 02m 03s",
        "queue": "1 running, 2 waiting (max 16), 340 prompt tokens waiting (max 32768)",
        "totals": "12 requests, 1234 prompt tokens, 5678 generation tokens, 0 errors",
        "context_length": "8192",
        "prefix_cache": "3 snapshots (2 in memory, 2 on disk), memory 3.0 MiB of 1.0 GiB, disk "
        "5.0 MiB of 8.0 GiB; 7 hits (3500 tokens) in 40 lookups",
    }
    # values are aligned in one column
    lines = head.splitlines()
    assert len({ln.index(v) for ln, v in zip(lines, fields.values(), strict=True)}) == 1
    header, row = workers.splitlines()
    assert header.split() == [
        "GROUP", "PID", "STATE", "DEVICES", "LAYERS", "RESTARTS", "UPTIME", "PYTHON",
    ]  # fmt: skip
    assert row.split() == [
        "cpu", "41234", "ready", "cpu", "[0,", "30)", "1", "1h", "02m", "00s", "/usr/bin/python3",
    ]  # fmt: skip
    assert daemon.calls == ["status"]


def test_lucectl_workers_table_is_aligned(
    daemon: FakeDaemon, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = run_ctl(capsys, "--socket", str(daemon.path), "workers")
    assert code == 0
    header, row = out.splitlines()
    assert header.startswith("GROUP    PID  STATE  DEVICES  LAYERS   RESTARTS  UPTIME      PYTHON")
    # text columns start under their header, numeric ones end under it
    assert row.index("ready") == header.index("STATE")
    assert row.index("41234") + len("41234") == header.index("PID") + len("PID")
    assert row.index("[0, 30)") == header.index("LAYERS")
    assert row.index("1830") + len("1830") == header.index("FORWARDS") + len("FORWARDS")


def test_lucectl_workers_shows_the_worker_counters(
    daemon: FakeDaemon, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run_ctl(capsys, "--socket", str(daemon.path), "workers")
    assert (code, err) == (0, "")
    header, row = (re.split(r"\s{2,}", line.strip()) for line in out.splitlines())
    cells = dict(zip(header, row, strict=True))
    assert header[-7:] == [
        "RSS", "BUSY", "FORWARDS", "TOKENS", "GRAPH_STEPS", "AHEAD_SERVED", "AHEAD_DROPPED",
    ]  # fmt: skip
    assert {k: cells[k] for k in header[-7:]} == {
        "RSS": "612.0 MiB",
        "BUSY": "41.2s",
        "FORWARDS": "1830",
        "TOKENS": "20512",
        "GRAPH_STEPS": "1700",
        "AHEAD_SERVED": "1650",
        "AHEAD_DROPPED": "12",
    }
    assert cells["UPTIME"] == "1h 02m 00s"  # the row's own fields are not replaced
    assert "stats" not in out.lower() and "KV_POSITION" not in header
    # A worker that could not answer (restarting) has no counters: "-" in their columns.
    restarting = {**WORKERS[0], "pid": 41300, "state": "starting"}
    lines = lucectl.workers_table([{**WORKERS[0], "stats": WORKER_STATS}, restarting])
    last = lines.splitlines()[-1].split()
    assert last[:3] == ["cpu", "41300", "starting"] and last[-7:] == ["-"] * 7


def test_lucectl_json_is_the_raw_reply(
    daemon: FakeDaemon, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LUCED_ADMIN_SOCKET", str(daemon.path))  # no --socket: the env var
    code, out, _ = run_ctl(capsys, "--json", "status")
    assert code == 0
    assert json.loads(out) == {**STATUS, "ok": True}
    code, out, _ = run_ctl(capsys, "--json", "snapshot", "list")
    assert json.loads(out) == {"ok": True, "snapshots": []}
    # --json after the subcommand too, at any depth
    for args in (
        ["status", "--json"],
        ["snapshot", "--json", "list"],
        ["snapshot", "list", "--json"],
    ):
        code, out, _ = run_ctl(capsys, *args)
        assert code == 0 and json.loads(out)["ok"] is True, args
    code, out, _ = run_ctl(capsys, "status")
    assert code == 0 and not out.startswith("{")  # without it, still a table


def test_lucectl_snapshot_list_empty(
    daemon: FakeDaemon, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = run_ctl(capsys, "--socket", str(daemon.path), "snapshot", "list")
    assert code == 0
    assert out.splitlines() == [
        "ID  TOKENS  BYTES  TIER  HITS  LAST USE  ENDS WITH",
        "(no snapshots)",
    ]
    assert daemon.calls == ["snapshot_list"]


def test_lucectl_snapshot_list_rows(
    daemon_with_snapshots: FakeDaemon, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = run_ctl(capsys, "--socket", str(daemon_with_snapshots.path), "snapshot", "list")
    assert code == 0
    header, row = out.splitlines()
    assert header.split() == [
        "ID", "TOKENS", "BYTES", "TIER", "HITS", "LAST", "USE", "ENDS", "WITH"
    ]  # fmt: skip
    assert row.startswith("a1b2c3     512  3.0 MiB  memory     4  1m 15s ago  ")
    # The end tells snapshots of one system prompt apart: the last turn.
    tail = row[header.index("ENDS WITH") :]
    assert tail == "…t is the capital of France?<|im_end|>\\n"
    assert len(tail) == 40


def test_lucectl_drain(daemon: FakeDaemon, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_ctl(capsys, "--socket", str(daemon.path), "drain", "--no-wait")
    assert code == 0
    assert out.splitlines() == ["state      draining", "in_flight  1"]
    assert daemon.calls == ["drain"]


def test_lucectl_drain_waits_for_the_stop(
    daemon: FakeDaemon, capsys: pytest.CaptureFixture[str]
) -> None:
    """This daemon never stops: the wait polls status until the timeout, then fails."""
    code, _, err = run_ctl(capsys, "--socket", str(daemon.path), "--timeout", "0.6", "drain")
    assert code == 1
    assert "still draining after 0.6 s" in err
    assert daemon.calls[0] == "drain" and daemon.calls.count("status") >= 2


def test_lucectl_drain_timeout_after_the_command(
    daemon: FakeDaemon, capsys: pytest.CaptureFixture[str]
) -> None:
    """`lucectl drain --timeout S`, as the README words it, equals `--timeout S drain`."""
    code, _, err = run_ctl(capsys, "--socket", str(daemon.path), "drain", "--timeout", "0.6")
    assert code == 1
    assert "still draining after 0.6 s" in err
    assert daemon.calls[0] == "drain" and daemon.calls.count("status") >= 2
    with pytest.raises(SystemExit) as done:
        lucectl.main(["drain", "--help"])
    assert done.value.code == 0
    assert "--timeout S  give up waiting" in capsys.readouterr().out


def test_lucectl_metrics_prints_the_exposition(
    daemon: FakeDaemon, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run_ctl(capsys, "--socket", str(daemon.path), "metrics")
    assert (code, err, out) == (0, "", METRICS_TEXT)
    code, out, _ = run_ctl(capsys, "--socket", str(daemon.path), "metrics", "--json")
    assert code == 0 and json.loads(out) == {"ok": True, "text": METRICS_TEXT}
    assert daemon.calls == ["metrics", "metrics"]


def test_lucectl_error_reply_exits_1(sock_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for _ in _serve(sock_path, []):
        with pytest.raises(SystemExit) as exc:  # a usage error is never sent
            lucectl.main(["--socket", str(sock_path), "snapshot", "drop"])  # no id
        assert exc.value.code == 2
        assert "the following arguments are required: id" in capsys.readouterr().err
        code, out, err = run_ctl(capsys, "--socket", str(sock_path), "--json", "status")
        assert code == 0
    for _ in _serve(sock_path, [], peer_allowed=lambda uid: False):
        code, out, err = run_ctl(capsys, "--socket", str(sock_path), "status")
    assert (code, out) == (1, "")
    assert err.startswith(f"lucectl: luced: permission denied: uid {os.getuid()} may not use")


def test_lucectl_when_not_running(sock_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_ctl(capsys, "--socket", str(sock_path), "status")
    assert (code, out) == (2, "")
    assert err == f"lucectl: luced is not running (no socket at {sock_path})\n"

    dead = socket.socket(socket.AF_UNIX)
    dead.bind(str(sock_path))  # a stale socket: the file exists, nobody listens
    dead.close()
    code, _, err = run_ctl(capsys, "--socket", str(sock_path), "status")
    assert code == 2
    assert err == f"lucectl: luced is not running (nothing listens on {sock_path})\n"


def test_lucectl_process_exit_code_when_not_running(sock_path: Path) -> None:
    env = {**os.environ, "LUCED_ADMIN_SOCKET": str(sock_path)}
    r = subprocess.run(
        [sys.executable, "-m", "luced.serve.lucectl", "status"],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=30,
    )
    assert r.returncode == 2
    assert r.stdout == ""
    assert r.stderr == f"lucectl: luced is not running (no socket at {sock_path})\n"


def test_lucectl_default_socket_follows_the_daemons_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(lucectl, "SYSTEMD_SOCKET", tmp_path / "absent.sock")
    env = {"XDG_RUNTIME_DIR": str(tmp_path)}
    assert lucectl.resolve_socket(None, env) == default_admin_socket(env)
    assert default_admin_socket(env) == tmp_path / "luced" / "admin.sock"
    assert lucectl.resolve_socket(None, {"RUNTIME_DIRECTORY": "/run/luced"}) == Path(
        "/run/luced/admin.sock"
    )
    assert lucectl.resolve_socket(None, {"LUCED_RUNTIME_DIR": "/srv/rt"}) == Path(
        "/srv/rt/admin.sock"
    )
    assert lucectl.resolve_socket(None, {"LUCED_ADMIN_SOCKET": "/a.sock"}) == Path("/a.sock")
    assert lucectl.resolve_socket("/b.sock", {"LUCED_ADMIN_SOCKET": "/a.sock"}) == Path("/b.sock")


def test_status_shows_the_running_and_waiting_requests() -> None:
    queue = {
        "running": 2,
        "max_running": 8,
        "waiting": 1,
        "requests": [
            {"id": "chatcmpl-a", "prompt_tokens": 12, "completion_tokens": 30},
            {"id": "chatcmpl-b", "prompt_tokens": 900, "completion_tokens": 2},
        ],
        "waiting_requests": [{"id": "chatcmpl-c", "prompt_tokens": 7, "completion_tokens": 0}],
        "batched_steps": 40,
        "mean_batch": 1.9,
    }
    assert lucectl.render_status({"queue": queue}).splitlines()[0:4] == [
        "queue  2 running (max 8), 1 waiting; 40 batched steps, 1.9 sequences each",
        "  chatcmpl-a running: 12 prompt + 30 generated",
        "  chatcmpl-b running: 900 prompt + 2 generated",
        "  chatcmpl-c waiting: 7 prompt + 0 generated",
    ]


def test_status_shows_the_finished_prompts_kept_in_the_pool() -> None:
    queue = {"running": 0, "waiting": 0, "kv_kept_requests": 2, "kv_kept_tokens": 300}
    assert lucectl.render_status({"queue": queue}) == (
        "queue  0 running, 0 waiting; finished prompts kept in the KV pool: 2 (300 tokens)"
    )


def test_status_says_what_a_torch_fallback_costs() -> None:
    fell = "torch fallback: no C compiler (gcc, cc or $CC) and no cached build in /x"
    assert lucectl.render_status({"kernels": fell}) == (
        f"kernels  {fell} (decode runs several times slower than on native kernels)"
    )
    assert lucectl.render_status({"kernels": "native avx2"}) == "kernels  native avx2"


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["models"], ("models", {})),
        (["load", "qwen3:8b"], ("load", {"model": "qwen3:8b"})),
        (["unload", "a"], ("unload", {"model": "a", "force": False})),
        (["unload", "a", "--force"], ("unload", {"model": "a", "force": True})),
        (["status", "--model", "a"], ("status", {"model": "a"})),
        (["status"], ("status", {})),
        (["workers", "--model", "a"], ("workers", {"model": "a"})),
        (["snapshot", "drop", "7", "--model", "a"], ("snapshot_drop", {"id": "7", "model": "a"})),
        (
            ["cache", "clear", "--yes", "--model", "a"],
            ("cache_clear", {"disk": False, "model": "a"}),
        ),
    ],
)  # fmt: skip
def test_lucectl_model_verbs(argv: list[str], expected: tuple[str, dict]) -> None:
    assert lucectl.command(lucectl.build_parser().parse_args(argv)) == expected


def test_models_table() -> None:
    now = 1000.0
    models = [
        {
            "name": "qwen3", "state": "ready", "memory_bytes": 3 << 30, "running": 1,
            "waiting": 2, "last_used": now - 5, "load_s": 12.34, "keep_alive_s": 300.0,
        },
        {
            "name": "gemma", "state": "failed", "memory_bytes": None, "running": 0,
            "waiting": 0, "last_used": None, "load_s": None, "keep_alive_s": 0.0,
            "error": "--draft /x: no such file",
        },
    ]  # fmt: skip
    assert lucectl.render_models(models, now).splitlines() == [
        "NAME   STATE   MEMORY   REQUESTS              LAST USE  LOAD   KEEP ALIVE",
        "qwen3  ready   3.0 GiB  1 running, 2 waiting  5s ago    12.3s  5m 00s",
        "gemma  failed  -        0 running, 0 waiting  -         -      until needed",
        "gemma: --draft /x: no such file",
    ]
    # a daemon serving one model: it is never unloaded
    (row,) = lucectl.render_models([{"name": "smol", "keep_alive_s": None}], now).splitlines()[1:]
    assert row.endswith("never unloaded")
