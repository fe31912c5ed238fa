"""Token sampling: penalties, temperature, top_k / top_p / min_p truncation, seeded draws.

Processing of a logits row, in order (the order of Hugging Face `generate`; llama.cpp's
default chain differs in applying temperature last, after the truncations):

    logits [n, vocab]
      -> penalties over each row's recent tokens: repetition (HF / llama.cpp: divide a positive
         logit, multiply a negative one), then frequency / presence (OpenAI: subtract
         freq * count + presence * (count > 0)); all three count the last `penalty_window`
         tokens of prompt + output, as llama.cpp's `penalty_last_n` does
      -> logit_bias (OpenAI): each listed token's bias added to its logit
      -> a grammar's mask (`bias`, when given): -inf added to every token it refuses
      -> temperature: divide (0 = greedy: argmax here, nothing below applies)   = "processed"
      -> top_k -> top_p -> min_p: mask to -inf, each stage on the renormalized survivors of
         the previous one, as HF's warpers do                                    = "truncated"
      -> draw from softmax(truncated) with the request's own torch.Generator

`probs()` returns softmax(truncated) scattered back to [n, vocab] (one-hot for greedy): the
distribution `sample()` draws from, which speculative rejection sampling needs for both the
target and the draft.

Logprobs are log_softmax of the *processed* logits (after penalties, logit_bias, a grammar's
mask and temperature, before truncation; temperature counts as 1 when greedy). We chose this
over the raw model distribution that OpenAI reports because it describes the distribution the
token was actually drawn from, and over the truncated one because that gives -inf to most of
the top-k alternatives. With the default parameters (temperature 1, no penalties, no grammar)
it is the raw model distribution, so OpenAI-style clients see the numbers they expect.

Cost at vocab 262144 on CPU: no Python loop touches the vocabulary. With top_k set the
truncations work on the top_k candidates from `torch.topk`, never a full sort. top_p without
top_k first tries the top 1024, then 16384 tokens, and sorts the full row only when those
hold less than top_p of the mass (a very flat distribution). The draw is an inverse CDF
with one uniform per row.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from luced.sampling_params import SamplingParams

__all__ = [
    "History",
    "SampleOutput",
    "Sampler",
    "SamplingParams",
    "apply_penalties",
    "probs",
    "sample",
]

# One token history per logits row: the tokens (prompt + output) that precede that row's
# position. Python ints or a 1-D integer tensor; only the last `penalty_window` are read.
History = Sequence[Sequence[int] | torch.Tensor]

# Prefix lengths top_p tries (with torch.topk) before a full sort of the row, which costs
# far more at a large vocabulary (docs/performance.md, "Measurements behind the code").
# A trained LM's nucleus almost always lies inside the first; high temperatures need the
# second.
_TOP_P_PREFIXES = (1024, 16384)

# Safety for every value SamplingParams accepts (tests/runtime/test_sampler.py checks it with
# hypothesis). Logits are float32, so a Python float outside float32 range turns into 0 or
# inf on the way in: temperature 1e-300 would divide by 0 (NaN at the row max), 1e308 by inf,
# and repetition_penalty 5e-324 would make a logit inf (inf - inf = NaN at the shift). NaN
# probabilities make the inverse-CDF draw return an id past the vocabulary. So penalized
# logits are clamped to finite float32, and the temperature to a range where the
# division neither overflows to NaN nor underflows: below 1e-30 the draw is greedy in all
# but name; above 1e30 it is uniform over the survivors.
_F32_MAX = torch.finfo(torch.float32).max
_TEMPERATURE_RANGE = (1e-30, 1e30)


@dataclass(frozen=True, slots=True)
class SampleOutput:
    tokens: torch.Tensor  # [n] int64
    # Present when params.logprobs is not None; from log_softmax of the processed logits.
    logprobs: torch.Tensor | None = None  # [n] float32, of the chosen tokens
    top_ids: torch.Tensor | None = None  # [n, k] int64, most likely first
    top_logprobs: torch.Tensor | None = None  # [n, k] float32


@dataclass(frozen=True, slots=True)
class _Candidates:
    """The tokens left after truncation, as processed logits with dropped ones at -inf."""

    logits: torch.Tensor  # [n, m]
    ids: torch.Tensor | None  # [n, m] vocab ids of the columns; None = all of vocab (m == vocab)


def apply_penalties(
    logits: torch.Tensor, params: SamplingParams, history: History | None
) -> torch.Tensor:
    """Repetition, frequency and presence penalties; returns a new tensor when any apply."""
    if history is None or not params.has_penalties:
        return logits
    n, vocab = logits.shape
    if len(history) != n:
        raise ValueError(f"history has {len(history)} rows, logits have {n}")
    window = params.penalty_window
    recent = []
    for row, tokens in enumerate(history):
        t = torch.as_tensor(tokens if window < 0 else tokens[-window:], dtype=torch.int64)
        if t.ndim != 1:
            raise ValueError(f"history row {row} must be 1-D, got shape {tuple(t.shape)}")
        recent.append(t.cpu())
    flat = torch.cat(recent)  # history is host-side token ids; count on the host
    if flat.numel() == 0:
        return logits
    if int(flat.min()) < 0 or int(flat.max()) >= vocab:
        raise ValueError(f"history holds token ids outside the vocabulary [0, {vocab})")
    row_of = torch.repeat_interleave(torch.arange(n), torch.tensor([len(t) for t in recent]))
    # (row, token) as one key so that a single `unique` counts every row.
    uniq, counts = torch.unique(row_of * vocab + flat, return_counts=True)
    uniq = uniq.to(logits.device)
    rows, toks = uniq // vocab, uniq % vocab
    counts = counts.to(device=logits.device, dtype=logits.dtype)

    out = logits.clone()
    vals = out[rows, toks]  # [u] one entry per distinct (row, token)
    if params.repetition_penalty != 1.0:
        rp = params.repetition_penalty
        vals = torch.where(vals > 0, vals / rp, vals * rp)
    # Every distinct key has count >= 1, so the presence term applies to all of them.
    vals = vals - params.frequency_penalty * counts - params.presence_penalty
    out[rows, toks] = vals
    return out


def _processed(
    logits: torch.Tensor,
    params: SamplingParams,
    history: History | None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Penalized, masked logits divided by the temperature: [n, vocab] float32.
    `bias`: float32 [n, vocab], 0 where a grammar allows the token and -inf where it
    does not (``luced.runtime.token_mask``)."""
    if logits.ndim != 2:
        raise ValueError(f"logits must be [n, vocab], got shape {tuple(logits.shape)}")
    x = apply_penalties(logits.float(), params, history)
    if params.has_penalties:
        # Extreme penalties overflow float32 (inf, or 0 * inf = NaN); keep every logit finite
        # so the row max is finite and argmax never picks a NaN.
        x = torch.nan_to_num(x, nan=-_F32_MAX, posinf=_F32_MAX, neginf=-_F32_MAX)
    if params.logit_bias:
        x = _add_logit_bias(x, params.logit_bias)
    if bias is not None:  # out of place: x may be the caller's logits
        x = x + bias.to(x.device)
    if params.greedy:
        return x
    lo, hi = _TEMPERATURE_RANGE
    t = min(max(params.temperature, lo), hi)
    # Shift by the row max first: softmax is unchanged and a tiny temperature cannot overflow.
    # The max is finite (a mask leaves at least one token), so every row keeps a 0.
    return (x - x.amax(dim=-1, keepdim=True)).div_(t)


