"""Structured output (`response_format`) on the real daemon (SmolLM2) with the official
`openai` client. Oracle: `jsonschema` — every reply parses and validates, streamed or
not, greedy or sampled; a malformed format or schema is a 400 in OpenAI's shape naming
the field, never a 5xx."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

SCHEMA = {
    "type": "object",
    "properties": {
        "country": {"type": "string", "maxLength": 40},
        "capital": {"type": "string", "maxLength": 40},
        "population_millions": {"type": "integer", "minimum": 0, "maximum": 2000},
        "languages": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3},
    },
    "required": ["country", "capital", "population_millions", "languages"],
    "additionalProperties": False,
}
FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "country", "schema": SCHEMA, "strict": True},
}
MODEL = "SmolLM2-135M-Instruct.Q4_1"
QUESTION = [{"role": "user", "content": "Describe France as JSON."}]


def test_json_schema_reply_validates_streamed_or_not(client) -> None:
    kw = {"model": MODEL, "messages": QUESTION, "max_tokens": 150, "response_format": FORMAT}
    # Sampled (seeded), with logprobs of the masked distribution. First: it also puts the
    # prompt into the prefix cache, so both greedy requests below restore it (a fresh
    # prefill may differ from a restored one in the last float bits, and greedy follows).
    sampled = client.chat.completions.create(
        seed=5, logprobs=True, top_logprobs=2, temperature=1, **kw
    )
    choice = sampled.choices[0]
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    assert all(lp.logprob <= 0 for lp in choice.logprobs.content)
    reply = client.chat.completions.create(temperature=0, **kw)
    text = reply.choices[0].message.content
    assert reply.choices[0].finish_reason == "stop", text
    jsonschema.validate(json.loads(text), SCHEMA)
    stream = client.chat.completions.create(temperature=0, stream=True, **kw)
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert streamed == text  # greedy: the same tokens either way


def test_json_object_on_completions(client) -> None:
    reply = client.completions.create(
        model=MODEL,
        prompt="A JSON object describing a cat: ",
        max_tokens=120,
        temperature=0,
        extra_body={"response_format": {"type": "json_object"}},
    )
    text = reply.choices[0].text
    assert reply.choices[0].finish_reason == "stop", text
    assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize(
    ("fmt", "param"),
    [
        ({"type": "yaml"}, "response_format.type"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}},
         "response_format.json_schema.schema"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/x"}}},
         "response_format.json_schema.schema"),
    ],
)  # fmt: skip
def test_bad_format_is_a_400_naming_the_field(client, fmt: dict, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=QUESTION, response_format=fmt)
    error = info.value.body
    assert info.value.status_code == 400 and error["param"] == param, error
    assert error["type"] == "invalid_request_error" and error["message"]
