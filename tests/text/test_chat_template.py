"""luced.text.chat_template against transformers' apply_chat_template (the oracle)."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import pytest

from luced.text.chat_template import (
    CHATML_TEMPLATE,
    LLAMA3_TEMPLATE,
    ChatTemplate,
    ChatTemplateError,
    builtin_template,
)
from luced.text.tokenizer import Tokenizer

CONVERSATION = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "What is 2+2? Answer with ünïcödé 😀."},
    # OpenAI clients send explicit nulls; templates must see the key absent, as in transformers.
    {"role": "assistant", "content": "4.", "tool_calls": None},
    {"role": "user", "content": "And 3+3?\nThink  step by step.  "},
]


@pytest.fixture(scope="module")
def smol_template(smollm2_gguf: Path) -> ChatTemplate:
    return ChatTemplate.from_gguf(smollm2_gguf, "llama")


@pytest.fixture(scope="module")
def gemma_template(gemma3_gguf: Path) -> ChatTemplate:
    return ChatTemplate.from_gguf(gemma3_gguf, "gemma3")


# --- the file's own template, vs transformers -----------------------------------------------


@pytest.mark.real_model
@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("with_system", [True, False])
def test_smollm2_template_matches_transformers(
    hf_smol, smol_template: ChatTemplate, add_generation_prompt: bool, with_system: bool
) -> None:
    messages = CONVERSATION if with_system else CONVERSATION[1:]
    expected = hf_smol.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert not smol_template.builtin
    assert smol_template.render(messages, add_generation_prompt=add_generation_prompt) == expected
    assert ("You are a terse assistant." in expected) == with_system  # else its default system


@pytest.mark.real_model
def test_smollm2_chat_ids_match_transformers(
    hf_smol, smol_template: ChatTemplate, smollm2_gguf: Path, tmp_path: Path
) -> None:
    tok = Tokenizer.from_gguf(smollm2_gguf, cache_dir=tmp_path)
    expected = hf_smol.apply_chat_template(
        CONVERSATION, tokenize=True, add_generation_prompt=True, return_dict=False
    )
    ids = tok.encode_chat(smol_template.render(CONVERSATION))
    assert ids == expected
    assert ids.count(1) == 5 and ids.count(2) == 4  # <|im_start|>, <|im_end|> as single tokens


HELPERS_TEMPLATE = """\
{%- set ns = namespace(count=0) -%}
{% for m in messages %}
    {% if m.role == 'system' %}{% continue %}{% endif %}
    {% set ns.count = ns.count + 1 %}
    [{{ ns.count }}] {{ m.role }}: {{ m.content | trim }}
    {% generation %}{{ m.content | length }} chars{% endgeneration %}

