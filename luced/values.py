"""The scalar values of luced's options (the daemon's ``serve.options``, the remote
worker's flags in ``runtime.listen``): each converter returns the typed value, or raises
ValueError(reason) that the option's label prefixes."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any


def to_int(v: Any) -> int:
    if isinstance(v, bool):
        raise ValueError(f"not an integer: {v!r}")
    if isinstance(v, int):
        return v
    if isinstance(v, str):
        try:
            return int(v.strip())
        except ValueError:
            pass
    raise ValueError(f"not an integer: {v!r}")


BYTE_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def to_bytes(v: Any) -> int:
    """A byte count: an integer, or a number with a binary unit ("512M", "1.5G", "2GiB")."""
    if isinstance(v, str):
        m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([kmgt]?)(?:i?b)?\s*", v.lower())
        if m is None:
            raise ValueError(f"not a byte count (e.g. 4096, 512M, 2G): {v!r}")
        return int(float(m[1]) * BYTE_UNITS[m[2]])
    return to_int(v)


def to_float(v: Any) -> float:
    if isinstance(v, bool):
        raise ValueError(f"not a number: {v!r}")
    try:
        x = float(v.strip() if isinstance(v, str) else v)
    except (TypeError, ValueError):
        raise ValueError(f"not a number: {v!r}") from None
    if not math.isfinite(x):
        raise ValueError(f"not a finite number: {v!r}")
    return x


def to_str(v: Any) -> str:
    if not isinstance(v, str):
        raise ValueError(f"not a string: {v!r}")
    if not v:
        raise ValueError("empty string")
    return v


def to_bool(v: Any) -> bool:
    if isinstance(v, bool):
        return v
    if isinstance(v, str) and v.strip().lower() in ("1", "true", "yes", "on"):
        return True
    if isinstance(v, str) and v.strip().lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a boolean (true / false): {v!r}")


def to_strs(v: Any) -> tuple[str, ...]:
    """A list of names: "a,b" (flag, env) or a TOML array of strings."""
    items = v.split(",") if isinstance(v, str) else v
    if not isinstance(items, list | tuple):
        raise ValueError(f"not a list of strings: {v!r}")
    return tuple(to_str(s.strip() if isinstance(s, str) else s) for s in items if s != "")


def to_path(v: Any) -> Path:
    if isinstance(v, Path):
        return v
    return Path(to_str(v)).expanduser()
