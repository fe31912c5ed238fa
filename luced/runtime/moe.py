"""The mixture-of-experts FFN every MoE family shares: route, then compute only the chosen
experts.

One layer, for normed hidden states x [n, hidden]::

    ids, w = route(x @ router, cfg, bias)   [n, k] expert ids, [n, k] final weights
    y  = expert_mix(x, ids, w, experts)     Σ_i w_i · down_e(act(gate_e·x) ⊙ up_e·x), e = ids_i
    y += shared(x) [· sigmoid(x · g)]       shared expert (and its gate) if the model has one

Routing (`route`) is separate from expert compute (`expert_mix`) so that a placement can
split a layer's experts into a local "hot" set and "cold" ones computed elsewhere (another
process, another device) without touching either: the router runs once, its ids are mapped to
each set's local indices, with -1 for experts the set does not hold, and the partial mixes add
up::

    y = expert_mix(x, hot_local[ids], w, hot) + cold.mix(x, cold_local[ids], w) + shared(x)

`expert_mix` skips ids of -1, and what crosses to a cold set is exactly its arguments: x,
local ids, and weights that are already normalised and scaled. `Experts` is the interface a
set provides (`len`, and one expert applied to some rows); `StackedExperts` is the local one.

Routers:
- softmax (qwen3moe, qwen35moe): p = softmax(logits); top-k of p; weights p[ids], renormalised
  to sum 1 when the config says so (`norm_topk_prob`, llama.cpp's expert_weights_norm).
- sigmoid (laguna): p = sigmoid(logits); a per-expert score bias (`exp_probs_b`, HF's
  e_score_correction_bias) is added for the choice only: top-k of p + bias, weights p[ids].
- Either way the weights are then multiplied by the routed scaling factor
  (expert_weights_scale), so `expert_mix` only ever sees final weights.

Only the selected experts run: the n·k (token, expert) pairs are sorted by expert and each
expert with pairs multiplies just its rows. Expert weights are stacked per layer, one tensor per
projection, as GGUF stores them (`ffn_{gate,up,down}_exps`: [E, ff, hidden], [E, ff, hidden],
[E, hidden, ff]); `prepare_layers` fuses gate and up into one [E, 2·ff, hidden] stack
(`ffn_gate_up_exps`, the layout qwen35moe files may already have) so an expert is two matmuls.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from luced.gguf_file import GGUFError, GGUFFile
from luced.runtime.layers import Matrix, cat_rows, linear, matrix_rows, store_matrix, swiglu
from luced.runtime.qlinear import QuantRows

# llama.cpp's llama_expert_gating_func_type values ({arch}.expert_gating_func)
GATING = {1: "softmax", 2: "sigmoid"}

ROUTED = {
    "ffn_gate_inp": "ffn_gate_inp.weight",  # router [E, hidden]
    "ffn_gate_exps": "ffn_gate_exps.weight",
    "ffn_up_exps": "ffn_up_exps.weight",
    "ffn_down_exps": "ffn_down_exps.weight",
}
SELECTION_BIAS = {"exp_probs_b": "exp_probs_b.bias"}  # [E]
SHARED = {
    "ffn_gate_shexp": "ffn_gate_shexp.weight",
    "ffn_up_shexp": "ffn_up_shexp.weight",
    "ffn_down_shexp": "ffn_down_shexp.weight",
}
SHARED_GATE = {"ffn_gate_inp_shexp": "ffn_gate_inp_shexp.weight"}  # [hidden] (or [1, hidden])
VECTORS = {"exp_probs_b", "ffn_gate_inp_shexp"}  # everything else feeds `linear`
# A layer's experts of one projection: a stored [E, out, in] stack, or under a compact
# weights mode one matrix per expert (`QuantRows` while loading, then `PackedLinear`).
Stack = torch.Tensor | Sequence[Matrix] | Sequence[QuantRows]
# The stacked expert tensors (dim 0: the expert), whose rows a placement divides.
EXPERT_STACKS = ("ffn_gate_exps", "ffn_up_exps", "ffn_gate_up_exps", "ffn_down_exps")


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


# By name, so that a process holding experts for another (runtime.experts) can rebuild them.
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_tanh": _gelu_tanh,
}


@dataclass(frozen=True)
class MoeConfig:
    """One model's routed experts; n_experts = 0 means none (the dataclass default)."""

    n_experts: int = 0
    n_used: int = 0  # k, experts per token
    expert_ffn: int = 0
    gating: str = "softmax"  # or "sigmoid"
    normalize: bool = True  # renormalise the k weights to sum 1
    scale: float = 1.0  # routed scaling factor
    selection_bias: bool = False  # exp_probs_b: biases the choice, not the weights
    shared_ffn: int = 0  # 0: no shared expert
    shared_gate: bool = False  # sigmoid gate on the shared expert (qwen35moe)
    fused_gate_up: bool = False  # the file stores ffn_gate_up_exps, not gate and up (gemma4)
    act: str = "silu"  # the experts' gate activation (ACTIVATIONS), gelu_tanh for gemma4

    def __post_init__(self) -> None:
        if self.act not in ACTIVATIONS:
            raise ValueError(f"unknown expert activation {self.act!r}")
        if self.gating not in GATING.values():
            raise ValueError(f"unknown expert gating {self.gating!r}")
        if self.n_experts and not 0 < self.n_used <= self.n_experts:
            raise ValueError(f"{self.n_used} experts used per token of {self.n_experts}")
        if self.n_experts and self.expert_ffn <= 0:
            raise ValueError("expert_feed_forward_length must be positive")


