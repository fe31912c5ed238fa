"""luced.text.reasoning: a reply's thinking and answer, whole or streamed in any pieces."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from luced.text.chat_template import CHATML_TEMPLATE, ChatTemplate
from luced.text.reasoning import THINKING, ThinkSplitter, opens_thinking, split, thinks


@pytest.mark.parametrize(
    ("text", "opened", "want"),
    [
        ("<think>\nA plan.\n</think>\n\nThe answer.", False, ("A plan.", "The answer.")),
        ("\n<think>x</think>y", False, ("x", "y")),
        ("<think>\n\n</think>\n\nHi", False, ("", "Hi")),  # thought nothing
        ("Just text.", False, ("", "Just text.")),  # a reply that never thought
        ("  <b>bold</b>", False, ("", "  <b>bold</b>")),
        ("<think>cut short by max_tokens\n", False, ("cut short by max_tokens", "")),
        ("<thi", False, ("", "<thi")),  # a marker that never completed is text
        ("A plan.\n</think>\n\nThe answer.", True, ("A plan.", "The answer.")),  # R1-style
        ("x <think> y", False, ("", "x <think> y")),  # only a leading marker opens
        ("<think>a</think>b</think>c", False, ("a", "b</think>c")),
    ],
)
def test_split(text: str, opened: bool, want: tuple[str, str]) -> None:
    assert split(text, opened) == want


REPLIES = st.sampled_from(
    [
        "<think>\nFirst, 2 + 2.\nThat is 4.\n</think>\n\nIt is 4.",
        "\n<think>\n\n</think>\n\nHello there <think> friend",
        "<think>never closed </thi",
        "Plain answer with </think> in it.",
        "  \n",
        "<think>a\n\n\n</think>",
    ]
)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(text=REPLIES, cuts=st.lists(st.integers(0, 60), max_size=12), opened=st.booleans())
def test_a_stream_splits_as_the_whole_reply(text: str, cuts: list[int], opened: bool) -> None:
    """However the deltas cut the markers, the pieces join to what `split` gives, and no
    piece is empty."""
    points = sorted({min(c, len(text)) for c in cuts})
    deltas = [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]
    splitter = ThinkSplitter(opened)
    pieces = [p for d in deltas for p in splitter.push(d)] + splitter.end()
    assert all(piece for _, piece in pieces)
    thinking = "".join(t for kind, t in pieces if kind == THINKING)
    answer = "".join(t for kind, t in pieces if kind != THINKING)
    assert (thinking, answer) == split(text, opened)
    # Thinking comes first: no thinking piece after the first answer piece.
    kinds = [kind for kind, _ in pieces]
    assert kinds == sorted(kinds, key=lambda k: k != THINKING)


def test_which_templates_think() -> None:
    qwen3_like = "{%- if '</think>' in content %}{%- set content = content.split('</think>')[-1] %}"
    assert thinks(ChatTemplate(qwen3_like + "{%- endif %}"))
    assert not thinks(ChatTemplate(CHATML_TEMPLATE))
    assert opens_thinking("<|im_start|>assistant\n<think>\n")
    assert not opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")
