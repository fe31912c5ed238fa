"""/v1/embeddings and Ollama's embedding routes, the request and reply side: parsing (a 400
naming the field), tokenizing and bounding the inputs, the reply's shape in float and base64,
and the routes on an engine whose worker never starts."""

from __future__ import annotations

import base64
import dataclasses
import io
import json
from collections.abc import AsyncIterator

import numpy as np
import pytest
import pytest_asyncio
from aiohttp.test_utils import TestClient, TestServer

from luced.api.embeddings import (
    MAX_INPUTS,
    input_ids,
    parse_embeddings,
    prepare_ollama_embed,
    response_json,
)
from luced.api.fields import APIError
from luced.api.server import make_app
from luced.engine.core import Engine
from luced.engine.metrics import Metrics

VOCAB = 49152
UNSTARTED_CONTEXT = 256  # the unstarted engine's (tests/api/conftest.py)


def parse(**body: object):
    return parse_embeddings(body, model_name="smol", vocab_size=VOCAB)


def test_inputs_in_every_shape() -> None:
    assert parse(input="hi").inputs == ("hi",)
    assert parse(input=["a", "b"]).inputs == ("a", "b")
    assert parse(input=[1, 2.0, 3]).inputs == ((1, 2, 3),)  # one input of token ids
    assert parse(input=[[1, 2], "c", [3]]).inputs == ((1, 2), "c", (3,))
    req = parse(input="x", model="smol", encoding_format="base64", dimensions=64, user="u")
    assert (req.encoding_format, req.dimensions) == ("base64", 64)
    assert parse(input="x", encoding_format=None).encoding_format == "float"


@pytest.mark.parametrize(
    ("body", "status", "param", "message"),
    [
        ({}, 400, "input", "input must be a string or a non-empty array, got null"),
        ({"input": []}, 400, "input", "got an empty array"),
        ({"input": ""}, 400, "input", "input is empty"),
        ({"input": ["a", ""]}, 400, "input[1]", "input[1] is empty"),
        ({"input": [[]]}, 400, "input[0]", "input[0] must not be empty"),
        ({"input": {"text": "a"}}, 400, "input", "got object"),
        ({"input": ["a", 7]}, 400, "input[1]", "input[1] must be a string or an array of"),
        ({"input": [1, VOCAB]}, 400, "input[1]", f"token id {VOCAB} is not in [0, {VOCAB})"),
        ({"input": [[1, True]]}, 400, "input[0][1]", "must be an integer, got boolean"),
        ({"input": ["a"] * (MAX_INPUTS + 1)}, 400, "input", f"at most {MAX_INPUTS} per request"),
        ({"input": "a", "encoding_format": "hex"}, 400, "encoding_format", "float or base64"),
        ({"input": "a", "dimensions": 0}, 400, "dimensions", "dimensions must be >= 1"),
        ({"input": "a", "dimensions": "8"}, 400, "dimensions", "must be an integer"),
        ({"input": "a", "model": "gpt-4"}, 404, "model", "does not exist"),
    ],
)
def test_bad_bodies_name_the_field(body: dict, status: int, param: str, message: str) -> None:
    with pytest.raises(APIError) as exc:
        parse(**body)
    assert (exc.value.status, exc.value.param) == (status, param)
    assert message in exc.value.message


def test_inputs_are_tokenized_and_bounded(unstarted_engine: Engine) -> None:
    tokenizer = unstarted_engine.tokenizer
    text = "The quick brown fox"
    assert input_ids(unstarted_engine, (text, (5, 6))) == [tokenizer.encode(text), [5, 6]]
    whole = (7,) * UNSTARTED_CONTEXT
    assert input_ids(unstarted_engine, (whole,)) == [list(whole)]
    for item, size in (((7,) * (UNSTARTED_CONTEXT + 1), "257 tokens"), ("x" * 9000, "9000 char")):
        with pytest.raises(APIError) as exc:
            input_ids(unstarted_engine, ("ok", item))
        assert exc.value.param == "input[1]" and exc.value.code == "context_length_exceeded"
        assert (
            size in exc.value.message and f"at most {UNSTARTED_CONTEXT} tokens" in exc.value.message
        )
    # Ollama's truncate: the first tokens that fit (this vocabulary adds no EOS to keep)
    (cut,) = input_ids(unstarted_engine, ("word " * 400,), truncate=True)
    assert cut == tokenizer.encode("word " * 400)[:UNSTARTED_CONTEXT]


def test_the_reply_is_openais_list_of_unit_vectors() -> None:
    vectors = [np.array([3, 4], np.float32), np.array([0, 0, 0], np.float32)]
    body = json.loads(response_json(vectors, "float", "smol", 9))
    assert body == {
        "object": "list",
        "data": [
            {
                "object": "embedding",
                "index": 0,
                "embedding": [0.6000000238418579, 0.800000011920929],
            },
            {"object": "embedding", "index": 1, "embedding": [0.0, 0.0, 0.0]},
        ],
        "model": "smol",
        "usage": {"prompt_tokens": 9, "total_tokens": 9},
    }
    raw = json.loads(response_json(vectors, "base64", "smol", 9))["data"][0]["embedding"]
    assert np.frombuffer(base64.b64decode(raw), "<f4").tolist() == pytest.approx([0.6, 0.8])


