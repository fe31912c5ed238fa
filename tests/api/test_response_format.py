"""`response_format` -> grammar: what each form asks for, and a 400 naming the field for
every malformed one (the grammar's behaviour is tested on real tokens in
tests/text/test_grammar.py and through the engine)."""

from __future__ import annotations

from typing import Any

import pytest
from test_openai_parsing import chat, completion, rejected

from luced.text.grammar import json_schema_grammar

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def json_schema(**spec: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "s", **spec}}


@pytest.mark.parametrize("parse", [chat, completion])
def test_each_form_maps_to_its_grammar(parse) -> None:
    assert parse(response_format={"type": "text"}).options.grammar is None
    assert parse().options.grammar is None
    any_object = parse(response_format={"type": "json_object"}).options.grammar
    assert any_object == json_schema_grammar(None)
    for strict in (True, False, None):
        fmt = json_schema(schema=SCHEMA, strict=strict)
        assert parse(response_format=fmt).options.grammar == json_schema_grammar(SCHEMA)
    # No schema: any JSON object, as json_object.
    assert parse(response_format=json_schema()).options.grammar == any_object


@pytest.mark.parametrize(
    ("fmt", "param", "says"),
    [
        ("json", "response_format", "must be an object"),
        ({"type": "xml"}, "response_format.type", "xml"),
        ({"type": "json_schema"}, "response_format.json_schema", "must be an object"),
        (json_schema(schema=[1]), "response_format.json_schema.schema", "must be an object"),
        (json_schema(schema={"type": "foo"}), "response_format.json_schema.schema", "foo"),
        (
            json_schema(schema={"$ref": "#/$defs/missing"}),
            "response_format.json_schema.schema",
            "missing",
        ),
        (json_schema(schema={"$ref": "#"}), "response_format.json_schema.schema", "loops"),
        (json_schema(name=3, schema=SCHEMA), "response_format.json_schema.name", "string"),
        (
            json_schema(strict="yes", schema=SCHEMA),
            "response_format.json_schema.strict",
            "boolean",
        ),
    ],
)
def test_a_bad_format_is_a_400_naming_the_field(fmt: Any, param: str, says: str) -> None:
    err = rejected(chat, response_format=fmt)
    assert (err.status, err.param) == (400, param)
    assert says in err.message


def test_a_tool_whose_parameters_loop_is_a_400_naming_them() -> None:
    """Its calls could match nothing: the reply would be empty, with a 200."""
    loop = {"type": "object", "properties": {"self": {"$ref": "#"}}, "required": ["self"]}
    tool = {"type": "function", "function": {"name": "f", "parameters": loop}}
    err = rejected(chat, tools=[tool])
    assert (err.status, err.param) == (400, "tools[0].function.parameters")
    assert "$ref '#' loops back" in err.message
