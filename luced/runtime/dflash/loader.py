"""DFlash draft weights and config from either published layout.

* GGUF (`convert_dflash_to_gguf.py` layout; arch `qwen35-dflash-draft`, `dflash-draft` or
  `gemma4-dflash-draft`): tensors `dflash.fc.weight`, `dflash.hidden_norm.weight`,
  `output_norm.weight`, `blk.{i}.attn_norm / ffn_norm / attn_q / attn_k / attn_v / attn_output /
  attn_q_norm / attn_k_norm / ffn_gate / ffn_up / ffn_down.weight` (aliases `dflash_fc.weight`,
  `dflash_hidden_norm.weight`, `blk.{i}.post_attention_norm.weight`); keys under `{arch}.`:
  `dflash.n_target_layers` (the capture COUNT), `dflash.target_layer_ids`, `dflash.block_size`,
  `dflash.mask_token_id`, `attention.sliding_window(_pattern)`, `rope.freq_base`, ...
* safetensors + `config.json` (z-lab / Hugging Face Qwen3 layout): `fc.weight`,
  `hidden_norm.weight`, `norm.weight`, `layers.{i}.input_layernorm / post_attention_layernorm /
  self_attn.{q,k,v,o}_proj / self_attn.{q,k}_norm / mlp.{gate,up,down}_proj.weight`; draft fields
  in `dflash_config` win over top-level ones, as in the reference.

Dimensions come from tensor shapes (hidden = len(hidden_norm), head_dim = len(q_norm), ...), so a
file whose metadata and tensors disagree is caught here. Capture layers: the file's
`target_layer_ids` when present, else the reference formula (`reference_capture_layers`) over
the TARGET's layer count. Every error names the file.

Weight keys: `fc`, `hidden_norm`, `norm`, `{i}.{attn_norm, ffn_norm, attn_q, ...}`; matrices in
`layers.linear`'s layout (`store_matrix`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from luced.gguf_file import GGUFFile
from luced.runtime.layers import store_matrix
from luced.runtime.weights import WeightLoader

GGUF_ARCHES = ("qwen35-dflash-draft", "dflash-draft", "gemma4-dflash-draft")

# our key -> (GGUF names, first found wins; safetensors name); `{i}` = layer index
EDGE_TENSORS = {
    "fc": (("dflash.fc.weight", "dflash_fc.weight"), "fc.weight"),
    "hidden_norm": (
        ("dflash.hidden_norm.weight", "dflash_hidden_norm.weight"),
        "hidden_norm.weight",
    ),
    "norm": (("output_norm.weight",), "norm.weight"),
}
LAYER_TENSORS = {
    "attn_norm": (("attn_norm.weight",), "input_layernorm.weight"),
    "ffn_norm": (
        ("ffn_norm.weight", "post_attention_norm.weight"),
        "post_attention_layernorm.weight",
    ),
    "attn_q": (("attn_q.weight",), "self_attn.q_proj.weight"),
    "attn_k": (("attn_k.weight",), "self_attn.k_proj.weight"),
    "attn_v": (("attn_v.weight",), "self_attn.v_proj.weight"),
    "attn_output": (("attn_output.weight",), "self_attn.o_proj.weight"),
    "attn_q_norm": (("attn_q_norm.weight",), "self_attn.q_norm.weight"),
    "attn_k_norm": (("attn_k_norm.weight",), "self_attn.k_norm.weight"),
    "ffn_gate": (("ffn_gate.weight",), "mlp.gate_proj.weight"),
    "ffn_up": (("ffn_up.weight",), "mlp.up_proj.weight"),
    "ffn_down": (("ffn_down.weight",), "mlp.down_proj.weight"),
}
MATRICES = {"fc", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"}


class DraftError(ValueError):
    """A draft file that cannot be used (with this target); the message names the file."""


@dataclass(frozen=True)
class DraftConfig:
    hidden: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn: int
    rms_eps: float
    rope_base: float
    rope_linear_scale: float
    capture_layers: tuple[int, ...]
    block_size: int
    mask_token_id: int | None
    sliding_window: int | None  # None: no layer has a window
    sliding_layers: tuple[bool, ...]  # per layer: "sliding_attention"
    is_causal: bool | None  # config override; None = causal iff sliding (the reference rule)
    # Logit post-processing the reference reads from the draft config (kept for the loop).
    output_multiplier: float = 1.0
    logit_softcap: float | None = None
    input_embedding_scale: float = 1.0


def reference_capture_layers(n_target_layers: int, n_capture: int) -> tuple[int, ...]:
    """z-lab's default: the middle layer for one capture, else `n_capture` ids spread evenly
    from layer 1 to layer n-3 (rounded half to even, as Python's round)."""
    if n_capture == 1:
        return (n_target_layers // 2,)
    span = n_target_layers - 4
    return tuple(round(1 + i * span / (n_capture - 1)) for i in range(n_capture))


def load_draft(
    path: Path,
    *,
    target_hidden: int,
    target_n_layers: int,
    dtype: torch.dtype,
    device: torch.device,
) -> tuple[DraftConfig, dict[str, torch.Tensor]]:
    """Read a draft GGUF file or a safetensors file / directory and check it fits the target."""
    if path.is_dir() or path.suffix == ".safetensors":
        cfg, weights = _load_safetensors(path, target_n_layers, dtype, device)
    else:
        cfg, weights = _load_gguf(path, target_n_layers, dtype, device)
    _check_fit(path, cfg, weights, target_hidden, target_n_layers)
    return cfg, weights


def _dims_from_shapes(path: Path, weights: dict[str, torch.Tensor], n_layers: int) -> dict:
    """Dimensions as Lucebox infers them, with every layer's shapes checked against them."""
    hidden = weights["hidden_norm"].shape[0]
    head_dim = weights["0.attn_q_norm"].shape[0]
    rows = {k: tuple(_rows(v).shape) for k, v in weights.items()}
    q_dim, kv_dim = rows["0.attn_q"][0], rows["0.attn_k"][0]
    ffn = rows["0.ffn_gate"][0]
    fc_in = rows["fc"][1]
    if q_dim % head_dim or kv_dim % head_dim or fc_in % hidden:
        raise DraftError(
            f"{path}: inconsistent draft tensor shapes (q {q_dim}, kv {kv_dim}, "
            f"head_dim {head_dim}, fc input {fc_in}, hidden {hidden})"
        )
    expect = {"fc": (hidden, fc_in), "norm": (hidden,)}
    for i in range(n_layers):
        expect |= {
            f"{i}.attn_norm": (hidden,),
            f"{i}.ffn_norm": (hidden,),
            f"{i}.attn_q": (q_dim, hidden),
            f"{i}.attn_k": (kv_dim, hidden),
            f"{i}.attn_v": (kv_dim, hidden),
            f"{i}.attn_output": (hidden, q_dim),
            f"{i}.attn_q_norm": (head_dim,),
            f"{i}.attn_k_norm": (head_dim,),
            f"{i}.ffn_gate": (ffn, hidden),
            f"{i}.ffn_up": (ffn, hidden),
            f"{i}.ffn_down": (hidden, ffn),
        }
    for key, shape in expect.items():
        if rows[key] != shape:
            raise DraftError(f"{path}: draft tensor {key} has shape {rows[key]}, expected {shape}")
    n_heads, n_kv = q_dim // head_dim, kv_dim // head_dim
    if n_heads % n_kv:
        raise DraftError(f"{path}: {n_heads} query heads not divisible by {n_kv} kv heads")
    return {
        "hidden": hidden,
        "head_dim": head_dim,
        "n_heads": n_heads,
        "n_kv_heads": n_kv,
        "ffn": ffn,
        "n_capture": fc_in // hidden,
    }


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[out, in] view of a stored matrix; 1-D tensors unchanged."""
    return t.t() if t.dim() == 2 and t.dtype == torch.float32 else t


def _capture_layers(
    path: Path, ids: Any, n_capture: int, count_hint: int | None, target_n_layers: int
) -> tuple[int, ...]:
    if count_hint is not None and count_hint != n_capture:
        raise DraftError(
            f"{path}: draft declares {count_hint} captured target layers but its fc "
            f"takes {n_capture} x hidden inputs"
        )
    if ids is None:
        return reference_capture_layers(target_n_layers, n_capture)
    out = tuple(int(i) for i in ids)
    if len(out) != n_capture:
        raise DraftError(
            f"{path}: target_layer_ids has {len(out)} entries but the draft's fc takes "
            f"{n_capture} captures"
        )
    return out


def _check_fit(
    path: Path,
    cfg: DraftConfig,
    weights: dict[str, torch.Tensor],
    target_hidden: int,
    target_n_layers: int,
) -> None:
    if cfg.hidden != target_hidden:
        raise DraftError(
            f"{path}: draft hidden size {cfg.hidden} does not match the target's {target_hidden}"
        )
    bad = [i for i in cfg.capture_layers if not 0 <= i < target_n_layers]
    if bad:
        raise DraftError(
            f"{path}: capture layers {list(cfg.capture_layers)} do not fit a target with "
            f"{target_n_layers} layers"
        )
    if len(set(cfg.capture_layers)) != len(cfg.capture_layers):
        raise DraftError(
            f"{path}: capture layers {list(cfg.capture_layers)} repeat a layer: a target with "
            f"{target_n_layers} layers is too shallow for {len(cfg.capture_layers)} captures"
        )
    if cfg.block_size < 2:
        raise DraftError(f"{path}: block_size {cfg.block_size} must be at least 2")


# ---------------------------------------------------------------------------------- GGUF


def _load_gguf(
    path: Path, target_n_layers: int, dtype: torch.dtype, device: torch.device
) -> tuple[DraftConfig, dict[str, torch.Tensor]]:
    gguf = GGUFFile(path)
    arch = gguf.arch
    if arch not in GGUF_ARCHES:
        raise DraftError(
            f"{path}: architecture {arch!r} is not a DFlash draft ({', '.join(GGUF_ARCHES)})"
        )

    def meta(name: str, default: Any = None) -> Any:
        return gguf.get(f"{arch}.{name}", default)

    n_layers = meta("block_count")
    if n_layers is None:  # count the layers present
        n_layers = 0
        while f"blk.{n_layers}.attn_q.weight" in gguf.tensors:
            n_layers += 1
    n_layers = int(n_layers)
    if n_layers <= 0:
        raise DraftError(f"{path}: draft has no layers")

    def pick(names: tuple[str, ...]) -> str:
        return next((n for n in names if n in gguf.tensors), names[0])  # absent: load names it

    plan = {key: (pick(gg), key in MATRICES) for key, (gg, _) in EDGE_TENSORS.items()}
    for i in range(n_layers):
        for key, (gg, _) in LAYER_TENSORS.items():
            plan[f"{i}.{key}"] = (pick(tuple(f"blk.{i}.{n}" for n in gg)), key in MATRICES)
    weights = WeightLoader(gguf, dtype, device).load_all(plan)
    dims = _dims_from_shapes(path, weights, n_layers)

    ids = meta("dflash.target_layer_ids")
    hint = meta("dflash.n_target_layers")
    if hint is None and ids is not None:
        hint = len(ids)
    if hint is None and meta("dflash.n_target_features") is not None:
        hint = int(meta("dflash.n_target_features")) // dims["hidden"]
    window = meta("attention.sliding_window")
    pattern = meta("attention.sliding_window_pattern")
    sliding = (False,) * n_layers
    if window and pattern is not None:
        if isinstance(pattern, np.ndarray | list):
            sliding = tuple(bool(p) for p in pattern)
        else:  # a period, as llama.cpp's gemma files: layer i is global iff (i + 1) % p == 0
            sliding = tuple(
                int(pattern) <= 0 or (i + 1) % int(pattern) != 0 for i in range(n_layers)
            )
        if len(sliding) != n_layers:
            raise DraftError(
                f"{path}: sliding_window_pattern has {len(sliding)} entries for {n_layers} layers"
            )
    mask = meta("dflash.mask_token_id")
    cfg = DraftConfig(
        n_layers=n_layers,
        rms_eps=float(meta("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_base=float(meta("rope.freq_base", 1e6)),
        rope_linear_scale=1.0,
        capture_layers=_capture_layers(
            path, ids, dims["n_capture"], None if hint is None else int(hint), target_n_layers
        ),
        block_size=int(meta("dflash.block_size", 16)),
        mask_token_id=None if mask is None else int(mask),
        sliding_window=int(window) if window and any(sliding) else None,
        sliding_layers=sliding,
        is_causal=None,
        **{k: v for k, v in dims.items() if k != "n_capture"},
    )
    return cfg, weights


# --------------------------------------------------------------------------- safetensors


def _safetensors_files(path: Path) -> tuple[Path, list[Path]]:
    """(config.json, weight files) for a directory or one .safetensors file beside its config."""
    folder = path if path.is_dir() else path.parent
    config = folder / "config.json"
    if not path.exists():
        raise DraftError(f"{path}: no such draft file or directory")
    if not config.is_file():
        raise DraftError(f"{path}: safetensors draft without {config.name} beside it")
    files = sorted(folder.glob("*.safetensors")) if path.is_dir() else [path]
    if not files:
        raise DraftError(f"{path}: no .safetensors files")
    return config, files


def _rope(path: Path, cfg: dict[str, Any]) -> tuple[float, float]:
    """(theta, linear scale) from transformers 5 `rope_parameters` or older `rope_theta` /
    `rope_scaling`. Lucebox refuses a draft without a theta: so do we."""
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    theta = params.get("rope_theta", cfg.get("rope_theta"))
    if theta is None:
        raise DraftError(f"{path}: draft config has no rope_theta")
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if kind == "default":
        return float(theta), 1.0
    if kind == "linear":
        return float(theta), float(params.get("factor", scaling.get("factor", 1.0)))
    raise DraftError(f"{path}: draft RoPE type {kind!r} is not supported (default, linear)")


def _load_safetensors(
    path: Path, target_n_layers: int, dtype: torch.dtype, device: torch.device
) -> tuple[DraftConfig, dict[str, torch.Tensor]]:
    from safetensors import safe_open

    config_path, files = _safetensors_files(path)
    try:
        cfg = json.loads(config_path.read_text())
    except (OSError, ValueError) as exc:
        raise DraftError(f"{config_path}: unreadable draft config: {exc}") from exc
    draft_cfg = cfg.get("dflash_config") or {}

    def value(name: str, default: Any = None) -> Any:  # the reference's _draft_value
        return draft_cfg.get(name, cfg.get(name, default))

    try:
        n_layers = int(cfg["num_hidden_layers"])
        eps = float(cfg.get("rms_norm_eps", 1e-6))
    except (KeyError, TypeError, ValueError) as exc:
        raise DraftError(f"{config_path}: bad draft config: {exc!r}") from exc

    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                tensors[name.removeprefix("model.")] = f.get_tensor(name)
    names = {key: st for key, (_, st) in EDGE_TENSORS.items()}
    for i in range(n_layers):
        names |= {f"{i}.{key}": f"layers.{i}.{st}" for key, (_, st) in LAYER_TENSORS.items()}
    weights = {}
    for key, name in names.items():
        if name not in tensors:
            raise DraftError(f"{path}: missing tensor {name!r}")
        t = tensors[name].to(device=device, dtype=dtype)
        weights[key] = store_matrix(t) if key.split(".")[-1] in MATRICES else t.contiguous()
    dims = _dims_from_shapes(path, weights, n_layers)
    if int(cfg.get("hidden_size", dims["hidden"])) != dims["hidden"]:
        raise DraftError(
            f"{path}: config hidden_size {cfg['hidden_size']} does not match "
            f"the tensors' {dims['hidden']}"
        )

    # Hugging Face's Qwen3Config rules: no window unless use_sliding_window; layer_types
    # default to sliding from max_window_layers on.
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window", False) else None
    types = cfg.get("layer_types") or [
        "sliding_attention"
        if window is not None and i >= int(cfg.get("max_window_layers", 28))
        else "full_attention"
        for i in range(n_layers)
    ]
    if len(types) != n_layers:
        raise DraftError(f"{config_path}: layer_types has {len(types)} entries for {n_layers}")
    sliding = tuple(t == "sliding_attention" for t in types)
    theta, scale = _rope(config_path, cfg)
    softcap = value("final_logit_softcapping")
    mask = value("mask_token_id")
    causal = cfg.get("is_causal")
    out = DraftConfig(
        n_layers=n_layers,
        rms_eps=eps,
        rope_base=theta,
        rope_linear_scale=scale,
        capture_layers=_capture_layers(
            path, value("target_layer_ids"), dims["n_capture"], None, target_n_layers
        ),
        block_size=int(value("block_size", 16)),
        mask_token_id=None if mask is None else int(mask),
        sliding_window=int(window) if window is not None and any(sliding) else None,
        sliding_layers=sliding,
        is_causal=None if causal is None else bool(causal),
        output_multiplier=float(value("output_multiplier", 1.0)),
        logit_softcap=float(softcap) if softcap is not None and float(softcap) > 0 else None,
        input_embedding_scale=float(value("input_embedding_scale", 1.0)),
        **{k: v for k, v in dims.items() if k != "n_capture"},
    )
    return out, weights
