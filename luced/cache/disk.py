"""The prefix cache's disk tier: one safetensors file per snapshot in ``--kv-cache-dir``.

    DIR/
      .lock                    flock: one daemon per directory
      3f9a0c12d4e1.safetensors one snapshot, named by its entry id
      3f9a0c12d4e1.safetensors.tmp   a write in progress (deleted by ``scan`` after a crash)
      quarantine/              files that failed validation, moved aside with a warning
                               (the newest QUARANTINE_KEEP are kept)

A file is a plain safetensors file: the snapshot's tensors (the model layout with the token
axis sized n; a recurrent layer's state, which has none, at its own shape; bfloat16 stored
as BF16, read back as uint16 bits) plus ``tokens`` (int32 ``[n]``), and string metadata::

    format "luced-kv-snapshot"   format_version "2"   n_tokens   created (unix s)
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
import fcntl
import json
import logging
import os
import re
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
from luced.cache.layout import TensorSpec
from luced.ipc.regions import numpy_dtype

log = logging.getLogger(__name__)

FORMAT = "luced-kv-snapshot"
FORMAT_VERSION = 2  # 2: recurrent states ("conv.l", "delta.l", no token axis)
SUFFIX = ".safetensors"
TMP_SUFFIX = ".tmp"
QUARANTINE = "quarantine"
QUARANTINE_KEEP = 16  # newest quarantined files kept for inspection; older ones are deleted
LOCK_NAME = ".lock"
_MAX_HEADER = 100 << 20  # safetensors' own header limit
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


class SnapshotDirError(Exception):
    """The cache directory cannot be used (e.g. another daemon holds it)."""


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
    """The files of one cache directory (see the module docstring)."""

    def __init__(
        self, directory: str | Path, identity: DiskIdentity, layout: Sequence[TensorSpec]
    ) -> None:
        check_layout(layout)
        if any(s.name == TOKENS for s in layout):
            raise ValueError(f"a layout tensor may not be called {TOKENS!r}")
        self.specs: tuple[TensorSpec, ...] = (*layout, TOKENS_SPEC)
        self.identity = identity
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._lock_fd: int | None = os.open(self.dir / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            self._lock_fd = None
            raise SnapshotDirError(f"{self.dir} is in use by another luced daemon") from None
        self._files: dict[str, DiskEntry] = {}
        self._mutex = threading.Lock()

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
            if p.name.endswith(SUFFIX + TMP_SUFFIX) and p.is_file():
                log.warning("prefix cache: deleting %s, a write interrupted by a crash", p)
                with contextlib.suppress(OSError):
                    p.unlink()
                continue
            if not p.name.endswith(SUFFIX) or not p.is_file():
                continue  # quarantine/, the lock, files that are not ours
            entry_id = p.name[: -len(SUFFIX)]
            try:
                if not _ID_RE.match(entry_id):
                    raise SnapshotFileError(
                        f"{p.name}: not a snapshot name (want <hex id>{SUFFIX})"
                    )
                found[entry_id] = self._load_entry(entry_id, p)
            except SnapshotFileError as e:
                self.quarantine(p, str(e))
        with self._mutex:
            self._files = found
        return list(found.values())

    def _load_entry(self, entry_id: str, path: Path) -> DiskEntry:
        parsed, mtime = self._parse(path), 0.0
        begin, end = parsed.spans[TOKENS]
        try:
            with path.open("rb") as f:
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
        """
        final = self.path(entry_id)
        tokens = np.asarray(arrays[TOKENS])
        n = len(tokens)
        self._check_arrays(arrays, n, "write", ValueError)
        crcs = {s.name: zlib.crc32(_bytes_of(arrays[s.name])) for s in self.specs}
        cut_list = sorted({int(c) for c in cuts if 0 < int(c) <= n} | {n})
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
        try:
            safetensors.serialize_file(specs, str(tmp), metadata)
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, final)
        except BaseException:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise
        self._fsync_dir()
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
        self._check_arrays(dest, parsed.n, path.name, SnapshotFileError)
        try:
            with path.open("rb", buffering=0) as f:
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
        qdir = self.dir / QUARANTINE
        reason = reason.removeprefix(f"{path.name}: ")  # the log names the file anyway
        with self._mutex:
            for entry_id, e in list(self._files.items()):
                if e.path == path:
                    del self._files[entry_id]
        try:
            qdir.mkdir(exist_ok=True)
            dest = qdir / path.name
            i = 1
            while dest.exists():
                dest = qdir / f"{path.name}.{i}"
                i += 1
            os.replace(path, dest)
            os.utime(dest)  # its quarantine time: the pruning below keeps the newest
            _prune(qdir, QUARANTINE_KEEP)
        except OSError as e:
            log.warning(
                "prefix cache: skipping snapshot file %s (%s); cannot quarantine it: %s",
                path,
                reason,
                e,
            )
            return
        log.warning("prefix cache: skipping snapshot file %s (%s); moved to %s", path, reason, dest)

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
            os.utime(e.path, (when, when))

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
        self, arrays: Mapping[str, np.ndarray], n: int, what: str, error: type[Exception]
    ) -> None:
        want = {s.name for s in self.specs}
        if set(arrays) != want:
            missing, extra = sorted(want - set(arrays)), sorted(set(arrays) - want)
            raise error(f"{what}: tensors missing {missing}, unexpected {extra}")
        for s in self.specs:
            a = arrays[s.name]
            shape, dt = s.shape_for(n), numpy_dtype(s.dtype)
            if a.shape != shape or a.dtype != dt or not a.flags.c_contiguous:
                raise error(
                    f"{what}: tensor {s.name} must be C-contiguous {dt} {list(shape)}, "
                    f"got {a.dtype} {list(a.shape)}"
                )

    def _parse(self, path: Path) -> _Parsed:
        """Header, metadata, identity, tensor table, file size; raises SnapshotFileError."""
        name = path.name
        try:
            with path.open("rb") as f:
                size = os.fstat(f.fileno()).st_size
                head = f.read(8)
                if len(head) < 8:
                    raise SnapshotFileError(f"{name}: truncated ({size} bytes, no header)")
                (hlen,) = struct.unpack("<Q", head)
                if hlen > min(_MAX_HEADER, size - 8):
                    raise SnapshotFileError(
                        f"{name}: truncated or not safetensors (header of {hlen} bytes, "
                        f"file of {size})"
                    )
                raw = f.read(hlen)
        except OSError as e:
            raise SnapshotFileError(f"{name}: cannot read: {e}") from e
        try:
            header = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise SnapshotFileError(f"{name}: header is not JSON ({e})") from None
        if not isinstance(header, dict):
            raise SnapshotFileError(f"{name}: header is not a JSON object")
        meta = header.pop("__metadata__", None)
        n, cuts, created, crcs = self._check_metadata(name, meta)
        spans = self._check_tensors(name, header, n, 8 + hlen, size)
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
            n = int(meta["n_tokens"])
            cuts = tuple(int(c) for c in json.loads(meta["cuts"]))
            created = float(meta["created"])
            crcs = {str(k): int(v) for k, v in json.loads(meta["crc32"]).items()}
        except (ValueError, TypeError, AttributeError) as e:
            raise SnapshotFileError(f"{name}: malformed metadata ({e})") from None
        if n < 1 or not cuts or not all(0 < c <= n for c in cuts) or n not in cuts:
            raise SnapshotFileError(f"{name}: bad token count {n} or cuts {list(cuts)}")
        return n, cuts, created, crcs

    def _check_tensors(
        self, name: str, header: dict[str, object], n: int, data_start: int, size: int
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
            shape = spec.shape_for(n)
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
            if end - begin != spec.nbytes(n) or begin < 0:
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

    def _fsync_dir(self) -> None:
        fd = os.open(self.dir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _prune(qdir: Path, keep: int) -> None:
    """Delete all but the `keep` most recently quarantined files (the directory would
    otherwise grow without bound outside the budget, e.g. when models alternate)."""
    files = sorted(qdir.iterdir(), key=lambda p: (p.stat().st_mtime_ns, p.name), reverse=True)
    for old in files[keep:]:
        with contextlib.suppress(OSError):
            old.unlink()


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
