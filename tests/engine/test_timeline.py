"""The per-second timeline the web page plots, on a clock the test moves."""

from __future__ import annotations

import pytest

from luced.engine.metrics import Metrics
from luced.engine.timeline import COLUMNS, Timeline


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_sums_means_and_gaps_per_second() -> None:
    clock = Clock(1000.2)
    tl = Timeline(span=60, clock=clock)
    for _ in range(3):
        tl.add("generation_tokens", 1)
    tl.add("ttft", 0.5)
    tl.add("itl", 0.02)
    tl.add("itl", 0.04)
    tl.add("batch_size", 2)
    tl.add("e2e", 9.0)  # not plotted: ignored
    clock.t = 1001.7  # second 1001: nothing observed
    tl.add("running", 1)  # a gauge alone keeps the second
    clock.t = 1003.1
    cols = tl.since()
    assert set(cols) == set(COLUMNS)
    assert cols["t"] == [1000, 1001, 1002]  # 1003 is still running
    assert cols["generation_tokens"] == [3, 0, 0]
    assert cols["ttft_s"] == [0.5, None, None]
    assert cols["itl_s"] == [pytest.approx(0.03), None, None]
    assert cols["batch_size"] == [2, None, None]
    assert cols["acceptance"] == [None, None, None]
    # Gauges: the last value seen, carried over the quiet second 1002.
    assert cols["running"] == [0, 1, 1]


def test_since_returns_only_newer_whole_seconds() -> None:
    clock = Clock(500.0)
    tl = Timeline(span=60, clock=clock)
    tl.add("prompt_tokens", 7)
    clock.t = 503.5
    tl.add("prompt_tokens", 5)
    clock.t = 505.0
    assert tl.since(501)["t"] == [502, 503, 504]
    assert tl.since(501)["prompt_tokens"] == [0, 5, 0]
    assert tl.since(504.9)["t"] == []  # nothing whole after 504 yet
    assert tl.since()["t"][0] == 500  # nothing made up before the timeline began


def test_span_bounds_what_is_kept() -> None:
    clock = Clock(0.0)
    tl = Timeline(span=10, clock=clock)
    for t in range(100):
        clock.t = t + 0.5
        tl.add("generation_tokens", t)
        tl.add("queue", t % 3)
    assert len(tl._seconds) == 10
    cols = tl.since()
    assert cols["t"] == list(range(90, 99))
    assert cols["generation_tokens"] == list(range(90, 99))
    assert cols["waiting"] == [t % 3 for t in range(90, 99)]


def test_metrics_feed_the_timeline() -> None:
    m = Metrics("smol")
    clock = Clock(2000.5)
    m.timeline = Timeline(clock=clock)
    m.observe("generation_tokens", 1)
    m.observe("ttft", 0.25)
    m.observe_spec_decode(4, [1, 1, 0, 0])
    m.observe_spec_decode(4, [1, 0, 0, 0])
    m.refresh({"queue": {"running": 2, "waiting": 3, "kv_usage": 0.5}})
    clock.t = 2001.0
    row = {k: v[0] for k, v in m.timeline.since(1999).items()}
    assert row == {
        "t": 2000,
        "generation_tokens": 1,
        "prompt_tokens": 0,
        "ttft_s": 0.25,
        "itl_s": None,
        "batch_size": None,
        "acceptance": 3 / 8,
        "running": 2,
        "waiting": 3,
        "kv_usage": 0.5,
    }
