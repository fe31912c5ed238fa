"""In-process generation over one whole model: prefill, then sample token by token.

This is the runtime measured alone (tools/generate.py, tools/bench_runtime.py, parity
tests). The daemon runs its own loop over workers; both use the same Model and Sampler.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from luced.runtime.model import Model
from luced.runtime.sampler import Sampler
from luced.sampling_params import SamplingParams


@dataclass
class Generation:
    tokens: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    finish_reason: str = "length"  # "stop" when an end-of-sequence token was produced
    ttft_s: float = 0.0  # prefill + first token
    decode_s: float = 0.0  # every later token

    @property
    def decode_tok_s(self) -> float:
        later = len(self.tokens) - 1
        return later / self.decode_s if later > 0 and self.decode_s > 0 else 0.0


@torch.inference_mode()
def generate(
    model: Model,
    prompt: list[int],
    params: SamplingParams,
    max_tokens: int,
    eos_ids: Iterable[int] = (),
    on_token: Callable[[int], None] | None = None,
) -> Generation:
    if not prompt:
        raise ValueError("the prompt must hold at least one token")
    stops = set(eos_ids)
    sampler = Sampler(params)
    cache = model.new_cache(min(model.cfg.context_length, len(prompt) + max_tokens))
    history = list(prompt)
    result = Generation(prompt_tokens=len(prompt))
    t0 = time.perf_counter()
    logits = model.forward(torch.tensor(prompt), cache, 0)[-1:]
    t_first = t0
    for step in range(max_tokens):
        token = int(sampler.sample(logits, [history]).tokens[0])
        if step == 0:
            t_first = time.perf_counter()
            result.ttft_s = t_first - t0
        if token in stops:
            result.finish_reason = "stop"
            break
        result.tokens.append(token)
        history.append(token)
        if on_token is not None:
            on_token(token)
        if step + 1 < max_tokens:
            logits = model.forward(torch.tensor([token]), cache, len(history) - 1)
    result.decode_s = time.perf_counter() - t_first
    return result
