"""POST /v1/embeddings on the real daemon, driven by the official `openai` client: a tiny
decoder (which serves generation too) and a tiny BERT (which serves embeddings only), each
vector against transformers' pooled last hidden state of the same weights, normalised."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import openai
import pytest
import torch
from daemon_proc import DaemonProcess
from tiny_hf import hf_model

from luced.runtime.tiny import ENCODERS, TinyModel, make_tiny_gguf
from luced.text.tokenizer import Tokenizer

TEXTS = ["The small model reads the prompt.", "hello world", "Sliding window attention"]


def unit(v: torch.Tensor) -> np.ndarray:
    return (v / v.norm()).numpy()


class Reference:
    """transformers' pooled, normalised last hidden state of an input."""

    def __init__(self, tiny: TinyModel, kind: str) -> None:
        model = hf_model(tiny)
        self.model = model if tiny.family in ENCODERS else model.model
        self.tokenizer = Tokenizer.from_gguf(tiny.path, use_cache=False)
        self.kind = kind

    def __call__(self, item: str | list[int]) -> np.ndarray:
        ids = self.tokenizer.encode(item) if isinstance(item, str) else item
        with torch.no_grad():
            h = self.model(torch.tensor([ids])).last_hidden_state[0]
        return unit({"mean": h.mean(0), "cls": h[0], "last": h[-1]}[self.kind])


def close(got: list[float], want: np.ndarray) -> None:
    np.testing.assert_allclose(np.array(got), want, rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module")
def decoder(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("embed-llama")
    tiny = make_tiny_gguf("llama", tmp / "tiny-llama.gguf", seed=12, tied=False)
    d = DaemonProcess(tiny.path, tmp, "--context-length", "96").start()
    yield tiny, d
    assert d.stop() == 0
    assert d.segments() == []


def client_of(d: DaemonProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{d.url}/v1", api_key="x", max_retries=0, timeout=120)


def test_a_decoder_embeds_in_every_input_shape(decoder) -> None:
    tiny, d = decoder
    ref, client = Reference(tiny, "mean"), client_of(d)  # no pooling_type in the file: mean
    out = client.embeddings.create(model=d.model_name, input=TEXTS[0], encoding_format="float")
    assert out.model == d.model_name and out.object == "list"
    (item,) = out.data
    assert item.index == 0 and item.object == "embedding" and len(item.embedding) == 64
    close(item.embedding, ref(TEXTS[0]))
    n = len(ref.tokenizer.encode(TEXTS[0]))
    assert (out.usage.prompt_tokens, out.usage.total_tokens) == (n, n)
    # The SDK's default asks for base64 and decodes it; a batch comes back in input order.
    batch = client.embeddings.create(model=d.model_name, input=TEXTS)
    assert [e.index for e in batch.data] == [0, 1, 2]
    for e, text in zip(batch.data, TEXTS, strict=True):
        close(e.embedding, ref(text))
    ids = [[5, 6, 7, 8], [300, 12, 77]]
    close(client.embeddings.create(model=d.model_name, input=ids[0]).data[0].embedding, ref(ids[0]))
    both = client.embeddings.create(model=d.model_name, input=ids, dimensions=64)
    for e, item_ids in zip(both.data, ids, strict=True):
        close(e.embedding, ref(item_ids))
    assert both.usage.prompt_tokens == 7


def test_a_decoder_generates_as_well(decoder) -> None:
    _, d = decoder
    out = client_of(d).completions.create(model=d.model_name, prompt=[5, 6, 7], max_tokens=3)
    assert out.usage.completion_tokens == 3


def test_errors_name_the_input(decoder) -> None:
    _, d = decoder
    client = client_of(d)
    with pytest.raises(openai.BadRequestError) as exc:
        client.embeddings.create(model=d.model_name, input=["ok", list(range(1, 98))])
    assert exc.value.code == "context_length_exceeded"
    assert exc.value.param == "input[1]" and "97 tokens" in exc.value.message
    with pytest.raises(openai.BadRequestError) as exc:
        client.embeddings.create(model=d.model_name, input="ok", dimensions=32)
    assert exc.value.param == "dimensions" and "64-dimensional" in exc.value.message
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="text-embedding-3-small", input="ok")


def test_bert_serves_embeddings_only(tmp_path: Path) -> None:
    """A BERT GGUF that declares mean pooling, served with --pooling cls: the flag wins."""
    tiny = make_tiny_gguf("bert", tmp_path / "tiny-bert.gguf", seed=13)
    ref = Reference(tiny, "cls")
    d = DaemonProcess(tiny.path, tmp_path, "--pooling", "cls").start()
    try:
        client = client_of(d)
        out = client.embeddings.create(model=d.model_name, input=TEXTS, encoding_format="float")
        for e, text in zip(out.data, TEXTS, strict=True):
            close(e.embedding, ref(text))
        assert [m.id for m in client.models.list().data] == [d.model_name]
        with pytest.raises(openai.BadRequestError) as exc:
            client.chat.completions.create(
                model=d.model_name, messages=[{"role": "user", "content": "hi"}]
            )
        assert exc.value.code == "model_not_supported" and "cannot generate" in exc.value.message
    finally:
        assert d.stop() == 0
    assert d.segments() == []