def _add_logit_bias(x: torch.Tensor, logit_bias: Sequence[tuple[int, float]]) -> torch.Tensor:
    """x [n, vocab] with each (id, bias) added to column id of every row; a new tensor (x
    may be the caller's logits). The same adds on every row, so a row's result does not
    depend on what else shares the batch."""
    vocab = x.shape[-1]
    if logit_bias[-1][0] >= vocab:  # sorted by id (SamplingParams)
        raise ValueError(f"logit_bias names token {logit_bias[-1][0]}, outside [0, {vocab})")
    ids = torch.tensor([token for token, _ in logit_bias], device=x.device)
    values = torch.tensor([b for _, b in logit_bias], dtype=x.dtype, device=x.device)
    # A finite float32 plus at most 100 stays finite (it rounds at the edge of the range).
    return x.index_add(1, ids, values.expand(x.shape[0], -1))


def _truncate(x: torch.Tensor, params: SamplingParams) -> _Candidates:
    """top_k -> top_p -> min_p over processed logits x [n, vocab]."""
    vocab = x.shape[-1]
    logits, ids = x, None
    if 0 < params.top_k < vocab:
        logits, ids = torch.topk(x, params.top_k, dim=-1)  # sorted, most likely first
    if params.top_p < 1.0:
        if ids is None:
            lse = torch.logsumexp(x, dim=-1, keepdim=True)  # mass over the full vocabulary
            logits, ids = _sorted_prefix(x, lse, params.top_p)
        else:
            lse = torch.logsumexp(logits, dim=-1, keepdim=True)  # renormalized over top_k
        p = torch.exp(logits - lse)
        # Keep a token while the mass of the tokens before it is below top_p: the smallest
        # prefix reaching top_p (HF: drop where the ascending cumsum <= 1 - top_p).
        before = torch.cumsum(p, dim=-1)
        before = torch.cat([torch.zeros_like(before[:, :1]), before[:, :-1]], dim=-1)
        drop = before >= params.top_p
        drop[:, 0] = False  # the top token always stays (a top_p below float32's tiny is 0)
        logits = logits.masked_fill(drop, -math.inf)
    if params.min_p > 0.0:
        # p_i < min_p * p_max  <=>  logit_i < logit_max + log(min_p); renormalizing does not
        # change probability ratios, so this holds after the earlier truncations too.
        threshold = logits.amax(dim=-1, keepdim=True) + math.log(params.min_p)
        logits = logits.masked_fill(logits < threshold, -math.inf)
    return _Candidates(logits, ids)


