"""The daemon's option values that are not scalars (``luced.values`` has those): each
converter returns the typed value or raises ValueError(reason), which the option's label
prefixes (``serve.options.Option.convert``)."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from luced.engine.placement import PlacementError
from luced.values import to_int, to_path

Pairs = tuple[tuple[str, Path], ...]  # (group, interpreter) in the order given
GROUP_RE = re.compile(r"[A-Za-z0-9_.:-]+")


def to_pool(v: Any) -> int | str:
    """KV Flash pool: a token count, or "auto"."""
    if isinstance(v, str) and v.strip().lower() == "auto":
        return "auto"
    n = to_int(v)
    if n < 1:
        raise ValueError(f"a pool needs tokens (or auto), got {n}")
    return n


def to_experts(v: Any) -> int | None:
    """MoE hot experts per layer: a count, or "all" (None)."""
    if isinstance(v, str) and v.strip().lower() == "all":
        return None
    n = to_int(v)
    if n < 0:
        raise ValueError(f"a count of experts (or all), got {n}")
    return n


def items(v: Any, what: str) -> list[Any]:
    """A repeatable option's items: "a,b" (env), a list (flags, file) or a table's pairs."""
    if isinstance(v, str):
        return [s for s in (p.strip() for p in v.split(",")) if s]
    if isinstance(v, Mapping):
        return list(v.items())
    if isinstance(v, list | tuple):
        return list(v)
    raise ValueError(f"not a list of {what}: {v!r}")


def to_pairs(v: Any) -> Pairs:
    """GROUP=PATH items: "a=/x,b=/y" (env), a list of "GROUP=PATH", a TOML table, or pairs."""
    out: dict[str, Path] = {}
    for item in items(v, "GROUP=PATH"):
        if isinstance(item, str):
            group, sep, path = item.partition("=")
            if not sep:
                raise ValueError(f"not GROUP=PATH: {item!r}")
        elif isinstance(item, tuple | list) and len(item) == 2:
            group, path = item
        else:
            raise ValueError(f"not GROUP=PATH: {item!r}")
        if not isinstance(group, str) or not GROUP_RE.fullmatch(group):
            raise ValueError(f"bad group name {group!r} (letters, digits, _ . : -)")
        if group in out:
            raise ValueError(f"group {group!r} given twice")
        try:
            out[group] = to_path(path)
        except ValueError as exc:
            raise ValueError(f"group {group!r}: {exc}") from None
    return tuple(out.items())


def unflagged(parse: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """A placement parser whose errors drop their flag prefix (the label adds the source)."""

    def convert(v: Any) -> Any:
        try:
            return parse(v)
        except PlacementError as exc:
            raise ValueError(str(exc).split(": ", 1)[-1]) from None

    return convert
