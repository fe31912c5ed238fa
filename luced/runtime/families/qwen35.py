"""Qwen3.5 family (dense): Gated DeltaNet linear attention in three of every four layers,
gated full attention in the fourth, zero-centred RMSNorms, SwiGLU MLP.

Layer i is full attention iff (i + 1) % full_attention_interval == 0, else DeltaNet.

Gated DeltaNet, x: [n, hidden] (normed) -> [n, hidden]::

    q|k|v = silu(causal_conv1d(attn_qkv x))      depthwise, kernel K, state: last K-1 inputs
    z = attn_gate x;  beta = sigmoid(ssm_beta x);  g = ssm_a * softplus(ssm_alpha x + ssm_dt.bias)
    q, k l2-normalised, q scaled by Dk^-1/2, then per value head h, per token t:
        S = exp(g_t) S;  S += k_t (beta_t (v_t - S^T k_t))^T;  o_t = S^T q_t      S: [Dk, Dv]
    out = ssm_out(rms_norm(o) * ssm_norm * silu(z))                              per head

The recurrence runs token by token for a single token (decode) and in chunks for longer
inputs (prefill): within a chunk the delta-rule updates form one unit lower triangular
system (`_delta_rule_chunked`), so a chunk is a few matmuls and a triangular solve.

Gated attention: attn_q yields, per head, D query dims then D gate dims; q/k RMSNorm, RoPE
on the first rope_dims dims, the output times sigmoid(gate). Qwen3.5 rotates with
interleaved M-RoPE sections (rope.dimension_sections); for text every section carries the
same position, which is plain RoPE.

GGUF conventions (llama.cpp's converter): every RMSNorm except ssm_norm is stored as 1 + w,
A_log as ssm_a = -exp(A_log), dt_bias as ssm_dt.bias, the conv1d weight squeezed to
[channels, K]. When key and value head counts differ, llama.cpp reorders value heads from
grouped by key head (HF: value head j reads key head j // r) to tiled (j reads key head
j % Hk) in attn_qkv, attn_gate, ssm_alpha, ssm_beta, ssm_a, ssm_dt, the conv1d and ssm_out;
we compute in the stored (tiled) order, so nothing is reordered back.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F

from luced.gguf_file import GGUFError, GGUFFile
from luced.runtime.families import common
from luced.runtime.families.common import ModelParts
from luced.runtime.kv_cache import RecurrentShape
from luced.runtime.layers import (
    Rope,
    apply_rope,
    cat_rows,
    linear,
    rms_norm,
    rope_inv_freq,
    swiglu,
)
from luced.runtime.ragged import Ragged

if TYPE_CHECKING:
    from luced.runtime.kv_cache import KVCache

ARCH = "qwen35"

_NORMS = {"attn_norm": "attn_norm.weight", "post_attn_norm": "post_attention_norm.weight"}
DENSE_FFN_TENSORS = {
    "ffn_gate": "ffn_gate.weight",
    "ffn_up": "ffn_up.weight",
    "ffn_down": "ffn_down.weight",
}
ATTENTION_TENSORS = _NORMS | {
    "attn_q": "attn_q.weight",  # [H * 2D, hidden]: per head D query rows, then D gate rows
    "attn_k": "attn_k.weight",
    "attn_v": "attn_v.weight",
    "attn_q_norm": "attn_q_norm.weight",
    "attn_k_norm": "attn_k_norm.weight",
    "attn_output": "attn_output.weight",
}
DELTA_NET_TENSORS = _NORMS | {
    "ssm_qkv": "attn_qkv.weight",  # [2 Hk Dk + Hv Dv, hidden]
    "ssm_z": "attn_gate.weight",  # [Hv Dv, hidden]
    "ssm_beta": "ssm_beta.weight",  # [Hv, hidden]
    "ssm_alpha": "ssm_alpha.weight",  # [Hv, hidden]
    "ssm_a": "ssm_a",  # [Hv]: -exp(A_log)
    "ssm_dt": "ssm_dt.bias",  # [Hv]
    "ssm_conv": "ssm_conv1d.weight",  # [channels, K]
    "ssm_norm": "ssm_norm.weight",  # [Dv]
    "ssm_out": "ssm_out.weight",  # [hidden, Hv Dv]
}
MATRICES = {
    "attn_q", "attn_k", "attn_v", "attn_output", "ssm_qkv", "ssm_z", "ssm_beta", "ssm_alpha",
    "ssm_out",
}  # fmt: skip

_IN_PROJECTIONS = ("ssm_qkv", "ssm_z", "ssm_beta", "ssm_alpha")  # stacked by `prepare`
CHUNK = 64  # tokens per chunk of the chunked delta rule
L2_EPS = 1e-6  # q/k l2 normalisation, as the reference kernels


@dataclass(frozen=True)
class Qwen35Config(common.ModelConfig):
    full_attention_interval: int = 4
    conv_kernel: int = 4
    linear_k_heads: int = 16  # ssm.group_count
    linear_v_heads: int = 32  # ssm.time_step_rank
    linear_k_dim: int = 128  # ssm.state_size
    linear_v_dim: int = 128  # ssm.inner_size / linear_v_heads
    rope_sections: tuple[int, ...] = ()  # M-RoPE sections (all one position for text)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.full_attention_interval <= 0 or self.conv_kernel <= 0:
            raise ValueError("full_attention_interval and ssm.conv_kernel must be positive")
        if self.linear_v_heads % self.linear_k_heads:
            raise ValueError(
                f"{self.linear_v_heads} value heads not a multiple of {self.linear_k_heads} "
                "key heads"
            )
        if self.rope_dims % 2 or self.rope_dims > self.head_dim:
            raise ValueError(f"rope.dimension_count {self.rope_dims} must be even, <= head_dim")

    def is_recurrent(self, layer: int) -> bool:
        return (layer + 1) % self.full_attention_interval != 0

    @property
    def conv_channels(self) -> int:
        return 2 * self.linear_k_heads * self.linear_k_dim + self.linear_v_heads * self.linear_v_dim


def config_from_gguf(
    gguf: GGUFFile,
    cls: type = Qwen35Config,
    known: dict[str, Any] | None = None,
    **extra: Any,
) -> Any:
    """The hybrid stack's config; `cls`, `known` and `extra` as in common.make_config (a
    subclass adds its FFN's fields, e.g. qwen35moe's experts)."""

    def key(name: str) -> str:
        return f"{gguf.arch}.{name}"

    v_heads = int(gguf.require(key("ssm.time_step_rank")))
    inner = int(gguf.require(key("ssm.inner_size")))
    if v_heads <= 0 or inner % v_heads:
        raise GGUFError(f"{gguf.path}: ssm.inner_size {inner} not a multiple of {v_heads} heads")
    sections = gguf.get(key("rope.dimension_sections"), ())
    return common.make_config(
        cls,
        gguf,
        known,
        full_attention_interval=int(gguf.get(key("full_attention_interval"), 4)),
        conv_kernel=int(gguf.require(key("ssm.conv_kernel"))),
        linear_k_heads=int(gguf.require(key("ssm.group_count"))),
        linear_v_heads=v_heads,
        linear_k_dim=int(gguf.require(key("ssm.state_size"))),
        linear_v_dim=inner // v_heads,
        rope_sections=tuple(int(s) for s in np.asarray(sections).ravel()),
        **extra,
    )


def mixer_plan(cfg: Qwen35Config, layers: range) -> dict[str, tuple[str, bool]]:
    """Each layer's norms and token mixer (DeltaNet or gated attention), without its FFN."""
    plan: dict[str, tuple[str, bool]] = {}
    for i in layers:
        names = DELTA_NET_TENSORS if cfg.is_recurrent(i) else ATTENTION_TENSORS
        plan |= common.layer_plan(range(i, i + 1), names, MATRICES)
    return plan


