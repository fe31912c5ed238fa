"""Chat templates: messages -> prompt text, the way the model was trained to read them.

Most GGUFs ship the Hugging Face Jinja template as `tokenizer.chat_template`; we render it as
transformers' `apply_chat_template` does (our oracle): a sandboxed Jinja environment with
trim_blocks/lstrip_blocks, `raise_exception`, `strftime_now`, an HTML-free `tojson`, the special
token strings as variables, and keys whose value is None dropped from messages. Files without a
template (the bundled Gemma 3 base model) get a built-in one for their family.

Templates are untrusted code from the file: the sandbox blocks attribute tricks, and every
failure while rendering, including the template's own `raise_exception`, surfaces as
`ChatTemplateError` (a ValueError) with a message fit for a 400 response.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

from luced.gguf_file import GGUFFile


class ChatTemplateError(ValueError):
    """A chat template failed to compile or render; the message says why."""


# Shared by the built-ins: message content as text, whether a string or OpenAI-style parts.
_TEXT_OF = (
    "{%- macro text_of(content) -%}"
    "{%- if content is string -%}{{ content }}"
    "{%- elif content is iterable -%}"
    "{%- for part in content if part.type == 'text' -%}{{ part.text }}{%- endfor -%}"
    "{%- endif -%}"
    "{%- endmacro -%}"
)

# The built-ins write every literal through {{ '...' }} so whitespace control ({%- -%}) never
# eats a newline that belongs to the format.

# Gemma's turn format: no system role (the system text opens the first user turn), the
# assistant is "model", turns must alternate starting with the user.
GEMMA_TEMPLATE = _TEXT_OF + (
    "{{ bos_token }}"
    "{%- if messages and messages[0].role == 'system' -%}"
    "{%- set prefix = text_of(messages[0].content) + '\\n\\n' -%}"
    "{%- set turns = messages[1:] -%}"
    "{%- else -%}"
    "{%- set prefix = '' -%}"
    "{%- set turns = messages -%}"
    "{%- endif -%}"
    "{%- for message in turns -%}"
    "{%- if (message.role == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "{%- set role = 'model' if message.role == 'assistant' else message.role -%}"
    "{{ '<start_of_turn>' + role + '\\n' + (prefix if loop.first else '') }}"
    "{{ text_of(message.content) | trim }}"
    "{{ '<end_of_turn>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)

CHATML_TEMPLATE = _TEXT_OF + (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message.role + '\\n' + text_of(message.content) + '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)

LLAMA3_TEMPLATE = _TEXT_OF + (
    "{{ bos_token }}"
    "{%- for message in messages -%}"
    "{{ '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' }}"
    "{{ text_of(message.content) | trim }}"
    "{{ '<|eot_id|>' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif -%}"
)

_BUILTIN_BY_FAMILY = {
    "gemma3": GEMMA_TEMPLATE,
    "gemma2": GEMMA_TEMPLATE,
    "gemma": GEMMA_TEMPLATE,
    "qwen3": CHATML_TEMPLATE,
    "qwen3moe": CHATML_TEMPLATE,
    "qwen2": CHATML_TEMPLATE,
    "llama": CHATML_TEMPLATE,  # Llama 3's format instead when its header tokens exist
}


def builtin_template(family: str, tokens: Sequence[str] = ()) -> str:
    """The built-in template for a family; tokens (the vocabulary) picks Llama 3 vs ChatML."""
    if family == "llama" and "<|start_header_id|>" in tokens:
        return LLAMA3_TEMPLATE
    try:
        return _BUILTIN_BY_FAMILY[family]
    except KeyError:
        raise ChatTemplateError(
            f"no chat template in the file and none built in for family {family!r}"
        ) from None


# --- the Jinja environment ----------------------------------------------------------------


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks in
    some HF templates; for rendering it is a plain block."""

    tags = {"generation"}  # noqa: RUF012 (jinja's own class attribute)

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes <, >, & and ' for HTML, which would change the prompt.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _SafeDict:
    """`dict(...)` for templates without handing them the type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """Jinja's namespace, refusing underscore names (no reaching CPython internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # same signature trick as Jinja's
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} is not allowed")


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _SafeDict()
    env.globals["namespace"] = _Namespace
    return env


# --- the template ---------------------------------------------------------------------------


class ChatTemplate:
    """A compiled chat template plus the special-token strings it may refer to."""

    def __init__(
        self,
        source: str,
        special_tokens: Mapping[str, str] | None = None,
        builtin: bool = False,
    ) -> None:
        """special_tokens: template variables such as bos_token and eos_token."""
        self.source = source
        self.builtin = builtin
        self.special_tokens = dict(special_tokens or {})
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template does not compile: {_describe(exc)}") from exc

    @classmethod
    def from_gguf(cls, source: str | os.PathLike[str] | GGUFFile, family: str) -> ChatTemplate:
        """The file's `tokenizer.chat_template`, or the family's built-in template."""
        gguf = source if isinstance(source, GGUFFile) else GGUFFile(source)
        tokens = gguf.get("tokenizer.ggml.tokens") or []
        special = {}
        for name, key in (
            ("bos_token", "bos_token_id"),
            ("eos_token", "eos_token_id"),
            ("unk_token", "unknown_token_id"),
            ("pad_token", "padding_token_id"),
        ):
            token_id = gguf.get(f"tokenizer.ggml.{key}")
            if token_id is not None and 0 <= int(token_id) < len(tokens):
                special[name] = tokens[int(token_id)]
        text = gguf.get("tokenizer.chat_template")
        if isinstance(text, str) and text.strip():
            return cls(text, special)
        return cls(builtin_template(family, tokens), special, builtin=True)

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str:
        """The prompt text for messages ([{"role": ..., "content": ...}, ...]).

        kwargs become template variables (tools, documents, enable_thinking, ...); they override
        the special token strings. Raises ChatTemplateError on any template failure.
        """
        if isinstance(messages, (str, bytes)) or not all(isinstance(m, Mapping) for m in messages):
            raise ChatTemplateError("messages must be a list of objects")
        # OpenAI clients send content=None or tool_calls=None; templates expect the key absent.
        chat = [{k: v for k, v in m.items() if v is not None} for m in messages]
        variables = {"tools": None, "documents": None, **self.special_tokens, **kwargs}
        try:
            return self._template.render(
                messages=chat, add_generation_prompt=add_generation_prompt, **variables
            )
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template error: {_describe(exc)}") from exc
        except Exception as exc:  # a template can raise anything Python can (TypeError, ...)
            raise ChatTemplateError(f"chat template failed: {type(exc).__name__}: {exc}") from exc


def _describe(exc: jinja2.TemplateError) -> str:
    message = exc.message or type(exc).__name__
    lineno = getattr(exc, "lineno", None)
    return f"{message} (line {lineno})" if isinstance(exc, jinja2.TemplateSyntaxError) else message
