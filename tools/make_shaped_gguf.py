"""A llama-family GGUF at a real model's shapes whose matrices are random Q4_0 blocks, written
directly as codes and scales (no float weights, no quantization pass), for speed measurements
on a machine the real file cannot travel to: the values mean nothing, the bytes a decoded
token reads are the real model's.

    python tools/make_shaped_gguf.py OUT.gguf [--shape llama3-8b] [--layers N] [--seed S]

Shapes (`SHAPES`): llama3-8b (hidden 4096, 32 layers, 32 / 8 heads of 128, FFN 14336,
vocab 128256, untied: 4.3 GB of Q4_0 matrices), tiny (for a CPU dry run). `--layers` cuts
the stack (a quick run). Metadata and vocabulary are luced.runtime.tiny's llama ones (a
BPE vocabulary padded to the vocab size), so the daemon serves it as any llama. Each Q4_0
block's scale is fixed per tensor so that weights have a standard deviation of about
1/sqrt(fan_in) (1 for the embedding): activations stay finite through the stack.
"""

from __future__ import annotations

import argparse
import time
import zlib
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q

from luced.runtime.tiny.build import _gguf_name, _hf_shapes, _write_metadata
from luced.runtime.tiny.spec import make_spec
from luced.runtime.tiny.vocab import make_vocab
from luced.runtime.tiny.weights import random_hf

SHAPES: dict[str, dict[str, object]] = {
    "llama3-8b": dict(
        hidden=4096, layers=32, heads=32, kv_heads=8, head_dim=128, ffn=14336,
        vocab_size=128256, context=8192, rope_base=500000.0, tied=False,
    ),
    "tiny": dict(hidden=128, layers=2, heads=4, kv_heads=2, head_dim=32, ffn=256, tied=False),
}  # fmt: skip
BLOCK = 32  # Q4_0: 32 weights in 18 bytes (an f16 scale, 16 bytes of nibbles)
NIBBLE_STD = 4.61  # std of (q - 8) for q uniform on 0..15


def q4_0_blocks(rows: int, cols: int, std: float, rng: np.random.Generator) -> np.ndarray:
    """[rows, cols / 32 * 18] uint8: random nibbles, every block's scale std / NIBBLE_STD."""
    blocks = np.empty((rows, cols // BLOCK, 18), np.uint8)
    blocks[..., :2] = np.frombuffer(np.float16(std / NIBBLE_STD).tobytes(), np.uint8)
    blocks[..., 2:] = rng.integers(0, 256, (rows, cols // BLOCK, 16), dtype=np.uint8)
    return blocks.reshape(rows, -1)


def build(path: Path, shape: str = "llama3-8b", layers: int | None = None, seed: int = 0) -> Path:
    overrides = dict(SHAPES[shape])
    if layers is not None:
        overrides["layers"] = layers
    spec = make_spec("llama", "Q4_0", seed, overrides)
    vocab = make_vocab("llama", spec.vocab_size)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(path, "llama")
    _write_metadata(writer, spec, vocab)
    for hf_name, dims in sorted(_hf_shapes(spec).items()):
        name = _gguf_name(spec, hf_name)
        if len(dims) == 1:  # norms: float32 near 1, as the tiny models'
            writer.add_tensor(name, random_hf(spec, hf_name, dims))
            continue
        rng = np.random.default_rng([seed, zlib.crc32(hf_name.encode())])
        embedding = "embed_tokens" in hf_name or "lm_head" in hf_name
        std = 1.0 if embedding else dims[1] ** -0.5
        writer.add_tensor(name, q4_0_blocks(*dims, std, rng), raw_dtype=Q.Q4_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    ap.add_argument("--layers", type=int, help="fewer layers than the shape's")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    path = build(args.out, args.shape, args.layers, args.seed)
    size = path.stat().st_size
    print(f"wrote {path} ({size / 1e9:.2f} GB) in {time.monotonic() - t0:.1f} s", flush=True)


if __name__ == "__main__":
    main()
