"""make_app over aiohttp's TestServer with the real Engine: first one whose worker never
started (state "loading": routing, errors, auth, metrics), then one serving SmolLM2 in a
real worker process, driven by the official openai client and by raw HTTP."""

from __future__ import annotations

import asyncio
import io
import json
import os
import re
import signal
import time
from collections.abc import AsyncIterator
from html.parser import HTMLParser
from pathlib import Path

import openai
import pytest
import pytest_asyncio
from aiohttp.test_utils import TestClient, TestServer
from openai import AsyncOpenAI
from prometheus_client.parser import text_string_to_metric_families

from luced.api.prepare import BYTES_PER_CHAR, LARGE_BODY, MANY_VALUES, MAX_CHARS_PER_TOKEN
from luced.api.server import MODELS, Guard, make_app
from luced.engine.config import ModelInfo, SchedulingLimits
from luced.engine.core import Engine
from luced.engine.metrics import Metrics
from luced.engine.target import Target, TargetPlacement
from luced.gguf_file import GGUFFile
from luced.ipc.shm import ShmOwner, scan
from luced.text.chat_template import GEMMA_TEMPLATE, ChatTemplate
from luced.text.tokenizer import Tokenizer

pytestmark = pytest.mark.asyncio(loop_scope="module")

MODEL = "smol"
CONTEXT = 512
USER = [{"role": "user", "content": "Name three colors."}]


def make_engine(
    path: Path, tokenizer: Tokenizer, template: ChatTemplate, metrics: Metrics, **kw
) -> tuple[Engine, Target, ShmOwner]:
    owner = ShmOwner()
    placement = TargetPlacement.one_cpu_worker(  # one thread: 2 cores, shared with other tests
        GGUFFile(path), threads=1, kv_capacity=CONTEXT, max_batch_tokens=128
    )
    target = Target(owner, placement)
    engine = Engine(
        target,
        tokenizer,
        template,
        model=ModelInfo(MODEL, CONTEXT),
        metrics=metrics,
        **kw,
    )
    return engine, target, owner


async def error_of(resp, status: int) -> dict:
    assert resp.status == status, await resp.text()
    assert resp.content_type == "application/json"
    body = await resp.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def metric(text: str, name: str, **labels: str) -> float:
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    raise KeyError(name)


# --- a daemon still loading its model ----------------------------------------------------


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def loading(smollm2_gguf: Path, smol_tokenizer: Tokenizer) -> AsyncIterator[TestClient]:
    # Gemma's built-in template insists on alternating turns: a real template that fails.
    template = ChatTemplate(GEMMA_TEMPLATE, {"bos_token": "<s>"}, builtin=True)
    metrics = Metrics(MODEL)
    engine, _, owner = make_engine(smollm2_gguf, smol_tokenizer, template, metrics)
    async with TestClient(TestServer(make_app(engine, metrics))) as client:
        yield client
    owner.unlink_all()


async def test_health_is_503_while_loading(loading: TestClient) -> None:
    resp = await loading.get("/health")
    assert (resp.status, await resp.json()) == (503, {"status": "loading"})


async def test_models(loading: TestClient) -> None:
    body = await (await loading.get("/v1/models")).json()
    assert body["object"] == "list"
    (card,) = body["data"]
    assert (card["id"], card["object"], card["max_model_len"]) == (MODEL, "model", CONTEXT)
    assert (await (await loading.get(f"/v1/models/{MODEL}")).json())["id"] == MODEL
    err = await error_of(await loading.get("/v1/models/gpt-4"), 404)
    assert err["code"] == "model_not_found"


