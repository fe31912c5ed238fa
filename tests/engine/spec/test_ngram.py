"""PromptLookup against a brute-force oracle: the continuation of the latest earlier
occurrence of the longest matching tail n-gram (n from max down to min), carried on
periodically past the sequence's end."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from luced.engine.spec.ngram import PromptLookup


def brute_force(seq: list[int], k: int, max_n: int, min_n: int) -> list[int]:
    for n in range(max_n, min_n - 1, -1):
        if len(seq) < n:
            continue
        tail = seq[len(seq) - n :]
        # Occurrences that end before the sequence does (so a continuation exists).
        for end in range(len(seq) - 1, n - 1, -1):
            if seq[end - n : end] == tail:
                # The sequence goes on as it did after `end`, predicted tokens included.
                ext = seq[:]
                while len(ext) < len(seq) + k:
                    ext.append(ext[end + len(ext) - len(seq)])
                return ext[len(seq) :]
    return []


@settings(max_examples=300, deadline=None)
@given(
    seq=st.lists(st.integers(0, 5), max_size=60),
    k=st.integers(0, 8),
    cut=st.integers(0, 60),
    sizes=st.sampled_from([(4, 2), (4, 1), (3, 3), (1, 1)]),
)
def test_matches_brute_force_however_the_sequence_arrives(seq, k, cut, sizes) -> None:
    lookup = PromptLookup(*sizes)
    lookup.extend(seq[:cut])  # the prompt, then token by token as generated
    for token in seq[cut:]:
        lookup.extend([token])
    assert lookup.tokens == seq
    assert lookup.propose(k) == brute_force(seq, k, *sizes)


def test_prefers_the_longest_then_the_latest_match() -> None:
    lookup = PromptLookup()
    #            0  1  2  3  4  5  6  7  8  9
    lookup.extend([1, 2, 3, 9, 2, 3, 8, 7, 2, 3])
    # Tail (2, 3): latest earlier occurrence ends at 6, continuation 8, 7, 2...
    assert lookup.propose(3) == [8, 7, 2]
    lookup.extend([1, 2, 3])  # tail (1, 2, 3): occurred at the start, continuation 9
    assert lookup.propose(2) == [9, 2]


def test_no_match_proposes_nothing() -> None:
    lookup = PromptLookup()
    assert lookup.propose(4) == []
    lookup.extend([5, 6, 7])
    assert lookup.propose(4) == []
    lookup.extend([5, 8, 7])  # 7 occurred before, but a 1-gram is below the default min 2
    assert lookup.propose(4) == []
    assert PromptLookup(min_ngram=1).propose(4) == []


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="n-gram sizes"):
        PromptLookup(max_ngram=2, min_ngram=3)


def test_a_loop_is_proposed_past_the_sequence_end() -> None:
    lookup = PromptLookup()
    lookup.extend([7, 1, 2, 3, 1, 2, 3])  # tail (1, 2, 3) ended at 4: continuation 1, 2, 3
    assert lookup.propose(8) == [1, 2, 3, 1, 2, 3, 1, 2]


def test_kind_tells_a_copy_under_way_from_a_fresh_match() -> None:
    lookup = PromptLookup()
    lookup.extend([1, 2, 3, 4, 5, 6, 7, 8, 9, 9, 1, 2])
    assert lookup.kind() == "n2"
    assert lookup.propose(3) == [3, 4, 5]
    lookup.extend([3, 4, 5, 6])  # all three accepted, and the target's own 6
    assert lookup.kind() == "run"
    assert lookup.propose(2) == [7, 8]
    lookup.extend([7, 0])  # the second was rejected
    assert lookup.kind() is None  # (7, 0) never occurred
    lookup.extend([3, 4, 5])  # (0, 3, 4, 5) is new, (3, 4, 5) occurred twice
    assert lookup.kind() == "n3"
    assert lookup.propose(1) == [6]
