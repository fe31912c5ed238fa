"""Model.load turns bad files into errors that name the file and the problem."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import make_tiny_gguf
import pytest
import tiny_qwen35
from gguf import GGMLQuantizationType
from gguf_samples import write_gguf

from luced.gguf_file import GGUFError, GGUFFile
from luced.ipc import frames as F
from luced.runtime.backend import Backend
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


def _load_req(path: Path, n_layers: int) -> F.Load:
    return F.Load(
        model=str(path),
        layers=(0, n_layers),
        dtype="float32",
        devices=("cpu",),
        kv_capacity=64,
        owns_embed=True,
        owns_head=True,
    )


def test_worker_rejects_a_qwen35_without_an_ssm_tensor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The converter's file minus layer 1's ssm_a: the worker's load names the tensor."""
    shapes = tiny_qwen35.hf_shapes
    monkeypatch.setattr(
        tiny_qwen35,
        "hf_shapes",
        lambda spec: {
            k: v for k, v in shapes(spec).items() if not k.endswith("1.linear_attn.A_log")
        },
    )
    path = make_tiny_gguf.build("qwen35", tmp_path / "no-a.gguf").path
    with pytest.raises(GGUFError, match=r"no-a\.gguf: missing tensor 'blk\.1\.ssm_a'"):
        Backend("cpu", ("cpu",)).load(_load_req(path, 4))


def test_worker_rejects_a_qwen35_whose_conv_contradicts_the_metadata(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Metadata saying kernel 3 beside conv weights of kernel 4."""
    write = tiny_qwen35.write_metadata
    monkeypatch.setattr(
        tiny_qwen35,
        "write_metadata",
        lambda w, spec: write(w, dataclasses.replace(spec, conv_kernel=3)),
    )
    path = make_tiny_gguf.build("qwen35", tmp_path / "conv.gguf").path
    with pytest.raises(
        GGUFError,
        match=r"conv\.gguf: tensor 'blk\.0\.ssm_conv1d\.weight' is \[96, 4\], "
        r"the metadata wants \[96, 3\]",
    ):
        Backend("cpu", ("cpu",)).load(_load_req(path, 4))
