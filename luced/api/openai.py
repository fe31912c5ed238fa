"""OpenAI request bodies -> validated requests -> engine requests: pure functions, no I/O.

The HTTP edge (`luced.api.server`) reads bytes, calls `decode_body` and `parse_chat` /
`parse_completion`, renders and tokenizes the prompt (`chat_prompt` / `completion_prompt`)
and hands the engine `generation_request(...)`; `luced.api.formats` shapes what comes
back. Raw JSON never travels past this module; every failure is an `APIError` whose
`param` names the offending field (`messages[2].content[0].type`).

Field policy (OpenAI's Chat Completions and legacy Completions APIs):

* Honoured: model, messages / prompt, stream, stream_options.include_usage, stop,
  max_tokens, max_completion_tokens (wins over max_tokens), temperature, top_p, seed,
  frequency_penalty, presence_penalty, logprobs, top_logprobs (chat), logprobs (int,
  completions); and vLLM's extensions top_k (-1 or 0 = off), min_p,
  repetition_penalty, stop_token_ids, ignore_eos.
* Unknown fields are accepted and ignored, like vLLM and unlike OpenAI (which 400s):
  clients built for one server often send another's extras, and a field we do not know
  cannot change what we do. Known fields we cannot honour are rejected with a 400 when
  set to anything but their neutral value, because ignoring them would silently return
  something else than asked for: n > 1, best_of > 1, echo: true, a non-empty suffix, a
  non-empty logit_bias, tools / functions (unless tool_choice is "none"),
  response_format other than {"type": "text"}, audio, modalities other than ["text"].
* Known and ignored (they do not change the output): user, metadata, store,
  service_tier, parallel_tool_calls, reasoning_effort, prediction, tool_choice and
  stream_options when not streaming.
* `model` may be omitted (the served model); any other name is a 404 model_not_found.
* `stop`: a string or up to 16 strings (OpenAI allows 4; stop strings cost us a little per
  token, so a bound stays), each at most 256 characters; empty strings are dropped.
* `max_tokens` default: chat none (up to the context, or the daemon's
  --default-max-tokens); completions 16, as OpenAI documents for that endpoint.
* Roles: system, developer (rendered as system: chat templates do not know it), user,
  assistant, tool. Content is a string or a list of {"type": "text", "text": ...}
  parts, joined with "\\n" (vLLM's choice); other part types are a 400. Assistant
  content may be null (a turn that only made tool calls).
* Numbers: JSON integers written as floats (2.0) count as integers; true/false are not
  numbers; null means "not given".
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from luced.engine.core import GenerationRequest
from luced.sampling_params import SamplingParams
from luced.text.chat_template import ChatTemplateError
from luced.text.prompt import chat_ids

if TYPE_CHECKING:
    from luced.text.chat_template import ChatTemplate
    from luced.text.tokenizer import Tokenizer

MAX_STOP = 16
MAX_STOP_CHARS = 256
MAX_TOP_LOGPROBS = 20  # the worker returns at most 20 alternatives per token
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
ROLES = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
}

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
}


# --- errors ------------------------------------------------------------------------------


class APIError(Exception):
    """An error response: HTTP status plus OpenAI's {"error": {...}} body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _ERROR_TYPES.get(
            status, "server_error" if status >= 500 else "invalid_request_error"
        )
        self.retry_after = retry_after

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(
    message: str, type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def _bad(param: str, message: str) -> APIError:
    return APIError(400, message, param=param)


# --- JSON in ----------------------------------------------------------------------------


def decode_body(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object, or a 400."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise APIError(400, f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {_kind(body)}")
    return body


# --- field readers -----------------------------------------------------------------------


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object" if isinstance(value, dict) else type(value).__name__


def _boolean(body: Mapping[str, Any], name: str, default: bool = False) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _bad(name, f"{name} must be a boolean, got {_kind(value)}")
    return value


def _as_int(param: str, value: Any) -> int:
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(param, f"{param} must be an integer, got {_kind(value)}")
    return value


def _integer(
    body: Mapping[str, Any], name: str, lo: int | None = None, hi: int | None = None
) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    n = _as_int(name, value)
    if (lo is not None and n < lo) or (hi is not None and n > hi):
        bounds = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise _bad(name, f"{name} must be {bounds}, got {n}")
    return n


def _number(
    body: Mapping[str, Any], name: str, lo: float | None = None, hi: float | None = None
) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _bad(name, f"{name} must be a number, got {_kind(value)}")
    try:
        x = float(value)
    except OverflowError:  # an integer beyond float range
        x = math.inf
    if not math.isfinite(x):
        raise _bad(name, f"{name} must be a finite number")
    if (lo is not None and x < lo) or (hi is not None and x > hi):
        raise _bad(name, f"{name} must be in [{lo}, {hi}], got {x}")
    return x


def _text(param: str, value: Any) -> str:
    if not isinstance(value, str):
        raise _bad(param, f"{param} must be a string, got {_kind(value)}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:  # JSON allows "\ud800"; no tokenizer does
        raise _bad(param, f"{param} contains a lone UTF-16 surrogate") from None
    return value


# --- requests ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Options:
    """What both endpoints share, validated."""

    model: str
    stream: bool
    include_usage: bool
    params: SamplingParams
    max_tokens: int | None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    @property
    def top_logprobs(self) -> int | None:
        """None: no logprobs; k: the chosen token's logprob plus k alternatives."""
        return self.params.logprobs


@dataclass(frozen=True)
class ChatRequest:
    options: Options
    messages: tuple[dict[str, Any], ...]  # as the chat template reads them


@dataclass(frozen=True)
class CompletionRequest:
    options: Options
    prompt: str | tuple[int, ...]  # text to tokenize, or token ids as given


def parse_chat(body: Mapping[str, Any], *, model_name: str, vocab_size: int) -> ChatRequest:
    """A validated chat request, or APIError (400, or 404 for an unknown model)."""
    _reject_unsupported(body, chat=True)
    if _boolean(body, "logprobs"):
        top = _integer(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
        logprobs: int | None = 0 if top is None else top
    else:
        if body.get("top_logprobs") is not None:
            raise _bad("top_logprobs", "top_logprobs requires logprobs: true")
        logprobs = None
    max_tokens = _integer(body, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = _integer(body, "max_tokens", 1)
    options = _options(body, model_name, vocab_size, logprobs, max_tokens)
    return ChatRequest(options, _messages(body.get("messages")))


def parse_completion(
    body: Mapping[str, Any], *, model_name: str, vocab_size: int
) -> CompletionRequest:
    """A validated completions request, or APIError (400, or 404 for an unknown model)."""
    _reject_unsupported(body, chat=False)
    logprobs = _integer(body, "logprobs", 0, MAX_TOP_LOGPROBS)
    max_tokens = _integer(body, "max_tokens", 1)
    if max_tokens is None:
        max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS
    options = _options(body, model_name, vocab_size, logprobs, max_tokens)
    return CompletionRequest(options, _prompt(body.get("prompt"), vocab_size))


def _options(
    body: Mapping[str, Any],
    model_name: str,
    vocab_size: int,
    logprobs: int | None,
    max_tokens: int | None,
) -> Options:
    model = body.get("model")
    if model is not None:
        model = _text("model", model)
        if model != model_name:
            raise APIError(
                404,
                f"The model {model!r} does not exist; this server serves {model_name!r}",
                param="model",
                code="model_not_found",
            )
    stream = _boolean(body, "stream")
    stream_options = body.get("stream_options")
    include_usage = False
    if stream and stream_options is not None:
        if not isinstance(stream_options, dict):
            raise _bad(
                "stream_options", f"stream_options must be an object, got {_kind(stream_options)}"
            )
        include_usage = _boolean(stream_options, "include_usage")
    return Options(
        model=model_name,
        stream=stream,
        include_usage=include_usage,
        params=_sampling(body, logprobs),
        max_tokens=max_tokens,
        stop=_stop(body.get("stop")),
        stop_token_ids=_token_ids(
            "stop_token_ids", body.get("stop_token_ids"), vocab_size, allow_empty=True
        ),
        ignore_eos=_boolean(body, "ignore_eos"),
    )


def _sampling(body: Mapping[str, Any], logprobs: int | None) -> SamplingParams:
    fields: dict[str, Any] = {"logprobs": logprobs}
    for name in ("temperature", "top_p", "min_p", "repetition_penalty"):
        if (x := _number(body, name)) is not None:
            fields[name] = x
    for name in ("frequency_penalty", "presence_penalty"):
        if (x := _number(body, name, -2.0, 2.0)) is not None:
            fields[name] = x
    top_k = _integer(body, "top_k")
    if top_k is not None:
        fields["top_k"] = 0 if top_k == -1 else top_k  # vLLM spells "off" -1
    fields["seed"] = _integer(body, "seed")
    try:
        return SamplingParams(**fields)
    except (ValueError, TypeError, OverflowError) as exc:
        # SamplingParams' messages start with the field's name, e.g. "top_p must be ...".
        name = str(exc).split(" ", 1)[0]
        raise APIError(400, str(exc), param=name if name in body else None) from None


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list):
        raise _bad("stop", f"stop must be a string or an array of strings, got {_kind(value)}")
    if len(items) > MAX_STOP:
        raise _bad("stop", f"stop takes at most {MAX_STOP} strings, got {len(items)}")
    out = []
    for i, item in enumerate(items):
        param = "stop" if isinstance(value, str) else f"stop[{i}]"
        text = _text(param, item)
        if len(text) > MAX_STOP_CHARS:
            raise _bad(param, f"{param} is longer than {MAX_STOP_CHARS} characters")
        if text and text not in out:
            out.append(text)
    return tuple(out)


def _token_ids(param: str, value: Any, vocab_size: int, allow_empty: bool) -> tuple[int, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise _bad(param, f"{param} must be an array of token ids, got {_kind(value)}")
    if not value and not allow_empty:
        raise _bad(param, f"{param} must not be empty")
    ids = []
    for i, item in enumerate(value):
        t = _as_int(f"{param}[{i}]", item)
        if not 0 <= t < vocab_size:
            raise _bad(f"{param}[{i}]", f"{param}[{i}]: token id {t} is not in [0, {vocab_size})")
        ids.append(t)
    return tuple(ids)


def _reject_unsupported(body: Mapping[str, Any], chat: bool) -> None:
    n = _integer(body, "n", 1)
    if n is not None and n > 1:
        raise _bad("n", "n > 1 is not supported")
    if logit_bias := body.get("logit_bias"):
        raise _bad("logit_bias", f"logit_bias is not supported (got {_kind(logit_bias)})")
    if chat:
        for tools, choice in (("tools", "tool_choice"), ("functions", "function_call")):
            if body.get(tools) and body.get(choice) != "none":
                raise _bad(
                    tools, f'tool calling is not supported; send {choice}: "none" or no {tools}'
                )
        fmt = body.get("response_format")
        if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
            raise _bad("response_format", 'only response_format {"type": "text"} is supported')
        if body.get("audio") is not None:
            raise _bad("audio", "audio output is not supported")
        modalities = body.get("modalities")
        if modalities is not None and modalities != ["text"]:
            raise _bad("modalities", 'only modalities ["text"] is supported')
    else:
        if _boolean(body, "echo"):
            raise _bad("echo", "echo is not supported")
        best_of = _integer(body, "best_of", 1)
        if best_of is not None and best_of > 1:
            raise _bad("best_of", "best_of > 1 is not supported")
        if suffix := body.get("suffix"):
            raise _bad("suffix", f"suffix is not supported (got {_kind(suffix)})")


def _messages(value: Any) -> tuple[dict[str, Any], ...]:
    if not isinstance(value, list) or not value:
        got = "an empty array" if value == [] else _kind(value)
        raise _bad("messages", f"messages must be a non-empty array of messages, got {got}")
    out = []
    for i, m in enumerate(value):
        p = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _bad(p, f"{p} must be an object, got {_kind(m)}")
        role = m.get("role")
        if role not in ROLES:
            roles = ", ".join(ROLES)
            raise _bad(f"{p}.role", f"{p}.role must be one of {roles}; got {role!r}")
        msg: dict[str, Any] = {"role": ROLES[role]}
        content = m.get("content")
        if content is None and role == "assistant":
            msg["content"] = None  # the template sees the key absent
        else:
            msg["content"] = _content(f"{p}.content", content)
        for key in ("name", "tool_call_id"):
            if m.get(key) is not None:
                msg[key] = _text(f"{p}.{key}", m[key])
        if role == "assistant" and m.get("tool_calls") is not None:
            calls = m["tool_calls"]
            if not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls):
                raise _bad(f"{p}.tool_calls", f"{p}.tool_calls must be an array of objects")
            msg["tool_calls"] = calls  # passed to the template as given
        out.append(msg)
    return tuple(out)


def _content(param: str, value: Any) -> str:
    if isinstance(value, str):
        return _text(param, value)
    if not isinstance(value, list):
        raise _bad(
            param, f"{param} must be a string or an array of content parts, got {_kind(value)}"
        )
    texts = []
    for j, part in enumerate(value):
        pp = f"{param}[{j}]"
        if not isinstance(part, dict):
            raise _bad(pp, f"{pp} must be an object, got {_kind(part)}")
        kind = part.get("type")
        if kind != "text":
            raise _bad(f"{pp}.type", f"{pp}.type {kind!r} is not supported (only 'text')")
        texts.append(_text(f"{pp}.text", part.get("text")))
    return "\n".join(texts)


def _prompt(value: Any, vocab_size: int) -> str | tuple[int, ...]:
    if isinstance(value, str):
        return _text("prompt", value)
    if not isinstance(value, list) or not value:
        got = "an empty array" if value == [] else _kind(value)
        raise _bad("prompt", f"prompt must be a string or an array of token ids, got {got}")
    if all(isinstance(x, int | float) and not isinstance(x, bool) for x in value):
        return _token_ids("prompt", value, vocab_size, allow_empty=False)
    if len(value) > 1:
        raise _bad("prompt", "a batch of prompts is not supported; send one prompt per request")
    (only,) = value
    if isinstance(only, str):
        return _text("prompt[0]", only)
    if isinstance(only, list):
        return _token_ids("prompt[0]", only, vocab_size, allow_empty=False)
    raise _bad(
        "prompt[0]", f"prompt[0] must be a string or an array of token ids, got {_kind(only)}"
    )


# --- prompts -----------------------------------------------------------------------------


def chat_prompt(req: ChatRequest, template: ChatTemplate, tokenizer: Tokenizer) -> list[int]:
    """Render the messages with the model's chat template and tokenize the result.

    As transformers' apply_chat_template, the template writes any BOS itself and the
    control tokens it writes are tokens; unlike it, message text is only ever text
    (`luced.text.prompt`), so `<|im_end|>` in a message cannot close a turn."""
    try:
        return chat_ids(template, tokenizer, req.messages, add_generation_prompt=True)
    except ChatTemplateError as exc:
        raise _bad("messages", str(exc)) from None


def completion_prompt(req: CompletionRequest, tokenizer: Tokenizer) -> list[int]:
    """Token ids of the prompt: ids as given, or the text with the file's BOS rule.

    No chat template runs: the caller owns the whole prompt. A string is tokenized as
    it always was, special-token parsing off (`<|im_start|>` in it is text); a caller who
    wants control tokens sends the prompt as token ids."""
    ids = tokenizer.encode(req.prompt) if isinstance(req.prompt, str) else list(req.prompt)
    if not ids:
        raise _bad("prompt", "prompt must not be empty")
    return ids


def generation_request(request_id: str, options: Options, prompt: list[int]) -> GenerationRequest:
    return GenerationRequest(
        request_id=request_id,
        prompt=prompt,
        params=options.params,
        max_tokens=options.max_tokens,
        stop=options.stop,
        stop_token_ids=options.stop_token_ids,
        ignore_eos=options.ignore_eos,
    )
