"""A grammar's allowed-token bitmask (``Forward.allowed``) as a logit bias.

Row r of the region is int32 [ceil(vocab / 32)]; id i may be sampled at row r when bit
i % 32 of word i // 32 is set (llguidance's layout; written by the daemon,
``luced.engine.constraint``). The sampler adds the bias (0 or -inf) to the logits.

Each byte of the mask picks its 8 bias values from a 256-row table (one embedding
lookup): about half the time of shifting the words into a bool mask and `torch.where`
(docs/performance.md, "Measurements behind the code").
"""

from __future__ import annotations

import math

import torch

# Byte value -> the bias of its 8 ids, least significant bit first.
_BITS = (torch.arange(256).unsqueeze(-1) >> torch.arange(8)) & 1  # [256, 8]
_TABLE = torch.zeros(256, 8).masked_fill_(_BITS == 0, -math.inf)


def bias(words: torch.Tensor, vocab: int) -> torch.Tensor:
    """int32 [n, ceil(vocab / 32)] -> float32 [n, vocab]: 0 where allowed, -inf elsewhere."""
    table = _TABLE.to(words.device)
    per_byte = torch.nn.functional.embedding(words.view(torch.uint8).long(), table)  # [n, 4w, 8]
    return per_byte.reshape(words.shape[0], -1)[:, :vocab]
