"""Random Hugging Face weights, and how the converter stores them: `random_hf` draws one
tensor from (seed, name, shape) alone; `encode` gives the array and ggml type the file
holds: 1-D tensors and the always-F32 ones in F32, every other matrix in the spec's qtype.
gguf-py cannot quantize K-quants, so their blocks are random but valid (small finite f16
scales) and the weight is defined as their dequantization."""

from __future__ import annotations

import math
import zlib

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q

from luced.runtime.tiny import moe, qwen35
from luced.runtime.tiny.spec import QTYPES, TinySpec

# The converter keeps routers (FFN_GATE_INP, FFN_GATE_INP_SHEXP), SSM_CONV1D and BERT's
# position and token type embeddings (named as in the GGUF by bert.py) in F32 whatever the
# file type.
ALWAYS_F32 = (
    ".mlp.gate.weight",
    ".mlp.shared_expert_gate.weight",
    ".router.proj.weight",
    "conv1d.weight",
    "position_embd.weight",
    "token_types.weight",
)


def random_hf(spec: TinySpec, hf_name: str, shape: tuple[int, ...]) -> np.ndarray:
    # One stream per tensor, so a tensor's values depend only on (seed, name, shape).
    rng = np.random.default_rng([spec.seed, zlib.crc32(hf_name.encode())])
    if len(shape) == 1 and "norm" not in hf_name and spec.family in moe.FAMILIES:
        return moe.random_bias(rng, shape)  # MoE score biases
    if (
        spec.family in qwen35.FAMILIES
        and (w := qwen35.random_hf(spec, hf_name, shape, rng)) is not None
    ):
        return w
    if len(shape) == 1:  # norm weights near their identity value (1, or 0 in Gemma's 1 + w form)
        base = 0.0 if spec.family == "gemma3" else 1.0
        return (base + rng.uniform(-0.3, 0.3, shape)).astype(np.float32)
    # Unit-scale embeddings and 1/sqrt(fan_in) projections keep activations O(1) and logits
    # well separated, so greedy continuations are not decided by rounding.
    std = 1.0 if "embed_tokens" in hf_name or "lm_head" in hf_name else shape[-1] ** -0.5
    return (rng.standard_normal(shape) * std).astype(np.float32)


def kquant_blocks(
    qtype: Q, shape: tuple[int, ...], std: float, rng: np.random.Generator
) -> np.ndarray:
    """Random but valid K-quant blocks whose dequantized values have roughly `std`."""
    n = math.prod(shape) // 256
    f16 = lambda x: np.full((n, 1), x, np.float16).view(np.uint8)  # noqa: E731
    u8 = lambda lo, hi, k: rng.integers(lo, hi, (n, k), dtype=np.uint8)  # noqa: E731
    if qtype == Q.Q6_K:  # ql[128] qh[64] scales:int8[16] d:f16 -> d * sc * (q - 32)
        blocks = [u8(0, 256, 128), u8(0, 256, 64), u8(1, 9, 16), f16(std / (4.5 * 18.5))]
    else:  # Q4_K / Q5_K: d dmin scales[12] [qh[32]] qs[128] -> d * sc * q - dmin * m
        q_max = 15 if qtype == Q.Q4_K else 31
        sc = rng.integers(4, 9, (n, 8)) if qtype == Q.Q4_K else rng.integers(2, 5, (n, 8))
        m = np.rint(sc * q_max / 2).astype(np.int64)  # centre each sub-block on zero
        scales = np.concatenate(
            [
                sc[:, :4] | (sc[:, 4:] >> 4) << 6,
                m[:, :4] | (m[:, 4:] >> 4) << 6,
                (sc[:, 4:] & 0xF) | (m[:, 4:] & 0xF) << 4,
            ],
            axis=1,
        )
        d = std / (sc.mean() * q_max * 0.3)
        blocks = [f16(d), f16(d), scales.astype(np.uint8)]
        blocks += [u8(0, 256, 32)] if qtype == Q.Q5_K else []
        blocks += [u8(0, 256, 128)]
    return np.concatenate(blocks, axis=1).reshape(*shape[:-1], -1)


def encode(spec: TinySpec, hf_name: str, w: np.ndarray) -> tuple[np.ndarray, Q]:
    """GGUF-layout float tensor -> (stored array, ggml type), as the converter would store it."""
    qtype = QTYPES[spec.qtype][0]
    if w.ndim == 1 or qtype == Q.F32 or hf_name.endswith(ALWAYS_F32):
        return w, Q.F32
    if qtype == Q.F16:
        return w.astype(np.float16), Q.F16
    if qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K):
        rng = np.random.default_rng([spec.seed, zlib.crc32(hf_name.encode()), int(qtype)])
        return kquant_blocks(qtype, w.shape, float(w.std()), rng), qtype
    return gguf.quants.quantize(w, qtype), qtype


def add_tensor(
    writer: gguf.GGUFWriter, spec: TinySpec, gguf_name: str, hf_name: str, w: np.ndarray
) -> np.ndarray:
    """Store `w` (GGUF layout) under `gguf_name` as the converter would (`encode`); returns
    what the file holds: its dequantization, float32, in `w`'s shape."""
    stored, ggml_type = encode(spec, hf_name, w)
    raw = None if ggml_type in (Q.F32, Q.F16) else ggml_type
    writer.add_tensor(gguf_name, stored, raw_dtype=raw)
    return gguf.quants.dequantize(stored, ggml_type).astype(np.float32).reshape(w.shape)


def write_out(writer: gguf.GGUFWriter) -> None:
    """Write the header, the metadata and every tensor added, and close the file."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
