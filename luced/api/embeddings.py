"""Embeddings: OpenAI's POST /v1/embeddings, and the path Ollama's /api/embed shares.

    input             a string, an array of strings, an array of token ids (one input) or
                      an array of arrays of token ids; 1 to MAX_INPUTS inputs, none empty
    encoding_format   "float" (default) or "base64": each vector's float32 bytes,
                      little-endian, base64-encoded (what OpenAI's SDK asks for)
    dimensions        only the model's own size: no GGUF key declares Matryoshka training,
                      so luced never shortens a vector (any other value is a 400)
    model             optional; another name than the served one is a 404
    user              accepted and ignored, as are unknown fields

Each input is one engine request (`GenerationRequest.pooling`, `luced.engine.pooling`): its
tokens, with the file's own BOS / EOS ([CLS] ... [SEP] for BERT; token-id inputs as given),
are fed in the steps beside every other request's work, and its last-layer states pooled
as the daemon's --pooling says. The API makes each vector unit length, as OpenAI's are. An
input longer than the model takes (`Intake.embedding_limit`) is a 400 before any input
runs. `usage`: prompt_tokens = total_tokens = the inputs' tokens.

A request's inputs go into the queue as it takes them (`embed_all`): when it is full, the
rest wait for this request's own earlier inputs to finish, and only a request none of whose
inputs is in flight gets the queue's 429. Its body is bounded (`luced.api.prepare`) by what
MAX_INPUTS inputs of the longest length carry (`embedding_tokens`), where a generation's
is bounded by one context: a client that sends token ids sends many values.
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from luced.api.fields import (
    MAX_CHARS_PER_TOKEN,
    APIError,
    bad,
    json_kind,
    read_bool,
    read_int,
    read_text,
)
from luced.api.formats import dumps, finish_error
from luced.api.ollama import check_model as ollama_model
from luced.api.openai import check_model, texts_or_ids, token_ids
from luced.engine.core import Engine, GenerationRequest, RequestHandle
from luced.sampling_params import SamplingParams

MAX_INPUTS = 2048  # OpenAI's bound on one request's inputs
ENCODINGS = ("float", "base64")
_NO_SAMPLING = SamplingParams()


@dataclass(frozen=True)
class EmbeddingsRequest:
    inputs: tuple[str | tuple[int, ...], ...]  # texts to tokenize, or token ids as given
    encoding_format: str = "float"
    dimensions: int | None = None


def parse_embeddings(
    body: Mapping[str, Any], *, model_name: str, vocab_size: int
) -> EmbeddingsRequest:
    """A validated /v1/embeddings body, or APIError (400, or 404 for another model)."""
    check_model(body, model_name)
    encoding = body.get("encoding_format")
    if encoding is None:
        encoding = "float"
    if encoding not in ENCODINGS:
        raise bad("encoding_format", f"encoding_format must be float or base64, got {encoding!r}")
    dimensions = read_int(body, "dimensions", 1)
    return EmbeddingsRequest(_inputs(body.get("input"), vocab_size), encoding, dimensions)


def _inputs(value: Any, vocab_size: int) -> tuple[str | tuple[int, ...], ...]:
    if isinstance(value, str):
        return (_text("input", value),)
    if not isinstance(value, list) or not value:
        got = "an empty array" if value == [] else json_kind(value)
        raise bad("input", f"input must be a string or a non-empty array, got {got}")
    if len(value) > MAX_INPUTS:
        raise bad("input", f"input has {len(value)} items; at most {MAX_INPUTS} per request")
    if all(isinstance(x, int | float) and not isinstance(x, bool) for x in value):
        return (token_ids("input", value, vocab_size, allow_empty=False),)
    return texts_or_ids("input", value, vocab_size, _text)


def _text(param: str, value: Any) -> str:
    text = read_text(param, value)
    if not text:
        raise bad(param, f"{param} is empty")
    return text


def input_ids(
    engine: Engine, inputs: tuple[str | tuple[int, ...], ...], truncate: bool = False
) -> list[list[int]]:
    """Each input's token ids (texts tokenized with the file's BOS / EOS). An input longer
    than the model takes is a 400 naming it (a text that long in characters before it is
    tokenized), or with `truncate` (Ollama's) is cut to fit, keeping its last token (the
    EOS / [SEP]) when the tokenizer adds one."""
    limit = engine.intake.embedding_limit
    tokenizer = engine.tokenizer
    chars = limit * MAX_CHARS_PER_TOKEN  # no token is longer: more cannot fit
    out = []
    for i, item in enumerate(inputs):
        param = f"input[{i}]" if len(inputs) > 1 else "input"
        if isinstance(item, str):
            if len(item) > chars and not truncate:
                raise _too_long(param, f"{len(item)} characters", limit)
            ids = tokenizer.encode(item[:chars])
        else:
            ids = list(item)
        if len(ids) > limit and truncate:
            ids = ids[: limit - 1] + ids[-1:] if tokenizer.add_eos else ids[:limit]
        if len(ids) > limit:
            raise _too_long(param, f"{len(ids)} tokens", limit)
        if not ids:
            raise bad(param, f"{param} has no tokens")
        out.append(ids)
    return out


def _too_long(param: str, size: str, limit: int) -> APIError:
    return APIError(
        400,
        f"{param} has {size}; this model embeds at most {limit} tokens",
        param=param,
        code="context_length_exceeded",
    )


def check_dimensions(engine: Engine, dimensions: int | None) -> None:
    size = engine.embedding_length
    if dimensions is not None and dimensions != size:
        raise bad(
            "dimensions",
            f"dimensions: this model gives {size}-dimensional embeddings and does not declare "
            f"that shorter ones keep their meaning (got {dimensions})",
        )


def embedding_tokens(engine: Engine) -> int:
    """The most tokens one request's inputs carry together: what bounds its body (its
    bytes and values), where a generation's is bounded by the context."""
    return MAX_INPUTS * engine.intake.embedding_limit


