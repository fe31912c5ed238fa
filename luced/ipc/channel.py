"""Frames over unix-domain sockets: an asyncio channel (daemon) and a blocking one (worker).

Framing on the stream, one frame after another::

    +---------------------+-------------------------------------+
    | length: u32 LE (4B) | msgpack payload (``length`` bytes)  |
    +---------------------+-------------------------------------+

``length`` <= ``MAX_FRAME_BYTES``: the sender refuses bigger payloads and the receiver
refuses a bigger prefix (``FrameTooLargeError``; the stream cannot be resynchronised
after that, so close the channel). Payloads are the msgpack maps of ``codec.py``.

Calls are one at a time per channel (the daemon sends a step's command, awaits its
reply). The async ``call`` is cancellation-safe: a reply to a call that was cancelled
(client disconnect, ``asyncio.timeout``) is dropped when it arrives, by seq, and a
frame read half-way is finished by the next read.

A ``SLOW`` request (a worker's start, a load) is answered under ``keep_alive``: progress
notes every ``PROGRESS_INTERVAL`` until the reply, so the caller can tell a slow peer
from a frozen one; ``call`` hands them to ``on_progress`` and reads on.

A request's ``Carry`` (``frames/remote.py``: regions put, got and relayed beside it) is
applied by the serving side's ``Carrier`` around the handler: ``before`` it (puts, relays
in), ``after`` it (relays out; the bytes got, returned in the reply), or ``failed`` when
the request failed (the relays out tell their peers so).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import threading
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import Protocol, Self

from luced.ipc.codec import (
    MAX_FRAME_BYTES,
    FrameTooLargeError,
    decode_request,
    encode_progress,
    encode_reply,
    encode_request,
    pop_carried,
    progress_stage,
    reply_from_wire,
    unpack_reply,
)
from luced.ipc.frames import (
    REPLIES,
    SLOW,
    Carry,
    ErrorReply,
    FrameError,
    Reply,
    Request,
    Shutdown,
)

_LEN = struct.Struct("<I")
PROGRESS_INTERVAL = 0.5  # seconds between the progress notes of a slow request


class ChannelClosedError(ConnectionError):
    """The peer closed the connection."""


class RemoteError(Exception):
    """The peer answered a request with ``ok: false``."""

    def __init__(self, op: str, error: str) -> None:
        super().__init__(f"{op} failed in the peer: {error}")
        self.op = op
        self.error = error


def _frame_bytes(payload: bytes, max_frame: int) -> bytes:
    if len(payload) > max_frame:
        raise FrameTooLargeError(
            f"refusing to send a frame of {len(payload)} bytes (max {max_frame}); "
            "bulk data belongs in shared memory"
        )
    return _LEN.pack(len(payload)) + payload


def _check_incoming(n: int, max_frame: int) -> None:
    if n > max_frame:
        raise FrameTooLargeError(
            f"incoming frame announces {n} bytes (max {max_frame}); closing the channel"
        )


def _checked_reply(req: Request, reply: Reply) -> Reply:
    if type(reply) is not REPLIES[req.OP]:
        raise TypeError(f"{req.OP} answered with {type(reply).__name__}")
    return reply


class Carrier(Protocol):
    """The serving side of a request's carry (module docstring)."""

    def before(self, carry: Carry) -> None: ...

    def after(self, carry: Carry) -> tuple[bytes, ...]: ...

    def failed(self, carry: Carry) -> None: ...


def read_request(payload: bytes) -> tuple[int, Request, Carry | None] | bytes:
    """A request frame's (seq, request, carry), or the failure reply owed to a frame that
    names its seq but does not decode. FrameError when not even the seq can be read: such
    a frame cannot be answered, and the caller should close the connection."""
    try:
        return decode_request(payload)
    except FrameError as e:
        if e.seq is None:
            raise
        return encode_reply(e.seq, ErrorReply(str(e)))


