"""Engine output -> OpenAI response bodies and server-sent events: pure functions, no I/O.

One `ChatFormat` / `CompletionFormat` per request. Non-streaming: `response(deltas, ...)`.
Streaming, as OpenAI sends it:

    start()          chat: one chunk with {"role": "assistant", "content": ""}
    chunk(delta)     one chunk per engine delta that has text or logprobs (else None)
    end(reason, ...) a chunk with an empty delta and finish_reason; then, when
                     stream_options.include_usage, a chunk with "choices": [] and the usage
                     (every earlier chunk then carries "usage": null)

each written as `sse(chunk)`, and `SSE_DONE` last. A request that ends in error instead
gets `sse(error_body)` before `SSE_DONE` (the openai client raises it as an APIError).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from luced.api.fields import APIError

if TYPE_CHECKING:
    from luced.engine.output import Delta, TokenLogprob

MIN_LOGPROB = -9999.0  # vLLM's floor: -inf is not JSON


# --- JSON out ----------------------------------------------------------------------------


def dumps(obj: Any) -> str:
    """JSON text; UTF-8 as is, unless a lone surrogate (legal in JSON input) forces escapes."""
    text = json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(obj, separators=(",", ":"))
    return text


def sse(obj: Any) -> bytes:
    """One server-sent event carrying obj."""
    return f"data: {dumps(obj)}\n\n".encode()


SSE_DONE = b"data: [DONE]\n\n"


# --- responses ---------------------------------------------------------------------------


def finish_error(finish_reason: str | None, error: str | None) -> APIError | None:
    """The error a request's end stands for, if any (a worker died, the daemon aborted)."""
    if finish_reason == "error":
        return APIError(500, error or "generation failed", code="generation_error")
    if finish_reason == "abort":
        return APIError(503, error or "the request was aborted", code="aborted")
    return None


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _lp(x: float) -> float:
    return x if x > MIN_LOGPROB else MIN_LOGPROB  # also maps -inf and NaN to the floor


def chat_logprobs(items: Iterable[TokenLogprob], top: int) -> list[dict[str, Any]]:
    """Chat's logprobs.content entries."""
    return [
        {
            "token": t.token,
            "logprob": _lp(t.logprob),
            "bytes": list(t.bytes),
            "top_logprobs": [
                {"token": s, "logprob": _lp(p), "bytes": list(b)} for s, p, b in t.top[:top]
            ],
        }
        for t in items
    ]


def completion_logprobs(
    items: Iterable[TokenLogprob], top: int, offset: int
) -> tuple[dict[str, list[Any]], int]:
    """The legacy completions logprobs object, and the text offset after its tokens.

    text_offset counts each token's string length from offset (exact except where a
    token holds part of a UTF-8 character). top_logprobs always holds the chosen token,
    so there are up to top + 1 entries (OpenAI's documented behaviour)."""
    out: dict[str, list[Any]] = {
        "tokens": [],
        "token_logprobs": [],
        "top_logprobs": [],
        "text_offset": [],
    }
    for t in items:
        alternatives = {s: _lp(p) for s, p, _ in t.top[:top]}
        alternatives.setdefault(t.token, _lp(t.logprob))
        out["tokens"].append(t.token)
        out["token_logprobs"].append(_lp(t.logprob))
        out["top_logprobs"].append(alternatives)
        out["text_offset"].append(offset)
        offset += len(t.token)
    return out, offset


