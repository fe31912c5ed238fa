"""One engine step through the workers: a batch in, each work's rows out.

`execute(batch)`:
  1. the preempted sequences' KV is freed in the workers (their samplers kept)
  2. draft windows are filled (``spec/proposer.py``)
  3. inputs are written: every work's tokens one after another in ``io.tokens``, output rows
     assigned in work order, a grammar's masks for its rows (walking a window's proposals,
     which may cut the window); each span's block table grown, after its KV Flash
     pager paged blocks out and in (the moves ride in the span)
  4. one ``forward`` frame per worker, in layer order: the spans of every work; a split
     pipeline hands the hidden rows on through ``act.boundary-k``. All or nothing: a
     failure, or a worker at the wrong positions after it, rolls every sequence back to
     its span's start on the workers that advanced
  5. each work's rows are read back (an embedding's pooled row from ``act.embeddings``)

Decoding ahead (``decode_ahead``, runtime/lookahead.py): a step of plain decodes on one
local worker asks it to feed the tokens it samples at once, into ``ahead`` regions, while
this side reads the reply and writes the next frame; the worker answers that next frame
without computing when it is exactly that step. The io regions' two halves alternate for
it: a step's ids and outputs use one half while the worker writes the next step's rows
into the other.

A sequence's span may start below what its KV holds (the rejected rows of its last draft
window): the worker rolls it back first, so a verify costs no extra round trip.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Callable

from luced.engine.executor import WorkerHandle, WorkerReplyError
from luced.engine.kv.blocks import BlocksExhausted
from luced.engine.kv.pager import PoolExhausted
from luced.engine.output import Sampled
from luced.engine.placement import WorkerSpec
from luced.engine.scheduler import Batch, Work, WorkOutput
from luced.engine.spec.proposer import Proposer
from luced.engine.target import MAX_TOP_LOGPROBS, Target
from luced.ipc.frames import Carry, Forward, ForwardReply, Span, Truncate
from luced.ipc.regions import Region

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class _Rows:
    """Where a work's outputs go: rows [first, first + n) of the output regions."""

    first: int
    n: int


