"""Where the target model's layers live: `--target-devices` + `--target-layer-split` -> shards.

    --target-devices cuda:0,cuda:1,hip:0 --target-layer-split 0.08,0.46,0.46

One shard per listed device, in layer order. A device belongs to a *backend group*,
and one group is one worker process (one torch build drives it):

    cuda:N -> group "cuda"      hip:N -> group "hip"      mps -> group "mps"
    cpu    -> group "cpu"       cpu:N -> group "cpu:N"    (each a distinct CPU worker)

so `cpu,cpu:1` is two workers (the cross-process path on one machine) and `cpu,cpu` is
one worker holding two shards (the in-process path). A group's devices must be
adjacent in the list, so each worker holds one contiguous layer range.

A device on another host is ``tcp://HOST:PORT/DEVICE``: the worker listening there
(``luced worker --listen``; ``engine/remote.py``) drives DEVICE. Its group is
``tcp://HOST:PORT``, one worker per address, so ``cpu,tcp://10.0.0.2:7070/cpu`` is a
local worker and a remote one, and ``tcp://h:7070/cuda:0,tcp://h:7070/cuda:1`` two
shards in one remote worker.

Layer ranges (pure integers, deterministic): with weights w (equal when not given),
``cum_i = w_0 + .. + w_i`` and ``end_i = round(cum_i / sum(w) * n_layers)``, clamped to
``[begin_i + 1, n_layers - (G - 1 - i)]`` so every shard keeps at least one layer;
``begin_{i+1} = end_i`` and the last shard ends at ``n_layers``. Examples (64 layers):
``1,1`` -> [0, 32), [32, 64); ``1,3`` -> [0, 16), [16, 64).

KV sharing (Gemma 4, ``GGUFFile.kv_sources``): a layer that attends to an earlier layer's
K/V must sit in that layer's shard, so a boundary b is legal only if no sharing pair
(source s, layer l) has s < b <= l. A proportional boundary that is not legal moves to the
nearest legal one (down on a tie), keeping every shard non-empty, and the move is logged.
Gemma 4's shared layers are its last ones and read layers just before them, so the tail
from the first source on stays in the last shard::

    layers 0 1 2 3 4 5, 4 reads 3, 5 reads 2:  legal boundaries 1, 2;  1,1 -> [0, 2), [2, 6)

Errors are `PlacementError`s naming the flag, raised at start-up before any worker runs.
"""

from __future__ import annotations

import bisect
import logging
import math
import os
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from luced.gguf_file import GGUFFile
from luced.ipc.frames import MoeCounts
from luced.ipc.tcp import parse_address

DEVICE_KINDS = ("cpu", "cuda", "hip", "mps")
DEVICES_FLAG = "--target-devices"
SPLIT_FLAG = "--target-layer-split"
_DEVICE_RE = re.compile(r"(?P<kind>[a-z]+)(?::(?P<index>\d+))?")
REMOTE_SCHEME = "tcp://"
_REMOTE_RE = re.compile(r"tcp://(?P<address>[^/]+)/(?P<device>[^/]+)")

log = logging.getLogger(__name__)


class PlacementError(ValueError):
    """A bad placement; the message names the flag."""


@dataclass(frozen=True)
class WorkerPlan:
    """One worker's share: its group, its devices (one shard each) and its layers."""

    group: str
    devices: tuple[str, ...]
    layers: tuple[int, int]  # [a, b)
    device_splits: tuple[int, ...]  # where the next device's shard starts, inside (a, b)
    n_layers: int  # of the whole model

    @property
    def owns_embed(self) -> bool:
        return self.layers[0] == 0

    @property
    def owns_head(self) -> bool:
        return self.layers[1] == self.n_layers

    def shard_ranges(self) -> list[tuple[int, int]]:
        bounds = (self.layers[0], *self.device_splits, self.layers[1])
        return [(bounds[i], bounds[i + 1]) for i in range(len(self.devices))]


def remote_address(name: str) -> str | None:
    """HOST:PORT of a device on another host (``tcp://HOST:PORT/DEVICE``), else None."""
    m = _REMOTE_RE.fullmatch(name)
    return m["address"] if m else None


def local_device(name: str) -> str:
    """The device as its worker names it: ``tcp://h:7070/cuda:1`` -> ``cuda:1``."""
    m = _REMOTE_RE.fullmatch(name)
    return m["device"] if m else name


