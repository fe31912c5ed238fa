"""Verification of a drafted block: the acceptance rule of speculative decoding.

One speculative step (dflash-reference B.3) feeds the target the block

    d[0..B-1] = [anchor, proposal 1, ..., proposal B-1]

where the anchor d[0] is the last token already decided (emitted, not yet fed) and d[1..B-1]
are the draft's proposals. One target forward scores all B positions; row i of its output is
the target's next-token prediction after d[0..i]. This module decides, from those rows, which
tokens the step emits. It is pure: no model, no KV cache, no daemon state.

Definitions (the reference's, with `accept` renamed):

    accept        = 1 + the length of the longest prefix of proposals the target agrees with
                    (the reference counts the anchor, so 1 <= accept <= B)
    num_accepted  = accept - 1 = proposals accepted (vLLM's "accepted tokens")
    bonus         = the target's own token at row accept - 1 (after the last accepted token);
                    it exists for every accept, including accept == B (row B-1 is the
                    prediction after the whole block)
    emitted       = d[1..num_accepted] + [bonus]      (1 <= len <= B new tokens per step)

The reference's server drops the bonus when accept == B and instead re-runs the target over the
accepted tokens ("replay"); the z-lab reference and this module always keep it, so a step emits
num_accepted + 1 tokens. The bonus is not fed to the target: it is the next step's anchor, and
the KV / feature-ring positions of d[0..num_accepted] are the ones that stay (`num_kept`).

Inside the block the request's limits apply exactly as in plain decoding: the emitted tokens
are cut after `budget` tokens (max tokens left; the bonus, last in order, is the first to go)
and after the first EOS (the EOS is emitted, nothing after it). Stop strings need detokenized
text and stay with the daemon, which truncates `tokens` further the same way.

Sampled blocks are verified in the worker (``luced.runtime.dflash.verify``: rejection
sampling needs the distributions, which stay with torch); the daemon clips what they emit
with ``clip``. This module is plain Python: both processes import it.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Literal

Finish = Literal["stop", "length"]


@dataclass(frozen=True, slots=True)
class VerifyResult:
    """What one verified block emits.

    tokens: the new tokens to emit, in order: accepted proposals, then the target's token
        (the bonus, or the token drawn at the first rejection), cut by budget and EOS.
    num_accepted: proposals the acceptance rule accepted, before any cut (0..B-1); position j
        (0-based among the proposals) was accepted iff j < num_accepted.
    num_kept: block positions whose KV and captured features stay valid: the anchor plus the
        accepted proposals that were emitted (1..B). The target's cache is truncated to
        (position of d[0]) + num_kept; the next anchor is tokens[-1] when `finish` is None.
    finish: "stop" when an EOS was emitted (it is tokens[-1]), "length" when the budget ran out,
        None when the request goes on.
    """

    tokens: tuple[int, ...]
    num_accepted: int
    num_kept: int
    finish: Finish | None

    @property
    def has_bonus(self) -> bool:
        """True when the last token is the target's own rather than an accepted proposal."""
        return len(self.tokens) == self.num_accepted + 1


def verify_greedy(
    block: Sequence[int],
    target: Sequence[int],
    *,
    budget: int,
    eos_ids: Collection[int] = (),
) -> VerifyResult:
    """Greedy acceptance: keep proposals while they equal the target's argmax.

    block: d[0..B-1], anchor first. target: t[0..B-1], t[i] = the target's argmax after
    d[0..i]. Proposal d[i+1] is accepted iff d[i+1] == t[i] and every earlier one was; the
    bonus is t[num_accepted]. The output equals plain greedy decoding token for token.
    """
    n = len(block)
    if n < 1 or len(target) != n:
        raise ValueError(f"block has {n} tokens and target {len(target)}: need B >= 1 of each")
    accepted = 0
    while accepted < n - 1 and int(block[accepted + 1]) == int(target[accepted]):
        accepted += 1
    emitted = [int(x) for x in block[1 : accepted + 1]] + [int(target[accepted])]
    return clip(emitted, accepted, budget, eos_ids)


def clip(
    emitted: Sequence[int], accepted: int, budget: int, eos_ids: Collection[int] = ()
) -> VerifyResult:
    """Apply max tokens and EOS to the step's candidate tokens, as plain decoding would.
    (The daemon clips what a worker's sampled verify emitted with the request's limits.)"""
    if budget < 1:
        raise ValueError(f"budget (max tokens left) must be >= 1, got {budget}")
    out: list[int] = []
    finish: Finish | None = None
    for tok in emitted:
        out.append(tok)
        if tok in eos_ids:
            finish = "stop"
            break
        if len(out) == budget:
            finish = "length"
            break
    # Kept positions: the anchor plus every emitted proposal (the bonus is never fed).
    kept = 1 + min(len(out), accepted)
    return VerifyResult(tuple(out), accepted, kept, finish)
