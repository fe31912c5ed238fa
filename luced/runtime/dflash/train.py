"""Training a DFlash draft: the block loss over one sequence, upstream's recipe.

    draft = trainable(Draft.load(init_path, ...))          # its weights become leaf tensors
    anchors = sample_anchors(n_tokens, answer_start, 64, block, gen)
    out = block_loss(draft, edges, features, ids, anchors, gamma=4.0)
    out.loss.backward()

One forward covers every block of a sequence (`Draft.hidden_states` with anchors): block j
is `[ids[a_j], mask × (B−1)]` at positions a_j .. a_j+B−1, sees the target's captured
features strictly before a_j (the anchor's own features do not exist yet at inference) and
its own block bidirectionally, never another block. Positions 1..B−1 are scored against
ids[a_j+k] with cross-entropy weighted exp(−(k−1)/γ). The target's embedding and head
(`edges`, a `Model` holding only them) are frozen and shared: no gradient reaches them.

The draft's matrices stay in `layers.store_matrix` layout, so the same `Draft` serves the
worker after training: `export_weights` gives them back under the safetensors names.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from luced.runtime.dflash.draft import Draft
from luced.runtime.dflash.loader import EDGE_TENSORS, LAYER_TENSORS
from luced.runtime.layers import matrix_rows
from luced.runtime.model import Model


def native_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX512-BF16 or AMX): there bf16 autocast
    is several times faster than float32 on GEMMs; elsewhere bf16 is emulated and slower
    than float32."""
    if torch.backends.cpu.get_cpu_capability() == "AMX":  # AMX implies bf16 tiles
        return True
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return any(f in flags.split() for f in ("avx512_bf16", "amx_bf16"))


def trainable(draft: Draft) -> list[torch.Tensor]:
    """Make the draft's weights float32 leaf tensors that require grad (in place); returns
    them, for the optimizer."""
    params = []
    for name, w in draft.weights.items():
        p = w.detach().clone().float().requires_grad_()
        draft.weights[name] = p
        params.append(p)
    draft.dtype = torch.float32
    return params


def export_weights(draft: Draft) -> dict[str, torch.Tensor]:
    """The draft's weights under the safetensors names, matrices as [out, in], float32."""
    out = {}
    for key, (_, st_name) in EDGE_TENSORS.items():
        out[st_name] = draft.weights[key]
    for i in range(draft.cfg.n_layers):
        for key, (_, st_name) in LAYER_TENSORS.items():
            out[f"layers.{i}.{st_name}"] = draft.weights[f"{i}.{key}"]
    return {k: (matrix_rows(v) if v.ndim == 2 else v).detach().float() for k, v in out.items()}


def sample_anchors(
    n_tokens: int, answer_start: int, n_anchors: int, generator: torch.Generator
) -> torch.Tensor:
    """Up to n_anchors distinct random anchors in the answer, each with at least one token
    after it to predict; sorted."""
    lo, hi = max(answer_start, 1), n_tokens - 1  # anchors in [lo, hi)
    if hi <= lo:
        raise ValueError(f"no anchor fits: {n_tokens} tokens, answer from {answer_start}")
    pick = torch.randperm(hi - lo, generator=generator)[:n_anchors] + lo
    return pick.sort().values


@dataclass
class BlockLoss:
    loss: torch.Tensor  # weighted mean cross-entropy (differentiable)
    predicted: int  # scored positions
    correct: torch.Tensor  # [N, B-1] bool: argmax == label (False past the sequence end)

    @property
    def acceptance(self) -> float:
        """Mean acceptance length of these blocks under greedy verification: 1 (the bonus
        token) + the run of correct proposals from position 1."""
        run = self.correct.long().cumprod(dim=1).sum(dim=1)
        return 1.0 + run.float().mean().item()


def block_loss(
    draft: Draft,
    edges: Model,
    features: torch.Tensor,
    ids: torch.Tensor,
    anchors: torch.Tensor,
    gamma: float,
    block_size: int | None = None,
) -> BlockLoss:
    """features [S, n_capture*hidden] (the target's captures at every position), ids [S]
    int64, anchors [N] -> the weighted loss of the N blocks (one draft forward)."""
    b = block_size or draft.block_size
    mask = draft.mask_token_id
    if mask is None:
        raise ValueError("the draft names no mask_token_id")
    n_tok, n, dev = ids.shape[0], anchors.shape[0], ids.device
    block_ids = torch.full((n, b), mask, dtype=torch.long, device=dev)
    block_ids[:, 0] = ids[anchors]
    # Frozen embedding: an inference tensor, cloned into one autograd may save.
    noise = draft.noise_embeddings(edges, block_ids.reshape(-1)).clone()
    hidden = draft.hidden_states(features, noise, 0, anchors).view(n, b, -1)[:, 1:]
    label_pos = anchors[:, None] + torch.arange(1, b, device=dev)  # [N, B-1]
    valid = label_pos < n_tok
    labels = ids[label_pos.clamp(max=n_tok - 1)]
    logits = edges.family.project(edges, hidden[valid])  # frozen head, float32 logits
    ce = F.cross_entropy(logits.float(), labels[valid], reduction="none")
    k = torch.arange(1, b, dtype=torch.float32, device=dev)
    weight = torch.exp(-(k - 1) / gamma).expand(n, b - 1)[valid]
    correct = torch.zeros(n, b - 1, dtype=torch.bool, device=dev)
    correct[valid] = logits.detach().argmax(dim=-1) == labels[valid]
    return BlockLoss((ce * weight).sum() / weight.sum(), int(valid.sum()), correct)


def cosine_lr(step: int, total: int, warmup: int) -> float:
    """The learning-rate factor: linear warmup, then cosine decay to 10%."""
    if step < warmup:
        return (step + 1) / warmup
    t = (step - warmup) / max(1, total - warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t)))
