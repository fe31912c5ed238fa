"""Typed records for msgpack frames: fields checked and normalised from their annotations.

A ``Record`` is a frozen dataclass whose construction checks every field against its
annotation (and normalises: numpy ints to ``int``, lists to tuples, region maps to
``Region``), then runs the record's own ``_check``. ``to_wire`` gives plain msgpack
types; ``from_wire`` rejects unknown keys and missing ones without a default. A record
with ``OMIT_DEFAULTS`` leaves each field equal to its default off the wire (``from_wire``
fills it back, so the decoded record equals the sent one). Supported annotations: ``bool``,
``int``, ``float``, ``str``, ``bytes``, ``None``, ``Region``, ``Literal[str, ...]``, unions,
``tuple[X, ...]``, ``tuple[X, Y]``, ``dict[str, X]`` and another ``Record`` (a map on the
wire, checked by that record's own rules). The frame declarations live in
``frames.py``; this module is only the machinery.
"""

from __future__ import annotations

import functools
import math
import numbers
import types
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, fields
from typing import Any, ClassVar, Literal, Self, Union, get_args, get_origin, get_type_hints

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


Coercer = Callable[[Any, str], Any]
# The exact Python types each plain annotation's check takes (a union dispatches on them).
_TAKES: dict[Any, tuple[type, ...]] = {
    bool: (bool,),
    int: (int,),
    float: (int, float),
    str: (str,),
    bytes: (bytes, bytearray, memoryview),
}


def coerce(v: Any, tp: Any, path: str) -> Any:
    """Check ``v`` against the annotation ``tp``; return it normalised."""
    return _coercer(tp)(v, path)


def _mismatch(v: Any, tp: Any, path: str) -> FrameError:
    shown = repr(v) if len(repr(v)) <= 60 else repr(v)[:57] + "..."
    return FrameError(f"{path}: expected {_typename(tp)}, got {type(v).__name__} {shown}")


_COERCERS: dict[Any, Coercer] = {}


def _coercer(tp: Any) -> Coercer:
    """The check of one annotation, worked out once: a frame of many spans checks the same
    few annotations thousands of times a second, and every step waits for it."""
    key = _ordered(tp)
    got = _COERCERS.get(key)
    if got is None:
        got = _COERCERS[key] = _compile(tp)
    return got


def _ordered(tp: Any) -> Any:
    """An annotation as a key that tells `int | float` from `float | int` (unions and
    literals compare equal whatever their order; their checks try the arms in order)."""
    args = get_args(tp)
    return (get_origin(tp), tuple(_ordered(a) for a in args)) if args else tp


def _compile(tp: Any) -> Coercer:
    if tp is bool:

        def check(v: Any, path: str) -> Any:
            if type(v) is bool:
                return v
            raise _mismatch(v, tp, path)

    elif tp is int:

        def check(v: Any, path: str) -> Any:
            if type(v) is int or (isinstance(v, numbers.Integral) and not isinstance(v, bool)):
                if not -(2**63) <= v < 2**64:  # what msgpack can carry
                    raise FrameError(f"{path}: {v} is outside the 64-bit integer range")
                return int(v)
            raise _mismatch(v, tp, path)

    elif tp is float:

        def check(v: Any, path: str) -> Any:
            if type(v) is float:
                return v
            if isinstance(v, numbers.Real) and not isinstance(v, bool):
                return float(v)
            raise _mismatch(v, tp, path)

    elif tp is str:

        def check(v: Any, path: str) -> Any:
            if isinstance(v, str):
                return str(v)
            raise _mismatch(v, tp, path)

    elif tp is bytes:

        def check(v: Any, path: str) -> Any:
            if isinstance(v, bytes | bytearray | memoryview):
                return bytes(v)
            raise _mismatch(v, tp, path)

    elif tp is type(None):

        def check(v: Any, path: str) -> Any:
            if v is None:
                return None
            raise _mismatch(v, tp, path)

    elif isinstance(tp, type) and issubclass(tp, Record):

        def check(v: Any, path: str) -> Any:
            if isinstance(v, tp):
                return v
            if isinstance(v, Mapping):
                try:
                    return tp.from_wire(v)
                except FrameError as e:
                    raise FrameError(f"{path}: {e}") from None
            raise _mismatch(v, tp, path)

    elif tp is Region:

        def check(v: Any, path: str) -> Any:
            if isinstance(v, Region):
                return v
            try:
                return Region.from_wire(v)
            except RegionError as e:
                raise FrameError(f"{path}: {e}") from None

    else:
        check = _generic(tp)
    return check