def parse_device(name: str) -> tuple[str, str]:
    """(device, group) of one entry of --target-devices."""
    if name.startswith(REMOTE_SCHEME):
        m = _REMOTE_RE.fullmatch(name)
        try:
            if m is None:
                raise ValueError("want tcp://HOST:PORT/DEVICE")
            parse_address(m["address"])
        except ValueError as exc:
            raise PlacementError(f"{DEVICES_FLAG}: bad remote device {name!r}: {exc}") from None
        parse_device(m["device"])  # the remote worker's own device
        return name, REMOTE_SCHEME + m["address"]
    m = _DEVICE_RE.fullmatch(name)
    if m is None or m["kind"] not in DEVICE_KINDS:
        raise PlacementError(
            f"{DEVICES_FLAG}: unknown device {name!r} (want KIND or KIND:INDEX, KIND one of "
            f"{', '.join(DEVICE_KINDS)})"
        )
    kind = m["kind"]
    if kind == "mps" and m["index"] not in (None, "0"):
        raise PlacementError(f"{DEVICES_FLAG}: unknown device {name!r} (there is one mps)")
    # CPU: the index names a group (several CPU workers); GPUs: it names a device of the group.
    return name, (name if kind == "cpu" else kind)


def parse_devices(text: str | Sequence[str]) -> tuple[str, ...]:
    items = text.split(",") if isinstance(text, str) else list(text)
    devices = tuple(d.strip() for d in items)
    if not devices or any(not d for d in devices):
        raise PlacementError(f"{DEVICES_FLAG}: empty device in {text!r}")
    for d in devices:
        parse_device(d)
    groups = [parse_device(d)[1] for d in devices]
    for i, g in enumerate(groups):
        if g in groups[:i] and groups[i - 1] != g:
            raise PlacementError(
                f"{DEVICES_FLAG}: the devices of group {g!r} must be adjacent in "
                f"{','.join(devices)} (one worker holds one contiguous layer range)"
            )
    return devices


def parse_weights(text: str | Sequence[float | int | str]) -> tuple[float, ...]:
    items = text.split(",") if isinstance(text, str) else list(text)
    out = []
    for item in items:
        try:
            w = float(item.strip() if isinstance(item, str) else item)
        except (TypeError, ValueError):
            raise PlacementError(f"{SPLIT_FLAG}: not a number: {item!r}") from None
        if not math.isfinite(w) or w <= 0:
            raise PlacementError(f"{SPLIT_FLAG}: weights must be positive numbers, got {item!r}")
        out.append(w)
    if not out:
        raise PlacementError(f"{SPLIT_FLAG}: no weights given")
    return tuple(out)


def layer_ranges(
    n_layers: int,
    n_shards: int,
    weights: Sequence[float] = (),
    kv_sources: Mapping[int, int] | None = None,
) -> list[tuple[int, int]]:
    """Contiguous [begin, end) per shard, in proportion to the weights, with no KV-sharing
    layer cut off from its source (`kv_sources`: layer -> source; module docstring)."""
    if n_shards < 1:
        raise PlacementError(f"{DEVICES_FLAG}: no devices")
    if n_shards > n_layers:
        raise PlacementError(
            f"{DEVICES_FLAG}: {n_shards} shards for a model of {n_layers} layers "
            "(each shard needs at least one layer)"
        )
    w = list(weights) if weights else [1.0] * n_shards
    if len(w) != n_shards:
        raise PlacementError(
            f"{SPLIT_FLAG}: {len(w)} weights for {n_shards} devices in {DEVICES_FLAG}"
        )
    total = sum(w)
    ranges, begin, cum = [], 0, 0.0
    for i, wi in enumerate(w):
        cum += wi
        end = n_layers if i == n_shards - 1 else round(cum / total * n_layers)
        end = max(begin + 1, min(end, n_layers - (n_shards - 1 - i)))
        ranges.append((begin, end))
        begin = end
    if kv_sources:
        ranges = _keep_kv_sources(ranges, n_layers, kv_sources)
    return ranges


