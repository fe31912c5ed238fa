"""KV Flash `qk` scorer, worker side: how relevant each sealed chunk is to the current query.

Per chunk c (positions [64c, 64c + 64)) and pooled layer: the mean post-RoPE key of
each KV head, L2-normalised when the chunk is sealed (its last position written; the
chunk is then in the tail, hence resident, and its K rows never change). Per layer the
query of the step's last token, post-RoPE, normalised. A chunk's score on one layer is
the largest cosine between a query head and its chunk key (max over the GQA group and
over heads); its score is the mean over the scored layers (full-attention layers: a
sliding layer cannot attend to an old chunk anyway). The worker returns, per chunk, the
sum over its layers and how many layers scored it, so the daemon can take the mean over
every shard of a split (``luced.engine.kvflash.transport.mean_scores``).

Upstream: lucebox ``kvflash_qk.h`` (``wave2-reference.md`` §1.3).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

EPS = 1e-6  # keeps the zero vector's normalisation finite


def _normalise(x: torch.Tensor) -> torch.Tensor:
    return x / (x.norm(dim=-1, keepdim=True) + EPS)


class ChunkKeys:
    """One pooled cache's chunk keys and latest queries (float32, on the cache's device)."""

    def __init__(
        self,
        shapes: Mapping[int, tuple[int, int]],  # stored layer -> (Hkv, D)
        n_chunks: int,
        chunk: int,
        device: torch.device,
    ) -> None:
        self.chunk = chunk
        self.keys = {
            i: torch.zeros(n_chunks, h, d, dtype=torch.float32, device=device)
            for i, (h, d) in shapes.items()
        }
        self.sealed = torch.zeros(n_chunks, dtype=torch.bool, device=device)
        self.queries: dict[int, torch.Tensor] = {}  # layer -> [H, D] normalised

    @property
    def n_chunks(self) -> int:
        return self.sealed.shape[0]

    def seal(self, layer: int, chunks: torch.Tensor, rows: torch.Tensor) -> None:
        """Chunk keys of `layer`: rows [Hkv, m, chunk, D] are the K rows of chunks [m]."""
        mean = rows.to(torch.float32).mean(2).transpose(0, 1)  # [m, Hkv, D]
        self.keys[layer][chunks] = _normalise(mean)
        self.sealed[chunks] = True

    def observe(self, layer: int, q: torch.Tensor) -> None:
        """The step's last query of a full-attention layer: q [n, H, D], post-RoPE."""
        self.queries[layer] = _normalise(q[-1].to(torch.float32))

    def forget(self, position: int) -> None:
        """Positions >= `position` are gone: chunks not complete below it are unsealed."""
        self.sealed[position // self.chunk :] = False

    def reset(self) -> None:
        self.sealed.zero_()
        self.queries.clear()

    def scores(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(sum over the scored layers of each chunk's best cosine, layers counted), both
        float32 [n_chunks]; unsealed chunks count 0 layers and sum 0."""
        total = torch.zeros(self.n_chunks, dtype=torch.float32, device=self.sealed.device)
        for layer, q in self.queries.items():
            keys = self.keys[layer]  # [C, Hkv, D]
            hkv = keys.shape[1]
            group = q.reshape(hkv, -1, q.shape[-1])  # [Hkv, G, D]: query heads of each KV head
            cos = torch.einsum("chd,hgd->chg", keys, group)
            total += cos.flatten(1).amax(1)
        count = self.sealed.to(torch.float32) * len(self.queries)
        return torch.where(self.sealed, total, 0.0), count


def write_scores(keys: Iterable[ChunkKeys], out: torch.Tensor) -> None:
    """The `qk` scores of one sequence's caches (one per shard) into `out`, float32
    [2, chunks]: per chunk the sum over their scored layers of its best cosine (row 0) and
    how many layers scored it (row 1); chunks past `out` are left out."""
    out.zero_()
    for qk in keys:
        sums, counts = qk.scores()
        n = min(out.shape[1], sums.shape[0])
        out[0, :n] += sums[:n].to(out.device)
        out[1, :n] += counts[:n].to(out.device)