def config_from_gguf(
    gguf: GGUFFile,
    *,
    gating: str = "softmax",
    normalize: bool | None = None,
    selection_bias: bool = False,
    shared_gate: bool = False,
    fused_gate_up: bool = False,
    act: str = "silu",
) -> MoeConfig:
    """The `{arch}.expert_*` keys as llama.cpp reads them. The family says what its graph
    has: `gating` when the file has no expert_gating_func, `normalize` to override
    expert_weights_norm where llama.cpp hard-codes it, and whether the score bias and the
    shared-expert gate exist (their tensors are then required, like the others)."""

    def key(name: str) -> str:
        return f"{gguf.arch}.{name}"

    gating_id = gguf.get(key("expert_gating_func"))
    scale = float(gguf.get(key("expert_weights_scale"), 0.0))
    try:
        return MoeConfig(
            n_experts=int(gguf.require(key("expert_count"))),
            n_used=int(gguf.require(key("expert_used_count"))),
            expert_ffn=int(gguf.require(key("expert_feed_forward_length"))),
            gating=GATING.get(int(gating_id), f"#{gating_id}") if gating_id else gating,
            normalize=(
                bool(gguf.get(key("expert_weights_norm"), False))
                if normalize is None
                else normalize
            ),
            scale=scale if scale else 1.0,  # llama.cpp: 0 means unscaled
            selection_bias=selection_bias,
            shared_ffn=int(gguf.get(key("expert_shared_feed_forward_length"), 0)),
            shared_gate=shared_gate,
            fused_gate_up=fused_gate_up,
            act=act,
        )
    except ValueError as exc:
        raise GGUFError(f"{gguf.path}: bad {gguf.arch} expert metadata: {exc}") from exc


def layer_tensors(cfg: MoeConfig) -> tuple[dict[str, str], set[str]]:
    """Our key -> GGUF suffix for one MoE layer's FFN, and which of them are matrices."""
    names = dict(ROUTED)
    if cfg.fused_gate_up:
        del names["ffn_gate_exps"], names["ffn_up_exps"]
        names["ffn_gate_up_exps"] = "ffn_gate_up_exps.weight"  # [E, 2·ff, hidden], gate first
    if cfg.selection_bias:
        names |= SELECTION_BIAS
    if cfg.shared_ffn:
        names |= SHARED
    if cfg.shared_gate:
        names |= SHARED_GATE
    return names, set(names) - VECTORS


def _expected_shapes(cfg: MoeConfig, hidden: int) -> dict[str, tuple[int, ...]]:
    e, f, s = cfg.n_experts, cfg.expert_ffn, cfg.shared_ffn
    return {
        "ffn_gate_inp": (e, hidden),
        "ffn_gate_exps": (e, f, hidden),
        "ffn_up_exps": (e, f, hidden),
        "ffn_gate_up_exps": (e, 2 * f, hidden),
        "ffn_down_exps": (e, hidden, f),
        "exp_probs_b": (e,),
        "ffn_gate_shexp": (s, hidden),
        "ffn_up_shexp": (s, hidden),
        "ffn_down_shexp": (hidden, s),
    }