def _keep_kv_sources(
    ranges: list[tuple[int, int]], n_layers: int, kv_sources: Mapping[int, int]
) -> list[tuple[int, int]]:
    """Move each boundary that separates a KV-sharing layer from its source to the nearest
    legal boundary, in order, leaving room for the boundaries after it."""
    legal = [
        b
        for b in range(1, n_layers)
        if not any(src < b <= layer for layer, src in kv_sources.items())
    ]
    wanted = [end for _, end in ranges[:-1]]
    if len(legal) < len(wanted):
        raise PlacementError(
            f"{DEVICES_FLAG}: {len(ranges)} shards for a model whose KV-sharing layers allow "
            f"only {len(legal) + 1} (legal boundaries: {legal})"
        )
    bounds: list[int] = []
    lo = 0  # index into legal of the lowest choice left
    for i, b in enumerate(wanted):
        hi = len(legal) - (len(wanted) - i)  # leave one legal boundary per later shard
        j = min(max(bisect.bisect_left(legal, b), lo), hi)  # legal[j] >= b, or the cap
        if j > lo and b - legal[j - 1] <= legal[j] - b:
            j -= 1  # the one below is as near or nearer
        if legal[j] != b:
            log.warning(
                "layer split: moved a shard boundary from layer %d to %d so KV-sharing "
                "layers stay with the layers whose KV they read",
                b,
                legal[j],
            )
        bounds.append(legal[j])
        lo = j + 1
    edges = [0, *bounds, n_layers]
    return [(edges[i], edges[i + 1]) for i in range(len(ranges))]


def plan_workers(
    devices: Sequence[str],
    weights: Sequence[float],
    n_layers: int,
    kv_sources: Mapping[int, int] | None = None,
) -> list[WorkerPlan]:
    """The workers, in layer order: consecutive devices of one group form one worker."""
    devices = parse_devices(list(devices))
    ranges = layer_ranges(n_layers, len(devices), weights, kv_sources)
    plans: list[WorkerPlan] = []
    run: list[int] = []  # shard indices of the current group
    for i, d in enumerate(devices):
        run.append(i)
        last = i == len(devices) - 1
        if last or parse_device(devices[i + 1])[1] != parse_device(d)[1]:
            plans.append(
                WorkerPlan(
                    group=parse_device(d)[1],
                    devices=tuple(local_device(devices[j]) for j in run),
                    layers=(ranges[run[0]][0], ranges[run[-1]][1]),
                    device_splits=tuple(ranges[j][0] for j in run[1:]),
                    n_layers=n_layers,
                )
            )
            run = []
    return plans


def check_interpreters(plans: Sequence[WorkerPlan], pythons: Mapping[str, str]) -> None:
    """Every group's interpreter must exist before any worker starts."""
    for p in plans:
        exe = pythons.get(p.group)
        if exe is not None and not (os.path.isfile(exe) and os.access(exe, os.X_OK)):
            raise PlacementError(
                f"{DEVICES_FLAG}: group {p.group!r} runs under {exe}, which is not an "
                "executable file (see --backend-python)"
            )


@dataclass(frozen=True)
class WorkerSpec:
    """How to start one worker process."""

    group: str  # backend group name: "cpu", "cpu:1", "cuda", ..., "tcp://HOST:PORT"
    devices: tuple[str, ...]  # as the worker names them
    python: str = sys.executable  # a group may bring its own interpreter (ROCm torch)
    threads: int | None = None
    address: str = ""  # HOST:PORT of a worker on another host (started there, not by us)

    @property
    def remote(self) -> bool:
        return bool(self.address)

    def named(self, device: str) -> str:
        """One of its devices as the placement names it (``tcp://HOST:PORT/cpu``)."""
        return f"{REMOTE_SCHEME}{self.address}/{device}" if self.remote else device

    def names(self) -> list[str]:
        return [self.named(d) for d in self.devices]


def worker_spec(
    device: str, pythons: Mapping[str, str], threads: int | None, devices: tuple[str, ...] = ()
) -> WorkerSpec:
    """The worker of a group of its own on `device` (or on `devices`, given the group's),
    local or on another host."""
    group = parse_device(device)[1]
    address = remote_address(device) or ""
    return WorkerSpec(
        group,
        devices or (local_device(device),),
        python=pythons.get(group, sys.executable),
        threads=None if address else threads,
        address=address,
    )


