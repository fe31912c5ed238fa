"""The adaptive block size's cost model and choice."""

from __future__ import annotations

import pytest

from luced.engine.spec.sizer import BlockSizer, StepCosts, expected_tokens


def costs(table: dict[int, float]) -> StepCosts:
    c = StepCosts()
    for n, s in table.items():
        c.observe(n, s)
    return c


def test_cost_interpolates_and_extrapolates() -> None:
    c = costs({1: 1.0, 4: 2.0, 16: 5.0})
    assert c.cost(4) == 2.0
    assert c.cost(10) == pytest.approx(3.5)
    assert c.cost(20) == pytest.approx(6.0)  # the last segment's slope
    assert StepCosts().cost(4) is None
    assert costs({1: 1.0}).cost(4) is None  # no speculative step measured


def test_smoothing_follows_new_measurements() -> None:
    c = costs({1: 1.0, 4: 2.0})
    for _ in range(50):
        c.observe(1, 3.0)
    assert c.cost(1) == pytest.approx(3.0, rel=1e-3)
    # The machine got 3x slower: block 4 is still twice a plain step, unobserved.
    assert c.cost(4) == pytest.approx(6.0, rel=1e-3)
    for _ in range(50):
        c.observe(4, 4.5)
    assert c.cost(4) == pytest.approx(4.5, rel=1e-3)
    assert costs({4: 2.0}).table() == {}  # no plain step to relate it to


def test_expected_tokens() -> None:
    assert expected_tokens(8, 0.0, 0.9) == 1.0
    assert expected_tokens(8, 1.0, 1.0) == 8.0
    assert expected_tokens(3, 0.5, 0.5) == pytest.approx(1.75)  # geometric: 1 + a + a^2
    assert expected_tokens(3, 1.0, 0.5) == pytest.approx(2.5)
    assert expected_tokens(1, 1.0, 1.0) == 1.0  # a plain step


# Verify of B costs 1 + 0.1 (B - 1) plain steps: cheap, as on a memory-bound device.
CHEAP_VERIFY = {1: 1.0, 2: 1.1, 16: 2.5}


def test_starts_at_the_configured_block() -> None:
    assert BlockSizer(costs(CHEAP_VERIFY), 16).next_block() == 16


def test_good_acceptance_drafts_long_blocks() -> None:
    sizer = BlockSizer(costs(CHEAP_VERIFY), 16)
    for _ in range(20):
        sizer.observe(15, 15)
    assert sizer.next_block() == 16


def test_poor_acceptance_decodes_plainly_then_probes() -> None:
    sizer = BlockSizer(costs(CHEAP_VERIFY), 16, probe_every=5, probe_block=4)
    for _ in range(20):
        sizer.observe(15, 0)
    assert sizer.next_block() == 1
    for _ in range(5):
        sizer.plain_step()
    assert sizer.next_block() == 4  # a probe
    sizer.observe(3, 0)
    assert sizer.next_block() == 1


def test_middling_acceptance_picks_the_best_rate() -> None:
    c = costs(CHEAP_VERIFY)
    sizer = BlockSizer(c, 16)
    for _ in range(30):
        sizer.observe(7, 3)  # ~ a = 0.75
    best = sizer.next_block()
    rates = {b: expected_tokens(b, *sizer.rates()) / c.cost(b) for b in range(2, 17)}
    assert best == max(rates, key=rates.get)
    assert 2 < best < 16


def test_kinds_are_learned_apart() -> None:
    """A lookup's copy under way is accepted whole, its fresh 2-gram matches never: the
    first get long blocks, the second plain steps, in the same request."""
    sizer = BlockSizer(costs(CHEAP_VERIFY), 16)
    for _ in range(20):
        sizer.observe(15, 15, "run")
        sizer.observe(3, 0, "n2")
    assert sizer.next_block("run") == 16
    assert sizer.next_block("n2") == 1
    first, then = sizer.rates("n3")  # not seen: the prior for a first proposal
    assert first == 0.5 and then > 0.9
    assert BlockSizer(costs(CHEAP_VERIFY), 16, priors={"run": 0.9}).rates("run")[0] == 0.9


def test_runs_outrate_a_per_proposal_rate() -> None:
    """Half the blocks accepted whole, half cut at once: a per-proposal rate would be ~0.9
    and a geometric model would draft short; split into first and later proposals the
    expectation is what happens, and long blocks pay."""
    sizer = BlockSizer(costs({1: 1.0, 2: 1.2, 16: 4.0}), 16)
    for _ in range(20):
        sizer.observe(15, 15)
        sizer.observe(15, 0)
    first, then = sizer.rates()
    assert first == pytest.approx(0.5, abs=0.05) and then > 0.95
    assert expected_tokens(16, first, then) == pytest.approx(8.3, abs=0.5)
    assert sizer.next_block() == 16
