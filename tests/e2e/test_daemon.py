"""The real daemon as a subprocess, driven with the official `openai` client and raw HTTP.

Each daemon here is `luced serve` with its own port and admin socket; a worker process,
shared memory and the whole request path are real. Tiny random models (fast) cover the
queue, disconnect and failure paths; SmolLM2 covers the API surface with real text.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
from daemon_proc import DaemonProcess
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parents[2]


def client(d: DaemonProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=d.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def chat(d: DaemonProcess, content: str, **kw):
    return client(d).chat.completions.create(
        model="SmolLM2-135M-Instruct.Q4_1",
        messages=[{"role": "user", "content": content}],
        temperature=0,
        **kw,
    )


def raw_post_any(d: DaemonProcess, path: str, body: bytes) -> tuple[int, dict, bytes]:
    """POST and return (status, headers, raw body); a stream is read to its end."""
    import urllib.error
    import urllib.request

    req = urllib.request.Request(
        d.url + path, data=body, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def raw_post(d: DaemonProcess, path: str, body: bytes) -> tuple[int, dict, dict]:
    import urllib.error
    import urllib.request

    req = urllib.request.Request(
        d.url + path, data=body, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, dict(r.headers), json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read())


# -- the API surface on a real model ----------------------------------------------------


def test_chat_stream_equals_non_stream_with_usage(smol) -> None:
    full = chat(smol, "What is the capital of France?", max_tokens=30)
    assert "Paris" in full.choices[0].message.content
    assert full.choices[0].finish_reason == "stop"
    chunks = list(
        chat(
            smol,
            "What is the capital of France?",
            max_tokens=30,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage is not None and chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_concurrent_chats_equal_each_alone(smol) -> None:
    """Continuous batching over HTTP (the default --max-running 8): four chats streamed at
    once give the texts they give one at a time. Each question runs once first, so every
    later run restores the same prefix-cache blocks (a fresh prefill may round apart)."""
    questions = [
        "What is the capital of France?",
        "Name three colors.",
        "Count from one to five.",
        "What is the largest planet?",
    ]

    def streamed(q: str) -> str:
        chunks = chat(smol, q, max_tokens=24, stream=True)
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    for q in questions:
        chat(smol, q, max_tokens=1)
    alone = [chat(smol, q, max_tokens=24).choices[0].message.content for q in questions]
    with ThreadPoolExecutor(len(questions)) as pool:
        together = list(pool.map(streamed, questions))
    assert together == alone
    assert smol.lucectl_json("status")["queue"]["max_running"] == 8


def test_max_tokens_and_stop_sequences(smol) -> None:
    capped = chat(smol, "Write a long story about a dragon.", max_tokens=5)
    assert capped.choices[0].finish_reason == "length"
    assert capped.usage.completion_tokens == 5
    free = chat(smol, "What is the capital of France?", max_tokens=30).choices[0].message.content
    stopped = chat(smol, "What is the capital of France?", max_tokens=30, stop=["Paris"])
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].message.content == free[: free.index("Paris")]


def test_logprobs(smol) -> None:
    out = chat(smol, "Say yes.", max_tokens=4, logprobs=True, top_logprobs=3)
    entries = out.choices[0].logprobs.content
    assert len(entries) == out.usage.completion_tokens
    for e in entries:
        assert e.logprob <= 0 and len(e.top_logprobs) == 3
        assert e.top_logprobs[0].logprob >= e.top_logprobs[-1].logprob
        # Greedy: the chosen token is the most likely one.
        assert e.token == e.top_logprobs[0].token


def test_errors_are_openai_shaped(smol) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        chat(smol, "hi", max_tokens=4, top_p=7)
    assert bad.value.body["param"] == "top_p"
    with pytest.raises(openai.NotFoundError):
        client(smol).chat.completions.create(
            model="no-such-model", messages=[{"role": "user", "content": "hi"}]
        )
    with pytest.raises(openai.BadRequestError, match="--max-queue") as bad:
        chat(smol, "hi", n=17)
    assert bad.value.body["param"] == "n"
    status, _, body = raw_post(smol, "/v1/chat/completions", b"{not json")
    assert status == 400 and body["error"]["type"] == "invalid_request_error"
    status, _, body = raw_post(
        smol,
        "/v1/chat/completions",
        json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**6}).encode(),
    )
    assert status == 400 and "context" in body["error"]["message"]


def generate_tool(model: Path, prompt: str, *extra: str) -> dict:
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tools" / "generate.py"),
            "--model",
            str(model),
            "--prompt",
            prompt,
            "--max-tokens",
            "24",
            "--threads",
            "1",
            "--json",
            "--weights",  # as `luced serve` holds them by default (extra may override)
            "auto",
            *extra,
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_http_greedy_equals_generate_tool(smol, smollm2_gguf) -> None:
    prompt = "Give me three tips for sleeping well."
    tool = generate_tool(smollm2_gguf, prompt, "--chat")
    http = chat(smol, prompt, max_tokens=24)
    assert http.choices[0].message.content == tool["text"]
    completion = client(smol).completions.create(
        model="SmolLM2-135M-Instruct.Q4_1",
        prompt="The capital of France is",
        max_tokens=24,
        temperature=0,
    )
    assert (
        completion.choices[0].text
        == generate_tool(smollm2_gguf, "The capital of France is")["text"]
    )


@pytest.mark.real_model
def test_gemma3_by_its_bundled_name_http_equals_generate_tool(gemma3_gguf, tmp_path) -> None:
    """`luced serve gemma3-270m` serves the bundled Gemma 3, as the generate tool runs it."""
    d = DaemonProcess(Path("gemma3-270m"), tmp_path).start(timeout=300)
    try:
        (card,) = client(d).models.list().data
        assert card.id == gemma3_gguf.stem == "gemma-3-270m-q4_k_m"
        prompt = "The three primary colours are"
        out = client(d).completions.create(
            model=card.id, prompt=prompt, max_tokens=24, temperature=0
        )
        assert out.choices[0].text == generate_tool(gemma3_gguf, prompt)["text"]
    finally:
        assert d.stop() == 0
    assert d.segments() == []


def test_lucectl_status_and_workers(smol) -> None:
    def lucectl(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "luced.serve.lucectl",
                "--socket",
                str(smol.admin_socket),
                *args,
            ],
            capture_output=True,
            text=True,
        )

    status = json.loads(lucectl("--json", "status").stdout)
    assert status["state"] == "ready" and status["model"] == "SmolLM2-135M-Instruct.Q4_1"
    pid = smol.worker_pid()
    table = lucectl("workers").stdout
    assert str(pid) in table and "FORWARDS" in table and "AHEAD_SERVED" in table
    # Each worker row carries its process's counters, from the worker's stats frame.
    (worker,) = json.loads(lucectl("--json", "workers").stdout)["workers"]
    assert worker["stats"]["pid"] == pid
    counters = {"forward_count", "decode_graph_steps", "ahead_served", "ahead_dropped"}
    assert counters <= worker["stats"].keys()
    # Earlier chats in this module left their prompts' K/V blocks in the prefix cache
    # (several running requests share a block pool: blocks, not snapshots).
    assert "keeps prompts as K/V blocks" in lucectl("snapshot", "list").stdout
    assert oct(os.stat(smol.admin_socket).st_mode & 0o777) == "0o600"
    # A daemon started with MODEL serves that one model, loaded for good.
    (row,) = json.loads(lucectl("--json", "models").stdout)["models"]
    assert (row["name"], row["state"], row["keep_alive_s"]) == (status["model"], "ready", None)
    refused = lucectl("unload", status["model"])
    assert refused.returncode == 1 and "this daemon's only model" in refused.stderr


# -- queue, disconnects, failures: SmolLM2 decodes slowly enough to act mid-request ----


def long_stream(d: DaemonProcess, max_tokens: int = 3000) -> openai.Stream:
    return client(d).completions.create(
        model=d.model_name,
        prompt="hello world",
        max_tokens=max_tokens,
        stream=True,
        temperature=0,
        extra_body={"ignore_eos": True},
    )


def test_queue_overflow_is_429(smollm2_gguf, tmp_path) -> None:
    d = DaemonProcess(smollm2_gguf, tmp_path, "--max-queue", "1", "--max-running", "1").start()
    try:
        running = long_stream(d)
        next(iter(running))  # the first request runs
        queued = threading.Thread(target=lambda: list(long_stream(d, 5)), daemon=True)
        queued.start()
        deadline = time.monotonic() + 10
        while d.metric("luced:num_requests_waiting") < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        status, headers, body = raw_post(
            d, "/v1/completions", json.dumps({"prompt": "x", "max_tokens": 2}).encode()
        )
        assert status == 429 and body["error"]["code"] == "queue_full"
        assert float(headers["Retry-After"]) >= 1
        # Counted by reason, with vLLM's model_name label on every series.
        assert d.metric("luced:request_rejected_total", 'reason="max_queue"') == 1
        assert d.metric("luced:request_rejected_total", 'reason="max_queued_tokens"') == 0
        assert f'model_name="{d.model_name}"' in d.metrics()
        assert d.lucectl_json("status")["rejected"] == {"max_queue": 1}
        running.close()
        queued.join(30)
        assert not queued.is_alive()
    finally:
        assert d.stop() == 0
    assert d.segments() == []


def test_second_daemon_on_a_taken_admin_socket_says_so(tiny_gguf, tmp_path) -> None:
    """Two instances with one admin socket (as two default instances on different ports
    would have): the second exits 2 with one line, before loading anything; `lucectl
    drain` then waits until the first has stopped."""
    first = DaemonProcess(tiny_gguf, tmp_path / "a").start()
    try:
        second = DaemonProcess(tiny_gguf, tmp_path / "b")
        second.args[second.args.index("--admin-socket") + 1] = str(first.admin_socket)
        out = subprocess.run(second.args, capture_output=True, text=True, timeout=60)
        assert out.returncode == 2
        errors = [line for line in out.stderr.splitlines() if line.startswith("luced:")]
        assert errors == [
            f"luced: another luced is listening on {first.admin_socket} "
            "(choose another with --admin-socket)"
        ], out.stderr
        assert "Traceback" not in out.stderr and "serving cpu" not in out.stderr  # no worker
        assert first.health()[0] == 200  # the first one is untouched
        drained = first.lucectl("drain")
        assert drained.returncode == 0 and "luced stopped" in drained.stderr
        assert first.proc.wait(30) == 0  # admin socket gone: drained, now exiting
    finally:
        assert first.stop() == 0
    assert first.segments() == []


def send_raw(d: DaemonProcess, body: dict, read_bytes: int = 0) -> socket.socket:
    """Send a completions request on a raw socket (read a little of the answer if asked);
    the caller hangs up by closing the returned socket."""
    payload = json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", d.port))
    s.sendall(
        b"POST /v1/completions HTTP/1.1\r\nContent-Type: application/json\r\n"
        + f"Host: 127.0.0.1:{d.port}\r\nContent-Length: {len(payload)}\r\n\r\n".encode()
        + payload
    )
    got = b""
    while len(got) < read_bytes:
        chunk = s.recv(4096)
        assert chunk, f"the daemon closed the connection after {got[:200]!r}"
        got += chunk
    return s


def wait_for(cond, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.05)


def test_disconnects_stop_the_work(smollm2_gguf, tmp_path) -> None:
    """SmolLM2 decodes slowly enough here to hang up in each phase of a request (one
    request at a time, so that one can wait in the queue; a cancel inside a batch:
    tests/engine/test_continuous_batching.py)."""
    d = DaemonProcess(
        smollm2_gguf, tmp_path, "--max-batch-tokens", "16", "--max-running", "1"
    ).start()

    def aborted() -> float:
        return d.metric("luced:request_success_total", 'finished_reason="abort"')

    def metric(name: str) -> float:
        return d.metric(f"luced:{name}")

    long = {"prompt": "hi", "max_tokens": 3000, "stream": True, "ignore_eos": True}
    try:
        # In decode: read the start of a long stream, then hang up.
        send_raw(d, long, read_bytes=300).close()
        wait_for(lambda: aborted() == 1)
        stopped_at = metric("generation_tokens_total")
        time.sleep(0.5)
        assert metric("generation_tokens_total") == stopped_at < 100

        # While queued: a request waits behind a running one, then hangs up.
        running = send_raw(d, long, read_bytes=300)
        queued = send_raw(d, {"prompt": "queued", "max_tokens": 50})
        wait_for(lambda: metric("num_requests_waiting") == 1)
        queued.close()
        wait_for(lambda: metric("num_requests_waiting") == 0 and aborted() == 2)
        running.close()
        wait_for(lambda: aborted() == 3)

        # In prefill: a long prompt fed 16 tokens per step; hang up once it runs.
        prompt_tokens = metric("prompt_tokens_total")
        prefilling = send_raw(d, {"prompt": "word " * 2000, "max_tokens": 5})
        wait_for(lambda: metric("num_requests_running") == 1)
        prefilling.close()
        wait_for(lambda: aborted() == 4)
        assert metric("prompt_tokens_total") == prompt_tokens  # the prefill never finished
        # The daemon is still healthy and serves the next request.
        status, _, body = raw_post(
            d, "/v1/completions", json.dumps({"prompt": "ok", "max_tokens": 3}).encode()
        )
        assert status == 200 and body["usage"]["completion_tokens"] == 3
    finally:
        assert d.stop() == 0
    assert d.segments() == []


def test_worker_killed_mid_stream(smollm2_gguf, tmp_path) -> None:
    d = DaemonProcess(smollm2_gguf, tmp_path).start()
    try:
        pid = d.worker_pid()
        stream = long_stream(d)
        it = iter(stream)
        next(it)
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(openai.APIError):
            for _ in it:
                pass
        d.wait_health(503, 10)
        d.wait_health(200, 60)
        assert d.worker_pid() != pid
        status, _, body = raw_post(
            d, "/v1/completions", json.dumps({"prompt": "again", "max_tokens": 4}).encode()
        )
        assert status == 200 and body["usage"]["completion_tokens"] == 4
    finally:
        assert d.stop() == 0
    assert d.segments() == []


def test_stopped_worker_is_noticed_killed_and_restarted(smollm2_gguf, tmp_path) -> None:
    """SIGSTOP: the worker neither answers nor exits. Its call misses the deadline, the
    daemon kills it (SIGKILL ends a stopped process), the stream ends with an error,
    /health says so, and the restarted worker serves the next request."""
    d = DaemonProcess(smollm2_gguf, tmp_path, "--worker-timeout", "1").start()
    try:
        pid = d.worker_pid()
        stream = long_stream(d)
        it = iter(stream)
        next(it)
        os.kill(pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        with pytest.raises(openai.APIError):
            for _ in it:
                pass
        noticed = time.monotonic() - stopped_at
        # The deadline: 1 s + 20x a decode step; nowhere near the 60 s of no deadline.
        assert noticed < 30, noticed
        d.wait_health(503, 10)  # health says so while the worker restarts
        d.wait_health(200, 60)
        assert d.worker_pid() != pid
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text()
        assert "missed its deadline" in d.log()
        status, _, body = raw_post(
            d, "/v1/completions", json.dumps({"prompt": "again", "max_tokens": 4}).encode()
        )
        assert status == 200 and body["usage"]["completion_tokens"] == 4
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
        assert d.stop() == 0
    assert d.segments() == []


def test_sigterm_lets_the_stream_finish(smollm2_gguf, tmp_path) -> None:
    d = DaemonProcess(smollm2_gguf, tmp_path).start()
    stream = long_stream(d, max_tokens=40)
    it = iter(stream)
    next(it)
    d.proc.send_signal(signal.SIGTERM)
    chunks = list(it)
    assert chunks[-1].choices[0].finish_reason == "length"
    assert d.proc.wait(60) == 0
    assert d.stop() == 0
    assert d.segments() == []


def test_sigterm_timeout_ends_stream_with_error(smollm2_gguf, tmp_path) -> None:
    d = DaemonProcess(smollm2_gguf, tmp_path, "--shutdown-timeout", "0.5").start()
    stream = long_stream(d, max_tokens=4000)
    it = iter(stream)
    next(it)
    d.proc.send_signal(signal.SIGTERM)
    with pytest.raises(openai.APIError):
        for _ in it:
            pass
    assert d.proc.wait(60) == 0
    assert d.stop() == 0
    assert d.segments() == []


# -- fuzzed request bodies against a real daemon (tiny model) ---------------------------

_values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**40), 2**40),
    st.floats(allow_nan=True),
    st.text(max_size=20),
    st.lists(st.integers(-5, 600), max_size=5),
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=2),
)
_fields = [
    "model",
    "messages",
    "prompt",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stream",
    "logprobs",
    "top_logprobs",
    "n",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "stream_options",
    "input",
    "instructions",
    "max_output_tokens",
    "tools",
    "tool_choice",
    "text",
]
_message = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["user", "system", "assistant", "tool", "bogus", 3]),
        "content": st.one_of(
            st.text(max_size=30),
            st.none(),
            st.integers(),
            st.lists(
                st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=10)})
            ),
        ),
    }
)
_body = st.dictionaries(st.sampled_from(_fields), _values, max_size=6).flatmap(
    lambda d: st.fixed_dictionaries(
        {
            **{k: st.just(v) for k, v in d.items()},
            "messages": st.lists(_message, max_size=3),
            "max_tokens": st.one_of(st.integers(-2, 8), st.just("x")),
        }
    )
)


@pytest.fixture(scope="module")
def tiny_daemon(tiny_gguf, tmp_path_factory):
    d = DaemonProcess(tiny_gguf, tmp_path_factory.mktemp("fuzz")).start()
    yield d
    assert d.stop() == 0
    assert d.segments() == []


# Every POST route; the bodies are chat-shaped, which the others must refuse cleanly.
FUZZED_ROUTES = [
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/v1/responses",
    "/tokenize",
    "/detokenize",
]


@settings(
    max_examples=105, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(body=_body, path=st.sampled_from(FUZZED_ROUTES))
def test_fuzzed_bodies_never_5xx(tiny_daemon, body: dict, path: str) -> None:
    payload = json.dumps(body, allow_nan=True).encode()
    status, _, reply = raw_post_any(tiny_daemon, path, payload)
    assert status < 500, (status, reply)
    assert tiny_daemon.health()[0] == 200


# Ollama's routes: its own fields, and options whose num_predict keeps every reply short (a
# num_predict <= 0 would generate to the end of the context). A stream's failure shows as
# an error line, not a status, so its body must not hold an internal error either.
OLLAMA_OPTIONS = ("num_ctx", "temperature", "top_k", "top_p", "min_p", "seed", "stop")
_ollama_options = st.fixed_dictionaries(
    {"num_predict": st.one_of(st.integers(1, 8), st.just("x"))},
    optional=dict.fromkeys((*OLLAMA_OPTIONS, "repeat_penalty", "typical_p", "mirostat"), _values),
)
_ollama_fields = [
    *("model", "prompt", "system", "raw", "context", "format", "stream", "keep_alive"),
    *("think", "images", "suffix", "template", "tools", "logprobs", "top_logprobs", "name"),
]
_ollama_body = st.dictionaries(st.sampled_from(_ollama_fields), _values, max_size=6).flatmap(
    lambda d: st.fixed_dictionaries(
        {
            **{k: st.just(v) for k, v in d.items()},
            "messages": st.lists(_message, max_size=3),
            "options": _ollama_options,
        }
    )
)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(body=_ollama_body, path=st.sampled_from(["/api/chat", "/api/generate", "/api/show"]))
def test_fuzzed_ollama_bodies_never_fail_inside(tiny_daemon, body: dict, path: str) -> None:
    payload = json.dumps(body, allow_nan=True).encode()
    status, _, reply = raw_post_any(tiny_daemon, path, payload)
    assert status < 500 and b"internal error" not in reply, (status, reply)
    assert tiny_daemon.health()[0] == 200
