"""Small hand-written GGUF files for loader and error tests."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.constants import GGML_QUANT_SIZES


def write_gguf(path: Path, arch: str = "llama", qtype: GGMLQuantizationType | None = None) -> Path:
    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_string("test.note", "héllo ✓")
    writer.add_array("test.words", ["a", "bb", "", "ccc"])
    writer.add_array("test.scores", [0.5, -1.25, 3.0])
    rng = np.random.default_rng(0)
    writer.add_tensor("token_embd.weight", rng.standard_normal((8, 32), dtype=np.float32))
    if qtype is not None:
        block, size = GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 255, (4, 256 // block * size), dtype=np.uint8)
        writer.add_tensor("odd.weight", raw, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