def _sorted_prefix(
    x: torch.Tensor, lse: torch.Tensor, top_p: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Descending (logits, ids) long enough to hold every token top_p keeps."""
    for k in _TOP_P_PREFIXES:
        if k >= x.shape[-1]:
            break
        vals, ids = torch.topk(x, k, dim=-1)
        mass = torch.exp(vals - lse).sum(dim=-1)
        # If the prefix already holds top_p of the mass, every later token is dropped.
        # (One host sync; the sampled tokens need one anyway.)
        if bool((mass >= top_p).all()):
            return vals, ids
    return torch.sort(x, dim=-1, descending=True)


def draw(p: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One column index per row of p [n, m], column j with probability p[:, j] / sum(p)."""
    if p.device.type == "mps":  # no float64 on MPS: the exponential race needs none
        race = torch.empty_like(p).exponential_(generator=generator).clamp_min_(1e-30)
        return (p / race).argmax(dim=-1)
    # Inverse CDF in float64: one uniform per row, and a token's share of [0, total) is its
    # float32 probability almost exactly (a float32 CDF would quantize every token to 2^-24,
    # a visible error over a 262144-token tail). Cheaper on CPU than V exponentials.
    cdf = p.double().cumsum_(dim=-1)  # [n, m], non-decreasing
    total = cdf[:, -1:].contiguous()  # [n, 1]; searchsorted wants contiguous values
    u = torch.rand(total.shape, generator=generator, dtype=torch.float64, device=p.device)
    # First j with cdf[j] > u: a dropped token (p = 0) repeats the cdf before it, never wins.
    pick = torch.searchsorted(cdf, u * total, right=True)
    # u * total may round up to total; then take the last token with p > 0.
    last = torch.searchsorted(cdf, total, right=False)
    # The clamp is belt and braces: with a NaN row searchsorted answers m, past the row.
    return torch.minimum(pick, last).clamp_(max=p.shape[-1] - 1).squeeze(1)


def probs(
    logits: torch.Tensor,
    params: SamplingParams,
    history: History | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The distribution `sample` draws from: [n, vocab] float32, rows sum to 1.

    Greedy rows are one-hot at the argmax of the penalized (masked) logits.
    """
    x = _processed(logits, params, history, bias)
    if params.greedy:
        out = torch.zeros_like(x)
        return out.scatter_(1, x.argmax(dim=-1, keepdim=True), 1.0)
    cand = _truncate(x, params)
    p = torch.softmax(cand.logits, dim=-1)
    if cand.ids is None:
        return p
    return torch.zeros_like(x).scatter_(1, cand.ids, p)


def argmax_only(params: SamplingParams) -> bool:
    """Whether `sample` with `params` (and no grammar mask) draws each row's argmax of the
    raw logits and reports nothing else: greedy, no penalties, logit bias or logprobs."""
    return (
        params.greedy
        and not params.has_penalties
        and not params.logit_bias
        and params.logprobs is None
    )


def sample(
    logits: torch.Tensor,
    params: SamplingParams,
    history: History | None = None,
    generator: torch.Generator | None = None,
    bias: torch.Tensor | None = None,
) -> SampleOutput:
    """Pick one token per row of logits [n, vocab].

    `generator` must live on the logits' device; None uses torch's global generator. For a
    request's stream of steps use `Sampler`, which owns a seeded generator.
    """
    x = _processed(logits, params, history, bias)
    if params.greedy:
        tokens = x.argmax(dim=-1)
    else:
        cand = _truncate(x, params)
        # Rows of x have max 0, and truncation keeps the max: exp cannot overflow, and draw
        # normalizes by the CDF total, so no softmax pass is needed.
        pick = draw(torch.exp(cand.logits), generator)  # [n] column in cand
        tokens = pick if cand.ids is None else cand.ids.gather(1, pick[:, None]).squeeze(1)
    if params.logprobs is None:
        return SampleOutput(tokens)
    return _with_logprobs(x, tokens, params.logprobs)


def token_logprobs(
    logits: torch.Tensor,
    params: SamplingParams,
    tokens: torch.Tensor,
    history: History | None = None,
    bias: torch.Tensor | None = None,
) -> SampleOutput:
    """The logprobs `sample` would report had it drawn `tokens` [n] (params.logprobs = k):
    for tokens chosen elsewhere, e.g. by speculative verification."""
    x = _processed(logits, params, history, bias)
    return _with_logprobs(x, tokens, params.logprobs or 0)


def _with_logprobs(x: torch.Tensor, tokens: torch.Tensor, k: int) -> SampleOutput:
    """Chosen tokens' and the top k's log-probabilities under processed logits x."""
    lse = torch.logsumexp(x, dim=-1, keepdim=True)
    chosen = x.gather(1, tokens[:, None]).squeeze(1) - lse.squeeze(1)
    top_vals, top_ids = torch.topk(x, min(k, x.shape[-1]), dim=-1)
    return SampleOutput(tokens, chosen, top_ids, top_vals - lse)


class Sampler:
    """Samples one request's tokens; owns that request's random generator.

    The generator is created on the device of the first logits it sees, seeded from
    `params.seed` (same seed and same logits -> same tokens) or from fresh OS entropy. A
    request's draws depend only on its own generator, not on what else shares the batch.
    """

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self._generator: torch.Generator | None = None

    def generator_state(self) -> torch.Tensor | None:
        """The generator's state (None before its first draw), for `restore_generator`."""
        return None if self._generator is None else self._generator.get_state()

    def restore_generator(self, state: torch.Tensor | None) -> None:
        """Back to a state `generator_state` gave (draws made since are undone)."""
        if state is not None and self._generator is not None:
            self._generator.set_state(state)

    def generator(self, device: torch.device) -> torch.Generator:
        """The request's generator (also for the uniforms of speculative rejection sampling)."""
        if self._generator is None:
            g = torch.Generator(device=device)
            if self.params.seed is None:
                g.seed()
            else:
                g.manual_seed(self.params.seed)
            self._generator = g
        elif self._generator.device.type != device.type or (
            device.index is not None and self._generator.device.index != device.index
        ):
            raise ValueError(
                f"sampler's generator lives on {self._generator.device}, logits on {device}"
            )
        return self._generator

    def sample(
        self,
        logits: torch.Tensor,
        history: History | None = None,
        bias: torch.Tensor | None = None,
    ) -> SampleOutput:
        # Greedy: no randomness, so no generator is created at all.
        g = None if self.params.greedy else self.generator(logits.device)
        return sample(logits, self.params, history, g, bias)

    def probs(
        self,
        logits: torch.Tensor,
        history: History | None = None,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return probs(logits, self.params, history, bias)


def histories(sampler: Sampler, seen: list[int], n_out: int) -> list | None:
    """Each output row's penalty history (None without penalties), `seen` being every id
    fed so far: row i predicts position start + i + 1, so its history is everything fed up
    to and including start + i (the last row: all of it)."""
    if not sampler.params.has_penalties:
        return None
    end = len(seen)
    return [seen[: end - n_out + 1 + i] for i in range(n_out)]


def write_rows(out: dict[str, torch.Tensor], result: SampleOutput, row: int = 0) -> None:
    """A SampleOutput's rows into the output regions a frame named, from `row` on."""
    pairs = (
        ("ids", result.tokens),
        ("logprobs", result.logprobs),
        ("topk_ids", result.top_ids),
        ("topk_logprobs", result.top_logprobs),
    )
    n = result.tokens.shape[0]
    for name, value in pairs:
        if name in out and value is not None:
            out[name][row : row + n].copy_(value)  # casts int64 -> int32; device -> host
