"""Prometheus metrics under vLLM's names, namespaced `luced:` instead of `vllm:`.

Dashboards written for vLLM work after replacing the prefix. Given a model name, every
series carries vLLM's label `model_name`; without one, no such label. The registry is our
own `CollectorRegistry`, never the process-wide default, so two daemons in one test
process do not collide.

    luced:time_to_first_token_seconds   histogram  submit -> first sampled token
    luced:inter_token_latency_seconds   histogram  between consecutive sampled tokens
    luced:e2e_request_latency_seconds   histogram  submit -> finished
    luced:request_queue_time_seconds    histogram  submit -> first admitted (waiting)
    luced:request_prefill_time_seconds  histogram  first admitted -> first token
    luced:request_decode_time_seconds   histogram  first token -> last token
    luced:request_prompt_tokens         histogram  prompt length per request
    luced:request_generation_tokens     histogram  tokens generated per request
    luced:num_requests_running          gauge      requests in prefill or decode
    luced:num_requests_waiting          gauge      requests in the queue
    luced:kv_cache_usage_perc           gauge      KV positions the running requests hold,
                                                   over the pool (--kv-pool-tokens; 0..1)
    luced:num_preemptions_total         counter    requests preempted (KV freed, recomputed)
    luced:prompt_tokens_total           counter    prompt tokens prefilled
    luced:generation_tokens_total       counter    tokens generated
    luced:request_success_total         counter    finished requests, label finished_reason
                                                   (stop | length | abort | error)
    luced:request_rejected_total        counter    submissions refused, label reason
                                                   (max_queue | max_queued_tokens: 429;
                                                   context_length_exceeded: 400;
                                                   loading | draining | degraded: 503)
    luced:spec_decode_num_drafts_total             counter  speculative decoding (DFlash):
    luced:spec_decode_num_draft_tokens_total       counter  drafts proposed, tokens drafted,
    luced:spec_decode_num_accepted_tokens_total    counter  tokens accepted, and accepted
    luced:spec_decode_num_accepted_tokens_per_pos_total     counter per draft position
                                                            (label position)
    luced:spec_decode_block_size        histogram  block of each speculative step
                                                   (1 = a plain step while speculating)
    luced:batch_size                    histogram  sequences in each batched decode step
                                                   (continuous batching, --max-running)
    luced:kv_flash_evictions_total      counter    KV Flash blocks paged out of the pool
    luced:kv_flash_recalls_total        counter    KV Flash blocks paged back in
    luced:kv_flash_host_bytes           gauge      bytes of paged-out blocks in the host tier
    luced:event_loop_lag_seconds        histogram  how late the daemon's event loop ran a
                                                   task due every 0.25 s (a stall shows
                                                   as one long lag)
    process_*                           prometheus_client's process collector (CPU
                                        seconds, resident memory, open fds, start
                                        time), as vLLM exports it; no model_name label

The engine reports through `observe(what, value)` and, once per request when it ends,
`request_finished(handle)` (the finish reason, the latency and the phase times from the
handle's timestamps, the tokens it generated); the HTTP
layer refreshes the gauges from `Engine.status()` on every scrape (and once a second),
so they are right even if an engine path forgot to report. Every observation also goes
to `timeline` (luced.engine.timeline): the last ten minutes, a sample a second, which
the web page plots. `_created` series are left out of the exposition (vLLM disables
them too, but globally; we filter our own output instead).

A daemon serving several models keeps a `Metrics` per model (its series labelled with
its name, kept while it is unloaded so that counters never go back) and one of its own
for the event loop's lag and the process; `merged_exposition` shows them as one page,
each family once.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, generate_latest
from prometheus_client.metrics_core import Metric

from luced.engine.timeline import Timeline

NAMESPACE = "luced:"
CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4
FINISH_REASONS = ("stop", "length", "abort", "error")

# vLLM's buckets: TTFT spans sub-millisecond to very long prompts; per-token latency
# is 10 ms and up; request latency in seconds to hours.
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
    40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
# Token counts: vLLM's 1-2-5 series (1, 2, 5, 10, 20, ... 5e6).
TOKEN_COUNT_BUCKETS = tuple(m * 10**e for e in range(7) for m in (1, 2, 5))
BLOCK_SIZE_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
BATCH_SIZE_BUCKETS = BLOCK_SIZE_BUCKETS  # sequences per batched step: 1 to 64 as well
# From the ordinary (under a millisecond) to a stopped or swapped-out daemon (minutes).
LOOP_LAG_BUCKETS = (
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 60.0, 300.0,
)  # fmt: skip
# The timeline's gauges, as Engine.status()'s queue names them.
_QUEUE_KEYS = {"running": "running", "queue": "waiting", "kv_usage": "kv_usage"}
REJECT_REASONS = ("max_queue", "max_queued_tokens", "context_length_exceeded")


class FinishedRequest(Protocol):
    """What `Metrics.request_finished` reads of a request that ended (the engine's
    `RequestHandle`): `time.monotonic()` timestamps, None for a phase never reached."""

    finish_reason: str | None
    completion_tokens: int
    submitted_at: float
    admitted_at: float | None  # first taken from the queue to run
    first_token_at: float | None
    last_token_at: float | None


class Metrics:
    """The daemon's metrics; one instance per daemon, shared by the engine and the HTTP app."""

    def __init__(self, model_name: str = "") -> None:
        """model_name: the value of vLLM's `model_name` label; "" leaves the label out."""
        self.model_name = model_name
        self.timeline = Timeline()
        self.registry = CollectorRegistry(auto_describe=True)
        base = {"model_name": model_name} if model_name else {}
        self._base = base

        def family(kind: type, name: str, doc: str, extra: Sequence[str] = (), **kw: Any) -> Any:
            metric = kind(NAMESPACE + name, doc, [*base, *extra], registry=self.registry, **kw)
            # One child per fixed label set, bound now; labelled by `extra` later.
            return metric.labels(**base) if base and not extra else metric

        def histogram(name: str, doc: str, buckets: Sequence[float]) -> Any:
            return family(Histogram, name, doc, buckets=buckets)

        self.time_to_first_token = histogram(
            "time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            TTFT_BUCKETS,
        )
        self.inter_token_latency = histogram(
            "inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            ITL_BUCKETS,
        )
        self.e2e_request_latency = histogram(
            "e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.request_prompt_tokens = histogram(
            "request_prompt_tokens",
            "Number of prefill tokens processed per request.",
            TOKEN_COUNT_BUCKETS,
        )
        # vLLM's request phases: waiting in the queue, prefill, decode (seconds each).
        self.request_queue_time = histogram(
            "request_queue_time_seconds",
            "Seconds a request waited in the queue before it first ran.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.request_prefill_time = histogram(
            "request_prefill_time_seconds",
            "Seconds from a request's admission to its first token.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.request_decode_time = histogram(
            "request_decode_time_seconds",
            "Seconds from a request's first token to its last.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.request_generation_tokens = histogram(
            "request_generation_tokens",
            "Tokens generated per finished request.",
            TOKEN_COUNT_BUCKETS,
        )
        self.num_requests_running = family(
            Gauge, "num_requests_running", "Number of requests in model execution."
        )
        self.num_requests_waiting = family(
            Gauge, "num_requests_waiting", "Number of requests waiting to be processed."
        )
        self.kv_cache_usage = family(
            Gauge, "kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."
        )
        # prometheus_client appends the `_total` suffix to counter names itself.
        self.prompt_tokens = family(Counter, "prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = family(
            Counter, "generation_tokens", "Number of generation tokens processed."
        )
        success = family(
            Counter,
            "request_success",
            "Count of successfully processed requests.",
            ["finished_reason"],
        )
        # Children made up front so every reason is exported (as 0) before it first happens.
        self.request_success = {
            r: success.labels(**base, finished_reason=r) for r in FINISH_REASONS
        }
        rejected = family(
            Counter,
            "request_rejected",
            "Requests refused before they were queued, by reason.",
            ["reason"],
        )
        self._rejected = rejected
        for reason in REJECT_REASONS:  # exported as 0 before they first happen
            rejected.labels(**base, reason=reason)
        self.spec_decode_num_drafts = family(
            Counter, "spec_decode_num_drafts", "Number of spec decoding drafts."
        )
        self.spec_decode_num_draft_tokens = family(
            Counter, "spec_decode_num_draft_tokens", "Number of draft tokens."
        )
        self.spec_decode_num_accepted_tokens = family(
            Counter, "spec_decode_num_accepted_tokens", "Number of accepted tokens."
        )
        self._accepted_per_pos = family(
            Counter,
            "spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft position.",
            ["position"],
        )
        self.spec_decode_block_size = histogram(
            "spec_decode_block_size",
            "Block sizes of speculative steps (anchor + proposals; 1 = a plain step).",
            BLOCK_SIZE_BUCKETS,
        )
        self.batch_size = histogram(
            "batch_size", "Sequences in each batched decode step.", BATCH_SIZE_BUCKETS
        )
        self.num_preemptions = family(
            Counter, "num_preemptions", "Requests preempted: KV freed, recomputed later."
        )
        # vLLM's names and meaning: prompt tokens looked up, and those found cached.
        self.prefix_cache_queries = family(
            Counter, "prefix_cache_queries", "Prefix cache queries, in queried prompt tokens."
        )
        self.prefix_cache_hits = family(
            Counter, "prefix_cache_hits", "Prefix cache hits, in restored prompt tokens."
        )
        self.prefix_shared = family(
            Counter,
            "prefix_shared_tokens",
            "Prompt tokens whose K/V blocks a request shared with a running one, not computed.",
        )
        self.prefix_kept = family(
            Counter,
            "prefix_kept_tokens",
            "Prompt tokens shared from a finished request's K/V blocks kept in the pool "
            "(counted in prefix_shared_tokens too).",
        )
        self._prefix_cache_bytes = family(
            Gauge, "prefix_cache_bytes", "Bytes the prefix cache holds per tier.", ["tier"]
        )
        self.kv_flash_evictions = family(
            Counter, "kv_flash_evictions", "KV Flash blocks paged out of the pool."
        )
        self.kv_flash_recalls = family(
            Counter, "kv_flash_recalls", "KV Flash blocks paged back into the pool."
        )
        self._kv_flash_host_bytes = family(
            Gauge, "kv_flash_host_bytes", "Bytes of KV Flash blocks in the host tier."
        )
        self._kv_flash_seen = {"evictions": 0, "recalls": 0}  # the pager's running totals
        self._moe = {
            "remote_calls": family(
                Counter, "moe_remote_calls", "MoE layer calls answered by the expert worker."
            ),
            "fallbacks": family(
                Counter,
                "moe_fallbacks",
                "MoE layer calls computed in process because the expert worker failed.",
            ),
            "remote_bytes": family(
                Counter, "moe_remote_bytes", "Bytes through the expert scratch, both ways."
            ),
        }
        self._moe_seen = dict.fromkeys(self._moe, 0)
        self.event_loop_lag = histogram(
            "event_loop_lag_seconds",
            "How late the daemon's event loop ran a task that was due (seconds).",
            LOOP_LAG_BUCKETS,
        )
        # process_cpu_seconds_total, process_resident_memory_bytes, ... of the daemon.
        ProcessCollector(registry=self.registry)
        self._observers = {
            "ttft": self.time_to_first_token.observe,
            "itl": self.inter_token_latency.observe,
            "e2e": self.e2e_request_latency.observe,
            "prompt_tokens": self._prompt_tokens,
            "generation_tokens": self.generation_tokens.inc,
            "queue": self.num_requests_waiting.set,
            "running": self.num_requests_running.set,
            "prefix_queries": self.prefix_cache_queries.inc,
            "prefix_hits": self.prefix_cache_hits.inc,
            "prefix_shared": self.prefix_shared.inc,
            "prefix_kept_hits": self.prefix_kept.inc,
            "block_size": self.spec_decode_block_size.observe,
            "batch_size": self.batch_size.observe,
            "preemptions": self.num_preemptions.inc,
            "loop_lag": self.event_loop_lag.observe,
        }

    # -- what the engine calls ----------------------------------------------------------------

    def observe(self, what: str, value: float) -> None:
        """One observation by short name (the engine's vocabulary):

        ttft, itl, e2e: seconds; prompt_tokens: one request's prompt length (counter and
        per-request histogram); generation_tokens: tokens just generated; queue, running:
        the current number of waiting / running requests; prefix_queries / prefix_hits:
        prompt tokens looked up in / restored from the prefix cache; prefix_shared: prompt
        tokens shared from a running (or kept) request's K/V blocks; prefix_kept_hits:
        those of a finished request kept in the pool; block_size: the
        block of one speculative step; batch_size: the sequences of one batched step;
        preemptions: requests just preempted; loop_lag: how late the event loop ran a
        task that was due (seconds; the daemon's watchdog).
        """
        try:
            observer = self._observers[what]
        except KeyError:
            # A typo in the engine should fail its tests, not vanish from the dashboard.
            raise ValueError(
                f"unknown metric {what!r}; expected one of {sorted(self._observers)}"
            ) from None
        observer(value)
        self.timeline.add(what, value)

    def request_finished(self, request: FinishedRequest) -> None:
        """A request ended, whatever the reason: count it by its finish reason and observe
        its latency, its phases (those it reached) and the tokens it generated. The engine
        calls this once per request, after setting its finish reason."""
        if request.finish_reason is None:
            raise ValueError("request_finished needs a finished request (finish_reason is None)")
        self.observe("e2e", time.monotonic() - request.submitted_at)
        self.finished(request.finish_reason)
        self.request_generation_tokens.observe(request.completion_tokens)
        admitted, first, last = request.admitted_at, request.first_token_at, request.last_token_at
        if admitted is not None:
            self.request_queue_time.observe(admitted - request.submitted_at)
            if first is not None:
                self.request_prefill_time.observe(first - admitted)
        if first is not None and last is not None:
            self.request_decode_time.observe(last - first)

    def finished(self, reason: str) -> None:
        """A request ended with reason stop | length | abort | error."""
        try:
            self.request_success[reason].inc()
        except KeyError:
            raise ValueError(
                f"unknown finish reason {reason!r}; expected one of {FINISH_REASONS}"
            ) from None

    def rejected(self, reason: str) -> None:
        """A submission refused: max_queue | max_queued_tokens (429),
        context_length_exceeded (400), loading | draining | degraded (503)."""
        self._rejected.labels(**self._base, reason=reason).inc()

    def observe_spec_decode(self, num_draft_tokens: int, accepted_per_pos: Sequence[int]) -> None:
        """One speculative step: num_draft_tokens proposed; accepted_per_pos[i] is 1 if
        the token at draft position i was accepted (so sum = accepted tokens)."""
        accepted = sum(accepted_per_pos)
        self.spec_decode_num_drafts.inc()
        self.spec_decode_num_draft_tokens.inc(num_draft_tokens)
        self.spec_decode_num_accepted_tokens.inc(accepted)
        self.timeline.add("draft_tokens", num_draft_tokens)
        self.timeline.add("accepted_tokens", accepted)
        for pos, n in enumerate(accepted_per_pos):
            if n:
                self._accepted_per_pos.labels(**self._base, position=str(pos)).inc(n)

    def _prompt_tokens(self, n: float) -> None:
        self.prompt_tokens.inc(n)
        self.request_prompt_tokens.observe(n)

    def set_queue(self, *, running: int, waiting: int) -> None:
        self.num_requests_running.set(running)
        self.num_requests_waiting.set(waiting)

    def refresh(self, status: Mapping[str, Any]) -> None:
        """Set the gauges (the timeline's too) from `Engine.status()`: called on every
        scrape and, by the HTTP app, once a second."""
        queue = status.get("queue") or {}
        self.set_queue(running=int(queue.get("running", 0)), waiting=int(queue.get("waiting", 0)))
        self.kv_cache_usage.set(float(queue.get("kv_usage", 0.0)))
        for what, key in _QUEUE_KEYS.items():
            self.timeline.add(what, float(queue.get(key, 0)))
        cache = status.get("prefix_cache") or {}
        disk = int(cache.get("disk_bytes", 0)) + int(cache.get("disk_block_bytes", 0))
        for tier, held in (("memory", int(cache.get("memory_bytes", 0))), ("disk", disk)):
            self._prefix_cache_bytes.labels(**self._base, tier=tier).set(held)
        flash = status.get("kv_flash") or {}
        # The pager keeps running totals (as do the MoE expert counters).
        flash_counters = {"evictions": self.kv_flash_evictions, "recalls": self.kv_flash_recalls}
        self._advance(flash, flash_counters, self._kv_flash_seen)
        self._kv_flash_host_bytes.set(int(flash.get("host_bytes", 0)))
        self._advance(status.get("moe_experts") or {}, self._moe, self._moe_seen)

    @staticmethod
    def _advance(totals: Mapping[str, Any], counters: Mapping[str, Any], seen: dict) -> None:
        """Counters from running totals: each advances by what is new since the last scrape."""
        for key, counter in counters.items():
            total = int(totals.get(key, 0))
            if total > seen[key]:
                counter.inc(total - seen[key])
                seen[key] = total

    # -- exposition ---------------------------------------------------------------------------

    def exposition(self) -> bytes:
        """The registry in Prometheus' classic text format (CONTENT_TYPE).

        Always this format, whatever the scraper's Accept header says: every Prometheus
        reads it, and prometheus_client's OpenMetrics writer escapes the `:` in sample
        names but not in HELP/TYPE lines, which would split each metric in two.
        """
        return generate_latest(_WithoutCreated(self.registry))


