"""Sequences driven through the runner by hand, one forward per call: for benchmarks that
measure the target's forwards without the scheduler, and for tests that check the runner
and the workers against an oracle (split == unsplit, batched == alone, restored == fresh).

    d = Driver(target)
    first = await d.prefill(prompt, {"temperature": 0})     # chunks as the scheduler cuts
    nxt = await d.step(first.token, {"temperature": 0})
    rows = await d.run([Work(...), Work(...)])              # several sequences in one forward

Each call plays the scheduler for one step: it builds the `Work`s and moves the
sequences' `computed` on. `truncate` only moves it back: the next span rolls the workers'
KV back (``runner.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence as Seq

import numpy as np

from luced.cache.layout import TensorSpec
from luced.engine.output import Sampled
from luced.engine.request import GenerationRequest, RequestHandle, Sequence, Status
from luced.engine.runner import ModelRunner
from luced.engine.scheduler import Work
from luced.engine.target import Target
from luced.ipc.regions import Region
from luced.sampling_params import SamplingParams


class Driver:
    """One or more sequences driven through the real runner by hand (the tests play the
    scheduler): each call is one forward of `Work`s, like a step of the engine."""

    def __init__(self, target: Target) -> None:
        self.target = target
        self.runner = ModelRunner(target)
        self.seqs: dict[int, Sequence] = {}

    def seq(self, slot: int, sampling: dict | None = None, logprobs: int | None = None) -> Sequence:
        """The sequence in `slot` (made on first use), with this sampling for its next rows."""
        params = SamplingParams.from_wire(dict(sampling or {}))
        params = dataclasses.replace(params, logprobs=logprobs)
        req = GenerationRequest(f"s{slot}", [0], params)
        old = self.seqs.get(slot)
        seq = Sequence(RequestHandle(req, 1 << 20), slot, params.to_wire(), frozenset(), None)  # type: ignore[arg-type]
        seq.slot, seq.status = slot, Status.RUNNING
        if old is not None:
            seq.computed, seq.ring_floor = old.computed, old.ring_floor
        self.seqs[slot] = seq
        return seq

    def position(self, slot: int = 0) -> int:
        return self.seqs[slot].computed if slot in self.seqs else 0

    async def reset(self, slot: int = 0) -> None:
        await self.target.reset(slot)
        self.seq(slot).computed = 0

    async def release(self, slot: int) -> None:
        await self.target.release(slot)
        self.seqs.pop(slot, None)

    def truncate(self, position: int, slot: int = 0) -> None:
        """Roll back to `position`: the next span starts there."""
        assert 0 <= position <= self.position(slot)
        self.seqs[slot].computed = position

    async def run(self, works: list[Work]) -> list[list[Sampled]]:
        outputs = await self.runner.forward(works)
        for w in works:
            w.seq.computed = w.start + len(w.tokens)
        return [o.rows for o in outputs if o is not None]

    async def feed(
        self,
        ids: list[int],
        sampling: dict,
        logprobs: int | None = None,
        slot: int = 0,
        n_out: int = 1,
    ) -> list[Sampled]:
        """Feed ids to `slot`'s sequence in one span; the rows sampled after its last
        (n_out 1), after each of them (n_out len(ids)) or none (0)."""
        seq = self.seq(slot, sampling, logprobs)
        (rows,) = await self.run([Work(seq, seq.computed, list(ids), n_out, window=1)])
        return rows

    async def prefill(
        self, prompt: list[int], sampling: dict, logprobs: int | None = None, slot: int = 0
    ) -> Sampled:
        """Reset `slot` and feed the prompt in chunks ending at multiples of the target's
        chunk (as the scheduler cuts them); the token after it."""
        await self.reset(slot)
        chunk = self.target.prompt_chunk
        at = 0
        while True:
            end = min((at // chunk + 1) * chunk, len(prompt))
            rows = await self.feed(
                prompt[at:end], sampling, logprobs, slot, int(end == len(prompt))
            )
            if end == len(prompt):
                return rows[0]
            at = end

    async def step(
        self, token: int, sampling: dict, logprobs: int | None = None, slot: int = 0
    ) -> Sampled:
        return (await self.feed([token], sampling, logprobs, slot))[0]

    async def logits(self, ids: list[int], slot: int = 0) -> np.ndarray:
        """Feed ids (at most logit_rows); a copy of every position's logits [n, vocab]."""
        seq = self.seq(slot)
        out = self.target.regions["logits"].rows(0, len(ids))
        work = Work(seq, seq.computed, list(ids), len(ids), window=1)
        await self.runner.forward([work], want="logits", logits_out=out)
        seq.computed += len(ids)
        return self.target.arrays["logits"][: len(ids)].copy()

    # -- the KV operations of `slot`'s sequence ----------------------------------------

    async def kv_layout(self) -> list[TensorSpec]:
        return await self.target.kv_layout()

    async def export_kv(
        self,
        n: int,
        regions: dict[str, Region],
        cuts: Seq[int] = (),
        entry: str = "",
        slot: int = 0,
    ) -> None:
        mover = self.target.mover(slot, self.position(slot), lambda f: None)
        await mover.export_kv(n, regions, cuts, entry)

    async def import_kv(
        self, n: int, regions: dict[str, Region], tokens: Region, entry: str = "", slot: int = 0
    ) -> None:
        seq = self.seq(slot)

        def floor(f: int) -> None:
            seq.ring_floor = f

        mover = self.target.mover(slot, seq.computed, floor)
        try:
            await mover.import_kv(n, regions, tokens, entry)
        finally:  # n, or unchanged when refused, or 0 when a worker failed part-way
            seq.computed = mover.position

    async def stats(self) -> dict:
        return await self.target.stats()

    async def draft_block(
        self, anchor: int, size: int, sampling: dict | None = None, slot: int = 0
    ) -> list[int]:
        """[anchor, proposals...] from the draft for `slot`'s sequence (greedy, or drawn
        with `sampling`, its q left in the slot's rows for `verify_sampled`)."""
        seq = self.seq(slot, sampling)
        work = Work(seq, seq.computed, [anchor], 1, window=size, draft_kind="draft")
        await self.runner.proposer.fill([work])
        return work.tokens

    async def verify(
        self,
        block: list[int],
        sampling: dict | None = None,
        logprobs: int | None = None,
        slot: int = 0,
    ) -> list[Sampled]:
        """A greedy window: the target's argmax after each of its rows."""
        seq = self.seq(slot, {**(sampling or {}), "temperature": 0}, logprobs)
        work = Work(seq, seq.computed, list(block), len(block), window=len(block))
        (rows,) = await self.run([work])
        return rows

    async def verify_sampled(
        self, block: list[int], sampling: dict, logprobs: int | None = None, slot: int = 0
    ) -> tuple[list[Sampled], int]:
        """A sampled window, rejection-sampled in the head's worker against the slot's q
        rows: (the step's tokens, proposals accepted)."""
        seq = self.seq(slot, sampling, logprobs)
        work = Work(seq, seq.computed, list(block), len(block), window=len(block))
        (out,) = await self.runner.forward([work])
        seq.computed += len(block)
        assert out is not None and out.accepted is not None
        return out.rows, out.accepted

    def set_point_mass_q(self, proposals: list[int], slot: int = 0) -> None:
        self.runner.proposer._set_point_mass(slot, proposals)