def answer(
    req: Request,
    seq: int,
    handler: Callable[[Request], Reply],
    carry: Carry | None = None,
    carrier: Carrier | None = None,
) -> bytes:
    """The reply payload for ``req``: the handler's reply (with the bytes its carry got),
    or its exception as a failure."""
    try:
        if carry is not None:
            if carrier is None:
                raise FrameError("this peer takes no carry (it shares the daemon's memory)")
            carrier.before(carry)
        reply = _checked_reply(req, handler(req))
        carried = carrier.after(carry) if carry is not None and carrier is not None else ()
        return encode_reply(seq, reply, carried)
    except Exception as e:  # the peer gets the message; the serving loop goes on
        if carry is not None and carrier is not None:
            carrier.failed(carry)
        return encode_reply(seq, ErrorReply(f"{type(e).__name__}: {e}"))


class BlockingChannel:
    """Worker side: plain ``socket.socket`` I/O, one frame at a time."""

    def __init__(self, sock: socket.socket, *, max_frame: int = MAX_FRAME_BYTES) -> None:
        self.sock = sock
        self.max_frame = max_frame
        self._seq = 0
        self.stage = ""  # what a slow request is doing now: its progress notes say it

    def send(self, payload: bytes) -> None:
        self.sock.sendall(_frame_bytes(payload, self.max_frame))

    def recv(self) -> bytes:
        """The next payload; ChannelClosedError on EOF."""
        (n,) = _LEN.unpack(self._read(_LEN.size))
        _check_incoming(n, self.max_frame)
        return self._read(n)

    def _read(self, n: int) -> bytes:
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        while got < n:
            k = self.sock.recv_into(view[got:])
            if k == 0:
                raise ChannelClosedError("peer closed the connection" + (" mid-frame" * (got > 0)))
            got += k
        return bytes(buf)

    def recv_request(self) -> tuple[int, Request, Carry | None]:
        return decode_request(self.recv())

    def reply(self, seq: int, reply: Reply | ErrorReply) -> None:
        self.send(encode_reply(seq, reply))

    def call(self, req: Request) -> Reply:
        """Send ``req`` and wait for its reply (raises RemoteError on ``ok: false``)."""
        self._seq += 1
        self.send(encode_request(self._seq, req))
        seq, obj = unpack_reply(self.recv())
        while progress_stage(seq, obj) is not None:
            seq, obj = unpack_reply(self.recv())
        rep = reply_from_wire(seq, obj, req.OP)
        if seq != self._seq:
            raise FrameError(f"reply seq {seq} does not answer request seq {self._seq}")
        if isinstance(rep, ErrorReply):
            raise RemoteError(req.OP, rep.error)
        return rep

    def serve(
        self,
        handler: Callable[[Request], Reply],
        carrier: Carrier | None = None,
        idle: Callable[[], None] | None = None,
    ) -> None:
        """Answer requests until ``shutdown`` (after replying to it) or the peer closes.

        A handler exception becomes a failure reply and serving goes on. A frame whose
        seq cannot even be read (not msgpack, not a map) cannot be answered: FrameError
        propagates and the caller should close the connection. A ``SLOW`` request is
        answered under ``keep_alive``, its stage first set to its op. ``carrier`` applies
        the requests' carries (without one, a request with a carry fails). ``idle`` runs
        after each reply went out, before the next request is read.
        """
        while True:
            try:
                payload = self.recv()
            except ChannelClosedError:
                return
            request = read_request(payload)
            if isinstance(request, bytes):
                self.send(request)
                continue
            seq, req, carry = request
            if isinstance(req, SLOW):
                self.stage = req.OP
                with self.keep_alive(seq):
                    reply = answer(req, seq, handler, carry, carrier)
            else:
                reply = answer(req, seq, handler, carry, carrier)
            self.send(reply)
            if isinstance(req, Shutdown):
                return
            if idle is not None:
                idle()

    @contextlib.contextmanager
    def keep_alive(self, seq: int, interval: float = PROGRESS_INTERVAL) -> Iterator[None]:
        """While the body runs, a thread sends a progress note for request ``seq`` (with
        ``self.stage``) at once and every ``interval`` s: the peer hears that a slow
        worker is alive, and a frozen one falls silent. The body must send nothing."""
        done = threading.Event()

        def beat() -> None:
            with contextlib.suppress(OSError):  # the peer is gone: the reply will find out
                while True:
                    self.send(encode_progress(seq, self.stage))
                    if done.wait(interval):
                        return

        thread = threading.Thread(target=beat, name=f"progress-{seq}", daemon=True)
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join()

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class AsyncChannel:
    """Daemon side: asyncio streams. One ``call`` at a time (an internal lock)."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        *,
        max_frame: int = MAX_FRAME_BYTES,
    ) -> None:
        self.reader = reader
        self.writer = writer
        self.max_frame = max_frame
        self._seq = 0
        self._lock = asyncio.Lock()
        self._outstanding: dict[int, str] = {}  # seq -> op of calls sent, not yet answered
        self._pending_len: int | None = None  # length read, body not yet (cancelled read)

    @classmethod
    async def from_socket(cls, sock: socket.socket) -> AsyncChannel:
        reader, writer = await asyncio.open_unix_connection(sock=sock)
        return cls(reader, writer)

    async def send(self, payload: bytes) -> None:
        # write() queues the whole frame at once, so a cancelled drain() never splits it.
        self.writer.write(_frame_bytes(payload, self.max_frame))
        await self.writer.drain()

    async def recv(self) -> bytes:
        """The next payload; ChannelClosedError on EOF."""
        # readexactly() takes all its bytes or none, so a cancellation between the two
        # reads is resumed through _pending_len.
        if self._pending_len is None:
            (n,) = _LEN.unpack(await self._readexactly(_LEN.size))
            _check_incoming(n, self.max_frame)
            self._pending_len = n
        data = await self._readexactly(self._pending_len)
        self._pending_len = None
        return data

    async def _readexactly(self, n: int) -> bytes:
        try:
            return await self.reader.readexactly(n)
        except asyncio.IncompleteReadError as e:
            mid = " mid-frame" if e.partial or self._pending_len is not None else ""
            raise ChannelClosedError(f"peer closed the connection{mid}") from None

    async def recv_request(self) -> tuple[int, Request, Carry | None]:
        return decode_request(await self.recv())

    async def reply(self, seq: int, reply: Reply | ErrorReply) -> None:
        await self.send(encode_reply(seq, reply))

    async def call(self, req: Request, on_progress: Callable[[str], object] | None = None) -> Reply:
        """Send ``req`` and await its reply (raises RemoteError on ``ok: false``); each
        progress note for it before the reply goes to ``on_progress`` (its stage).

        Wrap in ``asyncio.timeout`` to bound it; the late reply is then dropped.
        """
        reply, _ = await self.exchange(req, None, on_progress)
        return reply

    async def exchange(
        self,
        req: Request,
        carry: Carry | None,
        on_progress: Callable[[str], object] | None = None,
    ) -> tuple[Reply, tuple[bytes, ...]]:
        """``call`` with a carry: -> (the reply, the bytes of the regions it got)."""
        async with self._lock:
            self._seq += 1
            seq = self._seq
            self._outstanding[seq] = req.OP
            await self.send(encode_request(seq, req, carry))
            while True:
                got, obj = unpack_reply(await self.recv())
                stage = progress_stage(got, obj)
                if stage is not None:
                    if got not in self._outstanding:
                        raise FrameError(f"progress note for seq {got}: no such request", got)
                    if got == seq and on_progress is not None:
                        on_progress(stage)
                    continue  # (a note for a cancelled call is dropped as its reply is)
                op = self._outstanding.pop(got, None)
                if op is None:
                    raise FrameError(f"reply seq {got} answers no request sent", got)
                if got == seq:
                    break
                # else: the reply to a cancelled call; dropped
            carried = pop_carried(got, obj)
            rep = reply_from_wire(got, obj, op)
        if isinstance(rep, ErrorReply):
            raise RemoteError(req.OP, rep.error)
        return rep, carried

    async def serve(self, handler: Callable[[Request], Reply]) -> None:
        """The async twin of ``BlockingChannel.serve`` (daemon-side peers, tests)."""
        while True:
            try:
                payload = await self.recv()
            except ChannelClosedError:
                return
            request = read_request(payload)
            if isinstance(request, bytes):
                await self.send(request)
                continue
            seq, req, carry = request
            await self.send(answer(req, seq, handler, carry))
            if isinstance(req, Shutdown):
                return

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(ConnectionError):
            await self.writer.wait_closed()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()
