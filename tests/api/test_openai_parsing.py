"""Request bodies -> validated requests: every rule names its field; nothing else escapes."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from luced.api.fields import APIError, decode_body
from luced.api.openai import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    MAX_STOP,
    chat_prompt,
    completion_prompt,
    generation_request,
    parse_chat,
    parse_completion,
)
from luced.sampling_params import SamplingParams
from luced.text.chat_template import ChatTemplate
from luced.text.tokenizer import Tokenizer

MODEL = "smol"
VOCAB = 49152  # SmolLM2's vocabulary size
USER = [{"role": "user", "content": "Hi"}]


def chat(**fields: Any):
    return parse_chat({"messages": USER, **fields}, model_name=MODEL, vocab_size=VOCAB)


def completion(**fields: Any):
    body = {"prompt": "Hello", **fields}
    return parse_completion(body, model_name=MODEL, vocab_size=VOCAB)


def rejected(parse, **fields: Any) -> APIError:
    with pytest.raises(APIError) as info:
        parse(**fields)
    return info.value


# --- the body ----------------------------------------------------------------------------


@pytest.mark.parametrize("yielding", [False, True])
@pytest.mark.parametrize(
    "raw", [b"{", b"", b'{"a": 1,}', b"\xff\xfe{}", b"[" * 100_000 + b"]" * 100_000]
)
def test_malformed_json_is_a_400(raw: bytes, yielding: bool) -> None:
    with pytest.raises(APIError) as info:
        decode_body(raw, yielding=yielding)
    assert info.value.status == 400
    assert "not valid JSON" in info.value.message


@pytest.mark.parametrize("yielding", [False, True])
@pytest.mark.parametrize("raw", [b"[]", b"1", b'"x"', b"null"])
def test_body_must_be_an_object(raw: bytes, yielding: bool) -> None:
    with pytest.raises(APIError, match="must be a JSON object"):
        decode_body(raw, yielding=yielding)


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda kids: st.lists(kids) | st.dictionaries(st.text(), kids),
    max_leaves=30,
)


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.text(), JSON), st.sampled_from(["utf-8", "utf-16", "utf-32"]))
def test_the_yielding_decoder_reads_what_the_c_one_does(body: dict, encoding: str) -> None:
    raw = json.dumps(body, ensure_ascii=False).encode(encoding, "surrogatepass")
    assert decode_body(raw, yielding=True) == decode_body(raw) == body


# --- defaults ----------------------------------------------------------------------------


def test_chat_defaults() -> None:
    req = chat()
    o = req.options
    assert (o.model, o.stream, o.include_usage) == (MODEL, False, False)
    assert o.params == SamplingParams()
    assert (o.max_tokens, o.stop, o.stop_token_ids, o.ignore_eos) == (None, (), (), False)
    assert o.top_logprobs is None
    assert req.messages == ({"role": "user", "content": "Hi"},)


def test_completion_defaults_to_openais_16_tokens() -> None:
    req = completion()
    assert req.options.max_tokens == COMPLETIONS_DEFAULT_MAX_TOKENS == 16
    assert req.prompt == "Hello"
    assert completion(max_tokens=200).options.max_tokens == 200


def test_model_may_be_omitted_or_named_but_not_another() -> None:
    assert chat(model=MODEL).options.model == MODEL
    err = rejected(chat, model="gpt-4o")
    assert (err.status, err.code, err.param) == (404, "model_not_found", "model")
    assert "gpt-4o" in err.message


def test_unknown_fields_are_ignored() -> None:
    req = chat(user="u1", metadata={"a": 1}, frobnicate=[1, 2], store=False, tool_choice="auto")
    assert req.options.params == SamplingParams()


def test_null_means_not_given() -> None:
    nulls = dict.fromkeys(
        ["temperature", "top_p", "top_k", "min_p", "seed", "stop", "max_tokens", "n", "logprobs",
         "top_logprobs", "frequency_penalty", "presence_penalty", "stream", "stream_options",
         "tools", "response_format", "logit_bias", "model"]
    )  # fmt: skip
    assert chat(**nulls).options == chat().options


# --- sampling fields ---------------------------------------------------------------------


def test_sampling_fields_map_into_sampling_params() -> None:
    o = chat(
        temperature=0,
        top_p=0.9,
        top_k=40,
        min_p=0.05,
        seed=7,
        frequency_penalty=0.5,
        presence_penalty=-0.25,
        repetition_penalty=1.1,
        max_tokens=30,
        stop_token_ids=[2, 5.0],
        ignore_eos=True,
    ).options
    assert o.params == SamplingParams(
        temperature=0.0,
        top_p=0.9,
        top_k=40,
        min_p=0.05,
        seed=7,
        frequency_penalty=0.5,
        presence_penalty=-0.25,
        repetition_penalty=1.1,
    )
    assert o.params.greedy
    assert (o.max_tokens, o.stop_token_ids, o.ignore_eos) == (30, (2, 5), True)


def test_top_k_minus_one_is_off_as_in_vllm() -> None:
    assert chat(top_k=-1).options.params.top_k == 0


def test_max_completion_tokens_wins_over_max_tokens() -> None:
    assert chat(max_tokens=5, max_completion_tokens=9).options.max_tokens == 9
    assert chat(max_tokens=5).options.max_tokens == 5


def test_stream_options_include_usage_only_when_streaming() -> None:
    assert chat(stream=True, stream_options={"include_usage": True}).options.include_usage
    assert not chat(stream=False, stream_options={"include_usage": True}).options.include_usage
    assert not chat(stream=True).options.include_usage


BAD_FIELDS = [
    # (field, value, message fragment)
    ("temperature", "hot", "must be a number"),
    ("temperature", True, "must be a number"),
    ("temperature", -0.5, "temperature must be in [0, 100]"),
    ("temperature", 1e308, "temperature must be in [0, 100]"),
    ("top_k", 1e30, "top_k must be in [-1, 2147483647], got an integer of 31 digits"),
    ("repetition_penalty", 5e-324, "repetition_penalty must be in [0.01, 100]"),
    ("repetition_penalty", 1e300, "repetition_penalty must be in [0.01, 100]"),
    ("temperature", 10**400, "finite"),
    ("top_p", 0, "top_p must be in (0, 1]"),
    ("top_p", 1.5, "top_p must be in [0, 1]"),
    ("top_k", 2.5, "must be an integer"),
    ("top_k", -3, "top_k must be in [-1, 2147483647]"),
    ("min_p", 2, "min_p must be in [0, 1]"),
    ("repetition_penalty", 0, "repetition_penalty must be in [0.01, 100]"),
    ("frequency_penalty", 2.5, "in [-2, 2]"),
    ("presence_penalty", -3, "in [-2, 2]"),
    ("seed", "42", "must be an integer"),
    ("seed", 2**64, "seed must be in"),
    ("max_tokens", 0, "max_tokens must be in [1, 2147483647]"),
    ("max_tokens", 1e30, "max_tokens must be in [1, 2147483647]"),
    ("seed", 1e30, "seed must be in"),
    ("max_tokens", "10", "must be an integer"),
    ("max_completion_tokens", -1, "max_completion_tokens must be in [1, 2147483647]"),
    ("stream", "yes", "stream must be a boolean"),
    ("stream_options", [], "stream_options must be an object"),
    ("ignore_eos", 1, "ignore_eos must be a boolean"),
    ("stop", 5, "stop must be a string or an array"),
    ("stop", ["a"] * (MAX_STOP + 1), f"at most {MAX_STOP}"),
    ("stop_token_ids", 3, "must be an array of token ids"),
    ("n", 2, "n > 1 is not supported"),
    ("n", 0, "n must be in [1, 2147483647]"),
    ("logit_bias", {"50256": -100}, "logit_bias is not supported"),
    ("model", 3, "model must be a string"),
]


@pytest.mark.parametrize(("field", "value", "fragment"), BAD_FIELDS)
def test_bad_field_is_a_400_naming_it(field: str, value: Any, fragment: str) -> None:
    body = {field: value, "stream": True} if field == "stream_options" else {field: value}
    # max_completion_tokens is chat's newer name; the completions endpoint does not know it.
    for parse in (chat,) if field == "max_completion_tokens" else (chat, completion):
        err = rejected(parse, **body)
        assert err.status == 400
        assert err.param == field
        assert fragment in err.message
        assert err.body()["error"]["param"] == field


def test_nested_bad_values_name_their_path() -> None:
    assert rejected(chat, stop=["ok", 3]).param == "stop[1]"
    assert rejected(chat, stop="x" * 257).param == "stop"
    assert rejected(chat, stop_token_ids=[1, VOCAB]).param == "stop_token_ids[1]"
    err = rejected(chat, stream=True, stream_options={"include_usage": "yes"})
    assert err.param == "include_usage"


def test_stop_is_normalized() -> None:
    assert chat(stop="###").options.stop == ("###",)
    assert chat(stop=["a", "", "b", "a"]).options.stop == ("a", "b")
    assert chat(stop=[]).options.stop == ()
    assert len(chat(stop=[f"s{i}" for i in range(MAX_STOP)]).options.stop) == MAX_STOP


# --- logprobs ----------------------------------------------------------------------------


def test_chat_logprobs_map_to_top_k() -> None:
    assert chat().options.top_logprobs is None
    assert chat(logprobs=False).options.top_logprobs is None
    assert chat(logprobs=True).options.top_logprobs == 0
    assert chat(logprobs=True, top_logprobs=5).options.params.logprobs == 5
    assert chat(logprobs=True, top_logprobs=20).options.top_logprobs == 20


def test_chat_logprobs_errors() -> None:
    err = rejected(chat, top_logprobs=3)
    assert (err.param, err.message) == ("top_logprobs", "top_logprobs requires logprobs: true")
    assert rejected(chat, logprobs=True, top_logprobs=21).param == "top_logprobs"
    assert rejected(chat, logprobs=1).param == "logprobs"


def test_completion_logprobs_is_an_integer() -> None:
    assert completion(logprobs=3).options.top_logprobs == 3
    assert completion(logprobs=0).options.top_logprobs == 0
    assert completion().options.top_logprobs is None
    assert rejected(completion, logprobs=True).param == "logprobs"
    assert rejected(completion, logprobs=21).param == "logprobs"


# --- messages ----------------------------------------------------------------------------


def test_content_parts_are_joined_text() -> None:
    parts = [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]
    req = chat(messages=[{"role": "user", "content": parts}])
    assert req.messages[0]["content"] == "one\ntwo"


def test_roles_and_optional_fields() -> None:
    messages = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "Hi", "name": "ann"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function"}]},
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
    ]
    got = chat(messages=messages).messages
    assert got[0] == {"role": "system", "content": "Be brief."}
    assert got[1] == {"role": "user", "content": "Hi", "name": "ann"}
    assert got[2] == {"role": "assistant", "content": None, "tool_calls": messages[2]["tool_calls"]}
    assert got[3] == {"role": "tool", "content": "42", "tool_call_id": "c1"}


BAD_MESSAGES = [
    (None, "messages"),
    ([], "messages"),
    ("Hi", "messages"),
    (["Hi"], "messages[0]"),
    ([{"content": "Hi"}], "messages[0].role"),
    ([{"role": "function", "content": "Hi"}], "messages[0].role"),
    ([{"role": "user"}], "messages[0].content"),
    ([{"role": "user", "content": 5}], "messages[0].content"),
    ([{"role": "user", "content": ["x"]}], "messages[0].content[0]"),
    (
        [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url"}]}],
        "messages[0].content[1].type",
    ),
    ([{"role": "user", "content": [{"type": "text", "text": 1}]}], "messages[0].content[0].text"),
    ([USER[0], {"role": "user", "content": "a\ud800"}], "messages[1].content"),
    ([{"role": "user", "content": "a", "name": 3}], "messages[0].name"),
    ([{"role": "assistant", "content": "a", "tool_calls": "x"}], "messages[0].tool_calls"),
]


@pytest.mark.parametrize(("messages", "param"), BAD_MESSAGES)
def test_bad_messages_name_the_field(messages: Any, param: str) -> None:
    err = rejected(chat, messages=messages)
    assert (err.status, err.param) == (400, param)
    assert param in err.message


def test_image_parts_are_rejected_by_name() -> None:
    err = rejected(chat, messages=[{"role": "user", "content": [{"type": "image_url"}]}])
    assert "'image_url' is not supported" in err.message


# --- known but unsupported fields --------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"response_format": "text"}, "response_format"),
        ({"audio": {"voice": "alloy"}}, "audio"),
        ({"modalities": ["text", "audio"]}, "modalities"),
    ],
)
def test_chat_rejects_what_it_cannot_honour(fields: dict, param: str) -> None:
    assert rejected(chat, **fields).param == param


def test_chat_accepts_the_neutral_values() -> None:
    chat(
        tools=[{"type": "function", "function": {"name": "f"}}],
        tool_choice="none",
        response_format={"type": "text"},
        modalities=["text"],
        n=1,
        logit_bias={},
        tools_extra=1,
    )


# --- tools -------------------------------------------------------------------------------

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def test_tools_and_tool_choice() -> None:
    req = chat(tools=[WEATHER])
    assert req.tool_choice.mode == "auto" and req.calls_tools
    (tool,) = req.tools
    assert (tool.name, tool.description) == ("get_weather", "Weather in a city")
    assert tool.parameters["properties"] == {"city": {"type": "string"}}
    assert chat(tools=[WEATHER], tool_choice="required").tool_choice.mode == "required"
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert chat(tools=[WEATHER], tool_choice=named).tool_choice.name == "get_weather"
    assert not chat(tools=[WEATHER], tool_choice="none").calls_tools
    assert not chat(tool_choice="auto").calls_tools  # no tools: nothing to call
    # A function without parameters takes an empty object.
    bare = chat(tools=[{"type": "function", "function": {"name": "now"}}]).tools[0]
    assert bare.parameters == {"type": "object", "properties": {}}


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": {"type": "function"}}, "tools"),
        ({"tools": [{"type": "function"}]}, "tools[0].function"),
        ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
            "tools[0].function.parameters",
        ),
        (
            {
                "tools": [
                    {"type": "function", "function": {"name": "f", "parameters": {"type": "blob"}}}
                ]
            },
            "tools[0].function.parameters",
        ),
        ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
        ),
        ({"tools": [WEATHER], "response_format": {"type": "json_object"}}, "response_format"),
    ],
)
def test_bad_tools_name_their_field(fields: dict, param: str) -> None:
    err = rejected(chat, **fields)
    assert (err.status, err.param) == (400, param), err.message


@pytest.mark.parametrize(
    ("fields", "param"),
    [({"echo": True}, "echo"), ({"best_of": 2}, "best_of"), ({"suffix": "x"}, "suffix")],
)
def test_completion_rejects_what_it_cannot_honour(fields: dict, param: str) -> None:
    assert rejected(completion, **fields).param == param
    completion(echo=False, best_of=1, suffix="")


# --- prompts -----------------------------------------------------------------------------


def test_chat_prompt_is_the_templated_conversation(
    smol_tokenizer: Tokenizer, smol_template: ChatTemplate
) -> None:
    req = chat(messages=[{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}])
    ids = chat_prompt(req, smol_template, smol_tokenizer)
    im_start = smol_tokenizer.backend.token_to_id("<|im_start|>")
    # Control tokens the template writes are single tokens, not spelled-out text ...
    assert ids.count(im_start) == 3  # system, user, and the generation prompt
    assert smol_tokenizer.decode(ids, skip_special=False).endswith("<|im_start|>assistant\n")
    # ... and content parts give exactly the ids of the same text sent as a string.
    parts = chat(
        messages=[
            {"role": "system", "content": [{"type": "text", "text": "S"}]},
            {"role": "user", "content": "Hi"},
        ]
    )
    assert chat_prompt(parts, smol_template, smol_tokenizer) == ids


def test_template_errors_are_400(smol_tokenizer: Tokenizer) -> None:
    strict = ChatTemplate("{{ raise_exception('no system role, please') }}")
    with pytest.raises(APIError) as info:
        chat_prompt(chat(), strict, smol_tokenizer)
    assert (info.value.status, info.value.param) == (400, "messages")
    assert "no system role, please" in info.value.message


def test_completion_prompt_forms(smol_tokenizer: Tokenizer) -> None:
    text_ids = smol_tokenizer.encode("Hello world")
    assert completion_prompt(completion(prompt="Hello world"), smol_tokenizer) == text_ids
    assert completion_prompt(completion(prompt=["Hello world"]), smol_tokenizer) == text_ids
    assert completion_prompt(completion(prompt=[5, 6, 7]), smol_tokenizer) == [5, 6, 7]
    assert completion_prompt(completion(prompt=[[5, 6]]), smol_tokenizer) == [5, 6]


@pytest.mark.parametrize(
    ("prompt", "param", "fragment"),
    [
        (None, "prompt", "must be a string or an array"),
        ([], "prompt", "an empty array"),
        (["a", "b"], "prompt", "batch of prompts is not supported"),
        ([[1], [2]], "prompt", "batch of prompts is not supported"),
        ([1, VOCAB], "prompt[1]", "not in [0, 49152)"),
        ([1, -1], "prompt[1]", "not in [0, 49152)"),
        ([1, True], "prompt", "batch of prompts"),
        ([[]], "prompt[0]", "must not be empty"),
        ([{}], "prompt[0]", "must be a string or an array"),
        ({"text": "a"}, "prompt", "must be a string or an array"),
    ],
)
def test_bad_prompts_name_the_field(prompt: Any, param: str, fragment: str) -> None:
    err = rejected(completion, prompt=prompt)
    assert (err.status, err.param) == (400, param)
    assert fragment in err.message


def test_empty_text_prompt_is_a_400(smol_tokenizer: Tokenizer) -> None:
    assert not smol_tokenizer.add_bos  # SmolLM2: "" has no tokens at all
    with pytest.raises(APIError, match="prompt must not be empty"):
        completion_prompt(completion(prompt=""), smol_tokenizer)


def test_generation_request_carries_the_options() -> None:
    o = chat(
        temperature=0,
        max_tokens=3,
        stop=["x"],
        stop_token_ids=[2],
        ignore_eos=True,
        logprobs=True,
        top_logprobs=2,
    ).options
    req = generation_request("chatcmpl-1", o, [1, 2, 3])
    assert (req.request_id, req.prompt, req.max_tokens) == ("chatcmpl-1", [1, 2, 3], 3)
    assert (req.stop, req.stop_token_ids, req.ignore_eos) == (("x",), (2,), True)
    assert req.params.logprobs == 2 and req.params.greedy


# --- fuzzing: a 400 or a request, never anything else ------------------------------------

# Text with lone surrogates (legal in JSON, fatal to a tokenizer) and template-ish characters.
CHARS = st.characters() | st.sampled_from(["\ud800", "\udfff", "{", "%", "<", "|", "\n"])
TEXT = st.lists(CHARS, max_size=12).map("".join)  # st.text would filter the surrogates out
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | TEXT,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)


def mostly(good: st.SearchStrategy, bad: st.SearchStrategy) -> st.SearchStrategy:
    """good nine times in ten, else bad."""
    return st.integers(0, 9).flatmap(lambda i: bad if i == 0 else good)


NUMBERS = st.integers(-3, 70) | st.floats(-3, 3) | st.sampled_from([2**64, -(10**400), 1e300])
PART = st.fixed_dictionaries({"type": st.sampled_from(["text", "text", "image_url"]), "text": TEXT})
MESSAGE = st.fixed_dictionaries(
    {
        "role": mostly(
            st.sampled_from(["system", "user", "assistant", "tool", "developer"]),
            st.sampled_from(["bot", "", None]),
        ),
        "content": TEXT | st.lists(PART, max_size=3) | st.none(),
    },
    optional={
        "name": mostly(st.text(max_size=5), JSON),
        "tool_calls": mostly(st.lists(st.dictionaries(TEXT, JSON, max_size=2)), JSON),
    },
)
# Each field: mostly plausible values, else any JSON at all.
FIELDS = {
    name: mostly(NUMBERS, JSON)
    for name in ["temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "n",
                 "frequency_penalty", "presence_penalty", "repetition_penalty", "logprobs",
                 "top_logprobs", "max_completion_tokens", "best_of"]
}  # fmt: skip
FIELDS |= {
    "model": st.sampled_from([MODEL, MODEL, "other"]) | JSON,
    "stream": st.booleans() | JSON,
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans() | JSON}) | JSON,
    "stop": TEXT | st.lists(st.lists(CHARS, max_size=300).map("".join), max_size=17) | JSON,
    "stop_token_ids": st.lists(st.integers(-2, VOCAB + 2), max_size=3) | JSON,
    "ignore_eos": st.booleans() | JSON,
    "logprobs": st.booleans() | NUMBERS | JSON,
    "tools": JSON,
    "tool_choice": st.sampled_from(["none", "auto"]) | JSON,
    "response_format": st.sampled_from(
        [{"type": "text"}, {"type": "json_object"}, {"type": "json_schema"}, {"type": "xml"}]
    )
    | st.fixed_dictionaries(
        {"type": st.just("json_schema"), "json_schema": st.fixed_dictionaries({"schema": JSON})}
    )
    | JSON,
    "echo": st.booleans() | JSON,
    "suffix": JSON,
    "logit_bias": JSON,
    "extra": JSON,
}
FIELD = st.sampled_from(sorted(FIELDS)).flatmap(lambda k: st.tuples(st.just(k), FIELDS[k]))


def bodies(core: dict[str, Any]) -> st.SearchStrategy[dict[str, Any]]:
    """A plausible core plus up to three other fields: enough examples pass validation to
    exercise the template and the tokenizer too."""
    return st.builds(
        lambda base, extra: {**base, **dict(extra)},
        st.fixed_dictionaries(core),
        st.lists(FIELD, max_size=3),
    )


MESSAGES = st.lists(MESSAGE, min_size=1, max_size=3)
CHAT_BODY = bodies({"messages": mostly(MESSAGES, JSON)})
PROMPTS = TEXT | st.lists(st.integers(-1, VOCAB + 1), max_size=4) | st.lists(TEXT, max_size=2)
COMPLETION_BODY = bodies({"prompt": mostly(PROMPTS, JSON)})
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _only_client_errors(build) -> None:
    try:
        build()
    except APIError as exc:
        assert 400 <= exc.status < 500, exc
        assert exc.message


@FUZZ
@given(body=CHAT_BODY)
def test_fuzzed_chat_bodies(
    body: dict, smol_tokenizer: Tokenizer, smol_template: ChatTemplate
) -> None:
    def build() -> None:
        req = parse_chat(body, model_name=MODEL, vocab_size=VOCAB)
        generation_request("x", req.options, chat_prompt(req, smol_template, smol_tokenizer))

    _only_client_errors(build)


@FUZZ
@given(body=COMPLETION_BODY)
def test_fuzzed_completion_bodies(body: dict, smol_tokenizer: Tokenizer) -> None:
    def build() -> None:
        req = parse_completion(body, model_name=MODEL, vocab_size=VOCAB)
        generation_request("x", req.options, completion_prompt(req, smol_tokenizer))

    _only_client_errors(build)


@settings(max_examples=200, deadline=None)
@given(raw=st.binary(max_size=64) | JSON.map(lambda v: repr(v).encode()))
def test_fuzzed_raw_bytes(raw: bytes) -> None:
    _only_client_errors(lambda: decode_body(raw))
