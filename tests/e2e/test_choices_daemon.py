"""OpenAI's n choices and lists of prompts on the real daemon, with the official `openai`
client: each choice of a prompt in its place (index = prompt * n + choice), seeded
choices reproducible and different, streamed choices interleaved, usage counting each
prompt once, the choices sharing their prompt's KV blocks, and a reply's choices queued
all or none and cancelled together."""

from __future__ import annotations

import json
import threading
import time
from collections import defaultdict

import openai
import pytest
from daemon_proc import DaemonProcess
from test_daemon import long_stream, raw_post

MODEL = "SmolLM2-135M-Instruct.Q4_1"
USER = [{"role": "user", "content": "Write one sentence about the sea."}]
SAMPLED = {"temperature": 1.0, "top_p": 0.95, "max_tokens": 12}


def chat(client: openai.OpenAI, **kw):
    return client.chat.completions.create(model=MODEL, messages=USER, **kw)


def contents(reply) -> list[str]:
    assert [c.index for c in reply.choices] == list(range(len(reply.choices)))
    return [c.message.content for c in reply.choices]


def shared_tokens(d: DaemonProcess) -> float:
    return d.metric("luced:prefix_shared_tokens_total")


def test_greedy_choices_are_one_reply_n_times_and_share_the_prompt(smol, client) -> None:
    """n = 3 greedy: three identical choices, the prompt counted once in usage, computed
    once (the two later choices share its blocks: all but its last token each). The first
    choice takes them from the n = 1 request before, whose prompt blocks were kept."""
    one = chat(client, temperature=0, max_tokens=12)
    before = shared_tokens(smol)
    kept_before = smol.metric("luced:prefix_kept_tokens_total")
    three = chat(client, temperature=0, max_tokens=12, n=3)
    assert contents(three) == [one.choices[0].message.content] * 3
    assert {c.finish_reason for c in three.choices} == {one.choices[0].finish_reason}
    assert three.usage.prompt_tokens == one.usage.prompt_tokens
    assert three.usage.completion_tokens == 3 * one.usage.completion_tokens
    assert three.usage.total_tokens == three.usage.prompt_tokens + three.usage.completion_tokens
    assert shared_tokens(smol) - before == 3 * (one.usage.prompt_tokens - 1)
    kept = smol.metric("luced:prefix_kept_tokens_total") - kept_before
    assert kept == one.usage.prompt_tokens - 1


def test_seeded_choices_are_reproducible_and_differ(client) -> None:
    """Choice j samples with seed + j: the reply repeats, its choices differ, and choice
    j is what n = 1 with seed + j gives."""
    first = contents(chat(client, **SAMPLED, n=3, seed=1234))
    assert contents(chat(client, **SAMPLED, n=3, seed=1234)) == first
    assert len(set(first)) > 1
    for j in range(3):
        assert contents(chat(client, **SAMPLED, seed=1234 + j)) == [first[j]]


def test_streamed_choices_interleave_and_match_the_reply(client) -> None:
    """Streaming n = 3: every chunk names its choice; each choice gets its role chunk, its
    text and one finish chunk; the usage comes once, last, equal to the whole reply's."""
    whole = chat(client, **SAMPLED, n=3, seed=99, logprobs=True)
    stream = chat(
        client,
        **SAMPLED,
        n=3,
        seed=99,
        logprobs=True,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text, roles, finishes, tokens = defaultdict(str), defaultdict(int), {}, defaultdict(list)
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        text[choice.index] += choice.delta.content or ""
        roles[choice.index] += choice.delta.role == "assistant"
        if choice.finish_reason is not None:
            assert choice.index not in finishes
            finishes[choice.index] = choice.finish_reason
        if choice.logprobs is not None:
            tokens[choice.index] += [t.token for t in choice.logprobs.content]
    assert [text[k] for k in range(3)] == contents(whole)
    assert dict(roles) == {0: 1, 1: 1, 2: 1}
    assert finishes == {c.index: c.finish_reason for c in whole.choices}
    for c in whole.choices:  # logprobs per choice, streamed with its own text
        assert tokens[c.index] == [t.token for t in c.logprobs.content]
        assert "".join(tokens[c.index]) == c.message.content
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage


def test_choices_under_a_grammar_each_follow_it(client) -> None:
    """Structured output with n = 3 seeded: each choice is built under its own matcher."""
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "string", "enum": ["yes", "no", "maybe"]}},
        "required": ["answer"],
        "additionalProperties": False,
    }
    reply = chat(
        client,
        **{**SAMPLED, "max_tokens": 40},
        n=3,
        seed=5,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
    )
    for text in contents(reply):
        assert json.loads(text)["answer"] in ("yes", "no", "maybe")
    assert {c.finish_reason for c in reply.choices} == {"stop"}


