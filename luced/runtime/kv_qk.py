"""KV Flash `qk` scorer, worker side: how relevant each sealed block is to the current query.

Per block b (positions [b·block, (b + 1)·block)) and pooled layer: the mean post-RoPE key of
each KV head, L2-normalised when the block is sealed (its last position written; the
block is then in the tail, hence resident, and its K rows never change). Per layer the
query of the step's last token, post-RoPE, normalised. A block's score on one layer is
the largest cosine between a query head and its block key (max over the GQA group and
over heads); its score is the mean over the scored layers (full-attention layers: a
sliding layer cannot attend to an old block anyway). The worker returns, per block, the
sum over its layers and how many layers scored it, so the daemon can take the mean over
every shard of a split (``luced.engine.kvflash.transport.mean_scores``).

Upstream: lucebox ``kvflash_qk.h`` (``wave2-reference.md`` §1.3).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch

from luced.runtime.kv_host import RecordLayout

EPS = 1e-6  # keeps the zero vector's normalisation finite


def _normalise(x: torch.Tensor) -> torch.Tensor:
    return x / (x.norm(dim=-1, keepdim=True) + EPS)


class BlockKeys:
    """One pooled cache's block keys and latest queries (float32, on the cache's device)."""

    def __init__(
        self,
        shapes: Mapping[int, tuple[int, int]],  # stored layer -> (Hkv, D)
        n_blocks: int,
        block: int,
        device: torch.device,
    ) -> None:
        self.block = block
        self.keys = {
            i: torch.zeros(n_blocks, h, d, dtype=torch.float32, device=device)
            for i, (h, d) in shapes.items()
        }
        self.sealed = torch.zeros(n_blocks, dtype=torch.bool, device=device)
        self.queries: dict[int, torch.Tensor] = {}  # layer -> [H, D] normalised

    @property
    def n_blocks(self) -> int:
        return self.sealed.shape[0]

    def seal(self, layer: int, blocks: torch.Tensor, rows: torch.Tensor) -> None:
        """Block keys of `layer`: rows [Hkv, m, block, D] are the K rows of blocks [m]."""
        mean = rows.to(torch.float32).mean(2).transpose(0, 1)  # [m, Hkv, D]
        self.keys[layer][blocks] = _normalise(mean)
        self.sealed[blocks] = True

    def seal_records(
        self, layout: RecordLayout, records: torch.Tensor, ids: Sequence[int], blocks: torch.Tensor
    ) -> None:
        """Block keys of blocks [m] from the K rows of host records `ids` [m] (`layout`'s;
        a block adopted from a record): the bytes its computing cache sealed it from, so
        the keys are that cache's and a restored lane ranks its blocks as that one did."""
        for layer in self.keys:
            rows = layout.k_rows(records, ids, layer).to(self.sealed.device)
            self.seal(layer, blocks, rows)

    def copy_from(self, other: BlockKeys, blocks: torch.Tensor) -> None:
        """Blocks `blocks` keyed as `other` keys them (a share of rows it sealed)."""
        for layer, keys in self.keys.items():
            keys[blocks] = other.keys[layer][blocks]
        self.sealed[blocks] = other.sealed[blocks]

    def observe(self, layer: int, q: torch.Tensor) -> None:
        """The step's last query of a full-attention layer: q [n, H, D], post-RoPE."""
        self.queries[layer] = _normalise(q[-1].to(torch.float32))

    def forget(self, position: int) -> None:
        """Positions >= `position` are gone: blocks not complete below it are unsealed."""
        self.sealed[position // self.block :] = False

    def reset(self) -> None:
        self.sealed.zero_()
        self.queries.clear()

    def scores(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(sum over the scored layers of each block's best cosine, layers counted), both
        float32 [n_blocks]; unsealed blocks count 0 layers and sum 0."""
        total = torch.zeros(self.n_blocks, dtype=torch.float32, device=self.sealed.device)
        for layer, q in self.queries.items():
            keys = self.keys[layer]  # [C, Hkv, D]
            hkv = keys.shape[1]
            group = q.reshape(hkv, -1, q.shape[-1])  # [Hkv, G, D]: query heads of each KV head
            cos = torch.einsum("chd,hgd->chg", keys, group)
            total += cos.flatten(1).amax(1)
        count = self.sealed.to(torch.float32) * len(self.queries)
        return torch.where(self.sealed, total, 0.0), count


def write_scores(keys: Iterable[BlockKeys], out: torch.Tensor) -> None:
    """The `qk` scores of one sequence's caches (one per shard) into `out`, float32
    [2, blocks]: per block the sum over their scored layers of its best cosine (row 0) and
    how many layers scored it (row 1); blocks past `out` are left out."""
    out.zero_()
    for qk in keys:
        sums, counts = qk.scores()
        n = min(out.shape[1], sums.shape[0])
        out[0, :n] += sums[:n].to(out.device)
        out[1, :n] += counts[:n].to(out.device)