{% endfor %}
{{ tools | tojson }}
{{ tools | tojson(indent=2) }}
{{ tools | tojson(ensure_ascii=True, sort_keys=True) }}
{{ dict(a=1, b=[2]) | tojson }} {{ dict.fromkeys(['x']) | tojson }}
{{ 'documents' if documents else 'no documents' }} {{ strftime_now('%Y') }}
{{ bos_token }}|{{ eos_token }}|{{ extra }}
{% if add_generation_prompt %}GO{% endif %}
"""


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_helpers_render_like_transformers(add_generation_prompt: bool) -> None:
    """Whitespace control, tojson options, namespace, dict, {% generation %}, variables."""
    from transformers.utils.chat_template_utils import render_jinja_template

    tools = [{"name": "f<x>&", "description": "naïve 😀", "parameters": {"z": 1, "a": None}}]
    special = {"bos_token": "<s>", "eos_token": "</s>"}
    (expected,), _ = render_jinja_template(
        conversations=[[{k: v for k, v in m.items() if v is not None} for m in CONVERSATION]],
        tools=tools,
        chat_template=HELPERS_TEMPLATE,
        add_generation_prompt=add_generation_prompt,
        extra="kw",
        **special,
    )
    ours = ChatTemplate(HELPERS_TEMPLATE, special).render(
        CONVERSATION, add_generation_prompt=add_generation_prompt, tools=tools, extra="kw"
    )
    assert ours == expected
    assert '"f<x>&"' in ours and "\\u00ef" in ours and str(datetime.now().year) in ours


# --- built-in templates ---------------------------------------------------------------------


def test_gemma_builtin_renders_gemma_turns(gemma_template: ChatTemplate) -> None:
    assert gemma_template.builtin  # the bundled Gemma 3 file has no template
    assert gemma_template.render(CONVERSATION) == (
        "<bos><start_of_turn>user\n"
        "You are a terse assistant.\n\nWhat is 2+2? Answer with ünïcödé 😀.<end_of_turn>\n"
        "<start_of_turn>model\n4.<end_of_turn>\n"
        "<start_of_turn>user\nAnd 3+3?\nThink  step by step.<end_of_turn>\n"
        "<start_of_turn>model\n"
    )
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "image"}]}]
    assert gemma_template.render(parts, add_generation_prompt=False) == (
        "<bos><start_of_turn>user\nHi<end_of_turn>\n"
    )


@pytest.mark.real_model
def test_gemma_prompt_tokenizes_to_turn_tokens(
    gemma_template: ChatTemplate, gemma3_gguf: Path, tmp_path: Path
) -> None:
    tok = Tokenizer.from_gguf(gemma3_gguf, cache_dir=tmp_path)
    ids = tok.encode_chat(gemma_template.render(CONVERSATION))
    assert ids[:3] == [2, 105, tok.encode("user", add_bos=False)[0]]  # one BOS only
    assert ids.count(105) == 4 and ids.count(106) == 3  # <start_of_turn>, <end_of_turn>
    assert 106 in tok.eos_ids


def test_gemma_builtin_requires_alternating_turns(gemma_template: ChatTemplate) -> None:
    with pytest.raises(ValueError, match="roles must alternate"):
        gemma_template.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


def test_chatml_and_llama3_builtins() -> None:
    chat = [{"role": "user", "content": "Hi "}, {"role": "assistant", "content": "Yo"}]
    assert builtin_template("qwen3") == CHATML_TEMPLATE
    assert builtin_template("llama", ["<s>", "<|im_start|>"]) == CHATML_TEMPLATE
    assert builtin_template("llama", ["<|start_header_id|>"]) == LLAMA3_TEMPLATE
    assert ChatTemplate(CHATML_TEMPLATE).render(chat) == (
        "<|im_start|>user\nHi <|im_end|>\n<|im_start|>assistant\nYo<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    llama3 = ChatTemplate(LLAMA3_TEMPLATE, {"bos_token": "<|begin_of_text|>"})
    assert llama3.render(chat, add_generation_prompt=False) == (
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nYo<|eot_id|>"
    )
    with pytest.raises(ValueError, match="no chat template in the file"):
        builtin_template("mamba")


def test_special_tokens_come_from_the_file(smol_template: ChatTemplate, gemma_template) -> None:
    assert smol_template.special_tokens["eos_token"] == "<|im_end|>"
    assert smol_template.special_tokens["bos_token"] == "<|im_start|>"
    assert gemma_template.special_tokens["bos_token"] == "<bos>"
    # kwargs override them, as in transformers
    assert ChatTemplate("{{ bos_token }}", {"bos_token": "<s>"}).render([], bos_token="X") == "X"


# --- errors and the sandbox -----------------------------------------------------------------


def test_raise_exception_is_a_value_error() -> None:
    template = ChatTemplate(
        "{% if messages[0].role != 'user' %}{{ raise_exception('First message must be user') }}"
        "{% endif %}ok"
    )
    assert template.render([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(ValueError, match="First message must be user") as info:
        template.render([{"role": "system", "content": "x"}])
    assert isinstance(info.value, ChatTemplateError)


@pytest.mark.parametrize(
    "source",
    [
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",  # the classic sandbox escape
        "{% set x = messages.append({'role': 'x'}) %}",  # immutable inputs
        "{% set ns = namespace(_private=1) %}",
        "{{ 'a' + 1 }}",  # a Python TypeError inside the template
        "{{ messages[5].content }}x{{ undefined_thing.attr }}",
    ],
)
def test_template_failures_become_value_errors(source: str) -> None:
    with pytest.raises(ChatTemplateError, match="chat template"):
        ChatTemplate(source).render([{"role": "user", "content": "hi"}])


def test_syntax_error_fails_at_load() -> None:
    with pytest.raises(ValueError, match=r"does not compile: .*line 1"):
        ChatTemplate("{% for m in messages %}{{ m.content }")


def test_messages_must_be_objects() -> None:
    with pytest.raises(ValueError, match="list of objects"):
        ChatTemplate(CHATML_TEMPLATE).render(["hello"])  # type: ignore[list-item]


def test_none_values_are_dropped() -> None:
    template = ChatTemplate("{{ 'content' in messages[0] }} {{ messages[0] | tojson }}")
    out = template.render([{"role": "assistant", "content": None}], add_generation_prompt=False)
    assert out == 'False {"role": "assistant"}'
    assert json.loads(out.split(" ", 1)[1]) == {"role": "assistant"}
