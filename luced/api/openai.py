"""OpenAI request bodies -> validated requests -> engine requests: pure functions, no I/O.

The HTTP edge (`luced.api.server`) reads bytes, calls `luced.api.fields.decode_body`,
`parse_chat` / `parse_completion`, renders and tokenizes the prompt (`chat_prompt` /
`completion_prompts`) and hands the engine `generation_requests(...)`, one request per
choice; `luced.api.choices` relays them and `luced.api.formats` shapes what comes back.
Raw JSON never travels past this module; every failure is an `APIError` whose `param`
names the offending field (`messages[2].content[0].type`).

Field policy (OpenAI's Chat Completions and legacy Completions APIs):

* Honoured: model, messages / prompt (completions: a string, token ids, or a list of
  either: one prompt after another), n (choices per prompt, at most MAX_CHOICES; choice
  j of prompt i has index i * n + j), stream, stream_options.include_usage, stop,
  max_tokens, max_completion_tokens (wins over max_tokens), temperature, top_p, seed,
  frequency_penalty, presence_penalty, logprobs, top_logprobs (chat), logprobs (int,
  completions), logit_bias (token id strings -> -100..100, at most 300; the logprobs then
  describe the biased distribution, as every luced logprob describes the distribution the
  token was drawn from); and vLLM's extensions top_k (-1 or 0 = off), min_p,
  repetition_penalty, stop_token_ids, ignore_eos; response_format (text, json_object,
  json_schema; on completions too, as vLLM: `luced.api.response_format`).
* Unknown fields are accepted and ignored, like vLLM and unlike OpenAI (which 400s):
  clients built for one server often send another's extras, and a field we do not know
  cannot change what we do. Known fields we cannot honour are rejected with a 400 when
  set to anything but their neutral value, because ignoring them would silently return
  something else than asked for: best_of > 1, echo: true, a non-empty suffix, the
  deprecated functions (unless function_call is "none"),
  audio, modalities other than ["text"]. `tools` and `tool_choice` are honoured
  (`luced.api.tools`, `luced.text.tool_calls`); not with a response_format grammar.
* Known and ignored (they do not change the output): user, metadata, store,
  service_tier, parallel_tool_calls, reasoning_effort, prediction, and stream_options
  when not streaming.
* `model` may be omitted (the served model); any other name is a 404 model_not_found.
* `stop`: a string or up to 16 strings (OpenAI allows 4; stop strings cost us a little per
  token, so a bound stays), each at most 256 characters; empty strings are dropped.
* `seed` with n > 1: choice j of each prompt samples with seed + j (wrapped into the
  seed's range), so the choices differ and each one is reproducible alone: choice 0 is
  what the same request with n = 1 gives. Greedy choices are all the same.
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

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from luced.api.content import objects, read_role, text_parts
from luced.api.fields import (
    INT_RANGES,
    NUMBER_RANGES,
    OPENAI,
    APIError,
    as_int,
    bad,
    json_kind,
    read_bool,
    read_int,
    read_number,
    read_text,
)
from luced.api.response_format import response_format_grammar
from luced.api.tools import parse_tools
from luced.engine.core import GenerationRequest
from luced.sampling_params import LOGIT_BIAS_RANGE, MAX_LOGIT_BIAS, SamplingParams
from luced.text.chat_template import ChatTemplateError
from luced.text.prompt import chat_ids
from luced.text.tool_calls import Tool, ToolChoice, ToolFormat

if TYPE_CHECKING:
    from luced.text.chat_template import ChatTemplate
    from luced.text.tokenizer import Tokenizer

MAX_STOP = 16
MAX_CHOICES = INT_RANGES["n"][1]  # OpenAI's bound on n
MAX_STOP_CHARS = 256
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
ROLES = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
}

NO_TOOLS = ToolChoice("none")  # the choice of every request without tools

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
    grammar: str | None = None  # from response_format
    n: int = 1  # choices per prompt

    @property
    def top_logprobs(self) -> int | None:
        """None: no logprobs; k: the chosen token's logprob plus k alternatives."""
        return self.params.logprobs


@dataclass(frozen=True)
class ChatRequest:
    options: Options
    messages: tuple[dict[str, Any], ...]  # as the chat template reads them
    tools: tuple[Tool, ...] = ()
    tool_choice: ToolChoice = NO_TOOLS

    @property
    def calls_tools(self) -> bool:
        return self.tool_choice.mode != "none"


Prompt = str | tuple[int, ...]  # text to tokenize, or token ids as given


