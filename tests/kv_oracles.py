"""Plain caches as KV Flash's oracles: one whose mask hides the positions a pool evicted or
paged out, and one that records the queries the `qk` scorer sees, with each block's
score computed straight from its keys (runtime.kv_qk scores them in the worker)."""

from __future__ import annotations

import torch

from luced.runtime.kv_cache import KVCache


class HidingCache(KVCache):
    """A plain cache whose mask also hides every position outside `visible`."""

    visible: frozenset[int] = frozenset()

    def mask(self, start, n, window, device):
        base = super().mask(start, n, window, device)
        if base is None:
            base = torch.ones(n, start + n, dtype=torch.bool, device=device)
        seen = torch.zeros(start + n, dtype=torch.bool, device=device)
        seen[sorted(p for p in self.visible if p < start + n)] = True  # a row's keys end at it
        return base & seen[None, :]

    def decode_storage(self, layer):
        return None  # the native decode kernel knows only the causal mask: SDPA with this one


class QueryRecorder(KVCache):
    """A plain cache that keeps each full-attention layer's last query (the oracle's)."""

    queries: dict
    observes_queries = True

    def observe_query(self, layer, q, window):
        if window is None:
            self.queries[layer] = q[-1].float()


def block_scores(plain: QueryRecorder, size: int, n_blocks: int) -> dict[int, float]:
    """Block c's (positions [size * c, size * c + size)) mean over the recorded layers of
    the best cosine between a query head and its KV head's mean key."""
    want = {}
    for c in range(n_blocks):
        best = []
        for layer, q in plain.queries.items():
            k = plain.k[layer][:, size * c : size * c + size].float().mean(1)  # [Hkv, D]
            k = k / k.norm(dim=-1, keepdim=True)
            group = q.shape[0] // k.shape[0]
            cos = (q / q.norm(dim=-1, keepdim=True)) @ k.T  # [H, Hkv]
            best.append(max(float(cos[h, h // group]) for h in range(q.shape[0])))
        want[c] = sum(best) / len(best)
    return want
