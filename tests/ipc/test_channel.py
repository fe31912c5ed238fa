"""Channels: every op over a socketpair, blocking and asyncio, and the failure paths."""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator

import msgpack
import pytest

from luced.ipc import codec
from luced.ipc import frames as F
from luced.ipc.channel import AsyncChannel, BlockingChannel, ChannelClosedError, RemoteError


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    yield a, b
    a.close()
    b.close()


def replier(replies: dict[str, F.Reply]) -> Callable[[F.Request], F.Reply]:
    def handle(req: F.Request) -> F.Reply:
        if isinstance(req, F.Stats) and getattr(handle, "fail_next", False):
            handle.fail_next = False  # type: ignore[attr-defined]
            raise MemoryError("KV cache full")
        return replies[req.OP]

    return handle


def serve_in_thread(
    sock: socket.socket, handler: Callable[[F.Request], F.Reply]
) -> threading.Thread:
    t = threading.Thread(target=BlockingChannel(sock).serve, args=(handler,), daemon=True)
    t.start()
    return t


def test_blocking_frames_roundtrip_every_op(pair, sample_requests, sample_replies) -> None:
    a, b = BlockingChannel(pair[0]), BlockingChannel(pair[1])
    for seq, (op, req) in enumerate(sample_requests.items()):
        a.send(codec.encode_request(seq, req))
        assert b.recv_request() == (seq, req, None)
        b.reply(seq, sample_replies[op])
        assert codec.decode_reply(a.recv(), op) == (seq, sample_replies[op])


def test_blocking_call_and_serve(pair, sample_requests, sample_replies) -> None:
    handler = replier(sample_replies)
    t = serve_in_thread(pair[1], handler)
    client = BlockingChannel(pair[0])
    handler.fail_next = True  # type: ignore[attr-defined]
    with pytest.raises(RemoteError, match="stats failed in the peer: MemoryError: KV cache full"):
        client.call(F.Stats())
    for req in sample_requests.values():  # shutdown comes last: serve() returns after it
        assert client.call(req) == sample_replies[req.OP]
    t.join(timeout=5)
    assert not t.is_alive()


async def test_async_frames_roundtrip_every_op(pair, sample_requests, sample_replies) -> None:
    a = await AsyncChannel.from_socket(pair[0])
    b = await AsyncChannel.from_socket(pair[1])
    for seq, (op, req) in enumerate(sample_requests.items()):
        await a.send(codec.encode_request(seq, req))
        assert await b.recv_request() == (seq, req, None)
        await b.reply(seq, sample_replies[op])
        assert codec.decode_reply(await a.recv(), op) == (seq, sample_replies[op])
    server = asyncio.create_task(b.serve(replier(sample_replies)))
    for req in sample_requests.values():
        assert await a.call(req) == sample_replies[req.OP]
    await asyncio.wait_for(server, 5)
    await a.close()
    await b.close()


async def test_async_daemon_with_blocking_worker(pair, sample_requests, sample_replies) -> None:
    handler = replier(sample_replies)
    t = serve_in_thread(pair[1], handler)
    daemon = await AsyncChannel.from_socket(pair[0])
    handler.fail_next = True  # type: ignore[attr-defined]
    with pytest.raises(RemoteError, match="MemoryError"):
        await daemon.call(F.Stats())
    for req in sample_requests.values():
        assert await daemon.call(req) == sample_replies[req.OP]
    t.join(timeout=5)
    assert not t.is_alive()
    with pytest.raises(ChannelClosedError):  # the worker's side is gone after shutdown
        pair[1].close()
        await daemon.recv()
    await daemon.close()


async def test_version_mismatch_through_the_channel(pair, sample_replies) -> None:
    t = serve_in_thread(pair[1], replier(sample_replies))
    daemon = await AsyncChannel.from_socket(pair[0])
    # A daemon from another build says hello with protocol 999: the worker refuses.
    await daemon.send(msgpack.packb({"op": "hello", "seq": 1, "protocol": 999, "instance": "x"}))
    seq, rep = codec.decode_reply(await daemon.recv(), "hello")
    assert seq == 1 and isinstance(rep, F.ErrorReply)
    want = f"protocol version mismatch: the peer speaks 999, this side speaks {F.PROTOCOL_VERSION}"
    assert want in rep.error
    await daemon.call(F.Shutdown())
    t.join(timeout=5)
    await daemon.close()

    # A worker from another build answers hello with another protocol: the daemon refuses.
    a, b = socket.socketpair()
    with a, b:
        daemon = await AsyncChannel.from_socket(a)
        worker = BlockingChannel(b)
        task = asyncio.create_task(daemon.call(F.Hello(instance="x")))
        seq, *_ = await asyncio.to_thread(worker.recv_request)
        other = F.PROTOCOL_VERSION + 1
        worker.send(msgpack.packb({"seq": seq, "ok": True, "protocol": other, "pid": 1}))
        want = f"peer speaks {other}, this side speaks {F.PROTOCOL_VERSION}"
        with pytest.raises(F.ProtocolVersionError, match=want):
            await task
        await daemon.close()