@dataclass(frozen=True)
class CompletionRequest:
    options: Options
    prompts: tuple[Prompt, ...]  # one, or a list's in order


def parse_chat(body: Mapping[str, Any], *, model_name: str, vocab_size: int) -> ChatRequest:
    """A validated chat request, or APIError (400, or 404 for an unknown model)."""
    _reject_unsupported(body, chat=True)
    if read_bool(body, "logprobs"):
        top = read_int(body, "top_logprobs", *INT_RANGES["top_logprobs"])
        logprobs: int | None = 0 if top is None else top
    else:
        if body.get("top_logprobs") is not None:
            raise bad("top_logprobs", "top_logprobs requires logprobs: true")
        logprobs = None
    max_tokens = read_int(body, "max_completion_tokens", *INT_RANGES["max_completion_tokens"])
    if max_tokens is None:
        max_tokens = read_int(body, "max_tokens", *INT_RANGES["max_tokens"])
    options = _options(body, model_name, vocab_size, logprobs, max_tokens)
    tools, tool_choice = parse_tools(body)
    if tool_choice.mode != "none" and options.grammar is not None:
        raise bad(
            "response_format",
            "response_format cannot be combined with tools (their calls have a grammar "
            'of their own); send tool_choice: "none" or no response_format',
        )
    return ChatRequest(options, _messages(body.get("messages")), tools, tool_choice)


def parse_completion(
    body: Mapping[str, Any], *, model_name: str, vocab_size: int
) -> CompletionRequest:
    """A validated completions request, or APIError (400, or 404 for an unknown model)."""
    _reject_unsupported(body, chat=False)
    logprobs = read_int(body, "logprobs", *INT_RANGES["logprobs"])
    max_tokens = read_int(body, "max_tokens", *INT_RANGES["max_tokens"])
    if max_tokens is None:
        max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS
    options = _options(body, model_name, vocab_size, logprobs, max_tokens)
    return CompletionRequest(options, _prompts(body.get("prompt"), vocab_size))


def check_model(body: Mapping[str, Any], model_name: str) -> None:
    """`model` may be omitted; any name but the served model's is a 404."""
    model = body.get("model")
    if model is not None and read_text("model", model) != model_name:
        raise APIError(
            404,
            f"The model {model!r} does not exist; this server serves {model_name!r}",
            param="model",
            code="model_not_found",
        )


def _options(
    body: Mapping[str, Any],
    model_name: str,
    vocab_size: int,
    logprobs: int | None,
    max_tokens: int | None,
) -> Options:
    check_model(body, model_name)
    stream = read_bool(body, "stream")
    stream_options = body.get("stream_options")
    include_usage = False
    if stream and stream_options is not None:
        if not isinstance(stream_options, dict):
            raise bad(
                "stream_options",
                f"stream_options must be an object, got {json_kind(stream_options)}",
            )
        include_usage = read_bool(stream_options, "include_usage")
    return Options(
        model=model_name,
        stream=stream,
        include_usage=include_usage,
        params=sampling_params(body, logprobs, _logit_bias(body.get("logit_bias"), vocab_size)),
        max_tokens=max_tokens,
        stop=read_stop(body.get("stop")),
        stop_token_ids=token_ids(
            "stop_token_ids", body.get("stop_token_ids"), vocab_size, allow_empty=True
        ),
        ignore_eos=read_bool(body, "ignore_eos"),
        grammar=response_format_grammar(body.get("response_format")),
        n=read_int(body, "n", *INT_RANGES["n"]) or 1,
    )


def sampling_params(
    body: Mapping[str, Any],
    logprobs: int | None,
    logit_bias: tuple[tuple[int, float], ...] = (),
) -> SamplingParams:
    fields: dict[str, Any] = {"logprobs": logprobs, "logit_bias": logit_bias}
    for name, (lo, hi) in NUMBER_RANGES.items():
        if (x := read_number(body, name, lo, hi)) is not None:
            fields[name] = x
    top_k = read_int(body, "top_k", *INT_RANGES["top_k"])
    if top_k is not None:
        fields["top_k"] = 0 if top_k == -1 else top_k  # vLLM spells "off" -1
    fields["seed"] = read_int(body, "seed", *INT_RANGES["seed"])
    try:
        return SamplingParams(**fields)
    except (ValueError, TypeError, OverflowError) as exc:
        # SamplingParams' messages start with the field's name, e.g. "top_p must be ...".
        name = str(exc).split(" ", 1)[0]
        raise APIError(400, str(exc), param=name if name in body else None) from None


