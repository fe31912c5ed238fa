"""Grammars from JSON schemas, checked on the SmolLM2 vocabulary: what they accept
(token sequences walked through the matcher), how they refuse bad schemas (a message
naming the problem), and composition of a JSON value inside a larger grammar."""

from __future__ import annotations

import re

import pytest

from luced.text.grammar import (
    GrammarError,
    GrammarTokenizer,
    check_grammar,
    json_schema_grammar,
    json_value,
)
from luced.text.tokenizer import Tokenizer

POINT = {
    "type": "object",
    "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
    "required": ["x", "y"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def vocab(smollm2_gguf) -> tuple[Tokenizer, GrammarTokenizer]:
    tokenizer = Tokenizer.from_gguf(smollm2_gguf)
    return tokenizer, GrammarTokenizer(tokenizer)


def accepts(vocab, grammar: str, text: str) -> bool:
    """Whether the grammar takes `text` (tokenized as the model would write it) whole and
    may end there."""
    tokenizer, grammar_vocab = vocab
    ids = tokenizer.encode(text, add_bos=False)
    matcher = grammar_vocab.matcher(grammar)
    return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()


def test_a_schema_takes_its_values_on_one_line(vocab) -> None:
    grammar = json_schema_grammar(POINT)
    assert accepts(vocab, grammar, '{"x": 1, "y": -2}')
    assert not accepts(vocab, grammar, '{"x": 1}')  # y is required
    assert not accepts(vocab, grammar, '{"x": 1, "y": 2, "z": 3}')
    assert not accepts(vocab, grammar, '{\n  "x": 1,\n  "y": 2\n}')  # JSON_LAYOUT
    # The schema's own x-guidance wins: free whitespace.
    loose = json_schema_grammar({**POINT, "x-guidance": {"whitespace_flexible": True}})
    assert accepts(vocab, loose, '{\n  "x": 1,\n  "y": 2\n}')
    assert accepts(vocab, json_schema_grammar(None), '{"any": [true, null]}')
    assert not accepts(vocab, json_schema_grammar(None), "[1]")  # None: an object


def test_a_json_value_composes_into_a_larger_grammar(vocab) -> None:
    grammar = f'start: "<tool_call>\\n" {json_value(POINT)} "\\n</tool_call>"'
    check_grammar(grammar)
    assert accepts(vocab, grammar, '<tool_call>\n{"x": 3, "y": 4}\n</tool_call>')
    assert not accepts(vocab, grammar, '{"x": 3, "y": 4}')


@pytest.mark.parametrize(
    ("schema", "says"),
    [
        ({"type": "foo"}, "Invalid type: foo"),
        ({"$ref": "#/$defs/nowhere"}, "nowhere"),
        ({"type": "object", "properties": 3}, "properties"),
        ({"type": "number", "minimum": float("nan")}, "not plain JSON"),
        ({"x-guidance": 1}, "x-guidance must be an object"),
        ([1], "must be an object"),
    ],
)
def test_bad_schemas_say_why(schema, says: str) -> None:
    with pytest.raises(GrammarError, match=says) as info:
        json_schema_grammar(schema)
    assert not str(info.value).startswith("at ")  # no place in a grammar nobody wrote


def test_bad_grammars_say_why() -> None:
    with pytest.raises(GrammarError, match='unknown name: "value"'):
        check_grammar("start: value")


LOOP = "no finite JSON value matches the schema: its $ref '{}' loops back"


@pytest.mark.parametrize(
    ("schema", "ref"),
    [
        ({"$ref": "#"}, "#"),
        ({"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}},
         "#/$defs/a"),
        ({"$ref": "#/$defs/a", "$defs": {"a": {"anyOf": [{"$ref": "#/$defs/a"}]}}}, "#/$defs/a"),
        ({"allOf": [{"$ref": "#"}]}, "#"),
        # an object that must hold one of its own kind, which must hold one, ...
        ({"type": "object", "properties": {"x": {"$ref": "#"}}, "required": ["x"]}, "#"),
        ({"type": "array", "items": {"$ref": "#"}, "minItems": 1}, "#"),
        ({"type": "object", "properties": {"n": {"$ref": "#/$defs/a~1b"}}, "required": ["n"],
          "$defs": {"a/b": {"$ref": "#"}}}, "#/$defs/a~1b"),
    ],
)  # fmt: skip
def test_a_ref_loop_that_matches_nothing_is_refused(schema, ref: str) -> None:
    """llguidance compiles these into a grammar of nothing: the reply would be empty."""
    with pytest.raises(GrammarError, match=re.escape(LOOP.format(ref))):
        json_schema_grammar(schema)


def test_recursion_that_can_end_is_kept(vocab) -> None:
    tree = {
        "type": "object",
        "properties": {"v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#"}}},
        "required": ["v"],
    }
    assert accepts(vocab, json_schema_grammar(tree), '{"v": 1, "kids": [{"v": 2}]}')
    node = {
        "type": "object",
        "properties": {"next": {"$ref": "#/$defs/node"}},
        "required": ["next"],
    }
    linked = {"$ref": "#/$defs/node", "$defs": {"node": {"anyOf": [{"type": "null"}, node]}}}
    assert accepts(vocab, json_schema_grammar(linked), '{"next": {"next": null}}')
    # Without "type", a number matches properties/required vacuously: not a loop.
    untyped = {"properties": {"x": {"$ref": "#/properties/x"}}, "required": ["x"]}
    assert accepts(vocab, json_schema_grammar(untyped), "5")
