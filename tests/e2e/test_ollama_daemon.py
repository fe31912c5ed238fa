"""Ollama's API on the real daemon (SmolLM2), driven by the official `ollama` client and
raw HTTP. The daemon runs with --api-key, which the client sends as Authorization:
Bearer, as it does for a keyed Ollama."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import jsonschema
import ollama
import openai
import pytest
from daemon_proc import DaemonProcess

from luced.gguf_file import GGUFFile

KEY = "sk-ollama-test"
MODEL = "SmolLM2-135M-Instruct.Q4_1"
TAGGED = MODEL + ":latest"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def smol(smollm2_gguf, tmp_path_factory):
    d = DaemonProcess(smollm2_gguf, tmp_path_factory.mktemp("smol-ollama"), "--api-key", KEY)
    d.start()
    yield d
    assert d.stop() == 0
    assert d.segments() == []


@pytest.fixture(scope="module")
def client(smol) -> ollama.Client:
    return ollama.Client(host=smol.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)


def post(d: DaemonProcess, path: str, body: dict, key: str | None = KEY) -> tuple[int, dict, bytes]:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(d.url + path, data=json.dumps(body).encode(), headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def error_of(exc: pytest.ExceptionInfo[ollama.ResponseError], status: int) -> str:
    assert exc.value.status_code == status, exc.value
    return exc.value.error


# --- chat and generate ------------------------------------------------------------------


def test_chat_answers_as_the_openai_route_does(smol, client) -> None:
    reply = client.chat(model=MODEL, messages=QUESTION, options=GREEDY, stream=False)
    assert reply.model == MODEL and reply.done and reply.done_reason == "stop"
    assert reply.message.role == "assistant" and "Paris" in reply.message.content
    assert reply.eval_count > 0 and reply.prompt_eval_count > 0
    for d in ("total_duration", "load_duration", "prompt_eval_duration", "eval_duration"):
        assert isinstance(reply[d], int) and reply[d] >= 0, d
    assert reply.total_duration >= reply.prompt_eval_duration + reply.eval_duration
    chat = openai.OpenAI(base_url=smol.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    same = chat.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0)
    assert same.choices[0].message.content == reply.message.content
    assert same.usage.prompt_tokens == reply.prompt_eval_count
    assert same.usage.completion_tokens == reply.eval_count


def test_chat_stream_is_the_whole_reply_in_pieces(client) -> None:
    whole = client.chat(model=MODEL, messages=QUESTION, options=GREEDY, stream=False)
    parts = list(client.chat(model=MODEL, messages=QUESTION, options=GREEDY, stream=True))
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
    assert len(parts) > 2
    assert "".join(p.message.content for p in parts) == whole.message.content
    last = parts[-1]
    assert last.done_reason == "stop" and last.eval_count == whole.eval_count
    assert last.message.content == "" and last.prompt_eval_count == whole.prompt_eval_count


def test_a_stream_is_ndjson(smol) -> None:
    body = {"model": MODEL, "messages": QUESTION, "options": {**GREEDY, "num_predict": 3}}
    status, headers, raw = post(smol, "/api/chat", body)
    assert status == 200 and headers["Content-Type"] == "application/x-ndjson"
    lines = raw.decode().splitlines()
    objects = [json.loads(x) for x in lines]
    assert raw.endswith(b"\n") and len(objects) >= 2
    assert objects[-1]["done"] is True and objects[-1]["done_reason"] == "length"
    assert objects[-1]["eval_count"] == 3


def test_generate_is_the_chat_of_one_user_turn(client) -> None:
    gen = client.generate(model=TAGGED, prompt=QUESTION[0]["content"], options=GREEDY)
    chat = client.chat(model=TAGGED, messages=QUESTION, options=GREEDY)
    assert gen.response == chat.message.content and gen.model == TAGGED
    assert gen.done_reason == "stop" and len(gen.context) == gen.prompt_eval_count + gen.eval_count
    # The context carries the conversation on.
    more = client.generate(model=MODEL, prompt="And of Italy?", context=gen.context, options=GREEDY)
    assert more.prompt_eval_count > len(gen.context) and more.response


def test_raw_generate_takes_the_prompt_as_written(client) -> None:
    prompt = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    raw = client.generate(model=MODEL, prompt=prompt, raw=True, options=GREEDY)
    assert raw.context is None and raw.prompt_eval_count < 30 and raw.response


# --- options ----------------------------------------------------------------------------


def test_a_seed_reproduces_a_sampled_reply(client) -> None:
    def sample(seed: int) -> str:
        options = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "seed": seed, "num_predict": 24}
        return client.generate(model=MODEL, prompt="Tell me a story.", options=options).response

    first = sample(7)
    assert sample(7) == first
    assert any(sample(s) != first for s in (8, 9, 10))


def test_num_predict_limits_the_tokens(client) -> None:
    # Greedy: Ollama's default sampling may draw the end of turn within five tokens.
    options = {**GREEDY, "num_predict": 5}
    reply = client.generate(model=MODEL, prompt="Count to a hundred.", options=options)
    assert (reply.eval_count, reply.done_reason) == (5, "length")


def test_stop_strings_end_the_reply_before_them(client) -> None:
    free = client.chat(model=MODEL, messages=QUESTION, options=GREEDY).message.content
    stop = free.split()[2]  # a word in the middle of the greedy reply
    cut = client.chat(model=MODEL, messages=QUESTION, options={**GREEDY, "stop": [stop]})
    assert cut.done_reason == "stop"
    assert cut.message.content == free[: free.index(stop)]


def test_num_ctx_bounds_prompt_and_reply(client) -> None:
    reply = client.chat(model=MODEL, messages=QUESTION, options={"num_ctx": 40})
    assert reply.prompt_eval_count + reply.eval_count <= 40
    with pytest.raises(ollama.ResponseError) as exc:
        client.chat(model=MODEL, messages=QUESTION, options={"num_ctx": 8})
    assert "options.num_ctx 8 holds 8" in error_of(exc, 400)


def test_format_json_and_schema(client) -> None:
    prompt = "Describe a cat as JSON."
    reply = client.generate(model=MODEL, prompt=prompt, format="json", options=GREEDY)
    assert isinstance(json.loads(reply.response), dict) and reply.done_reason == "stop"
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    }
    chat = client.chat(
        model=MODEL, messages=[{"role": "user", "content": prompt}], format=schema, options=GREEDY
    )
    jsonschema.validate(json.loads(chat.message.content), schema)


def test_tool_calls_round_trip(client) -> None:
    def get_weather(city: str) -> str:
        """Get the current weather in a city.

        Args:
          city: The city's name
        """
        return "sunny"

    ask = [{"role": "user", "content": "What is the weather in Paris? Use the tool."}]
    reply = client.chat(model=MODEL, messages=ask, tools=[get_weather], options=GREEDY)
    (call,) = reply.message.tool_calls
    assert call.function.name == "get_weather" and set(call.function.arguments) == {"city"}
    streamed = list(
        client.chat(model=MODEL, messages=ask, tools=[get_weather], options=GREEDY, stream=True)
    )
    assert [c.function for p in streamed for c in p.message.tool_calls or ()] == [call.function]
    # The call and its result go back as history.
    result = {"role": "tool", "content": "sunny, 21 C", "tool_name": "get_weather"}
    again = client.chat(model=MODEL, messages=[*ask, reply.message, result], options=GREEDY)
    assert again.done and again.message.content


# --- the model listings -----------------------------------------------------------------


def test_version_tags_ps_show(smol, client, smollm2_gguf) -> None:
    assert client.list().models[0].model == TAGGED
    (tag,) = client.list().models
    assert tag.size == smollm2_gguf.stat().st_size and tag.details.format == "gguf"
    assert (tag.details.family, tag.details.quantization_level) == ("llama", "Q4_1")
    (running,) = client.ps().models
    assert running.name == TAGGED and running.size_vram == 0  # on the CPU
    assert running.context_length == 8192 and running.digest == tag.digest
    show = client.show(MODEL)
    gguf = GGUFFile(smollm2_gguf)
    assert show.template == gguf.get("tokenizer.chat_template")
    assert show.modelinfo["general.architecture"] == "llama"
    assert show.modelinfo["llama.block_count"] == 30
    assert show.capabilities == ["completion", "tools"] and "num_ctx" in show.parameters
    status, _, raw = post(smol, "/api/show", {"name": MODEL})  # the older field
    assert status == 200 and json.loads(raw)["details"]["family"] == "llama"
    with urllib.request.urlopen(
        urllib.request.Request(
            smol.url + "/api/version", headers={"Authorization": f"Bearer {KEY}"}
        )
    ) as r:
        assert json.loads(r.read()) == {"version": "0.32.0"}


def test_load_and_unload_idioms_leave_the_model_loaded(client) -> None:
    assert client.generate(model=MODEL).done_reason == "load"
    assert client.generate(model=MODEL, keep_alive=0).done_reason == "unload"
    assert client.chat(model=MODEL, messages=[], keep_alive="0s").done_reason == "unload"
    assert client.ps().models  # still loaded
    reply = client.chat(model=MODEL, messages=QUESTION, keep_alive="5m", options={"num_predict": 2})
    assert reply.eval_count == 2


# --- errors -------------------------------------------------------------------------------


def test_errors_in_ollamas_shape(smol, client) -> None:
    with pytest.raises(ollama.ResponseError) as exc:
        client.chat(model="llama3.2", messages=QUESTION)
    assert error_of(exc, 404) == f"model 'llama3.2' not found; luced serves '{TAGGED}'"
    with pytest.raises(ollama.ResponseError) as exc:
        client.generate(model=MODEL, prompt="x", options={"num_predict": "many"})
    assert error_of(exc, 400) == "options.num_predict must be an integer, got string"
    with pytest.raises(ollama.ResponseError) as exc:
        list(client.chat(model=MODEL, messages=QUESTION, options={"top_p": 0}, stream=True))
    assert error_of(exc, 400).startswith("options.top_p must be in (0, 1]")
    with pytest.raises(ollama.ResponseError) as exc:
        client.chat(model=MODEL, messages=[{**QUESTION[0], "images": [b"\x89PNG"]}])
    assert "images are not supported" in error_of(exc, 400)
    with pytest.raises(ollama.ResponseError) as exc:
        client.embed(model=MODEL, input="x" * 300_000, truncate=False)
    assert "this model embeds at most" in error_of(exc, 400)
    status, _, raw = post(smol, "/api/chat", {"model": MODEL, "messages": QUESTION}, key=None)
    assert status == 401 and set(json.loads(raw)) == {"error"}
    with pytest.raises(ollama.ResponseError) as exc:
        ollama.Client(host=smol.url, headers={"Authorization": "Bearer wrong"}).list()
    assert "API key" in error_of(exc, 401)


def test_embed_gives_openais_vectors(smol, client) -> None:
    """/api/embed's vectors are the OpenAI route's (unit length, in order); the older
    /api/embeddings gives the same direction, unnormalised."""
    texts = ["The capital of France is Paris.", "Bonjour"]
    reply = client.embed(model=MODEL, input=texts)
    oai = openai.OpenAI(base_url=smol.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    want = oai.embeddings.create(model=MODEL, input=texts, encoding_format="float")
    assert reply.model == MODEL and reply.prompt_eval_count == want.usage.prompt_tokens
    for got, ref in zip(reply.embeddings, want.data, strict=True):
        assert got == pytest.approx(ref.embedding, abs=1e-6)
    raw = client.embeddings(model=MODEL, prompt=texts[0]).embedding
    norm = sum(x * x for x in raw) ** 0.5
    assert norm > 1.5 and [x / norm for x in raw] == pytest.approx(want.data[0].embedding, abs=1e-6)


def test_a_client_that_leaves_mid_stream_frees_its_request(smol) -> None:
    body = json.dumps({"model": MODEL, "messages": QUESTION, "options": {"num_predict": 4000}})
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"}
    req = urllib.request.Request(smol.url + "/api/chat", data=body.encode(), headers=headers)
    with urllib.request.urlopen(req, timeout=120) as r:
        assert json.loads(r.readline())["done"] is False
    status = urllib.request.Request(smol.url + "/v1/status", headers=headers)
    deadline = time.monotonic() + 60
    while json.loads(urllib.request.urlopen(status, timeout=10).read())["queue"]["running"]:
        assert time.monotonic() < deadline, "the request went on after its client left"
        time.sleep(0.2)