def _logit_bias(value: Any, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias} map, checked against the vocabulary."""
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise bad(
            "logit_bias",
            f"logit_bias must be an object mapping token ids to biases, got {json_kind(value)}",
        )
    if len(value) > MAX_LOGIT_BIAS:
        raise bad(
            "logit_bias", f"logit_bias takes at most {MAX_LOGIT_BIAS} tokens, got {len(value)}"
        )
    pairs = []
    for key, bias in value.items():
        if not (key.isascii() and key.isdigit()):
            raise bad(
                "logit_bias", f"logit_bias: {key!r} is not a token id (a non-negative integer)"
            )
        token = int(key)
        if token >= vocab_size:
            raise bad("logit_bias", f"logit_bias: token id {token} is not in [0, {vocab_size})")
        lo, hi = LOGIT_BIAS_RANGE
        number = isinstance(bias, int | float) and not isinstance(bias, bool)
        if not number or not lo <= bias <= hi:  # NaN compares false
            got = bias if number else json_kind(bias)
            raise bad(
                "logit_bias", f"logit_bias[{key}] must be a number in [{lo:g}, {hi:g}], got {got}"
            )
        pairs.append((token, float(bias)))
    return tuple(pairs)


def read_stop(value: Any, name: str = "stop") -> tuple[str, ...]:
    """Stop strings: a string or an array of them (field `name`); empty ones dropped."""
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list):
        raise bad(name, f"{name} must be a string or an array of strings, got {json_kind(value)}")
    if len(items) > MAX_STOP:
        raise bad(name, f"{name} takes at most {MAX_STOP} strings, got {len(items)}")
    out = []
    for i, item in enumerate(items):
        param = name if isinstance(value, str) else f"{name}[{i}]"
        text = read_text(param, item)
        if len(text) > MAX_STOP_CHARS:
            raise bad(param, f"{param} is longer than {MAX_STOP_CHARS} characters")
        if text and text not in out:
            out.append(text)
    return tuple(out)


def token_ids(param: str, value: Any, vocab_size: int, allow_empty: bool) -> tuple[int, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise bad(param, f"{param} must be an array of token ids, got {json_kind(value)}")
    if not value and not allow_empty:
        raise bad(param, f"{param} must not be empty")
    ids = []
    for i, item in enumerate(value):
        t = as_int(f"{param}[{i}]", item)
        if not 0 <= t < vocab_size:
            raise bad(f"{param}[{i}]", f"{param}[{i}]: token id {t} is not in [0, {vocab_size})")
        ids.append(t)
    return tuple(ids)


def _reject_unsupported(body: Mapping[str, Any], chat: bool) -> None:
    if chat:
        if body.get("functions") and body.get("function_call") != "none":
            raise bad("functions", "functions (deprecated) is not supported; send tools")
        if body.get("audio") is not None:
            raise bad("audio", "audio output is not supported")
        modalities = body.get("modalities")
        if modalities is not None and modalities != ["text"]:
            raise bad("modalities", 'only modalities ["text"] is supported')
    else:
        if read_bool(body, "echo"):
            raise bad("echo", "echo is not supported")
        best_of = read_int(body, "best_of", *INT_RANGES["best_of"])
        if best_of is not None and best_of > 1:
            raise bad("best_of", "best_of > 1 is not supported")
        if suffix := body.get("suffix"):
            raise bad("suffix", f"suffix is not supported (got {json_kind(suffix)})")


def _messages(value: Any) -> tuple[dict[str, Any], ...]:
    out = []
    for p, m in objects("messages", value, "a non-empty array of messages"):
        role = read_role(p, m, ROLES)
        msg: dict[str, Any] = {"role": ROLES[role]}
        content = m.get("content")
        if content is None and role == "assistant":
            msg["content"] = None  # the template sees the key absent
        else:
            msg["content"] = _content(f"{p}.content", content)
        for key in ("name", "tool_call_id"):
            if m.get(key) is not None:
                msg[key] = read_text(f"{p}.{key}", m[key])
        if role == "assistant" and m.get("tool_calls") is not None:
            calls = m["tool_calls"]
            if not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls):
                raise bad(f"{p}.tool_calls", f"{p}.tool_calls must be an array of objects")
            msg["tool_calls"] = calls  # passed to the template as given
        out.append(msg)
    return tuple(out)


def _content(param: str, value: Any) -> str:
    return text_parts(param, value, _text_part, "an array of content parts")


def _text_part(param: str, part: Any) -> str:
    kind = OPENAI.object(param, part).get("type")
    if kind != "text":
        raise bad(f"{param}.type", f"{param}.type {kind!r} is not supported (only 'text')")
    return read_text(f"{param}.text", part.get("text"))


def _prompts(value: Any, vocab_size: int) -> tuple[Prompt, ...]:
    """OpenAI's four shapes: a string, token ids, or a list of strings or of token-id lists."""
    if isinstance(value, str):
        return (read_text("prompt", value),)
    if not isinstance(value, list) or not value:
        got = "an empty array" if value == [] else json_kind(value)
        raise bad(
            "prompt",
            f"prompt must be a string, an array of token ids or an array of prompts, got {got}",
        )
    if isinstance(value[0], int | float) and not isinstance(value[0], bool):
        return (token_ids("prompt", value, vocab_size, allow_empty=False),)
    return texts_or_ids("prompt", value, vocab_size, read_text)


