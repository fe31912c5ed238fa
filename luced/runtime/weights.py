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
from dataclasses import replace

import numpy as np
import torch
from gguf.constants import GGMLQuantizationType as Q
from gguf.quants import dequantize

from luced.gguf_file import GGUFError, GGUFFile, TensorInfo
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


def _supported(gguf: GGUFFile, name: str) -> TensorInfo:
    """The tensor's info, or a GGUFError if its quant type cannot be read."""
    info = gguf.info(name)
    if info.ggml_type not in SUPPORTED_TYPES:
        raise GGUFError(
            f"{gguf.path}: tensor {name!r} uses unsupported quant type {info.type_name}"
        )
    return info


def dequantize_tensor(gguf: GGUFFile, name: str) -> np.ndarray:
    """The named tensor as float32 numpy, in torch shape order."""
    info = _supported(gguf, name)
    return dequantize_rows(gguf.raw(name), info.ggml_type, info.shape)


def dequantize_rows(raw: np.ndarray, ggml_type: Q, shape: tuple[int, ...]) -> np.ndarray:
    """Stored rows (`GGUFFile.raw`, or a slice of it: one expert's) as float32 `shape`."""
    if ggml_type == Q.F32:
        return raw.view(np.float32).reshape(shape)
    if ggml_type == Q.F16:
        return raw.view(np.float16).reshape(shape).astype(np.float32)
    return dequantize(raw, ggml_type).reshape(shape)


# A stack of experts held compact: one quantized [out, in] matrix per expert.
ExpertRows = list[QuantRows]


def _from_numpy(arr: np.ndarray) -> torch.Tensor:
    # Copy when the array is a read-only view of the mapped file (F32 tensors).
    return torch.from_numpy(arr if arr.flags.writeable else arr.copy())


# Rows requantized at a time: a whole 262k-row head (Gemma 3's tied Q8_0 embedding) would
# pass through ~2 GB of float32 temporaries, a chunk through ~100 MB. Codes and scales are
# per row (int8) or per 32-wide group (int4), so chunks give the whole matrix's bits.
REQUANT_ROWS = 16384


def compact_rows(raw: np.ndarray, ggml_type: Q, shape: tuple[int, ...], form: str) -> QuantRows:
    """A stored matrix (raw rows) in a compact `form`: Q4 blocks become int4 block for
    block, anything else is dequantized and requantized, `REQUANT_ROWS` at a time."""
    if form == "int4" and ggml_type in qlinear.EXACT_INT4:
        return qlinear.int4_from_blocks(raw, ggml_type, shape)  # type: ignore[arg-type]
    n, rest = shape[0], shape[1:]
    parts = [
        qlinear.quantize(_from_numpy(dequantize_rows(raw[i : i + REQUANT_ROWS], ggml_type,
                                                     (min(REQUANT_ROWS, n - i), *rest))), form)
        for i in range(0, n, REQUANT_ROWS)
    ]  # fmt: skip
    return parts[0] if len(parts) == 1 else replace(QuantRows.cat(parts), splits=())


def expert_stack(
    gguf: GGUFFile,
    name: str,
    ids: Sequence[int],
    mode: str,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor | ExpertRows:
    """Experts `ids` of a stacked expert tensor [E, out, in], reading only their rows: a
    [len(ids), out, in] stack in `linear`'s layout, or, when the weights `mode` holds an
    [out, in] matrix of this type compact (`qlinear.choose_form`), one `QuantRows` each."""
    info = _supported(gguf, name)
    n_experts, out, inner = info.shape
    if any(not 0 <= e < n_experts for e in ids):
        raise ValueError(f"{name}: experts {list(ids)} outside [0, {n_experts})")
    raw = gguf.raw(name)  # [E * out, bytes per row], a view of the mapping
    rows = [raw[e * out : (e + 1) * out] for e in ids]  # an expert: `out` consecutive rows
    form = qlinear.choose_form(mode, info.ggml_type, (out, inner), device)
    if form != "dequant":
        return [compact_rows(r, info.ggml_type, (out, inner), form) for r in rows]
    # filled in place: stacking per-expert parts would hold the experts twice
    stack = np.empty((len(ids), out, inner), np.float32)
    for i, r in enumerate(rows):
        stack[i] = dequantize_rows(r, info.ggml_type, (out, inner))
    return store_matrix(torch.from_numpy(stack).to(device=device, dtype=dtype))


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

    def tensor(self, name: str, *, matrix: bool = False) -> torch.Tensor | QuantRows | ExpertRows:
        """The tensor in the compute dtype; a `matrix` goes into `linear`'s layout, or is
        quantized rows when the weights mode holds it compact (a stack of experts: as
        `expert_stack` holds it)."""
        info = self.gguf.info(name)
        if matrix and len(info.shape) == 3:
            ids = self.experts.get(name, range(info.shape[0]))
            stack = expert_stack(self.gguf, name, ids, self.weights, self.dtype, self.device)
            form = stack[0].form if isinstance(stack, list) and stack else "dequant"
            self.forms[form] = self.forms.get(form, 0) + len(ids)
            return stack
        form = qlinear.choose_form(self.weights, info.ggml_type, info.shape, self.device)
        if matrix:
            self.forms[form] = self.forms.get(form, 0) + 1
        if matrix and form != "dequant":
            return compact_rows(self.gguf.raw(name), info.ggml_type, info.shape, form)
        t = _from_numpy(dequantize_tensor(self.gguf, name)).to(self.device, self.dtype)
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
