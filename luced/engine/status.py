"""The engine's status: what `lucectl status`, `/v1/status` and the page show, and what
/metrics' gauges are refreshed from."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from luced.engine.executor import kernels_summary
from luced.engine.request import RequestHandle


def _request_row(h: RequestHandle, now: float) -> dict:
    return {
        "id": h.request_id,
        "prompt_tokens": h.prompt_tokens,
        "completion_tokens": h.completion_tokens,
        "age_s": round(now - h.submitted_at, 1),
    }


def engine_status(engine: Any) -> dict:
    """`engine`: a `core.Engine` (not imported here: core imports this module)."""
    placement = engine.workers()
    cache = engine.prefix.cache
    now = time.monotonic()
    running = engine.scheduler.running
    return {
        "model": engine.model.name,
        "state": engine.state,
        "context_length": engine.model.context_length,
        "uptime_s": round(time.time() - engine.started_at, 1),
        "queue": {
            "waiting": len(engine.scheduler.waiting),
            "queued_tokens": engine.intake.queued_tokens(),
            "running": len(running),
            "max_running": engine.limits.max_running,
            # Each running and each waiting request with its tokens so far (a
            # preempted one waits with what it had generated).
            "requests": [_request_row(s.handle, now) for s in running],
            "waiting_requests": [_request_row(s.handle, now) for s in engine.scheduler.waiting],
            # KV positions the running requests hold, over the pool (--kv-pool-tokens).
            "kv_usage": sum(s.computed for s in running) / engine.kv.positions,
            "kv_pool_tokens": engine.kv.positions,
            # Finished requests' K/V kept in the pool for later prompts (engine/kv/finished.py).
            "kv_kept_requests": len(engine.kv.kept),
            "kv_kept_tokens": engine.finished.positions if engine.finished is not None else 0,
            # Of those, the positions whose blocks are paged out to host memory.
            "kv_kept_paged_tokens": engine.finished.paged if engine.finished is not None else 0,
            "preempted": len(engine.preempted),
            "batched_steps": engine.steps,
            "mean_batch": round(engine.stepped_sequences / engine.steps, 2)
            if engine.steps
            else None,
            "max_queue": engine.limits.max_queue,
            "max_queued_tokens": engine.limits.max_queued_tokens,
        },
        "totals": dict(engine.totals),
        "rejected": dict(engine.rejected),
        # Speculation: tokens committed per verify step (1 + accepted / drafts).
        "mean_acceptance_length": (
            round(1 + engine.totals["spec_accepted_tokens"] / engine.totals["spec_drafts"], 3)
            if engine.totals["spec_drafts"]
            else None
        ),
        # Draft windows by size ("1": plain steps taken while speculating).
        "block_sizes": {str(b): n for b, n in sorted(engine.scheduler.block_sizes.items())},
        "placement": placement,
        # A "torch fallback" here decodes several times slower than native kernels.
        "kernels": kernels_summary(placement),
        "prefix_cache": dataclasses.asdict(cache.stats()) if cache is not None else None,
        "kv_flash": engine.target.flash_status(),
        "moe_experts": engine.target.moe_status(),
        # Links across hosts (torch.distributed): bytes moved, and per token fed.
        "hops": engine.target.hops.describe() or None,
    }