@dataclass(frozen=True)
class TargetPlacement:
    """The target model and where its layers run. Give ``worker`` (one worker holding every
    layer) or ``workers`` (the split, in layer order; see ``TargetPlacement.split``)."""

    model: str
    n_layers: int  # from the GGUF header, read by the daemon before any worker starts
    dtype: str
    kv_capacity: int
    max_batch_tokens: int
    worker: WorkerSpec | None = None
    workers: tuple[tuple[WorkerSpec, WorkerPlan], ...] = ()
    logit_rows: int = 16  # rows of the logits region
    moe_hot: int | None = None  # routed experts each worker keeps per layer; None: all
    moe_expert: WorkerSpec | None = None  # the worker of the cold experts; None: in process
    moe_required: bool = False  # a forward fails rather than compute cold experts in process
    moe_dims: tuple[int, int] = (0, 0)  # (hidden, experts per token): sizes the scratch
    moe_profile: MoeCounts = ()  # a routing profile's counts: the most routed are hot
    weights_mode: str = "dequant"  # how workers hold matrices (frames.WEIGHT_MODES)
    batch_invariant: bool = False  # logits independent of how tokens are grouped in calls
    kv_dtype: str = ""  # the K/V rows' dtype; "" = dtype
    kv_block: int = 0  # rows per block of the workers' K/V block pools; 0: none (frames.Load)
    decode_graphs: str = "auto"  # decode through a captured step (frames.Load)

    def __post_init__(self) -> None:
        if not self.workers:
            if self.worker is None:
                raise ValueError("a placement needs worker or workers")
            w = self.worker
            plan = WorkerPlan(w.group, w.devices[:1], (0, self.n_layers), (), self.n_layers)
            object.__setattr__(self, "workers", ((w, plan),))

    @classmethod
    def one_cpu_worker(
        cls,
        gguf: GGUFFile,
        *,
        threads: int | None,
        kv_capacity: int,
        max_batch_tokens: int,
        dtype: str = "float32",
        **fields: Any,
    ) -> TargetPlacement:
        """Every layer of `gguf`'s model in one CPU worker (the tools' and `luced
        train-draft`'s engines); `fields` are the placement's others (weights_mode, ...)."""
        return cls(
            model=str(gguf.path),
            n_layers=int(gguf.require(f"{gguf.arch}.block_count")),
            dtype=dtype,
            kv_capacity=kv_capacity,
            max_batch_tokens=max_batch_tokens,
            worker=WorkerSpec("cpu", ("cpu",), threads=threads),
            **fields,
        )

    @classmethod
    def split(
        cls,
        *,
        model: str,
        n_layers: int,
        dtype: str,
        kv_capacity: int,
        max_batch_tokens: int,
        devices: Sequence[str],
        weights: Sequence[float] = (),
        kv_sources: Mapping[int, int] | None = None,
        pythons: Mapping[str, str] | None = None,
        threads: int | None = None,
        cores: int = 1,
        logit_rows: int = 16,
        moe_hot: int | None = None,
        moe_expert_device: str | None = None,
        moe_required: bool = False,
        moe_dims: tuple[int, int] = (0, 0),
        moe_profile: MoeCounts = (),
        weights_mode: str = "dequant",
        batch_invariant: bool = False,
        kv_dtype: str = "",
        kv_block: int = 0,
        decode_graphs: str = "auto",
    ) -> TargetPlacement:
        """--target-devices / --target-layer-split -> workers; raises PlacementError.
        `kv_sources` (the GGUF's KV-sharing layers) keeps sharing layers with their sources;
        `threads` None shares `cores` among the workers."""
        plans = plan_workers(devices, weights, n_layers, kv_sources)
        local = [p for p in plans if not p.group.startswith(REMOTE_SCHEME)]
        if threads is None:  # a worker on another host has that host's cores
            threads = max(1, cores // max(1, len(local)))
        pythons = dict(pythons or {})
        check_interpreters(local, pythons)
        names = parse_devices(list(devices))
        first = {parse_device(d)[1]: d for d in reversed(names)}  # each group's first device
        workers = [(worker_spec(first[p.group], pythons, threads, p.devices), p) for p in plans]
        return cls(
            model=model,
            n_layers=n_layers,
            dtype=dtype,
            kv_capacity=kv_capacity,
            max_batch_tokens=max_batch_tokens,
            workers=tuple(workers),
            logit_rows=logit_rows,
            moe_hot=moe_hot,
            moe_expert=worker_spec(moe_expert_device, pythons, threads)
            if moe_expert_device
            else None,
            moe_required=moe_required,
            moe_dims=moe_dims,
            moe_profile=moe_profile,
            weights_mode=weights_mode,
            batch_invariant=batch_invariant,
            kv_dtype=kv_dtype,
            kv_block=kv_block,
            decode_graphs=decode_graphs,
        )
