"""The machinery the op modules share: the protocol version, the envelope, the request and
reply bases with their registries, and the checks and constants several ops use."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any, ClassVar, Literal, TypeVar

from luced.ipc.regions import Region
from luced.ipc.typed import FrameError, Record
from luced.sampling_params import SamplingParams

PROTOCOL_VERSION = 28

_ENVELOPE = frozenset(
    {"op", "seq", "ok", "error", "progress", "carry", "carried"}
)  # no op may use these as fields


class ProtocolVersionError(FrameError):
    """The peer speaks another protocol version."""


@dataclass(frozen=True)
class _Frame(Record):
    OP: ClassVar[str] = ""
    KIND: ClassVar[str] = ""

    @classmethod
    def label(cls) -> str:
        return f"{cls.OP} {cls.KIND}"


@dataclass(frozen=True)
class Request(_Frame):
    KIND: ClassVar[str] = "request"


@dataclass(frozen=True)
class Reply(_Frame):
    KIND: ClassVar[str] = "reply"


@dataclass(frozen=True)
class ErrorReply:
    """``{"seq", "ok": false, "error"}``: the request failed; ``error`` says why."""

    error: str


REQUESTS: dict[str, type[Request]] = {}
REPLIES: dict[str, type[Reply]] = {}

_F = TypeVar("_F", bound=_Frame)


def _op(op: str, registry: dict[str, Any]) -> Callable[[type[_F]], type[_F]]:
    def register(cls: type[_F]) -> type[_F]:
        cls.OP = op
        clash = {f.name for f in fields(cls)} & _ENVELOPE
        if clash or op in registry:
            raise TypeError(f"{cls.__name__}: envelope key(s) {clash} or op {op!r} declared twice")
        registry[op] = cls
        return cls

    return register


def _check_protocol(version: object) -> None:
    if version != PROTOCOL_VERSION or type(version) is not int:
        raise ProtocolVersionError(
            f"protocol version mismatch: the peer speaks {version!r}, this side speaks "
            f"{PROTOCOL_VERSION} (daemon and worker come from different luced builds)"
        )


COMPUTE_DTYPES = ("float32", "bfloat16", "float16")
ComputeDtype = Literal["float32", "bfloat16", "float16"]
# How a worker holds weight matrices (luced.runtime.qlinear): packed int4 / int8 for the
# weight-only kernels, "auto" per tensor and CPU, "dequant" the exact float path.
WEIGHT_MODES = ("auto", "int4", "int8", "dequant")
# When a worker decodes through a captured fixed-shape step (luced.runtime.decode_graph).
DECODE_GRAPHS = ("auto", "on", "compile", "off")
# A MoE routing profile's counts (luced.serve.routing_profile): per MoE layer, how often
# each expert was routed to, as ((layer, (count per expert, ...)), ...).
MoeCounts = tuple[tuple[int, tuple[int, ...]], ...]


def _check_sequence(frame: Any) -> None:
    """A frame's `sequence` (truncate, reset, kv_export, kv_import, kv_share)."""
    if frame.sequence < 0:
        raise frame._fail(f"sequence must be >= 0, got {frame.sequence}")


def _check_sampling_map(frame: Any) -> None:
    """The map must be a ``SamplingParams`` wire form (the one definition of the fields)."""
    sampling = frame.sampling
    try:
        try:
            _check_sampling_items(tuple(sampling.items()), tuple(map(type, sampling.values())))
        except TypeError:  # a nested logit_bias map cannot be a cache key
            SamplingParams.from_wire(sampling)
    except ValueError as e:
        where = "" if str(e).startswith("unknown") else "sampling."
        raise frame._fail(f"{where}{e}") from None


@functools.lru_cache(maxsize=1024)
def _check_sampling_items(items: tuple[tuple[str, Any], ...], types: tuple[type, ...]) -> None:
    """A map that passed is not checked again (a sequence sends one at every step, and the
    daemon and each worker check it). Keyed by its values' types too: 1, 1.0 and True are
    equal keys, and not all are valid; a map that fails is not cached."""
    SamplingParams.from_wire(dict(items))


def _check_rings(frame: Request, capture: tuple[int, ...], rings: tuple[Region, ...]) -> None:
    """Capture layers and the feature ring(s) they go to: both or neither, each ring float
    [ring_cap >= 1, len(capture), hidden]."""
    if not capture:
        if rings:
            raise frame._fail("ring given without capture layers")
        return
    if not rings:
        raise frame._fail("capture layers given without a ring region")
    if len(set(capture)) != len(capture) or min(capture) < 0:
        raise frame._fail(f"capture layers must be distinct and >= 0: {list(capture)}")
    for r in rings:
        shape_ok = len(r.shape) == 3 and r.shape[0] >= 1 and r.shape[1] == len(capture)
        if not shape_ok or r.dtype not in COMPUTE_DTYPES:
            raise frame._fail(
                f"ring must be float [ring_cap, {len(capture)}, hidden], got "
                f"{r.dtype} {list(r.shape)}"
            )
