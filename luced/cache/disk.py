"""The prefix cache's disk tier: one safetensors file per snapshot in ``--kv-cache-dir``.

    DIR/                       --kv-cache-dir, shared by every model served from it
      <fingerprint>/           one model's snapshots (``model_dir_name``); other models'
                               directories are never read, moved or deleted
        .lock                  flock: one daemon per model directory
        3f9a0c12d4e1.safetensors       one snapshot, named by its entry id
        3f9a0c12d4e1.safetensors.tmp   a write in progress (deleted by ``scan`` after a crash)
        quarantine/            files that failed validation, moved aside with a warning
                               (the newest QUARANTINE_KEEP are kept)
        blocks/                block files (``cache/block_files.py``), not read here

The model directory, its lock and the quarantine are ``cache/files.py``'s.

Files of the old flat layout (``DIR/<id>.safetensors``) are moved into the directory of the
model their header names on first open (``migrate_flat``); one whose header cannot be read
goes to this model's ``quarantine/``.

Hostile contents: every file is read through ``open_regular`` (``O_NOFOLLOW``, must be a
regular file), directories are checked with ``lstat`` (``real_dir``: a symlinked
``quarantine/`` or model directory is refused, never followed), headers are bounded
(``_MAX_HEADER``) and parsed by ``_json``, which refuses nesting deeper than ``_MAX_DEPTH``,
NaN / Infinity and numbers past float range, so no byte pattern raises anything but
``SnapshotFileError`` and ``scan`` quarantines on any failure.

A file is a plain safetensors file: the snapshot's tensors (the model layout with the token
axis sized n; a recurrent layer's state, which has none, with a leading axis of one slot
per cut; bfloat16 stored as BF16, read back as uint16 bits) plus ``tokens`` (int32
``[n]``), and string metadata::

    format "luced-kv-snapshot"   format_version "3"   n_tokens   created (unix s)
    fingerprint   template_hash   placement   dtype   (must equal this daemon's identity)
    cuts   JSON list of restore points      crc32   JSON {tensor name: crc32 of its bytes}

Shape checks cannot see flipped bits in tensor data, so every tensor carries a CRC-32,
verified on each read (the token ids' already at ``scan``). The file's mtime is its last
use (bumped by ``touch``), so LRU order survives a restart.

Writes: temp file in the same directory, fsync, rename, fsync the directory: a visible
``*.safetensors`` file is always complete. ``scan`` validates every file (header, metadata,
identity, tensor set and shapes for its token count, offsets, file size); any failure moves
the file to ``quarantine/`` and logs a warning naming it and the reason.

Threads: ``write`` and ``read_into`` do blocking I/O and are meant for a worker thread
(``asyncio.to_thread``); the registry of files is guarded by a lock.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
import stat
import struct
import threading
import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
import safetensors

from luced.cache.arena import TOKENS, TOKENS_SPEC, check_layout
from luced.cache.files import QUARANTINE as QUARANTINE  # re-exported: callers import them here
from luced.cache.files import QUARANTINE_KEEP as QUARANTINE_KEEP
from luced.cache.files import SnapshotDirBusy as SnapshotDirBusy
from luced.cache.files import (
    SnapshotDirError,
    fsync_dir,
    lock_model_dir,
    model_dir_name,
    open_regular,
    quarantine,
    real_dir,
)
from luced.cache.layout import TensorSpec
from luced.ipc.regions import numpy_dtype

log = logging.getLogger(__name__)

FORMAT = "luced-kv-snapshot"
# 2: recurrent states ("conv.l", "delta.l", no token axis); 3: a state slot per cut point
# (format-2 states hold the end only: read as format 3 they would be misplaced, so quarantine)
FORMAT_VERSION = 3
SUFFIX = ".safetensors"
TMP_SUFFIX = ".tmp"
# Our headers hold ~2 entries per layer plus the cut list: tens of KiB. safetensors itself
# allows 100 MiB, which json would parse into ~1 GB of objects.
_MAX_HEADER = 8 << 20
_MAX_DEPTH = 8  # our header nests 3 deep ({name: {"shape": [...]}})
_STRINGS = re.compile(rb'"(?:[^"\\]|\\.)*"')
_ID_RE = re.compile(r"^[0-9a-f]{1,32}$")
_IDENTITY = ("fingerprint", "template_hash", "placement", "dtype")
_METADATA = ("format", "format_version", "n_tokens", "created", "cuts", "crc32", *_IDENTITY)

# luced dtype name -> safetensors header dtype
FILE_DTYPES = {
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "float64": "F64",
    "int8": "I8",
    "uint8": "U8",
    "int16": "I16",
    "uint16": "U16",
    "int32": "I32",
    "uint32": "U32",
    "int64": "I64",
}


class SnapshotFileError(Exception):
    """A snapshot file is unreadable, corrupt or another daemon's; the message says why."""


