"""Prompt-lookup drafting (``--draft ngram``): proposals copied from the sequence itself.

The draft for the next tokens is the continuation of the latest earlier occurrence of
the sequence's last n tokens, trying n = 4 first and down to 2 (the idea of vLLM's
``ngram`` proposer and transformers' ``prompt_lookup_num_tokens``). Input-grounded work
(quoting, editing, summarising a document, code refactors) repeats long spans of its
prompt, and there a hit is often accepted whole; open chat rarely matches, and then
nothing is proposed and the step is a plain one.

No model and no worker: the index is a dict per n from each n-gram to where its latest
occurrence ended, updated as tokens are appended, so a draft costs a few dict lookups.

Acceptance comes in runs: a copied span is accepted whole, a chance match mostly not.
`kind` names what the next proposal is, for the adaptive block size (``block_size.py``)
to learn each kind's acceptance apart: ``"run"`` when the last proposals were all
accepted (the copy goes on), else ``"n4"`` .. ``"n2"`` by the order of the match.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar


class PromptLookup:
    """One sequence's n-gram index (prompt and output so far)."""

    # The adaptive block size's prior for a kind's first proposal (`BlockSizer` priors),
    # where it is not the default one half: a copy under way almost always has its first
    # proposal accepted (docs/performance.md, "Measurements behind the code").
    FIRST_ACCEPTANCE: ClassVar[dict[str, float]] = {"run": 0.9}

    # n = 1 matches are common in free text and rarely continue: requiring 2 made open chat
    # and copy tasks faster (docs/performance.md, "Measurements behind the code").
    def __init__(self, max_ngram: int = 4, min_ngram: int = 2) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"n-gram sizes need 1 <= min ({min_ngram}) <= max ({max_ngram})")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.tokens: list[int] = []
        # _ends[n][gram] = the index just past gram's latest occurrence that has a token
        # after it, i.e. where a copied continuation starts.
        self._ends: dict[int, dict[tuple[int, ...], int]] = {
            n: {} for n in range(min_ngram, max_ngram + 1)
        }
        self._proposed: list[int] = []  # the last proposals, until the tokens after them arrive
        self.in_run = False  # the last proposals were all accepted

    def extend(self, tokens: Iterable[int]) -> None:
        tokens = [int(t) for t in tokens]
        proposed, self._proposed = self._proposed, []
        self.in_run = bool(proposed) and tokens[: len(proposed)] == proposed
        seq = self.tokens
        for token in tokens:
            end = len(seq)
            # Every n-gram ending here gains a continuation: the token being appended.
            for n, ends in self._ends.items():
                if end >= n:
                    ends[tuple(seq[end - n :])] = end
            seq.append(token)

    def _match(self) -> tuple[int, int] | None:
        """(n, start) of the longest tail n-gram that occurred before: its latest
        occurrence's continuation starts at tokens[start]."""
        seq = self.tokens
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            if len(seq) < n:
                continue
            start = self._ends[n].get(tuple(seq[len(seq) - n :]))
            if start is not None:
                return n, start
        return None

    def kind(self) -> str | None:
        """What a proposal made now would be: "run" (the last proposals were all accepted:
        the copy goes on), "n4" .. "n2" (a fresh match of that order), or None (no match:
        nothing to propose)."""
        match = self._match()
        if match is None:
            return None
        return "run" if self.in_run else f"n{match[0]}"

    def propose(self, k: int) -> list[int]:
        """k proposals for the tokens after the sequence (the match's continuation); []
        when no n-gram of the sequence's tail occurred before."""
        match = self._match() if k > 0 else None
        if match is None:
            self._proposed = []
            return []
        seq, start = self.tokens, match[1]
        proposals = seq[start : start + k]
        # A continuation that reaches the sequence's end predicts its own next tokens
        # (the tail repeats with period len - start): a loop is proposed k tokens ahead.
        period = len(seq) - start
        while len(proposals) < k:
            proposals.append(proposals[len(proposals) - period])
        self._proposed = proposals[:]
        return proposals
