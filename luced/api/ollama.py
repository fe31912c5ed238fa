"""Ollama's API, the request side: `/api/chat` and `/api/generate` bodies -> validated
requests -> prompts' token ids. Pure functions, no I/O; the routes are in
`luced.api.ollama_routes`, the replies are shaped by `luced.api.ollama_format`.

    prepare_chat(engine, body) / prepare_generate(engine, body) -> Prepared
        parse (a 400 naming the field, 404 for another model) -> render the chat template
        and tokenize -> the token budget of num_predict and num_ctx

Field policy:

* Honoured: model, messages (system, user, assistant, tool; an assistant's tool_calls, a
  tool's tool_name; a last assistant message is continued, as Ollama does), prompt,
  system, raw (the prompt as is, control tokens parsed), context (token ids prepended),
  stream (default true), format ("json" or a JSON schema: luced's structured output),
  tools (Ollama spells them as OpenAI does), logprobs, top_logprobs, and these `options`:
  num_predict, num_ctx, temperature, top_k, top_p, min_p, seed, stop, repeat_penalty,
  repeat_last_n, presence_penalty, frequency_penalty.
* Sampling defaults are Ollama's (temperature 0.8, top_k 40, top_p 0.9), not luced's, so
  that a client gets what it would get from Ollama.
* num_predict: <= 0 (-1, -2) is no limit; above the room left in the context it is cut to
  that room (Ollama would shift the context). num_ctx: the request's context; smaller than
  the daemon's it bounds prompt + reply, larger it changes nothing (luced's context is
  fixed at start). A prompt that does not fit is a 400 (Ollama would truncate it).
* keep_alive (seconds, or a duration such as "5m", "1h30m", "-1") is read and ignored,
  but for its 0. An empty prompt (generate) or no messages (chat) is Ollama's "load"
  idiom, answered done_reason "load" once the model is loaded; with keep_alive 0 its
  "unload" idiom, answered done_reason "unload": a daemon serving several models unloads
  it once no request holds it (one started with MODEL keeps its model loaded).
* think (true, false, "low", "medium", "high", "max"): the reply comes without a thinking
  phase (templates that know `enable_thinking` render it off) and without `thinking`.
* Refused (400) when set: images, suffix, template (luced renders the GGUF's own Jinja
  chat template), raw with system / template / context, and the sampler options luced does
  not have at anything but their neutral value (typical_p 1, tfs_z 1, mirostat 0).
* Ignored: the load-time options (num_batch, num_gpu, main_gpu, num_thread, use_mmap,
  use_mlock, numa, low_vram, ...: set when the daemon starts), num_keep, penalize_newline,
  shift, truncate, and unknown fields and options (Ollama ignores those too).
* `model` may be omitted (the served model, when there is one); it matches a served name
  with or without a ":latest" tag, any case; another name is a 404.
"""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from luced.api.content import objects, read_role
from luced.api.fields import (
    INT32_MAX,
    INT_RANGES,
    MAX_CHARS_PER_TOKEN,
    NUMBER_RANGES,
    OPENAI,
    APIError,
    bad,
    json_kind,
    read_bool,
    read_int,
    read_number,
    read_text,
)
from luced.api.openai import NO_TOOLS, Options, read_stop, token_ids
from luced.api.tools import parse_tools
from luced.sampling_params import SamplingParams
from luced.text.chat_template import ChatTemplateError
from luced.text.grammar import GrammarError, json_schema_grammar
from luced.text.prompt import chat_ids
from luced.text.tool_calls import Tool, ToolChoice, ToolFormat, has_tool_turns, tool_format

if TYPE_CHECKING:
    from luced.engine.core import Engine

ROLES = ("system", "user", "assistant", "tool")
THINK_LEVELS = ("low", "medium", "high", "max")
# Ollama's api.DefaultOptions where they differ from SamplingParams' "off" values.
DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.9}
# Ollama's option -> SamplingParams' field, for the numbers read the same way.
SAMPLING = {
    "temperature": "temperature",
    "top_p": "top_p",
    "min_p": "min_p",
    "repeat_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
}
# Sampler options luced does not have: refused unless at the value that turns them off.
NEUTRAL = {"typical_p": 1.0, "tfs_z": 1.0, "mirostat": 0}
TAG = ":latest"


# --- requests ----------------------------------------------------------------------------


