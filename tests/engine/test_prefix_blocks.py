"""The block-hash index of held prefixes (engine/kv/prefix_blocks.py) against its oracle:
the longest common prefix by comparing the prompt with every lane's held tokens."""

from __future__ import annotations

import random

from luced.cache.index import common_prefix
from luced.engine.kv.prefix_blocks import BLOCK, PrefixBlocks


def oracle(lanes: dict[int, tuple[list[int], int]], prompt: list[int]) -> tuple[int, int]:
    best = (-1, 0)
    for lane in sorted(lanes):
        tokens, n = lanes[lane]
        k = min(common_prefix(prompt, tokens), n)
        if k > best[1]:
            best = (lane, k)
    return best


def test_longest_equals_comparing_with_every_lane() -> None:
    rng = random.Random(3)
    system = [rng.randrange(1000) for _ in range(70)]
    for trial in range(200):
        index, lanes = PrefixBlocks(), {}
        for lane in rng.sample(range(80), rng.randrange(1, 12)):
            cut = rng.randrange(0, len(system) + 1)
            tokens = system[:cut] + [rng.randrange(1000) for _ in range(rng.randrange(0, 60))]
            n = rng.randrange(0, len(tokens) + 1)  # computed so far
            lanes[lane] = (tokens, n)
            index.hold(lane, tokens, n)
        prompt = system[: rng.randrange(0, len(system) + 1)] + [rng.randrange(1000)] * 5
        assert index.longest(prompt) == oracle(lanes, prompt), trial


def test_a_lane_grows_changes_and_goes() -> None:
    tokens = list(range(100, 200))
    index = PrefixBlocks()
    index.hold(7, tokens, 10)  # its prefill has computed 10 positions
    assert index.longest(tokens) == (7, 10)
    index.hold(7, tokens, 3 * BLOCK + 5)  # 40 more: only the new blocks are hashed
    assert index.longest(tokens) == (7, 3 * BLOCK + 5)
    assert index.longest(tokens, among={8}) == (-1, 0)
    other = [*tokens[:20], 0, *tokens[21:]]
    index.hold(7, other, 60)  # the slot's next sequence
    assert index.longest(tokens) == (7, 20) and index.tokens(7) is other
    index.hold(9, tokens, 100)
    index.keep_only({9})
    assert index.lanes == [9] and index.longest(tokens[:50]) == (9, 50)
    index.drop(9)
    assert index.longest(tokens) == (-1, 0)


def test_a_hash_collision_shares_nothing() -> None:
    index = PrefixBlocks()
    index.hold(1, list(range(40)), 40)
    held = index._lanes[1]
    held.tokens = [*held.tokens[:30], -1, *held.tokens[31:]]  # keys no longer match tokens
    assert index.longest(list(range(40))) == (-1, 0)
