"""The adaptive window size's cost model, measured before the first request.

Plain steps against draft windows of each size (the draft's work included), on a
throwaway sequence in slot 0 (no request runs yet): a warm-up round first (first-call
costs), then the median of three interleaved rounds (one round on a shared machine put
c(2) at 1.46 plain steps, 1.18 in a repeated measurement). The slot is reset after.
"""

from __future__ import annotations

import statistics
import time

from luced.engine.request import Sequence, Status
from luced.engine.runner import ModelRunner
from luced.engine.scheduler import Work
from luced.engine.spec.sizer import StepCosts


async def calibrate(
    runner: ModelRunner,
    costs: StepCosts,
    seq: Sequence,
    sizes: tuple[int, ...],
    lookup_drafts: bool,
) -> dict[int, float]:
    """Observe c(1) and c(size) for each size into `costs`; -> its table. `seq`: a new
    sequence with a short prompt, run in slot 0."""
    target = runner.target
    seq.slot, seq.status, seq.lookup = 0, Status.RUNNING, None
    await target.reset(0)
    (first,) = await runner.forward([Work(seq, 0, list(seq.tokens), 1)])
    assert first is not None
    seq.computed, anchor = len(seq.tokens), first.rows[0].token
    seconds: dict[int, list[float]] = {}
    for measured in (False, True, True, True):
        for size in (1, *sizes):
            began = time.perf_counter()
            work = Work(seq, seq.computed, [anchor], 1, window=size, draft_kind="draft")
            if size > 1:
                if lookup_drafts:  # a lookup drafts in microseconds: the verify alone
                    work.tokens, work.n_out = [anchor] * size, size
                else:
                    await runner.proposer.fill([work])
            await runner.forward([work])
            if measured:
                seconds.setdefault(size, []).append(time.perf_counter() - began)
    for size, measurements in seconds.items():
        costs.observe(size, statistics.median(measurements))
    await target.reset(0)
    return costs.table()