@dataclass(frozen=True)
class OllamaRequest:
    kind: str  # "chat" or "generate"
    model: str  # as the client named it: replies echo it
    options: Options  # max_tokens holds num_predict (None: no limit)
    num_ctx: int | None = None
    keep_alive: float | None = None  # seconds (inf: forever); None when not given
    messages: tuple[dict[str, Any], ...] = ()  # through the chat template
    prefill: str = ""  # a last assistant message's text, which the reply continues
    raw: str | None = None  # generate's raw prompt, tokenized as it is
    context: tuple[int, ...] = ()  # generate's `context`: ids before the prompt
    tools: tuple[Tool, ...] = ()
    tool_choice: ToolChoice = NO_TOOLS
    think: bool | str | None = None

    @property
    def calls_tools(self) -> bool:
        return self.tool_choice.mode != "none"

    @property
    def idle(self) -> bool:
        """Nothing to generate: Ollama's "load" (or, with keep_alive 0, "unload") idiom."""
        return not self.messages and self.raw is None

    @property
    def done_reason(self) -> str:
        """An idle request's answer."""
        return "unload" if self.keep_alive == 0 else "load"


@dataclass(frozen=True)
class Prepared:
    request: OllamaRequest
    prompt: list[int]  # empty for an idle request
    options: Options  # max_tokens from the budget; the tools' grammar when calling tools
    tools: ToolFormat | None = None  # how calls are read back, when the request calls tools


def parse_chat(body: Mapping[str, Any], *, model_name: str, vocab_size: int) -> OllamaRequest:
    """A validated /api/chat body, or APIError (400, or 404 for another model)."""
    model = check_model(body, model_name)
    _refuse_images("images", body.get("images"))
    messages = _messages(body.get("messages"))
    prefill = ""
    last = messages[-1] if len(messages) > 1 else {}
    if last.get("role") == "assistant" and not last.get("tool_calls"):
        prefill = messages.pop()["content"] or ""
    tools, tool_choice = parse_tools(body)
    options = _options(body, model_name)
    if tool_choice.mode != "none" and options.grammar is not None:
        raise bad(
            "format", "format cannot be combined with tools (calls have a grammar of their own)"
        )
    if prefill and tool_choice.mode != "none":
        raise bad("messages", "a last assistant message cannot be continued with tools")
    return OllamaRequest(
        kind="chat",
        model=model,
        options=options,
        num_ctx=_num_ctx(body),
        keep_alive=keep_alive_seconds(body.get("keep_alive")),
        messages=tuple(messages),
        prefill=prefill,
        tools=tools,
        tool_choice=tool_choice,
        think=_think(body.get("think")),
    )


def parse_generate(body: Mapping[str, Any], *, model_name: str, vocab_size: int) -> OllamaRequest:
    """A validated /api/generate body, or APIError (400, or 404 for another model)."""
    model = check_model(body, model_name)
    _refuse_images("images", body.get("images"))
    for name, why in (
        ("suffix", "luced does not fill in the middle"),
        ("template", "luced renders the model's own chat template (Jinja, from the GGUF)"),
    ):
        if body.get(name):
            raise bad(name, f"{name} is not supported: {why}")
    prompt = read_text("prompt", body.get("prompt") or "")
    system = read_text("system", body.get("system") or "")
    context = token_ids("context", body.get("context"), vocab_size, allow_empty=True)
    raw = read_bool(body, "raw")
    if raw and (system or context):
        raise bad("raw", "raw mode does not support system or context")
    messages: list[dict[str, Any]] = []
    if prompt and not raw:
        messages = [{"role": "system", "content": system}] if system else []
        messages.append({"role": "user", "content": prompt})
    return OllamaRequest(
        kind="generate",
        model=model,
        options=_options(body, model_name),
        num_ctx=_num_ctx(body),
        keep_alive=keep_alive_seconds(body.get("keep_alive")),
        messages=tuple(messages),
        raw=prompt if raw and prompt else None,
        context=context,
        think=_think(body.get("think")),
    )


def served_name(model_name: str) -> str:
    """The served model as Ollama lists it: name:tag (":latest" unless it has a tag)."""
    return model_name if ":" in model_name.rpartition("/")[2] else model_name + TAG


def check_model(body: Mapping[str, Any], model_name: str, field: str = "model") -> str:
    """The model name to echo in replies; a 404 in Ollama's words for another model."""
    model = body.get(field)
    if model is None or model == "":
        return served_name(model_name)
    model = read_text(field, model)
    match_model(model, [model_name])
    return model


