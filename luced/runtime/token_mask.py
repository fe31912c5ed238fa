"""A grammar's allowed-token bitmask (``Forward.allowed``) as a boolean tensor.

Row r of the region is int32 [ceil(vocab / 32)]; id i may be sampled at row r when bit
i % 32 of word i // 32 is set (llguidance's layout; written by the daemon,
``luced.engine.constraint``). The sampler sets the other ids' logits to -inf.
"""

from __future__ import annotations

import torch


def unpack(words: torch.Tensor, vocab: int) -> torch.Tensor:
    """int32 [n, ceil(vocab / 32)] -> bool [n, vocab]."""
    bits = torch.arange(32, dtype=torch.int32, device=words.device)
    # An arithmetic shift keeps the sign bit in front; `& 1` keeps only bit b.
    flags = (words.unsqueeze(-1) >> bits) & 1  # [n, words, 32]
    return flags.reshape(words.shape[0], -1)[:, :vocab].bool()
