"""Tensors out of a GGUF file: dequantized with the `gguf` package into a compute dtype, or,
for matrices under a compact weights mode, quantized rows for `qlinear` (see there).

A family names the tensors it needs for a layer range; `WeightLoader` reads
exactly those (a shard never touches the bytes of layers it does not own), and of a
stacked expert tensor only the experts it is told to hold (MoE placement), and
reports progress: a bar on a terminal, log lines otherwise.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import torch
from gguf.constants import GGMLQuantizationType as Q
from gguf.quants import dequantize

from luced.gguf_file import GGUFError, GGUFFile
from luced.runtime import qlinear
from luced.runtime.layers import store_matrix
from luced.runtime.qlinear import QuantRows

log = logging.getLogger(__name__)

SUPPORTED_TYPES = frozenset(
    {
        Q.F32,
        Q.F16,
        Q.BF16,
        Q.Q8_0,
        Q.Q4_0,
        Q.Q4_1,
        Q.Q5_0,
        Q.Q5_1,
        Q.Q2_K,
        Q.Q3_K,
        Q.Q4_K,
        Q.Q5_K,
        Q.Q6_K,
    }
)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; choose one of {', '.join(DTYPES)}") from None


def dequantize_tensor(gguf: GGUFFile, name: str) -> np.ndarray:
    """The named tensor as float32 numpy, in torch shape order."""
    info = gguf.info(name)
    if info.ggml_type not in SUPPORTED_TYPES:
        raise GGUFError(
            f"{gguf.path}: tensor {name!r} uses unsupported quant type {info.type_name}"
        )
    return dequantize_rows(gguf.raw(name), info.ggml_type, info.shape)


def dequantize_experts(gguf: GGUFFile, name: str, ids: Sequence[int]) -> np.ndarray:
    """Experts `ids` of a stacked expert tensor [E, out, inner] as float32 [len(ids), out,
    inner]: an expert is a contiguous block of `out` stored rows, so only their bytes are
    read from the mapping."""
    info = gguf.info(name)
    if info.ggml_type not in SUPPORTED_TYPES:
        raise GGUFError(
            f"{gguf.path}: tensor {name!r} uses unsupported quant type {info.type_name}"
        )
    n_experts, out, inner = info.shape
    if any(not 0 <= e < n_experts for e in ids):
        raise ValueError(f"{name}: experts {list(ids)} outside [0, {n_experts})")
    raw = gguf.raw(name)  # [E * out, bytes per row], a view of the mapping
    # filled in place: stacking per-expert parts would hold the held experts twice
    out_arr = np.empty((len(ids), out, inner), np.float32)
    for i, e in enumerate(ids):
        out_arr[i] = dequantize_rows(raw[e * out : (e + 1) * out], info.ggml_type, (out, inner))
    return out_arr


def dequantize_rows(raw: np.ndarray, ggml_type: Q, shape: tuple[int, ...]) -> np.ndarray:
    """Stored rows (`GGUFFile.raw`, or a slice of it: one expert's) as float32 `shape`."""
    if ggml_type == Q.F32:
        return raw.view(np.float32).reshape(shape)
    if ggml_type == Q.F16:
        return raw.view(np.float16).reshape(shape).astype(np.float32)
    return dequantize(raw, ggml_type).reshape(shape)


class WeightLoader:
    """Loads named tensors into torch with progress output for long loads."""

    def __init__(
        self,
        gguf: GGUFFile,
        dtype: torch.dtype,
        device: torch.device | str,
        weights: str = "dequant",
        experts: Mapping[str, Sequence[int]] | None = None,
    ) -> None:
        self.gguf = gguf
        self.dtype = dtype
        self.device = torch.device(device)
        self.weights = weights  # qlinear.WEIGHT_MODES: how matrices are held
        self.forms: dict[str, int] = {}  # form -> matrices loaded in it
        # stacked expert tensor name -> the experts (dim 0) to hold; the others are not read
        self.experts = dict(experts or {})

    def require(self, names: Iterable[str]) -> None:
        missing = [n for n in names if n not in self.gguf.tensors]
        if missing:
            raise GGUFError(f"{self.gguf.path}: missing tensor {missing[0]!r}")

    def tensor(self, name: str, *, matrix: bool = False) -> torch.Tensor | QuantRows:
        """The tensor in the compute dtype; a `matrix` goes into `linear`'s layout, or is
        quantized rows when the weights mode holds it compact."""
        info = self.gguf.info(name)
        form = qlinear.choose_form(self.weights, info.ggml_type, info.shape, self.device)
        if matrix:
            self.forms[form] = self.forms.get(form, 0) + 1
        compact = matrix and form != "dequant"
        if compact and form == "int4" and info.ggml_type in qlinear.EXACT_INT4:
            return qlinear.int4_from_blocks(self.gguf.raw(name), info.ggml_type, info.shape)
        ids = self.experts.get(name)
        arr = (
            dequantize_tensor(self.gguf, name)
            if ids is None
            else dequantize_experts(self.gguf, name, ids)
        )
        # Copy when the array is a read-only view of the mapped file (F32 tensors).
        t = torch.from_numpy(arr if arr.flags.writeable else arr.copy())
        if compact:
            return qlinear.quantize(t, form)
        t = t.to(device=self.device, dtype=self.dtype)
        return store_matrix(t) if matrix else t.contiguous()

    def nbytes(self, name: str) -> int:
        """Stored bytes the loader reads of a tensor (of a stack: its held experts')."""
        info = self.gguf.info(name)
        ids = self.experts.get(name)
        return info.nbytes if ids is None else info.nbytes // info.shape[0] * len(ids)

    def load_all(self, plan: dict[str, tuple[str, bool]]) -> dict[str, torch.Tensor | QuantRows]:
        """plan: key -> (tensor name, is a matrix). Returns key -> tensor."""
        self.require(name for name, _ in plan.values())
        total = sum(self.nbytes(name) for name, _ in plan.values())
        progress = _Progress(f"loading {self.gguf.path.name}", total)
        out = {}
        for key, (name, matrix) in plan.items():
            out[key] = self.tensor(name, matrix=matrix)
            progress.advance(self.nbytes(name))
        progress.close()
        if set(self.forms) - {"dequant"}:
            log.info("weights %s: matrices %s", self.weights, self.forms)
        return out


class _Progress:
    """tqdm on a terminal; otherwise a log line at every quarter and at the end."""

    def __init__(self, label: str, total: int) -> None:
        self.label, self.total, self.done = label, total, 0
        self.start = time.monotonic()
        self.next_mark = 0.25
        self.bar = None
        if sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=label, unit="B", unit_scale=True, leave=False)

    def advance(self, n: int) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
        elif self.total and self.done / self.total >= self.next_mark and self.next_mark < 1:
            log.info("%s: %d%%", self.label, int(100 * self.done / self.total))
            self.next_mark += 0.25

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        log.info(
            "%s: %.0f MB in %.1f s", self.label, self.total / 1e6, time.monotonic() - self.start
        )
