"""Model.load turns bad files into errors that name the file and the problem."""

from __future__ import annotations

import dataclasses
import re
import struct
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType
from gguf_samples import write_gguf

from luced.gguf_file import GGUFError, GGUFFile
from luced.ipc import frames as F
from luced.runtime.backend import Backend
from luced.runtime.model import Model
from luced.runtime.tiny import make_tiny_gguf, qwen35
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


def _patched(tiny_path: Path, old: bytes, new: bytes) -> Path:
    """The file with one header byte string replaced by another of the same length."""
    data = tiny_path.read_bytes()
    assert data.count(old) == 1 and len(old) == len(new)
    out = tiny_path.with_name("bad-" + tiny_path.name)
    out.write_bytes(data.replace(old, new))
    return out


@pytest.mark.parametrize("family", ["qwen3moe", "qwen35moe"])
def test_expert_count_disagreeing_with_the_expert_tensors(tmp_path: Path, family: str) -> None:
    tiny = make_tiny_gguf(family, tmp_path / "moe.gguf")  # 8 experts, hidden 64
    key = f"{family}.expert_count".encode()
    u32, eight, six = struct.pack("<I", 4), struct.pack("<I", 8), struct.pack("<I", 6)
    path = _patched(tiny.path, key + u32 + eight, key + u32 + six)
    with pytest.raises(
        GGUFError,
        match=r"bad-moe\.gguf: tensor 'blk\.0\.ffn_gate_inp\.weight' has shape \[8, 64\], "
        r"expected \[6, 64\] \(expert_count 6",
    ):
        Model.load(path)


@pytest.mark.parametrize(
    ("family", "tensor"),
    [
        ("qwen3moe", "blk.1.ffn_up_exps.weight"),
        ("laguna", "blk.2.exp_probs_b.bias"),
        ("qwen35moe", "blk.3.ffn_gate_inp_shexp.weight"),  # the shared expert's gate
    ],
)
def test_missing_expert_tensor(tmp_path: Path, family: str, tensor: str) -> None:
    tiny = make_tiny_gguf(family, tmp_path / f"{family}.gguf")
    path = _patched(tiny.path, tensor.encode(), tensor.encode()[:-1] + b"X")
    with pytest.raises(
        GGUFError, match=rf"bad-{family}\.gguf: missing tensor '{re.escape(tensor)}'"
    ):
        Model.load(path, layers=(0, 1))  # checked for every layer, even by a shard without it


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
    shapes = qwen35.hf_shapes
    monkeypatch.setattr(
        qwen35,
        "hf_shapes",
        lambda spec: {
            k: v for k, v in shapes(spec).items() if not k.endswith("1.linear_attn.A_log")
        },
    )
    path = make_tiny_gguf("qwen35", tmp_path / "no-a.gguf").path
    with pytest.raises(GGUFError, match=r"no-a\.gguf: missing tensor 'blk\.1\.ssm_a'"):
        Backend("cpu", ("cpu",)).load(_load_req(path, 4))


def test_worker_rejects_a_qwen35_whose_conv_contradicts_the_metadata(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Metadata saying kernel 3 beside conv weights of kernel 4."""
    write = qwen35.write_metadata
    monkeypatch.setattr(
        qwen35,
        "write_metadata",
        lambda w, spec: write(w, dataclasses.replace(spec, conv_kernel=3)),
    )
    path = make_tiny_gguf("qwen35", tmp_path / "conv.gguf").path
    with pytest.raises(
        GGUFError,
        match=r"conv\.gguf: tensor 'blk\.0\.ssm_conv1d\.weight' is \[96, 4\], "
        r"the metadata wants \[96, 3\]",
    ):
        Backend("cpu", ("cpu",)).load(_load_req(path, 4))


@pytest.mark.parametrize("name", ["per_layer_token_embd.weight", "blk.2.attn_k.weight"])
def test_gemma4_missing_tensor_is_named(tmp_path: Path, name: str) -> None:
    tiny = make_tiny_gguf("gemma4", tmp_path / "g4.gguf", seed=1)
    data = tiny.path.read_bytes()
    assert data.count(name.encode()) == 1
    cut = tmp_path / "g4-cut.gguf"  # the tensor renamed in the header: the file lacks it
    cut.write_bytes(data.replace(name.encode(), name[:-1].encode() + b"X"))
    with pytest.raises(GGUFError, match=rf"g4-cut\.gguf: missing tensor '{re.escape(name)}'"):
        Model.load(cut)
