"""Every family served over HTTP with the default flags.

For each decoder family, `luced serve` on its tiny GGUF (the harness adds only
`--threads 1`) answers a completion of token ids with the runtime's greedy continuation of
the same ids, token by token. The daemons start one after another, each stopped (and its
shared memory gone) before the next. The heads are untied: a tiny random model with a tied
head echoes its last prompt token, which a broken forward would echo too.
"""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
import torch
from daemon_proc import DaemonProcess

from luced.runtime.generate import generate
from luced.runtime.model import Model
from luced.runtime.tiny import DECODERS, make_tiny_gguf
from luced.sampling_params import SamplingParams
from luced.text.tokenizer import Tokenizer

PROMPT = [300, 12, 77, 140, 9, 201]
MAX_TOKENS = 8


def runtime_greedy(path: Path) -> list[int]:
    """The runtime's greedy tokens, the weights held as `luced serve` holds them by default,
    on one thread like the daemon's worker."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = Model.load(path, weights="auto")
        return generate(model, PROMPT, SamplingParams(temperature=0.0), MAX_TOKENS).tokens
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("family", DECODERS)
def test_default_daemon_answers_the_runtimes_greedy_tokens(family: str, tmp_path: Path) -> None:
    path = make_tiny_gguf(family, tmp_path / f"tiny-{family}.gguf", seed=1, tied=False).path
    want = runtime_greedy(path)
    tokenizer = Tokenizer.from_gguf(path)
    d = DaemonProcess(path, tmp_path).start()
    try:
        client = openai.OpenAI(base_url=f"{d.url}/v1", api_key="x", max_retries=0, timeout=120)
        out = client.completions.create(
            model=d.model_name,
            prompt=PROMPT,
            max_tokens=MAX_TOKENS,
            temperature=0,
            logprobs=0,  # the chosen token of each step
            extra_body={"ignore_eos": True},
        )
    finally:
        assert d.stop() == 0
    assert d.segments() == []
    choice = out.choices[0]
    pieces = [tokenizer.token_bytes(t).decode("utf-8", errors="replace") for t in want]
    assert choice.logprobs is not None and choice.logprobs.tokens == pieces
    assert choice.text == tokenizer.decode(want)
    assert choice.finish_reason == "length" and out.usage.completion_tokens == MAX_TOKENS
