"""Typed records for msgpack frames: fields checked and normalised from their annotations.

A ``Record`` is a frozen dataclass whose construction checks every field against its
annotation (and normalises: numpy ints to ``int``, lists to tuples, region maps to
``Region``), then runs the record's own ``_check``. ``to_wire`` gives plain msgpack
types; ``from_wire`` rejects missing and unknown keys. Supported annotations: ``bool``,
``int``, ``float``, ``str``, ``bytes``, ``None``, ``Region``, ``Literal[str, ...]``, unions,
``tuple[X, ...]``, ``tuple[X, Y]``, ``dict[str, X]`` and another ``Record`` (a map on the
wire, checked by that record's own rules). The frame declarations live in
``frames.py``; this module is only the machinery.
"""

from __future__ import annotations

import numbers
import types
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, fields
from typing import Any, Literal, Self, Union, get_args, get_origin, get_type_hints

from luced.ipc.regions import Region, RegionError


class FrameError(Exception):
    """A frame is malformed or invalid. ``seq`` is set when it could be read, so the
    receiver can still answer the request with an error."""

    def __init__(self, message: str, seq: int | None = None) -> None:
        super().__init__(message)
        self.seq = seq


_HINTS: dict[type, list[tuple[str, Any]]] = {}


def _hints(cls: type) -> list[tuple[str, Any]]:
    # Resolved once per class: get_type_hints is far too slow to run for every frame.
    got = _HINTS.get(cls)
    if got is None:
        resolved = get_type_hints(cls)
        got = _HINTS[cls] = [(f.name, resolved[f.name]) for f in fields(cls)]
    return got


def _typename(tp: Any) -> str:
    if isinstance(tp, type):
        return tp.__name__
    return str(tp).replace("typing.", "").replace("luced.ipc.regions.", "")


def coerce(v: Any, tp: Any, path: str) -> Any:
    """Check ``v`` against the annotation ``tp``; return it normalised."""
    if tp is bool:
        if type(v) is bool:
            return v
    elif tp is int:
        if isinstance(v, numbers.Integral) and not isinstance(v, bool):
            if not -(2**63) <= v < 2**64:  # what msgpack can carry
                raise FrameError(f"{path}: {v} is outside the 64-bit integer range")
            return int(v)
    elif tp is float:
        if isinstance(v, numbers.Real) and not isinstance(v, bool):
            return float(v)
    elif tp is str:
        if isinstance(v, str):
            return str(v)
    elif tp is bytes:
        if isinstance(v, bytes | bytearray | memoryview):
            return bytes(v)
    elif tp is type(None):
        if v is None:
            return None
    elif isinstance(tp, type) and issubclass(tp, Record):
        if isinstance(v, tp):
            return v
        if isinstance(v, Mapping):
            try:
                return tp.from_wire(v)
            except FrameError as e:
                raise FrameError(f"{path}: {e}") from None
    elif tp is Region:
        if isinstance(v, Region):
            return v
        try:
            return Region.from_wire(v)
        except RegionError as e:
            raise FrameError(f"{path}: {e}") from None
    else:
        origin, args = get_origin(tp), get_args(tp)
        if origin is Literal:
            if isinstance(v, str) and v in args:
                return v
            raise FrameError(f"{path}: expected one of {list(args)}, got {v!r}")
        if origin in (Union, types.UnionType):
            arms = [a for a in args if a is not type(None)]
            if v is None and len(arms) < len(args):
                return None
            if len(arms) == 1:
                return coerce(v, arms[0], path)  # X | None: keep X's precise error
            for arm in arms:
                try:
                    return coerce(v, arm, path)
                except FrameError:
                    pass
        elif origin is tuple:
            if isinstance(v, list | tuple):
                if len(args) == 2 and args[1] is Ellipsis:
                    return tuple(coerce(x, args[0], f"{path}[{i}]") for i, x in enumerate(v))
                if len(v) != len(args):
                    raise FrameError(f"{path}: expected {len(args)} items, got {len(v)}")
                pairs = enumerate(zip(v, args, strict=True))
                return tuple(coerce(x, a, f"{path}[{i}]") for i, (x, a) in pairs)
        elif origin is dict:
            if isinstance(v, Mapping):
                out = {}
                for k, x in v.items():
                    if not isinstance(k, str):
                        raise FrameError(f"{path}: keys must be strings, got {k!r}")
                    out[k] = coerce(x, args[1], f"{path}.{k}")
                return out
        else:  # pragma: no cover - an annotation this module does not support
            raise TypeError(f"{path}: unsupported field type {tp!r}")
    shown = repr(v) if len(repr(v)) <= 60 else repr(v)[:57] + "..."
    raise FrameError(f"{path}: expected {_typename(tp)}, got {type(v).__name__} {shown}")


def to_wire(v: Any) -> Any:
    """Plain msgpack types: regions to maps, tuples to lists."""
    if isinstance(v, Region | Record):
        return v.to_wire()
    if isinstance(v, tuple | list):
        return [to_wire(x) for x in v]
    if isinstance(v, dict):
        return {k: to_wire(x) for k, x in v.items()}
    return v


@dataclass(frozen=True)
class Record:
    """Base of typed frames; subclasses are frozen dataclasses."""

    @classmethod
    def label(cls) -> str:
        """How errors name this record."""
        return cls.__name__

    def __post_init__(self) -> None:
        where = self.label()
        for name, tp in _hints(type(self)):
            object.__setattr__(self, name, coerce(getattr(self, name), tp, f"{where}: {name}"))
        self._check()

    def _check(self) -> None:
        """Rules beyond field types; raise ``self._fail(...)``."""

    def _fail(self, message: str) -> FrameError:
        return FrameError(f"{self.label()}: {message}")

    def to_wire(self) -> dict[str, Any]:
        return {name: to_wire(getattr(self, name)) for name, _ in _hints(type(self))}

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> Self:
        fs = fields(cls)
        names = {f.name for f in fs}
        required = {f.name for f in fs if f.default is MISSING and f.default_factory is MISSING}
        missing, unknown = required - d.keys(), d.keys() - names
        if missing or unknown:
            parts = []
            if missing:
                parts.append(f"missing field(s) {sorted(missing)}")
            if unknown:
                parts.append(f"unknown field(s) {sorted(map(str, unknown))}")
            raise FrameError(f"{cls.label()}: {'; '.join(parts)}")
        return cls(**d)
