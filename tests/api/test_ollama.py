"""luced.api.ollama, ollama_format and ollama_models without a daemon: Ollama bodies ->
requests and prompts (the real SmolLM2 tokenizer and template, an engine that never
starts), engine deltas -> Ollama's objects, and the GGUF -> the model listings."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from luced.api import ollama_models
from luced.api.fields import APIError
from luced.api.ollama import (
    DEFAULTS,
    format_grammar,
    keep_alive_seconds,
    parse_chat,
    parse_generate,
    prepare_chat,
    prepare_generate,
    served_name,
    token_budget,
)
from luced.api.ollama_format import OllamaReply, Timings, line
from luced.api.ollama_models import ModelFacts, accelerated_share, parameter_size
from luced.engine.config import ModelInfo
from luced.engine.core import Engine, GenerationRequest, RequestHandle
from luced.engine.output import Delta, TokenLogprob
from luced.gguf_file import GGUFFile
from luced.runtime.tiny import make_tiny_gguf
from luced.sampling_params import SamplingParams
from luced.text.chat_template import ChatTemplate
from luced.text.prompt import chat_ids
from luced.text.tokenizer import Tokenizer
from luced.text.tool_calls import GenericToolFormat, ToolCall

MODEL = "smol"
CONTEXT = 256  # the unstarted engine's (tests/api/conftest.py)
VOCAB = 49152
USER = [{"role": "user", "content": "Hi"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def chat(**body):
    return parse_chat(body, model_name=MODEL, vocab_size=VOCAB)


def generate(**body):
    return parse_generate(body, model_name=MODEL, vocab_size=VOCAB)


def rejected(parse, **body) -> APIError:
    with pytest.raises(APIError) as info:
        parse(**body)
    return info.value


@pytest.fixture
def engine(unstarted_engine: Engine) -> Engine:
    assert unstarted_engine.model.context_length == CONTEXT
    return unstarted_engine


# --- requests ----------------------------------------------------------------------------


def test_chat_messages_as_the_template_reads_them() -> None:
    req = chat(
        model="smol",
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather?", "images": None},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "X"}}}],
            },
            {"role": "tool", "content": "sunny", "tool_name": "get_weather"},
        ],
        tools=[WEATHER],
    )
    assert req.kind == "chat" and req.model == "smol" and not req.idle
    assert req.messages[:2] == (
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
    )
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "X"}}}
    assert req.messages[2] == {"role": "assistant", "content": None, "tool_calls": [call]}
    assert req.messages[3] == {"role": "tool", "content": "sunny", "name": "get_weather"}
    assert req.calls_tools and req.tools[0].name == "get_weather"
    assert req.options.stream is True  # Ollama streams unless told not to


def test_a_last_assistant_message_is_continued() -> None:
    req = chat(messages=[*USER, {"role": "assistant", "content": "Hello, "}])
    assert req.prefill == "Hello, " and req.messages == tuple(USER)


@pytest.mark.parametrize("name", [None, "", "smol", "smol:latest", "SMOL", "Smol:Latest"])
def test_the_served_model_by_any_of_its_names(name) -> None:
    assert chat(model=name, messages=USER).model == (name or "smol:latest")


def test_another_model_is_a_404_naming_the_served_one() -> None:
    err = rejected(chat, model="llama3.2", messages=USER)
    assert err.status == 404
    assert err.message == "model 'llama3.2' not found; luced serves 'smol:latest'"
    assert served_name("org/m:q4") == "org/m:q4" and served_name("a.b") == "a.b:latest"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (
            {"messages": [{"role": "user", "content": "x", "images": ["aGk="]}]},
            "messages[0].images",
        ),
        ({"messages": [{"role": "bot", "content": "x"}]}, "messages[0].role"),
        ({"messages": "hi"}, "messages"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({"messages": USER, "format": "json", "tools": [WEATHER]}, "format"),
        ({"messages": USER, "think": "hard"}, "think"),
        ({"messages": USER, "options": []}, "options"),
    ],
)
def test_bad_chat_bodies_name_the_field(body, param) -> None:
    err = rejected(chat, **body)
    assert (err.status, err.param) == (400, param) and err.message.startswith(param)


def test_generate_renders_a_user_turn_after_the_system() -> None:
    req = generate(prompt="Why?", system="Be brief.", keep_alive="10m", stream=False)
    assert req.messages == (
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Why?"},
    )
    assert req.raw is None and req.keep_alive == 600 and req.options.stream is False


def test_generate_raw_and_context() -> None:
    assert generate(prompt="<|im_start|>", raw=True).raw == "<|im_start|>"
    assert generate(prompt="x", context=[1, 2.0]).context == (1, 2)
    assert rejected(generate, prompt="x", raw=True, system="s").param == "raw"
    assert rejected(generate, prompt="x", context=[VOCAB]).param == "context[0]"
    assert rejected(generate, prompt="x", suffix="y").param == "suffix"
    assert rejected(generate, prompt="x", template="{{ .Prompt }}").param == "template"
    assert rejected(generate, prompt="x", images=["aGk="]).param == "images"


def test_load_and_unload_idioms() -> None:
    assert generate().idle and generate().done_reason == "load"
    assert generate(keep_alive=0).done_reason == "unload"
    assert generate(keep_alive="0s", prompt="").done_reason == "unload"
    assert chat(messages=[], keep_alive=0).done_reason == "unload"
    assert chat().idle and not generate(prompt="x", keep_alive=0).idle


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        (None, None),
        (0, 0.0),
        (30, 30.0),
        (1.5, 1.5),
        ("0", 0.0),
        ("300", 300.0),
        ("5m", 300.0),
        ("1h30m", 5400.0),
        ("1.5s", 1.5),
        ("250ms", 0.25),
        ("-1", math.inf),
        ("-1m", math.inf),
        (-1, math.inf),
    ],
)
def test_keep_alive_durations(value, seconds) -> None:
    assert keep_alive_seconds(value) == seconds


@pytest.mark.parametrize("value", ["5 minutes", "m", "", "1x", "1h-5m", True, [], "nan"])
def test_bad_keep_alive_is_a_400(value) -> None:
    with pytest.raises(APIError) as info:
        keep_alive_seconds(value)
    assert (info.value.status, info.value.param) == (400, "keep_alive")


# --- options -----------------------------------------------------------------------------


def test_ollama_defaults_without_options() -> None:
    opts = chat(messages=USER).options
    assert opts.params == SamplingParams(**DEFAULTS)
    assert (opts.max_tokens, opts.stop, opts.grammar) == (None, (), None)


def test_options_map_to_sampling_params() -> None:
    req = chat(
        messages=USER,
        options={
            "num_predict": 7,
            "num_ctx": 128,
            "temperature": 0,
            "top_k": -1,
            "top_p": 0.5,
            "min_p": 0.1,
            "seed": 42,
            "stop": ["\n", "user:", ""],
            "repeat_penalty": 1.2,
            "repeat_last_n": -1,
            "presence_penalty": 0.5,
            "frequency_penalty": 0.25,
            "typical_p": 1.0,
            "mirostat": 0,
            # load-time and unknown options are ignored, as Ollama ignores unknown ones
            "num_gpu": 99,
            "num_thread": 8,
            "use_mmap": False,
            "num_keep": 5,
            "penalize_newline": True,
            "no_such_option": 1,
        },
        logprobs=True,
        top_logprobs=3,
    )
    assert req.options.params == SamplingParams(
        temperature=0.0,
        top_k=0,
        top_p=0.5,
        min_p=0.1,
        repetition_penalty=1.2,
        presence_penalty=0.5,
        frequency_penalty=0.25,
        penalty_window=-1,
        seed=42,
        logprobs=3,
    )
    assert req.options.max_tokens == 7 and req.num_ctx == 128
    assert req.options.stop == ("\n", "user:")


@pytest.mark.parametrize("num_predict", [0, -1, -2])
def test_num_predict_zero_or_less_is_no_limit(num_predict) -> None:
    assert chat(messages=USER, options={"num_predict": num_predict}).options.max_tokens is None


def test_seed_minus_one_is_a_fresh_seed() -> None:
    assert chat(messages=USER, options={"seed": -1}).options.params.seed is None


@pytest.mark.parametrize(
    ("options", "param", "message"),
    [
        ({"num_predict": "x"}, "options.num_predict", "must be an integer, got string"),
        ({"temperature": "hot"}, "options.temperature", "must be a number, got string"),
        ({"temperature": -1}, "options.temperature", "must be in [0, 100]"),
        ({"top_p": 0}, "options.top_p", "must be in (0, 1]"),
        ({"repeat_penalty": 0}, "options.repeat_penalty", "must be in [0.01, 100]"),
        ({"stop": 5}, "options.stop", "must be a string or an array of strings"),
        ({"stop": ["a", 1]}, "options.stop[1]", "must be a string"),
        ({"num_ctx": -5}, "options.num_ctx", "must be in [0, "),
        ({"typical_p": 0.7}, "options.typical_p", "is not supported"),
        ({"mirostat": 2}, "options.mirostat", "is not supported"),
        ({"seed": 1.5}, "options.seed", "must be an integer"),
    ],
)
def test_bad_options_name_the_option(options, param, message) -> None:
    err = rejected(chat, messages=USER, options=options)
    assert (err.status, err.param) == (400, param)
    assert err.message.startswith(param) and message in err.message


def test_format_is_a_grammar() -> None:
    assert format_grammar(None) is None and format_grammar("") is None
    assert format_grammar("json") is not None
    schema = {"type": "object", "properties": {"age": {"type": "integer"}}}
    assert format_grammar(schema) is not None
    assert chat(messages=USER, format=schema).options.grammar == format_grammar(schema)
    for bad in ("yaml", 5, {"type": "nonsense"}):
        with pytest.raises(APIError) as info:
            format_grammar(bad)
        assert info.value.param == "format"


@pytest.mark.parametrize(
    ("n_prompt", "num_predict", "num_ctx", "expected"),
    [
        (10, None, None, None),  # the engine's own default
        (10, 5, None, 5),
        (250, 50, None, 6),  # cut to the room left
        (10, None, 64, 54),  # a smaller num_ctx bounds prompt + reply
        (10, 100, 64, 54),
        (10, 3, 64, 3),
        (10, None, 100_000, None),  # a larger one changes nothing
        (10, 7, 100_000, 7),
    ],
)
def test_token_budget(n_prompt, num_predict, num_ctx, expected) -> None:
    assert token_budget(n_prompt, num_predict, num_ctx, 256, None) == expected


def test_token_budget_refuses_a_prompt_that_does_not_fit() -> None:
    with pytest.raises(APIError) as info:
        token_budget(64, None, 64, 256, None)
    assert info.value.status == 400 and "options.num_ctx 64 holds 64" in info.value.message
    with pytest.raises(APIError) as info:
        token_budget(300, None, 1000, 256, None)
    assert "more than the 256 tokens this daemon was started with" in info.value.message
    assert token_budget(10, None, 64, 256, 20) == 20  # --default-max-tokens still caps


# --- prompts -----------------------------------------------------------------------------


def test_chat_prompt_is_the_template_rendering(engine: Engine) -> None:
    prep = prepare_chat(engine, {"messages": USER, "options": {"num_predict": 4}})
    assert prep.prompt == chat_ids(engine.chat_template, engine.tokenizer, USER)
    assert prep.options.max_tokens == 4 and prep.tools is None


def test_generate_prompt_equals_the_chat_of_one_user_turn(engine: Engine) -> None:
    gen = prepare_generate(engine, {"prompt": "Hi"})
    assert gen.prompt == prepare_chat(engine, {"messages": USER}).prompt


def test_raw_prompts_parse_control_tokens(engine: Engine) -> None:
    prep = prepare_generate(engine, {"prompt": "<|im_start|>user\nHi", "raw": True})
    assert prep.prompt[0] == engine.tokenizer.encode("<|im_start|>", allow_special=True)[0]
    assert prep.prompt == engine.tokenizer.encode("<|im_start|>user\nHi", allow_special=True)


def test_context_and_prefill_extend_the_prompt(engine: Engine) -> None:
    base = prepare_chat(engine, {"messages": USER}).prompt
    cont = prepare_chat(engine, {"messages": [*USER, {"role": "assistant", "content": "Hello"}]})
    assert cont.prompt == base + engine.tokenizer.encode("Hello", add_bos=False)
    ctx = prepare_generate(engine, {"prompt": "Hi", "context": [5, 6]})
    assert ctx.prompt == [5, 6, *prepare_generate(engine, {"prompt": "Hi"}).prompt]


def test_think_renders_the_template_without_thinking(engine: Engine) -> None:
    template = ChatTemplate(
        "{% for m in messages %}{{ m.content }}{% endfor %}"
        "{% if enable_thinking is defined and not enable_thinking %}<no-think>{% endif %}"
    )
    thinking = Engine(engine.target, engine.tokenizer, template, model=ModelInfo(MODEL, CONTEXT))
    text = thinking.tokenizer.decode
    assert "<no-think>" not in text(prepare_chat(thinking, {"messages": USER}).prompt)
    for think in (True, False, "high"):
        prep = prepare_chat(thinking, {"messages": USER, "think": think})
        assert text(prep.prompt).endswith("<no-think>")


def test_tools_bring_their_grammar_and_format(engine: Engine) -> None:
    prep = prepare_chat(engine, {"messages": USER, "tools": [WEATHER]})
    assert isinstance(prep.tools, GenericToolFormat) and prep.options.grammar is not None
    assert "get_weather" in engine.tokenizer.decode(prep.prompt)


def test_an_idle_request_has_no_prompt(engine: Engine) -> None:
    prep = prepare_generate(engine, {"keep_alive": 0})
    assert prep.prompt == [] and prep.request.done_reason == "unload"


def test_prompts_that_cannot_fit(engine: Engine) -> None:
    with pytest.raises(APIError) as info:
        prepare_generate(engine, {"prompt": "x" * (CONTEXT * 32 + 1)})
    assert (info.value.status, info.value.param) == (400, "prompt")
    with pytest.raises(APIError) as info:
        prepare_chat(engine, {"messages": USER, "options": {"num_ctx": 8}})
    assert info.value.param == "options.num_ctx"


# --- replies -----------------------------------------------------------------------------


def delta(text: str, ids: list[int], logprob: float | None = None) -> Delta:
    lps = None
    if logprob is not None:
        lps = [TokenLogprob(ids[0], text, logprob, list(text.encode()), [(text, logprob, [])])]
    return Delta(text, ids, lps)


TIMINGS = Timings(
    prompt_tokens=5, completion_tokens=2, total=2.0, load=0.25, prompt_eval=0.5, eval=1.0
)


def test_chat_stream_objects() -> None:
    fmt = OllamaReply("chat", "m:latest")
    first = fmt.chunk(delta("Hel", [1]))
    assert first is not None and set(first) == {"model", "created_at", "message", "done"}
    assert first["message"] == {"role": "assistant", "content": "Hel"}
    assert first["done"] is False and first["created_at"].endswith("Z")
    assert fmt.chunk(delta("", [2])) is None
    (last,) = fmt.end("length", TIMINGS)
    assert last["message"] == {"role": "assistant", "content": ""}
    assert last["done"] is True and last["done_reason"] == "length"
    assert {k: last[k] for k in TIMINGS.fields()} == {
        "total_duration": 2_000_000_000,
        "load_duration": 250_000_000,
        "prompt_eval_count": 5,
        "prompt_eval_duration": 500_000_000,
        "eval_count": 2,
        "eval_duration": 1_000_000_000,
    }
    assert json.loads(line(last)) == last and line(last).endswith(b"}\n")


def test_generate_objects_carry_the_context() -> None:
    fmt = OllamaReply("generate", "m", prompt=[7, 8])
    assert fmt.chunk(delta("a", [1]))["response"] == "a"
    (last,) = fmt.end("stop", TIMINGS)
    assert last["response"] == "" and last["context"] == [7, 8, 1]
    whole = OllamaReply("generate", "m", prompt=[7]).whole(
        [delta("a", [1]), delta("b", [2])], "stop", TIMINGS
    )
    assert whole["response"] == "ab" and whole["context"] == [7, 1, 2] and "message" not in whole
    raw = OllamaReply("generate", "m").whole([delta("a", [1])], "stop", TIMINGS)
    assert "context" not in raw


def test_tool_calls_come_at_the_end_with_arguments_as_objects() -> None:
    fmt = OllamaReply("chat", "m", tools=GenericToolFormat())
    text = '{"tool_call": {"name": "get_weather", "arguments": {"city": "Paris"}}}'
    assert fmt.chunk(delta(text, [1])) is None  # held back until it parses
    calls, last = fmt.end("stop", TIMINGS)
    (call,) = calls["message"]["tool_calls"]
    assert call["function"] == {"index": 0, "name": "get_weather", "arguments": {"city": "Paris"}}
    assert calls["message"]["content"] == "" and calls["done"] is False
    assert last["done"] is True and "tool_calls" not in last["message"]
    whole = OllamaReply("chat", "m", tools=GenericToolFormat()).whole(
        [delta(text, [1])], "stop", TIMINGS
    )
    assert whole["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    answer = OllamaReply("chat", "m", tools=GenericToolFormat())
    answer.chunk(delta('{"response": "Hi"}', [1]))
    reply, _ = answer.end("stop", TIMINGS)
    assert reply["message"] == {"role": "assistant", "content": "Hi"}


def test_unparsable_arguments_become_an_empty_object() -> None:
    from luced.api.ollama_format import tool_calls

    (call,) = tool_calls([ToolCall("f", "not json", "call_1")])
    assert call == {"id": "call_1", "function": {"index": 0, "name": "f", "arguments": {}}}


def test_logprobs_in_ollama_shape() -> None:
    fmt = OllamaReply("chat", "m", top_logprobs=1)
    chunk = fmt.chunk(delta("a", [1], logprob=-0.5))
    assert chunk["logprobs"] == [
        {
            "token": "a",
            "logprob": -0.5,
            "bytes": [97],
            "top_logprobs": [{"token": "a", "logprob": -0.5, "bytes": []}],
        }
    ]
    assert "logprobs" not in OllamaReply("chat", "m").chunk(delta("a", [1], logprob=-0.5))


def test_idle_answers() -> None:
    body = OllamaReply("chat", "m").idle("unload")
    assert body["done"] is True and body["done_reason"] == "unload"
    assert body["message"] == {"role": "assistant", "content": ""}
    assert OllamaReply("generate", "m").idle("load")["response"] == ""


def test_timings_of_a_handle() -> None:
    handle = RequestHandle(GenerationRequest("r", [1, 2, 3], SamplingParams()), 10)
    handle.submitted_at, handle.first_token_at, handle.last_token_at = 10.5, 11.0, 13.0
    handle.completion_tokens = 4
    t = Timings.of(handle, arrived=10.0, now=13.5)
    assert t == Timings(3, 4, total=3.5, load=0.5, prompt_eval=0.5, eval=2.0)
    handle.first_token_at = handle.last_token_at = None  # ended before its first token
    assert Timings.of(handle, arrived=10.0, now=12.0).eval == 0.0


# --- the model listings ------------------------------------------------------------------


def test_facts_from_the_gguf(smollm2_gguf: Path) -> None:
    facts = ModelFacts.from_gguf(GGUFFile(smollm2_gguf))
    assert facts.arch == "llama" and facts.quantization == "Q4_1"
    assert facts.size == smollm2_gguf.stat().st_size and facts.path == str(smollm2_gguf)
    assert 130e6 < facts.parameter_count < 140e6  # SmolLM2-135M
    assert facts.metadata["general.parameter_count"] == facts.parameter_count
    assert facts.metadata["tokenizer.ggml.tokens"] == []  # arrays as Ollama shows them
    assert "tokenizer.chat_template" not in facts.metadata
    assert facts.metadata["llama.context_length"] == 8192
    assert facts.digest == ModelFacts.from_gguf(GGUFFile(smollm2_gguf)).digest


def test_listings(smollm2_gguf: Path) -> None:
    facts = ModelFacts.from_gguf(GGUFFile(smollm2_gguf))
    (tag,) = ollama_models.tags(facts, "smol")["models"]
    assert tag["name"] == tag["model"] == "smol:latest" and tag["size"] == facts.size
    assert tag["details"] == {
        "parent_model": "",
        "format": "gguf",
        "family": "llama",
        "families": ["llama"],
        "parameter_size": parameter_size(facts.parameter_count),
        "quantization_level": "Q4_1",
    }
    on_gpu = [{"devices": ["cuda:0"], "layers": [0, 10]}, {"devices": ["cpu"], "layers": [10, 30]}]
    (running,) = ollama_models.ps(facts, "smol", 512, on_gpu)["models"]
    assert running["context_length"] == 512 and running["size_vram"] == round(facts.size / 3)
    assert running["expires_at"] > "2100"  # loaded until the daemon stops
    show = ollama_models.show(facts, "{{ messages }}", 512)
    assert show["template"] == "{{ messages }}" and show["capabilities"] == ["completion", "tools"]
    assert show["model_info"]["general.architecture"] == "llama"
    assert "num_ctx" in show["parameters"] and f"FROM {smollm2_gguf}" in show["modelfile"]


def test_an_encoder_shows_only_the_embedding_capability(tmp_path: Path) -> None:
    facts = ModelFacts.from_gguf(GGUFFile(make_tiny_gguf("bert", tmp_path / "b.gguf").path))
    show = ollama_models.show(facts, "", 128)
    assert show["capabilities"] == ["embedding"] and show["template"] == ""


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (134_515_008, "134.52M"),
        (8_030_261_248, "8.0B"),
        (7_000_000_000, "7B"),
        (2_000_000, "2M"),
        (1500, "2K"),
        (12, "12"),
    ],
)
def test_parameter_size_as_ollama_writes_it(n, text) -> None:
    assert parameter_size(n) == text


def test_accelerated_share() -> None:
    assert accelerated_share([{"devices": ["cpu"], "layers": [0, 30]}]) == 0.0
    shards = [
        {"devices": ["cuda:0"], "layers": [0, 30]},
        {"devices": ["cpu"], "layers": "draft"},  # not a pipeline shard
    ]
    assert accelerated_share(shards) == 1.0 and accelerated_share([]) == 0.0


def test_context_drops_the_bos_of_a_file_that_asks_for_one(
    engine: Engine, gemma3_gguf: Path
) -> None:
    gemma = Engine(
        engine.target,
        Tokenizer.from_gguf(gemma3_gguf),
        ChatTemplate.from_gguf(gemma3_gguf, "gemma3"),
        model=ModelInfo(MODEL, CONTEXT),
    )
    alone = prepare_generate(gemma, {"prompt": "Hi"}).prompt
    assert alone[0] == gemma.tokenizer.bos_id
    after = prepare_generate(gemma, {"prompt": "Hi", "context": [alone[0], 9]}).prompt
    assert after == [alone[0], 9, *alone[1:]]  # one BOS, at the start
