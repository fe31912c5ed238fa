"""The Prometheus exposition, read back with prometheus_client's own text parser."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

import pytest
from prometheus_client.parser import text_string_to_metric_families

from luced.engine.metrics import CONTENT_TYPE, FINISH_REASONS, Metrics, merged_exposition

# The issue's list: vLLM's names under our namespace.
VLLM_NAMES = {
    "luced:time_to_first_token_seconds": "histogram",
    "luced:inter_token_latency_seconds": "histogram",
    "luced:e2e_request_latency_seconds": "histogram",
    "luced:num_requests_running": "gauge",
    "luced:num_requests_waiting": "gauge",
    "luced:prompt_tokens": "counter",
    "luced:generation_tokens": "counter",
    "luced:request_success": "counter",
    # The phases and sizes a vLLM Grafana dashboard plots.
    "luced:request_queue_time_seconds": "histogram",
    "luced:request_prefill_time_seconds": "histogram",
    "luced:request_decode_time_seconds": "histogram",
    "luced:request_generation_tokens": "histogram",
    "luced:request_prompt_tokens": "histogram",
}


def samples(m: Metrics) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels minus model_name): value}"""
    out = {}
    for family in text_string_to_metric_families(m.exposition().decode()):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            out[s.name, labels] = s.value
    return out


def test_vllm_names_and_types_are_exported() -> None:
    text = Metrics().exposition().decode()
    types = {f.name: f.type for f in text_string_to_metric_families(text)}
    assert VLLM_NAMES.items() <= types.items()
    # Counters appear with the _total suffix, as in vLLM's exposition.
    for name in ("prompt_tokens_total", "generation_tokens_total", "request_success_total"):
        assert re.search(rf"^luced:{name}[ {{]", text, re.MULTILINE), name
    assert "spec_decode_num_accepted_tokens_total" in text
    assert "_created" not in text  # the timestamp series are filtered out
    assert CONTENT_TYPE.startswith("text/plain; version=0.0.4")


def test_observations_show_up() -> None:
    m = Metrics("smol")
    m.observe("ttft", 0.05)
    m.observe("itl", 0.02)
    m.observe("itl", 0.03)
    m.observe("e2e", 1.2)
    m.observe("prompt_tokens", 12)
    m.observe("generation_tokens", 1)
    m.observe("generation_tokens", 1)
    m.observe("queue", 3)
    m.observe("running", 1)
    m.finished("length")
    s = samples(m)
    ttft = "luced:time_to_first_token_seconds"
    assert s[f"{ttft}_bucket", (("le", "0.04"),)] == 0
    assert s[f"{ttft}_bucket", (("le", "0.06"),)] == 1
    assert (s[f"{ttft}_count", ()], s[f"{ttft}_sum", ()]) == (1, 0.05)
    assert s["luced:inter_token_latency_seconds_count", ()] == 2
    assert s["luced:inter_token_latency_seconds_sum", ()] == pytest.approx(0.05)
    assert s["luced:e2e_request_latency_seconds_bucket", (("le", "1.5"),)] == 1
    assert s["luced:prompt_tokens_total", ()] == 12
    assert s["luced:request_prompt_tokens_sum", ()] == 12
    assert s["luced:generation_tokens_total", ()] == 2
    assert s["luced:num_requests_waiting", ()] == 3
    assert s["luced:num_requests_running", ()] == 1
    reasons = {
        r: s["luced:request_success_total", (("finished_reason", r),)] for r in FINISH_REASONS
    }
    assert reasons == {"stop": 0, "length": 1, "abort": 0, "error": 0}


def test_model_name_label_only_when_named() -> None:
    text = Metrics("SmolLM2-135M").exposition().decode()
    assert 'luced:num_requests_running{model_name="SmolLM2-135M"} 0.0' in text
    assert 'luced:request_success_total{finished_reason="stop",model_name="SmolLM2-135M"}' in text
    text = Metrics().exposition().decode()
    assert "\nluced:num_requests_running 0.0\n" in text
    assert '\nluced:request_success_total{finished_reason="stop"} 0.0\n' in text
    assert "model_name" not in text


def test_refresh_sets_gauges_from_engine_status() -> None:
    m = Metrics()
    m.observe("queue", 9)  # stale: the status wins on scrape
    queue = {"waiting": 2, "running": 1, "max_queue": 16, "kv_usage": 0.25}
    m.refresh({"state": "ready", "queue": queue})
    s = samples(m)
    assert (s["luced:num_requests_waiting", ()], s["luced:num_requests_running", ()]) == (2, 1)
    assert s["luced:kv_cache_usage_perc", ()] == 0.25