def check_tensors(gguf: GGUFFile, cfg: MoeConfig, hidden: int, layers: Iterable[int]) -> None:
    """Every MoE layer's expert tensors exist with the shapes the metadata implies; else a
    GGUFError naming the first tensor that does not (before any weight is read)."""
    names, _ = layer_tensors(cfg)
    shapes = _expected_shapes(cfg, hidden)
    for layer in layers:
        for key, suffix in names.items():
            name = f"blk.{layer}.{suffix}"
            if name not in gguf.tensors:
                raise GGUFError(f"{gguf.path}: missing tensor {name!r}")
            got, want = gguf.info(name).shape, shapes.get(key)
            if key == "ffn_gate_inp_shexp":  # [hidden] or [1, hidden]
                got, want = (got[-1],), (hidden,)
            if want is not None and tuple(got) != want:
                raise GGUFError(
                    f"{gguf.path}: tensor {name!r} has shape {list(got)}, expected {list(want)} "
                    f"(expert_count {cfg.n_experts}, expert_feed_forward_length "
                    f"{cfg.expert_ffn}, expert_shared_feed_forward_length {cfg.shared_ffn}, "
                    f"embedding_length {hidden})"
                )


def stack_experts(
    held: Mapping[int, Sequence[int]], layers: Iterable[int]
) -> dict[str, Sequence[int]]:
    """GGUF name of each expert stack of `layers` -> the experts `held` keeps of it (for
    `WeightLoader`'s `experts`); layers `held` does not name keep all."""
    return {
        f"blk.{layer}.{stack}.weight": held[layer]
        for layer in layers
        if layer in held
        for stack in EXPERT_STACKS
    }


def fuse_gate_up(gate: Stack, up: Stack) -> Stack:
    """One [E, 2·ff, hidden] stack (gate rows first) of loaded gate and up stacks, so an
    expert is two matmuls; compact stacks fuse expert by expert."""
    if isinstance(gate, torch.Tensor):
        assert isinstance(up, torch.Tensor)
        return store_matrix(torch.cat([matrix_rows(gate), matrix_rows(up)], 1))
    return [cat_rows([g, u]) for g, u in zip(gate, up, strict=True)]  # type: ignore[list-item]


def prepare_layers(weights: dict[str, Any], layers: Iterable[int]) -> None:
    """Fuse each loaded MoE layer's gate and up stacks into `ffn_gate_up_exps` (a layer the
    file already stores fused is left as it is)."""
    for layer in layers:
        gate, up = f"{layer}.ffn_gate_exps", f"{layer}.ffn_up_exps"
        if gate in weights:
            fused = fuse_gate_up(weights.pop(gate), weights.pop(up))
            weights[f"{layer}.ffn_gate_up_exps"] = fused


# ---------------------------------------------------------------- routing