def match_model(model: str, served: Sequence[str]) -> str:
    """The served model that `model` names as Ollama matches names (any case, with or
    without ":latest"); a 404 in Ollama's words naming the served ones otherwise."""
    wanted = model.casefold().removesuffix(TAG)
    for name in served:
        if name.casefold().removesuffix(TAG) == wanted:
            return name
    names = ", ".join(f"'{served_name(n)}'" for n in served)
    raise APIError(404, f"model '{model}' not found; luced serves {names}")


@dataclass(frozen=True)
class Named:
    """What a route reads of a body before it has a model (a daemon serving several)."""

    model: str | None  # as the client named it; None: not named
    unload: bool = False  # Ollama's "unload" idiom: nothing to generate, keep_alive 0


def named_request(body: Mapping[str, Any]) -> Named:
    """An /api/chat or /api/generate body's model, and whether it only asks to unload."""
    model = body.get("model")
    idle = not body.get("messages") and not body.get("prompt")
    unload = idle and keep_alive_seconds(body.get("keep_alive")) == 0
    return Named(read_text("model", model) if model else None, unload)


def named_model(body: Mapping[str, Any]) -> Named:
    """An /api/embed or /api/embeddings body's model."""
    model = body.get("model")
    return Named(read_text("model", model) if model else None)


def named_show(body: Mapping[str, Any]) -> Named:
    """/api/show names its model as `model` (or the older `name`)."""
    field = "model" if body.get("model") else "name"
    model = body.get(field)
    return Named(read_text(field, model) if model else None)


