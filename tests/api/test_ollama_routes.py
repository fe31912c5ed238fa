"""The Ollama routes in make_app over aiohttp's TestServer, on an engine whose worker never
starts (state "loading"): routing, Ollama's error shape, the API key, the listings of an
app built without a GGUF's facts, and the idioms that need no generation."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
from aiohttp.test_utils import TestClient, TestServer

from luced.api.server import make_app
from luced.engine.core import Engine
from luced.engine.metrics import Metrics

pytestmark = pytest.mark.asyncio(loop_scope="module")

KEY = "sekret"
AUTH = {"Authorization": f"Bearer {KEY}"}
USER = [{"role": "user", "content": "Hi"}]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def client(unstarted_engine: Engine) -> AsyncIterator[TestClient]:
    app = make_app(unstarted_engine, Metrics("smol"), api_key=KEY)
    async with TestClient(TestServer(app)) as c:
        yield c


async def ollama_error(resp, status: int) -> str:
    assert resp.status == status, await resp.text()
    assert resp.content_type == "application/json"
    body = await resp.json()
    assert set(body) == {"error"} and isinstance(body["error"], str) and body["error"]
    return body["error"]


async def test_listings_without_facts_name_the_model(client: TestClient) -> None:
    tags = await (await client.get("/api/tags", headers=AUTH)).json()
    (model,) = tags["models"]
    assert model["name"] == model["model"] == "smol:latest" and model["details"]["format"] == "gguf"
    ps = await (await client.get("/api/ps", headers=AUTH)).json()
    assert ps["models"][0]["context_length"] == 256
    show = await client.post("/api/show", json={"model": "smol"}, headers=AUTH)
    assert show.status == 200 and (await show.json())["model_info"] == {}
    version = await client.get("/api/version", headers=AUTH)
    assert (await version.json())["version"]


async def test_every_api_route_wants_the_key(client: TestClient) -> None:
    for method, path in [
        ("GET", "/api/version"),
        ("GET", "/api/tags"),
        ("GET", "/api/ps"),
        ("POST", "/api/show"),
        ("POST", "/api/chat"),
        ("POST", "/api/generate"),
        ("POST", "/api/embed"),
    ]:
        resp = await client.request(method, path, json={})
        assert "API key" in await ollama_error(resp, 401), path
    wrong = {"Authorization": "Bearer nope"}
    await ollama_error(await client.get("/api/tags", headers=wrong), 401)


async def test_generation_while_loading_is_503_with_retry_after(client: TestClient) -> None:
    for path, body in [("/api/chat", {"messages": USER}), ("/api/generate", {"prompt": "Hi"})]:
        resp = await client.post(path, json=body, headers=AUTH)
        assert "loading" in await ollama_error(resp, 503)
        assert resp.headers["Retry-After"] == "1"
    # Loading the model is not done either; unloading answers (the model stays).
    resp = await client.post("/api/generate", json={}, headers=AUTH)
    assert "loading" in await ollama_error(resp, 503)
    resp = await client.post("/api/chat", json={"messages": [], "keep_alive": 0}, headers=AUTH)
    body = await resp.json()
    assert resp.status == 200 and (body["done"], body["done_reason"]) == (True, "unload")


async def test_request_errors_are_ollama_shaped(client: TestClient) -> None:
    post = client.post
    err = await ollama_error(
        await post("/api/chat", json={"model": "x", "messages": USER}, headers=AUTH), 404
    )
    assert err == "model 'x' not found; luced serves 'smol:latest'"
    err = await ollama_error(await post("/api/show", json={"model": "x"}, headers=AUTH), 404)
    assert "not found" in err
    js = {**AUTH, "Content-Type": "application/json"}
    err = await ollama_error(await post("/api/generate", data=b"{oops", headers=js), 400)
    assert "not valid JSON" in err
    body = {"prompt": "x", "options": {"temperature": "hot"}}
    err = await ollama_error(await post("/api/generate", json=body, headers=AUTH), 400)
    assert err == "options.temperature must be a number, got string"
    form = {**AUTH, "Content-Type": "application/x-www-form-urlencoded"}
    await ollama_error(await post("/api/generate", data=b"{}", headers=form), 415)
    err = await ollama_error(await post("/api/embed", json={"input": 5}, headers=AUTH), 400)
    assert err == "input must be a string or an array of strings, got integer"
    body = {"model": "x", "prompt": "hi"}
    err = await ollama_error(await post("/api/embeddings", json=body, headers=AUTH), 404)
    assert "not found" in err


async def test_unknown_routes_and_methods(client: TestClient) -> None:
    await ollama_error(await client.get("/api/nothing", headers=AUTH), 404)
    await ollama_error(await client.post("/api/pull", json={"model": "x"}, headers=AUTH), 404)
    resp = await client.get("/api/chat", headers=AUTH)
    await ollama_error(resp, 405)
    assert resp.headers["Allow"] == "POST"
