"""The admin unix socket: the daemon's control surface, spoken to by ``lucectl``.

Access: the socket file is created mode 0600 (umask while binding, then chmod), in a
directory that is ours (created 0700 when missing). Each connection's peer is checked
with ``SO_PEERCRED``: the daemon's own uid or root; anyone else gets one error line and
the connection is closed.

Protocol: newline-delimited JSON (UTF-8), one request line -> one reply line, any
number of requests per connection, in order::

    -> {"cmd": "status"}                 (further keys are the command's arguments)
    <- {"ok": true, ...reply fields}
    <- {"ok": false, "error": "unknown command 'x' (known: drain, status, ...)"}

A request line is at most ``MAX_LINE`` bytes; one that is not JSON (or holds a number
Python will not read, an integer of 5,000 digits) gets an error reply and the connection
stays open. Arguments are typed strictly (``arg_bool``, ``arg_str``): ``"disk": "no"`` is
an error, not true. Handlers run on the daemon's event loop
(the single owner of engine state); a slow one (``drain``) holds only its connection.

Replies the daemon supplies, as ``lucectl`` renders them (unknown keys are shown too,
missing ones are left out; see ``luced.engine.core.Engine.status``):

    status         model, state, context_length, uptime_s, queue {running, waiting,
                   max_queue, queued_tokens, max_queued_tokens}, totals {name: count},
                   placement [worker] (or a str), optionally model_path, workers [worker]
    workers        workers [worker]; a worker is {group, pid, state, devices,
                   layers [a, b), restarts, uptime_s, python, ...}
    drain          state, ... (answered once the daemon stops accepting)
    snapshot_list  snapshots [{id, tokens, bytes, disk_bytes, tier, hits, last_used (unix s),
                   in_use, prefix}]
    snapshot_drop  {id} -> dropped          snapshot_save -> saved (entries written)
    cache_clear    {disk: bool} -> cleared (entries affected)
    (the status's prefix_cache has disk_error while the disk tier cannot write: a full disk)
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
import os
import socket
import stat
import struct
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, Self

log = logging.getLogger(__name__)

MAX_LINE = 64 * 1024
_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid

# A handler gets the request's arguments (the request without "cmd") and returns a
# JSON-able mapping; it may be a coroutine function or a plain one.
Handler = Callable[[dict[str, Any]], Awaitable[Mapping[str, Any]] | Mapping[str, Any]]


class AdminSocketError(RuntimeError):
    """The admin socket cannot be set up at the configured path."""


class CommandError(Exception):
    """A command that cannot be done as asked: its message is the whole answer (no
    traceback in the log; e.g. an unknown snapshot id)."""


def arg_bool(request: Mapping[str, Any], name: str, default: bool = False) -> bool:
    """A boolean argument: true or false (absent or null: `default`); anything else is an
    error, since guessing ("no" is a non-empty string) could clear what was meant to stay."""
    value = request.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise CommandError(f"{name} must be true or false, got {value!r:.40}")
    return value


def arg_str(request: Mapping[str, Any], name: str) -> str:
    """A string argument (absent: "")."""
    value = request.get(name, "")
    if not isinstance(value, str):
        raise CommandError(f"{name} must be a string, got {type(value).__name__}")
    return value


def same_uid_or_root(uid: int) -> bool:
    """The default peer rule: the daemon's own user, or root."""
    return uid == 0 or uid == os.getuid()


