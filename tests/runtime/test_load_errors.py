"""Model.load turns bad files into errors that name the file and the problem."""

from __future__ import annotations

import re
from pathlib import Path

import make_tiny_gguf
import pytest
from gguf import GGMLQuantizationType
from gguf_samples import write_gguf

from luced.gguf_file import GGUFError, GGUFFile
from luced.runtime.model import Model
from luced.runtime.weights import dequantize_tensor


def test_unknown_architecture(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "odd.gguf", arch="mamba9")
    with pytest.raises(GGUFError, match=r"odd\.gguf: unknown architecture 'mamba9'"):
        Model.load(path)


def test_unsupported_quant_type(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "iq.gguf", qtype=GGMLQuantizationType.IQ2_XXS)
    with pytest.raises(
        GGUFError, match=r"iq\.gguf: tensor 'odd.weight' uses unsupported quant type IQ2_XXS"
    ):
        dequantize_tensor(GGUFFile(path), "odd.weight")


def test_missing_metadata_and_tensor(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "bare.gguf")  # llama arch, but no llama.* keys
    with pytest.raises(
        GGUFError, match=r"bare\.gguf: missing metadata key 'llama.attention.head_count'"
    ):
        Model.load(path)


def test_truncated_real_model(tmp_path: Path, smollm2_gguf: Path) -> None:
    cut = tmp_path / "smol-cut.gguf"
    with open(smollm2_gguf, "rb") as src, open(cut, "wb") as dst:
        dst.write(src.read(smollm2_gguf.stat().st_size // 2))
    with pytest.raises(GGUFError, match=r"smol-cut\.gguf: truncated file \(tensor"):
        Model.load(cut)


def test_bad_layer_range(smollm2_gguf: Path) -> None:
    with pytest.raises(ValueError, match=r"layer range \[20, 40\) outside the model's 30 layers"):
        Model.load(smollm2_gguf, layers=(20, 40))


@pytest.mark.parametrize("name", ["per_layer_token_embd.weight", "blk.3.attn_k.weight"])
def test_gemma4_missing_tensor_is_named(tmp_path: Path, name: str) -> None:
    tiny = make_tiny_gguf.build("gemma4", tmp_path / "g4.gguf", seed=1)
    data = tiny.path.read_bytes()
    assert data.count(name.encode()) == 1
    cut = tmp_path / "g4-cut.gguf"  # the tensor renamed in the header: the file lacks it
    cut.write_bytes(data.replace(name.encode(), name[:-1].encode() + b"X"))
    with pytest.raises(GGUFError, match=rf"g4-cut\.gguf: missing tensor '{re.escape(name)}'"):
        Model.load(cut)