async def test_request_errors_are_openai_shaped(loading: TestClient) -> None:
    post = loading.post
    js = {"Content-Type": "application/json"}
    err = await error_of(await post("/v1/chat/completions", data=b"{oops", headers=js), 400)
    assert "not valid JSON" in err["message"]
    err = await error_of(await post("/v1/chat/completions", json={"messages": USER, "n": 17}), 400)
    assert err["param"] == "n"
    assert err["message"] == (
        "n = 17 asks for 17 choices; at most 16 requests may wait in the queue (--max-queue)"
    )
    two = {"prompt": ["a", "b"], "n": 9}
    err = await error_of(await post("/v1/completions", json=two), 400)
    assert err["param"] == "prompt" and "2 prompts × n = 9 asks for 18 choices" in err["message"]
    err = await error_of(await post("/v1/completions", json={"prompt": "x", "top_p": 0}), 400)
    assert err["param"] == "top_p"
    err = await error_of(
        await post("/v1/chat/completions", json={"messages": USER, "model": "gpt-4o"}), 404
    )
    assert (err["code"], err["param"]) == ("model_not_found", "model")
    turns = [{"role": "assistant", "content": "hi"}]
    err = await error_of(await post("/v1/chat/completions", json={"messages": turns}), 400)
    assert "alternate" in err["message"] and err["param"] == "messages"


async def test_submit_while_loading_is_503_with_retry_after(loading: TestClient) -> None:
    resp = await loading.post("/v1/chat/completions", json={"messages": USER})
    err = await error_of(resp, 503)
    assert err["code"] == "unavailable" and "loading" in err["message"]
    assert resp.headers["Retry-After"] == "1"


async def test_unknown_route_and_method(loading: TestClient) -> None:
    err = await error_of(await loading.get("/v1/nothing"), 404)
    assert "/v1/nothing" in err["message"]
    resp = await loading.get("/v1/chat/completions")
    await error_of(resp, 405)
    assert "POST" in resp.headers["Allow"]


async def test_metrics_endpoint(loading: TestClient) -> None:
    resp = await loading.get("/metrics")
    assert resp.status == 200
    assert resp.headers["Content-Type"].startswith("text/plain; version=0.0.4")
    text = await resp.text()
    assert metric(text, "luced:num_requests_waiting", model_name=MODEL) == 0
    assert "luced:time_to_first_token_seconds_bucket" in text


async def test_body_size_limit_and_api_key(smollm2_gguf: Path, smol_tokenizer: Tokenizer) -> None:
    metrics = Metrics()
    template = ChatTemplate.from_gguf(smollm2_gguf, "llama")
    engine, _, owner = make_engine(smollm2_gguf, smol_tokenizer, template, metrics)
    app = make_app(engine, metrics, api_key="sekret", client_max_size=1024)
    async with TestClient(TestServer(app)) as client:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"}):
            err = await error_of(await client.get("/v1/models", headers=headers), 401)
            assert err["code"] == "invalid_api_key"
        ok = {"Authorization": "Bearer sekret"}
        assert (await client.get("/v1/models", headers=ok)).status == 200
        for path in ("/v1/status", "/v1/status/history"):
            await error_of(await client.get(path), 401)
            assert (await client.get(path, headers=ok)).status == 200
        # The page holds nothing secret: it loads without the key, then asks for it.
        for path in ("/", "/static/app.js"):
            assert (await client.get(path)).status == 200
        assert (await client.get("/health")).status == 503  # open, just not ready
        # /metrics wants the key too, unless --metrics-public
        await error_of(await client.get("/metrics"), 401)
        assert (await client.get("/metrics", headers=ok)).status == 200
        big = {"messages": [{"role": "user", "content": "x" * 2000}]}
        await error_of(await client.post("/v1/chat/completions", json=big, headers=ok), 413)
    owner.unlink_all()


# --- a daemon serving SmolLM2 ------------------------------------------------------------


