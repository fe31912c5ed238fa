"""tools/replay_lookup.py: the replay's accounting on answers whose acceptance is known,
and the whole tool on a tiny random model."""

from __future__ import annotations

from tools import replay_lookup
from tools.replay_lookup import replay

# A verify of n tokens costs 1 + 0.25 (n - 1) plain steps.
COSTS = {n: 1.0 + 0.25 * (n - 1) for n in range(1, 17)}


def test_an_answer_with_nothing_to_copy_decodes_plainly() -> None:
    prompt, answer = list(range(100, 140)), list(range(200, 264))  # no token repeats
    for policy in replay_lookup.POLICIES:
        assert replay(prompt, answer, COSTS, policy, 16) == 1.0


def test_a_copied_answer_is_priced_by_its_verify_steps() -> None:
    prompt = list(range(100, 164))
    answer = prompt[10:42]  # 32 tokens: the first from the prefill, 31 copied
    # Fixed block 16: after the first token, "n2" matches can only start once two answer
    # tokens are out, so one plain step, then blocks of 16 (15 accepted + the target's
    # own) until the last, cut by the answer's end: 1 + 16 + 14 tokens.
    fixed = replay(prompt, answer, COSTS, "fixed", 16)
    assert fixed == 31 / (COSTS[1] + COSTS[16] + COSTS[14])
    # Hindsight drafts exactly what is accepted, so the same steps here.
    assert replay(prompt, answer, COSTS, "hindsight", 16) == fixed
    assert 1.0 < replay(prompt, answer, COSTS, "adaptive", 16) <= fixed


def test_a_copy_that_departs_costs_the_fixed_block_more_than_hindsight() -> None:
    prompt = list(range(100, 164))
    answer = [*prompt[10:20], 900, 901, 902, *prompt[30:50], 903, 904]
    fixed = replay(prompt, answer, COSTS, "fixed", 16)
    hindsight = replay(prompt, answer, COSTS, "hindsight", 16)
    assert 1.0 < fixed < hindsight


def test_the_tool_on_a_tiny_model() -> None:
    argv = "--model tiny-llama --workloads repeat --prompt 40 --tokens 24 --block-size 4"
    rows = replay_lookup.main([*argv.split(), "--rounds", "1", "--threads", "1"])
    (row,) = rows
    assert row["workload"] == "repeat" and row["context"] == 40
    # A repeated sentence: the lookup matches, and hindsight never drafts a rejected token.
    assert row["hindsight"] >= row["fixed"] and row["hindsight"] > 0
