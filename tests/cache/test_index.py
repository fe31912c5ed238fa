"""Radix index: exact matches on hand-built trees, a brute-force oracle, long prompts."""

from __future__ import annotations

import random
import time

import numpy as np
import pytest

from luced.cache.index import PrefixIndex, common_prefix


def lcp(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_longest_common_prefix_any_prefix_of_an_entry() -> None:
    idx = PrefixIndex()
    idx.insert("a", [1, 2, 3, 4, 5, 6])
    idx.insert("b", [1, 2, 3, 4, 9])
    idx.check()
    assert idx.longest([1, 2, 3, 4, 5, 7]) == ("a", 5)
    assert idx.longest([1, 2, 3, 4, 9, 9, 9]) == ("b", 5)
    assert idx.longest([1, 2, 3, 4, 5, 6, 7, 8]) == ("a", 6)
    assert idx.longest([1, 2]) in {("a", 2), ("b", 2)}
    assert idx.longest([7, 1, 2]) is None
    assert idx.longest([]) is None


def test_equal_matches_prefer_the_key_then_the_latest_insert() -> None:
    idx = PrefixIndex()
    idx.insert("old", [1, 2, 3, 10])
    idx.insert("new", [1, 2, 3, 20])
    assert idx.longest([1, 2, 3, 4]) == ("new", 3)  # default: latest insert
    rank = {"old": 5, "new": 1}
    assert idx.longest([1, 2, 3, 4], key=rank.__getitem__) == ("old", 3)
    # The key only breaks ties: a longer match wins whatever its rank.
    assert idx.longest([1, 2, 3, 20], key=rank.__getitem__) == ("new", 4)


def test_cuts_only_matches_end_at_recorded_cut_points() -> None:
    idx = PrefixIndex()
    idx.insert("a", [1, 2, 3, 4, 5, 6], cuts=[4])  # cuts {4, 6}
    idx.insert("b", [1, 2, 7, 7, 7], cuts=[2])  # cuts {2, 5}
    idx.check()
    assert idx.cuts("a").tolist() == [4, 6]
    assert idx.longest([1, 2, 3, 4, 5, 7], cuts_only=True) == ("a", 4)
    assert idx.longest([1, 2, 3, 4, 5, 6, 0], cuts_only=True) == ("a", 6)
    assert idx.longest([1, 2, 3, 4, 5, 6], cuts_only=True) == ("a", 6)
    # The prompt diverges from "a" before its first cut: "b" (branching off at 2) serves 2.
    assert idx.longest([1, 2, 3, 9], cuts_only=True) == ("b", 2)
    assert idx.longest([1, 2, 7, 7, 7], cuts_only=True) == ("b", 5)
    assert idx.longest([1, 2, 7, 7], cuts_only=True) == ("b", 2)
    assert idx.longest([1, 9], cuts_only=True) is None
    # Without cuts_only any common prefix counts.
    assert idx.longest([1, 2, 3, 9]) == ("a", 3)


def test_prefixes_lists_entries_contained_in_a_sequence() -> None:
    idx = PrefixIndex()
    idx.insert("s", [1, 2])
    idx.insert("m", [1, 2, 3, 4])
    idx.insert("x", [1, 2, 3, 5])
    idx.insert("l", [1, 2, 3, 4, 5, 6])
    assert sorted(idx.prefixes([1, 2, 3, 4, 5, 6, 7])) == [("l", 6), ("m", 4), ("s", 2)]
    assert idx.prefixes([1, 2, 3]) == [("s", 2)]
    assert idx.prefixes([2]) == []


def test_remove_recompresses_the_tree() -> None:
    idx = PrefixIndex()
    idx.insert("a", [1, 2, 3, 4, 5, 6])
    idx.insert("b", [1, 2, 3, 4, 9])
    idx.insert("c", [1, 2, 3])
    idx.check()
    idx.remove("c")
    idx.check()
    idx.remove("b")
    idx.check()
    assert idx.longest([1, 2, 3, 4, 9]) == ("a", 4)
    # One entry left: a single edge from the root.
    root_child = next(iter(idx._root.children.values()))
    assert root_child.label.tolist() == [1, 2, 3, 4, 5, 6] and not root_child.children
    idx.remove("a")
    idx.check()
    assert len(idx) == 0 and not idx._root.children and idx.longest([1, 2]) is None
    with pytest.raises(KeyError):
        idx.remove("a")


def test_duplicates_and_bad_input_are_rejected() -> None:
    idx = PrefixIndex()
    idx.insert("a", [1, 2, 3])
    with pytest.raises(KeyError):
        idx.insert("a", [4])
    with pytest.raises(ValueError):
        idx.insert("e", [])
    with pytest.raises(ValueError):
        idx.insert("c", [1, 2], cuts=[3])
    with pytest.raises(ValueError):
        idx.insert("c", [1, 2], cuts=[0])
    idx.insert("same", [1, 2, 3])  # another id, same tokens: both are kept
    assert {idx.longest([1, 2, 3])[0]} <= {"a", "same"}  # type: ignore[index]
    idx.check()
    # The index keeps its own copy: the caller's array may change afterwards.
    toks = np.array([5, 6, 7], dtype=np.int32)
    idx.insert("d", toks)
    toks[:] = 0
    assert idx.tokens("d").tolist() == [5, 6, 7] and idx.longest([5, 6]) == ("d", 2)


def test_common_prefix_in_chunks() -> None:
    a = np.arange(300_000, dtype=np.int32)
    for k in (0, 1, 63, 64, 65, 5000, 299_999):
        b = a.copy()
        b[k] = -1
        assert common_prefix(a, b) == k
    assert common_prefix(a, a) == len(a)
    assert common_prefix(a, a[:10]) == 10


def test_common_prefix_finds_where_two_lists_part() -> None:
    a = list(range(100_000))
    for k in (0, 1, 37, 99, 64, 50_000, 99_999):
        assert common_prefix(a, [*a[:k], -1, *a[k + 1 :]]) == k
    assert common_prefix(a, a[:40]) == 40 and common_prefix(a, a) == len(a)
    assert common_prefix([], a) == 0
    # A list against an array (either way round) takes the array path.
    arr = np.asarray(a, dtype=np.int32)
    assert common_prefix(a[:300], arr) == 300 and common_prefix(arr, [*a[:70], -1]) == 70


@pytest.mark.parametrize("cuts_only", [False, True])
def test_random_operations_match_brute_force(cuts_only: bool) -> None:
    rng = random.Random(1234 + cuts_only)
    idx = PrefixIndex()
    live: dict[str, tuple[list[int], set[int]]] = {}
    for step in range(1500):
        op = rng.random()
        if op < 0.45 or not live:
            base = list(rng.choice(list(live.values()))[0]) if live and rng.random() < 0.7 else []
            toks = base[: rng.randint(0, len(base))] + [
                rng.randint(0, 3) for _ in range(rng.randint(1, 12))
            ]
            cuts = {rng.randint(1, len(toks)) for _ in range(rng.randint(0, 3))}
            eid = f"e{step}"
            idx.insert(eid, toks, sorted(cuts))
            live[eid] = (toks, cuts | {len(toks)})
        elif op < 0.7:
            eid = rng.choice(sorted(live))
            idx.remove(eid)
            del live[eid]
        else:
            base = list(rng.choice(list(live.values()))[0])
            prompt = base[: rng.randint(0, len(base))] + [
                rng.randint(0, 3) for _ in range(rng.randint(0, 6))
            ]
            got = idx.longest(prompt, cuts_only=cuts_only)
            if cuts_only:
                best = max(
                    (
                        max((c for c in cuts if c <= lcp(t, prompt)), default=0)
                        for t, cuts in live.values()
                    ),
                    default=0,
                )
            else:
                best = max((lcp(t, prompt) for t, _ in live.values()), default=0)
            if best == 0:
                assert got is None
            else:
                assert got is not None and got[1] == best
                toks, cuts = live[got[0]]
                assert toks[:best] == prompt[:best]
                assert not cuts_only or best in cuts
        if step % 50 == 0:
            idx.check()
    idx.check()


def test_long_prompts_are_fast() -> None:
    rng = np.random.default_rng(0)
    shared = rng.integers(0, 50_000, size=40_000, dtype=np.int32)
    idx = PrefixIndex()
    t0 = time.perf_counter()
    for i in range(20):  # 20 entries of 50k tokens sharing a 40k system prefix
        tail = rng.integers(0, 50_000, size=10_000, dtype=np.int32)
        idx.insert(f"e{i}", np.concatenate([shared, tail]), cuts=[40_000])
    insert_s = time.perf_counter() - t0
    prompt = np.concatenate([idx.tokens("e7")[:45_000], rng.integers(0, 9, 5_000, dtype=np.int32)])
    prompt[45_000] = -1  # diverge right after 45k tokens
    t0 = time.perf_counter()
    for _ in range(20):
        assert idx.longest(prompt) == ("e7", 45_000)
        assert idx.longest(prompt, cuts_only=True)[1] == 40_000  # type: ignore[index]
    lookup_s = (time.perf_counter() - t0) / 40
    idx.check()
    # Generous bounds (shared 2-core machine); typical: ~2 ms per insert, ~0.2 ms per lookup.
    assert insert_s / 20 < 0.05, insert_s
    assert lookup_s < 0.02, lookup_s
