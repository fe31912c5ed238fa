"""Engine deltas -> OpenAI bodies and SSE chunks, checked against the openai client's own
response types (the oracle for the shapes) and against the text the deltas carry."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from luced.api.formats import (
    MIN_LOGPROB,
    SSE_DONE,
    ChatFormat,
    CompletionFormat,
    dumps,
    finish_error,
    sse,
)
from luced.engine.output import Delta, TokenLogprob


def lp(token: str, logprob: float, top: list[tuple[str, float]] = ()) -> TokenLogprob:
    return TokenLogprob(
        token_id=0,
        token=token,
        logprob=logprob,
        bytes=list(token.encode()),
        top=[(t, p, list(t.encode())) for t, p in top],
    )


# "Hello" " wor" "ld" "!" as four deltas; the third carries no text yet (held back by a
# possible stop string), the fourth releases it together.
DELTAS = [
    Delta("Hello", [1], [lp("Hello", -0.1, [("Hello", -0.1), ("Hi", -2.5), ("Hey", -3.0)])]),
    Delta(" wor", [2], [lp(" wor", -0.5, [(" wor", -0.5), (" there", -1.0), (" you", -4.0)])]),
    Delta("", [3], None),
    Delta("ld!", [4, 5], [lp("ld", -math.inf, [("x", -1.0)]), lp("!", -0.2)]),
]


def decode_events(events: list[bytes]) -> list[Any]:
    out = []
    for event in events:
        assert event.startswith(b"data: ") and event.endswith(b"\n\n")
        payload = event[len(b"data: ") : -2]
        out.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
    return out


def chat_stream(fmt: ChatFormat, deltas: list[Delta], reason: str = "stop") -> list[Any]:
    chunks = [*fmt.start(), *filter(None, map(fmt.chunk, deltas)), *fmt.end(reason, 7, 5)]
    return decode_events([*map(sse, chunks), SSE_DONE])


# --- chat --------------------------------------------------------------------------------


def test_chat_response_shape() -> None:
    fmt = ChatFormat("chatcmpl-abc", "smol", 1700000000, system_fingerprint="luced-1-ab")
    body = fmt.response(DELTAS, "length", prompt_tokens=7, completion_tokens=5)
    parsed = ChatCompletion.model_validate(body)
    assert parsed.id == "chatcmpl-abc" and parsed.object == "chat.completion"
    assert (parsed.model, parsed.created) == ("smol", 1700000000)
    assert parsed.system_fingerprint == "luced-1-ab"
    # Every chunk of a stream carries it too, as OpenAI's do.
    chunks = chat_stream(fmt, DELTAS)[:-1]
    assert chunks and {c["system_fingerprint"] for c in chunks} == {"luced-1-ab"}
    (choice,) = parsed.choices
    assert choice.message.role == "assistant"
    assert choice.message.content == "Hello world!"
    assert choice.finish_reason == "length"
    assert choice.logprobs is None
    usage = parsed.usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (7, 5, 12)


def test_chat_logprobs_non_stream() -> None:
    body = ChatFormat("chatcmpl-1", "smol", 0, top_logprobs=2).response(DELTAS, "stop", 7, 5)
    content = ChatCompletion.model_validate(body).choices[0].logprobs.content
    assert [c.token for c in content] == ["Hello", " wor", "ld", "!"]
    assert [c.logprob for c in content] == [-0.1, -0.5, MIN_LOGPROB, -0.2]  # -inf floored
    assert content[1].bytes == list(b" wor")
    assert [(t.token, t.logprob) for t in content[0].top_logprobs] == [
        ("Hello", -0.1),
        ("Hi", -2.5),
    ]
    assert content[3].top_logprobs == []
    json.loads(json.dumps(body, allow_nan=False))  # strict JSON: no -Infinity anywhere


def test_chat_top_logprobs_zero_gives_chosen_tokens_only() -> None:
    body = ChatFormat("c", "m", 0, top_logprobs=0).response(DELTAS, "stop", 1, 5)
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == 4 and all(c["top_logprobs"] == [] for c in content)


def test_chat_stream_sequence() -> None:
    events = chat_stream(ChatFormat("chatcmpl-s", "smol", 5), DELTAS)
    assert events[-1] == "[DONE]"
    chunks = [ChatCompletionChunk.model_validate(e) for e in events[:-1]]
    assert all(c.id == "chatcmpl-s" and c.object == "chat.completion.chunk" for c in chunks)
    # role first, then one chunk per delta with text (the empty one is skipped), then the end
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].delta.content for c in chunks[1:-1]] == ["Hello", " wor", "ld!"]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Hello world!"
    assert [c.choices[0].finish_reason for c in chunks] == [None, None, None, None, "stop"]
    assert all("usage" not in e for e in events[:-1])


def test_chat_stream_include_usage() -> None:
    events = chat_stream(ChatFormat("c", "smol", 5, include_usage=True), DELTAS, "length")
    *chunks, usage_chunk, done = events
    assert done == "[DONE]"
    assert all(c["usage"] is None for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"] == {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12}
    ChatCompletionChunk.model_validate(usage_chunk)


def test_chat_stream_logprobs_ride_with_their_text() -> None:
    events = chat_stream(ChatFormat("c", "smol", 5, top_logprobs=1), DELTAS)
    chunks = [ChatCompletionChunk.model_validate(e) for e in events[:-1]]
    per_chunk = [
        [t.token for t in c.choices[0].logprobs.content] if c.choices[0].logprobs else None
        for c in chunks
    ]
    assert per_chunk == [None, ["Hello"], [" wor"], ["ld", "!"], None]
    assert chunks[2].choices[0].logprobs.content[0].top_logprobs[0].token == " wor"


def test_a_delta_with_logprobs_but_no_text_still_streams() -> None:
    fmt = ChatFormat("c", "smol", 5, top_logprobs=0)
    chunk = fmt.chunk(Delta("", [9], [lp("\xe2", -1.0)]))
    assert chunk is not None and chunk["choices"][0]["delta"] == {"content": ""}
    assert ChatFormat("c", "smol", 5).chunk(Delta("", [9], None)) is None


# --- completions -------------------------------------------------------------------------


def test_completion_response_shape_and_logprobs() -> None:
    fmt = CompletionFormat("cmpl-1", "smol", 9, top_logprobs=1)
    body = fmt.response(DELTAS, "stop", prompt_tokens=3, completion_tokens=5)
    parsed = Completion.model_validate(body)
    assert (parsed.id, parsed.object) == ("cmpl-1", "text_completion")
    (choice,) = parsed.choices
    assert (choice.text, choice.finish_reason) == ("Hello world!", "stop")
    assert choice.logprobs.tokens == ["Hello", " wor", "ld", "!"]
    assert choice.logprobs.token_logprobs == [-0.1, -0.5, MIN_LOGPROB, -0.2]
    assert choice.logprobs.text_offset == [0, 5, 9, 11]
    # the top alternative, plus the chosen token whenever it is not among them
    assert choice.logprobs.top_logprobs == [
        {"Hello": -0.1},
        {" wor": -0.5},
        {"x": -1.0, "ld": MIN_LOGPROB},
        {"!": -0.2},
    ]
    assert parsed.usage.total_tokens == 8


def test_completion_stream_offsets_continue_across_chunks() -> None:
    fmt = CompletionFormat("cmpl-2", "smol", 9, top_logprobs=0, include_usage=True)
    *chunks, end, last = [c for c in map(fmt.chunk, DELTAS) if c is not None] + fmt.end(
        "length", 3, 5
    )
    # The openai types want a finish_reason on every Completion; streamed chunks carry
    # null until the end (as OpenAI and vLLM send them), so only the ends are validated.
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, None]
    assert [c["choices"][0]["text"] for c in chunks] == ["Hello", " wor", "ld!"]
    offsets = [c["choices"][0]["logprobs"]["text_offset"] for c in chunks]
    assert offsets == [[0], [5], [9, 11]]
    assert all(c["object"] == "text_completion" and c["usage"] is None for c in chunks)
    end, last = Completion.model_validate(end), Completion.model_validate(last)
    assert (end.choices[0].text, end.choices[0].finish_reason) == ("", "length")
    assert last.choices == [] and last.usage.completion_tokens == 5
    assert fmt.start() == []


# --- errors and JSON ---------------------------------------------------------------------


def test_finish_error_mapping() -> None:
    assert finish_error("stop", None) is None and finish_error("length", None) is None
    err = finish_error("error", "the model worker failed: died")
    assert (err.status, err.type) == (500, "server_error")
    assert err.body() == {
        "error": {
            "message": "the model worker failed: died",
            "type": "server_error",
            "param": None,
            "code": "generation_error",
        }
    }
    assert finish_error("abort", None).status == 503


@pytest.mark.parametrize("text", ["plain", "ünïcödé 😀", "lone \ud800 surrogate"])
def test_dumps_is_always_valid_utf8_json(text: str) -> None:
    out = dumps({"t": text})
    assert json.loads(out.encode("utf-8")) == {"t": text}
    assert sse({"t": text}).decode("utf-8").startswith('data: {"t":')
