"""From a request body's bytes to a validated request and its prompt's token ids, off the
event loop and bounded before any costly step.

    bytes ─decode─► JSON ─bound─► parse (schemas compiled) ─render─► template ─► token ids

Each route's `prepare_*` runs the whole chain in a thread (`Preparer.run`): a 30 MB body
takes long to parse, a tool schema long to compile, a template long to render, and none of
it may hold up `/health`, the admin socket or the token streams on the event loop. The
tokenizer and llguidance let go of the GIL while they work; JSON decoding does not (tens
of milliseconds for a body of many small values at the 32 MiB limit), which is the most
one request can hold up the others.

The bound (`check_size`) comes right after decoding: the text a request brings (every
string in its prompt-bearing fields, tool descriptions and schemas, stop strings, Anthropic
system blocks, Responses `input` items; keys count, and each other JSON value counts one)
must fit MAX_CHARS_PER_TOKEN characters per context token, since no token is longer. Past
it the request is a 400 naming the field where the text ran over, whatever the field.

Bodies up to LARGE_BODY go to the default executor; larger ones to a pool of
PREPARE_THREADS threads, so that at most that many large bodies are expanded into Python
objects at once (a crowd of them waits, holding only its bytes) and small requests never
queue behind them.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, Generic, TypeVar

from luced.api import anthropic
from luced.api.fields import APIError, as_int, decode_body, json_kind, read_bool, read_text
from luced.api.openai import (
    ChatRequest,
    CompletionRequest,
    Options,
    chat_prompt,
    completion_prompt,
    parse_chat,
    parse_completion,
)
from luced.api.responses import parse_responses
from luced.engine.core import Engine
from luced.text.grammar import GrammarError, check_grammar
from luced.text.tool_calls import ToolFormat, has_tool_turns, tool_format

# No token is this long; text longer than this per context token cannot fit anyway.
MAX_CHARS_PER_TOKEN = 32
LARGE_BODY = 1 << 20
PREPARE_THREADS = 2

# The fields of each API that carry text into the prompt or the grammar.
CHAT_FIELDS = ("messages", "tools", "tool_choice", "response_format", "stop", "stop_token_ids")
COMPLETION_FIELDS = ("prompt", "response_format", "stop", "stop_token_ids")
MESSAGES_FIELDS = ("system", "messages", "tools", "tool_choice", "stop_sequences")
RESPONSES_FIELDS = ("instructions", "input", "tools", "tool_choice", "text")

R = TypeVar("R")
T = TypeVar("T")


@dataclass(frozen=True)
class Prepared(Generic[R]):
    request: R
    prompt: list[int]
    options: Options  # the request's, with its tools' grammar when it calls tools
    tools: ToolFormat | None = None  # how its tool calls are read back, when it calls tools


class Preparer:
    """Runs preparations in threads: see the module docstring."""

    def __init__(self, threads: int = PREPARE_THREADS) -> None:
        self._large = ThreadPoolExecutor(threads, thread_name_prefix="luced-prepare")

    async def run(self, raw: bytes, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args, raw)` in a thread."""
        pool = self._large if len(raw) > LARGE_BODY else None
        call = functools.partial(fn, *args, raw)
        return await asyncio.get_running_loop().run_in_executor(pool, call)

    def close(self) -> None:
        self._large.shutdown(wait=False, cancel_futures=True)


# --- the bound -----------------------------------------------------------------------------


def json_size(value: Any, cap: int) -> int:
    """Characters of every string in `value` (keys too) plus one per other JSON value;
    the count stops once past `cap`, so it costs at most that many steps."""
    n, stack = 0, [value]
    while stack and n <= cap:
        v = stack.pop()
        n += len(v) if isinstance(v, str) else 1
        if isinstance(v, dict):
            stack += v.keys()
            stack += v.values()
        elif isinstance(v, list):
            if len(v) > cap:  # each item counts at least one
                return n + len(v)
            stack += v
    return n


def check_size(body: Mapping[str, Any], fields: Iterable[str], context_length: int) -> None:
    """A 400 when the text of `fields` cannot fit `context_length` tokens (module docstring)."""
    limit = context_length * MAX_CHARS_PER_TOKEN
    total = 0
    for field in fields:
        if body.get(field) is None:
            continue
        total += json_size(body[field], limit - total)
        if total > limit:
            raise APIError(
                400,
                f"{field}: the request's text runs past {limit} characters here, more than "
                f"a context of {context_length} tokens holds (at most {MAX_CHARS_PER_TOKEN} "
                "characters per token)",
                param=field,
            )


