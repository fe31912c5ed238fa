"""The prefix cache's disk tier of K/V blocks: one file per block, named by its prefix key;
and of a hybrid's recurrent states at block ends (`STATE_FILES`: the state after a block, named
by that block's key, in files of their own kind beside the blocks).

A block is ``block`` positions of one worker's K/V: one host record (``engine/kv/host.py``,
``LoadReply.kv_record_bytes`` bytes: one pool block of every layer the worker stores).
Its key names the whole prefix up to and including it, so a prompt's blocks are found by
hashing the prompt, never by a search (as vLLM's prefix caching)::

    key 0 = blake2b-128(ROOT_KEY || tokens[0:block] as int32 LE)
    key i = blake2b-128(key i-1  || tokens[i*block:(i+1)*block])

Layout (``cache/files.py`` owns the model directory, its lock and the quarantine)::

    DIR/<model>/blocks/<part>/              one worker's record layout: "b16-bf16-L0-30"
        5f0c...e1.kvb                       one block, named by its key (32 hex digits)
        5f0c...e1-<rand>.kvb.tmp            a write in progress (deleted by ``scan``)
        5f0c...e1.kvs                       the recurrent state after that block (`STATE_FILES`)
    DIR/<model>/quarantine/                 files that failed validation

File (little endian; ``_HEADER``; a state file alike, its magic b"LUCEKVS1", its record
one state record of the worker: ``LoadReply.kv_state_bytes``)::

    offset  size
         0     8   magic b"LUCEKVB1"
         8     4   u32 format version (1)
        12     4   u32 block rows (this part's block)
        16     8   u64 record bytes (this part's record)
        24    16   parent key (ROOT_KEY for a prompt's first block)
        40    16   key = blake2b-128(parent || tokens)
        56     4   u32 n tokens (== block rows)
        60     4   u32 CRC-32 of the tokens section
        64     4   u32 CRC-32 of the data section
        68     4   u32 part length p (at most 64)
        72     p   the part string (ASCII; must equal this directory's)
      72+p   4*n   tokens, int32
    72+p+4n   rec   the record's bytes

Validation: ``scan`` reads the header and the tokens of every file (magic, version,
block, record bytes, part, the exact file size, the tokens' CRC, key == block_key(parent,
tokens), name == key hex); ``read_into`` checks them again and the data's CRC. A failure
moves the file to ``quarantine/`` with one warning naming it and the reason, and the index
forgets it. Every file is opened ``O_NOFOLLOW`` and must be a regular file.

Writes: a temp file in the same directory (``O_EXCL``, a unique name: two threads may
write one key), fsync, rename, fsync the directory: a visible ``*.kvb`` is complete. A
file's mtime is its last use (``touch``), so the LRU order survives a restart; past
``max_bytes`` a write evicts the least recently used files (never the one it wrote).

Threads: ``write`` and ``read_into`` block on I/O and are meant for worker threads; the
index (an LRU-ordered dict) is guarded by a lock. ``scan`` replaces the index: run it at
start-up, before writes. Snapshot files (``*.safetensors`` in the model directory) are
``cache/disk.py``'s and never touched here. One ``BlockFiles`` keeps one kind (`FileKind`:
`BLOCK_FILES` or `STATE_FILES`) of one part, and passes over the other kind's files.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import secrets
import struct
import threading
import time
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

import numpy as np

from luced.cache.files import (
    NAME_RE,
    SnapshotDirError,
    fsync_dir,
    model_dir_name,
    open_regular,
    quarantine,
    real_dir,
)

log = logging.getLogger(__name__)

BLOCK_KEY_BYTES = 16
ROOT_KEY = bytes(BLOCK_KEY_BYTES)  # the parent of a prompt's first block
FORMAT_VERSION = 1
BLOCKS = "blocks"  # DIR/<model>/blocks/<part>/
# dtype names as part names spell them (`b16-f32-...`)
SHORT_DTYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}
_HEADER = struct.Struct("<8sIIQ16s16sIIII")  # the module docstring's first 72 bytes
_MAX_PART = 64
_INT32 = np.iinfo(np.int32)


@dataclass(frozen=True)
class FileKind:
    """What one ``BlockFiles`` keeps: its files' magic and suffix, and what to call one."""

    magic: bytes
    suffix: str
    noun: str

    @property
    def tmp_suffix(self) -> str:
        return f"{self.suffix}.tmp"

    def is_name(self, name: str) -> bool:
        """Whether `name` is a file of this kind's: <key hex><suffix>."""
        key, suffix = name[: -len(self.suffix)], name[-len(self.suffix) :]
        return suffix == self.suffix and bool(_KEY_HEX.fullmatch(key))


