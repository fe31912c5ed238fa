"""OpenAI's `response_format` -> the grammar that constrains the output (or None).

    {"type": "text"}                                      no grammar
    {"type": "json_object"}                               any JSON object
    {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}
                                                          JSON valid against the schema

The output is constrained token by token (``luced.engine.constraint``), so it always
parses and validates, whether `strict` is true, false or absent: we cannot ignore a schema
we were given. A schema llguidance cannot compile (an unknown type, a bad $ref, a keyword
it does not implement) is a 400 naming `response_format.json_schema.schema`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from luced.api.fields import bad, json_kind, read_text
from luced.text.grammar import GrammarError, json_schema_grammar

FIELD = "response_format"


def response_format_grammar(value: Any) -> str | None:
    """The grammar `response_format` asks for; APIError (400) naming the bad field."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise bad(FIELD, f"{FIELD} must be an object, got {json_kind(value)}")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return json_schema_grammar(None)
    if kind != "json_schema":
        raise bad(
            f"{FIELD}.type",
            f'{FIELD}.type must be "text", "json_object" or "json_schema", got {kind!r}',
        )
    param = f"{FIELD}.json_schema"
    spec = value.get("json_schema")
    if not isinstance(spec, Mapping):
        raise bad(param, f"{param} must be an object, got {json_kind(spec)}")
    if spec.get("name") is not None:
        read_text(f"{param}.name", spec["name"])
    strict = spec.get("strict")  # true or false, the schema is enforced
    if strict is not None and not isinstance(strict, bool):
        raise bad(f"{param}.strict", f"{param}.strict must be a boolean, got {json_kind(strict)}")
    schema = spec.get("schema")
    if schema is not None and not isinstance(schema, Mapping):
        raise bad(f"{param}.schema", f"{param}.schema must be an object, got {json_kind(schema)}")
    try:
        return json_schema_grammar(schema)
    except GrammarError as exc:
        raise bad(f"{param}.schema", f"{param}.schema: {exc}") from None