def _reject_constant(name: str) -> object:
    raise ValueError(f"{name} is not a number JSON allows")


def _finite_float(text: str) -> float:
    x = float(text)
    if not math.isfinite(x):
        raise ValueError(f"number {text[:20]} is out of range")
    return x


def _json(raw: bytes | str) -> object:
    """json.loads for untrusted bytes: ValueError (never RecursionError / OverflowError) for
    nesting deeper than _MAX_DEPTH, NaN / Infinity, floats past range, huge integers."""
    data = raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else raw
    # Depth without recursion: drop string bodies, then a running sum of brackets. An
    # unterminated string leaves its brackets counted, which can only over-count.
    marks = np.frombuffer(_STRINGS.sub(b'""', data), dtype=np.uint8)
    step = np.isin(marks, (ord("["), ord("{"))).astype(np.int32)
    step -= np.isin(marks, (ord("]"), ord("}")))
    if step.size and int(np.cumsum(step).max()) > _MAX_DEPTH:
        raise ValueError(f"JSON nested deeper than {_MAX_DEPTH}")
    try:
        return json.loads(data, parse_constant=_reject_constant, parse_float=_finite_float)
    except RecursionError:  # cannot happen past the depth check; kept as the invariant
        raise ValueError("JSON nested too deeply") from None


@dataclass(frozen=True)
class DiskIdentity:
    """What a file must match to be restored by this daemon."""

    fingerprint: str  # the model
    template_hash: str  # the chat template (cut points depend on it)
    placement: str  # shards and their layer ranges, as one string
    dtype: str  # the KV dtype


@dataclass
class DiskEntry:
    entry_id: str
    path: Path
    tokens: np.ndarray  # int32 [n], read-only
    cuts: tuple[int, ...]
    nbytes: int  # file size
    created: float
    last_used: float  # the file's mtime


@dataclass(frozen=True)
class _Parsed:
    n: int
    cuts: tuple[int, ...]
    created: float
    crcs: dict[str, int]
    spans: dict[str, tuple[int, int]]  # name -> absolute [begin, end) in the file
    size: int


