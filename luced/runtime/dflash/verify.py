"""Speculative rejection sampling of a drafted block, in the worker that holds the head.

The block, its rows and the acceptance terms (``accept``, ``num_accepted``, bonus,
``num_kept``) are defined in ``luced.acceptance``, which also has the greedy rule and
``clip``; this module is the sampled rule, which needs the distributions themselves.

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
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch

from luced.acceptance import VerifyResult, clip
from luced.runtime.sampler import draw


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
    # .float(): draw's cumsum works in place on a float64 input, which would be a view of p.
    last = int(draw(dist[None, :].float(), generator)[0])
    emitted = [*proposals[:accepted].tolist(), last]
    return clip(emitted, accepted, budget, eos_ids)


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """normalize(max(0, p - q)) for one row [vocab]; p itself when that is all zero.

    A rejection at a row needs p(x) < q(x) for the proposal x, and since both sum to 1 some
    other token then has p > q: the residual is all zero only where p == q, where nothing is
    ever rejected. Falling back to p keeps the function total (rounding in a caller's p, q).
    """
    r = (p - q).clamp_min_(0.0)
    total = r.sum()
    return torch.where(total > 0, r / total.clamp_min(torch.finfo(r.dtype).tiny), p)