_KEY_HEX = re.compile(r"[0-9a-f]{32}")
BLOCK_FILES = FileKind(b"LUCEKVB1", ".kvb", "block file")
STATE_FILES = FileKind(b"LUCEKVS1", ".kvs", "state file")  # a hybrid's state after a block
MAGIC, SUFFIX = BLOCK_FILES.magic, BLOCK_FILES.suffix


def block_key(parent: bytes, tokens: Sequence[int]) -> bytes:
    """Key of a block = blake2b-128 over parent key + the block's token ids as int32 LE. A
    key names the whole prefix up to and including this block (as vLLM's prefix-caching
    hashes)."""
    return _hash(parent, _int32_le(tokens).tobytes())


def file_size(part: str, block: int, record_bytes: int) -> int:
    """Bytes of one block file of `part` (the module docstring's layout)."""
    return _HEADER.size + len(part.encode()) + 4 * block + record_bytes


def prompt_keys(tokens: Sequence[int], block: int, limit: int | None = None) -> list[bytes]:
    """Keys of tokens' whole blocks of `block` tokens, in order (at most `limit`)."""
    return list(_keys(_int32_le(tokens), block, limit))


def block_tokens(tokens: Sequence[int], block: int, i: int) -> tuple[int, ...]:
    """The ids of block i of `tokens` (what its key hashes with its parent's)."""
    return tuple(int(x) for x in tokens[i * block : (i + 1) * block])


class Hashed(Protocol):
    """What a key was hashed from: a block file, or a block (or state) held in memory."""

    @property
    def parent(self) -> bytes: ...

    @property
    def tokens(self) -> tuple[int, ...]: ...


def found(
    memory: Hashed | None,
    parts: Sequence[BlockFiles],
    key: bytes,
    parent: bytes,
    tokens: tuple[int, ...],
) -> bool:
    """Whether `key`, hashed from `parent` and `tokens`, is in memory (`memory`: what is
    held there by the key) or in every part (one at least): compared, so a key collision
    never matches."""
    if memory is not None and memory.parent == parent and memory.tokens == tokens:
        return True
    files = [p.get(key) for p in parts]
    return bool(files) and all(
        f is not None and f.parent == parent and f.tokens == tokens for f in files
    )


def read_parts(parts: Sequence[BlockFiles], rows: Sequence[np.ndarray], key: bytes) -> None:
    """Fill each part's row (a worker's bytes of one record) from its file of `key`, then
    mark the use; BlockFileError at the first that fails (quarantined by its part). A
    thread's work."""
    for part, row in zip(parts, rows, strict=True):
        part.read_into(key, memoryview(row))
    for part in parts:
        part.touch(key)


def write_parts(
    parts: Sequence[BlockFiles], rows: Sequence[np.ndarray], parent: bytes, tokens: Sequence[int]
) -> None:
    """Write each part's row (a worker's bytes of one record) as its file of the key of
    `parent` and `tokens`. A thread's work; OSError when the OS refuses."""
    for part, row in zip(parts, rows, strict=True):
        part.write(parent, tokens, row)


def _keys(ids: np.ndarray, block: int, limit: int | None) -> Iterator[bytes]:
    """prompt_keys, lazily: a lookup that stops early hashes no further."""
    if block < 1:
        raise ValueError(f"block must be positive, got {block}")
    n = len(ids) // block
    if limit is not None:
        n = min(n, max(limit, 0))
    raw, step, parent = ids.tobytes(), 4 * block, ROOT_KEY
    for i in range(n):
        parent = _hash(parent, raw[step * i : step * (i + 1)])
        yield parent


@dataclass(frozen=True)
class BlockFile:
    key: bytes
    parent: bytes
    tokens: tuple[int, ...]  # the block's token ids (len == block)
    nbytes: int  # file size
    used: float  # last use (the file's mtime: LRU survives a restart)


