"""Tool formats: what the model is shown, which outputs the grammars take (llguidance over
SmolLM2's vocabulary), and the calls parsed back out."""

from __future__ import annotations

import json

import pytest
from test_grammar import accepts, vocab  # noqa: F401 - vocab is a fixture

from luced.text.chat_template import ChatTemplate
from luced.text.grammar import check_grammar
from luced.text.tool_calls import (
    GenericToolFormat,
    NativeToolFormat,
    Tool,
    ToolChoice,
    tool_format,
)

WEATHER = Tool(
    "get_weather",
    "Current weather in a city",
    {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
)
TIME = Tool("get_time", "", {"type": "object", "properties": {}})
TOOLS = (WEATHER, TIME)

# A template in Qwen's manner: it lists the tools in the system turn and reads calls back.
QWEN_LIKE = (
    "{% if tools %}<|im_start|>system\n<tools>\n"
    "{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    "</tools>\nCall a tool inside <tool_call></tool_call> tags.<|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.tool_calls %}<|im_start|>assistant\n"
    "{% for c in m.tool_calls %}<tool_call>\n{{ {'name': c.function.name, "
    "'arguments': c.function.arguments} | tojson }}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_the_template_decides_the_format(smollm2_gguf) -> None:
    assert isinstance(tool_format(ChatTemplate(QWEN_LIKE)), NativeToolFormat)
    assert isinstance(tool_format(ChatTemplate.from_gguf(smollm2_gguf, "llama")), GenericToolFormat)


@pytest.mark.parametrize("mode", ["auto", "required", "function"])
def test_generic_grammar_takes_calls_of_the_allowed_tools_only(vocab, mode: str) -> None:  # noqa: F811
    choice = ToolChoice(mode, "get_weather" if mode == "function" else None)
    grammar = GenericToolFormat().grammar(TOOLS, choice)
    assert grammar is not None
    weather = '{"tool_call": {"name": "get_weather", "arguments": {"city": "Paris"}}}'
    assert accepts(vocab, grammar, weather)
    assert not accepts(vocab, grammar, weather.replace('"Paris"', "3"))  # the schema holds
    # Closed objects: no invented keys, where the schema lists its properties.
    assert not accepts(vocab, grammar, weather.replace('"Paris"}', '"Paris", "unit": "C"}'))
    other = '{"tool_call": {"name": "get_time", "arguments": {}}}'
    assert accepts(vocab, grammar, other) == (mode != "function")
    reply = '{"response": "It is sunny."}'
    assert accepts(vocab, grammar, reply) == (mode == "auto")
    assert GenericToolFormat().grammar(TOOLS, ToolChoice("none")) is None


def test_native_grammar_is_tool_call_blocks(vocab) -> None:  # noqa: F811
    fmt = NativeToolFormat()
    assert fmt.grammar(TOOLS, ToolChoice("auto")) is None  # free text that may call
    grammar = fmt.grammar(TOOLS, ToolChoice("required"))
    assert grammar is not None
    check_grammar(grammar)
    call = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    assert accepts(vocab, grammar, call)
    assert accepts(vocab, grammar, f"{call}\n{call}")  # parallel calls
    assert not accepts(vocab, grammar, "It is noon.")


def test_parsing_native_blocks() -> None:
    fmt = NativeToolFormat()
    call = '{"name": "get_weather", "arguments": {"city": "Oslo"}}'
    text = f"Let me look.\n<tool_call>\n{call}\n</tool_call>"
    parsed = fmt.parse(text)
    assert parsed.content == "Let me look."
    ((call),) = parsed.calls
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Oslo"}
    assert call.id.startswith("call_")
    # Not a call: the text stays as written.
    assert fmt.parse("<tool_call>not json</tool_call>").calls == ()
    assert fmt.parse("Plain answer.").content == "Plain answer."


def test_parsing_generic_json() -> None:
    fmt = GenericToolFormat()
    parsed = fmt.parse('{"tool_call": {"name": "get_time", "arguments": {}}}')
    assert parsed.content is None and [c.name for c in parsed.calls] == ["get_time"]
    assert fmt.parse('{"response": "Hi \\u00e9"}').content == "Hi \u00e9"
    cut = '{"response": "It is sun'  # max_tokens cut the reply short
    assert fmt.parse(cut).content == "It is sun"
    assert fmt.parse("not json").content == "not json"


def test_generic_history_renders_through_a_template_without_tools(smollm2_gguf) -> None:
    template = ChatTemplate.from_gguf(smollm2_gguf, "llama")
    call = {"id": "c1", "type": "function"}
    call["function"] = {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "-3 C"},
    ]
    chat, variables = GenericToolFormat().prepare(messages, TOOLS)
    text = template.render(chat, **variables)
    assert "Be brief.\n\nYou can call these tools:" in text  # one system turn
    assert '"name": "get_weather"' in text and '"description": "Current weather' in text
    assert '{"tool_call": {"name": "get_weather", "arguments": {"city": "Oslo"}}}' in text
    assert '<|im_start|>user\n{"tool_result": "-3 C"}' in text


def test_native_history_renders_through_the_template() -> None:
    call = {"id": "c1", "type": "function"}
    call["function"] = {"name": "get_time", "arguments": "{}"}
    messages = [
        {"role": "user", "content": "Time?"},
        {"role": "assistant", "tool_calls": [call]},
        {"role": "tool", "content": "12:00"},
    ]
    chat, variables = NativeToolFormat().prepare(messages, TOOLS)
    text = ChatTemplate(QWEN_LIKE).render(chat, **variables)
    assert text.startswith("<|im_start|>system\n<tools>\n")
    assert '"name": "get_weather"' in text
    # Arguments reach the template as an object, not as JSON text inside a string.
    assert '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>' in text
    assert "<|im_start|>tool\n12:00<|im_end|>" in text