def test_ollamas_embed_bodies(unstarted_engine: Engine) -> None:
    prep = prepare_ollama_embed(unstarted_engine, {"model": "smol", "input": ["a", "", "b"]})
    assert prep.model == "smol" and len(prep.inputs) == 2  # Ollama skips empty strings
    assert prepare_ollama_embed(unstarted_engine, {"input": []}).inputs == []  # "load"
    for body, message in (
        ({"input": 5}, "input must be a string or an array of strings, got integer"),
        ({"input": ["a", ["b"]]}, "got array"),
        ({"input": "a", "truncate": "yes"}, "truncate must be a boolean"),
        ({"input": "a", "truncate": False, "model": "other"}, "model 'other' not found"),
    ):
        with pytest.raises(APIError, match=message):
            prepare_ollama_embed(unstarted_engine, body)


# --- the routes ------------------------------------------------------------------------------


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def client(unstarted_engine: Engine) -> AsyncIterator[TestClient]:
    async with TestClient(TestServer(make_app(unstarted_engine, Metrics("smol")))) as c:
        yield c


@pytest.mark.asyncio(loop_scope="module")
async def test_routes_on_an_engine_that_is_loading(client: TestClient) -> None:
    resp = await client.post("/v1/embeddings", json={"input": ["a", "b"]})
    assert resp.status == 503 and (await resp.json())["error"]["code"] == "unavailable"
    resp = await client.post("/v1/embeddings", json={"input": "a", "dimensions": 3})
    assert resp.status == 400 and (await resp.json())["error"]["param"] == "dimensions"
    resp = await client.post("/api/embed", json={"model": "smol", "input": "a"})
    assert resp.status == 503 and set(await resp.json()) == {"error"}  # Ollama's shape
    resp = await client.post("/api/embed", json={"model": "smol"})  # Ollama's "load" idiom
    assert resp.status == 200 and await resp.json() == {
        "model": "smol",
        "embeddings": [],
        "total_duration": (await resp.json())["total_duration"],
        "load_duration": 0,
        "prompt_eval_count": 0,
    }
    resp = await client.post("/api/embeddings", json={"model": "smol", "prompt": ""})
    assert resp.status == 200 and await resp.json() == {"embedding": []}


@pytest.mark.asyncio(loop_scope="module")
async def test_a_body_may_carry_many_inputs_of_token_ids(client: TestClient) -> None:
    """500 inputs of 200 ids are more values than one context's request may carry (a
    chat's body would be a 400 before decoding), not more than 2048 inputs may."""
    many = {"input": [[7] * 200] * 500}
    resp = await client.post("/v1/completions", json={"prompt": many["input"]})
    assert resp.status == 400 and "commas" in (await resp.json())["error"]["message"]
    resp = await client.post("/v1/embeddings", json=many)
    assert resp.status == 503  # decoded, parsed and bounded: only the loading engine refuses


@pytest.mark.asyncio(loop_scope="module")
async def test_a_body_may_be_as_large_as_its_inputs_may_carry(client: TestClient) -> None:
    """More bytes than a request of one context may carry (a completion's is a 413 before
    its body is read), not more than 2048 inputs may: the embedding routes lease their
    model with that bound (luced.api.lease.leasing_inputs, Ollama's too)."""

    async def post(path: str, body: dict) -> int:
        data = io.BytesIO(json.dumps(body).encode())  # streamed: aiohttp warns of raw bytes
        resp = await client.post(path, data=data, headers={"Content-Type": "application/json"})
        return resp.status

    ids = [[100] * 250] * 1500  # ~1.9 MB of JSON; a context of 256 tokens takes 1.3 MB
    assert await post("/v1/completions", {"prompt": ids}) == 413
    # read, parsed and bounded: only the loading engine refuses
    assert await post("/v1/embeddings", {"input": ids}) == 503
    texts = ["word " * 1600] * 200  # 8000 characters each, 1.6 MB in all
    assert await post("/api/embed", {"model": "smol", "input": texts}) == 503


@pytest.mark.asyncio(loop_scope="module")
async def test_an_encoder_refuses_generation_before_rendering(
    client: TestClient, unstarted_engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    encoder = dataclasses.replace(unstarted_engine.model, encoder=True)
    monkeypatch.setattr(unstarted_engine.intake, "model", encoder)
    monkeypatch.setattr(unstarted_engine, "chat_template", None)  # none is read
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    for path, body in (("/v1/chat/completions", chat), ("/v1/completions", {"prompt": "hi"})):
        resp = await client.post(path, json=body)
        error = (await resp.json())["error"]
        assert resp.status == 400 and error["code"] == "model_not_supported"
        assert "serves POST /v1/embeddings" in error["message"]
    resp = await client.post("/api/chat", json=chat)
    assert resp.status == 400 and "cannot generate text" in (await resp.json())["error"]
    resp = await client.post("/api/show", json={})
    assert resp.status == 200 and (await resp.json())["template"] == ""