def weight_plan(
    cfg: Qwen35Config, layers: range, owns_embed: bool, owns_head: bool
) -> dict[str, tuple[str, bool]]:
    plan = common.edge_plan(cfg, owns_embed, owns_head) | mixer_plan(cfg, layers)
    return plan | common.layer_plan(layers, DENSE_FFN_TENSORS, set(DENSE_FFN_TENSORS))


def prepare(cfg: Qwen35Config, weights: dict[str, torch.Tensor]) -> None:
    """Check the DeltaNet vectors and conv against the metadata, and stack each DeltaNet
    layer's four input projections into one matrix `ssm_in` (one matmul per step, not four):
    rows [qkv | z | beta | alpha]."""
    want = {
        "ssm_a": (cfg.linear_v_heads,),
        "ssm_dt": (cfg.linear_v_heads,),
        "ssm_norm": (cfg.linear_v_dim,),
        "ssm_conv": (cfg.conv_channels, cfg.conv_kernel),
    }
    for key in list(weights):
        layer, _, name = key.partition(".")
        if name not in want:
            continue
        shape = tuple(weights[key].shape)
        if shape != want[name]:
            raise ValueError(
                f"tensor 'blk.{layer}.{DELTA_NET_TENSORS[name]}' is {list(shape)}, the "
                f"metadata wants {list(want[name])}"
            )
    for key in [k for k in weights if k.endswith(".ssm_qkv")]:
        layer = key.partition(".")[0]
        parts = [weights.pop(f"{layer}.{name}") for name in _IN_PROJECTIONS]
        weights[f"{layer}.ssm_in"] = cat_rows(parts)


