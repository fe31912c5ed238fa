"""DFlash through the real daemon: greedy speculative output == plain greedy output.

A random draft is a poor proposer (acceptance near zero), which is exactly what makes
the equality test sharp: every block is mostly rejected and rolled back, so any slip in
the verify / accept / KV-rollback / ring bookkeeping changes the text.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from daemon_proc import DaemonProcess
from test_daemon import raw_post

from luced.runtime.tiny import make_tiny_draft, make_tiny_gguf


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("dflash")
    target = root / "tiny-qwen3.gguf"
    make_tiny_gguf("qwen3", target, seed=7, layers=8, context=2048)
    _, draft_gguf, _ = make_tiny_draft(target, root / "draft", seed=3, block_size=4)
    return target, draft_gguf


def complete(d: DaemonProcess, prompt: str, **kw) -> dict:
    body = {"prompt": prompt, "temperature": 0, "ignore_eos": True, **kw}
    status, _, reply = raw_post(d, "/v1/completions", json.dumps(body).encode())
    assert status == 200, reply
    return reply


PROMPTS = ["hello world, this is", "the quick brown fox"]


@pytest.fixture(scope="module")
def plain_texts(tiny_pair, tmp_path_factory) -> dict[str, str]:
    target, _ = tiny_pair
    d = DaemonProcess(target, tmp_path_factory.mktemp("plain")).start()
    try:
        return {p: complete(d, p, max_tokens=40)["choices"][0]["text"] for p in PROMPTS}
    finally:
        assert d.stop() == 0


@pytest.mark.parametrize("block_size", [2, 4, 16])
def test_speculative_greedy_equals_plain(tiny_pair, plain_texts, block_size, tmp_path) -> None:
    target, draft = tiny_pair
    d = DaemonProcess(
        target, tmp_path, "--draft", str(draft), "--block-size", str(block_size)
    ).start()
    try:
        for prompt, plain in plain_texts.items():
            reply = complete(d, prompt, max_tokens=40)
            assert reply["choices"][0]["text"] == plain
            spec = reply["usage"]["speculative"]
            assert spec["draft_tokens"] <= spec["drafts"] * (block_size - 1)
            assert 0 <= spec["accepted_tokens"] <= spec["draft_tokens"]
        # max_tokens landing inside a block: exactly that many tokens, a prefix of plain.
        short = complete(d, PROMPTS[0], max_tokens=7)
        assert short["usage"]["completion_tokens"] == 7
        assert plain_texts[PROMPTS[0]].startswith(short["choices"][0]["text"])
        # A stop string inside a block: the text up to it, nothing after.
        plain = plain_texts[PROMPTS[1]]
        stop = plain[len(plain) // 2 : len(plain) // 2 + 3]
        stopped = complete(d, PROMPTS[1], max_tokens=40, stop=[stop])
        assert stopped["choices"][0]["text"] == plain[: plain.index(stop)]
        assert stopped["choices"][0]["finish_reason"] == "stop"
        # The draft was used: one draft per verify step, block_size - 1 tokens each.
        drafts = d.metric("luced:spec_decode_num_drafts_total")
        assert drafts > 0
        assert d.metric("luced:spec_decode_num_draft_tokens_total") <= drafts * (block_size - 1)
        status = d.lucectl_json("status")
        assert status["mean_acceptance_length"] >= 1
        # Sampled requests decode speculatively (rejection sampling), seeded = repeatable.
        sampled = [complete(d, PROMPTS[0], max_tokens=12, temperature=0.7, seed=1) for _ in "ab"]
        assert sampled[0]["choices"][0]["text"] == sampled[1]["choices"][0]["text"]
        assert sampled[0]["usage"]["speculative"]["drafts"] > 0
        # Logprobs and penalties are honoured inside blocks too: still speculative.
        with_logprobs = complete(d, PROMPTS[0], max_tokens=9, logprobs=2, frequency_penalty=0.5)
        assert len(with_logprobs["choices"][0]["logprobs"]["token_logprobs"]) == 9
        assert with_logprobs["usage"]["speculative"]["drafts"] > 0
    finally:
        assert d.stop() == 0
    assert d.segments() == []


def test_split_target_with_the_draft_in_its_own_worker(tiny_pair, plain_texts, tmp_path) -> None:
    target, draft = tiny_pair
    d = DaemonProcess(
        target,
        tmp_path,
        *("--target-devices", "cpu,cpu:1", "--draft", str(draft), "--draft-device", "cpu:2"),
    ).start()
    try:
        for prompt, plain in plain_texts.items():
            assert complete(d, prompt, max_tokens=40)["choices"][0]["text"] == plain
        workers = d.lucectl_json("workers")["workers"]
        assert [w["group"] for w in workers] == ["cpu", "cpu:1", "cpu:2"]
        assert workers[-1]["role"] == "draft" and workers[-1]["layers"] == "draft"
        assert d.metric("luced:spec_decode_num_drafts_total") > 0
    finally:
        assert d.stop() == 0
    assert d.segments() == []


def test_a_restart_restores_a_prompt_with_its_features(tiny_pair, tmp_path) -> None:
    """Several running requests (the default) and the prefix cache on disk: the prompt's
    whole K/V blocks are kept with their feature-ring rows (a part of their own), and a
    restarted daemon restores both: the same text and the same speculative counts as the
    daemon that computed the prompt (fixed blocks: measured costs would vary)."""
    target, draft = tiny_pair
    kv = tmp_path / "kv"
    args = ("--draft", str(draft), "--block-size", "4", "--adaptive-block-size", "false")
    args += ("--kv-cache-dir", str(kv))
    prompt = "the quick brown fox jumps over the lazy dog, " * 8
    d = DaemonProcess(target, tmp_path / "one", *args).start()
    try:
        first = complete(d, prompt, max_tokens=24)
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert d.lucectl_json("snapshot", "save")["saved"] == 0  # waits for the writes
    finally:
        assert d.stop() == 0
    n = first["usage"]["prompt_tokens"]
    (rings,) = kv.glob("*/blocks/ring-*")  # kv/<model fingerprint>/blocks/<the rows' part>
    assert len(list(rings.glob("*.kvb"))) == n // 16
    d = DaemonProcess(target, tmp_path / "two", *args).start()
    try:
        again = complete(d, prompt, max_tokens=24)
    finally:
        assert d.stop() == 0
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == (n - 1) // 16 * 16
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
    assert again["usage"]["speculative"] == first["usage"]["speculative"]
    assert d.segments() == []


def test_draft_for_another_target_is_a_startup_error(tiny_pair, tmp_path) -> None:
    target, _ = tiny_pair
    other = tmp_path / "other.gguf"
    make_tiny_gguf("llama", other, seed=1, hidden=96)
    _, wrong, _ = make_tiny_draft(other, tmp_path / "wrong")
    d = DaemonProcess(target, tmp_path, "--draft", str(wrong))
    with pytest.raises(RuntimeError, match=r"--draft .*hidden"):
        d.start(timeout=60)


@pytest.mark.real_model
@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
def test_real_models_with_a_random_draft(model, request, tmp_path) -> None:
    target = request.getfixturevalue(f"{model}_gguf")
    _, draft, _ = make_tiny_draft(target, tmp_path / "draft", seed=2, block_size=4)
    prompt = "The history of the printing press"
    plain = DaemonProcess(target, tmp_path / "plain").start()
    try:
        expected = complete(plain, prompt, max_tokens=32)["choices"][0]["text"]
    finally:
        assert plain.stop() == 0
    spec = DaemonProcess(target, tmp_path / "spec", "--draft", str(draft), "--block-size", "4")
    spec.start()
    try:
        assert complete(spec, prompt, max_tokens=32)["choices"][0]["text"] == expected
        assert spec.metric("luced:spec_decode_num_drafts_total") > 0
    finally:
        assert spec.stop() == 0
    assert spec.segments() == []


def test_ngram_lookup_greedy_equals_plain(tiny_pair, plain_texts, tmp_path) -> None:
    """--draft ngram: no draft model, no draft worker; adaptive block sizes (the default)
    report what they used. The text is plain decoding's."""
    target, _ = tiny_pair
    d = DaemonProcess(target, tmp_path, "--draft", "ngram", "--block-size", "8").start()
    try:
        for prompt, plain in plain_texts.items():
            assert complete(d, prompt, max_tokens=40)["choices"][0]["text"] == plain
        status = d.lucectl_json("status")
        assert [w.get("role") for w in status["placement"]].count("draft") == 0
        assert sum(status["block_sizes"].values()) > 0
        assert d.metric("luced:spec_decode_block_size_count") == sum(status["block_sizes"].values())
        sampled = [complete(d, PROMPTS[0], max_tokens=12, temperature=0.7, seed=1) for _ in "ab"]
        assert sampled[0]["choices"][0]["text"] == sampled[1]["choices"][0]["text"]
    finally:
        assert d.stop() == 0