class Served:
    def __init__(self, client: TestClient, engine: Engine) -> None:
        self.client = client
        self.engine = engine
        self.openai = AsyncOpenAI(
            base_url=str(client.make_url("/v1")), api_key="unused", max_retries=0
        )

    async def metric(self, name: str, **labels: str) -> float:
        return metric(await (await self.client.get("/metrics")).text(), name, **labels)

    async def until_idle(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while self.engine.active is not None or self.engine.waiting:
            assert time.monotonic() < deadline, "the engine never went idle"
            await asyncio.sleep(0.02)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def served(
    smollm2_gguf: Path, smol_tokenizer: Tokenizer, smol_template: ChatTemplate
) -> AsyncIterator[Served]:
    metrics = Metrics(MODEL)
    engine, target, owner = make_engine(
        smollm2_gguf, smol_tokenizer, smol_template, metrics, limits=SchedulingLimits(max_queue=1)
    )
    try:
        async with TestClient(TestServer(make_app(engine, metrics))) as client:
            await target.start()
            engine.start()
            served = Served(client, engine)
            yield served
            await served.openai.close()
            await engine.stop()
    finally:
        await target.close()
        owner.unlink_all()
    assert not [i.name for i in scan() if i.header and i.header.instance == owner.instance]


JSON_TYPE = {"Content-Type": "application/json"}
GREEDY = {"model": MODEL, "messages": USER, "temperature": 0, "max_tokens": 8}


@pytest.mark.real_model
async def test_chat_stream_matches_non_stream(served: Served) -> None:
    assert (await served.client.get("/health")).status == 200
    full = await served.openai.chat.completions.create(**GREEDY)
    choice = full.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens

    stream = await served.openai.chat.completions.create(
        **GREEDY, stream=True, stream_options={"include_usage": True}
    )
    chunks = [c async for c in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content  # greedy: the same tokens either way
    assert chunks[-2].choices[0].finish_reason == choice.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage == full.usage


@pytest.mark.real_model
async def test_logprobs_and_stop_strings(served: Served) -> None:
    full = await served.openai.chat.completions.create(**GREEDY, logprobs=True, top_logprobs=2)
    content = full.choices[0].logprobs.content
    assert len(content) == full.usage.completion_tokens
    for item in content:  # greedy: the chosen token is the most likely one
        assert len(item.top_logprobs) == 2
        assert (item.top_logprobs[0].token, item.top_logprobs[0].logprob) == (
            item.token,
            item.logprob,
        )
    text = full.choices[0].message.content
    stop = text[len(text) // 2 :][:3]
    cut = await served.openai.chat.completions.create(**GREEDY, stop=[stop])
    assert cut.choices[0].message.content == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


@pytest.mark.real_model
async def test_completions_endpoint(served: Served) -> None:
    out = await served.openai.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0, logprobs=1
    )
    choice = out.choices[0]
    assert out.usage.completion_tokens <= 4 and choice.text
    assert "".join(choice.logprobs.tokens) == choice.text
    assert choice.logprobs.text_offset[0] == 0


@pytest.mark.real_model
async def test_disconnects_cancel_the_work_and_a_full_queue_is_429(served: Served) -> None:
    client, engine = served.client, served.engine
    aborted = await served.metric("luced:request_success_total", finished_reason="abort")
    # A: a stream that would run for 400 tokens holds the engine ...
    busy = {**GREEDY, "max_tokens": 400, "ignore_eos": True, "stream": True}
    a = await client.post("/v1/chat/completions", json=busy)
    assert a.status == 200
    first = await a.content.readuntil(b"\n\n")
    assert json.loads(first[len(b"data: ") :])["choices"][0]["delta"]["role"] == "assistant"
    handle_a = engine.active
    # ... B waits in the queue (max_queue=1) ...
    b = asyncio.create_task(client.post("/v1/chat/completions", json=GREEDY))
    while not engine.waiting:
        await asyncio.sleep(0.01)
    handle_b = engine.waiting[0]
    # The status shows both, with their tokens so far.
    queue = (await (await client.get("/v1/status")).json())["queue"]
    (running,) = queue["requests"]
    assert (running["id"], running["prompt_tokens"]) == (
        handle_a.request_id,
        handle_a.prompt_tokens,
    )
    (waiting,) = queue["waiting_requests"]
    assert (waiting["id"], waiting["completion_tokens"]) == (handle_b.request_id, 0)
    assert waiting["prompt_tokens"] == handle_b.prompt_tokens
    # ... so C finds it full.
    c = await client.post("/v1/chat/completions", json=GREEDY)
    err = await error_of(c, 429)
    assert err["code"] == "queue_full" and int(c.headers["Retry-After"]) >= 1
    # B's client gives up while queued, A's mid-stream: the handlers cancel both.
    b.cancel()
    a.close()
    await served.until_idle()
    assert handle_a.cancelled and handle_a.finish_reason == "abort"
    assert handle_b.cancelled and handle_b.finish_reason == "abort"
    assert handle_a.completion_tokens < 400 and handle_b.completion_tokens == 0
    abort = await served.metric("luced:request_success_total", finished_reason="abort")
    # A's at least: today the engine does not count a request it drops from the queue.
    assert abort >= aborted + 1
    # and the daemon serves the next request normally
    after = await served.openai.chat.completions.create(**GREEDY)
    assert after.choices[0].message.content


@pytest.mark.real_model
async def test_worker_death_mid_stream_ends_it_with_an_error_event(served: Served) -> None:
    # Last in the module: the target restarts the worker, which takes a few seconds.
    stream = await served.openai.chat.completions.create(
        **{**GREEDY, "max_tokens": 400}, stream=True, extra_body={"ignore_eos": True}
    )
    got = []
    with pytest.raises(openai.APIError) as info:
        async for chunk in stream:
            got.append(chunk)
            if len(got) == 2:  # the role chunk and one token
                os.kill(served.engine.target.executor.slots[0].handle.pid, signal.SIGKILL)
    assert "worker" in info.value.message
    assert info.value.body["type"] == "server_error"
    deadline = time.monotonic() + 60
    while (resp := await served.client.get("/health")).status != 200:
        assert (await resp.json())["status"] in ("degraded", "loading")
        assert time.monotonic() < deadline, "the worker was not replaced"
        await asyncio.sleep(0.1)
    after = await served.openai.chat.completions.create(**GREEDY)
    assert after.choices[0].message.content


async def test_a_web_page_cannot_drive_it(loading: TestClient) -> None:
    """text/plain POSTs (a cross-site form), foreign Host headers (DNS rebinding) and CORS
    preflights from unknown origins are refused, each in the API's error shape."""
    body = b'{"messages": [{"role": "user", "content": "Hi"}]}'
    for path in ("/v1/chat/completions", "/v1/completions", "/tokenize"):
        resp = await loading.post(path, data=body, headers={"Content-Type": "text/plain"})
        assert "application/json" in (await error_of(resp, 415))["message"]
    resp = await loading.post("/v1/messages", data=body, headers={"Content-Type": "text/plain"})
    assert resp.status == 415 and (await resp.json())["type"] == "error"
    resp = await loading.get("/v1/models", headers={"Host": "evil.example:8000"})
    assert "Host" in (await error_of(resp, 403))["message"]
    assert (await loading.get("/v1/models", headers={"Host": "localhost:8000"})).status == 200
    pre = {"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"}
    await error_of(await loading.options("/v1/chat/completions", headers=pre), 403)
    # A request from another site's page, preflighted or not, is refused as well ...
    evil = {"Origin": "https://evil.example"}
    err = await error_of(await loading.get("/v1/models", headers=evil), 403)
    assert "evil.example" in err["message"]
    for origin in ("null", f"http://{loading.host}:{loading.port + 1}"):
        resp = await loading.post("/v1/chat/completions", json={}, headers={"Origin": origin})
        await error_of(resp, 403)
    # ... but our own page (same host and port) is not.
    ours = {"Origin": f"http://{loading.host}:{loading.port}"}
    assert (await loading.get("/v1/models", headers=ours)).status == 200
    assert (await loading.get("/", headers=evil)).status == 403


async def test_allowed_hosts_and_origins(loading: TestClient) -> None:
    engine = loading.app[MODELS].peek(None)
    guard = Guard("127.0.0.1", ("luced.lan",), ("http://app.lan",), metrics_public=True)
    app = make_app(engine, Metrics(), api_key="k", guard=guard)
    async with TestClient(TestServer(app)) as client:
        assert (await client.get("/metrics", headers={"Host": "luced.lan"})).status == 200
        pre = {"Origin": "http://app.lan", "Access-Control-Request-Method": "POST"}
        resp = await client.options("/v1/chat/completions", headers=pre)
        assert resp.status == 204
        assert resp.headers["Access-Control-Allow-Origin"] == "http://app.lan"


class _Markup(HTMLParser):
    """What a strict Content-Security-Policy would block in a page: inline scripts and
    styles, style attributes and inline event handlers."""

    def __init__(self) -> None:
        super().__init__()
        self.scripts: list[str] = []  # src of each <script>
        self.inline: list[str] = []
        self._in_script = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        names = dict(attrs)
        if tag == "script":
            self.scripts.append(names.get("src") or "")
            self._in_script = True
        if tag == "style":
            self.inline.append("<style>")
        self.inline += [f"{tag} {k}=" for k in names if k == "style" or k.startswith("on")]

    def handle_endtag(self, tag: str) -> None:
        self._in_script = self._in_script and tag != "script"

    def handle_data(self, data: str) -> None:
        if self._in_script and data.strip():
            self.inline.append(f"<script>{data[:40]}")


async def test_the_page_is_served_under_a_strict_csp(loading: TestClient) -> None:
    resp = await loading.get("/")
    assert resp.status == 200 and resp.content_type == "text/html"
    csp = resp.headers["Content-Security-Policy"]
    assert "default-src 'self'" in csp and "connect-src 'self'" in csp
    assert "frame-ancestors 'none'" in csp and "unsafe" not in csp
    assert resp.headers["X-Content-Type-Options"] == "nosniff"
    markup = _Markup()
    markup.feed(await resp.text())
    assert markup.scripts == ["/static/app.js"] and markup.inline == []
    # Every module the page imports, directly or not, is served as JavaScript.
    todo, seen = ["app.js"], set()
    while todo:
        name = todo.pop()
        resp = await loading.get(f"/static/{name}")
        assert resp.status == 200, name
        assert resp.headers["Content-Type"] == "text/javascript; charset=utf-8", name
        assert resp.headers["Content-Security-Policy"] == csp
        seen.add(name)
        folder = name.rpartition("/")[0]
        for target in re.findall(r'(?:^|\n)import[^"\n]*"\./([^"]+)"', await resp.text()):
            path = f"{folder}/{target}" if folder else target
            if path not in seen:
                todo.append(path)
    assert {"chat.js", "status.js", "plots.js", "markdown.js"} <= seen
    assert any(n.startswith("vendor/uplot-") for n in seen)
    # Each vendored library comes with its licence.
    for lib in {n.split("/")[1] for n in seen if n.startswith("vendor/")}:
        assert (await loading.get(f"/static/vendor/{lib}/LICENSE")).status == 200, lib
    # Only the files of the package: no path reaches the file system.
    for bad in ("/static/%2E%2E/server.py", "/static/nothing.js", "/static/vendor"):
        assert (await loading.get(bad)).status == 404, bad
    resp = await loading.get("/static/style.css")
    assert resp.content_type == "text/css"
    again = await loading.get("/static/style.css", headers={"If-None-Match": resp.headers["ETag"]})
    assert again.status == 304


async def test_status_and_its_history(loading: TestClient) -> None:
    body = await (await loading.get("/v1/status")).json()
    assert body["state"] == "loading" and body["model"] == MODEL
    assert body["queue"]["requests"] == [] and body["queue"]["waiting_requests"] == []
    assert body["snapshots"] == []  # no prefix cache
    history = await (await loading.get("/v1/status/history")).json()
    assert history["interval_s"] == 1 and history["span_s"] == 600
    lengths = {len(v) for k, v in history.items() if isinstance(v, list)}
    assert len(lengths) == 1  # one value per second in every column
    assert history["t"] == sorted(history["t"])
    resp = await loading.get("/v1/status/history", params={"since": time.time() - 2})
    assert len((await resp.json())["t"]) <= 2
    for bad in ("yesterday", "nan", "inf"):
        resp = await loading.get("/v1/status/history", params={"since": bad})
        assert (await error_of(resp, 400))["param"] == "since"


async def test_bad_encodings_and_huge_prompts_are_400s(loading: TestClient) -> None:
    engine = loading.app[MODELS].peek(None)
    huge = "x" * (engine.model.context_length * MAX_CHARS_PER_TOKEN + 1)
    resp = await loading.post("/v1/completions", json={"prompt": huge})
    assert (await error_of(resp, 400))["param"] == "prompt"
    resp = await loading.post(
        "/v1/messages", json={"max_tokens": 1, "messages": [{"role": "user", "content": huge}]}
    )
    assert resp.status == 400 and (await resp.json())["type"] == "error"
    js = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
    resp = await loading.post("/v1/chat/completions", data=b"not gzip at all", headers=js)
    assert "cannot be decoded" in (await error_of(resp, 400))["message"]


async def test_every_text_bearing_field_is_bounded_before_parsing(loading: TestClient) -> None:
    """Tools, schemas, tool-call history, Anthropic system blocks, Responses items and
    token-id prompts count against the context's characters too, each a 400 naming the
    field in its API's shape (the model is still loading: the bound comes first)."""
    over = CONTEXT * MAX_CHARS_PER_TOKEN + 1
    text = "x" * over
    tool = {"type": "function", "function": {"name": "f", "description": text}}
    schema = {"type": "object", "properties": {"a": {"type": "string", "description": text}}}
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": text}}
    turns = [*USER, {"role": "assistant", "content": None, "tool_calls": [call]}]
    cases = [
        ("/v1/chat/completions", {"messages": USER, "tools": [tool]}, "tools"),
        (
            "/v1/chat/completions",
            {"messages": USER, "response_format": {"type": "json_schema", "json_schema": {
                "name": "s", "schema": schema}}},
            "response_format",
        ),
        ("/v1/chat/completions", {"messages": turns}, "messages"),
        ("/v1/completions", {"prompt": [1] * over}, "prompt"),
        ("/v1/responses", {"input": [{"type": "function_call_output", "call_id": "c",
                                      "output": {"rows": [text]}}]}, "input"),
        ("/tokenize", {"content": text}, "content"),
        ("/detokenize", {"tokens": [1] * over}, "tokens"),
    ]  # fmt: skip
    for path, body, field in cases:
        err = await error_of(await loading.post(path, json=body), 400)
        assert err["param"] == field, (path, err)
        assert err["message"].startswith(f"{field}: "), err
    system = [{"type": "text", "text": text}]
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        body = {"max_tokens": 1, "system": system, "messages": USER}
        resp = await loading.post(path, json=body)
        assert resp.status == 400
        err = await resp.json()
        assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
        assert err["error"]["message"].startswith("system: "), err
    resp = await loading.post(
        "/v1/messages",
        json={
            "max_tokens": 1,
            "messages": USER,
            "tools": [{"name": "f", "description": text, "input_schema": schema}],
        },
    )
    assert (await resp.json())["error"]["message"].startswith("tools: ")


async def test_bodies_no_request_of_the_context_could_be_are_refused_undecoded(
    loading: TestClient,
) -> None:
    """Larger than any request the context takes: 413; more commas than its values and
    characters: 400; many values, decoded the slow way that lets the loop run: bounded."""
    limit = CONTEXT * MAX_CHARS_PER_TOKEN
    big = json.dumps({"prompt": "hi", "pad": "x" * (BYTES_PER_CHAR * limit + LARGE_BODY)})
    resp = await loading.post("/v1/completions", data=io.BytesIO(big.encode()), headers=JSON_TYPE)
    assert "a context of 512 tokens takes no more" in (await error_of(resp, 413))["message"]
    commas = {"prompt": "hi", "pad": [0] * (3 * limit + LARGE_BODY // 16)}
    err = await error_of(await loading.post("/v1/completions", json=commas), 400)
    assert "commas: more JSON values than a context of 512 tokens" in err["message"]
    ids = {"prompt": [1] * (MANY_VALUES + 1)}  # decoded by the yielding scanner
    err = await error_of(await loading.post("/v1/completions", json=ids), 400)
    assert err["param"] == "prompt"
