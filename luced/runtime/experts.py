"""Expert placement: which routed experts a target worker keeps (hot) and where the others
(cold) are computed, for every MoE family at once (they all mix experts in `moe.routed_mix`).

    placement = plan_for(path, hot=4)                 # per layer: the lowest ids, or the
                                                      # most routed ones given a profile
    model = Model.load(path, experts=placement.hot)   # reads only the hot experts' rows
    place(model, placement)                           # cold: in process (LocalExperts)

Per MoE layer the router runs once over all experts; `Split.mix` maps its global ids to
each side's local index (-1 where that side does not hold the expert) and adds the parts::

    y = expert_mix(x, hot_local[ids], w, hot_stacks) + cold.mix(layer, x, cold_local[ids], w)

Index convention (the property the tests check): `hot[layer]` and `cold(layer)` are both
ascending, disjoint and cover 0..E-1; local index i on a side is the i-th id of its list, so
the cold side's `inverted().hot[layer][i]` is the same global expert as `cold(layer)[i]`.

A cold compute answers `mix(layer, x, ids, weights)` with Σ_i w_i · expert_i(x) [n, hidden]
for its own local ids: `LocalExperts` in this process (the fallback), or
`luced.runtime.expert_link.RemoteExperts` in an expert worker. When the remote one fails the
call is redone in process (`fallback`), unless the placement says the remote is required.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from luced.gguf_file import GGUFFile
from luced.runtime.families import family_for
from luced.runtime.moe import (
    ACTIVATIONS,
    MoeConfig,
    Stack,
    StackedExperts,
    expert_mix,
    fuse_gate_up,
)
from luced.runtime.qlinear import pack
from luced.runtime.weights import expert_stack

log = logging.getLogger(__name__)


# ---------------------------------------------------------------- placement


@dataclass(frozen=True)
class Placement:
    """The target's hot experts: MoE layer -> ascending global ids (the rest are cold)."""

    n_experts: int
    hot: Mapping[int, tuple[int, ...]]

    def __post_init__(self) -> None:
        for layer, ids in self.hot.items():
            if list(ids) != sorted(set(ids)) or (
                ids and not 0 <= ids[0] <= ids[-1] < self.n_experts
            ):
                raise ValueError(
                    f"layer {layer}: hot experts {list(ids)} must be ascending, unique ids "
                    f"below {self.n_experts}"
                )

    @property
    def layers(self) -> tuple[int, ...]:
        return tuple(sorted(self.hot))

    def cold(self, layer: int) -> tuple[int, ...]:
        held = set(self.hot[layer])
        return tuple(e for e in range(self.n_experts) if e not in held)

    @property
    def all_hot(self) -> bool:
        return all(len(ids) == self.n_experts for ids in self.hot.values())

    def inverted(self) -> Placement:
        """The other side's placement: it holds exactly what this one lacks."""
        return Placement(self.n_experts, {layer: self.cold(layer) for layer in self.layers})

    def fingerprint(self) -> str:
        """Equal for equal placements (layers, expert count, hot ids), else different: decides
        whether a running expert worker still holds the right experts."""
        doc = [self.n_experts, [[layer, list(self.hot[layer])] for layer in self.layers]]
        return hashlib.sha256(json.dumps(doc).encode()).hexdigest()[:16]

    def to_wire(self) -> dict[str, Any]:
        return {
            "n_experts": self.n_experts,
            "hot": [[layer, list(self.hot[layer])] for layer in self.layers],
        }

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> Placement:
        return cls(
            int(d["n_experts"]), {int(layer): tuple(int(e) for e in ids) for layer, ids in d["hot"]}
        )


def plan(
    n_experts: int,
    layers: Iterable[int],
    hot: int | None,
    profile: Mapping[int, Sequence[float]] | None = None,
) -> Placement:
    """`hot` experts per layer (None: all): the most routed first where `profile` (layer ->
    routing count per expert) covers the layer, else the lowest ids."""
    if hot is None:
        hot = n_experts
    if not 0 <= hot <= n_experts:
        raise ValueError(f"{hot} hot experts per layer of {n_experts}")
    chosen = {}
    for layer in layers:
        counts = (profile or {}).get(layer)
        if counts is not None and len(counts) != n_experts:
            raise ValueError(
                f"routing profile of layer {layer}: {len(counts)} counts for {n_experts} experts"
            )
        order = (
            range(n_experts)
            if counts is None
            else sorted(range(n_experts), key=lambda e: (-counts[e], e))
        )
        chosen[layer] = tuple(sorted(order[:hot]))
    return Placement(n_experts, chosen)


