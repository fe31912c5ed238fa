"""Worker lifecycle frames: hello, load, the expert worker's load_experts and expert_mix,
stats and shutdown."""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Self

from luced.ipc.frames.base import (
    COMPUTE_DTYPES,
    DECODE_GRAPHS,
    PROTOCOL_VERSION,
    REPLIES,
    REQUESTS,
    WEIGHT_MODES,
    ComputeDtype,
    MoeCounts,
    Reply,
    Request,
    _check_protocol,
    _op,
)
from luced.ipc.frames.remote import FileIdentity
from luced.ipc.regions import Region

# -- hello ----------------------------------------------------------------------------------


@_op("hello", REQUESTS)
@dataclass(frozen=True)
class Hello(Request):
    instance: str  # the daemon's instance id (its segment names carry it)
    protocol: int = PROTOCOL_VERSION
    # A remote worker's: each file the daemon will name (its path there) -> its size and
    # hash; the worker answers only when it holds a copy of each (empty: same host).
    files: dict[str, FileIdentity] = field(default_factory=dict)

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> Self:
        _check_protocol(d.get("protocol"))  # before anything else: fields may differ
        return super().from_wire(d)

    def _check(self) -> None:
        _check_protocol(self.protocol)


@_op("hello", REPLIES)
@dataclass(frozen=True)
class HelloReply(Reply):
    pid: int
    group: str  # backend group name, e.g. "cuda", "cpu:1"
    devices: tuple[str, ...]  # devices this worker drives, e.g. ("cuda:0", "cuda:1")
    versions: dict[str, str]  # {"python": ..., "torch": ..., "luced": ...}
    protocol: int = PROTOCOL_VERSION
    store: str = ""  # a remote worker's torch.distributed store, "host:port" (link)
    # A remote worker's --prefix-cache-bytes: the most of its memory the prefix cache's
    # host records may take (its mirror of them; a context's at least); None: no bound.
    prefix_cache_bytes: int | None = None

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> Self:
        _check_protocol(d.get("protocol"))
        return super().from_wire(d)

    def _check(self) -> None:
        _check_protocol(self.protocol)
        if self.prefix_cache_bytes is not None and self.prefix_cache_bytes < 0:
            raise self._fail(f"prefix_cache_bytes must be >= 0, got {self.prefix_cache_bytes}")


# -- load -----------------------------------------------------------------------------------


def _check_weights(frame: Load | LoadExperts) -> None:
    if frame.weights not in WEIGHT_MODES:
        raise frame._fail(
            f"weights must be one of {', '.join(WEIGHT_MODES)}, got {frame.weights!r}"
        )


@_op("load", REQUESTS)
@dataclass(frozen=True)
class Load(Request):
    model: str  # path of the GGUF file
    layers: tuple[int, int]  # [a, b): the layers this worker holds
    dtype: ComputeDtype
    devices: tuple[str, ...]  # one shard per device, in layer order
    kv_capacity: int  # tokens of KV per layer
    owns_embed: bool  # holds the token embedding (accepts `tokens` in forward)
    owns_head: bool  # holds the final norm + LM head (can sample / return logits)
    # Layer indices in (a, b) where the next device's shard starts; len(devices) - 1 of them.
    device_splits: tuple[int, ...] = ()
    # MoE: routed experts kept per layer (-1: all); the rest are cold, computed by the
    # expert worker through `moe_scratch` (uint8 bytes of a daemon-owned segment) when
    # the daemon links one, else in process. `moe_required`: no in-process fallback.
    moe_hot: int = -1
    moe_scratch: Region | None = None
    moe_required: bool = False
    # The expert worker is on another host than this one: cold experts go over this hop
    # (a ``link`` with serve="experts" at the other end), not through moe_scratch.
    moe_link: str = ""
    moe_profile: MoeCounts = ()  # the most routed experts are the hot ones; (): lowest ids
    weights: str = "dequant"  # one of WEIGHT_MODES
    # Logits independent of how tokens are grouped into calls (runtime.model.Model.load).
    batch_invariant: bool = False
    kv_dtype: str = ""  # the K/V rows' dtype; "" = dtype
    # Rows per block of one K/V pool per shard that every sequence's rows live in
    # (runtime.kv_blocks), so sequences may share a prefix's blocks (kv_share); 0: each
    # sequence's K/V contiguous on its own. KV Flash pages these blocks (Span.moves).
    kv_block: int = 0
    # With kv_block: the pool's block count, fixed by the daemon, which hands every block
    # out itself (engine/kv/blocks.py); the worker may grow its tensors up to it lazily.
    kv_blocks: int = 0
    # Decode steps of whole sequences through a fixed-shape step over the block pool,
    # captured once per batch bucket as a CUDA graph (runtime.decode_graph): "auto" on CUDA
    # devices, "on" on any (the CPU runs the same step eagerly), "off". Needs kv_block.
    decode_graphs: str = "auto"
    # KV Flash's qk policy over the block pool: every sequence's caches keep each block's
    # mean key and score the blocks (Span.kv_scores). Needs kv_block.
    kv_scored: bool = False

    def _check(self) -> None:
        if self.decode_graphs not in DECODE_GRAPHS:
            raise self._fail(
                f"decode_graphs must be one of {DECODE_GRAPHS}, got {self.decode_graphs!r}"
            )
        if self.kv_block < 0:
            raise self._fail(f"kv_block must be >= 0, got {self.kv_block}")
        if self.kv_scored and not self.kv_block:
            raise self._fail("kv_scored keeps block keys: it needs kv_block")
        if self.kv_blocks < 0 or bool(self.kv_blocks) != bool(self.kv_block):
            raise self._fail(
                f"kv_blocks (the pool's blocks, {self.kv_blocks}) comes with kv_block "
                f"({self.kv_block}), both > 0, or neither"
            )
        if self.kv_dtype not in ("", *COMPUTE_DTYPES):
            raise self._fail(f"kv_dtype must be one of {COMPUTE_DTYPES}, got {self.kv_dtype!r}")
        if self.moe_hot < -1:
            raise self._fail(f"moe_hot must be -1 (all) or >= 0, got {self.moe_hot}")
        a, b = self.layers
        _check_weights(self)
        if not 0 <= a < b:
            raise self._fail(f"layers must be [a, b) with 0 <= a < b, got {list(self.layers)}")
        if not self.model:
            raise self._fail("model path is empty")
        if not self.devices:
            raise self._fail("devices is empty")
        if self.kv_capacity < 1:
            raise self._fail(f"kv_capacity must be >= 1, got {self.kv_capacity}")
        if len(self.device_splits) != len(self.devices) - 1:
            raise self._fail(
                f"{len(self.devices)} devices need {len(self.devices) - 1} device_splits, "
                f"got {len(self.device_splits)}"
            )
        bounds = (a, *self.device_splits, b)
        if any(lo >= hi for lo, hi in itertools.pairwise(bounds)):
            raise self._fail(f"device_splits must increase strictly inside {list(self.layers)}")