class OutputFormat:
    """Shapes one request's output. Streaming: start(), chunk(delta)..., end(...)."""

    object_name = ""
    chunk_object_name = ""

    def __init__(
        self,
        response_id: str,
        model: str,
        created: int,
        *,
        top_logprobs: int | None = None,
        include_usage: bool = False,
        system_fingerprint: str | None = None,
    ) -> None:
        self.id = response_id
        self.model = model
        self.created = created
        # OpenAI's name for the backend configuration that produced the output: the same
        # luced build with the same model and weights gives the same string.
        self.system_fingerprint = system_fingerprint
        self.top_logprobs = top_logprobs
        self.include_usage = include_usage
        # Extra usage fields the server learns at the end (DFlash draft / accepted counts).
        self.usage_extra: dict[str, Any] = {}

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.system_fingerprint,
            "choices": choices,
        }

    def _chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        chunk = self._envelope(self.chunk_object_name, [{"index": 0, **choice}])
        if self.include_usage:
            chunk["usage"] = None  # OpenAI: null on every chunk but the last
        return chunk

    def start(self) -> list[dict[str, Any]]:
        return []

    def end(
        self, finish_reason: str, prompt_tokens: int, completion_tokens: int
    ) -> list[dict[str, Any]]:
        chunks = [self._chunk(self._final_choice(finish_reason))]
        if self.include_usage:
            last = self._envelope(self.chunk_object_name, [])
            last["usage"] = usage(prompt_tokens, completion_tokens) | self.usage_extra
            chunks.append(last)
        return chunks

    def _final_choice(self, finish_reason: str) -> dict[str, Any]:
        raise NotImplementedError


class ChatFormat(OutputFormat):
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def response(
        self,
        deltas: Sequence[Delta],
        finish_reason: str,
        prompt_tokens: int,
        completion_tokens: int,
    ) -> dict[str, Any]:
        text = "".join(d.text for d in deltas)
        logprobs = None
        if self.top_logprobs is not None:
            items = [t for d in deltas for t in d.logprobs or ()]
            logprobs = {"content": chat_logprobs(items, self.top_logprobs), "refusal": None}
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text, "refusal": None},
            "logprobs": logprobs,
            "finish_reason": finish_reason,
        }
        body = self._envelope(self.object_name, [choice])
        body["usage"] = usage(prompt_tokens, completion_tokens) | self.usage_extra
        return body

    def start(self) -> list[dict[str, Any]]:
        first = {
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        return [self._chunk(first)]

    def chunk(self, delta: Delta) -> dict[str, Any] | None:
        """The chunk for one engine delta; None if it carries nothing to send."""
        logprobs = None
        if self.top_logprobs is not None and delta.logprobs:
            logprobs = {
                "content": chat_logprobs(delta.logprobs, self.top_logprobs),
                "refusal": None,
            }
        if not delta.text and logprobs is None:
            return None
        return self._chunk(
            {"delta": {"content": delta.text}, "logprobs": logprobs, "finish_reason": None}
        )

    def _final_choice(self, finish_reason: str) -> dict[str, Any]:
        return {"delta": {}, "logprobs": None, "finish_reason": finish_reason}


class CompletionFormat(OutputFormat):
    object_name = "text_completion"
    chunk_object_name = "text_completion"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._offset = 0  # characters streamed so far, for text_offset

    def response(
        self,
        deltas: Sequence[Delta],
        finish_reason: str,
        prompt_tokens: int,
        completion_tokens: int,
    ) -> dict[str, Any]:
        logprobs = None
        if self.top_logprobs is not None:
            items = [t for d in deltas for t in d.logprobs or ()]
            logprobs, _ = completion_logprobs(items, self.top_logprobs, 0)
        choice = {
            "index": 0,
            "text": "".join(d.text for d in deltas),
            "logprobs": logprobs,
            "finish_reason": finish_reason,
        }
        body = self._envelope(self.object_name, [choice])
        body["usage"] = usage(prompt_tokens, completion_tokens) | self.usage_extra
        return body

    def chunk(self, delta: Delta) -> dict[str, Any] | None:
        logprobs = None
        if self.top_logprobs is not None and delta.logprobs:
            logprobs, self._offset = completion_logprobs(
                delta.logprobs, self.top_logprobs, self._offset
            )
        if not delta.text and logprobs is None:
            return None
        return self._chunk({"text": delta.text, "logprobs": logprobs, "finish_reason": None})

    def _final_choice(self, finish_reason: str) -> dict[str, Any]:
        return {"text": "", "logprobs": None, "finish_reason": finish_reason}