def _generic(tp: Any) -> Coercer:
    """The check of a parametrised annotation (Literal, a union, tuple, dict)."""
    origin, args = get_origin(tp), get_args(tp)
    if origin is Literal:

        def literal(v: Any, path: str) -> Any:
            if isinstance(v, str) and v in args:
                return v
            raise FrameError(f"{path}: expected one of {list(args)}, got {v!r}")

        return literal
    if origin in (Union, types.UnionType):
        arms = [_coercer(a) for a in args if a is not type(None)]
        optional = len(arms) < len(args)
        if len(arms) == 1:  # X | None: keep X's precise error
            (arm,) = arms

            def maybe(v: Any, path: str) -> Any:
                return None if v is None and optional else arm(v, path)

            return maybe

        # A value of a plain type goes straight to the first arm that takes it (as trying
        # the arms in order would: no arm before it takes that type), sparing the failed
        # tries of the arms before.
        direct: dict[type, Coercer | None] = {}
        for a in args:
            if get_origin(a) is Literal:
                direct.setdefault(str, None)  # it may take a string: try the arms in order
            for t in _TAKES.get(a, ()):
                direct.setdefault(t, _coercer(a))

        def union(v: Any, path: str) -> Any:
            if v is None and optional:
                return None
            if (arm := direct.get(type(v))) is not None:
                return arm(v, path)
            for arm in arms:
                try:
                    return arm(v, path)
                except FrameError:
                    pass
            raise _mismatch(v, tp, path)

        return union
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            item = _coercer(args[0])

            def items(v: Any, path: str) -> Any:
                if isinstance(v, list | tuple):
                    return tuple(item(x, f"{path}[{i}]") for i, x in enumerate(v))
                raise _mismatch(v, tp, path)

            return items
        parts = [_coercer(a) for a in args]

        def fixed(v: Any, path: str) -> Any:
            if isinstance(v, list | tuple):
                if len(v) != len(parts):
                    raise FrameError(f"{path}: expected {len(parts)} items, got {len(v)}")
                pairs = enumerate(zip(v, parts, strict=True))
                return tuple(part(x, f"{path}[{i}]") for i, (x, part) in pairs)
            raise _mismatch(v, tp, path)

        return fixed
    if origin is dict:
        value = _coercer(args[1])

        def mapping(v: Any, path: str) -> Any:
            if isinstance(v, Mapping):
                out = {}
                for k, x in v.items():
                    if not isinstance(k, str):
                        raise FrameError(f"{path}: keys must be strings, got {k!r}")
                    out[k] = value(x, f"{path}.{k}")
                return out
            raise _mismatch(v, tp, path)

        return mapping
    raise TypeError(f"unsupported field type {tp!r}")  # pragma: no cover


def to_wire(v: Any) -> Any:
    """Plain msgpack types: regions to maps, tuples to lists."""
    if isinstance(v, Region | Record):
        return v.to_wire()
    if isinstance(v, tuple | list):
        return [to_wire(x) for x in v]
    if isinstance(v, dict):
        return {k: to_wire(x) for k, x in v.items()}
    return v


Encoder = Callable[[Any], Any]
# Checked values of these annotations are msgpack types already: they go on the wire as they are.
_PLAIN = (bool, int, float, str, bytes, type(None))


