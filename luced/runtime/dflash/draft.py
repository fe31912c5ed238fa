"""The DFlash draft: a few Qwen3-style layers conditioned on captured target features.

    draft = Draft.load(path, target_hidden=cfg.hidden, target_n_layers=cfg.n_layers)
    noise = draft.noise_embeddings(target, [last_tok] + [draft.mask_token_id] * (B - 1))
    h = draft.forward(ctx_features, noise, ctx_start)      # [B, hidden], after the draft's norm
    logits = project_with_target_head(target, h[1:])       # target head only, no target norm

One step (reference: z-lab `DFlashDraftModel`, see shared/dflash-reference.md A.3):

    T = RMSNorm_hidden_norm(ctx_features @ fc^T)           [C, hidden]
    h = noise                                              [B, hidden]
    per layer:  x = RMSNorm(h);  Q from x;  K, V from concat(T, x) (context rows first)
                per-head RMSNorm on Q and K, RoPE, attention, h += o(attn); h += SwiGLU(RMSNorm(h))
    out = RMSNorm_norm(h)

Positions are absolute, as in the reference: context rows at ctx_start .. ctx_start+C-1, the
block at ctx_start+C .. ctx_start+C+B-1 (only differences matter to RoPE, so a window-relative
caller passing ctx_start=0 gets the same result). Attention inside the block is NON-causal on
full layers (every query sees all context and all block keys); sliding layers are causal and
see keys with q_pos - k_pos < window, the window sliding per query as the reference does it.

Stateless: context K/V are recomputed every call (cost grows with C); the caller bounds C.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from luced.runtime.dflash.loader import DraftConfig, load_draft
from luced.runtime.families.common import embed_rows
from luced.runtime.layers import (
    Rope,
    apply_rope,
    attention,
    linear,
    rms_norm,
    rope_inv_freq,
    swiglu,
)
from luced.runtime.weights import parse_dtype

if TYPE_CHECKING:
    from luced.runtime.model import Model

log = logging.getLogger(__name__)


class Draft:
    def __init__(
        self,
        cfg: DraftConfig,
        weights: dict[str, torch.Tensor],
        dtype: torch.dtype,
        device: torch.device,
        path: Path,
    ) -> None:
        self.cfg = cfg
        self.weights = weights
        self.dtype = dtype
        self.device = device
        self.path = path
        inv = rope_inv_freq(cfg.head_dim, cfg.rope_base, linear_scale=cfg.rope_linear_scale)
        self.rope = Rope(inv.to(device))

    @classmethod
    def load(
        cls,
        path: str | os.PathLike[str],
        *,
        target_hidden: int,
        target_n_layers: int,
        dtype: str | torch.dtype = "float32",
        device: str | torch.device = "cpu",
    ) -> Draft:
        """A draft GGUF file, or a safetensors directory / file with config.json beside it.
        Raises ValueError (naming the file) when it is malformed or does not fit the target."""
        t0 = time.monotonic()
        p = Path(path)
        torch_dtype, torch_device = parse_dtype(dtype), torch.device(device)
        cfg, weights = load_draft(
            p,
            target_hidden=target_hidden,
            target_n_layers=target_n_layers,
            dtype=torch_dtype,
            device=torch_device,
        )
        log.info(
            "loaded draft %s (%d layers, captures %s, block %d) in %.1f s",
            p.name,
            cfg.n_layers,
            list(cfg.capture_layers),
            cfg.block_size,
            time.monotonic() - t0,
        )
        return cls(cfg, weights, torch_dtype, torch_device, p)

    @property
    def capture_layers(self) -> tuple[int, ...]:
        return self.cfg.capture_layers

    @property
    def block_size(self) -> int:
        return self.cfg.block_size

    @property
    def mask_token_id(self) -> int | None:
        return self.cfg.mask_token_id

    @torch.inference_mode()
    def noise_embeddings(self, target: Model, ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """The block's input: the target's RAW embedding rows (no family scaling such as
        Gemma's sqrt(hidden)) times the draft's input_embedding_scale, as the reference."""
        ids_t = torch.as_tensor(ids, dtype=torch.long, device=target.device)
        rows = embed_rows(target, ids_t).to(self.dtype)
        if self.cfg.input_embedding_scale != 1.0:
            rows = rows * self.cfg.input_embedding_scale
        return rows.to(self.device)

    @torch.inference_mode()
    def forward(
        self, ctx_features: torch.Tensor, noise_embeddings: torch.Tensor, ctx_start: int
    ) -> torch.Tensor:
        """ctx_features [C, n_capture*hidden] (captures concatenated in capture order),
        noise_embeddings [B, hidden] -> draft hidden [B, hidden] after the draft's final norm."""
        return self.hidden_states(ctx_features, noise_embeddings, ctx_start)

    def hidden_states(
        self,
        ctx_features: torch.Tensor,
        noise_embeddings: torch.Tensor,
        ctx_start: int,
        anchors: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The draft's math, differentiable (training calls it with trainable weights).

        anchors None: one block right after the context (inference). anchors [N] (absolute
        positions, training): noise holds N blocks of B rows, block j at positions
        anchors[j] .. anchors[j]+B-1; it sees the context rows strictly before anchors[j]
        and its own block, never another block (upstream's training layout: every block of
        a sequence in one forward)."""
        cfg, w = self.cfg, self.weights
        ctx = ctx_features.to(device=self.device, dtype=self.dtype)
        h = noise_embeddings.to(device=self.device, dtype=self.dtype)
        n_ctx, n_block = ctx.shape[0], h.shape[0]
        if ctx.shape[-1] != len(cfg.capture_layers) * cfg.hidden or h.shape[-1] != cfg.hidden:
            raise ValueError(
                f"draft expects features [C, {len(cfg.capture_layers) * cfg.hidden}] and noise "
                f"[B, {cfg.hidden}], got {tuple(ctx.shape)} and {tuple(h.shape)}"
            )
        fused = rms_norm(linear(ctx, w["fc"]), w["hidden_norm"], cfg.rms_eps)  # [C, hidden]
        if anchors is None:
            cos, sin = self.rope.tables(ctx_start, n_ctx + n_block, self.dtype)  # keys' positions
            layout = None
        else:
            layout = _BlockLayout(anchors.to(self.device), n_block, ctx_start, n_ctx)
            cos, sin = self.rope.tables(0, int(layout.k_pos.max()) + 1, self.dtype)
            cos, sin = cos[layout.k_pos], sin[layout.k_pos]
        for i in range(cfg.n_layers):
            x = rms_norm(h, w[f"{i}.attn_norm"], cfg.rms_eps)
            h = h + self._attention(i, x, fused, cos, sin, layout)
            y = rms_norm(h, w[f"{i}.ffn_norm"], cfg.rms_eps)
            h = h + swiglu(y, w[f"{i}.ffn_gate"], w[f"{i}.ffn_up"], w[f"{i}.ffn_down"])
        return rms_norm(h, w["norm"], cfg.rms_eps)

    def _attention(
        self,
        i: int,
        x: torch.Tensor,
        fused: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        layout: _BlockLayout | None,
    ) -> torch.Tensor:
        cfg, w = self.cfg, self.weights
        n_block, n_keys = x.shape[0], fused.shape[0] + x.shape[0]
        q = linear(x, w[f"{i}.attn_q"]).view(n_block, cfg.n_heads, cfg.head_dim)
        # context rows first; under autocast fused may be bf16 while x is float32
        kv_in = torch.cat([fused.to(x.dtype), x])  # [C + B, hidden]
        k = linear(kv_in, w[f"{i}.attn_k"]).view(n_keys, cfg.n_kv_heads, cfg.head_dim)
        v = linear(kv_in, w[f"{i}.attn_v"]).view(n_keys, cfg.n_kv_heads, cfg.head_dim)
        q = rms_norm(q, w[f"{i}.attn_q_norm"], cfg.rms_eps)
        k = rms_norm(k, w[f"{i}.attn_k_norm"], cfg.rms_eps)
        q = apply_rope(q, cos[-n_block:], sin[-n_block:])  # queries sit at the block's positions
        k = apply_rope(k, cos, sin)
        mask = self._mask(i, n_block, n_keys, layout)
        out = attention(q, k.transpose(0, 1), v.transpose(0, 1), mask, cfg.head_dim**-0.5)
        return linear(out, w[f"{i}.attn_output"])

    def _mask(
        self, i: int, n_block: int, n_keys: int, layout: _BlockLayout | None = None
    ) -> torch.Tensor | None:
        """[B, C+B] bool (True = attend), or None when every query sees every key.

        The reference's rule: a layer is causal iff it is a sliding layer (unless the config
        sets is_causal); a sliding layer sees keys with q_pos - k_pos < window (and, when not
        causal, k_pos - q_pos < window too). With several blocks (`layout`), a query also
        sees only the context before its anchor and its own block."""
        cfg = self.cfg
        sliding = cfg.sliding_layers[i]
        causal = sliding if cfg.is_causal is None else cfg.is_causal
        window = cfg.sliding_window if sliding else None
        if not causal and window is None and layout is None:
            return None
        if layout is None:
            q_pos = torch.arange(n_keys - n_block, n_keys, device=self.device)[:, None]
            k_pos = torch.arange(n_keys, device=self.device)[None, :]
            visible = torch.ones(n_block, n_keys, dtype=torch.bool, device=self.device)
        else:
            q_pos, k_pos = layout.k_pos[-n_block:, None], layout.k_pos[None, :]
            visible = layout.visible.clone()
        if causal:
            visible &= k_pos <= q_pos
        if window is not None:
            visible &= (q_pos - k_pos) < window
            if not causal:
                visible &= (k_pos - q_pos) < window
        return visible


class _BlockLayout:
    """Positions and visibility of N blocks of B rows over C context rows (training)."""

    def __init__(self, anchors: torch.Tensor, n_rows: int, ctx_start: int, n_ctx: int) -> None:
        n = anchors.shape[0]
        if n_rows % n:
            raise ValueError(f"{n_rows} noise rows do not split into {n} blocks")
        b, dev = n_rows // n, anchors.device
        offsets = torch.arange(b, device=dev)
        block_pos = (anchors[:, None] + offsets).reshape(-1)  # [N*B]
        ctx_pos = torch.arange(ctx_start, ctx_start + n_ctx, device=dev)
        self.k_pos = torch.cat([ctx_pos, block_pos])  # [C + N*B]
        q_anchor = anchors.repeat_interleave(b)[:, None]  # [N*B, 1]
        q_block = torch.arange(n, device=dev).repeat_interleave(b)
        self.visible = torch.cat(
            [ctx_pos[None, :] < q_anchor, q_block[:, None] == q_block[None, :]], dim=1
        )


@torch.inference_mode()
def project_with_target_head(target: Model, hidden: torch.Tensor) -> torch.Tensor:
    """Draft hidden [n, hidden] -> float32 logits [n, vocab] through the target's head matrix
    and its logit scaling / softcap, WITHOUT the target's final norm (the draft already applied
    its own). The target (shard) must own the head."""
    if not target.owns_head:
        raise RuntimeError("this shard does not own the output head")
    return target.family.project(target, hidden.to(device=target.device, dtype=target.dtype))