def _body(engine: Engine, raw: bytes, fields: Iterable[str]) -> dict[str, Any]:
    body = decode_body(raw)
    check_size(body, fields, engine.context_length)
    return body


# --- the routes' preparations ---------------------------------------------------------------


def prepare_chat(engine: Engine, raw: bytes) -> Prepared[ChatRequest]:
    body = _body(engine, raw, CHAT_FIELDS)
    vocab = engine.tokenizer.vocab_size
    req = parse_chat(body, model_name=engine.model_name, vocab_size=vocab)
    return _chat(engine, req, chat_prompt)


def prepare_responses(engine: Engine, raw: bytes) -> Prepared[ChatRequest]:
    body = _body(engine, raw, RESPONSES_FIELDS)
    return _chat(engine, parse_responses(body, model_name=engine.model_name), chat_prompt)


def prepare_messages(
    engine: Engine, count_only: bool, raw: bytes
) -> Prepared[anthropic.MessagesRequest]:
    body = _body(engine, raw, MESSAGES_FIELDS)
    req = anthropic.parse_messages(body, model_name=engine.model_name, count_only=count_only)
    return _chat(engine, req, anthropic.message_prompt, grammar=not count_only)


def prepare_completion(engine: Engine, raw: bytes) -> Prepared[CompletionRequest]:
    body = _body(engine, raw, COMPLETION_FIELDS)
    vocab = engine.tokenizer.vocab_size
    req = parse_completion(body, model_name=engine.model_name, vocab_size=vocab)
    _check(req.options.grammar)
    return Prepared(req, completion_prompt(req, engine.tokenizer), req.options)


def prepare_tokenize(engine: Engine, raw: bytes) -> tuple[list[int], bool]:
    """(the ids of `content`, whether the reply lists each token's piece)."""
    body = _body(engine, raw, ("content",))
    content = read_text("content", body.get("content"))
    add_bos = read_bool(body, "add_special")
    special = read_bool(body, "parse_special", default=True)
    with_pieces = read_bool(body, "with_pieces")
    ids = engine.tokenizer.encode(content, add_bos=add_bos, allow_special=special, add_eos=False)
    return ids, with_pieces


def prepare_detokenize(engine: Engine, raw: bytes) -> str:
    """The text of `tokens` (control tokens as their text, so that it inverts tokenize)."""
    body = _body(engine, raw, ("tokens",))
    tokens = body.get("tokens")
    if not isinstance(tokens, list):
        raise APIError(
            400, f"tokens must be an array of token ids, got {json_kind(tokens)}", param="tokens"
        )
    vocab = engine.tokenizer.vocab_size
    ids = []
    for i, t in enumerate(tokens):
        n = as_int(f"tokens[{i}]", t)
        if not 0 <= n < vocab:
            raise APIError(
                400, f"tokens[{i}]: token id {n} is not in [0, {vocab})", param=f"tokens[{i}]"
            )
        ids.append(n)
    return engine.tokenizer.decode(ids, skip_special=False)


def _chat(
    engine: Engine,
    req: Any,
    render: Callable[..., list[int]],
    grammar: bool = True,
) -> Prepared[Any]:
    """A chat-shaped request's prompt, and its tools' grammar when it calls tools (a
    template without tools cannot render calls or results as they came, so a history
    holding them goes through the tool format too)."""
    tools = None
    if req.calls_tools or has_tool_turns(req.messages):
        tools = tool_format(engine.chat_template)
    prompt = render(req, engine.chat_template, engine.tokenizer, tools)
    if tools is None or not req.calls_tools or not grammar:
        _check(req.options.grammar)
        return Prepared(req, prompt, req.options)
    options = replace(req.options, grammar=tools.grammar(req.tools, req.tool_choice))
    _check(options.grammar)
    return Prepared(req, prompt, options, tools)


def _check(grammar: str | None) -> None:
    """Compile the grammar here, in the thread, so that the engine's own check on the
    event loop finds it compiled (`check_grammar` remembers); the engine reports a
    failure as a 400 of its own."""
    if grammar is not None:
        with contextlib.suppress(GrammarError):
            check_grammar(grammar)
