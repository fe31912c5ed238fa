"""Prompt-lookup drafting (``--draft ngram``): proposals copied from the sequence itself.

The draft for the next tokens is the continuation of the latest earlier occurrence of
the sequence's last n tokens, trying n = 4 first and down to 2 (the idea of vLLM's
``ngram`` proposer and transformers' ``prompt_lookup_num_tokens``). Input-grounded work
(quoting, editing, summarising a document, code refactors) repeats long spans of its
prompt, and there a hit is often accepted whole; open chat rarely matches, and then
nothing is proposed and the step is a plain one.

No model and no worker: the index is a dict per n from each n-gram to where its latest
occurrence ended, updated as tokens are appended, so a draft costs a few dict lookups.
"""

from __future__ import annotations

from collections.abc import Iterable


class PromptLookup:
    """One sequence's n-gram index (prompt and output so far)."""

    # n = 1 matches are common in free text and rarely continue: on SmolLM2 (two
    # bench_dflash runs, each against its own plain baseline) min 2 instead of 1 took
    # open chat from 0.72x to 0.98x of plain decoding and a copy task from 0.99x to 1.77x.
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

    def extend(self, tokens: Iterable[int]) -> None:
        seq = self.tokens
        for token in tokens:
            end = len(seq)
            # Every n-gram ending here gains a continuation: the token being appended.
            for n, ends in self._ends.items():
                if end >= n:
                    ends[tuple(seq[end - n :])] = end
            seq.append(int(token))

    def propose(self, k: int) -> list[int]:
        """Up to k proposals for the tokens after the sequence; [] when no n-gram of the
        sequence's tail occurred before."""
        seq = self.tokens
        if k <= 0:
            return []
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            if len(seq) < n:
                continue
            start = self._ends[n].get(tuple(seq[len(seq) - n :]))
            if start is not None:
                return seq[start : start + k]
        return []