def texts_or_ids(
    name: str, items: list[Any], vocab_size: int, text: Callable[[str, Any], str]
) -> tuple[Prompt, ...]:
    """Each of `items` (`name[i]`): a string, read by `text`, or a non-empty array of
    token ids (the list shapes of completions' prompt and embeddings' input)."""
    out: list[Prompt] = []
    for i, item in enumerate(items):
        param = f"{name}[{i}]"
        if isinstance(item, str):
            out.append(text(param, item))
        elif isinstance(item, list):
            out.append(token_ids(param, item, vocab_size, allow_empty=False))
        else:
            raise bad(
                param, f"{param} must be a string or an array of token ids, got {json_kind(item)}"
            )
    return tuple(out)


# --- prompts -----------------------------------------------------------------------------


def chat_prompt(
    req: ChatRequest, template: ChatTemplate, tokenizer: Tokenizer, tools: ToolFormat | None = None
) -> list[int]:
    """Render the messages with the model's chat template and tokenize the result; with
    `tools` (the template's tool format, when the request calls tools), as it shows them.

    As transformers' apply_chat_template, the template writes any BOS itself and the
    control tokens it writes are tokens; unlike it, message text is only ever text
    (`luced.text.prompt`), so `<|im_end|>` in a message cannot close a turn."""
    messages, variables = list(req.messages), {}
    if tools is not None:
        messages, variables = tools.prepare(req.messages, req.tools)
    try:
        return chat_ids(template, tokenizer, messages, add_generation_prompt=True, **variables)
    except ChatTemplateError as exc:
        raise bad("messages", str(exc)) from None


def completion_prompts(req: CompletionRequest, tokenizer: Tokenizer) -> list[list[int]]:
    """Token ids of each prompt: ids as given, or the text with the file's BOS rule.

    No chat template runs: the caller owns the whole prompt. A string is tokenized as
    it always was, special-token parsing off (`<|im_start|>` in it is text); a caller who
    wants control tokens sends the prompt as token ids."""
    out = []
    for i, prompt in enumerate(req.prompts):
        ids = tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            param = "prompt" if len(req.prompts) == 1 else f"prompt[{i}]"
            raise bad(param, f"{param} must not be empty")
        out.append(ids)
    return out


def generation_request(
    request_id: str, options: Options, prompt: list[int], *, choice: int = 0
) -> GenerationRequest:
    """The engine request of one choice of `prompt`: choice j > 0 is a sibling of the one
    before it (it shares that prompt's KV) and, with a seed, samples with seed + j."""
    params = options.params
    if choice and params.seed is not None:
        lo, hi = INT_RANGES["seed"]
        params = replace(params, seed=(params.seed + choice - lo) % (hi - lo + 1) + lo)
    return GenerationRequest(
        request_id=request_id,
        prompt=prompt,
        params=params,
        max_tokens=options.max_tokens,
        stop=options.stop,
        stop_token_ids=options.stop_token_ids,
        ignore_eos=options.ignore_eos,
        grammar=options.grammar,
        share_prompt=choice > 0,
    )


def generation_requests(
    reply_id: str, options: Options, prompts: list[list[int]]
) -> list[GenerationRequest]:
    """One engine request per choice, in the reply's order: choice j of prompt i is the
    reply's choice i * n + j (OpenAI's index)."""
    n = options.n
    if n * len(prompts) == 1:
        return [generation_request(reply_id, options, prompts[0])]
    return [
        generation_request(f"{reply_id}-{i * n + j}", options, prompt, choice=j)
        for i, prompt in enumerate(prompts)
        for j in range(n)
    ]
