"""Several models in one daemon (`--models-dir`, `[models.NAME]` tables): each request is
answered by the model it names, a model loads on its first request while the others go
on serving, an idle one is unloaded with its workers and shared memory, the memory budget
unloads the least recently used idle model and never a busy one, and lucectl loads and
unloads them."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from datetime import datetime
from pathlib import Path

import openai
import pytest
from daemon_proc import DaemonProcess

from luced.ipc.shm import pid_alive
from luced.runtime.tiny import make_tiny_gguf
from luced.serve.config import load_config
from luced.serve.loader import read_spec
from luced.serve.options import ModelEntry

ROOT = Path(__file__).resolve().parents[2]
A, B = "tiny-a", "tiny-b"
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory) -> Path:
    """Two tiny models of different families, so that each answers in its own way."""
    d = tmp_path_factory.mktemp("models")
    make_tiny_gguf("llama", d / f"{A}.gguf", seed=5, context=4096)
    make_tiny_gguf("qwen3", d / f"{B}.gguf", seed=7, context=2048)
    return d


def serve(models_dir: Path, tmp: Path, *extra: str, toml: str = "") -> DaemonProcess:
    config = tmp / "luced.toml"
    config.write_text(f'models_dir = "{models_dir}"\nprefix_cache_bytes = "16M"\n{toml}')
    return DaemonProcess(None, tmp, "--config", str(config), *extra).start()


def client(d: DaemonProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=d.url + "/v1", api_key="none", max_retries=0, timeout=300)


def complete(d: DaemonProcess, model: str, max_tokens: int = 24, **kw) -> openai.types.Completion:
    return client(d).completions.create(
        model=model, prompt=PROMPT, max_tokens=max_tokens, temperature=0, **kw
    )


def stream(d: DaemonProcess, model: str, max_tokens: int) -> openai.Stream:
    return client(d).completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )


def post(d: DaemonProcess, body: dict, path: str = "/v1/completions") -> tuple[int, dict, dict]:
    """POST a JSON body: (status, headers, JSON body), errors included."""
    req = urllib.request.Request(
        d.url + path, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, dict(r.headers), json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read())


def rows(d: DaemonProcess) -> dict[str, dict]:
    return {m["name"]: m for m in d.lucectl_json("models")["models"]}


def wait_state(d: DaemonProcess, name: str, state: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while rows(d)[name]["state"] != state:
        assert time.monotonic() < deadline, f"{name} never {state}: {rows(d)}\n{d.log()}"
        time.sleep(0.2)


def worker_pids(d: DaemonProcess, name: str) -> list[int]:
    return [w["pid"] for w in d.lucectl_json("workers", "--model", name)["workers"]]


def mapped(d: DaemonProcess) -> str:
    """The daemon's memory map: which shared-memory segments it still maps."""
    assert d.proc is not None
    return Path(f"/proc/{d.proc.pid}/maps").read_text()


def generate_tool(model: Path) -> str:
    """The model's greedy text from tools/generate.py: a process that serves nothing else."""
    out = subprocess.run(
        [
            sys.executable, str(ROOT / "tools" / "generate.py"), "--model", str(model),
            "--prompt", PROMPT, "--max-tokens", "24", "--threads", "1", "--json",
            "--weights", "auto",
        ],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])["text"]


