"""A torch-free, memory-mapped GGUF reader: metadata, tensor table, raw tensor bytes.

Both sides use it: the daemon reads the tokenizer and chat template, workers
read weights (dequantized by `luced.runtime.weights` with the `gguf` package's
quant routines). We parse the header ourselves instead of using
`gguf.GGUFReader` because that reader builds a numpy view per array element, which
takes seconds for Gemma 3's 262k-token vocabulary (docs/performance.md, "Measurements behind the
code"). Types, block
sizes and dequantization still come from the `gguf` package.

File layout (little endian)::

    "GGUF" u32 version u64 n_tensors u64 n_kv
    n_kv    x  (string key, u32 value_type, value)
    n_tensors x (string name, u32 n_dims, u64 dims[n_dims] (fastest first),
                 u32 ggml_type, u64 offset from data start)
    padding to `general.alignment` (default 32)
    tensor data
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

# GGUF value type id -> (struct format, numpy dtype) for fixed-size scalars.
_SCALARS: dict[int, tuple[str, np.dtype]] = {
    0: ("<B", np.dtype(np.uint8)),
    1: ("<b", np.dtype(np.int8)),
    2: ("<H", np.dtype("<u2")),
    3: ("<h", np.dtype("<i2")),
    4: ("<I", np.dtype("<u4")),
    5: ("<i", np.dtype("<i4")),
    6: ("<f", np.dtype("<f4")),
    7: ("<?", np.dtype(np.bool_)),
    10: ("<Q", np.dtype("<u8")),
    11: ("<q", np.dtype("<i8")),
    12: ("<d", np.dtype("<f8")),
}
_STRING = 8
_ARRAY = 9


class GGUFError(ValueError):
    """A GGUF file is unreadable or lacks what we need; the message names the file."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # torch order: slowest dimension first
    ggml_type: GGMLQuantizationType
    offset: int  # absolute byte offset in the file
    nbytes: int

    @property
    def type_name(self) -> str:
        return self.ggml_type.name


class _Cursor:
    """Sequential little-endian reads over the mapped header, with bounds checks."""

    def __init__(self, buf: mmap.mmap, path: Path) -> None:
        self.buf = buf
        self.pos = 0
        self.path = path

    def need(self, n: int, what: str) -> None:
        if self.pos + n > len(self.buf):
            raise GGUFError(f"{self.path}: truncated file (ends inside {what})")

    def scalar(self, fmt: str, what: str) -> Any:
        size = struct.calcsize(fmt)
        self.need(size, what)
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def string(self, what: str) -> str:
        n = self.scalar("<Q", what)
        self.need(n, what)
        raw = self.buf[self.pos : self.pos + n]
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def value(self, vtype: int, what: str) -> Any:
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype][0], what)
        if vtype == _STRING:
            return self.string(what)
        if vtype == _ARRAY:
            etype = self.scalar("<I", what)
            count = self.scalar("<Q", what)
            if etype in _SCALARS:
                dtype = _SCALARS[etype][1]
                self.need(count * dtype.itemsize, what)
                arr = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos).copy()
                self.pos += count * dtype.itemsize
                return arr
            if etype == _STRING:
                return self._strings(count, what)
            return [self.value(etype, what) for _ in range(count)]
        raise GGUFError(f"{self.path}: unknown metadata value type {vtype} in {what}")

    def _strings(self, count: int, what: str) -> list[str]:
        # The hot loop for vocabularies: plain struct + slicing, no numpy per item.
        buf, pos, end = self.buf, self.pos, len(self.buf)
        unpack = struct.Struct("<Q").unpack_from
        out: list[str] = []
        append = out.append
        for _ in range(count):
            if pos + 8 > end:
                raise GGUFError(f"{self.path}: truncated file (ends inside {what})")
            (n,) = unpack(buf, pos)
            pos += 8
            if pos + n > end:
                raise GGUFError(f"{self.path}: truncated file (ends inside {what})")
            append(buf[pos : pos + n].decode("utf-8", errors="replace"))
            pos += n
        self.pos = pos
        return out