def route(
    logits: torch.Tensor, cfg: MoeConfig, bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [n, E] -> (expert ids [n, k] int64, final weights [n, k] float32).

    `bias` [E] (sigmoid routers' score correction) shifts which experts win, never their
    weights. Ids come in the order of their (biased) scores, best first."""
    logits = logits.float()
    probs = logits.softmax(-1) if cfg.gating == "softmax" else logits.sigmoid()
    scores = probs if bias is None else probs + bias.float()
    ids = torch.topk(scores, cfg.n_used, dim=-1).indices
    weights = probs.gather(-1, ids)
    if cfg.normalize:
        weights = weights / weights.sum(-1, keepdim=True)
    if cfg.scale != 1.0:
        weights = weights * cfg.scale
    return ids, weights


# ---------------------------------------------------------------- experts


class Experts(Protocol):
    """A set of experts addressed by local index 0..len-1."""

    def __len__(self) -> int: ...

    def __call__(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        """Expert `expert` on rows x [m, hidden] -> [m, hidden]."""
        ...


class StackedExperts:
    """Experts held here as stacked matrices in `linear`'s layout: gate_up [E, 2·ff, hidden]
    (gate rows first) and down [E, hidden, ff] (as [out, in] per expert), or, under a
    compact weights mode, one packed matrix per expert."""

    def __init__(
        self,
        gate_up: Stack,
        down: Stack,
        act: Callable[[torch.Tensor], torch.Tensor] = F.silu,
    ) -> None:
        self.gate_up, self.down, self.act = gate_up, down, act

    def __len__(self) -> int:
        return len(self.gate_up)

    def __call__(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        gate, up = linear(x, self.gate_up[expert]).chunk(2, dim=-1)
        return linear(self.act(gate) * up, self.down[expert])


def expert_mix(
    x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, experts: Experts
) -> torch.Tensor:
    """Σ_i weights[t, i] · experts(ids[t, i], x[t]) for every token t: x [n, hidden], ids and
    weights [n, k]; ids index `experts`, -1 = held elsewhere (contributes nothing here).
    Returns [n, hidden] in x's dtype; each expert runs once, on the rows that chose it."""
    # Decode (one row): its k experts in turn; sorting would cost more than it saves.
    if ids.shape[0] == 1:
        return _mix_one(x, ids[0].tolist(), weights[0].to(x.dtype).tolist(), experts)
    k = ids.shape[1]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # pair indices (token * k + slot), by expert
    counts = torch.bincount(flat + 1, minlength=len(experts) + 1).tolist()  # [0]: the -1s
    held = order[counts[0] :]
    rows = torch.div(held, k, rounding_mode="floor")  # the token of each held pair
    xs = x[rows]
    outs, start = [], 0
    for expert, count in enumerate(counts[1:]):
        if count:
            outs.append(experts(expert, xs[start : start + count]))
            start += count
    out = torch.zeros_like(x)
    if outs:
        mixed = torch.cat(outs) * weights.reshape(-1)[held, None].to(x.dtype)
        out.index_add_(0, rows, mixed)
    return out


def _mix_one(
    x: torch.Tensor, ids: list[int], weights: list[float], experts: Experts
) -> torch.Tensor:
    total = None
    for expert, weight in zip(ids, weights, strict=True):
        if expert >= 0:
            y = experts(expert, x)
            total = y * weight if total is None else total.add_(y, alpha=weight)
    return torch.zeros_like(x) if total is None else total


# ---------------------------------------------------------------- the block


class ExpertSplit(Protocol):
    """A layer's experts split between the hot ones held here (the weights' stacks) and cold
    ones held elsewhere (`luced.runtime.experts.Split`); it maps the router's global ids."""

    def mix(
        self,
        layer: int,
        x: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
        hot: StackedExperts,
    ) -> torch.Tensor:
        """`expert_mix` over all experts: hot ones here, cold ones wherever they are."""
        ...


def routed_mix(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    stacks: Mapping[str, torch.Tensor],
    layer: int,
    cfg: MoeConfig,
    split: ExpertSplit | None = None,
) -> torch.Tensor:
    """The routed experts of one layer for global ids [n, k] and final weights [n, k]: the
    layer's stacks hold every expert, or (with a `split`) only its hot ones."""
    p = f"{layer}."
    hot = StackedExperts(
        stacks[p + "ffn_gate_up_exps"], stacks[p + "ffn_down_exps"], ACTIVATIONS[cfg.act]
    )
    if split is None:
        return expert_mix(x, ids, weights, hot)
    return split.mix(layer, x, ids, weights, hot)


def moe_ffn(
    x: torch.Tensor,
    weights: Mapping[str, torch.Tensor],
    layer: int,
    cfg: MoeConfig,
    split: ExpertSplit | None = None,
) -> torch.Tensor:
    """One layer's MoE FFN on normed hidden states x [n, hidden] -> [n, hidden], reading the
    layer's tensors (after `prepare_layers`) from `weights` by our keys."""
    w, p = weights, f"{layer}."
    ids, mix = route(linear(x, w[p + "ffn_gate_inp"]), cfg, w.get(p + "exp_probs_b"))
    out = routed_mix(x, ids, mix, w, layer, cfg, split)
    if cfg.shared_ffn:
        shared = swiglu(x, w[p + "ffn_gate_shexp"], w[p + "ffn_up_shexp"], w[p + "ffn_down_shexp"])
        if cfg.shared_gate:
            shared = shared * torch.sigmoid(x @ w[p + "ffn_gate_inp_shexp"].reshape(-1, 1))
        out = out + shared
    return out


def model_split(model: Any) -> ExpertSplit | None:
    """The expert placement applied to a loaded model (`luced.runtime.experts.place`)."""
    return getattr(model, "expert_split", None)


def model_ffn(model: Any, layer: int, h: torch.Tensor) -> torch.Tensor:
    """`moe_ffn` of one layer of a model whose config has a `moe` field: the `ffn` hook the
    dense families' `block` takes (qwen3moe over llama, qwen35moe over qwen35, laguna)."""
    return moe_ffn(h, model.weights, layer, model.cfg.moe, model_split(model))
