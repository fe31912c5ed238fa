"""Which lanes hold which prompt prefixes, found by block hash: a new prompt's longest
prefix held by a running sequence or a kept finished one, in time proportional to the
blocks it matches, however many lanes there are.

A lane's tokens are cut into blocks of BLOCK; block i's key is the hash of block i-1's
key and block i's tokens, so a key names a whole prefix, as in vLLM's prefix caching.
`longest` walks the prompt's keys while some lane holds them, then compares tokens only
with the lanes holding the last key found, within the next block (sharing splits a
block: copy-on-write), and the whole match once, so a hash collision can never share a
wrong row.

It runs on the event loop at each admission and, each step, for each sequence waiting
to share: comparing the prompt with every lane instead grew with lanes times prompt
length (docs/performance.md, "Finished requests' blocks against the prefix cache").
"""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass, field

from luced.cache.index import common_prefix

# Tokens per hashed block: a match is found to the block, then extended to the token.
BLOCK = 16


@dataclass
class _Held:
    tokens: list[int]  # the lane's tokens (a prefix of them is held)
    n: int  # positions held
    keys: list[int] = field(default_factory=list)  # one per whole block of [0, n)


class PrefixBlocks:
    def __init__(self) -> None:
        self._holders: dict[int, set[int]] = {}  # block key -> lanes holding that prefix
        self._lanes: dict[int, _Held] = {}

    @property
    def lanes(self) -> list[int]:
        return list(self._lanes)

    def tokens(self, lane: int) -> list[int]:
        """The tokens `lane` was last held with (the K/V of their first n is held)."""
        return self._lanes[lane].tokens

    def hold(self, lane: int, tokens: list[int], n: int) -> None:
        """`lane` holds the K/V of tokens[:n]. The same list again with n grown indexes
        only the new blocks; other tokens (the lane's next sequence) start over."""
        held = self._lanes.get(lane)
        if held is None or held.tokens is not tokens or n < held.n:
            self.drop(lane)
            held = self._lanes[lane] = _Held(tokens, 0)
        held.n = n
        keys = held.keys
        while (len(keys) + 1) * BLOCK <= n:
            i = len(keys)
            key = hash((keys[-1] if keys else 0, *tokens[i * BLOCK : (i + 1) * BLOCK]))
            keys.append(key)
            self._holders.setdefault(key, set()).add(lane)

    def drop(self, lane: int) -> None:
        held = self._lanes.pop(lane, None)
        if held is None:
            return
        for key in held.keys:
            lanes = self._holders[key]
            lanes.discard(lane)
            if not lanes:
                del self._holders[key]

    def keep_only(self, lanes: set[int]) -> None:
        """Forget every lane but these (the ones whose sequences went away)."""
        for lane in self._lanes.keys() - lanes:
            self.drop(lane)

    def longest(self, prompt: list[int], among: Container[int] | None = None) -> tuple[int, int]:
        """The lane (of `among`, default any) holding the longest prefix of `prompt` ->
        (lane, length), or (-1, 0); the lowest lane of equals."""
        found = {lane for lane in self._lanes if among is None or lane in among}
        key, i = 0, 0
        while (i + 1) * BLOCK <= len(prompt):
            key = hash((key, *prompt[i * BLOCK : (i + 1) * BLOCK]))
            holders = self._holders.get(key, set()) & found
            if not holders:
                break
            found, i = holders, i + 1
        best = (-1, 0)
        start = i * BLOCK
        end = start + BLOCK  # a match past this would have matched one more key
        for lane in found:
            held = self._lanes[lane]
            n = start + common_prefix(prompt[start:end], held.tokens[start : min(held.n, end)])
            if n > best[1] or (n == best[1] and best[0] >= 0 and lane < best[0]):
                best = (lane, n)
        lane, n = best
        if n and prompt[:n] != self._lanes[lane].tokens[:n]:  # a hash collision
            return -1, 0
        return best