def keep_alive_seconds(value: Any) -> float | None:
    """Ollama's keep_alive: seconds as a number, or a Go duration ("5m", "1h30m", "-1s";
    a bare number of seconds too); negative = forever (inf)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise bad("keep_alive", f"keep_alive must be a number or a string, got {json_kind(value)}")
    seconds = _duration(value) if isinstance(value, str) else float(value)
    if seconds is None or math.isnan(seconds):
        raise bad(
            "keep_alive",
            f"keep_alive: invalid duration {value!r} (seconds, or a duration such as "
            '"5m", "1h30m", "-1")',
        )
    return math.inf if seconds < 0 else seconds


_UNITS = {
    "ns": 1e-9,
    "us": 1e-6,
    "µs": 1e-6,
    "μs": 1e-6,
    "ms": 1e-3,
    "s": 1.0,
    "m": 60.0,
    "h": 3600.0,
}
_PART = re.compile(r"(\d+\.?\d*|\.\d+)(ns|us|µs|μs|ms|s|m|h)")


def _duration(text: str) -> float | None:
    text = text.strip()
    sign = -1.0 if text.startswith("-") else 1.0
    body = text.lstrip("+-")
    with contextlib.suppress(ValueError):
        return sign * float(body)  # a bare number: seconds (as OLLAMA_KEEP_ALIVE reads it)
    parts = _PART.findall(body)
    if not body or "".join(n + u for n, u in parts) != body:
        return None
    return sign * sum(float(n) * _UNITS[u] for n, u in parts)


def _think(value: Any) -> bool | str | None:
    if value is None or isinstance(value, bool) or value in THINK_LEVELS:
        return value
    raise bad(
        "think",
        f'think must be true, false, "low", "medium", "high" or "max", got {value!r}',
    )


def _refuse_images(param: str, value: Any) -> None:
    if value:  # null or [] mean none
        raise bad(param, f"{param}: luced serves text models; images are not supported")


def _messages(value: Any) -> list[dict[str, Any]]:
    if value is None:
        return []
    out = []
    for p, m in objects("messages", value, "an array of messages", non_empty=False):
        role = read_role(p, m, ROLES)
        _refuse_images(f"{p}.images", m.get("images"))
        content = m.get("content")
        msg: dict[str, Any] = {"role": role, "content": read_text(f"{p}.content", content or "")}
        if role == "tool" and m.get("tool_name") is not None:
            msg["name"] = read_text(f"{p}.tool_name", m["tool_name"])
        if role == "assistant" and m.get("tool_calls"):
            msg["tool_calls"] = _history_calls(f"{p}.tool_calls", m["tool_calls"])
            msg["content"] = msg["content"] or None
        out.append(msg)
    return out


def _history_calls(param: str, value: Any) -> list[dict[str, Any]]:
    """An assistant turn's Ollama tool calls ({"function": {"name", "arguments": {...}}})
    as the tool formats read them (OpenAI's spelling; arguments may stay an object)."""
    if not isinstance(value, list):
        raise bad(param, f"{param} must be an array of tool calls, got {json_kind(value)}")
    calls = []
    for j, call in enumerate(value):
        fn = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(fn, Mapping):
            raise bad(f"{param}[{j}].function", f"{param}[{j}].function must be an object")
        name = read_text(f"{param}[{j}].function.name", fn.get("name"))
        arguments = fn.get("arguments") or {}
        if not isinstance(arguments, Mapping | str):
            raise bad(
                f"{param}[{j}].function.arguments",
                f"{param}[{j}].function.arguments must be an object, got {json_kind(arguments)}",
            )
        calls.append({"type": "function", "function": {"name": name, "arguments": arguments}})
    return calls


# --- options -----------------------------------------------------------------------------


def _options_of(body: Mapping[str, Any]) -> Mapping[str, Any]:
    opts = body.get("options")
    return {} if opts is None else OPENAI.object("options", opts)


def _options(body: Mapping[str, Any], model_name: str) -> Options:
    opts = _options_of(body)
    logprobs = None
    if read_bool(body, "logprobs"):
        logprobs = read_int(body, "top_logprobs", *INT_RANGES["top_logprobs"]) or 0
    with _in_options():
        params = _sampling(opts, logprobs)
        num_predict = read_int(opts, "num_predict", -INT32_MAX, INT32_MAX)
        stop = read_stop(opts.get("stop"), "stop")
    return Options(
        model=model_name,
        stream=read_bool(body, "stream", default=True),
        include_usage=False,
        params=params,
        max_tokens=num_predict if num_predict is not None and num_predict > 0 else None,
        stop=stop,
        grammar=format_grammar(body.get("format")),
    )


def _sampling(opts: Mapping[str, Any], logprobs: int | None) -> SamplingParams:
    for name, neutral in NEUTRAL.items():
        x = read_number(opts, name)
        if x is not None and x != neutral:
            raise bad(name, f"{name} is not supported (only {neutral:g}, which turns it off)")
    fields: dict[str, Any] = {"logprobs": logprobs, **DEFAULTS}
    for name, field in SAMPLING.items():
        if (x := read_number(opts, name, *NUMBER_RANGES[field])) is not None:
            fields[field] = x
    if (top_k := read_int(opts, "top_k", -INT32_MAX, INT32_MAX)) is not None:
        fields["top_k"] = max(top_k, 0)  # llama.cpp: <= 0 = the whole vocabulary
    if (window := read_int(opts, "repeat_last_n", -1, INT32_MAX)) is not None:
        fields["penalty_window"] = window  # -1: every token (Ollama: the context)
    seed = read_int(opts, "seed", *INT_RANGES["seed"])
    fields["seed"] = None if seed == -1 else seed  # Ollama's -1: a fresh seed
    try:
        return SamplingParams(**fields)
    except (ValueError, TypeError, OverflowError) as exc:
        # SamplingParams names its field ("top_p must be in (0, 1]"): name Ollama's.
        field = str(exc).split(" ", 1)[0]
        name = next((k for k, v in SAMPLING.items() if v == field), field)
        raise bad(name, str(exc).replace(field, name, 1)) from None


@contextlib.contextmanager
def _in_options() -> Iterator[None]:
    """Errors of fields read inside `options` name them as options.X."""
    try:
        yield
    except APIError as exc:
        raise bad(f"options.{exc.param}", f"options.{exc.message}") from None


def _num_ctx(body: Mapping[str, Any]) -> int | None:
    with _in_options():
        n = read_int(_options_of(body), "num_ctx", 0, INT32_MAX)
    return n or None  # 0: Ollama's "not set"


def format_grammar(value: Any) -> str | None:
    """Ollama's `format`: "json" (any JSON object) or a JSON schema; "" or null: none."""
    if value is None or value == "":
        return None
    if value == "json":
        return json_schema_grammar(None)
    if not isinstance(value, Mapping):
        raise bad("format", f'format must be "json" or a JSON schema object, got {value!r}')
    try:
        return json_schema_grammar(value)
    except GrammarError as exc:
        raise bad("format", f"format: {exc}") from None


def token_budget(
    n_prompt: int,
    num_predict: int | None,
    num_ctx: int | None,
    context_length: int,
    default_max_tokens: int | None,
) -> int | None:
    """The reply's max_tokens under num_predict and num_ctx (None: the engine's default);
    a 400 when the prompt leaves no room. See the module docstring."""
    limit = context_length if num_ctx is None else min(num_ctx, context_length)
    if n_prompt >= limit:
        held = f"options.num_ctx {num_ctx}" if limit < context_length else "the context"
        note = ""
        if num_ctx is not None and num_ctx > context_length:
            note = (
                f"; options.num_ctx {num_ctx} is more than the {context_length} tokens this "
                "daemon was started with (--context-length)"
            )
        raise APIError(
            400,
            f"the prompt has {n_prompt} tokens; {held} holds {limit} (the prompt plus at "
            f"least one generated token){note}",
            param="options.num_ctx" if num_ctx is not None else None,
        )
    room = limit - n_prompt
    if num_predict is not None:
        return min(num_predict, room)
    if limit == context_length:
        return None
    return min(room, default_max_tokens or room)


# --- prompts -----------------------------------------------------------------------------


def prepare_chat(engine: Engine, body: Mapping[str, Any]) -> Prepared:
    """An /api/chat body's request and prompt (run off the event loop: it tokenizes)."""
    req = parse_chat(body, model_name=engine.model.name, vocab_size=engine.tokenizer.vocab_size)
    return _prepare(engine, req)


def prepare_generate(engine: Engine, body: Mapping[str, Any]) -> Prepared:
    """An /api/generate body's request and prompt (run off the event loop: it tokenizes)."""
    req = parse_generate(body, model_name=engine.model.name, vocab_size=engine.tokenizer.vocab_size)
    return _prepare(engine, req)


def _prepare(engine: Engine, req: OllamaRequest) -> Prepared:
    if req.idle:
        return Prepared(req, [], req.options)
    engine.intake.check_generates()
    _check_chars(req, engine.model.context_length)
    tools = None
    if req.calls_tools or has_tool_turns(req.messages):
        tools = tool_format(engine.chat_template)
    prompt = list(req.context) + _prompt_ids(engine, req, tools)
    options = replace(
        req.options,
        max_tokens=token_budget(
            len(prompt),
            req.options.max_tokens,
            req.num_ctx,
            engine.model.context_length,
            engine.limits.default_max_tokens,
        ),
    )
    if tools is None or not req.calls_tools:
        return Prepared(req, prompt, options)
    options = replace(options, grammar=tools.grammar(req.tools, req.tool_choice))
    return Prepared(req, prompt, options, tools)


def _check_chars(req: OllamaRequest, context_length: int) -> None:
    """A 400 for text that cannot fit the context, before any tokenizing."""
    chars = len(req.raw or "") + len(req.prefill)
    chars += sum(len(v) for m in req.messages for v in m.values() if isinstance(v, str))
    limit = context_length * MAX_CHARS_PER_TOKEN
    if chars > limit:
        param = "messages" if req.kind == "chat" else "prompt"
        raise bad(
            param,
            f"{param}: {chars} characters cannot fit the context of {context_length} tokens "
            f"(at most {limit} characters)",
        )


def _prompt_ids(engine: Engine, req: OllamaRequest, tools: ToolFormat | None) -> list[int]:
    tokenizer = engine.tokenizer
    if req.raw is not None:  # the caller wrote the whole prompt, control tokens included
        return tokenizer.encode(req.raw, allow_special=True)
    messages, variables = list(req.messages), {}
    if tools is not None:
        messages, variables = tools.prepare(req.messages, req.tools)
    if req.think is not None:
        variables["enable_thinking"] = False  # see the module docstring: no thinking phase
    try:
        ids = chat_ids(
            engine.chat_template, tokenizer, messages, add_generation_prompt=True, **variables
        )
    except ChatTemplateError as exc:
        raise bad("messages" if req.kind == "chat" else "prompt", str(exc)) from None
    if req.context and tokenizer.add_bos and ids[:1] == [tokenizer.bos_id]:
        # The context began the sequence with its BOS. (Only where the file asks for a
        # BOS: SmolLM2's "BOS" is <|im_start|>, which opens every turn.)
        ids = ids[1:]
    if req.prefill:
        ids += tokenizer.encode(req.prefill, add_bos=False)
    return ids
