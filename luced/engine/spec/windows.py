"""How each sequence speculates: whether it drafts at all, by what (the DFlash draft model
or the n-gram lookup), and the draft window it asks for each step."""

from __future__ import annotations

from luced.engine.config import SpeculationConfig
from luced.engine.request import Sequence
from luced.engine.spec.ngram import PromptLookup
from luced.engine.spec.sizer import BlockSizer, StepCosts
from luced.engine.target import MAX_BLOCK


class DraftWindows:
    def __init__(self, config: SpeculationConfig) -> None:
        # Settable at run time (tests and benchmarks try other windows on one engine).
        self.block_size = config.block_size  # the window, or the most an adaptive one asks for
        self.lookup_drafts = config.lookup_drafts  # the prompt lookup, no draft model
        self.lookup_ngrams = (4, 2)  # the lookup's longest and shortest n-gram (ngram.py)
        self.adaptive_blocks = config.adaptive_blocks
        self.step_costs = StepCosts()  # the adaptive window size's cost model

    def setup(self, seq: Sequence, has_draft: bool) -> None:
        """Make `seq` speculate when the target has a draft model or the lookup is on."""
        seq.speculates = has_draft or self.lookup_drafts
        if self.lookup_drafts:
            seq.lookup = PromptLookup(*self.lookup_ngrams)
            seq.lookup.extend(seq.prompt)
        params = seq.params
        # A seeded sampled request keeps the fixed window: which uniforms its generator
        # draws for what depends on the window sizes, and timing-driven sizes would make the
        # same seed give other tokens. Greedy output does not depend on them at all.
        if seq.speculates and self.adaptive_blocks and (params.greedy or params.seed is None):
            # A lookup starts from its priors, not --block-size: its fresh matches are often
            # wrong, and a first window of 16 costs several plain steps.
            priors = PromptLookup.FIRST_ACCEPTANCE if self.lookup_drafts else None
            seq.sizer = BlockSizer(self.step_costs, self.block_size, priors=priors)

    def window(self, seq: Sequence) -> tuple[int, str]:
        """The draft window `seq` asks for this step and what drafts it: (1, "") for a
        plain step."""
        if not seq.speculates:
            return 1, ""
        kind = seq.lookup.kind() if seq.lookup is not None else "draft"
        if kind is None:
            return 1, ""  # the lookup found nothing to propose
        want = seq.sizer.next_block(kind) if seq.sizer is not None else self.block_size
        return min(want, self.block_size, MAX_BLOCK), kind
