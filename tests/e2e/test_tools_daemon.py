"""Tool calls on the real daemon (SmolLM2, whose template knows no tools: the generic
format) with the official `openai` client: a forced call is a valid call of the allowed
tool (its arguments validate against the tool's schema, by `jsonschema`), streamed or not;
the result goes back and the model answers; bad tools are 400s naming the field."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

MODEL = "SmolLM2-135M-Instruct.Q4_1"
CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 40}},
    "required": ["city"],
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather in a city", "parameters": CITY},
    },
    {"type": "function", "function": {"name": "get_time", "description": "The time now"}},
]
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


def ask(client, messages, **kw):
    kw = {"temperature": 0, "max_tokens": 60, **kw}
    return client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, **kw)


def check_call(call, name: str = "get_weather") -> dict:
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == name
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, CITY if name == "get_weather" else {"type": "object"})
    return arguments


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_a_forced_call_round_trip(client, choice) -> None:
    reply = ask(client, QUESTION, tool_choice=choice)
    (c,) = reply.choices
    assert c.finish_reason == "tool_calls" and c.message.content is None
    (call,) = c.message.tool_calls
    check_call(call)
    # The client runs the tool and sends the result back; the model answers in text.
    history = [
        *QUESTION,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"},
    ]
    answer = ask(client, history).choices[0]  # tool_choice auto: a call or a reply
    assert answer.finish_reason in ("stop", "tool_calls")
    if answer.finish_reason == "stop":
        assert answer.message.content and not answer.message.tool_calls
    else:
        check_call(answer.message.tool_calls[0], answer.message.tool_calls[0].function.name)


def test_a_named_function_is_the_one_called(client) -> None:
    named = {"type": "function", "function": {"name": "get_time"}}
    (call,) = ask(client, QUESTION, tool_choice=named).choices[0].message.tool_calls
    assert check_call(call, "get_time") == {}


def test_a_streamed_call_equals_the_unstreamed_one(client) -> None:
    whole = ask(client, QUESTION, tool_choice="required").choices[0].message.tool_calls[0]
    deltas, reasons = [], []
    for chunk in ask(client, QUESTION, tool_choice="required", stream=True):
        (c,) = chunk.choices
        deltas += c.delta.tool_calls or []
        reasons.append(c.finish_reason)
        assert not c.delta.content  # a call is not content
    (streamed,) = deltas
    assert streamed.index == 0 and streamed.id.startswith("call_")
    assert (streamed.function.name, streamed.function.arguments) == (
        whole.function.name,
        whole.function.arguments,
    )
    assert reasons[-1] == "tool_calls"


def test_tool_choice_none_is_plain_chat(client) -> None:
    plain = client.chat.completions.create(
        model=MODEL, messages=QUESTION, temperature=0, max_tokens=12
    )
    with_none = ask(client, QUESTION, tool_choice="none", max_tokens=12)
    assert with_none.choices[0].message.content == plain.choices[0].message.content


@pytest.mark.parametrize(
    ("tools", "choice", "param"),
    [
        ([{"type": "function", "function": {"name": "bad name"}}], None, "tools[0].function.name"),
        (TOOLS, {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
        (
            [{"type": "function", "function": {"name": "f", "parameters": {"type": "blob"}}}],
            None,
            "tools[0].function.parameters",
        ),
    ],
)
def test_bad_tools_are_400s_naming_the_field(client, tools, choice, param) -> None:
    extra = {} if choice is None else {"tool_choice": choice}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=MODEL, messages=QUESTION, tools=tools, max_tokens=4, **extra
        )
    assert err.value.status_code == 400 and err.value.body["param"] == param