def test_each_request_is_answered_by_the_model_it_names(models_dir: Path, tmp_path: Path) -> None:
    d = serve(models_dir, tmp_path)
    assert d.health() == (200, {"status": "ok", "models": {A: "unloaded", B: "unloaded"}})
    answers: dict[str, list[str]] = {A: [], B: []}

    def ask(model: str) -> None:
        for _ in range(2):
            reply = complete(d, model)
            assert reply.model == model
            answers[model].append(reply.choices[0].text)

    # Both load and answer at once, each on its own engine and workers.
    threads = [threading.Thread(target=ask, args=(m,)) for m in (A, B)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert {n: r["state"] for n, r in rows(d).items()} == {A: "ready", B: "ready"}
    assert set(worker_pids(d, A)).isdisjoint(worker_pids(d, B))
    assert d.stop() == 0 and d.segments() == []
    for model in (A, B):
        alone = generate_tool(models_dir / f"{model}.gguf")
        assert answers[model] == [alone, alone], model
    assert answers[A] != answers[B]


def test_an_idle_model_is_unloaded_with_its_workers_and_memory(
    models_dir: Path, tmp_path: Path
) -> None:
    (tmp_path / "models").mkdir()
    for model in (A, B):
        (tmp_path / "models" / f"{model}.gguf").symlink_to(models_dir / f"{model}.gguf")
    (tmp_path / "models" / "broken.gguf").write_bytes(b"not a model")
    toml = f"[models.{A}]\nmodel_keep_alive = 1\ncontext_length = 512\n"
    d = serve(tmp_path / "models", tmp_path, toml=toml)
    # A model that cannot load answers 503 with the reason; the others are not disturbed.
    status, _, body = post(d, {"model": "broken", "prompt": "x", "max_tokens": 1})
    assert status == 503 and body["error"]["code"] == "model_load_failed", body
    assert "broken" in body["error"]["message"] and rows(d)["broken"]["error"]
    first = {m: complete(d, m).choices[0].text for m in (B, A)}
    cards = {
        c["id"]: c for c in json.loads(urllib.request.urlopen(d.url + "/v1/models").read())["data"]
    }
    assert cards[A]["max_model_len"] == 512 and cards[B]["max_model_len"] == 2048  # its table

    def segment(model: str) -> re.Pattern:  # a model's segments: luced-<instance>-m<i>-<name>-
        return re.compile(rf"luced-{d.instance()}-m\d+-{model}-")

    # A running stream holds A loaded (its keep-alive is 1 s) while its workers are read.
    with stream(d, A, max_tokens=64) as held:
        next(iter(held))
        pids = worker_pids(d, A)
        assert any(segment(A).match(s) for s in d.segments()) and segment(A).search(mapped(d))
    wait_state(d, A, "unloaded")
    assert not any(pid_alive(pid) for pid in pids)  # its workers are gone, their memory too
    assert not any(segment(A).match(s) for s in d.segments())  # its segments unlinked
    assert not segment(A).search(mapped(d))  # and unmapped from the daemon
    assert rows(d)[B]["state"] == "ready"  # B keeps the default keep-alive
    assert segment(B).search(mapped(d))
    # Asked again, A loads again and answers as before.
    assert complete(d, A).choices[0].text == first[A]
    assert complete(d, B).choices[0].text == first[B]
    assert d.stop() == 0 and d.segments() == []


@pytest.fixture(scope="module")
def preloaded(models_dir: Path, tmp_path_factory) -> DaemonProcess:
    """A daemon with A loaded at start (/health says 200 once it is) and B not yet."""
    d = serve(models_dir, tmp_path_factory.mktemp("preloaded"), "--preload", A)
    assert rows(d)[A]["state"] == "ready"
    yield d
    assert d.stop() == 0 and d.segments() == []


def test_a_load_does_not_stall_the_model_that_serves(preloaded: DaemonProcess) -> None:
    d = preloaded
    chunks: list[float] = []
    loaded: dict[str, float] = {}

    def load_b() -> None:
        loaded["sent"] = time.monotonic()
        assert complete(d, B, max_tokens=2).model == B
        loaded["answered"] = time.monotonic()

    loader = threading.Thread(target=load_b)
    with stream(d, A, max_tokens=3000) as tokens:
        for _ in tokens:
            chunks.append(time.monotonic())
            if len(chunks) == 1:
                loader.start()
            if "answered" in loaded and chunks[-1] > loaded["answered"] + 0.5:
                break
    loader.join()
    during = [t for t in chunks if loaded["sent"] < t < loaded["answered"]]
    # A's tokens kept coming while B's workers started and loaded.
    assert len(during) >= 3, (len(during), loaded, len(chunks))
    assert rows(d)[B]["load_s"] is not None


def test_lucectl_loads_and_unloads(preloaded: DaemonProcess) -> None:
    d = preloaded
    loaded = d.lucectl_json("load", B)
    assert (loaded["model"], loaded["state"]) == (B, "ready")
    status = d.lucectl_json("status")
    assert status["state"] == "ok" and {m["name"] for m in status["models"]} == {A, B}
    assert d.lucectl_json("status", "--model", B)["model"] == B
    assert "NAME" in d.lucectl("models").stdout
    # A model with a request running is not unloaded, unless forced: the request then ends
    # with an error event.
    with stream(d, A, max_tokens=3000) as tokens:
        next(iter(tokens))
        refused = d.lucectl("unload", A, check=False)
        assert refused.returncode == 1 and "1 request(s) running or queued" in refused.stderr
        assert d.lucectl_json("unload", A, "--force")["state"] == "unloaded"
        with pytest.raises(openai.APIError, match="was unloaded"):
            for _ in tokens:
                pass
    assert d.lucectl_json("unload", B)["state"] == "unloaded"
    assert {n: r["state"] for n, r in rows(d).items()} == {A: "unloaded", B: "unloaded"}
    assert d.lucectl_json("workers")["workers"] == []
    assert complete(d, A).model == A  # a request loads it again


def test_ollama_lists_describes_loads_and_unloads_each_model(preloaded: DaemonProcess) -> None:
    d = preloaded
    d.lucectl("unload", B, check=False)
    wait_state(d, B, "unloaded")
    tags = json.loads(urllib.request.urlopen(d.url + "/api/tags").read())["models"]
    assert {t["name"] for t in tags} == {f"{A}:latest", f"{B}:latest"}
    assert all(t["size"] > 0 and t["details"]["format"] == "gguf" for t in tags)
    # /api/show reads the file: it does not load the model
    status, _, show = post(d, {"model": B.upper()}, "/api/show")
    assert status == 200 and show["template"] and "num_ctx" in show["parameters"]
    assert rows(d)[B]["state"] == "unloaded"
    generate = {"model": f"{B}:latest", "prompt": PROMPT, "stream": False}
    status, _, reply = post(d, {**generate, "options": {"num_predict": 4}}, "/api/generate")
    assert status == 200 and reply["model"] == f"{B}:latest" and reply["done"], reply
    running = json.loads(urllib.request.urlopen(d.url + "/api/ps").read())["models"]
    (b,) = [m for m in running if m["name"] == f"{B}:latest"]
    expires = datetime.fromisoformat(b["expires_at"].replace("Z", "+00:00")).timestamp()
    assert b["context_length"] == 2048 and expires < time.time() + 3600  # its keep-alive
    # keep_alive 0 and nothing to generate: Ollama's "unload", which does not load it again
    unload = {"model": B, "keep_alive": 0, "stream": False}
    assert post(d, unload, "/api/generate")[2]["done_reason"] == "unload"
    wait_state(d, B, "unloaded")
    assert post(d, unload, "/api/generate")[2]["done_reason"] == "unload"
    assert rows(d)[B]["state"] == "unloaded"
    status, _, body = post(d, {"model": "nope", "messages": []}, "/api/chat")
    assert status == 404
    assert body == {"error": f"model 'nope' not found; luced serves '{A}:latest', '{B}:latest'"}


def test_the_memory_budget_unloads_only_idle_models(models_dir: Path, tmp_path: Path) -> None:
    options = ["--max-running", "1", "--prefix-cache-bytes", "0"]
    base = load_config([*options, "--models-dir", str(models_dir)], env={})
    # Each model's estimate as the daemon makes it (its file and KV pool).
    size = {
        m: read_spec(base.for_model(ModelEntry(m, None), models_dir / f"{m}.gguf")).memory
        for m in (A, B)
    }
    budget = max(size.values()) + min(size.values()) // 2  # one fits, not both
    toml = f"[models.{B}]\nmax_queue = 1\n"
    d = serve(models_dir, tmp_path, *options, "--models-memory-budget", str(budget), toml=toml)
    complete(d, A)
    assert rows(d)[A]["memory_bytes"] == size[A]
    # While A streams, B cannot have its room: B's request waits, and with max_queue 1
    # a second one for B is answered 503 at once.
    done: dict[str, float] = {}

    def ask_b() -> None:
        assert complete(d, B, max_tokens=2).model == B
        done[B] = time.monotonic()

    waiter = threading.Thread(target=ask_b)
    reasons = []
    with stream(d, A, max_tokens=300) as tokens:
        for chunk in tokens:
            reasons.append(chunk.choices[0].finish_reason)
            if len(reasons) > 1:
                continue
            waiter.start()
            deadline = time.monotonic() + 60
            while rows(d)[B]["waiting"] < 1:  # B's request waits for its load
                assert time.monotonic() < deadline
                time.sleep(0.05)
            status, headers, body = post(d, {"model": B, "prompt": "x", "max_tokens": 1})
            assert status == 503 and int(headers["Retry-After"]) >= 1, body
            assert "wait for it already" in body["error"]["message"]
    done[A] = time.monotonic()
    waiter.join()
    assert reasons[-1] == "length"  # A's stream ran to its end: never unloaded under it
    assert done[A] < done[B]
    assert {n: r["state"] for n, r in rows(d).items()} == {A: "unloaded", B: "ready"}
    assert f"unloading {A} to make room for {B}" in d.log()
    assert d.stop() == 0 and d.segments() == []


def test_an_encoder_among_several_models_embeds_through_its_lease(tmp_path: Path) -> None:
    """A BERT beside a decoder: /api/show describes it from its file (no template, only
    the `embedding` capability) without loading it; each API's embedding route loads and
    leases the model it names (Ollama's as Ollama matches names), the decoder embeds too,
    and the encoder refuses to generate."""
    models = tmp_path / "models"
    make_tiny_gguf("bert", models / "tiny-bert.gguf", seed=13)
    make_tiny_gguf("llama", models / f"{A}.gguf", seed=5, context=512)
    d = serve(models, tmp_path)
    try:
        status, _, show = post(d, {"model": "TINY-BERT"}, "/api/show")
        assert status == 200 and show["capabilities"] == ["embedding"], show
        assert show["template"] == "" and rows(d)["tiny-bert"]["state"] == "unloaded"
        status, _, out = post(
            d, {"model": "tiny-bert", "input": ["hello", "world"]}, "/v1/embeddings"
        )
        assert status == 200 and [e["index"] for e in out["data"]] == [0, 1], out
        assert len(out["data"][0]["embedding"]) == 64 and out["model"] == "tiny-bert"
        body = {"model": "tiny-bert:latest", "input": "hello"}
        status, _, embed = post(d, body, "/api/embed")
        assert status == 200 and embed["model"] == "tiny-bert:latest", embed
        # the same vector (alone here, in a batch of two there: float32 rounding apart)
        (vector,) = embed["embeddings"]
        want = out["data"][0]["embedding"]
        assert max(abs(x - y) for x, y in zip(vector, want, strict=True)) < 1e-5
        status, _, old = post(d, {"model": "Tiny-Bert", "prompt": "hello"}, "/api/embeddings")
        assert status == 200 and len(old["embedding"]) == 64, old
        status, _, out = post(d, {"model": A, "input": "hello"}, "/v1/embeddings")
        assert status == 200 and out["model"] == A and len(out["data"]) == 1, out
        assert {n: r["state"] for n, r in rows(d).items()} == {A: "ready", "tiny-bert": "ready"}
        status, _, err = post(
            d, {"model": "tiny-bert", "prompt": "hi", "stream": False}, "/api/generate"
        )
        assert status == 400 and "cannot generate" in err["error"], err
        status, _, err = post(d, {"model": "nope", "input": "hi"}, "/api/embed")
        assert status == 404 and "model 'nope' not found" in err["error"], err
    finally:
        assert d.stop() == 0
    assert d.segments() == []