class BlockFileError(Exception):
    """A block cannot be read: its file failed validation (then it was quarantined) or is
    gone; either way the index forgot it. The message names the file and says why."""


@dataclass(frozen=True)
class _Head:
    file: BlockFile
    data_at: int  # where the record's bytes start
    data_crc: int


class BlockFiles:
    """The block files (or state files) of one worker's part of one model (the module
    docstring)."""

    def __init__(
        self,
        root: str | Path,
        fingerprint: str,
        part: str,
        record_bytes: int,
        block: int,
        max_bytes: int,
        *,
        lock_fd: int | None = None,
        kind: FileKind = BLOCK_FILES,
        on_drop: Callable[[bytes], None] | None = None,
    ) -> None:
        """Files of one worker's part of one model's blocks:
        DIR/<model_dir_name(fingerprint)>/blocks/<part>/<key hex>.kvb.

        part names the record layout, e.g. "b16-bf16-L0-30" (block rows, KV dtype, the
        worker's layer range); the caller builds it. lock_fd: the lock ``lock_model_dir``
        took, which this object owns from here on (``close`` releases it); None means the
        caller holds the model directory's lock (one daemon per model directory: the
        snapshot tier or the first part's BlockFiles took it). kind: blocks, or a hybrid's
        recurrent states (`STATE_FILES`: record_bytes is one state record of the worker).
        on_drop: told each key the index loses on its own (evicted past max_bytes, found
        gone or bad; not ``remove`` or ``clear``), under the index's lock: keep it short.
        """
        if not NAME_RE.match(part) or len(part) > _MAX_PART:
            raise ValueError(f"bad part name {part!r}: want 1-64 of [0-9A-Za-z._-]")
        if record_bytes < 1 or block < 1 or max_bytes < 0:
            raise ValueError(
                f"record_bytes {record_bytes} and block {block} must be positive, "
                f"max_bytes {max_bytes} not negative"
            )
        self.part = part
        self.kind = kind
        self.record_bytes = record_bytes
        self.block = block
        self.max_bytes = max_bytes
        self.model_dir = Path(root) / model_dir_name(fingerprint)
        self.dir = self.model_dir / BLOCKS / part
        self._lock_fd = lock_fd
        self._on_drop = on_drop
        self._part = part.encode()
        self._file_bytes = file_size(part, block, record_bytes)
        self._files: OrderedDict[bytes, BlockFile] = OrderedDict()  # least recently used first
        self._used = 0
        self._mutex = threading.Lock()
        try:
            Path(root).mkdir(parents=True, exist_ok=True)  # the operator's path
            for d in (self.model_dir, self.model_dir / BLOCKS, self.dir):
                real_dir(d, create=True)  # never through a symlink
        except OSError as e:
            self.close()
            raise SnapshotDirError(f"{self.dir}: {e.strerror or e}") from e
        except BaseException:
            self.close()
            raise

    # -- the index ------------------------------------------------------------------------

    @property
    def used_bytes(self) -> int:
        """Bytes of the indexed files."""
        with self._mutex:
            return self._used

    def __len__(self) -> int:
        with self._mutex:
            return len(self._files)

    def get(self, key: bytes) -> BlockFile | None:
        with self._mutex:
            return self._files.get(key)

    def has(self, key: bytes) -> bool:
        with self._mutex:
            return key in self._files

    def files(self) -> list[BlockFile]:
        """Every indexed file, least recently used first."""
        with self._mutex:
            return list(self._files.values())

    def chain(self, tokens: Sequence[int], limit: int | None = None) -> list[bytes]:
        """Keys of tokens' whole blocks present here consecutively from the first (at most
        `limit`), stopping at the first one missing. Each file's parent and tokens are
        compared with the prompt's, so a key collision never matches."""
        ids = _int32_le(tokens)
        out: list[bytes] = []
        parent = ROOT_KEY
        with self._mutex:
            for i, key in enumerate(_keys(ids, self.block, limit)):
                f = self._files.get(key)
                want = tuple(ids[i * self.block : (i + 1) * self.block].tolist())
                if f is None or f.parent != parent or f.tokens != want:
                    break
                out.append(key)
                parent = key
        return out

    def scan(self) -> int:
        """Index every file (headers and the tokens' CRC; the LRU order from the mtimes);
        returns how many. Temp files are deleted, bad files quarantined; then the least
        recently used past max_bytes are evicted."""
        found: list[BlockFile] = []
        with os.scandir(self.dir) as it:
            entries = sorted(it, key=lambda e: e.name)  # listed first: scan moves files
        for entry in entries:
            name, path = entry.name, Path(entry.path)
            is_dir = entry.is_dir(follow_symlinks=False)
            if name.endswith(self.kind.tmp_suffix) and not is_dir:
                log.warning("prefix cache: deleting %s, a write interrupted by a crash", path)
                with contextlib.suppress(OSError):
                    path.unlink()  # a symlink is removed itself, never its target
                continue
            if not name.endswith(self.kind.suffix) or is_dir:
                continue  # not ours
            try:
                if not self.kind.is_name(name):
                    want = f"<key hex>{self.kind.suffix}"
                    raise BlockFileError(f"{name}: not a {self.kind.noun} name (want {want})")
                if not entry.is_file(follow_symlinks=False):
                    raise BlockFileError(f"{name}: not a regular file (a symlink?)")
                fd = open_regular(path)
                try:
                    found.append(self._head(fd, name).file)
                finally:
                    os.close(fd)
            except Exception as e:  # any byte pattern: quarantine, never stop the start-up
                reason = str(e) if isinstance(e, (BlockFileError, OSError)) else repr(e)[:200]
                self._quarantine(path, reason)
        found.sort(key=lambda f: (f.used, f.key))
        with self._mutex:
            self._files = OrderedDict((f.key, f) for f in found)
            self._used = sum(f.nbytes for f in found)
            victims = self._evict(keep=None)
        if victims:
            log.info(
                "prefix cache: %d block files of %s past its %d bytes deleted",
                victims,
                self.dir,
                self.max_bytes,
            )
        return len(found) - victims

    # -- file operations ------------------------------------------------------------------

    def write(self, parent: bytes, tokens: Sequence[int], data: memoryview | bytes) -> bytes:
        """Write one block durably; returns its key. A key present already is only touched.
        Then evicts the least recently used files past max_bytes (never this one). Blocking
        (run it in a thread); a failure of the filesystem (a full disk) raises its OSError
        and leaves no file behind."""
        ids = _int32_le(tokens)
        if len(ids) != self.block:
            raise ValueError(f"a block holds {self.block} tokens, got {len(ids)}")
        view = _bytes_view(data)
        if view.nbytes != self.record_bytes:
            raise ValueError(f"a record is {self.record_bytes} bytes, got {view.nbytes}")
        raw_tokens = ids.tobytes()
        key = _hash(parent, raw_tokens)
        if self.touch(key):  # present already (a file found gone is written again)
            return key
        head = _HEADER.pack(
            self.kind.magic,
            FORMAT_VERSION,
            self.block,
            self.record_bytes,
            parent,
            key,
            self.block,
            zlib.crc32(raw_tokens),
            zlib.crc32(view),
            len(self._part),
        )
        final = self._path(key)
        tmp = self.dir / f"{key.hex()}-{secrets.token_hex(4)}{self.kind.tmp_suffix}"
        written = tmp
        try:
            fd = os.open(
                tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
            )
            try:
                _write_all(fd, (head, self._part, raw_tokens, view))
                os.fsync(fd)
                st = os.fstat(fd)
            finally:
                os.close(fd)
            os.replace(tmp, final)
            written = final
            fsync_dir(self.dir)
        except BaseException:
            with contextlib.suppress(OSError):
                written.unlink()
            raise
        f = BlockFile(key, parent, tuple(ids.tolist()), st.st_size, st.st_mtime_ns / 1e9)
        with self._mutex:
            old = self._files.pop(key, None)  # another thread wrote it meanwhile
            self._used += f.nbytes - (old.nbytes if old else 0)
            self._files[key] = f
            self._evict(keep=key)
        return key

    def read_into(self, key: bytes, dest: memoryview) -> None:
        """Fill ``dest`` (exactly record_bytes, writable: a host record) with the block's
        record, validating the file again and the data's CRC. Blocking (run it in a thread);
        does not mark a use (``touch``). A file that is gone or fails: BlockFileError (a bad
        one is quarantined first) and the index forgets it; then dest holds garbage."""
        view = memoryview(dest)
        if view.readonly or not view.c_contiguous or view.nbytes != self.record_bytes:
            raise ValueError(
                f"dest must be {self.record_bytes} writable contiguous bytes, got "
                f"{view.nbytes}{' read-only' if view.readonly else ''}"
            )
        view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
        path = self._path(key)
        try:
            fd = open_regular(path)
        except FileNotFoundError:
            self._forget(key)
            raise BlockFileError(f"{path.name}: gone (evicted or deleted)") from None
        except OSError as e:
            self._quarantine(path, str(e))
            raise BlockFileError(f"{path.name}: {e}") from e
        try:
            head = self._head(fd, path.name)
            _read_exactly(fd, view, head.data_at, path.name)
            if zlib.crc32(view) != head.data_crc:
                raise BlockFileError(f"{path.name}: the data fails its checksum (corrupt)")
        except (BlockFileError, OSError) as e:
            self._quarantine(path, str(e))
            if isinstance(e, BlockFileError):
                raise
            raise BlockFileError(f"{path.name}: cannot read: {e}") from e
        finally:
            os.close(fd)

    def touch(self, key: bytes) -> bool:
        """Mark a use now: the index's LRU order and the file's mtime (LRU across restarts).
        -> False when the key is not indexed, or its file is gone (deleted behind this
        index's back: then forgotten)."""
        now = time.time_ns()
        with self._mutex:
            f = self._files.get(key)
            if f is None:
                return False
            self._files[key] = replace(f, used=now / 1e9)
            self._files.move_to_end(key)
        try:
            os.utime(self._path(key), ns=(now, now), follow_symlinks=False)
        except FileNotFoundError:
            self._forget(key)
            return False
        except OSError:
            pass
        return True

    def remove(self, key: bytes) -> None:
        """Delete one block file (missing is fine)."""
        path = self._path(key)
        with self._mutex:  # as _evict: never after a newer write of the key
            f = self._files.pop(key, None)
            self._used -= f.nbytes if f is not None else 0
            with contextlib.suppress(FileNotFoundError):
                path.unlink()

    def clear(self) -> int:
        """Delete every block file of this part (not the temp files of writes in progress);
        returns how many."""
        with self._mutex:
            self._files.clear()
            self._used = 0
        removed = 0
        with os.scandir(self.dir) as it:
            entries = list(it)
        for entry in entries:
            if entry.name.endswith(self.kind.suffix) and not entry.is_dir(follow_symlinks=False):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)
                    removed += 1
        return removed

    def close(self) -> None:
        """Release the directory lock, if this object owns it."""
        fd, self._lock_fd = self._lock_fd, None
        if fd is not None:
            os.close(fd)  # closing drops the flock

    # -- internals ------------------------------------------------------------------------

    def _path(self, key: bytes) -> Path:
        if len(key) != BLOCK_KEY_BYTES:
            raise ValueError(f"a block key is {BLOCK_KEY_BYTES} bytes, got {len(key)}")
        return self.dir / f"{key.hex()}{self.kind.suffix}"

    def _head(self, fd: int, name: str) -> _Head:
        """Header and tokens of an open file, checked against this part; BlockFileError."""
        st = os.fstat(fd)
        size = st.st_size
        raw = os.pread(fd, _HEADER.size + _MAX_PART + 4 * self.block, 0)
        if len(raw) < _HEADER.size:
            raise BlockFileError(f"{name}: truncated ({size} bytes, no header)")
        magic, version, block, record, parent, key, n, tokens_crc, data_crc, part_len = (
            _HEADER.unpack_from(raw)
        )
        if magic != self.kind.magic:
            raise BlockFileError(f"{name}: not a {self.kind.noun} (magic {magic!r})")
        if version != FORMAT_VERSION:
            raise BlockFileError(
                f"{name}: format version {version}, this build reads {FORMAT_VERSION}"
            )
        if block != self.block or n != block:
            raise BlockFileError(
                f"{name}: a block of {block} rows and {n} tokens, this part's is {self.block}"
            )
        if record != self.record_bytes:
            raise BlockFileError(
                f"{name}: a record of {record} bytes, this part's is {self.record_bytes}"
            )
        tokens_at = _HEADER.size + part_len
        part = raw[_HEADER.size : tokens_at]
        if part_len > _MAX_PART or part != self._part:
            raise BlockFileError(
                f"{name}: part {part.decode('ascii', 'replace')!r} "
                f"(length {part_len}) is not this directory's {self.part!r}"
            )
        data_at = tokens_at + 4 * n
        if size != data_at + record:
            what = "truncated" if size < data_at + record else "has trailing bytes"
            raise BlockFileError(
                f"{name}: {what} ({size} bytes, the header says {data_at + record})"
            )
        raw_tokens = raw[tokens_at:data_at]
        if len(raw_tokens) != 4 * n:
            raise BlockFileError(f"{name}: truncated in its tokens")
        if zlib.crc32(raw_tokens) != tokens_crc:
            raise BlockFileError(f"{name}: the tokens fail their checksum (corrupt)")
        if _hash(parent, raw_tokens) != key:
            raise BlockFileError(f"{name}: its key does not match its parent and tokens")
        if name != f"{key.hex()}{self.kind.suffix}":
            raise BlockFileError(f"{name}: named for another key than its own {key.hex()}")
        tokens = tuple(np.frombuffer(raw_tokens, dtype="<i4").tolist())
        return _Head(BlockFile(key, parent, tokens, size, st.st_mtime_ns / 1e9), data_at, data_crc)

    def _evict(self, keep: bytes | None) -> int:
        """Delete the least recently used files until the rest fit max_bytes, never
        ``keep``; returns how many. Under the lock, unlinks included: a file unlinked
        after it could be a newer write of the same key."""
        evicted = 0
        for key in list(self._files):
            if self._used <= self.max_bytes:
                break
            if key != keep:
                self._used -= self._files.pop(key).nbytes
                with contextlib.suppress(FileNotFoundError):
                    self._path(key).unlink()
                evicted += 1
                if self._on_drop is not None:
                    self._on_drop(key)
        return evicted

    def _forget(self, key: bytes) -> None:
        with self._mutex:
            f = self._files.pop(key, None)
            if f is not None:
                self._used -= f.nbytes
                if self._on_drop is not None:
                    self._on_drop(key)

    def _quarantine(self, path: Path, reason: str) -> None:
        if self.kind.is_name(path.name):
            self._forget(bytes.fromhex(path.name[:32]))
        quarantine(self.model_dir, path, reason, self.kind.noun)