def recurrent_shapes(cfg: Qwen35Config, layers: range) -> dict[int, RecurrentShape]:
    """The DeltaNet layers among `layers` and the sizes of their states."""
    shape = RecurrentShape(
        conv_channels=cfg.conv_channels,
        conv_kernel=cfg.conv_kernel,
        heads=cfg.linear_v_heads,
        key_dim=cfg.linear_k_dim,
        value_dim=cfg.linear_v_dim,
    )
    return {i: shape for i in layers if cfg.is_recurrent(i)}


def ropes(cfg: Qwen35Config, weights: dict[str, torch.Tensor], device: torch.device) -> dict:
    rope = Rope(rope_inv_freq(cfg.rope_dims, cfg.rope_base).to(device))
    return {i: rope for i in range(cfg.n_layers) if not cfg.is_recurrent(i)}


def embed(model: ModelParts, ids: torch.Tensor) -> torch.Tensor:
    return common.embed_rows(model, ids)


def dense_ffn(model: ModelParts, layer: int, h: torch.Tensor) -> torch.Tensor:
    w = model.weights
    return swiglu(h, w[f"{layer}.ffn_gate"], w[f"{layer}.ffn_up"], w[f"{layer}.ffn_down"])


def block(
    model: ModelParts,
    layer: int,
    x: torch.Tensor,
    start: int | Ragged,
    cache: KVCache | Ragged,
    ffn: Callable[[ModelParts, int, torch.Tensor], torch.Tensor] = dense_ffn,
) -> torch.Tensor:
    """x + mixer(norm x), then + ffn(norm x); `ffn` is the dense SwiGLU or qwen35moe's experts."""
    cfg: Qwen35Config = model.cfg
    w, eps = model.weights, cfg.rms_eps
    h = rms_norm(x, w[f"{layer}.attn_norm"], eps)
    if cfg.is_recurrent(layer) and isinstance(cache, Ragged):  # each sequence's own state
        x = x + cache.per_sequence(lambda s, h: delta_net(model, layer, h, s.cache), h)
    elif cfg.is_recurrent(layer):
        x = x + delta_net(model, layer, h, cache)
    else:
        x = x + gated_attention(model, layer, h, start, cache)
    return x + ffn(model, layer, rms_norm(x, w[f"{layer}.post_attn_norm"], eps))


