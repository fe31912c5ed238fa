"""BERT-family encoders (`bert`, `nomic-bert`): bidirectional attention, post-norm blocks,
no LM head. They serve embeddings only: a pooled last-layer state per input.

    bert        word + position + token-type-0 embeddings, LayerNorm; each block
                x = LN(x + O(attn(x))), x = LN(x + down(GELU(up(x)))), every matrix with
                its bias, exact (erf) GELU
    nomic-bert  no position table: RoPE (rotate-half) on Q and K instead; Q, K, V in one
                matrix; SwiGLU FFN; no biases

Every query sees every key of its input, so an input is encoded whole in one span from
position 0 (the engine never cuts an encoder's input into chunks), and no K/V is kept:
attention reads the span's own rows. BERT's position rows and the embedding LayerNorm
need each row's position, which `block` has (`start`) and `embed` does not, so they open
layer 0 (always in the first shard, beside the embedding).

GGUF (llama.cpp's converter): `attention.layer_norm_epsilon`, `attention.causal` false,
`pooling_type`; nomic-bert's RoPE base `rope.freq_base`; `token_types` has a row per
token type, and every input is type 0 (as llama.cpp feeds it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from luced.gguf_file import GGUFFile
from luced.runtime.families import common
from luced.runtime.families.common import ModelParts
from luced.runtime.layers import Rope, attention, gated_ffn, layer_norm, linear, linears
from luced.runtime.layers import rope_inv_freq as inv_freq
from luced.runtime.ragged import Ragged

if TYPE_CHECKING:
    from luced.runtime.kv_cache import KVStore

ARCH = "bert"
NOMIC = "nomic-bert"

_NORMS = ("attn_output_norm", "layer_output_norm")
_BERT_LINEARS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_up", "ffn_down")
_NOMIC_LINEARS = ("attn_qkv", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


@dataclass(frozen=True)
class EncoderConfig(common.ModelConfig):
    rope: bool = False  # nomic-bert: RoPE instead of a position table
    biases: bool = True


def config_from_gguf(gguf: GGUFFile) -> EncoderConfig:
    eps = gguf.require(f"{gguf.arch}.attention.layer_norm_epsilon")
    nomic = gguf.arch == NOMIC
    return common.make_config(
        EncoderConfig, gguf, known={"rms_eps": float(eps)}, rope=nomic, biases=not nomic
    )


def weight_plan(
    cfg: EncoderConfig, layers: range, owns_embed: bool, owns_head: bool
) -> dict[str, tuple[str, bool]]:
    """Embedding pieces in the first shard; each layer's matrices, biases and norms. The
    last shard holds no head: the last layer's output is normed already."""
    plan: dict[str, tuple[str, bool]] = {}
    if owns_embed:
        plan["tok_embd"] = ("token_embd.weight", False)
        plan["token_types"] = ("token_types.weight", False)
        plan["embd_norm"] = ("token_embd_norm.weight", False)
        plan["embd_norm_b"] = ("token_embd_norm.bias", False)
        if not cfg.rope:
            plan["pos_embd"] = ("position_embd.weight", False)
    for i in layers:
        for name in _BERT_LINEARS if cfg.biases else _NOMIC_LINEARS:
            plan[f"{i}.{name}"] = (f"blk.{i}.{name}.weight", True)
            if cfg.biases:
                plan[f"{i}.{name}_b"] = (f"blk.{i}.{name}.bias", False)
        for name in _NORMS:
            plan[f"{i}.{name}"] = (f"blk.{i}.{name}.weight", False)
            plan[f"{i}.{name}_b"] = (f"blk.{i}.{name}.bias", False)
    return plan


FUSED = (("attn_q", "attn_k", "attn_v"), ("ffn_gate", "ffn_up"))


def prepare(cfg: EncoderConfig, weights: dict[str, torch.Tensor]) -> None:
    """Nothing to undo: the converter keeps Hugging Face's row order for encoders."""