def peer_credentials(sock: Any) -> tuple[int, int, int]:
    """(pid, uid, gid) of a connected unix socket's peer, from the kernel."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size)
    pid, uid, gid = _CRED.unpack(raw)
    return pid, uid, gid


def prepare_socket_dir(directory: Path) -> None:
    """Create the socket's directory (0700) or check that an existing one is safe.

    Safe: owned by us or root, and not writable by others unless sticky (/tmp). Otherwise
    someone else could replace our socket, or plant /tmp/luced-$UID before we start.
    """
    old = os.umask(0o077)
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise AdminSocketError(f"cannot create {directory}: {exc.strerror}") from None
    finally:
        os.umask(old)
    st = directory.stat()
    if not stat.S_ISDIR(st.st_mode):
        raise AdminSocketError(f"{directory} is not a directory")
    if st.st_uid not in (0, os.getuid()):
        raise AdminSocketError(f"{directory} belongs to uid {st.st_uid}, not to us")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
        raise AdminSocketError(f"{directory} is writable by others; refusing to use it")


def _claim_path(path: Path) -> None:
    """Remove a stale socket at ``path``; refuse a live one or a non-socket."""
    try:
        st = path.lstat()
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise AdminSocketError(f"{path} exists and is not a socket; not replacing it")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(str(path))
        except ConnectionRefusedError:
            pass  # nobody listens: left by a daemon that died
        except OSError as exc:
            raise AdminSocketError(f"cannot probe the existing {path}: {exc}") from None
        else:
            raise AdminSocketError(f"another luced is listening on {path}")
    path.unlink()
    log.info("removed stale admin socket %s", path)


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, Path):
        return str(obj)
    if hasattr(obj, "item"):  # numpy scalars
        return obj.item()
    if isinstance(obj, set | frozenset):
        return sorted(obj)
    raise TypeError(f"{type(obj).__name__} is not JSON-serializable")


def _encode(reply: Mapping[str, Any]) -> bytes:
    return json.dumps(reply, separators=(",", ":"), default=_jsonable).encode() + b"\n"


def _error(message: str) -> dict[str, Any]:
    return {"ok": False, "error": message}


class AdminServer:
    """A listening admin socket; ``close()`` stops it and removes the socket file."""

    def __init__(
        self,
        path: Path,
        handlers: Mapping[str, Handler],
        peer_allowed: Callable[[int], bool],
    ) -> None:
        self.path = path
        self._handlers = dict(handlers)
        self._peer_allowed = peer_allowed
        self._server: asyncio.AbstractServer | None = None
        self._inode: int | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def _start(self, sock: socket.socket) -> None:
        self._server = await asyncio.start_unix_server(self._client, sock=sock, limit=MAX_LINE)

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in self._tasks:
            task.cancel()
        # Remove the file only if it is still ours (a successor may have replaced it).
        with contextlib.suppress(OSError):
            if self._inode is not None and os.stat(self.path).st_ino == self._inode:
                self.path.unlink()
        self._inode = None

    async def wait_closed(self) -> None:
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
        await self.wait_closed()

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            pid, uid, _ = peer_credentials(writer.get_extra_info("socket"))
            if not self._peer_allowed(uid):
                log.warning("admin socket: refused pid %d (uid %d)", pid, uid)
                writer.write(
                    _encode(
                        _error(
                            f"permission denied: uid {uid} may not use this socket "
                            f"(only uid {os.getuid()} and root)"
                        )
                    )
                )
                await writer.drain()
                # Consume the request before closing: closing with unread data would
                # reset the connection and the peer might never read our reason.
                with contextlib.suppress(ValueError, TimeoutError):
                    await asyncio.wait_for(reader.readline(), 1.0)
                return
            while True:
                try:
                    line = await reader.readline()
                except ValueError:  # the line overran MAX_LINE; the stream is unusable
                    writer.write(_encode(_error(f"request longer than {MAX_LINE} bytes")))
                    await writer.drain()
                    return
                if not line:
                    return
                if line.strip():
                    writer.write(await self._dispatch(line))
                    await writer.drain()
        except (ConnectionError, asyncio.CancelledError):
            pass  # the client went away, or the server is closing
        finally:
            self._tasks.discard(task)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _dispatch(self, line: bytes) -> bytes:
        try:
            request = json.loads(line)
        except (ValueError, RecursionError) as exc:  # bad UTF-8 or JSON, a 5,000-digit int
            return _encode(_error(f"malformed JSON: {exc}"))
        if not isinstance(request, dict) or not isinstance(request.get("cmd"), str):
            return _encode(_error('a request is a JSON object with a string "cmd"'))
        cmd = request.pop("cmd")
        handler = self._handlers.get(cmd)
        if handler is None:
            known = ", ".join(sorted(self._handlers))
            return _encode(_error(f"unknown command {cmd!r} (known: {known})"))
        try:
            result = handler(request)
            if inspect.isawaitable(result):
                result = await result
        except CommandError as exc:
            return _encode(_error(str(exc)))
        except Exception as exc:  # a failing command must not take the socket down
            log.exception("admin command %s failed", cmd)
            return _encode(_error(f"{cmd} failed: {exc}"))
        if not isinstance(result, Mapping):
            return _encode(_error(f"{cmd} returned {type(result).__name__}, not a mapping"))
        try:
            return _encode({**result, "ok": True})
        except (TypeError, ValueError) as exc:
            log.error("admin command %s: reply not serializable: %s", cmd, exc)
            return _encode(_error(f"{cmd}: reply not serializable: {exc}"))


async def start_admin_server(
    path: Path | str,
    handlers: Mapping[str, Handler],
    *,
    peer_allowed: Callable[[int], bool] = same_uid_or_root,
) -> AdminServer:
    """Listen on ``path`` (mode 0600) on the running loop, replacing a stale socket.

    ``peer_allowed(uid)`` judges each peer's uid as read with SO_PEERCRED; it is a
    parameter so tests can stand in for a foreign user.
    """
    path = Path(path)
    prepare_socket_dir(path.parent)
    _claim_path(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server = AdminServer(path, handlers, peer_allowed)
    try:
        # The umask makes the file 0600 from its first moment (no window in which
        # others could connect); chmod then states the mode whatever the umask did.
        old = os.umask(0o177)
        try:
            sock.bind(str(path))
        finally:
            os.umask(old)
        server._inode = os.stat(path).st_ino  # from here on close() removes the file
        os.chmod(path, 0o600)
        sock.listen(16)
        sock.setblocking(False)
        await server._start(sock)
    except OSError as exc:
        sock.close()
        server.close()
        raise AdminSocketError(f"cannot listen on {path}: {exc}") from None
    except BaseException:
        sock.close()
        server.close()
        raise
    log.info("admin socket listening on %s", path)
    return server
