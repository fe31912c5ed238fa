"""A model file's identity: its size and SHA-256, by which a remote host finds its own copy.

The daemon names files by its own paths (``load``'s model, ``load_draft``'s path). A worker
on another host holds copies, maybe elsewhere, and learns in ``hello`` which of the
daemon's paths is which identity; a copy of another size or hash is refused there, with
both identities in the message. A directory (a safetensors draft) is its files in name
order: each relative name and content go into one hash, and its size is their sum.

Hashing reads the whole file (about 1 GB/s): the result is kept per (path, size, mtime,
inode), so a process hashes a file once.
"""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path

from luced.ipc.frames import FileIdentity

_CHUNK = 8 << 20


def identify(path: str | Path) -> FileIdentity:
    """Size and SHA-256 of a file or a directory's files (OSError when unreadable)."""
    p = Path(path).resolve()
    files = sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else [p]
    stamps = tuple((str(f), *_stamp(f)) for f in files)
    return _identity(str(p), p.is_dir(), stamps)


def _stamp(f: Path) -> tuple[int, int, int]:
    st = os.stat(f)
    return st.st_size, st.st_mtime_ns, st.st_ino


@functools.lru_cache(maxsize=64)
def _identity(
    root: str, is_dir: bool, stamps: tuple[tuple[str, int, int, int], ...]
) -> FileIdentity:
    digest = hashlib.sha256()
    for name, *_ in stamps:
        if is_dir:
            digest.update(os.path.relpath(name, root).encode() + b"\0")
        with open(name, "rb") as fh:
            while chunk := fh.read(_CHUNK):
                digest.update(chunk)
    return FileIdentity(size=sum(s[1] for s in stamps), sha256=digest.hexdigest())
