"""From a request body's bytes to a validated request and its prompt's token ids, off the
event loop and bounded before any costly step.

    chunks ─join─► bytes ─check_commas─► decode ─check_size─► parse (schemas compiled)
           ─► render ─► token ids

Each route's `prepare_*` runs the whole chain in a thread (`Preparer.run`): a 30 MB body
takes long to decode, a tool schema long to compile, a template long to render, and none
of it may hold up `/health`, the admin socket or the token streams on the event loop. A
thread still holds the GIL while Python or a C extension keeps it, so each costly step is
one that lets go: the tokenizer (`encode_batch_fast`) and llguidance do. The C JSON
decoder does not, so a body of many values (MANY_VALUES) is decoded by the json module's
pure-Python scanner, which lets the loop in between values, and freed a container at a
time in the thread (`_let_go`; freed whole, or with an error's frames on the loop, it
would go in one step). A long string is still scanned whole (a few ms per MB).

The bounds, all from the context length C and MAX_CHARS_PER_TOKEN (no token is longer):
`max_body_bytes` is the largest body a request C can take has (the HTTP edge answers a
larger one 413 as soon as its Content-Length, or its bytes, say so); `check_commas`
refuses, before decoding, a body with more commas than values and characters C can take
(400); `check_size`, right after decoding, refuses one whose text does not fit: every
string in its text-bearing fields (messages, tool descriptions and schemas, response
schemas, stop strings, Anthropic system blocks, Responses `input` items; keys count, and
each other JSON value counts one) against 32·C characters, a 400 naming the field where
the text ran over.

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
from luced.api.fields import (
    MAX_CHARS_PER_TOKEN,
    APIError,
    as_int,
    bad,
    decode_body,
    json_kind,
    read_bool,
    read_text,
)
from luced.api.openai import (
    ChatRequest,
    CompletionRequest,
    Options,
    chat_prompt,
    completion_prompts,
    parse_chat,
    parse_completion,
)
from luced.api.responses import parse_responses
from luced.engine.core import Engine
from luced.text import reasoning
from luced.text.grammar import GrammarError, check_grammar
from luced.text.tool_calls import ToolFormat, has_tool_turns, tool_format

LARGE_BODY = 1 << 20
PREPARE_THREADS = 2
# JSON bytes per counted character at most: a character may be written \ud83d\ude00,
# and a pretty-printed schema spends a line of indentation on one value.
BYTES_PER_CHAR = 32
MANY_VALUES = 20_000  # the C decoder's time for as many values: ~10 ms

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
    thinking: anthropic.Thinking | None = None  # a Messages reply that thinks
    others: tuple[list[int], ...] = ()  # completions: a list's prompts after the first

    @property
    def prompts(self) -> list[list[int]]:
        return [self.prompt, *self.others]


class Preparer:
    """Runs preparations in threads: see the module docstring."""

    def __init__(self, threads: int = PREPARE_THREADS) -> None:
        self._large = ThreadPoolExecutor(threads, thread_name_prefix="luced-prepare")

    async def run(
        self,
        chunks: list[bytes],
        fn: Callable[..., T],
        engine: Engine,
        *args: Any,
        tokens: int | None = None,
    ) -> T:
        """`fn(engine, *args, body)` in a thread, the body decoded there from its chunks.
        `tokens`: what the request may carry in all, which bounds its values (default:
        the context; a request of many embedding inputs carries more)."""
        pool = self._large if sum(map(len, chunks)) > LARGE_BODY else None
        bound = tokens or engine.model.context_length
        call = functools.partial(_prepare, fn, engine, args, chunks, bound)
        return await asyncio.get_running_loop().run_in_executor(pool, call)

    async def peek(self, chunks: list[bytes], fn: Callable[[Any], T]) -> T:
        """`fn(body)` in a thread, the body decoded there: what a route reads of a body
        before it has an engine (the model it names, when the daemon serves several)."""
        pool = self._large if sum(map(len, chunks)) > LARGE_BODY else None
        call = functools.partial(_peek, fn, chunks)
        return await asyncio.get_running_loop().run_in_executor(pool, call)

    def close(self) -> None:
        self._large.shutdown(wait=False, cancel_futures=True)


def _prepare(
    fn: Callable[..., T], engine: Engine, args: tuple[Any, ...], chunks: list[bytes], tokens: int
) -> T:
    raw = b"".join(chunks)
    many = check_commas(raw, tokens)
    held = [decode_body(raw, yielding=many)]  # the one reference, for `_let_go`
    del raw
    try:
        return fn(engine, *args, held[0])
    except APIError as exc:
        # Its frames hold the body, and would free it on the event loop along with them.
        exc.__traceback__ = exc.__context__ = None
        raise
    finally:
        if many:
            _let_go(held)


def _peek(fn: Callable[[Any], T], chunks: list[bytes]) -> T:
    raw = b"".join(chunks)
    many = raw.count(b",") > MANY_VALUES  # no context to bound it by yet: decoded yielding
    held = [decode_body(raw, yielding=many)]
    del raw
    try:
        return fn(held[0])
    except APIError as exc:
        exc.__traceback__ = exc.__context__ = None  # as in _prepare
        raise
    finally:
        if many:
            _let_go(held)


def _let_go(holder: list[Any]) -> None:
    """Free a decoded body a container at a time (`holder` holds the only reference):
    freed whole, its objects would all go in one step that keeps the GIL."""
    order = holder  # the body's containers and values, each container before its items
    for v in order:
        if isinstance(v, dict):
            order.extend(v.values())
        elif isinstance(v, list):
            order.extend(v)
    for i in range(len(order)):
        order[i] = None  # frees one container: its items are still in `order`


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


def max_body_bytes(context_length: int) -> int:
    """The most bytes a body of a request the context can take has: BYTES_PER_CHAR per
    character of the bound, and LARGE_BODY for what is not counted."""
    return BYTES_PER_CHAR * context_length * MAX_CHARS_PER_TOKEN + LARGE_BODY


def check_commas(raw: bytes, context_length: int) -> bool:
    """Before decoding: a 400 for a body with more values than the context can take
    (values count one each, and a comma is a character or parts two values). Returns
    whether the body has so many values (MANY_VALUES) that it is decoded in the yielding
    way (`decode_body`)."""
    commas = raw.count(b",")
    if commas > 2 * context_length * MAX_CHARS_PER_TOKEN + LARGE_BODY // 16:
        raise APIError(
            400,
            f"the request body has {commas} commas: more JSON values than a context of "
            f"{context_length} tokens can take",
        )
    return commas > MANY_VALUES


# --- the routes' preparations ---------------------------------------------------------------


def prepare_chat(engine: Engine, body: dict[str, Any]) -> Prepared[ChatRequest]:
    check_size(body, CHAT_FIELDS, engine.model.context_length)
    vocab = engine.tokenizer.vocab_size
    req = parse_chat(body, model_name=engine.model.name, vocab_size=vocab)
    check_choices(engine, req.options.n, 1)
    return _chat(engine, req, chat_prompt)


def prepare_responses(engine: Engine, body: dict[str, Any]) -> Prepared[ChatRequest]:
    check_size(body, RESPONSES_FIELDS, engine.model.context_length)
    return _chat(engine, parse_responses(body, model_name=engine.model.name), chat_prompt)


def prepare_messages(
    engine: Engine, count_only: bool, body: dict[str, Any]
) -> Prepared[anthropic.MessagesRequest]:
    check_size(body, MESSAGES_FIELDS, engine.model.context_length)
    req = anthropic.parse_messages(body, model_name=engine.model.name, count_only=count_only)
    # count_tokens renders what the reply would have, thinking or not, without compiling.
    think = req.thinks(engine.chat_template, constrained=_constrained(engine, req))
    render = functools.partial(anthropic.message_prompt, think=think)
    prep = _chat(engine, req, render, grammar=not count_only)
    if not think:
        return prep
    # Does the prompt itself open the think block (DeepSeek-R1's generation prompt)?
    tail = engine.tokenizer.decode(prep.prompt[-8:], skip_special=False)
    opened = reasoning.opens_thinking(tail)
    return replace(prep, thinking=anthropic.Thinking(opened, req.thinking == "omitted"))


def _constrained(engine: Engine, req: anthropic.MessagesRequest) -> bool:
    """Whether a grammar will hold the reply to a tool call, leaving no text to think in."""
    if not req.calls_tools:
        return False
    return tool_format(engine.chat_template).grammar(req.tools, req.tool_choice) is not None


def prepare_completion(engine: Engine, body: dict[str, Any]) -> Prepared[CompletionRequest]:
    engine.intake.check_generates()
    check_size(body, COMPLETION_FIELDS, engine.model.context_length)
    vocab = engine.tokenizer.vocab_size
    req = parse_completion(body, model_name=engine.model.name, vocab_size=vocab)
    check_choices(engine, req.options.n, len(req.prompts))
    _check(req.options.grammar)
    first, *others = completion_prompts(req, engine.tokenizer)
    if others and (total := len(first) + sum(map(len, others))) > engine.limits.max_queued_tokens:
        raise bad(
            "prompt",
            f"the prompts have {total} tokens together; at most {engine.limits.max_queued_tokens} "
            "may wait in the queue (--max-queued-tokens)",
        )
    return Prepared(req, first, req.options, others=tuple(others))


def check_choices(engine: Engine, n: int, prompts: int) -> None:
    """A 400 for more choices than the engine's queue takes at once: every choice is an
    engine request, and they are queued together."""
    most = engine.limits.max_queue
    if n * prompts > most:
        param = "n" if prompts == 1 else "prompt"
        what = f"n = {n}" if prompts == 1 else f"{prompts} prompts × n = {n}"
        raise bad(
            param,
            f"{what} asks for {n * prompts} choices; at most {most} requests may "
            "wait in the queue (--max-queue)",
        )


def prepare_tokenize(engine: Engine, body: dict[str, Any]) -> tuple[list[int], bool]:
    """(the ids of `content`, whether the reply lists each token's piece)."""
    check_size(body, ("content",), engine.model.context_length)
    content = read_text("content", body.get("content"))
    add_bos = read_bool(body, "add_special")
    special = read_bool(body, "parse_special", default=True)
    with_pieces = read_bool(body, "with_pieces")
    ids = engine.tokenizer.encode(content, add_bos=add_bos, allow_special=special, add_eos=False)
    return ids, with_pieces


def prepare_detokenize(engine: Engine, body: dict[str, Any]) -> str:
    """The text of `tokens` (control tokens as their text, so that it inverts tokenize)."""
    check_size(body, ("tokens",), engine.model.context_length)
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
    engine.intake.check_generates()
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
