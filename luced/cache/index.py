"""Radix tree over token ids: which cached snapshot shares the longest prefix with a prompt.

Pure bookkeeping (numpy int32 arrays, no tensors, no I/O). Every entry is a token sequence
with an id; the tree merges their common prefixes. Edges carry their token labels as int32
arrays (views of the entries' own token arrays), so a 100k-token entry costs one array, not
100k Python objects. Lookups compare tokens (numpy, in growing chunks), never hashes.

    root ─[1 2 3 4]─ n1 ─[5 6]─ n2      entry A = 1 2 3 4 5 6   (ends at n2)
                      └─[9]──── n3      entry B = 1 2 3 4 9     (ends at n3)

Two ways to reuse an entry for a prompt:

* any prefix (attention-only models: K/V rows ``[0, m)`` of a longer snapshot are the K/V of
  its first m tokens): the match is the longest common prefix of the prompt with any entry;
  above, prompt ``1 2 3 4 5 7`` matches A with 5 tokens.
* exact cut points (recurrent state exists only where the snapshot was taken): each entry
  records its cuts (always including its own length); the match is the largest cut ``c`` of
  an entry with ``entry[:c] == prompt[:c]``. With A's cuts {4, 6}, the same prompt matches 4.

Among entries giving the same match length the caller's ``key`` picks (largest wins; the
prefix cache passes "in memory, then most recently used"); without a key the newest insert
wins.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

_EMPTY = np.zeros(0, dtype=np.int32)
_FIRST_CHUNK = 64  # a mismatch near the start costs one small comparison ...
_MAX_CHUNK = 1 << 16  # ... a full match of a long edge costs a few large ones


def common_prefix(a: Sequence[int] | np.ndarray, b: Sequence[int] | np.ndarray) -> int:
    """Length of the common prefix of two token sequences: lists (the engine's prompts, which
    converting to numpy would cost more than comparing) or int32 arrays (this index's edges).

    Lists are compared whole in C, the usual case when they match, and a mismatch is found
    by bisecting. Arrays are compared in growing chunks, stopping at the first mismatch."""
    n = min(len(a), len(b))
    if isinstance(a, list) and isinstance(b, list):
        if a[:n] == b[:n]:
            return n
        lo, hi = 0, n  # a[:lo] == b[:lo], a[lo:hi] != b[lo:hi]
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if a[lo:mid] == b[lo:mid]:
                lo = mid
            else:
                hi = mid
        return lo
    i, chunk = 0, _FIRST_CHUNK
    while i < n:
        j = min(n, i + chunk)
        diff = np.flatnonzero(np.not_equal(a[i:j], b[i:j]))
        if diff.size:
            return i + int(diff[0])
        i, chunk = j, min(chunk * 4, _MAX_CHUNK)
    return n


def as_tokens(tokens: Sequence[int] | np.ndarray) -> np.ndarray:
    """Tokens as a 1-D int32 array (no copy when they already are one)."""
    arr = np.asarray(tokens, dtype=np.int32)
    if arr.ndim != 1:
        raise ValueError(f"tokens must be 1-D, got shape {arr.shape}")
    return arr


class _Node:
    __slots__ = ("children", "depth", "ends", "label", "parent")

    def __init__(self, label: np.ndarray, parent: _Node | None, depth: int) -> None:
        self.label = label  # int32 tokens on the edge parent -> self
        self.parent = parent
        self.depth = depth  # tokens from the root through the end of label
        self.children: dict[int, _Node] = {}  # first token of the child's label -> child
        self.ends: dict[str, None] = {}  # ids of the entries whose tokens end exactly here


class _Record:
    __slots__ = ("cuts", "node", "seq", "tokens")

    def __init__(self, tokens: np.ndarray, cuts: np.ndarray, node: _Node, seq: int) -> None:
        self.tokens = tokens  # read-only int32 copy
        self.cuts = cuts  # sorted unique int64, in [1, len(tokens)], the last == len(tokens)
        self.node = node
        self.seq = seq  # insertion order: the default tie-break


class PrefixIndex:
    """A radix tree of token sequences keyed by entry id (see the module docstring)."""

    def __init__(self) -> None:
        self._root = _Node(_EMPTY, None, 0)
        self._records: dict[str, _Record] = {}
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._records)

    def __contains__(self, entry_id: object) -> bool:
        return entry_id in self._records

    def tokens(self, entry_id: str) -> np.ndarray:
        return self._records[entry_id].tokens

    def cuts(self, entry_id: str) -> np.ndarray:
        return self._records[entry_id].cuts

    # -- updates ------------------------------------------------------------------------

    def insert(
        self, entry_id: str, tokens: Sequence[int] | np.ndarray, cuts: Sequence[int] = ()
    ) -> None:
        """Add an entry; ``cuts`` are restore points in ``[1, len]`` (the end is always one)."""
        if entry_id in self._records:
            raise KeyError(f"entry {entry_id!r} is already indexed")
        toks = as_tokens(tokens).copy()
        toks.flags.writeable = False
        if not len(toks):
            raise ValueError("cannot index an empty token sequence")
        cut_arr = np.unique(np.asarray([*cuts, len(toks)], dtype=np.int64))
        if cut_arr[0] < 1 or cut_arr[-1] > len(toks):
            raise ValueError(f"cuts must lie in [1, {len(toks)}], got {list(cuts)}")
        node, pos = self._root, 0
        while pos < len(toks):
            child = node.children.get(int(toks[pos]))
            if child is None:
                leaf = _Node(toks[pos:], node, len(toks))
                node.children[int(toks[pos])] = leaf
                node = leaf
                break
            k = common_prefix(child.label, toks[pos:])
            if k < len(child.label):
                child = self._split(child, k)
            node, pos = child, pos + k
        node.ends[entry_id] = None
        self._records[entry_id] = _Record(toks, cut_arr, node, next(self._seq))

    def remove(self, entry_id: str) -> None:
        """Forget an entry; merges the nodes it leaves with a single child."""
        node = self._records.pop(entry_id).node
        del node.ends[entry_id]
        while node is not self._root and not node.ends:
            parent = node.parent
            assert parent is not None
            if not node.children:  # a bare leaf: cut it off, then look at the parent
                del parent.children[int(node.label[0])]
                node = parent
                continue
            if len(node.children) == 1:  # a pass-through node: merge it into its child
                (child,) = node.children.values()
                child.label = np.concatenate([node.label, child.label])
                child.parent = parent
                parent.children[int(node.label[0])] = child
            break

    def _split(self, node: _Node, k: int) -> _Node:
        """Split ``node``'s edge after ``k`` tokens; returns the new middle node."""
        parent = node.parent
        assert parent is not None and 0 < k < len(node.label)
        mid = _Node(node.label[:k], parent, node.depth - len(node.label) + k)
        parent.children[int(node.label[0])] = mid
        node.label = node.label[k:]
        node.parent = mid
        mid.children[int(node.label[0])] = node
        return mid

    # -- queries ------------------------------------------------------------------------

    def longest(
        self,
        prompt: Sequence[int] | np.ndarray,
        *,
        cuts_only: bool = False,
        key: Callable[[str], Any] | None = None,
    ) -> tuple[str, int] | None:
        """``(entry_id, match_len)`` of the entry sharing the longest reusable prefix, or None.

        ``cuts_only``: a match must end at one of the entry's cuts. ``key(entry_id)`` ranks
        entries with equal match lengths (largest wins); default: the latest inserted.
        Returns None when nothing matches at least one token.
        """
        prompt = as_tokens(prompt)
        path, partial, matched = self._walk(prompt)
        rank = key or (lambda eid: self._records[eid].seq)
        if matched == 0:
            return None
        deepest = partial or path[-1]
        if not cuts_only:
            best = max(self._subtree_ends(deepest), key=rank)
            return best, matched
        # Levels from the deepest point up: the entries hanging below path[i] but not below
        # the next path node share exactly path[i].depth tokens with the prompt.
        chain = [*path, partial] if partial is not None else path
        levels: list[tuple[int, Iterator[str]]] = [(matched, self._subtree_ends(deepest))]
        for i in range(len(chain) - 2, 0, -1):
            levels.append((chain[i].depth, self._ends_except(chain[i], chain[i + 1])))
        best_id, best_cut, best_rank = None, 0, None
        for shared, ids in levels:
            if shared <= best_cut:
                break  # every entry further up shares fewer tokens than the best cut
            for eid in ids:
                cuts = self._records[eid].cuts
                j = int(np.searchsorted(cuts, shared, side="right")) - 1
                if j < 0:
                    continue
                cut, r = int(cuts[j]), rank(eid)
                if cut > best_cut or (cut == best_cut and r > best_rank):
                    best_id, best_cut, best_rank = eid, cut, r
        return None if best_id is None else (best_id, best_cut)

    def prefixes(self, tokens: Sequence[int] | np.ndarray) -> list[tuple[str, int]]:
        """Entries whose whole token sequence is a prefix of ``tokens`` (or equal): (id, len)."""
        path, _, _ = self._walk(as_tokens(tokens))
        return [(eid, node.depth) for node in path[1:] for eid in node.ends]

    def _walk(self, prompt: np.ndarray) -> tuple[list[_Node], _Node | None, int]:
        """Follow ``prompt`` down: (fully matched nodes from the root, the node whose edge the
        match ends inside or None, matched token count)."""
        node, pos, path = self._root, 0, [self._root]
        while pos < len(prompt):
            child = node.children.get(int(prompt[pos]))
            if child is None:
                break
            k = common_prefix(child.label, prompt[pos:])
            if k < len(child.label):
                return path, child, pos + k
            node, pos = child, pos + k
            path.append(node)
        return path, None, pos

    def _subtree_ends(self, node: _Node) -> Iterator[str]:
        stack = [node]
        while stack:
            n = stack.pop()
            yield from n.ends
            stack.extend(n.children.values())

    def _ends_except(self, node: _Node, skip: _Node) -> Iterator[str]:
        yield from node.ends
        for child in node.children.values():
            if child is not skip:
                yield from self._subtree_ends(child)

    def check(self) -> None:
        """Assert the tree invariants (tests): depths, labels, compression, records."""
        seen: dict[str, _Node] = {}
        stack: list[tuple[_Node, np.ndarray]] = [(self._root, _EMPTY)]
        while stack:
            node, prefix = stack.pop()
            for eid in node.ends:
                seen[eid] = node
                assert np.array_equal(self._records[eid].tokens, prefix), eid
            for first, child in node.children.items():
                assert child.parent is node and len(child.label) > 0
                assert int(child.label[0]) == first
                assert child.depth == node.depth + len(child.label)
                assert child.ends or len(child.children) > 1, "uncompressed node"
                stack.append((child, np.concatenate([prefix, child.label])))
        assert seen.keys() == self._records.keys()
        assert all(self._records[eid].node is node for eid, node in seen.items())