def local_index(
    ids: Sequence[int], n_experts: int, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """[E + 1] int64: global id -> its position in `ids`, -1 elsewhere; the extra last entry
    maps an id of -1 to -1 again."""
    table = torch.full((n_experts + 1,), -1, dtype=torch.int64)
    table[list(ids)] = torch.arange(len(ids))
    return table.to(device)


# ---------------------------------------------------------------- computes


class ExpertsUnavailable(RuntimeError):
    """A cold compute could not answer (the expert worker died, or refused the call)."""


class ExpertCompute(Protocol):
    def mix(
        self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """Σ_i weights[t, i] · expert(ids[t, i])(x[t]) [n, hidden]; ids local, -1 skipped."""
        ...


def read_experts(
    gguf: GGUFFile,
    layer: int,
    ids: Sequence[int],
    cfg: MoeConfig,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    weights: str = "dequant",
) -> StackedExperts:
    """The experts `ids` of one layer, read from the mapped file: only their rows are touched
    (an expert is a contiguous slice of each stacked tensor), held as the `weights` mode
    holds the target's matrices (`weights.expert_stack`: dequantized, or packed)."""
    device = torch.device(device)

    def stack(name: str) -> Stack:
        return expert_stack(gguf, f"blk.{layer}.{name}.weight", ids, weights, dtype, device)

    if cfg.fused_gate_up:
        gate_up = stack("ffn_gate_up_exps")
    else:
        gate_up = fuse_gate_up(stack("ffn_gate_exps"), stack("ffn_up_exps"))
    return StackedExperts(
        pack(gate_up, dtype, device),
        pack(stack("ffn_down_exps"), dtype, device),
        ACTIVATIONS[cfg.act],
    )


class LocalExperts:
    """Experts held in this process: `held` (layer -> ascending global ids) read from the
    GGUF at `path` on a layer's first call, or all at once with `load_all`; `weights` as
    `read_experts` takes it."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        cfg: MoeConfig,
        held: Mapping[int, Sequence[int]],
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        weights: str = "dequant",
    ) -> None:
        self.gguf = GGUFFile(path)
        self.cfg, self.held, self.dtype, self.device = cfg, dict(held), dtype, torch.device(device)
        self.weights = weights
        self.layers: dict[int, StackedExperts] = {}

    def experts(self, layer: int) -> StackedExperts:
        stacks = self.layers.get(layer)
        if stacks is None:
            held = self.held[layer]
            stacks = read_experts(
                self.gguf, layer, held, self.cfg, self.dtype, self.device, self.weights
            )
            self.layers[layer] = stacks
        return stacks

    def load_all(self) -> None:
        for layer in self.held:
            self.experts(layer)

    @torch.inference_mode()
    def mix(
        self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        d = self.device
        return expert_mix(
            x.to(d, self.dtype), ids.to(d, torch.int64), weights.to(d), self.experts(layer)
        )


class Split:
    """`moe.ExpertSplit` for one target shard: hot experts in the model's stacks, cold ones
    through `cold`; when `cold` fails the call is redone by `fallback` (in process) unless
    `required`. Counters feed the worker's stats."""

    def __init__(
        self,
        placement: Placement,
        cold: ExpertCompute,
        device: torch.device | str = "cpu",
        *,
        fallback: ExpertCompute | None = None,
        required: bool = False,
    ) -> None:
        self.placement, self.cold, self.fallback, self.required = (
            placement,
            cold,
            fallback,
            required,
        )
        e = placement.n_experts
        self.hot_local = {
            layer: local_index(ids, e, device) for layer, ids in placement.hot.items()
        }
        self.cold_local = {
            layer: local_index(placement.cold(layer), e, device) for layer in placement.layers
        }
        self.stats = {"cold_calls": 0, "fallbacks": 0}
        self._falling_back = False

    def mix(
        self,
        layer: int,
        x: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
        hot: StackedExperts,
    ) -> torch.Tensor:
        out = expert_mix(x, self.hot_local[layer][ids], weights, hot)
        cold_ids = self.cold_local[layer][ids]
        if bool((cold_ids >= 0).any()):
            out += self._cold_mix(layer, x, cold_ids, weights).to(out.device, out.dtype)
        return out

    def _cold_mix(
        self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        # int32 ids and f32 weights: what crosses to an expert worker (and exact for either)
        ids, weights = ids.to(torch.int32), weights.float()
        self.stats["cold_calls"] += 1
        try:
            out = self.cold.mix(layer, x, ids, weights)
        except ExpertsUnavailable as exc:
            if self.required or self.fallback is None:
                raise
            self.stats["fallbacks"] += 1
            if not self._falling_back:  # once per outage, not per layer and step
                log.warning("cold experts computed in process: %s", exc)
                self._falling_back = True
            return self.fallback.mix(layer, x, ids, weights)
        if self._falling_back:
            log.info("cold experts computed by the expert worker again")
            self._falling_back = False
        return out


def model_moe(gguf: GGUFFile) -> MoeConfig:
    """The routed experts of the model in `gguf` (n_experts 0: it has none)."""
    return getattr(family_for(gguf).config_from_gguf(gguf), "moe", MoeConfig())


def plan_for(
    path: str | os.PathLike[str],
    hot: int | None,
    profile: Mapping[int, Sequence[float]] | None = None,
) -> Placement | None:
    """`plan` for the model at `path` before it is loaded (its `Model.load(experts=...)` is
    then `placement.hot`), or None if it has no routed experts."""
    gguf = GGUFFile(path)
    cfg = model_moe(gguf)
    if not cfg.n_experts:
        return None
    return plan(cfg.n_experts, gguf.moe_layers(), hot, profile)


def place(
    model: Any,
    placement: Placement,
    *,
    cold: ExpertCompute | None = None,
    required: bool = False,
) -> None:
    """Route a model loaded with only `placement`'s hot experts (`Model.load(experts=
    placement.hot)`) through a `Split`: the cold ones go through `cold` (an expert worker)
    with the in-process `LocalExperts` as its fallback, or through `LocalExperts` alone."""
    for layer in placement.layers:
        stack = model.weights.get(f"{layer}.ffn_down_exps")
        if stack is not None and len(stack) != len(placement.hot[layer]):
            raise ValueError(
                f"layer {layer} holds {len(stack)} experts, the placement keeps "
                f"{len(placement.hot[layer])}: load it with experts=placement.hot"
            )
    cold_ids = placement.inverted().hot
    # the cold experts held as the model holds its matrices: hot + cold is what the
    # all-local model computes
    local = LocalExperts(
        model.path, model.cfg.moe, cold_ids, model.dtype, weights=model.weights_mode
    )
    model.expert_split = Split(
        placement, cold or local, model.device, fallback=local, required=required
    )
