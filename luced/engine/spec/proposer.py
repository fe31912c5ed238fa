"""Draft windows for a step: the scheduler sized them, the proposer fills them.

A window is [anchor, proposals...]: the anchor is the sequence's last token (emitted, not
fed yet), the proposals what the drafter guesses follows. The target verifies the whole
window in the step's forward (a row after each token): greedy windows by comparing its
argmax rows in the daemon (``acceptance.verify_greedy``), sampled ones by rejection
sampling in the head's worker against the drafter's distributions q.

    n-gram lookup   the sequence's `PromptLookup` proposes the continuation of its latest
                    matching n-gram, maybe fewer than asked, maybe none (then the step is
                    plain); its q is a point mass, written here as one-hot rows
    DFlash draft    one `draft` frame per window to the draft's worker, which reads the
                    sequence's feature ring in place and writes its ids (and q) to the
                    sequence's rows of the `draft` segment

The window's size may shrink: to the proposals found, or with a grammar to the ones it
allows (done where the masks are written, ``runner.py``).
"""

from __future__ import annotations

import numpy as np

from luced.engine.scheduler import Work
from luced.engine.target import Target
from luced.ipc.frames import DraftBlock


class Proposer:
    def __init__(self, target: Target) -> None:
        self.target = target
        self._point_mass: dict[int, int] = {}  # slot -> one-hot q rows it last wrote

    def q_row(self, slot: int) -> int:
        """The first of `slot`'s q rows in ``draft_probs``."""
        return slot * (self.target.block_size - 1)

    async def fill(self, works: list[Work]) -> None:
        for work in works:
            if work.window < 2:
                continue
            seq = work.seq
            # The map names its temperature: the draft samples iff it is above 0 (a wire map
            # leaves defaults out, and an empty one reads as greedy to `DraftBlock`).
            sampled = not seq.params.greedy
            sampling = {**seq.sampling, "temperature": seq.params.temperature} if sampled else None
            if seq.lookup is not None:
                proposals = seq.lookup.propose(work.window - 1) if work.draft_kind else []
                if proposals and sampling is not None:
                    self._set_point_mass(seq.slot, proposals)
            else:
                proposals = await self._draft(work, sampling)
            work.tokens = [work.tokens[0], *proposals]
            work.n_out = len(work.tokens)

    async def _draft(self, work: Work, sampling: dict | None) -> list[int]:
        """The DFlash draft's proposals after the anchor, conditioned on the ring's
        features of the committed positions; greedy, or drawn from q (left in the slot's
        ``draft_probs`` rows for the verify)."""
        t, seq, size = self.target, work.seq, work.window
        assert t.draft is not None
        ring = t.ring(seq.slot)
        assert ring is not None
        base = seq.slot * t.block_size
        outputs = {"ids": t.regions["draft_ids"].rows(base, base + size)}
        if sampling is not None:
            q = self.q_row(seq.slot)
            outputs["probs"] = t.regions["draft_probs"].rows(q, q + size - 1)
        ctx = self.context(work)
        frame = DraftBlock(
            ring=ring.region,
            committed=seq.computed,
            anchor=work.tokens[0],
            outputs=outputs,
            block_size=size,
            mask_token_id=t.draft.mask_token_id,
            ctx_window=ctx,
            sampling=sampling or {},
            sequence=seq.slot,
        )
        relay = t.ring_relay  # a draft on another host: the rows it reads go to its mirror
        if relay is None:
            await t.executor.draft_worker().call(frame)
        else:
            lo = max(0, seq.computed - ctx)
            carry = await relay.carry(seq.slot, ring, lo, seq.computed)
            try:
                await t.executor.draft_worker().call(frame, carry)
            except BaseException:
                relay.forget(seq.slot)
                raise
        return t.arrays["draft_ids"][base + 1 : base + size].tolist()

    def context(self, work: Work) -> int:
        """How many committed positions before the window the draft reads from the ring.
        A verify feeds up to B positions past the committed ones and rolls back: their
        slots overwrote the oldest B rows of the ring, so those stay unread; nor are rows
        below the floor a restore or a share left valid."""
        seq, ring = work.seq, self.target.ring(work.seq.slot)
        assert ring is not None
        return max(1, min(ring.ring_cap - work.window, seq.computed - seq.ring_floor))

    def _set_point_mass(self, slot: int, proposals: list[int]) -> None:
        """q row i = one-hot at proposal i: rejection sampling against a drafter that
        proposes one token with certainty (exact: accept with probability p(x), else draw
        from p without x)."""
        q = self.target.arrays["draft_probs"]
        first = self.q_row(slot)
        q[first : first + self._point_mass.get(slot, 0)] = 0.0  # only last window's rows set
        rows = np.arange(first, first + len(proposals))
        q[rows, proposals] = 1.0
        self._point_mass[slot] = len(proposals)