def ropes(cfg: EncoderConfig, weights: dict[str, torch.Tensor], device: torch.device) -> dict:
    if not cfg.rope:
        return {}
    rope = Rope(inv_freq(cfg.rope_dims, cfg.rope_base).to(device))
    return dict.fromkeys(range(cfg.n_layers), rope)


def embed(model: ModelParts, ids: torch.Tensor) -> torch.Tensor:
    """Word rows plus token type 0; without a position table, normed here (else layer 0
    adds the positions first)."""
    w = model.weights
    x = w["tok_embd"][ids] + w["token_types"][0]
    return x if "pos_embd" in w else _norm(model, x, "embd_norm")


def block(
    model: ModelParts, layer: int, x: torch.Tensor, start: int | Ragged, cache: KVStore | Ragged
) -> torch.Tensor:
    w = model.weights
    if layer == 0 and "pos_embd" in w:
        x = _norm(model, x + w["pos_embd"][_positions(start, x.shape[0])], "embd_norm")
    x = _norm(model, x + _attention(model, layer, x, start), f"{layer}.attn_output_norm")
    if model.cfg.biases:
        up = F.gelu(_linear(model, x, f"{layer}.ffn_up"))
        h = _linear(model, up, f"{layer}.ffn_down")
    else:
        h = gated_ffn(x, w, f"{layer}.")
    return _norm(model, x + h, f"{layer}.layer_output_norm")


def _attention(model: ModelParts, layer: int, x: torch.Tensor, start: int | Ragged) -> torch.Tensor:
    """Every row of an input attends to every row of it (no mask, no cache)."""
    cfg: EncoderConfig = model.cfg
    n, d = x.shape[0], cfg.head_dim
    if cfg.biases:
        keys = [f"{layer}.attn_q", f"{layer}.attn_k", f"{layer}.attn_v"]
        q, k, v = (
            t + model.weights[f"{key}_b"]
            for t, key in zip(linears(x, model.weights, keys), keys, strict=True)
        )
    else:
        q, k, v = linear(x, model.weights[f"{layer}.attn_qkv"]).chunk(3, -1)
    q, k, v = q.reshape(n, -1, d), k.reshape(n, -1, d), v.reshape(n, -1, d)  # [n, H, D]
    if cfg.rope:
        q, kv = common.rotate(q, (k, v), start, model.ropes[layer])
        assert kv is not None
        k, v = kv

    def one(span_start: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if span_start != 0:
            raise ValueError(
                f"{cfg.arch} encodes an input whole, in one span from position 0; got a "
                f"span at position {span_start}"
            )
        return attention(q, k.transpose(0, 1), v.transpose(0, 1), None, d**-0.5)

    if isinstance(start, Ragged):
        out = start.per_sequence(lambda span, *rows: one(span.start, *rows), q, k, v)
    else:
        out = one(start, q, k, v)
    return _linear(model, out, f"{layer}.attn_output")


def _linear(model: ModelParts, x: torch.Tensor, key: str) -> torch.Tensor:
    y = linear(x, model.weights[key])
    bias = model.weights.get(f"{key}_b")
    return y if bias is None else y + bias


def _norm(model: ModelParts, x: torch.Tensor, key: str) -> torch.Tensor:
    w = model.weights
    return layer_norm(x, w[key], w[f"{key}_b"], model.cfg.rms_eps)


def _positions(start: int | Ragged, n: int) -> torch.Tensor:
    if isinstance(start, Ragged):
        return start.positions
    return torch.arange(start, start + n)


def final_norm(model: ModelParts, x: torch.Tensor) -> torch.Tensor:
    """The last layer's output is what an embedding pools: each block ends normed."""
    return x


def head(model: ModelParts, x: torch.Tensor) -> torch.Tensor:
    raise ValueError(f"{model.cfg.arch} is an encoder without an LM head: it serves embeddings")


project = head
