"""Faults of a worker on another host under a real Engine: killed (kill -9), cut off (a
partition of the wire during decode), the connection reset, a peer without the key, a
host with another copy of the model. Each running request ends with a clean error, new
ones are refused (503, Retry-After) while the worker is gone, the daemon reconnects when
it is back and serves as before, and nothing stays behind on either side."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterator
from contextlib import AbstractAsyncContextManager
from pathlib import Path

import pytest
from engine_harness import engine_for, generate
from remote_harness import WorkerProc, needs_wire, settings

from luced.engine.core import Engine, GenerationRequest, RequestHandle, Unavailable
from luced.engine.executor import Deadlines, WorkerDied, WorkerReplyError
from luced.engine.remote import RemoteSettings
from luced.ipc import tcp
from luced.ipc.files import identify
from luced.ipc.frames import Stats, StatsReply
from luced.runtime.tiny import make_tiny_gguf
from luced.sampling_params import SamplingParams

PORTS = itertools.count(7270)
PROMPT = [3, 17, 5, 42, 8, 99, 23, 4, 61, 7]
# Found quickly when a call goes unanswered: the wire is cut, or the worker hangs.
QUICK = Deadlines(call=3.0, start=20.0)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("faults") / "qwen3.gguf"
    return make_tiny_gguf("qwen3", path, seed=7, layers=4, context=512).path


@pytest.fixture
def worker(host, key: Path, model: Path) -> Iterator[WorkerProc]:
    w = WorkerProc(host, key, [model], next(PORTS)).start()
    yield w
    w.stop()


@pytest.fixture(scope="module")
def alone(model: Path) -> list[int]:
    """The greedy tokens of PROMPT on one local worker: what every recovery must give."""

    async def run() -> list[int]:
        async with engine_for(model) as engine:
            return (await generate(engine, PROMPT, 16))[0]

    return asyncio.run(run())


def long_request() -> GenerationRequest:
    return GenerationRequest("long", PROMPT, SamplingParams(temperature=0), 400, ignore_eos=True)


async def started(engine: Engine) -> tuple[RequestHandle, object]:
    """A long request that has streamed its first token, and its stream."""
    handle = engine.submit(long_request())
    stream = aiter(handle)
    await anext(stream)
    return handle, stream


async def until(condition, timeout: float = 120) -> None:
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.05)


def check_refused(engine: Engine) -> None:
    """While the worker is gone: degraded, and a new request is a 503 with Retry-After."""
    assert engine.state == "degraded"
    with pytest.raises(Unavailable) as refused:
        engine.submit(long_request())
    assert refused.value.retry_after == 1.0


async def check_recovers(engine: Engine, alone: list[int]) -> None:
    """The daemon reconnects on its own and serves the same tokens as before."""
    await until(lambda: engine.state == "ready")
    assert (await generate(engine, PROMPT, 16))[0] == alone


def remote_engine(worker: WorkerProc, key: Path, model: Path) -> AbstractAsyncContextManager:
    """An Engine whose second stage is `worker`, with QUICK deadlines."""
    remote = settings(key, model)
    return engine_for(model, ("cpu", worker.device()), remote=remote, deadlines=QUICK)


async def remote_stats(engine: Engine) -> dict:
    handle = engine.target.executor.slots[1].handle
    assert handle is not None
    reply = await handle.call(Stats())
    assert isinstance(reply, StatsReply)
    return dict(reply.stats)


async def test_a_killed_worker_fails_the_running_request_and_is_reconnected(
    worker: WorkerProc, key: Path, model: Path, alone: list[int]
) -> None:
    async with remote_engine(worker, key, model) as engine:
        handle, stream = await started(engine)
        worker.kill()
        async for _ in stream:
            pass
        assert handle.finish_reason == "error"
        assert f"tcp://{worker.address}" in handle.error
        await until(lambda: engine.state == "degraded")
        check_refused(engine)
        worker.start()  # by hand, as systemd would: the daemon only reconnects
        await check_recovers(engine, alone)
        assert engine.target.executor.slots[1].restarts >= 1
        stats = await remote_stats(engine)
        assert stats["kv_sequences"] <= 1  # only what the last request left in its slot


async def cut_mid_decode(host, engine: Engine, what: str) -> RequestHandle:
    """A long request cut off mid-decode by the wire (`what`: "partition" or "reset"): it
    ends with an error, and while the wire stays cut the engine is degraded and refuses
    new requests; then the wire is restored."""
    needs_wire(host)
    handle, stream = await started(engine)
    host.wire(f"{what} on")
    try:
        async for _ in stream:
            pass
        assert handle.finish_reason == "error"
        await until(lambda: engine.state == "degraded")
        check_refused(engine)
    finally:
        host.wire(f"{what} off")
    return handle


async def test_a_partition_during_decode_is_an_error_then_the_link_comes_back(
    host, worker: WorkerProc, key: Path, model: Path, alone: list[int]
) -> None:
    async with remote_engine(worker, key, model) as engine:
        handle = await cut_mid_decode(host, engine, "partition")
        assert "did not answer" in handle.error or "died" in handle.error, handle.error
        await check_recovers(engine, alone)
        # The worker dropped the old daemon connection's state before serving the new one.
        worker.wait_log("newer connection replaces|daemon disconnected")
        assert (await remote_stats(engine))["kv_sequences"] <= 1


async def test_reset_connections_end_the_request_and_are_reconnected(
    host, worker: WorkerProc, key: Path, model: Path, alone: list[int]
) -> None:
    async with remote_engine(worker, key, model) as engine:
        await cut_mid_decode(host, engine, "reset")
        await check_recovers(engine, alone)


async def test_a_peer_without_the_key_is_refused_and_logged(
    worker: WorkerProc, tmp_path: Path, key: Path, model: Path
) -> None:
    host, port = tcp.parse_address(worker.address)
    with pytest.raises(tcp.AuthError, match="refused this daemon's key"):
        await tcp.connect(host, port, b"w" * 40, timeout=10)
    worker.wait_log(r"refused unauthenticated peer .*: the peer does not hold the worker key")
    # A port scanner that sends nothing is dropped after the handshake's timeout; a daemon
    # with the key still gets in meanwhile.
    _, silent = await asyncio.open_connection(host, port)
    wrong = RemoteSettings(key=b"x" * 40, files={str(model): identify(model)})
    with pytest.raises(WorkerDied, match="refused this daemon's key"):
        async with engine_for(model, ("cpu", worker.device()), remote=wrong):
            pass
    async with engine_for(model, ("cpu", worker.device()), remote=settings(key, model)) as engine:
        assert len((await generate(engine, PROMPT, 4))[0]) == 4
    silent.close()


async def test_another_copy_of_the_model_is_refused_naming_both(
    worker: WorkerProc, key: Path, model: Path, tmp_path: Path
) -> None:
    other = make_tiny_gguf("qwen3", tmp_path / "qwen3.gguf", seed=8, layers=4, context=512).path
    with pytest.raises(WorkerReplyError) as refused:
        async with engine_for(other, ("cpu", worker.device()), remote=settings(key, other)):
            pass
    message = str(refused.value)
    assert f"holds no copy of {other}" in message and identify(other).sha256[:16] in message
    assert str(model) in message  # what it does hold
