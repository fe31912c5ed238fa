"""What clients of other servers rely on, on the real daemon: OpenAI's logit_bias and
system_fingerprint, Anthropic's extended thinking in a tool loop (the official `anthropic`
client), vLLM's request-phase metrics, `lucectl metrics`, bundled models by name, and
llama-server's own routes staying refused."""

from __future__ import annotations

import json
import subprocess
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import anthropic
import openai
import pytest
from daemon_proc import DaemonProcess
from prometheus_client.parser import text_string_to_metric_families

from luced.runtime.tiny import make_tiny_gguf

MODEL = "SmolLM2-135M-Instruct.Q4_1"
PROMPT = "The capital of France is"
PARIS, BANANA = 7042, 21285  # " Paris", " banana" in SmolLM2's vocabulary
THINK = {"type": "enabled", "budget_tokens": 1024}
WEATHER = {
    "name": "get_weather",
    "description": "Current weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}


def complete(client: openai.OpenAI, **kw):
    return client.completions.create(model=MODEL, prompt=PROMPT, temperature=0, **kw)


def claude(d: DaemonProcess) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=d.url, api_key="unused", max_retries=0, timeout=120)


def post(d: DaemonProcess, path: str, body: dict | None = None) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(
        d.url + path, data=data, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


# --- OpenAI ------------------------------------------------------------------------------


def test_logit_bias_forces_and_forbids_tokens(client: openai.OpenAI) -> None:
    free = complete(client, max_tokens=6, logprobs=1)
    assert free.choices[0].logprobs.tokens[0] == " Paris"
    forced = complete(client, max_tokens=3, logit_bias={str(BANANA): 100})
    assert forced.choices[0].text == " banana banana banana"
    banned = complete(client, max_tokens=6, logprobs=1, logit_bias={str(PARIS): -100})
    tokens = banned.choices[0].logprobs.tokens
    assert " Paris" not in tokens and tokens != free.choices[0].logprobs.tokens
    # Chat too; the logprobs describe the biased distribution the token came from.
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Say a fruit."}],
        temperature=0,
        max_tokens=2,
        logprobs=True,
        logit_bias={str(BANANA): 100},
    )
    (first, second) = chat.choices[0].logprobs.content
    assert (first.token, second.token) == (" banana", " banana")
    assert first.logprob > -1e-3  # all but certain once biased


def test_logit_bias_batched_equals_alone(client: openai.OpenAI) -> None:
    """Requests with different biases decode together (--max-running 8) and give what
    each gives alone. Free, the text is " Paris.\\n\\nThe answer is: 2018-01": the biases
    turn it at its first token, its second (".") and later (" answer")."""
    period, answer = "30", "2988"
    biases = [{}, {str(PARIS): -100}, {period: -100}, {answer: -100, str(BANANA): -3.5}]

    def streamed(bias: dict) -> str:
        chunks = complete(client, max_tokens=16, logit_bias=bias, stream=True)
        return "".join(c.choices[0].text for c in chunks if c.choices)

    complete(client, max_tokens=1)  # the prompt's snapshot: every later run restores it
    alone = [complete(client, max_tokens=16, logit_bias=b).choices[0].text for b in biases]
    assert len(set(alone)) == len(biases)  # each bias changes the text
    with ThreadPoolExecutor(len(biases)) as pool:
        together = list(pool.map(streamed, biases))
    assert together == alone


def test_logit_bias_errors_name_the_field(smol) -> None:
    for bias, fragment in [
        ({"x": 1}, "'x' is not a token id"),
        ({"49152": 1}, "token id 49152 is not in [0, 49152)"),
        ({"5": 101}, "logit_bias[5] must be a number in [-100, 100]"),
    ]:
        body = {"messages": [{"role": "user", "content": "Hi"}], "logit_bias": bias}
        status, body = post(smol, "/v1/chat/completions", body)
        assert status == 400 and body["error"]["param"] == "logit_bias", body
        assert fragment in body["error"]["message"]


def test_system_fingerprint_is_stable(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    one = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    fingerprint = one.system_fingerprint
    assert fingerprint is not None and fingerprint.startswith("luced-")
    chunks = list(
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, stream=True)
    )
    assert {c.system_fingerprint for c in chunks} == {fingerprint}
    assert complete(client, max_tokens=1).system_fingerprint == fingerprint


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("POST", "/completion"),
        ("POST", "/completions"),
        ("POST", "/chat/completions"),
        ("POST", "/infill"),
        ("POST", "/apply-template"),
        ("GET", "/props"),
        ("GET", "/slots"),
    ],
)
def test_llama_server_routes_stay_refused(smol, method: str, path: str) -> None:
    status, body = post(smol, path, {"prompt": "x"} if method == "POST" else None)
    assert status == 404 and body["error"]["message"].startswith(f"{method} {path}")


# --- Anthropic: thinking ---------------------------------------------------------------------