def test_oversized_frames(pair) -> None:
    a = BlockingChannel(pair[0], max_frame=1024)
    b = BlockingChannel(pair[1], max_frame=1024)
    with pytest.raises(codec.FrameTooLargeError, match="refusing to send a frame of 1025 bytes"):
        a.send(bytes(1025))
    a.send(bytes(1024))  # the limit itself is fine
    assert b.recv() == bytes(1024)
    pair[0].sendall(struct.pack("<I", 1025))  # a peer that ignores the limit
    with pytest.raises(codec.FrameTooLargeError, match="announces 1025 bytes"):
        b.recv()


async def test_oversized_frame_async(pair) -> None:
    b = await AsyncChannel.from_socket(pair[1])
    pair[0].sendall(struct.pack("<I", codec.MAX_FRAME_BYTES + 1))
    with pytest.raises(codec.FrameTooLargeError, match="announces 16777217 bytes"):
        await b.recv()
    await b.close()


def test_malformed_frames_in_serve(pair, sample_replies) -> None:
    client = BlockingChannel(pair[0])
    served = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            BlockingChannel(pair[1]).serve(lambda r: served.append(r) or sample_replies[r.OP])
        except F.FrameError as e:
            errors.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    # Readable seq, bad field: answered with an error, serving goes on.
    client.send(msgpack.packb({"op": "truncate", "seq": 4, "position": -2}))
    seq, rep = codec.decode_reply(client.recv(), "truncate")
    assert seq == 4 and isinstance(rep, F.ErrorReply) and "position must be >= 0" in rep.error
    assert client.call(F.Truncate(position=2)) == sample_replies["truncate"]
    # Not msgpack at all: nobody to answer; serve() raises for the caller to close.
    client.send(b"\xc1\xc1")
    t.join(timeout=5)
    assert len(errors) == 1 and "malformed msgpack" in str(errors[0])
    assert served == [F.Truncate(position=2)]


def test_eof(pair) -> None:
    a, b = BlockingChannel(pair[0]), BlockingChannel(pair[1])
    pair[0].sendall(struct.pack("<I", 10) + b"abc")
    pair[0].shutdown(socket.SHUT_WR)
    with pytest.raises(ChannelClosedError, match="mid-frame"):
        b.recv()
    a.close()


async def test_cancelled_call_reply_is_dropped(pair, sample_replies) -> None:
    def slow(req: F.Request) -> F.Reply:
        if isinstance(req, F.Stats):
            time.sleep(0.3)  # the daemon gives up before this answer arrives
        return sample_replies[req.OP]

    t = serve_in_thread(pair[1], slow)
    daemon = await AsyncChannel.from_socket(pair[0])
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.05):
            await daemon.call(F.Stats())
    # The late StatsReply arrives first on the stream and must not answer this call.
    assert await daemon.call(F.Truncate(position=1)) == sample_replies["truncate"]
    assert await daemon.call(F.Shutdown()) == F.ShutdownReply()
    t.join(timeout=5)
    await daemon.close()


async def test_cancelled_read_resumes_mid_frame(pair) -> None:
    b = await AsyncChannel.from_socket(pair[1])
    pair[0].sendall(struct.pack("<I", 5))  # the length arrives, the body not yet
    task = asyncio.create_task(b.recv())
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    pair[0].sendall(b"hello")
    assert await asyncio.wait_for(b.recv(), 5) == b"hello"
    await b.close()


async def test_a_slow_request_sends_progress_notes_until_its_reply(pair, sample_replies) -> None:
    """A `SLOW` request (a start, a load) is answered with progress notes first, carrying
    the stage the handler set; the async call hands them to on_progress, the blocking one
    skips them; any other request sends none."""
    worker = BlockingChannel(pair[1])

    def handle(req: F.Request) -> F.Reply:
        if isinstance(req, F.Hello):
            worker.stage = "importing"  # as the worker does on its first request
        time.sleep(1.2)  # 2.4 intervals
        return sample_replies[req.OP]

    t = threading.Thread(target=worker.serve, args=(handle,), daemon=True)
    t.start()
    daemon = await AsyncChannel.from_socket(pair[0])
    stages: list[str] = []
    assert await daemon.call(F.Hello(instance="x"), stages.append) == sample_replies["hello"]
    assert stages[0] in {"hello", "importing"} and stages[-1] == "importing"
    stages.clear()
    assert await daemon.call(F.Stats(), stages.append) == sample_replies["stats"]
    assert stages == []
    await daemon.call(F.Shutdown(), stages.append)
    t.join(timeout=5)
    await daemon.close()

    a, b = socket.socketpair()
    with a, b:
        t = serve_in_thread(b, handle)
        assert BlockingChannel(a).call(F.Hello(instance="x")) == sample_replies["hello"]
        a.shutdown(socket.SHUT_RDWR)
        t.join(timeout=5)


async def test_bad_progress_notes_are_frame_errors(pair) -> None:
    daemon = await AsyncChannel.from_socket(pair[0])
    worker = BlockingChannel(pair[1])
    task = asyncio.create_task(daemon.call(F.Hello(instance="x")))
    seq, *_ = await asyncio.to_thread(worker.recv_request)
    worker.send(codec.encode_progress(seq + 5, "loading"))
    with pytest.raises(F.FrameError, match=f"progress note for seq {seq + 5}: no such request"):
        await task
    with pytest.raises(F.FrameError, match="exactly a string 'progress'"):
        codec.progress_stage(1, {"progress": 3})
    await daemon.close()
