"""One request's grammar during decoding: the allowed-token masks the worker applies.

The daemon owns the grammar state (an llguidance matcher, ``luced.text.grammar``): it
consumes every emitted token and, before each forward that samples, writes the mask of the
tokens allowed next into the target's ``allowed`` region (shared memory, one int32 bitmask
row per sampled position; layout in ``luced.engine.target``). The worker sets every other
logit to -inf before penalties' results are read, sampling, and logprobs
(``luced.runtime.sampler``), so greedy, sampled and speculative decoding all draw from the
masked distribution.

End of output: the matcher allows its EOS id exactly when the grammar may end; that bit
stands for every id that ends the request (EOS ids, stop_token_ids), so EOS is masked while
the grammar is incomplete. When the grammar can take no further token (`done`), the engine
stops the request itself without asking the model for an EOS.

Speculation (`walk`): row i of a verify block predicts the token after block[0..i], so its
mask is the grammar's after consuming proposals 1..i. The walk consumes proposals while the
grammar allows them and cuts the block at the first it does not (that proposal would be
rejected anyway: the target's masked row gives it probability 0); `rollback` undoes the
walk after the verify, and the emitted tokens are then consumed as any others.
"""

from __future__ import annotations

import logging
from collections.abc import Collection

import llguidance
import numpy as np

from luced.text.grammar import GrammarTokenizer

log = logging.getLogger(__name__)


class Constraint:
    def __init__(
        self,
        matcher: llguidance.LLMatcher,
        vocab: GrammarTokenizer,
        stops: Collection[int],
        masks: np.ndarray,  # int32 [rows, words >= vocab.mask_words]: the shared region
    ) -> None:
        self.matcher = matcher
        self.masks = masks
        self._words = vocab.mask_words
        self._eos = vocab.eos_id
        self._stops = sorted(s for s in stops if 0 <= s < 32 * masks.shape[1])
        masks[:, self._words :] = 0  # ids past the tokenizer's (a padded head): never

    @property
    def done(self) -> bool:
        """The grammar takes no further token (complete, or broken by a bad token)."""
        return self.matcher.is_stopped()

    def advance(self, token: int) -> None:
        """Consume an emitted token (not an id that ended the request)."""
        if not self.matcher.consume_token(token):
            # Only a mask bug can get here; the matcher is stopped now, so the request ends.
            log.warning("grammar refused emitted token %d: %s", token, self.matcher.get_error())

    def fill(self, row: int = 0) -> None:
        """Write the mask of the tokens allowed next into masks[row]."""
        words = self.masks[row, : self._words]
        self.matcher.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
        may_end = self.allows(row, self._eos)
        for s in self._stops:  # the EOS bit speaks for every id that ends the request
            self._set(row, s, may_end)

    def allows(self, row: int, token: int) -> bool:
        return bool((int(self.masks[row, token >> 5]) >> (token & 31)) & 1)

    def _set(self, row: int, token: int, on: bool) -> None:
        word = self.masks[row, token >> 5 : (token >> 5) + 1].view(np.uint32)
        bit = np.uint32(1 << (token & 31))
        word[0] = (word[0] | bit) if on else (word[0] & ~bit)

    def walk(self, block: list[int], first_row: int = 0) -> int:
        """Fill the masks of a draft window's rows (from `first_row`); how many of its
        positions to feed (the anchor and the proposals the grammar allows, up to the first
        it does not). The proposals kept are consumed: `rollback(kept - 1)` after the
        verify."""
        self.fill(first_row)
        kept = 1
        for token in block[1:]:
            if token in self._stops or not self.allows(first_row + kept - 1, token):
                break
            self.matcher.consume_token(token)
            self.fill(first_row + kept)
            kept += 1
        return kept

    def rollback(self, proposals: int) -> None:
        if proposals:
            self.matcher.rollback(proposals)