def test_a_tool_loop_carries_thinking_blocks_back(smol) -> None:
    """An agent client's second turn sends the first answer back whole, thinking blocks
    included (what a thinking model's reply holds). SmolLM2 does not think: thinking is
    accepted on both turns, each reply comes without a thinking block, and the earlier
    thinking is dropped, since its template cannot show it."""
    c = claude(smol)
    kw = {"model": MODEL, "max_tokens": 60, "tools": [WEATHER], "thinking": THINK}
    kw["extra_body"] = {"temperature": 0}
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = c.messages.create(messages=question, tool_choice={"type": "any"}, **kw)
    assert [b.type for b in first.content] == ["tool_use"] and first.stop_reason == "tool_use"
    use = first.content[0]
    thought = {"type": "thinking", "thinking": "Paris: call get_weather.", "signature": "c2ln"}
    redacted = {"type": "redacted_thinking", "data": "ZW5jcnlwdGVk"}
    answered = {"type": "tool_result", "tool_use_id": use.id, "content": "18 C, sunny"}
    history = [
        *question,
        {"role": "assistant", "content": [thought, redacted, *first.content]},
        {"role": "user", "content": [answered]},
    ]
    second = c.messages.create(messages=history, **kw)
    assert second.content and "thinking" not in [b.type for b in second.content]
    assert second.stop_reason in ("end_turn", "tool_use", "max_tokens")
    with c.messages.stream(messages=history, **kw) as stream:
        streamed = stream.get_final_message()
    assert streamed.model_dump()["content"] == second.model_dump()["content"]
    counted = c.messages.count_tokens(
        model=MODEL, messages=history, tools=[WEATHER], thinking=THINK
    )
    assert counted.input_tokens == second.usage.input_tokens + (
        second.usage.cache_read_input_tokens or 0
    )
    without = [*question, {"role": "assistant", "content": first.content}, history[2]]
    bare = c.messages.count_tokens(model=MODEL, messages=without, tools=[WEATHER])
    assert bare.input_tokens == counted.input_tokens


def test_thinking_reaches_a_template_that_thinks(tmp_path: Path) -> None:
    """A Qwen3-style model (a tiny random one): thinking on or off is what its template
    is told (off renders an empty think block), and replies are well-formed either way."""
    model = tmp_path / "tiny-qwen3.gguf"
    make_tiny_gguf("qwen3", model, seed=3, context=4096)
    d = DaemonProcess(model, tmp_path).start()
    try:
        c = claude(d)
        name = d.model_name
        question = [{"role": "user", "content": "Why is the sky blue?"}]
        off = c.messages.count_tokens(model=name, messages=question).input_tokens
        on = c.messages.count_tokens(model=name, messages=question, thinking=THINK).input_tokens
        assert off > on  # "<think>\n\n</think>\n\n" closes the thinking before it starts
        kw = {"model": name, "max_tokens": 12, "messages": question, "thinking": THINK}
        reply = c.messages.create(**kw, extra_body={"temperature": 0})
        assert reply.usage.input_tokens + (reply.usage.cache_read_input_tokens or 0) == on
        with c.messages.stream(**kw, extra_body={"temperature": 0}) as stream:
            streamed = stream.get_final_message()
        assert streamed.model_dump()["content"] == reply.model_dump()["content"]
    finally:
        assert d.stop() == 0
    assert d.segments() == []


# --- operations --------------------------------------------------------------------------


def test_request_phase_and_process_metrics(smol, client: openai.OpenAI) -> None:
    """vLLM dashboards' queue, prefill and decode times and tokens per request, and the
    process collector; `lucectl metrics` prints the same exposition."""
    before = smol.metric("luced:request_decode_time_seconds_count")
    complete(client, max_tokens=4)
    names = {
        "luced:request_queue_time_seconds",
        "luced:request_prefill_time_seconds",
        "luced:request_decode_time_seconds",
        "luced:request_generation_tokens",
        "process_resident_memory_bytes",
        "process_cpu_seconds",
    }
    # The engine counts a request once its lane is released, just after the reply went out.
    deadline = time.monotonic() + 30
    while smol.metric("luced:request_decode_time_seconds_count") < before + 1:
        assert time.monotonic() < deadline, smol.metrics()
        time.sleep(0.05)
    http = {f.name for f in text_string_to_metric_families(smol.metrics())}
    assert names <= http
    assert smol.metric("luced:request_decode_time_seconds_count") == before + 1
    assert smol.metric("luced:request_generation_tokens_count") >= 1
    assert smol.metric("luced:request_prefill_time_seconds_sum") > 0
    printed = smol.lucectl("metrics").stdout
    assert {f.name for f in text_string_to_metric_families(printed)} == http


def test_an_unknown_bundled_name_is_one_line(tmp_path: Path) -> None:
    """An unknown model name is one line naming the bundled ones, before anything starts.
    (`luced serve gemma3-270m` serving the bundled Gemma 3: tests/e2e/test_daemon.py.)"""
    wrong = DaemonProcess(Path("gemma3"), tmp_path / "wrong")
    out = subprocess.run(wrong.args, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines()[-1] == (
        "luced: MODEL: 'gemma3' is neither a file nor a bundled model; the bundled models "
        "are smollm2-135m, gemma3-270m (or give the path of a .gguf file)"
    )
