"""A reply's usage over its choices: each prompt counted once, as OpenAI bills n choices."""

from __future__ import annotations

from luced.api.choices import reply_usage
from luced.engine.core import GenerationRequest, RequestHandle
from luced.sampling_params import SamplingParams


def handle(prompt: int, completion: int, cached: int = 0, drafts: int = 0) -> RequestHandle:
    h = RequestHandle(GenerationRequest("r", [1] * prompt, SamplingParams()), 16)
    h.completion_tokens, h.cached_tokens = completion, cached
    h.spec = {"drafts": drafts, "draft_tokens": 4 * drafts, "accepted_tokens": 2 * drafts}
    return h


def test_each_prompt_counts_once_and_every_choice_its_tokens() -> None:
    # Two prompts (10 and 4 tokens) × n = 2: their later choices shared the prompt (cached).
    handles = [handle(10, 3, 2), handle(10, 5, 9), handle(4, 1), handle(4, 2, 3, drafts=1)]
    assert reply_usage(handles, 2) == {
        "prompt_tokens": 14,
        "completion_tokens": 11,
        "total_tokens": 25,
        "prompt_tokens_details": {"cached_tokens": 2},
        "speculative": {"drafts": 1, "draft_tokens": 4, "accepted_tokens": 2},
    }
    assert reply_usage(handles[:1], 1) == {
        "prompt_tokens": 10,
        "completion_tokens": 3,
        "total_tokens": 13,
        "prompt_tokens_details": {"cached_tokens": 2},
    }
