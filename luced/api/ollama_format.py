"""Engine output -> Ollama's `/api/chat` and `/api/generate` replies: pure functions, no I/O.

One `OllamaReply` per request. Streaming (NDJSON, one JSON object per line, `line(obj)`):

    chunk(delta)   {"model", "created_at", "message": {"role": "assistant", "content"}
                   (chat) | "response" (generate), "done": false} per delta with text
    end(...)       a request that offered tools: one chunk with the content and
                   "tool_calls" (the text is held back until it parses); then the last
                   object: "done": true, "done_reason" ("stop" | "length"), the counts and
                   durations, and for generate "context" (the ids of prompt and reply)

A request that fails after the first line gets `{"error": message}` as its last line, as
Ollama sends it. Not streaming, `whole(...)` is the last object with the whole content.

Durations are nanoseconds (`Timings`): total (arrival to the end), load (arrival to the
queue: reading, templating, tokenizing; the model itself is loaded when the daemon
starts), prompt_eval (the queue and the prefill, to the first token) and eval (first
token to last).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from luced.api.formats import chat_logprobs, dumps
from luced.text.tool_calls import ToolCall, ToolFormat

if TYPE_CHECKING:
    from luced.engine.core import RequestHandle
    from luced.engine.output import Delta

NDJSON = "application/x-ndjson"


def line(obj: Any) -> bytes:
    """One NDJSON line."""
    return (dumps(obj) + "\n").encode()


def created_at() -> str:
    """Now, as Ollama writes its timestamps (RFC 3339, UTC)."""
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def _ns(seconds: float) -> int:
    return max(0, round(seconds * 1e9))


@dataclass(frozen=True)
class Timings:
    """A finished request's counts and durations (seconds, monotonic clock)."""

    prompt_tokens: int
    completion_tokens: int
    total: float
    load: float
    prompt_eval: float
    eval: float

    @classmethod
    def of(cls, handle: RequestHandle, arrived: float, now: float | None = None) -> Timings:
        now = time.monotonic() if now is None else now
        first = handle.first_token_at or now
        last = handle.last_token_at or first
        return cls(
            prompt_tokens=handle.prompt_tokens,
            completion_tokens=handle.completion_tokens,
            total=now - arrived,
            load=handle.submitted_at - arrived,
            prompt_eval=first - handle.submitted_at,
            eval=last - first,
        )

    def fields(self) -> dict[str, int]:
        return {
            "total_duration": _ns(self.total),
            "load_duration": _ns(self.load),
            "prompt_eval_count": self.prompt_tokens,
            "prompt_eval_duration": _ns(self.prompt_eval),
            "eval_count": self.completion_tokens,
            "eval_duration": _ns(self.eval),
        }


def tool_calls(calls: Sequence[ToolCall]) -> list[dict[str, Any]]:
    """A message's tool_calls in Ollama's spelling: arguments as an object."""
    out = []
    for i, call in enumerate(calls):
        try:
            arguments = json.loads(call.arguments)
        except json.JSONDecodeError:
            arguments = {}
        if not isinstance(arguments, dict):
            arguments = {}
        fn = {"index": i, "name": call.name, "arguments": arguments}
        out.append({"id": call.id, "function": fn})
    return out


class OllamaReply:
    """Shapes one request's output: see the module docstring."""

    def __init__(
        self,
        kind: str,
        model: str,
        *,
        tools: ToolFormat | None = None,
        top_logprobs: int | None = None,
        prompt: Sequence[int] | None = None,
    ) -> None:
        """kind: "chat" or "generate"; prompt: generate's ids, returned as `context` with
        the reply's (None: no context, as for a raw prompt)."""
        self.kind = kind
        self.model = model
        self.tools = tools
        self.top_logprobs = top_logprobs
        self.context = None if prompt is None else list(prompt)
        self._held: list[str] = []  # a tool-calling reply's text, parsed at the end

    def _object(self, text: str, done: bool, **extra: Any) -> dict[str, Any]:
        out: dict[str, Any] = {"model": self.model, "created_at": created_at()}
        message = extra.pop("message", {})  # tool_calls: chat's only
        if self.kind == "chat":
            out["message"] = {"role": "assistant", "content": text, **message}
        else:
            out["response"] = text
        out["done"] = done
        return out | extra

    def idle(self, done_reason: str) -> dict[str, Any]:
        """The answer to Ollama's "load" and "unload" idioms (nothing generated)."""
        return self._object("", True, done_reason=done_reason)

    def chunk(self, delta: Delta) -> dict[str, Any] | None:
        """The line for one engine delta; None if it carries nothing to send yet."""
        self._grow_context(delta)
        extra = self._logprobs([delta])
        if self.tools is not None:
            self._held.append(delta.text)
            return self._object("", False, **extra) if extra else None
        if not delta.text and not extra:
            return None
        return self._object(delta.text, False, **extra)

    def end(self, finish_reason: str, timings: Timings) -> list[dict[str, Any]]:
        """The last line(s) of a stream."""
        lines = []
        if self.tools is not None:
            content, message = self._parsed("".join(self._held))
            if content or message:
                lines.append(self._object(content, False, message=message))
        return [*lines, self._done("", finish_reason, timings)]

    def whole(
        self, deltas: Sequence[Delta], finish_reason: str, timings: Timings
    ) -> dict[str, Any]:
        """The one object of a request that does not stream."""
        for d in deltas:
            self._grow_context(d)
        text = "".join(d.text for d in deltas)
        message: dict[str, Any] = {}
        if self.tools is not None:
            text, message = self._parsed(text)
        return self._done(text, finish_reason, timings, message, self._logprobs(deltas))

    def _done(
        self,
        text: str,
        finish_reason: str,
        timings: Timings,
        message: dict[str, Any] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        out = self._object(text, True, message=message or {}, done_reason=finish_reason)
        out |= timings.fields()
        if self.kind == "generate" and self.context is not None:
            out["context"] = self.context
        return out | (extra or {})

    def _parsed(self, text: str) -> tuple[str, dict[str, Any]]:
        assert self.tools is not None
        parsed = self.tools.parse(text)
        message = {"tool_calls": tool_calls(parsed.calls)} if parsed.calls else {}
        return parsed.content or "", message

    def _logprobs(self, deltas: Sequence[Delta]) -> dict[str, Any]:
        if self.top_logprobs is None:
            return {}
        items = [t for d in deltas for t in d.logprobs or ()]
        return {"logprobs": chat_logprobs(items, self.top_logprobs)} if items else {}

    def _grow_context(self, delta: Delta) -> None:
        if self.context is not None:
            self.context.extend(delta.token_ids)