def gated_attention(
    model: ModelParts, layer: int, x: torch.Tensor, start: int | Ragged, cache: KVCache | Ragged
) -> torch.Tensor:
    cfg: Qwen35Config = model.cfg
    w = model.weights
    n, heads, d = x.shape[0], cfg.n_heads, cfg.head_dim
    qg = linear(x, w[f"{layer}.attn_q"]).view(n, heads, 2, d)
    q = rms_norm(qg[:, :, 0], w[f"{layer}.attn_q_norm"], cfg.rms_eps)
    gate = qg[:, :, 1].reshape(n, heads * d)
    k = linear(x, w[f"{layer}.attn_k"]).view(n, cfg.n_kv_heads, d)
    k = rms_norm(k, w[f"{layer}.attn_k_norm"], cfg.rms_eps)
    v = linear(x, w[f"{layer}.attn_v"]).view(n, cfg.n_kv_heads, d)
    cos, sin = model.ropes[layer].tables(start, n, q.dtype)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    out = common.cached_attention(layer, q, start, cache, (k, v), window=None, scale=d**-0.5)
    return linear(out * torch.sigmoid(gate), w[f"{layer}.attn_output"])


def delta_net(model: ModelParts, layer: int, x: torch.Tensor, cache: KVCache) -> torch.Tensor:
    cfg: Qwen35Config = model.cfg
    w = model.weights
    n = x.shape[0]
    hk, hv, dk, dv = cfg.linear_k_heads, cfg.linear_v_heads, cfg.linear_k_dim, cfg.linear_v_dim
    conv_state, state = cache.recurrent_state(layer)
    qkv, z, b, a = linear(x, w[f"{layer}.ssm_in"]).split(
        [cfg.conv_channels, hv * dv, hv, hv], dim=-1
    )

    # Causal depthwise conv over the window [K-1 earlier inputs, this forward's n]: token t
    # sees window rows t..t+K-1. A product and a sum, far cheaper per decode step than
    # F.conv1d's mkldnn path (docs/performance.md, "Measurements behind the code").
    window = torch.cat([conv_state, qkv])  # [K-1+n, channels]
    taps = window.unfold(0, cfg.conv_kernel, 1)  # [n, channels, K] view
    mixed = F.silu((taps * w[f"{layer}.ssm_conv"]).sum(-1))  # [n, channels]
    q, k, v = mixed.split([hk * dk, hk * dk, hv * dv], dim=-1)

    beta = torch.sigmoid(b).float()  # [n, Hv]
    dt = F.softplus(a.float() + w[f"{layer}.ssm_dt"].float())
    g = w[f"{layer}.ssm_a"].float() * dt  # [n, Hv]: log of the decay, <= 0
    q = _to_value_heads(_l2norm(q.float().view(n, hk, dk)), hv) * dk**-0.5
    k = _to_value_heads(_l2norm(k.float().view(n, hk, dk)), hv)
    v = v.float().view(n, hv, dv)
    steps = None
    if n == 1:
        o, state = _delta_rule_step(q[0], k[0], v[0], g[0], beta[0], state)
        o = o[None]
    elif cache.tracks_positions():  # a verify block: keep the state after every token
        o, deltas = _delta_rule_steps(q, k, v, g, beta, state)
        state = deltas[-1]
        # Token t's conv state is the window's rows t+1 .. t+K-1 (views of one tensor).
        steps = [(window[t + 1 : t + cfg.conv_kernel], deltas[t]) for t in range(n)]
    else:
        o, state = _delta_rule_chunked(q, k, v, g, beta, state)
    cache.stage_state(layer, window[n:].clone(), state, steps)

    # Gated RMSNorm per value head, in float32.
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + cfg.rms_eps)
    o = o * w[f"{layer}.ssm_norm"].float() * F.silu(z.float().view(n, hv, dv))
    return linear(o.reshape(n, hv * dv).to(x.dtype), w[f"{layer}.ssm_out"])


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + L2_EPS)