def _hash(parent: bytes, raw_tokens: bytes) -> bytes:
    if len(parent) != BLOCK_KEY_BYTES:
        raise ValueError(f"a block key is {BLOCK_KEY_BYTES} bytes, got {len(parent)}")
    h = hashlib.blake2b(parent, digest_size=BLOCK_KEY_BYTES)
    h.update(raw_tokens)
    return h.digest()


def _int32_le(tokens: Sequence[int]) -> np.ndarray:
    """Token ids as int32 little endian; ValueError for anything else."""
    a = np.asarray(tokens)
    if a.ndim != 1 or (a.size and a.dtype.kind not in "iu"):
        raise ValueError(f"token ids must be a flat sequence of integers, got {a.dtype} {a.shape}")
    if a.size and (int(a.min()) < _INT32.min or int(a.max()) > _INT32.max):
        raise ValueError("token ids must fit int32")
    return a.astype("<i4", copy=False)


def _bytes_view(data: memoryview | bytes) -> memoryview:
    view = memoryview(data)
    if not view.c_contiguous:
        raise ValueError("a record must be contiguous bytes")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def _write_all(fd: int, chunks: Sequence[bytes | memoryview]) -> None:
    """os.write until every byte is down (a regular file may take part of a chunk)."""
    for chunk in chunks:
        view = memoryview(chunk)
        while view:
            view = view[os.write(fd, view) :]


def _read_exactly(fd: int, buf: memoryview, offset: int, name: str) -> None:
    got = 0
    while got < len(buf):
        k = os.preadv(fd, [buf[got:]], offset + got)
        if not k:
            raise BlockFileError(f"{name}: truncated in its data")
        got += k
