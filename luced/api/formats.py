"""Engine output -> OpenAI response bodies and server-sent events: pure functions, no I/O.

One `ChatFormat` / `CompletionFormat` per choice of a reply (its `index`; a reply of n
choices has n of them, sharing id, model and created). Non-streaming:
`body([fmt.choice(deltas, reason) for each choice], usage)`. Streaming, as OpenAI sends it,
each choice's chunks interleaved with the others' as they come:

    start()          chat: one chunk with {"role": "assistant", "content": ""}
    chunk(delta)     one chunk per engine delta that has text or logprobs (else None)
    finish(reason)   a chunk with an empty delta and finish_reason
    usage_chunks(u)  once every choice finished, when stream_options.include_usage: a
                     chunk with "choices": [] and the usage (every earlier chunk then
                     carries "usage": null)

each written as `sse(chunk)`, and `SSE_DONE` last. A reply that ends in error instead
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
    """Shapes one choice of a reply (the module docstring)."""

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
        index: int = 0,
    ) -> None:
        self.id = response_id
        self.index = index
        self.model = model
        self.created = created
        # OpenAI's name for the backend configuration that produced the output: the same
        # luced build with the same model and weights gives the same string.
        self.system_fingerprint = system_fingerprint
        self.top_logprobs = top_logprobs
        self.include_usage = include_usage

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.system_fingerprint,
            "choices": choices,
        }

    def body(self, choices: list[dict[str, Any]], usage: dict[str, Any]) -> dict[str, Any]:
        """The whole reply, not streamed: every choice's `choice(...)`, in index order."""
        body = self._envelope(self.object_name, choices)
        body["usage"] = usage
        return body

    def choice(self, deltas: Sequence[Delta], finish_reason: str) -> dict[str, Any]:
        """This choice of a reply that is not streamed."""
        raise NotImplementedError

    def _chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        chunk = self._envelope(self.chunk_object_name, [{"index": self.index, **choice}])
        if self.include_usage:
            chunk["usage"] = None  # OpenAI: null on every chunk but the last
        return chunk

    def start(self) -> list[dict[str, Any]]:
        return []

    def chunk(self, delta: Delta) -> dict[str, Any] | None:
        """The chunk for one engine delta; None if it carries nothing to send."""
        raise NotImplementedError

    def finish(self, finish_reason: str) -> list[dict[str, Any]]:
        """This choice's last chunks."""
        return [self._chunk(self._final_choice(finish_reason))]

    def usage_chunks(self, usage: dict[str, Any]) -> list[dict[str, Any]]:
        """The reply's usage, after every choice finished: a chunk when asked for."""
        if not self.include_usage:
            return []
        last = self._envelope(self.chunk_object_name, [])
        last["usage"] = usage
        return [last]

    def _final_choice(self, finish_reason: str) -> dict[str, Any]:
        raise NotImplementedError


class ChatFormat(OutputFormat):
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def choice(self, deltas: Sequence[Delta], finish_reason: str) -> dict[str, Any]:
        text = "".join(d.text for d in deltas)
        logprobs = None
        if self.top_logprobs is not None:
            items = [t for d in deltas for t in d.logprobs or ()]
            logprobs = {"content": chat_logprobs(items, self.top_logprobs), "refusal": None}
        return {
            "index": self.index,
            "message": {"role": "assistant", "content": text, "refusal": None},
            "logprobs": logprobs,
            "finish_reason": finish_reason,
        }

    def start(self) -> list[dict[str, Any]]:
        first = {
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        return [self._chunk(first)]

    def chunk(self, delta: Delta) -> dict[str, Any] | None:
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

    def choice(self, deltas: Sequence[Delta], finish_reason: str) -> dict[str, Any]:
        logprobs = None
        if self.top_logprobs is not None:
            items = [t for d in deltas for t in d.logprobs or ()]
            logprobs, _ = completion_logprobs(items, self.top_logprobs, 0)
        return {
            "index": self.index,
            "text": "".join(d.text for d in deltas),
            "logprobs": logprobs,
            "finish_reason": finish_reason,
        }

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