# The daemon's own families, whatever the models: one event loop, one process (process_*).
DAEMON_FAMILIES = frozenset({NAMESPACE + "event_loop_lag_seconds"})


def _daemon_own(family: str) -> bool:
    return family in DAEMON_FAMILIES or not family.startswith(NAMESPACE)


def merged_exposition(daemon: Metrics, models: Iterable[Metrics]) -> bytes:
    """Several models' metrics and the daemon's own as one exposition: each family once,
    with every model's samples (told apart by their model_name label)."""
    return generate_latest(_Merged(daemon, list(models)))


class _Merged:
    """A collector of the daemon's families from `daemon` and the rest from `models`."""

    def __init__(self, daemon: Metrics, models: list[Metrics]) -> None:
        self._parts = [(daemon.registry, True)] + [(m.registry, False) for m in models]

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for registry, own in self._parts:
            for metric in registry.collect():
                if _daemon_own(metric.name) != own:
                    continue
                samples = _without_created(metric.samples)
                if metric.name in families:
                    families[metric.name].samples += samples
                else:
                    metric.samples = samples
                    families[metric.name] = metric
        yield from families.values()


class _WithoutCreated:
    """A collector view of a registry minus the `<name>_created` timestamp samples."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry

    def collect(self) -> Iterator[Metric]:
        for metric in self._registry.collect():
            metric.samples = _without_created(metric.samples)
            yield metric


def _without_created(samples: Iterable[Any]) -> list[Any]:
    return [s for s in samples if not s.name.endswith("_created")]
