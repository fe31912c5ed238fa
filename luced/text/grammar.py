"""Grammars for constrained decoding: JSON schemas to llguidance's Lark dialect, and the
token-level matcher that walks a grammar over one model's vocabulary (torch-free).

A request's grammar is a string in llguidance's Lark dialect, e.g.::

    start: %json{"type": "object"}                              any JSON object
    start: "<tool_call>\\n" %json{...schema...} "\\n</tool_call>"  a tool call

`GrammarTokenizer` is built once per loaded model from its `tokenizers` backend (the same
object luced encodes and decodes with, so the matcher's token bytes are ours). Its
`matcher(grammar)` compiles a grammar into an `llguidance.LLMatcher`: the per-request state
that says which tokens may come next (a bitmask, one bit per vocabulary id, 32 ids per
int32 word, id i at bit i % 32 of word i // 32), consumes the emitted tokens and rolls back
rejected speculative proposals.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Mapping
from typing import Any

import llguidance

from luced.text.schema_refs import ref_loop
from luced.text.tokenizer import Tokenizer

# Any JSON object (OpenAI's response_format {"type": "json_object"}).
ANY_OBJECT: Mapping[str, Any] = {"type": "object"}

# JSON is written on one line with json.dumps's separators. llguidance's default allows any
# run of whitespace between tokens, and small models fall into emitting it forever (SmolLM2
# and every tiny random model do). A schema with its own "x-guidance" options keeps them
# instead (llguidance's defaults under them).
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """A grammar or JSON schema that cannot be compiled; the message names the problem."""


def json_schema_grammar(schema: Mapping[str, Any] | None) -> str:
    """The Lark grammar of JSON values matching `schema` (None: any JSON object), written
    on one line (`JSON_LAYOUT`).

    Raises GrammarError when the schema is not a JSON object, llguidance cannot compile
    it (an unknown type, a bad $ref, ...) or no finite value matches it (a $ref loop)."""
    return f"start: {json_value(schema)}"


def json_value(schema: Mapping[str, Any] | None) -> str:
    """The Lark term (`%json{...}`) of one JSON value matching `schema`, checked as
    `json_schema_grammar`; for composing, e.g. ``start: "<tool_call>" TERM "</tool_call>"``."""
    if schema is None:
        schema = ANY_OBJECT
    if not isinstance(schema, Mapping):
        raise GrammarError(f"a JSON schema must be an object, got {type(schema).__name__}")
    options = schema.get("x-guidance", JSON_LAYOUT)
    if not isinstance(options, Mapping):
        raise GrammarError("x-guidance must be an object")
    schema = {**schema, "x-guidance": options}
    try:
        text = json.dumps(schema, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise GrammarError(f"the JSON schema is not plain JSON: {exc}") from None
    term = f"%json{text}"
    try:
        check_grammar(f"start: {term}")
    except GrammarError as exc:  # the place in a grammar the caller never wrote: drop it
        raise GrammarError(re.sub(r"^at \d+\(\d+\): ", "", str(exc))) from None
    if (problem := ref_loop(schema)) is not None:  # it compiles, to a grammar of nothing
        raise GrammarError(problem)
    return term


def check_grammar(grammar: str, tokenizer: llguidance.LLTokenizer | None = None) -> None:
    """GrammarError unless `grammar` compiles (with `tokenizer`: for that vocabulary).

    A grammar that compiled is remembered, so the engine's check of a request's grammar,
    on its event loop, is free when the API checked it first, off the loop (a large
    schema takes a tenth of a second)."""
    problem = _problem(grammar) if tokenizer is None else _validate(grammar, tokenizer)
    if problem is not None:
        raise GrammarError(problem)


@functools.lru_cache(maxsize=8)
def _problem(grammar: str) -> str | None:
    return _validate(grammar, None)


def _validate(grammar: str, tokenizer: llguidance.LLTokenizer | None) -> str | None:
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
    return _first_line(messages[0]) if is_error else None


def _first_line(error: str) -> str:
    # llguidance adds the grammar's source line and a caret below its message.
    return error.strip().splitlines()[0]


class GrammarTokenizer:
    """One model's vocabulary as llguidance sees it, and the matchers built over it."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.vocab_size = tokenizer.vocab_size
        # llguidance allows its one EOS id when a grammar may end; the engine maps that bit
        # to every id that ends a request (`luced.engine.constraint`).
        self.eos_id = tokenizer.eos_id if tokenizer.eos_id is not None else min(tokenizer.eos_ids)
        self.ll = llguidance.LLTokenizer(
            tokenizer.backend.to_str(), n_vocab=self.vocab_size, eos_token=self.eos_id
        )

    @property
    def mask_words(self) -> int:
        """int32 words of one row of the allowed-token bitmask."""
        return (self.vocab_size + 31) // 32

    def matcher(self, grammar: str) -> llguidance.LLMatcher:
        """A fresh matcher at the grammar's start; GrammarError if it does not compile."""
        matcher = llguidance.LLMatcher(self.ll, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(_first_line(matcher.get_error()))
        return matcher