class GGUFFile:
    """One GGUF file, memory-mapped read-only for the object's lifetime."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        try:
            with open(self.path, "rb") as fh:
                size = os.fstat(fh.fileno()).st_size
                if size < 24:
                    raise GGUFError(f"{self.path}: truncated file ({size} bytes, not a GGUF)")
                self._map = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as exc:
            raise GGUFError(f"{self.path}: cannot open: {exc.strerror or exc}") from exc
        self.size = size
        cur = _Cursor(self._map, self.path)
        if self._map[:4] != GGUF_MAGIC:
            raise GGUFError(f"{self.path}: not a GGUF file (bad magic {bytes(self._map[:4])!r})")
        cur.pos = 4
        self.version = cur.scalar("<I", "header")
        if self.version not in SUPPORTED_VERSIONS:
            raise GGUFError(f"{self.path}: unsupported GGUF version {self.version}")
        n_tensors = cur.scalar("<Q", "header")
        n_kv = cur.scalar("<Q", "header")

        self.metadata: dict[str, Any] = {}
        for i in range(n_kv):
            key = cur.string(f"metadata key #{i}")
            vtype = cur.scalar("<I", f"metadata {key!r}")
            self.metadata[key] = cur.value(vtype, f"metadata {key!r}")

        raw_infos = []
        for i in range(n_tensors):
            name = cur.string(f"tensor info #{i}")
            n_dims = cur.scalar("<I", f"tensor info {name!r}")
            dims = [cur.scalar("<Q", f"tensor info {name!r}") for _ in range(n_dims)]
            type_id = cur.scalar("<I", f"tensor info {name!r}")
            rel = cur.scalar("<Q", f"tensor info {name!r}")
            raw_infos.append((name, dims, type_id, rel))

        align = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        if align <= 0 or align & (align - 1):
            raise GGUFError(f"{self.path}: invalid general.alignment {align}")
        self.data_offset = -(-cur.pos // align) * align

        self.tensors: dict[str, TensorInfo] = {}
        for name, dims, type_id, rel in raw_infos:
            try:
                qtype = GGMLQuantizationType(type_id)
            except ValueError:
                raise GGUFError(
                    f"{self.path}: tensor {name!r} has unknown ggml type id {type_id}"
                ) from None
            block, type_size = GGML_QUANT_SIZES[qtype]
            n_elem = int(np.prod(dims)) if dims else 1
            if dims and dims[0] % block:
                raise GGUFError(
                    f"{self.path}: tensor {name!r} row of {dims[0]} is not a multiple "
                    f"of the {qtype.name} block ({block})"
                )
            info = TensorInfo(
                name=name,
                shape=tuple(int(d) for d in reversed(dims)),
                ggml_type=qtype,
                offset=self.data_offset + rel,
                nbytes=n_elem // block * type_size,
            )
            if info.offset + info.nbytes > size:
                raise GGUFError(
                    f"{self.path}: truncated file (tensor {name!r} needs bytes up to "
                    f"{info.offset + info.nbytes}, file has {size})"
                )
            self.tensors[name] = info

    @property
    def arch(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise GGUFError(f"{self.path}: no general.architecture in metadata")
        return arch

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def require(self, key: str) -> Any:
        if key not in self.metadata:
            raise GGUFError(f"{self.path}: missing metadata key {key!r}")
        return self.metadata[key]

    def layer_counts(self, name: str, default: tuple[int, ...] | None = None) -> tuple[int, ...]:
        """`{arch}.{name}` per layer, as llama.cpp's get_key_or_arr reads a count: one number
        for every layer, or an array of one per layer (laguna's query heads, Gemma 4's KV
        heads and FFN widths). Absent: `default`, or an error when there is none."""
        key = f"{self.arch}.{name}"
        if default is not None and key not in self.metadata:
            return default
        value = self.require(key)
        n_layers = int(self.require(f"{self.arch}.block_count"))
        if isinstance(value, int | float):
            return (int(value),) * n_layers
        if not isinstance(value, np.ndarray):  # a numeric array comes as one
            raise GGUFError(f"{self.path}: {key} is not a count: {value!r}")
        counts = tuple(int(v) for v in value)
        if len(counts) != n_layers:
            raise GGUFError(f"{self.path}: {key} has {len(counts)} entries for {n_layers} layers")
        return counts

    def sliding_layers(
        self, default_period: int = 6, *, full_first: bool = False
    ) -> tuple[bool, ...]:
        """Per layer: True = sliding-window attention, from
        `{arch}.attention.sliding_window_pattern`: per-layer flags (Gemma 3n / 4), or a period
        p whose one global layer comes last in each period, i.e. layer i is global iff
        (i + 1) % p == 0 (gemma), or first, i % p == 0 (`full_first`: laguna), as llama.cpp's
        set_swa_pattern; p <= 0: all sliding. Absent means `default_period` (llama.cpp's
        Gemma default, 5 sliding then 1 global)."""
        n_layers = int(self.require(f"{self.arch}.block_count"))
        pattern = self.get(f"{self.arch}.attention.sliding_window_pattern", default_period)
        if isinstance(pattern, np.ndarray | list):
            flags = tuple(bool(p) for p in pattern)
            if len(flags) != n_layers:
                raise GGUFError(
                    f"{self.path}: sliding_window_pattern has {len(flags)} entries "
                    f"for {n_layers} layers"
                )
            return flags
        period = int(pattern)
        full_at = 0 if full_first else period - 1
        return tuple(period <= 0 or i % period != full_at for i in range(n_layers))

    def moe_layers(self) -> tuple[int, ...]:
        """The layers with routed experts (laguna's leading layers are dense). Torch-free:
        the daemon checks a routing profile against them."""
        n = int(self.require(f"{self.arch}.block_count"))
        return tuple(i for i in range(n) if f"blk.{i}.ffn_down_exps.weight" in self.tensors)

    def kv_sources(self) -> dict[int, int]:
        """KV sharing (Gemma 3n / 4): layer -> the earlier layer whose K/V it attends to.

        The last `{arch}.attention.shared_kv_layers` layers compute no K/V; each reads the
        last non-shared layer of its own kind (sliding or full), as transformers'
        `Gemma4TextConfig.kv_sharing_modes` ("reuse" / "store") defines it. Empty when the
        file shares nothing. Torch-free: the daemon plans layer splits from it."""
        arch = self.arch
        n_shared = int(self.get(f"{arch}.attention.shared_kv_layers", 0))
        if n_shared == 0:
            return {}
        n_layers = int(self.require(f"{arch}.block_count"))
        first = n_layers - n_shared
        if not 0 < first < n_layers:
            raise GGUFError(f"{self.path}: {n_shared} KV-shared layers of {n_layers}")
        sliding = self.sliding_layers()
        sources = {}
        for layer in range(first, n_layers):
            kind = sliding[layer]
            source = next((j for j in range(first - 1, -1, -1) if sliding[j] == kind), None)
            if source is None:
                raise GGUFError(
                    f"{self.path}: KV-shared layer {layer} ({'sliding' if kind else 'full'}) "
                    "has no earlier layer of its kind to read from"
                )
            sources[layer] = source
        return sources

    def raw(self, name: str) -> np.ndarray:
        """The stored bytes of a tensor as a zero-copy uint8 view (rows kept whole)."""
        info = self.info(name)
        flat = np.frombuffer(self._map, dtype=np.uint8, count=info.nbytes, offset=info.offset)
        rows = int(np.prod(info.shape[:-1])) if len(info.shape) > 1 else 1
        return flat.reshape(rows, info.nbytes // rows)

    def info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise GGUFError(f"{self.path}: missing tensor {name!r}") from None
