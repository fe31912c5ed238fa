"""Stop strings across token boundaries: nothing of a stop, or after it, is ever released."""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from luced.text.stops import StopMatcher


def run(pieces: list[str], stops: list[str]) -> tuple[str, bool]:
    m = StopMatcher(stops)
    out, hit = "", False
    for p in pieces:
        text, hit = m.push(p)
        out += text
        if hit:
            return out, True
    return out + m.flush(), False


def test_stop_split_across_tokens() -> None:
    assert run(["Hello", "\n", "\nUs", "er: hi"], ["\n\nUser:"]) == ("Hello", True)


def test_partial_prefix_released_when_it_diverges() -> None:
    m = StopMatcher(["###"])
    assert m.push("a#") == ("a", False)
    assert m.push("#b") == ("##b", False)
    assert m.flush() == ""


def test_earliest_stop_wins_and_text_after_is_dropped() -> None:
    assert run(["x END y STOP z"], ["STOP", "END"]) == ("x ", True)


def test_held_text_is_flushed_at_the_end() -> None:
    assert run(["abc", "#"], ["##"]) == ("abc#", False)


def test_no_stops_passes_through() -> None:
    assert run(["a", "b"], []) == ("ab", False)


@given(
    text=st.text(alphabet="ab#\n", max_size=40),
    cuts=st.lists(st.integers(0, 40), max_size=8),
    stop=st.text(alphabet="ab#\n", min_size=1, max_size=4),
)
def test_any_split_equals_whole_string_semantics(text: str, cuts: list[int], stop: str) -> None:
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    pieces = [text[a:b] for a, b in itertools.pairwise(bounds)]
    i = text.find(stop)
    expected = (text[:i], True) if i >= 0 else (text, False)
    assert run(pieces, [stop]) == expected