def _to_value_heads(x: torch.Tensor, hv: int) -> torch.Tensor:
    """[n, Hk, D] -> [n, Hv, D]: value head j reads key head j % Hk (llama.cpp's tiled
    order, see the module docstring)."""
    return x if x.shape[1] == hv else x.repeat(1, hv // x.shape[1], 1)


def _delta_rule_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token. q, k: [H, Dk]; v: [H, Dv]; g, beta: [H]; state: [H, Dk, Dv] (not written).
    Returns o [H, Dv] and the new state."""
    s = state * g.exp()[:, None, None]
    predicted = torch.bmm(k[:, None, :], s)[:, 0]  # [H, Dv]: S^T k
    update = (v - predicted) * beta[:, None]
    s = torch.baddbmm(s, k[:, :, None], update[:, None, :])  # S + k update^T
    return torch.bmm(q[:, None, :], s)[:, 0], s


def _delta_rule_steps(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The recurrent form over n tokens: o [n, H, Dv] and the state after each token."""
    outs, states = [], []
    for t in range(q.shape[0]):
        o, state = _delta_rule_step(q[t], k[t], v[t], g[t], beta[t], state)
        outs.append(o)
        states.append(state)
    return torch.stack(outs), states


def _delta_rule_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence of `_delta_rule_step` over n tokens, a chunk of L at a time.

    q, k: [n, H, Dk]; v: [n, H, Dv]; g, beta: [n, H]; state: [H, Dk, Dv] (not written).
    Within a chunk, with G_t = exp(g_1 + ... + g_t) and S0 the state before it, unrolling
    the step gives for the updates u_t = beta_t (v_t - S_{t-1}'^T k_t):

        u_t + sum_{i<t} beta_t (G_t/G_i) (k_t . k_i) u_i = beta_t v_t - beta_t G_t S0^T k_t
        o_t = G_t S0^T q_t + sum_{i<=t} (G_t/G_i) (q_t . k_i) u_i
        S_L = G_L S0 + sum_i (G_L/G_i) k_i u_i^T

    The first line is a unit lower triangular system (I + A) U = B, solved once for the
    v part and the S0 part of B, so that only `U = U_v - W S0` waits for the previous chunk.
    """
    n, heads, dk = k.shape
    size = min(chunk, n)
    pad = -n % size
    count = (n + pad) // size

    def chunks(t: torch.Tensor) -> torch.Tensor:  # [n, H, ...] -> [H, count, L, ...]
        t = F.pad(t, (0, 0) * (t.dim() - 1) + (0, pad))
        return t.transpose(0, 1).reshape(heads, count, size, *t.shape[2:])

    q, k, v, g, beta = (chunks(t) for t in (q, k, v, g, beta))
    log_g = g.cumsum(-1)  # [H, C, L]: log G_t; padding adds g = 0, beta = 0, k = 0
    causal = torch.ones(size, size, dtype=torch.bool, device=k.device).tril()
    # G_t / G_i for i <= t; exp of a masked -inf is 0 (and never overflows above it).
    ratio = (log_g[..., :, None] - log_g[..., None, :]).masked_fill(~causal, -torch.inf).exp()
    decay = log_g.exp()[..., None]  # [H, C, L, 1]
    system = (beta[..., None] * (k @ k.transpose(-1, -2)) * ratio).tril(-1)
    rhs = torch.cat([beta[..., None] * v, beta[..., None] * decay * k], dim=-1)
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    u_v, w_s = solved.split([v.shape[-1], dk], dim=-1)
    scores = (q @ k.transpose(-1, -2)) * ratio  # [H, C, L, L]
    q_decayed = q * decay
    k_to_end = k * (log_g[..., -1:] - log_g).exp()[..., None]  # G_L / G_i k_i
    outs = []
    for c in range(count):
        u = u_v[:, c] - w_s[:, c] @ state  # [H, L, Dv]
        outs.append(q_decayed[:, c] @ state + scores[:, c] @ u)
        state = state * decay[:, c, -1:] + k_to_end[:, c].transpose(-1, -2) @ u
    out = torch.stack(outs, dim=1).reshape(heads, count * size, -1)[:, :n]
    return out.transpose(0, 1), state


def project(model: ModelParts, h: torch.Tensor) -> torch.Tensor:
    """Normed hidden -> float32 logits: the head matrix alone."""
    return linear(h, model.weights["head"]).float()


def head(model: ModelParts, x: torch.Tensor) -> torch.Tensor:
    return project(model, rms_norm(x, model.weights["out_norm"], model.cfg.rms_eps))
