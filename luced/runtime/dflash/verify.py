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

Sampled requests (temperature > 0) use speculative rejection sampling (Leviathan et al. 2023,
Chen et al. 2023): proposal x_i, drawn from the draft's distribution q_i, is accepted with
probability min(1, p_i(x) / q_i(x)); at the first rejection the step's last token is drawn from
normalize(max(0, p_i - q_i)); if all are accepted the bonus is drawn from p at the last row.
Every emitted token then follows the target's distribution p exactly, whatever q is. p and q
must be the *processed* distributions (`luced.runtime.sampler.probs` with the request's
SamplingParams: temperature, top_k, top_p, min_p), so "exact" means exactly what plain decoding
with the same parameters would sample from.

Penalties make row i's distribution depend on the tokens before it, which inside a block
include the proposals d[1..i]: the worker penalizes each of the B rows with its own history
(prompt + output + d[1..i]) for the target's argmax / p, so greedy and sampled speculation
stay exact with penalties too (the draft's q may ignore them: any q is exact).

The greedy rule and the clipping are plain Python, and torch is
imported only inside `verify_sampled`: the daemon (which never imports torch) may run the
greedy rule on the argmax ids a worker returns.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import torch

__all__ = [
    "VerifyResult",
    "clip",
    "residual_distribution",
    "verify_greedy",
    "verify_sampled",
]

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


def verify_sampled(
    block: Sequence[int] | torch.Tensor,
    p: torch.Tensor,
    q: torch.Tensor,
    generator: torch.Generator,
    *,
    budget: int,
    eos_ids: Collection[int] = (),
) -> VerifyResult:
    """Speculative (rejection) sampling of one block; emitted tokens follow p exactly.

    block: d[0..B-1], anchor first (the anchor only counts towards `num_kept`).
    p: [B, vocab] the target's processed distributions; p[i] follows d[0..i].
    q: [B-1, vocab] the draft's processed distributions the proposals were drawn from;
        q[i] is the one for d[i+1]. (A DFlash draft's output row i is its guess for d[i], so
        pass its rows 1..B-1.) A draft that proposes its argmax has one-hot rows; then a
        proposal is accepted with probability p(x).
    generator: the request's (`Sampler.generator(p.device)`). Each call draws B-1 uniforms and
        then one token, whatever is accepted, so the same generator state gives the same result.
    """
    import torch

    from luced.runtime.sampler import _draw

    n = len(block)
    vocab = p.shape[-1] if p.ndim == 2 else -1
    if n < 1 or p.ndim != 2 or p.shape[0] != n:
        raise ValueError(f"p must be [B={n}, vocab], got shape {tuple(p.shape)}")
    if tuple(q.shape) != (n - 1, vocab):
        raise ValueError(f"q must be [B-1={n - 1}, {vocab}], got shape {tuple(q.shape)}")
    if isinstance(block, torch.Tensor):  # no per-element host sync for a device tensor
        proposals = block[1:].to(device=p.device, dtype=torch.int64)
    else:
        proposals = torch.tensor([int(x) for x in block[1:]], dtype=torch.int64, device=p.device)
    if proposals.numel() and (int(proposals.min()) < 0 or int(proposals.max()) >= vocab):
        raise ValueError(f"proposals hold token ids outside the vocabulary [0, {vocab})")

    rows = torch.arange(n - 1, device=p.device)
    # float64 so that p(x)/q(x) near 1 is not decided by float32 rounding of the uniform.
    px = p[rows, proposals].double()
    qx = q[rows, proposals].double()
    if bool((qx <= 0).any()):
        # Impossible if x was drawn from q: the caller passed the wrong rows or distributions.
        raise ValueError("a proposal has zero draft probability: q is not what it was drawn from")
    u = torch.rand(n - 1, generator=generator, dtype=torch.float64, device=p.device)
    ok = u * qx < px  # P(u < p/q) = min(1, p/q); p(x) = 0 never passes
    accepted = int(ok.long().cumprod(0).sum()) if n > 1 else 0

    # At the first rejection: the residual; with every proposal accepted: the bonus from p.
    dist = residual_distribution(p[accepted], q[accepted]) if accepted < n - 1 else p[accepted]
    # .float(): _draw's cumsum works in place on a float64 input, which would be a view of p.
    last = int(_draw(dist[None, :].float(), generator)[0])
    emitted = [*proposals[:accepted].tolist(), last]
    return clip(emitted, accepted, budget, eos_ids)


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """normalize(max(0, p - q)) for one row [vocab]; p itself when that is all zero.

    A rejection at a row needs p(x) < q(x) for the proposal x, and since both sum to 1 some
    other token then has p > q: the residual is all zero only where p == q, where nothing is
    ever rejected. Falling back to p keeps the function total (rounding in a caller's p, q).
    """
    import torch

    r = (p - q).clamp_min_(0.0)
    total = r.sum()
    return torch.where(total > 0, r / total.clamp_min(torch.finfo(r.dtype).tiny), p)


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