def _wire_form(tp: Any) -> Encoder | None:
    """How a checked value of the annotation ``tp`` goes on the wire (None: as it is),
    worked out once per field, as its check is."""
    origin, args = get_origin(tp), get_args(tp)
    if tp in _PLAIN or origin is Literal:
        return None
    if tp is Region or (isinstance(tp, type) and issubclass(tp, Record)):
        return tp.to_wire
    if origin in (Union, types.UnionType):
        return None if all(_wire_form(a) is None for a in args) else to_wire
    if origin is tuple:
        forms = {_wire_form(a) for a in args if a is not Ellipsis}
        if forms == {None}:
            return list
        if len(args) == 2 and args[1] is Ellipsis:
            (item,) = forms
            return lambda v: [item(x) for x in v]
    if origin is dict:
        value = _wire_form(args[1])
        if value is None:
            return dict  # a copy: the wire map never aliases the frozen record's own
        return lambda v: {k: value(x) for k, x in v.items()}
    return to_wire


@dataclass(frozen=True)
class Record:
    """Base of typed frames; subclasses are frozen dataclasses."""

    # Frames sent at every step set this: their fields are mostly at their defaults, and a
    # default costs its key and value in the encoder, the bytes and the decoder. A frame
    # whose defaults must travel (hello's protocol version) leaves it False.
    OMIT_DEFAULTS: ClassVar[bool] = False

    @classmethod
    def label(cls) -> str:
        """How errors name this record."""
        return cls.__name__

    def __post_init__(self) -> None:
        for name, check, path, default in _checks(type(self)):
            value = getattr(self, name)
            if value is not default:  # the declared default passed its check once, unchanged
                object.__setattr__(self, name, check(value, path))
        self._check()

    def _check(self) -> None:
        """Rules beyond field types; raise ``self._fail(...)``."""

    def _fail(self, message: str) -> FrameError:
        return FrameError(f"{self.label()}: {message}")

    def to_wire(self) -> dict[str, Any]:
        return _encoder(type(self))(self)

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> Self:
        names, required = _keys(cls)
        missing, unknown = required - d.keys(), d.keys() - names
        if missing or unknown:
            parts = []
            if missing:
                parts.append(f"missing field(s) {sorted(missing)}")
            if unknown:
                parts.append(f"unknown field(s) {sorted(map(str, unknown))}")
            raise FrameError(f"{cls.label()}: {'; '.join(parts)}")
        return cls(**d)


_NO_DEFAULT: Any = object()  # a field that has none: no value is it


@functools.cache
def _checks(cls: type[Record]) -> list[tuple[str, Coercer, str, Any]]:
    """(field, its check, the path its errors name, a default that needs no check) for
    each field of a record class. A declared default that its check would change (an int
    for a float) is checked every time, as any value."""
    out = []
    for f, (name, tp) in zip(fields(cls), _hints(cls), strict=True):
        check, path = _coercer(tp), f"{cls.label()}: {name}"
        default = f.default
        if default is MISSING or check(default, path) is not default:
            default = _NO_DEFAULT
        out.append((name, check, path, default))
    return out


@functools.cache
def _encoder(cls: type[Record]) -> Callable[[Record], dict[str, Any]]:
    """A record class's ``to_wire``: each field's wire form, and with ``OMIT_DEFAULTS``
    the test that leaves it off: its value is its default (as its check gives it), of the
    same type, and for a float of the same sign (-0.0 is not sent as 0.0)."""
    plan = []
    for f, (name, tp) in zip(fields(cls), _hints(cls), strict=True):
        default = _NO_DEFAULT
        if cls.OMIT_DEFAULTS and f.default is not MISSING:
            default = _coercer(tp)(f.default, name)
        elif cls.OMIT_DEFAULTS and f.default_factory is not MISSING:
            default = _coercer(tp)(f.default_factory(), name)
        plan.append((name, _wire_form(tp), default))

    def encode(record: Record) -> dict[str, Any]:
        wire = {}
        for name, form, default in plan:
            v = getattr(record, name)
            if (
                type(v) is type(default)
                and v == default
                and (type(v) is not float or math.copysign(1.0, v) == math.copysign(1.0, default))
            ):
                continue
            wire[name] = v if form is None else form(v)
        return wire

    return encode


@functools.cache
def _keys(cls: type[Record]) -> tuple[frozenset[str], frozenset[str]]:
    """A record class's field names, and those without a default (the wire must carry)."""
    fs = fields(cls)
    required = (f.name for f in fs if f.default is MISSING and f.default_factory is MISSING)
    return frozenset(f.name for f in fs), frozenset(required)