class SnapshotDisk:
    """The files of one model's cache directory (see the module docstring)."""

    def __init__(
        self,
        directory: str | Path,
        identity: DiskIdentity,
        layout: Sequence[TensorSpec],
        *,
        lock_fd: int | None = None,
    ) -> None:
        """lock_fd: the lock `lock_model_dir` took already (the daemon takes it before the
        model load); this object owns it from here on."""
        check_layout(layout)
        if any(s.name == TOKENS for s in layout):
            raise ValueError(f"a layout tensor may not be called {TOKENS!r}")
        self.specs: tuple[TensorSpec, ...] = (*layout, TOKENS_SPEC)
        self.identity = identity
        self.root = Path(directory)
        self.dir = self.root / model_dir_name(identity.fingerprint)
        if lock_fd is None:
            lock_fd = lock_model_dir(self.root, identity.fingerprint)
        self._lock_fd: int | None = lock_fd
        self._files: dict[str, DiskEntry] = {}
        self._mutex = threading.Lock()
        try:
            self.migrate_flat()
        except BaseException:
            self.close()
            raise

    def migrate_flat(self) -> None:
        """Move snapshot files of the old flat layout (DIR/<id>.safetensors) into the
        directory of the model their header names; unreadable ones to our quarantine."""
        try:
            names = sorted(os.listdir(self.root))
        except OSError as e:
            raise SnapshotDirError(f"{self.root}: cannot list: {e}") from e
        for name in names:
            p = self.root / name
            if not name.endswith(SUFFIX) or not stat.S_ISREG(os.lstat(p).st_mode):
                continue
            try:
                meta = _read_header(p)[0].get("__metadata__")
                fingerprint = meta.get("fingerprint") if isinstance(meta, dict) else None
                if not isinstance(fingerprint, str) or not fingerprint:
                    raise SnapshotFileError(f"{name}: no fingerprint in its metadata")
                dest_dir = self.root / model_dir_name(fingerprint)
                real_dir(dest_dir, create=True)
                if os.path.lexists(dest_dir / name):
                    raise SnapshotFileError(f"{name}: {dest_dir / name} exists already")
                os.rename(p, dest_dir / name)
                log.info("prefix cache: moved %s of the flat layout to %s/", name, dest_dir)
            except FileNotFoundError:
                continue  # another daemon moved it first
            except (SnapshotFileError, SnapshotDirError, OSError) as e:
                self.quarantine(p, str(e))

    def path(self, entry_id: str) -> Path:
        if not _ID_RE.match(entry_id):
            raise ValueError(f"bad snapshot id {entry_id!r}: want 1-32 lowercase hex digits")
        return self.dir / f"{entry_id}{SUFFIX}"

    # -- registry -------------------------------------------------------------------------

    @property
    def used(self) -> int:
        """Bytes of the valid snapshot files."""
        with self._mutex:
            return sum(e.nbytes for e in self._files.values())

    def entries(self) -> list[DiskEntry]:
        with self._mutex:
            return list(self._files.values())

    def get(self, entry_id: str) -> DiskEntry | None:
        with self._mutex:
            return self._files.get(entry_id)

    def scan(self) -> list[DiskEntry]:
        """Validate every file of the directory; returns the valid ones (and registers them).

        Leftover temp files are deleted; invalid files are quarantined with a warning.
        """
        found: dict[str, DiskEntry] = {}
        for p in sorted(self.dir.iterdir()):
            try:
                mode = os.lstat(p).st_mode
            except OSError:
                continue
            if p.name.endswith(SUFFIX + TMP_SUFFIX) and not stat.S_ISDIR(mode):
                log.warning("prefix cache: deleting %s, a write interrupted by a crash", p)
                with contextlib.suppress(OSError):
                    p.unlink()  # a symlink is removed itself, never its target
                continue
            if not p.name.endswith(SUFFIX) or stat.S_ISDIR(mode):
                continue  # quarantine/, the lock, files that are not ours
            entry_id = p.name[: -len(SUFFIX)]
            try:
                if not _ID_RE.match(entry_id):
                    raise SnapshotFileError(
                        f"{p.name}: not a snapshot name (want <hex id>{SUFFIX})"
                    )
                if not stat.S_ISREG(mode):
                    raise SnapshotFileError(f"{p.name}: not a regular file (a symlink?)")
                found[entry_id] = self._load_entry(entry_id, p)
            except Exception as e:  # any byte pattern: quarantine, never stop the start-up
                reason = str(e) if isinstance(e, SnapshotFileError) else repr(e)[:200]
                self.quarantine(p, reason)
        with self._mutex:
            self._files = found
        return list(found.values())

    def _load_entry(self, entry_id: str, path: Path) -> DiskEntry:
        parsed, mtime = self._parse(path), 0.0
        begin, end = parsed.spans[TOKENS]
        try:
            with os.fdopen(open_regular(path), "rb") as f:
                f.seek(begin)
                raw = f.read(end - begin)
                mtime = os.fstat(f.fileno()).st_mtime
        except OSError as e:
            raise SnapshotFileError(f"{path.name}: cannot read: {e}") from e
        if len(raw) != end - begin:
            raise SnapshotFileError(f"{path.name}: truncated in tensor {TOKENS}")
        if zlib.crc32(raw) != parsed.crcs[TOKENS]:
            raise SnapshotFileError(f"{path.name}: tensor {TOKENS} fails its checksum (corrupt)")
        tokens = np.frombuffer(raw, dtype=np.int32).copy()
        tokens.flags.writeable = False
        return DiskEntry(entry_id, path, tokens, parsed.cuts, parsed.size, parsed.created, mtime)

    # -- file operations ------------------------------------------------------------------

    def write(
        self, entry_id: str, arrays: Mapping[str, np.ndarray], cuts: Sequence[int] = ()
    ) -> DiskEntry:
        """Write one snapshot (layout tensors + ``tokens``) durably; registers and returns it.

        ``arrays`` must be C-contiguous (arena views are); blocking (run it in a thread).
        A failure of the filesystem (a full disk) raises OSError with its errno.
        """
        final = self.path(entry_id)
        tokens = np.asarray(arrays[TOKENS])
        n = len(tokens)
        cut_list = sorted({int(c) for c in cuts if 0 < int(c) <= n} | {n})
        self._check_arrays(arrays, n, len(cut_list), "write", ValueError)
        crcs = {s.name: zlib.crc32(_bytes_of(arrays[s.name])) for s in self.specs}
        created = time.time()
        metadata = {
            "format": FORMAT,
            "format_version": str(FORMAT_VERSION),
            "n_tokens": str(n),
            "created": repr(created),
            "cuts": json.dumps(cut_list),
            "crc32": json.dumps(crcs, sort_keys=True),
            **{k: getattr(self.identity, k) for k in _IDENTITY},
        }
        # safetensors reads the data straight from these pointers; `arrays` keeps them alive.
        specs = {
            s.name: safetensors.TensorSpec(
                dtype=s.dtype,
                shape=list(arrays[s.name].shape),
                data_ptr=arrays[s.name].ctypes.data,
                data_len=arrays[s.name].nbytes,
            )
            for s in self.specs
        }
        tmp = final.with_name(final.name + TMP_SUFFIX)
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()  # so that a planted symlink is not written through
        try:
            _serialize(specs, tmp, metadata)
            fd = open_regular(tmp)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, final)
        except BaseException:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise
        fsync_dir(self.dir)
        st = final.stat()
        toks = tokens.astype(np.int32, copy=True)
        toks.flags.writeable = False
        entry = DiskEntry(entry_id, final, toks, tuple(cut_list), st.st_size, created, st.st_mtime)
        with self._mutex:
            self._files[entry_id] = entry
        return entry

    def read_into(self, path: str | Path, dest: Mapping[str, np.ndarray]) -> None:
        """Fill ``dest`` (every tensor of the file, e.g. arena views) from ``path``.

        Validates the file as ``scan`` does, the destination shapes and dtypes, the data
        length and every tensor's checksum. Any failure raises ``SnapshotFileError``; then
        ``dest`` holds garbage and must not be used.
        """
        path = Path(path)
        parsed = self._parse(path)
        # A file replaced since the scan may no longer fit the arrays sized from it.
        self._check_arrays(dest, parsed.n, len(parsed.cuts), path.name, SnapshotFileError)
        try:
            with os.fdopen(open_regular(path), "rb", buffering=0) as f:
                for name, (begin, _) in sorted(parsed.spans.items(), key=lambda kv: kv[1]):
                    buf = _bytes_of(dest[name])
                    f.seek(begin)
                    _read_exactly(f, buf, path.name, name)
                    if zlib.crc32(buf) != parsed.crcs[name]:
                        raise SnapshotFileError(
                            f"{path.name}: tensor {name} fails its checksum (corrupt data)"
                        )
        except OSError as e:
            raise SnapshotFileError(f"{path.name}: cannot read: {e}") from e

    def quarantine(self, path: str | Path, reason: str) -> None:
        """Move ``path`` to ``quarantine/`` (a numbered name if taken) and log why."""
        path = Path(path)
        with self._mutex:
            for entry_id, e in list(self._files.items()):
                if e.path == path:
                    del self._files[entry_id]
        quarantine(self.dir, path, reason, "snapshot file")

    def remove(self, entry_id: str) -> None:
        """Delete one snapshot file (missing is fine)."""
        with self._mutex:
            self._files.pop(entry_id, None)
        with contextlib.suppress(FileNotFoundError):
            self.path(entry_id).unlink()

    def touch(self, entry_id: str, when: float | None = None) -> None:
        """Record a use: the registry and the file's mtime (LRU across restarts)."""
        when = time.time() if when is None else when
        with self._mutex:
            e = self._files.get(entry_id)
            if e is None:
                return
            e.last_used = when
        with contextlib.suppress(OSError):
            os.utime(e.path, (when, when), follow_symlinks=False)

    def plan_eviction(self, budget: int, in_use: Callable[[str], bool]) -> list[str]:
        """Ids to delete, least recently used first, until the files fit ``budget`` bytes.

        Entries for which ``in_use(id)`` holds are skipped (may leave the tier over budget).
        """
        with self._mutex:
            files = sorted(self._files.values(), key=lambda e: (e.last_used, e.entry_id))
        total = sum(e.nbytes for e in files)
        out = []
        for e in files:
            if total <= budget:
                break
            if not in_use(e.entry_id):
                out.append(e.entry_id)
                total -= e.nbytes
        return out

    def evict_to(self, budget: int, in_use: Callable[[str], bool] = lambda _: False) -> list[str]:
        """Delete LRU files until under ``budget`` (skipping ``in_use``); returns their ids."""
        victims = self.plan_eviction(budget, in_use)
        for entry_id in victims:
            self.remove(entry_id)
        return victims

    def close(self) -> None:
        """Release the directory lock."""
        fd, self._lock_fd = self._lock_fd, None
        if fd is not None:
            os.close(fd)  # closing drops the flock

    # -- validation -----------------------------------------------------------------------

    def _check_arrays(
        self,
        arrays: Mapping[str, np.ndarray],
        n: int,
        n_cuts: int,
        what: str,
        error: type[Exception],
    ) -> None:
        want = {s.name for s in self.specs}
        if set(arrays) != want:
            missing, extra = sorted(want - set(arrays)), sorted(set(arrays) - want)
            raise error(f"{what}: tensors missing {missing}, unexpected {extra}")
        for s in self.specs:
            a = arrays[s.name]
            shape, dt = s.shape_for(n, n_cuts), numpy_dtype(s.dtype)
            if a.shape != shape or a.dtype != dt or not a.flags.c_contiguous:
                raise error(
                    f"{what}: tensor {s.name} must be C-contiguous {dt} {list(shape)}, "
                    f"got {a.dtype} {list(a.shape)}"
                )

    def _parse(self, path: Path) -> _Parsed:
        """Header, metadata, identity, tensor table, file size; raises SnapshotFileError."""
        name = path.name
        header, hlen, size = _read_header(path)
        meta = header.pop("__metadata__", None)
        n, cuts, created, crcs = self._check_metadata(name, meta)
        spans = self._check_tensors(name, header, n, len(cuts), 8 + hlen, size)
        if set(crcs) != set(spans):
            raise SnapshotFileError(f"{name}: checksums do not name exactly the tensors")
        return _Parsed(n, cuts, created, crcs, spans, size)

    def _check_metadata(
        self, name: str, meta: object
    ) -> tuple[int, tuple[int, ...], float, dict[str, int]]:
        if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
            raise SnapshotFileError(f"{name}: no luced metadata")
        missing = [k for k in _METADATA if k not in meta]
        if meta.get("format") != FORMAT or missing:
            raise SnapshotFileError(f"{name}: not a luced snapshot (metadata lacks {missing})")
        if meta["format_version"] != str(FORMAT_VERSION):
            raise SnapshotFileError(
                f"{name}: format version {meta['format_version']}, this build reads "
                f"{FORMAT_VERSION}"
            )
        for k in _IDENTITY:
            ours = getattr(self.identity, k)
            if meta[k] != ours:
                raise SnapshotFileError(
                    f"{name}: {k} {_short(meta[k])!r} is not this daemon's {_short(ours)!r}"
                )
        try:
            if not re.fullmatch(r"[0-9]{1,9}", meta["n_tokens"]):
                raise ValueError(f"n_tokens {_short(meta['n_tokens'], 20)!r}")
            n = int(meta["n_tokens"])
            cut_list = _json(meta["cuts"])
            if not isinstance(cut_list, list) or not all(type(c) is int for c in cut_list):
                raise ValueError("cuts is not a list of integers")
            cuts = tuple(cut_list)
            created = _finite_float(meta["created"])
            crc_map = _json(meta["crc32"])
            if not isinstance(crc_map, dict) or not all(
                type(v) is int and 0 <= v < 1 << 32 for v in crc_map.values()
            ):
                raise ValueError("crc32 is not a map of 32-bit checksums")
            crcs = dict(crc_map)
        except (ValueError, TypeError, OverflowError) as e:
            raise SnapshotFileError(f"{name}: malformed metadata ({e})") from None
        ordered = list(cuts) == sorted(set(cuts))  # slot i of a state is the i-th cut
        if n < 1 or not cuts or not all(0 < c <= n for c in cuts) or cuts[-1] != n or not ordered:
            raise SnapshotFileError(f"{name}: bad token count {n} or cuts {list(cuts)}")
        return n, cuts, created, crcs

    def _check_tensors(
        self,
        name: str,
        header: dict[str, object],
        n: int,
        n_cuts: int,
        data_start: int,
        size: int,
    ) -> dict[str, tuple[int, int]]:
        want = {s.name: s for s in self.specs}
        if set(header) != set(want):
            missing, extra = sorted(set(want) - set(header)), sorted(set(header) - set(want))
            raise SnapshotFileError(
                f"{name}: tensors differ from this model's layout (missing {missing[:4]}, "
                f"unexpected {extra[:4]})"
            )
        spans: dict[str, tuple[int, int]] = {}
        for tname, spec in want.items():
            info = header[tname]
            shape = spec.shape_for(n, n_cuts)
            ok = (
                isinstance(info, dict)
                and info.get("dtype") == FILE_DTYPES[spec.dtype]
                and info.get("shape") == list(shape)
                and isinstance(offs := info.get("data_offsets"), list)
                and len(offs) == 2
                and all(type(o) is int for o in offs)
            )
            if not ok:
                raise SnapshotFileError(
                    f"{name}: tensor {tname} is {_short(json.dumps(info))}, expected "
                    f"{FILE_DTYPES[spec.dtype]} {list(shape)}"
                )
            begin, end = info["data_offsets"]  # type: ignore[index]
            if end - begin != spec.nbytes(n, n_cuts) or begin < 0:
                raise SnapshotFileError(f"{name}: tensor {tname} has bad data offsets")
            spans[tname] = (data_start + begin, data_start + end)
        # The data must tile [data_start, size) exactly: no gap, no overlap, nothing missing.
        pos = data_start
        for begin, end in sorted(spans.values()):
            if begin != pos:
                raise SnapshotFileError(f"{name}: tensor data overlaps or leaves a gap")
            pos = end
        if pos != size:
            what = "truncated" if pos > size else "has trailing bytes"
            raise SnapshotFileError(f"{name}: {what} ({size} bytes, the header says {pos})")
        return spans