class ModelRunner:
    def __init__(self, target: Target) -> None:
        self.target = target
        self.proposer = Proposer(target)
        # Wall time of the last forward and the workers' compute time in it (µs): their
        # difference is the orchestration cost (frames, wakeups, waits).
        self.last_wall_us = 0
        self.last_compute_us = 0
        self.decode_ahead = "auto"  # --decode-ahead (`ahead_pays`)
        self._base = 0  # the io regions' first row for the next frame (a half, when ahead)

    async def execute(self, batch: Batch) -> list[WorkOutput]:
        t = self.target
        for seq in batch.preempted:
            with contextlib.suppress(Exception):  # a dead worker forgot it anyway
                await t.release(seq.slot, keep_sampler=bool(seq.generated))
        if not batch.works:
            return []
        t.check_in_sync()
        await self.proposer.fill(batch.works)
        return await self.forward(batch.works)

    async def forward(
        self, works: list[Work], want: str = "sample", logits_out: Region | None = None
    ) -> list[WorkOutput]:
        """One forward of `works` (windows filled); `want` "logits" writes each output row's
        logits to `logits_out` instead of sampling."""
        t = self.target
        rows, masks = self._rows(works)
        tokens = sum(len(w.tokens) for w in works)
        n_out = sum(r.n for r in rows)
        half = t.step_tokens // 2
        base = self._base if max(tokens, n_out) <= half else 0
        self._write_tokens(works, base)
        k = max((w.seq.logprobs or 0 for w in works), default=0)
        k = min(k, MAX_TOP_LOGPROBS)
        asked = any(w.seq.logprobs is not None for w in works)
        logprobs = k if asked else None
        outputs = self._outputs(n_out, logprobs, base) if want == "sample" else {}
        ahead = {}
        if want == "sample" and self._ahead(works, rows, masks, max(tokens, n_out)):
            ahead = self._outputs(n_out, logprobs, half - base)
        grown, scored = self._grow_tables(works, bool(ahead))
        moved = any(g.get("moves") for g in grown)
        regions = t.flash.regions if t.flash is not None else None
        host = t.host.regions if t.host is not None else []
        if logits_out is not None:
            outputs = {"logits": logits_out}
        pooled = [j for j, w in enumerate(works) if w.pool]
        if pooled:  # one row each, in work order
            outputs["embeddings"] = t.regions["embeddings"].rows(0, len(pooled))
        sampled = [w.verifies and not w.seq.params.greedy for w in works]
        q_rows = [
            self.proposer.q_row(w.seq.slot) if s else 0 for w, s in zip(works, sampled, strict=True)
        ]
        capture = t.capture[0] if t.capture is not None else ()
        keep_blocks = t.recurrent and t.rollback == "select"

        def frame(i: int, last: bool) -> Forward:
            spans = []
            for j, w in enumerate(works):
                ring = t.ring(w.seq.slot)
                sampling = w.seq.sampling
                if w.verifies and not sampled[j]:
                    sampling = {**sampling, "temperature": 0.0}  # greedy window rows
                spans.append(
                    Span(
                        sequence=w.seq.slot,
                        start=w.start,
                        n=len(w.tokens),
                        n_out=rows[j].n,
                        sampling=sampling if last and rows[j].n else {},
                        verify=sampled[j] and last,
                        q_row=q_rows[j],
                        keep_state=w.keep_state,
                        keep_block_states=keep_blocks and w.verifies,
                        ring=ring.region if ring is not None else None,
                        pool=w.pool if last else "",  # type: ignore[arg-type]
                        kv_scores=regions.scores(w.seq.slot, i) if scored[j] else None,
                        **grown[j],
                    )
                )
            return Forward(
                spans=tuple(spans),
                want=want if last else "hidden",  # type: ignore[arg-type]
                outputs=outputs if last else {"hidden": self._boundary(i, tokens)},
                tokens=t.regions["tokens"].rows(base, base + tokens),
                hidden_in=self._boundary(i - 1, tokens) if i else None,
                top_logprobs=k if last and asked else 0,
                capture=capture,
                draft_probs=t.regions["draft_probs"] if last and any(sampled) else None,
                allowed=masks if last else None,
                ahead=ahead if last else {},
                kv_host=host[i] if moved else None,
            )

        t0 = time.perf_counter()
        starts = {w.seq.slot: w.start for w in works}
        if t.ring_relay is not None:  # the rows from each start on change in the rings
            for w in works:
                t.ring_relay.wrote(w.seq.slot, w.start)
        ends = tuple(w.start + len(w.tokens) for w in works)
        try:
            replies = await self._pipeline(frame, starts, ends)
        except BaseException:
            if moved:  # some workers may have run the moves and others not: start over
                t.executor.in_sync = False
            raise
        for w, scores in zip(works, scored, strict=True):
            if scores:  # qk: the pager reselects by them at its next plan
                t.pager(w.seq.slot).score(regions.mean_scores(w.seq.slot))  # type: ignore[union-attr]
        if ahead:  # the next frame's rows are where the worker writes them now
            self._base = half - base
        self.last_wall_us = int((time.perf_counter() - t0) * 1e6)
        self.last_compute_us = sum(r.elapsed_us for r in replies)
        out = [WorkOutput([]) for _ in works]
        if want == "sample":
            accepted = replies[-1].accepted or (-1,) * len(works)
            for i, (w, r, a) in enumerate(zip(works, rows, accepted, strict=True)):
                got = self._read_rows(base + r.first, a + 1 if a >= 0 else r.n, outputs)
                out[i].rows = [_trimmed(s, w.seq.logprobs) for s in got]
                out[i].accepted = a if a >= 0 else None
        for k, j in enumerate(pooled):
            out[j].pooled = t.arrays["embeddings"][k].copy()
        return out

    def _grow_tables(self, works: list[Work], ahead: bool) -> tuple[list[dict], list[bool]]:
        """Each work's span fields for its block table (engine/kv/blocks.py): the moves
        first (under KV Flash its pager's: blocks paged out to make room, the span's paged
        in; without, every paged-out block it shares with a kept lane paged in, so it
        attends over all its positions as a plain cache), then the growth: its rows'
        blocks, and with `ahead` the next position's too (the worker writes it before the
        next frame). And whether each asks the workers for its `qk` scores. Empty without
        a block pool."""
        t = self.target
        blocks = t.blocks
        if blocks is None:
            return [{} for _ in works], [False] * len(works)
        cap = t.placement.kv_capacity
        out, scored = [], []
        for i, w in enumerate(works):
            end = min(cap, w.start + len(w.tokens) + ahead)
            fields: dict = {}
            pager = t.pager(w.seq.slot)
            if pager is not None:
                if w.n_out and not w.seq.generated and len(w.seq.prompt) > pager.cfg.pool_tokens:
                    pager.ask_reselect()  # qk: select by the prompt's last query
                try:
                    fields["moves"] = tuple(tuple(m) for m in pager.plan(w.start, end - w.start))
                except PoolExhausted:
                    if i:  # the works before moved blocks no worker has moved
                        t.executor.in_sync = False
                    raise
            elif blocks.paged(w.seq.slot):
                fields["moves"] = self._page_in(w.seq.slot, bool(i))
            scored.append(pager is not None and pager.reselect_due())
            g = blocks.write(w.seq.slot, w.start, end)
            out.append({**fields, "copies": g.copies, "blocks": g.blocks, "table": g.length})
        return out, scored

    def _page_in(self, slot: int, after_moves: bool) -> tuple[tuple[int, ...], ...]:
        """Without KV Flash: page every paged-out block of `slot` in (shared from a kept
        lane: the budget charged the slot those positions, so the pool has the blocks).
        BlocksExhausted, changing nothing, when it has not (a bookkeeping bug)."""
        blocks = self.target.blocks
        assert blocks is not None
        paged = sorted(blocks.host(slot))
        if len(paged) > blocks.free_blocks:
            if after_moves:  # the works before moved blocks no worker has moved
                self.target.executor.in_sync = False
            raise BlocksExhausted(
                f"sequence {slot} shares {len(paged)} paged-out blocks, the pool has "
                f"{blocks.free_blocks} free to page them in"
            )
        return tuple(tuple(blocks.page_in(slot, j)) for j in paged)

    def _write_tokens(self, works: list[Work], base: int) -> None:
        """The fed ids into ``io.tokens`` from row `base`, one work after another."""
        t = self.target
        total = sum(len(w.tokens) for w in works)
        if base + total > t.step_tokens:
            raise ValueError(f"a step of {total} tokens exceeds the budget of {t.step_tokens}")
        t.arrays["tokens"][base : base + total] = [tok for w in works for tok in w.tokens]

    def _ahead(
        self,
        works: list[Work],
        rows: list[_Rows],
        masks: Region | None,
        n: int,
    ) -> bool:
        """Whether the worker should decode this step's successor ahead (module docstring):
        one local worker, plain decodes that each continue (no grammar, drafts, captures
        or pooling, budget for another token), in half the io rows, and no KV Flash (only
        the daemon's pager may make room for the next position)."""
        t = self.target
        spec = t.executor.slots[0].spec
        if self.decode_ahead == "off" or len(t.executor.workers()) != 1 or spec.remote:
            return False
        if self.decode_ahead == "auto" and not ahead_pays(spec):
            return False
        if masks is not None or t.capture is not None or t.flash is not None:
            return False
        if 2 * n > t.step_tokens:
            return False
        return all(
            r.n == 1 and not w.verifies and not w.pool and w.seq.constraint is None
            and not w.seq.speculates and w.seq.budget > 1
            for w, r in zip(works, rows, strict=True)
        )  # fmt: skip

    def _rows(self, works: list[Work]) -> tuple[list[_Rows], Region | None]:
        """Each work's output rows, in order, and a grammar's allowed-token mask per output
        row (every token allowed where a work has no grammar; None when no work has one).
        A window's rows are walked: its proposals past the first the grammar refuses are
        cut (the target's masked row gives them probability 0), so it may shrink."""
        t = self.target
        masked = any(w.seq.constraint is not None for w in works)
        masks = t.arrays["allowed"]
        rows, at = [], 0
        for w in works:
            constraint = w.seq.constraint
            if masked and constraint is None:
                masks[at : at + w.n_out] = -1  # all 32 bits of every word
            elif constraint is not None and w.verifies:
                kept = constraint.walk(w.tokens, first_row=at)
                w.tokens, w.n_out = w.tokens[:kept], kept
                if kept == 1:
                    w.window = 1  # a plain step now: the walk filled its row
            elif constraint is not None and w.n_out:
                constraint.fill(at)
            rows.append(_Rows(at, w.n_out))
            at += w.n_out
        return rows, t.regions["allowed"].rows(0, at) if masked and at else None

    def _outputs(self, n: int, logprobs: int | None, base: int = 0) -> dict[str, Region]:
        """Output regions for n rows of ids from row `base`, and logprobs + top k when
        asked."""
        r = self.target.regions
        outputs = {"ids": r["ids"].rows(base, base + n)}
        k = min(logprobs or 0, MAX_TOP_LOGPROBS)
        if logprobs is not None:
            outputs["logprobs"] = r["logprobs"].rows(base, base + n)
        if k:
            outputs["topk_ids"] = self._topk_region("topk_ids", n, k, base)
            outputs["topk_logprobs"] = self._topk_region("topk_logprobs", n, k, base)
        return outputs

    def _read_rows(self, first: int, n: int, outputs: dict[str, Region]) -> list[Sampled]:
        """Rows [first, first + n) the last worker wrote into `outputs`."""
        a = self.target.arrays
        ids = a["ids"][first : first + n].tolist()
        if "logprobs" not in outputs:
            return [Sampled(tok) for tok in ids]
        lps = a["logprobs"][first : first + n].tolist()
        k = outputs["topk_ids"].shape[1] if "topk_ids" in outputs else 0
        top_ids = a["topk_ids"][first * k : (first + n) * k].reshape(n, k).tolist()
        top_lps = a["topk_logprobs"][first * k : (first + n) * k].reshape(n, k).tolist()
        return [
            Sampled(tok, lp, tuple(zip(ti, tl, strict=True)))
            for tok, lp, ti, tl in zip(ids, lps, top_ids, top_lps, strict=True)
        ]

    async def _pipeline(
        self,
        frame_for: Callable[[int, bool], Forward],
        starts: dict[int, int],
        ends: tuple[int, ...],
    ) -> list[ForwardReply]:
        """One pass through every worker, frame_for(k, last) to the k-th; all or nothing: a
        failure, or a worker not at `ends` after it (each sequence's position), rolls every
        sequence back to its start in `starts` on the workers that advanced."""
        t = self.target
        workers = t.executor.workers()
        advanced: list[WorkerHandle] = []
        replies: list[ForwardReply] = []
        carries: list[Carry | None] = [None] * len(workers)
        if t.hops.hops:  # links to workers on other hosts, made anew where one failed
            await t.hops.ensure()
        if t.hops.boundaries:  # boundaries across hosts go over their hops, not shared memory
            n = sum(ends) - sum(starts.values())
            carries = t.hops.carries([self._boundary(k, n) for k in range(len(workers) - 1)], n)
        try:
            for k, worker in enumerate(workers):
                reply = await worker.call(frame_for(k, k == len(workers) - 1), carries[k])
                assert isinstance(reply, ForwardReply)
                advanced.append(worker)
                replies.append(reply)
                if t.experts is not None:
                    t.experts.account(reply)
                if reply.positions != ends:
                    raise WorkerReplyError(
                        f"worker {worker.spec.group} is at position(s) {list(reply.positions)}, "
                        f"expected {list(ends)}: the shards disagree"
                    )
        except BaseException:
            if t.hops.hops:
                t.hops.failed()
            for worker in advanced:  # keep the shards agreeing: undo where it happened
                for seq, start in starts.items():
                    with contextlib.suppress(Exception):
                        await worker.call(Truncate(position=start, sequence=seq))
            raise
        return replies

    def _boundary(self, k: int, n: int) -> Region:
        return self.target.regions[f"boundary-{k}"].rows(0, n)

    def _topk_region(self, name: str, n: int, k: int, base: int) -> Region:
        """n rows of k from row `base`, packed (the region is step_tokens *
        MAX_TOP_LOGPROBS long)."""
        whole = self.target.regions[name]
        offset = whole.offset + base * k * whole.itemsize
        return Region(whole.segment, offset, (n, k), whole.dtype)


def ahead_pays(spec: WorkerSpec) -> bool:
    """Whether a worker gains from decoding ahead (`--decode-ahead auto`): only while the
    daemon has a processor the step does not use, so that turning one step into the next
    overlaps the step rather than taking cores from it. A GPU worker leaves the processor
    free; a CPU worker does when its threads leave a core. Measured in
    docs/performance.md."""
    if spec.group.startswith("cuda"):
        return True
    cores = len(os.sched_getaffinity(0))
    return spec.threads is not None and spec.threads < cores


def _trimmed(sampled: Sampled, logprobs: int | None) -> Sampled:
    """A row as its sequence reports it: logprobs only when asked, and its own top k (the
    step computed the largest k any sequence asked)."""
    if logprobs is None:
        return Sampled(sampled.token)
    return dataclasses.replace(sampled, top=sampled.top[:logprobs])
