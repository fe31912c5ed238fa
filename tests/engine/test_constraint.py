"""The grammar's masks on the real SmolLM2 vocabulary, without a model.

Oracles: `json` + `jsonschema` (masked greedy decoding of random logits must always give
valid output: random logits would never write JSON on their own), and the matcher
itself (a speculative walk must leave exactly the masks and the state plain decoding
would)."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest

from luced.engine.constraint import Constraint
from luced.text.grammar import GrammarTokenizer, json_schema_grammar
from luced.text.tokenizer import Tokenizer

SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "ok": {"type": "boolean"},
            "tags": {"type": "array", "items": {"enum": ["x", "yz"]}, "maxItems": 3},
            "where": {
                "type": "object",
                "properties": {"lat": {"type": "number", "minimum": -90, "maximum": 90}},
                "required": ["lat"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "age", "ok", "tags", "where"],
        "additionalProperties": False,
    },
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 4},
    {"enum": ["red", "green", {"rgb": [1, 2, 3]}]},
]


@pytest.fixture(scope="module")
def vocab(smollm2_gguf) -> tuple[Tokenizer, GrammarTokenizer]:
    tokenizer = Tokenizer.from_gguf(smollm2_gguf)
    return tokenizer, GrammarTokenizer(tokenizer)


def constraint(vocab, schema, rows: int = 8) -> tuple[Constraint, set[int]]:
    tokenizer, grammar_vocab = vocab
    stops = set(tokenizer.eos_ids)
    # A padded head: the region is wider than the tokenizer's vocabulary.
    masks = np.full((rows, grammar_vocab.mask_words + 2), -1, dtype=np.int32)
    matcher = grammar_vocab.matcher(json_schema_grammar(schema))
    return Constraint(matcher, grammar_vocab, stops, masks), stops


def allowed_ids(c: Constraint, row: int = 0) -> np.ndarray:
    bits = np.unpackbits(c.masks[row].view(np.uint8), bitorder="little")
    return np.flatnonzero(bits)


@pytest.mark.parametrize("schema", range(len(SCHEMAS)))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_masked_greedy_of_random_logits_validates(vocab, schema: int, seed: int) -> None:
    tokenizer, grammar_vocab = vocab
    c, stops = constraint(vocab, SCHEMAS[schema])
    rng = np.random.default_rng(seed)
    out: list[int] = []
    for _ in range(300):
        c.fill(0)
        ids = allowed_ids(c)
        assert ids.max() < grammar_vocab.vocab_size  # nothing past the tokenizer's ids
        # EOS (every stop id) exactly when the grammar may end.
        assert stops <= set(ids.tolist()) if c.matcher.is_accepting() else not stops & set(ids)
        token = int(ids[np.argmax(rng.standard_normal(len(ids)))])
        if token in stops:
            break
        out.append(token)
        c.advance(token)
        if c.done:
            break
    else:
        pytest.fail(f"no end after 300 tokens: {tokenizer.decode(out)!r}")
    jsonschema.validate(json.loads(tokenizer.decode(out)), SCHEMAS[schema])


def test_walk_fills_the_masks_plain_decoding_would_and_rolls_back(vocab) -> None:
    tokenizer, _ = vocab
    c, _ = constraint(vocab, SCHEMAS[0], rows=16)
    text = '{"name": "Ann", "age": 41, "ok": true, "tags": [], "where": {"lat": 1.5}}'
    ids = tokenizer.encode(text, add_bos=False)
    anchor, rest = ids[0], ids[1:]
    c.advance(anchor)
    # The plain masks: one per position, consuming as decoding would.
    plain = []
    for token in rest[:6]:
        c.fill(0)
        plain.append(c.masks[0].copy())
        c.advance(token)
    c.rollback(6)
    refused = tokenizer.encode("\n", add_bos=False)[0]  # a raw newline: never in a string
    block = [anchor, *rest[:4], refused, *rest[5:8]]
    assert tokenizer.decode(block[:5]) == '{"name": "Ann'
    kept = c.walk(block)
    assert kept == 5  # the anchor and the four allowed proposals
    for i in range(kept):
        assert np.array_equal(c.masks[i], plain[i]), f"row {i}"
    c.rollback(kept - 1)
    c.fill(0)
    assert np.array_equal(c.masks[0], plain[0])  # the state before the walk