@dataclass(frozen=True)
class PreparedEmbeddings:
    request: EmbeddingsRequest
    inputs: list[list[int]]


def prepare_embeddings(engine: Engine, body: dict[str, Any]) -> PreparedEmbeddings:
    """Run off the event loop (`luced.api.prepare.Preparer`): parse, tokenize, bound (each
    input on its own: the body's size is bounded at the HTTP edge)."""
    req = parse_embeddings(
        body, model_name=engine.model.name, vocab_size=engine.tokenizer.vocab_size
    )
    check_dimensions(engine, req.dimensions)
    return PreparedEmbeddings(req, input_ids(engine, req.inputs))


# --- Ollama's shapes -------------------------------------------------------------------------


@dataclass(frozen=True)
class OllamaEmbed:
    model: str  # as the request named it (Ollama echoes it)
    inputs: list[list[int]]  # none: the "load the model" idiom, answered with no vectors


def prepare_ollama_embed(engine: Engine, body: dict[str, Any]) -> OllamaEmbed:
    """/api/embed: `input` a string or an array of strings (none, or only empty ones: the
    "load" idiom, no vectors), `truncate` (default true) cuts an input to fit instead of
    the 400, `dimensions` as above; options and keep_alive are read by Ollama at load time
    and ignored here."""
    model = ollama_model(body, engine.model.name)
    value = body.get("input")
    texts = [value] if isinstance(value, str) else [] if value is None else value
    if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
        got = json_kind(value)
        raise bad("input", f"input must be a string or an array of strings, got {got}")
    if len(texts) > MAX_INPUTS:
        raise bad("input", f"input has {len(texts)} items; at most {MAX_INPUTS} per request")
    check_dimensions(engine, read_int(body, "dimensions", 1))
    inputs = tuple(_text(f"input[{i}]", t) for i, t in enumerate(texts) if t)
    truncate = read_bool(body, "truncate", default=True)
    return OllamaEmbed(model, input_ids(engine, inputs, truncate))


def prepare_ollama_embeddings(engine: Engine, body: dict[str, Any]) -> OllamaEmbed:
    """/api/embeddings (Ollama's older route): one `prompt`; Ollama does not normalise its
    vector, and neither does luced."""
    model = ollama_model(body, engine.model.name)
    prompt = body.get("prompt")
    text = "" if prompt is None else read_text("prompt", prompt)
    return OllamaEmbed(model, input_ids(engine, (text,) if text else ()))


# --- running -------------------------------------------------------------------------------


async def embed_all(engine: Engine, inputs: list[list[int]], request_id: str) -> list[np.ndarray]:
    """Each input's pooled vector (float32, not normalised), in order (see the module
    docstring for how the inputs enter the queue). A client that leaves, or an input that
    fails, cancels the rest."""
    handles: list[RequestHandle] = []
    ends: list[asyncio.Task] = []
    try:
        for i, ids in enumerate(inputs):
            while not engine.intake.queue_takes(len(ids)) and not all(t.done() for t in ends):
                await asyncio.wait(
                    [t for t in ends if not t.done()], return_when=asyncio.FIRST_COMPLETED
                )
            req = GenerationRequest(
                f"{request_id}-{i}", ids, _NO_SAMPLING, pooling=engine.model.pooling
            )
            handles.append(engine.submit(req))  # QueueFull when none of ours is in flight
            ends.append(asyncio.create_task(_end(handles[-1])))
        await asyncio.gather(*ends)
    except BaseException:
        for handle, end in zip(handles, ends, strict=True):
            handle.cancel()
            end.cancel()
        raise
    vectors = []
    for handle in handles:
        if (err := finish_error(handle.finish_reason, handle.error)) is not None:
            raise err
        assert handle.embedding is not None
        vectors.append(handle.embedding)
    return vectors


async def _end(handle: RequestHandle) -> None:
    async for _ in handle:  # an embedding streams no deltas: this waits for its end
        pass


def normalized(vector: np.ndarray) -> np.ndarray:
    """Unit length (L2), as OpenAI's embeddings are; a zero vector stays zero."""
    norm = float(np.linalg.norm(vector))
    return vector / np.float32(norm) if norm > 0 else vector


def encoded(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()


def vectors_json(vectors: list[np.ndarray], normalize: bool = True) -> str:
    """A JSON array of float arrays, built a vector at a time (see `response_json`)."""
    rows = (dumps((normalized(v) if normalize else v).tolist()) for v in vectors)
    return "[" + ",".join(rows) + "]"


def response_json(
    vectors: list[np.ndarray], encoding_format: str, model: str, prompt_tokens: int
) -> str:
    """OpenAI's list of embeddings, each normalised, as JSON text. Built a vector at a time
    in a thread (thousands of floats each): the event loop gets the GIL between them."""
    items = ",".join(
        dumps(
            {
                "object": "embedding",
                "index": i,
                "embedding": encoded(normalized(v), encoding_format),
            }
        )
        for i, v in enumerate(vectors)
    )
    usage = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}
    return f'{{"object":"list","data":[{items}],"model":{dumps(model)},"usage":{dumps(usage)}}}'