def test_the_prefix_cache_bytes_count_its_blocks_on_disk_too() -> None:
    """A cache of K/V blocks: memory is its records' bytes, disk its block files'."""
    m = Metrics()
    cache = {"memory_bytes": 6 << 20, "memory_block_bytes": 6 << 20, "disk_bytes": 0}
    m.refresh({"prefix_cache": {**cache, "disk_block_bytes": 4 << 20}})
    s = samples(m)
    bytes_of = {t: s["luced:prefix_cache_bytes", (("tier", t),)] for t in ("memory", "disk")}
    assert bytes_of == {"memory": 6 << 20, "disk": 4 << 20}


def test_spec_decode_counters() -> None:
    m = Metrics()
    m.observe_spec_decode(4, [1, 1, 0, 0])
    m.observe_spec_decode(4, [1, 0, 0, 0])
    s = samples(m)
    assert s["luced:spec_decode_num_drafts_total", ()] == 2
    assert s["luced:spec_decode_num_draft_tokens_total", ()] == 8
    assert s["luced:spec_decode_num_accepted_tokens_total", ()] == 3
    per_pos = "luced:spec_decode_num_accepted_tokens_per_pos_total"
    assert (s[per_pos, (("position", "0"),)], s[per_pos, (("position", "1"),)]) == (2, 1)


def test_unknown_names_fail_loudly() -> None:
    m = Metrics()
    with pytest.raises(ValueError, match="unknown metric 'tfft'"):
        m.observe("tfft", 1.0)
    with pytest.raises(ValueError, match="unknown finish reason 'done'"):
        m.finished("done")


def test_each_instance_has_its_own_registry() -> None:
    a, b = Metrics(), Metrics()  # would raise "Duplicated timeseries" on a shared registry
    a.observe("generation_tokens", 5)
    assert samples(b)["luced:generation_tokens_total", ()] == 0


@dataclass
class Ended:
    """A request as the engine's handle holds it at its end (Metrics.FinishedRequest)."""

    finish_reason: str | None
    completion_tokens: int
    submitted_at: float
    admitted_at: float | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None


def test_a_finished_request_gives_its_phases() -> None:
    m = Metrics("smol")
    t0 = time.monotonic() - 10.0
    # Waited 0.2 s, prefilled 0.7 s, decoded 4 s; then one cancelled while queued.
    m.request_finished(Ended("stop", 9, t0, t0 + 0.2, t0 + 0.9, t0 + 4.9))
    m.request_finished(Ended("abort", 0, time.monotonic()))
    s = samples(m)

    def histogram(name: str) -> tuple[float, float]:
        return s[f"luced:{name}_count", ()], s[f"luced:{name}_sum", ()]

    assert histogram("request_queue_time_seconds") == (1, pytest.approx(0.2))
    assert histogram("request_prefill_time_seconds") == (1, pytest.approx(0.7))
    assert histogram("request_decode_time_seconds") == (1, pytest.approx(4.0))
    assert histogram("request_generation_tokens") == (2, 9)
    assert s["luced:request_generation_tokens_bucket", (("le", "10.0"),)] == 2
    assert s["luced:request_generation_tokens_bucket", (("le", "5.0"),)] == 1
    count, total = histogram("e2e_request_latency_seconds")
    assert count == 2 and 10.0 <= total < 60.0
    reasons = {
        r: s["luced:request_success_total", (("finished_reason", r),)] for r in FINISH_REASONS
    }
    assert reasons == {"stop": 1, "length": 0, "abort": 1, "error": 0}
    with pytest.raises(ValueError, match="needs a finished request"):
        m.request_finished(Ended(None, 0, t0))


def test_process_metrics_are_exported() -> None:
    """prometheus_client's process collector, as vLLM exports it (no model_name label)."""
    s = samples(Metrics("smol"))
    assert s["process_resident_memory_bytes", ()] > 0
    assert s["process_cpu_seconds_total", ()] >= 0
    assert s["process_open_fds", ()] >= 3


def test_merged_exposition_shows_each_family_once_with_every_model() -> None:
    """Several models: one page, each family once, each model's series by its label, and
    the event loop's lag once, the daemon's own (no model label)."""
    daemon, a, b = Metrics(), Metrics("a"), Metrics("b")
    a.finished("stop")
    b.finished("stop")
    b.finished("length")
    daemon.observe("loop_lag", 0.002)
    a.observe("loop_lag", 9.0)  # not the daemon's: left out
    text = merged_exposition(daemon, [a, b]).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    names = [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")]
    assert len(names) == len(set(names))  # each family once
    done = {
        (s.labels["model_name"], s.labels["finished_reason"]): s.value
        for s in families["luced:request_success"].samples
    }
    assert (done[("a", "stop")], done[("b", "stop")], done[("b", "length")]) == (1, 1, 1)
    (count,) = [
        s for s in families["luced:event_loop_lag_seconds"].samples if s.name.endswith("_count")
    ]
    assert count.labels == {} and count.value == 1
    (rss,) = families["process_resident_memory_bytes"].samples  # one process, once
    assert rss.labels == {} and rss.value > 0
    assert "_created" not in text