def test_a_list_of_prompts_times_n(client) -> None:
    """Two prompts × n = 2: choice i * 2 + j is prompt i's choice j (seed + j); usage
    counts each prompt once."""
    prompts = ["The capital of France is", "My favourite colour is"]
    kw = {"model": MODEL, "max_tokens": 6, "temperature": 1.0, "seed": 7, "logprobs": 1}
    both = client.completions.create(prompt=prompts, n=2, **kw)
    assert [c.index for c in both.choices] == [0, 1, 2, 3]
    alone = [
        client.completions.create(prompt=p, **{**kw, "seed": 7 + j})
        for p in prompts
        for j in (0, 1)
    ]
    assert [c.text for c in both.choices] == [a.choices[0].text for a in alone]
    for c in both.choices:
        assert "".join(c.logprobs.tokens) == c.text
    assert both.usage.prompt_tokens == alone[0].usage.prompt_tokens + alone[2].usage.prompt_tokens
    assert both.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    # Token-id prompts, a list of them, in the same order.
    ids = client.completions.create(prompt=[[504, 3575], [1431]], n=2, max_tokens=2, model=MODEL)
    assert [c.index for c in ids.choices] == [0, 1, 2, 3] and ids.usage.prompt_tokens == 3


def test_too_many_choices_are_a_400_naming_the_field(client) -> None:
    """The default queue takes 16 requests: every choice is one."""
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, n=17)
    assert info.value.body["param"] == "n" and "--max-queue" in info.value.message
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=["a"] * 5, n=4)
    assert info.value.body["param"] == "prompt" and "20 choices" in info.value.message
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, n=129)
    assert info.value.body["param"] == "n"


def test_a_client_that_goes_away_cancels_every_choice(smol, client) -> None:
    aborted = smol.metric("luced:request_success_total", 'finished_reason="abort"')
    stream = chat(
        client, max_tokens=400, n=3, stream=True, temperature=0, extra_body={"ignore_eos": True}
    )
    seen = set()
    for chunk in stream:
        seen |= {c.index for c in chunk.choices if c.delta.content}
        if len(seen) == 3:
            break
    stream.close()
    deadline = time.monotonic() + 30
    while smol.lucectl_json("status")["queue"]["running"]:
        assert time.monotonic() < deadline, "the choices ran on"
        time.sleep(0.05)
    assert smol.metric("luced:request_success_total", 'finished_reason="abort"') == aborted + 3


def post(d: DaemonProcess, body: dict) -> tuple[int, dict]:
    status, _, reply = raw_post(d, "/v1/completions", json.dumps(body).encode())
    return status, reply


def test_a_replys_choices_queue_all_or_none(tiny_gguf, tmp_path) -> None:
    """A queue of 3 with 2 waiting: a reply of 2 choices does not fit, and none of it
    stays queued (429); the waiting ones then run as usual."""
    d = DaemonProcess(tiny_gguf, tmp_path, "--max-queue", "3", "--max-running", "1").start()
    try:
        running = long_stream(d)
        next(iter(running))
        waiting: list = []
        body = {"prompt": "d e", "max_tokens": 2, "n": 2}
        queued = threading.Thread(target=lambda: waiting.append(post(d, body)), daemon=True)
        queued.start()
        deadline = time.monotonic() + 20
        while d.lucectl_json("status")["queue"]["waiting"] < 2:
            assert time.monotonic() < deadline, "the first reply never queued"
            time.sleep(0.02)
        status, err = post(d, {"prompt": "f g", "max_tokens": 2, "n": 2})
        assert status == 429 and err["error"]["code"] == "queue_full"
        assert d.lucectl_json("status")["queue"]["waiting"] == 2
        running.close()
        queued.join(60)
        ((status, reply),) = waiting
        assert status == 200 and [c["index"] for c in reply["choices"]] == [0, 1]
    finally:
        assert d.stop() == 0
    assert d.segments() == []