@_op("load", REPLIES)
@dataclass(frozen=True)
class LoadReply(Reply):
    n_layers: int  # layers in the whole model
    hidden: int
    vocab: int
    layers: tuple[int, int]
    dtype: ComputeDtype
    kv_capacity: int
    load_s: float
    # The loaded layers that keep a recurrent state (Gated DeltaNet) instead of K/V rows:
    # such a state cannot be truncated, only rewound to a kept one (the daemon replays).
    recurrent: tuple[int, ...] = ()
    # With kv_block: one host record of a paged-out block, its rows of every shard's stored
    # layers, the shards side by side (runtime.kv_host layout each).
    kv_record_bytes: int = 0
    # With recurrent layers: one state record, every recurrent layer's state of every shard
    # (runtime.kv_state layout each), the shards side by side.
    kv_state_bytes: int = 0
    moe_fingerprint: str = ""  # the expert placement (runtime.experts.Placement); "": none
    # What runs the packed matrices and decode attention (runtime.native.describe):
    # "native avx2", "torch", or KERNELS_FALLBACK + ": why" (native wanted, not had).
    kernels: str = ""


KERNELS_FALLBACK = "torch fallback"  # decode runs several times slower than native


# -- load_experts, expert_mix ---------------------------------------------------------------


@_op("load_experts", REQUESTS)
@dataclass(frozen=True)
class LoadExperts(Request):
    """Hold the cold experts of a target that keeps `hot` per layer (planned as the target
    plans it: ``runtime.experts.plan``), read from the GGUF's mapping."""

    model: str
    dtype: ComputeDtype
    device: str
    hot: int
    moe_profile: MoeCounts = ()  # as the target's load has it
    weights: str = "dequant"  # as the target's load has it (one of WEIGHT_MODES)

    def _check(self) -> None:
        if self.hot < 0:
            raise self._fail(f"hot must be >= 0, got {self.hot}")
        _check_weights(self)


@_op("load_experts", REPLIES)
@dataclass(frozen=True)
class LoadExpertsReply(Reply):
    n_layers: int  # MoE layers with experts held here
    n_held: int  # experts held, over all layers
    fingerprint: str  # of the target's placement it complements (load's moe_fingerprint)
    load_s: float


@_op("expert_mix", REQUESTS)
@dataclass(frozen=True)
class ExpertMix(Request):
    """One MoE layer's cold experts for n rows: x [n, hidden], ids [n, k] int32 (this
    worker's local indices, -1 skipped), weights [n, k] float32. The answer overwrites x."""

    layer: int
    x: Region
    ids: Region
    weights: Region

    def _check(self) -> None:
        n = self.x.shape[0] if len(self.x.shape) == 2 else -1
        if n < 0 or self.ids.shape != self.weights.shape or len(self.ids.shape) != 2:
            raise self._fail("x must be [n, hidden], ids and weights the same [n, k]")
        if self.ids.shape[0] != n:
            raise self._fail(f"{n} rows of x but {self.ids.shape[0]} of ids")
        if self.ids.dtype != "int32" or self.weights.dtype != "float32":
            raise self._fail("ids must be int32 and weights float32")


@_op("expert_mix", REPLIES)
@dataclass(frozen=True)
class ExpertMixReply(Reply):
    elapsed_us: int


@_op("stats", REQUESTS)
@dataclass(frozen=True)
class Stats(Request):
    pass


@_op("stats", REPLIES)
@dataclass(frozen=True)
class StatsReply(Reply):
    stats: dict[str, int | float | str]  # flat: "rss_bytes", "forward_count", ...


@_op("shutdown", REQUESTS)
@dataclass(frozen=True)
class Shutdown(Request):
    """Reply, then exit. The only way a worker ends (it ignores SIGINT / SIGTERM)."""


@_op("shutdown", REPLIES)
@dataclass(frozen=True)
class ShutdownReply(Reply):
    pass