def _serialize(specs: dict, path: Path, metadata: dict[str, str]) -> None:
    """safetensors.serialize_file, its I/O errors as the OSError they are: it reports a
    full disk as SafetensorError("... I/O error: No space left on device (os error 28)")."""
    try:
        safetensors.serialize_file(specs, str(path), metadata)
    except safetensors.SafetensorError as exc:
        found = re.search(r"\(os error (\d+)\)", str(exc))
        if found is None:
            raise
        code = int(found.group(1))
        raise OSError(code, os.strerror(code), str(path)) from exc


def _read_header(path: Path) -> tuple[dict, int, int]:
    """(header object, header length, file size) of a safetensors file; SnapshotFileError
    for anything else, whatever the bytes."""
    name = path.name
    try:
        with os.fdopen(open_regular(path), "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            if len(head) < 8:
                raise SnapshotFileError(f"{name}: truncated ({size} bytes, no header)")
            (hlen,) = struct.unpack("<Q", head)
            if hlen > min(_MAX_HEADER, size - 8):
                raise SnapshotFileError(
                    f"{name}: truncated, not safetensors or a header over {_MAX_HEADER >> 20} "
                    f"MiB (header of {hlen} bytes, file of {size})"
                )
            raw = f.read(hlen)
    except OSError as e:
        raise SnapshotFileError(f"{name}: cannot read: {e}") from e
    try:
        header = _json(raw)
    except ValueError as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise SnapshotFileError(f"{name}: header is not JSON we accept ({e})") from None
    if not isinstance(header, dict):
        raise SnapshotFileError(f"{name}: header is not a JSON object")
    return header, hlen, size


def _bytes_of(a: np.ndarray) -> memoryview:
    """The bytes of a C-contiguous array (no copy)."""
    return memoryview(a).cast("B")


def _read_exactly(f: BinaryIO, buf: memoryview, file: str, tensor: str) -> None:
    got = 0
    while got < len(buf):
        k = f.readinto(buf[got:])
        if not k:
            raise SnapshotFileError(f"{file}: truncated in tensor {tensor}")
        got += k


def _short(s: str, limit: int = 80) -> str:
    return s if len(s) <= limit else s[: limit - 3] + "..."
