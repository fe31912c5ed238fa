"""A DFlash draft's files, as its loader (`loader.py`) reads them: the GGUF of llama.cpp's
`convert_dflash_to_gguf.py` (arch qwen35-dflash-draft, dflash.* tensors, blk.*) and the
z-lab / Hugging Face Qwen3 layout (config.json with dflash_config {target_layer_ids,
block_size, mask_token_id}, model.safetensors). `luced train-draft` writes its drafts with
them, starting from `random_weights`; `luced.runtime.tiny.draft` writes random ones.

    spec = spec_for_target("target.gguf", layers=1, block_size=8)
    write_gguf(spec, weights, out / "draft.gguf")      # weights: safetensors names -> arrays
    write_safetensors(spec, weights, out / "draft")

Norms are stored F32 in the GGUF, as the converter does, every other tensor in `spec.dtype`.
`sliding_layers` (e.g. "TF") with `sliding_window` gives sliding-window layers (config
`layer_types` / GGUF `attention.sliding_window_pattern`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
from safetensors.numpy import save_file

from luced.gguf_file import GGUFFile
from luced.runtime.dflash.loader import EDGE_TENSORS, LAYER_TENSORS, reference_capture_layers

GGUF_ARCH = "qwen35-dflash-draft"
NP_DTYPES = {"f32": np.float32, "f16": np.float16}


@dataclass(frozen=True)
class DraftSpec:
    hidden: int
    target_layers: int
    vocab_size: int
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    ffn: int = 128
    captures: int = 3
    capture_layers: tuple[int, ...] | None = None  # None: the reference formula
    block_size: int = 16
    mask_token_id: int | None = None  # None: the last vocabulary id
    rms_eps: float = 1e-6
    rope_base: float = 1e6
    sliding_window: int | None = None
    sliding_layers: str = ""  # per layer "T"/"F"; empty = none sliding
    dtype: str = "f32"
    seed: int = 0

    @property
    def target_layer_ids(self) -> list[int]:
        if self.capture_layers is not None:
            return list(self.capture_layers)
        ids = reference_capture_layers(self.target_layers, self.captures)
        if all(0 <= i < self.target_layers for i in ids):
            return list(ids)
        # Targets too shallow for the formula (tiny test models): spread over all layers.
        last, n = self.target_layers - 1, max(self.captures - 1, 1)
        return [round(i * last / n) for i in range(self.captures)]

    @property
    def mask_id(self) -> int:
        return self.vocab_size - 1 if self.mask_token_id is None else self.mask_token_id

    @property
    def sliding(self) -> list[bool]:
        flags = [c == "T" for c in self.sliding_layers] or [False] * self.layers
        if len(flags) != self.layers:
            raise ValueError(f"sliding_layers {self.sliding_layers!r} needs {self.layers} flags")
        return flags


def spec_for_target(target: str | Path, **overrides: object) -> DraftSpec:
    """A spec sized for the target GGUF (hidden, layer count, vocabulary from its metadata)."""
    g = GGUFFile(target)
    arch = g.arch
    vocab = g.get(f"{arch}.vocab_size")
    if vocab is None:
        vocab = g.info("token_embd.weight").shape[0]
    return DraftSpec(
        hidden=int(g.require(f"{arch}.embedding_length")),
        target_layers=int(g.require(f"{arch}.block_count")),
        vocab_size=int(vocab),
        **overrides,  # type: ignore[arg-type]
    )


def random_weights(spec: DraftSpec) -> dict[str, np.ndarray]:
    """Safetensors-named float32 weights, deterministic in the seed, rounded to spec.dtype.
    Scales keep activations O(1) through the layers so parity tests compare real numbers."""
    rng = np.random.default_rng(spec.seed)
    h, q, kv, f = spec.hidden, spec.heads * spec.head_dim, spec.kv_heads * spec.head_dim, spec.ffn

    def mat(rows: int, cols: int) -> np.ndarray:
        return rng.standard_normal((rows, cols), dtype=np.float32) / np.sqrt(cols)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    out = {"fc.weight": mat(h, spec.captures * h), "hidden_norm.weight": norm(h)}
    for i in range(spec.layers):
        p = f"layers.{i}."
        out |= {
            p + "input_layernorm.weight": norm(h),
            p + "self_attn.q_proj.weight": mat(q, h),
            p + "self_attn.k_proj.weight": mat(kv, h),
            p + "self_attn.v_proj.weight": mat(kv, h),
            p + "self_attn.o_proj.weight": mat(h, q),
            p + "self_attn.q_norm.weight": norm(spec.head_dim),
            p + "self_attn.k_norm.weight": norm(spec.head_dim),
            p + "post_attention_layernorm.weight": norm(h),
            p + "mlp.gate_proj.weight": mat(f, h),
            p + "mlp.up_proj.weight": mat(f, h),
            p + "mlp.down_proj.weight": mat(h, f),
        }
    out["norm.weight"] = norm(h)
    np_dtype = NP_DTYPES[spec.dtype]
    return {k: v.astype(np_dtype).astype(np.float32) for k, v in out.items()}


def hf_config(spec: DraftSpec) -> dict:
    """config.json as z-lab ships it (a Qwen3Config plus dflash_config)."""
    sliding = spec.sliding
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": spec.hidden,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "head_dim": spec.head_dim,
        "intermediate_size": spec.ffn,
        "hidden_act": "silu",
        "vocab_size": spec.vocab_size,
        "rms_norm_eps": spec.rms_eps,
        "rope_theta": spec.rope_base,
        "rope_parameters": {"rope_type": "default", "rope_theta": spec.rope_base},
        "attention_bias": False,
        "tie_word_embeddings": False,
        "use_sliding_window": spec.sliding_window is not None,
        "sliding_window": spec.sliding_window,
        "max_window_layers": spec.layers,
        "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
        "num_target_layers": spec.target_layers,
        "block_size": spec.block_size,
        "dflash_config": {
            "target_layer_ids": spec.target_layer_ids,
            "block_size": spec.block_size,
            "mask_token_id": spec.mask_id,
        },
        "torch_dtype": "float32" if spec.dtype == "f32" else "float16",
    }


def write_safetensors(
    spec: DraftSpec, weights: dict[str, np.ndarray], folder: Path, *, drop: tuple[str, ...] = ()
) -> Path:
    """folder/config.json and folder/model.safetensors (every tensor in `spec.dtype`);
    `drop` leaves tensors out (to build malformed folders for tests)."""
    folder.mkdir(parents=True, exist_ok=True)
    np_dtype = NP_DTYPES[spec.dtype]
    tensors = {k: np.ascontiguousarray(v.astype(np_dtype)) for k, v in weights.items()}
    save_file({k: v for k, v in tensors.items() if k not in drop}, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(hf_config(spec), indent=2) + "\n")
    return folder


def _gguf_name(name: str, aliases: bool) -> str:
    """The GGUF name of a safetensors-named tensor: the loader's first name, or its last (an
    alias) with `aliases`."""
    pick = -1 if aliases else 0
    edges = {st: names[pick] for names, st in EDGE_TENSORS.values()}
    if name in edges:
        return edges[name]
    _, i, rest = name.split(".", 2)
    layer = {st: names[pick] for names, st in LAYER_TENSORS.values()}
    return f"blk.{i}.{layer[rest]}"


def write_gguf(
    spec: DraftSpec,
    weights: dict[str, np.ndarray],
    path: Path,
    *,
    aliases: bool = False,
    drop: tuple[str, ...] = (),
    n_target_layers: int | None = None,
) -> Path:
    """The converter's layout; `aliases` uses the alternative names the loader accepts,
    `drop` leaves GGUF tensors out and `n_target_layers` overrides the capture count key
    (both to build malformed files for tests)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    a = GGUF_ARCH
    w = gguf.GGUFWriter(path, a)
    w.add_string("general.name", f"tiny-dflash-draft-seed{spec.seed}")
    for key, value in {
        "context_length": 32768,
        "embedding_length": spec.hidden,
        "block_count": spec.layers,
        "feed_forward_length": spec.ffn,
        "attention.head_count": spec.heads,
        "attention.head_count_kv": spec.kv_heads,
        "attention.key_length": spec.head_dim,
        "attention.value_length": spec.head_dim,
        "vocab_size": spec.vocab_size,
        "dflash.n_target_layers": n_target_layers or spec.captures,
        "dflash.block_size": spec.block_size,
        "dflash.mask_token_id": spec.mask_id,
    }.items():
        w.add_uint32(f"{a}.{key}", int(value))
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", spec.rms_eps)
    w.add_float32(f"{a}.rope.freq_base", spec.rope_base)
    w.add_array(f"{a}.dflash.target_layer_ids", spec.target_layer_ids)
    if spec.sliding_window is not None:
        w.add_uint32(f"{a}.attention.sliding_window", spec.sliding_window)
        w.add_array(f"{a}.attention.sliding_window_pattern", spec.sliding)
    np_dtype = NP_DTYPES[spec.dtype]
    # The converter's order: dflash.*, output_*, then blk.* by layer.
    named = {_gguf_name(k, aliases): v for k, v in weights.items()}

    def rank(n: str) -> tuple[int, int, str]:
        group = 0 if n.startswith("dflash") else 2 if n.startswith("blk.") else 1
        return group, int(n.split(".")[1]) if group == 2 else 0, n

    order = sorted(named, key=rank)
    for name in order:
        if name in drop:
            continue
        arr = named[name]
        is_norm = arr.ndim == 1  # norms stay F32, as the converter writes them
        w.add_tensor(name, np.ascontiguousarray(arr if is_norm else arr.astype(np_dtype)))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
