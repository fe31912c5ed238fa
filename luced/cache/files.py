"""The cache directory's shared parts: one directory per model, its lock, safe opens and
the quarantine. Both disk tiers use them: snapshots (``cache/disk.py``) and block files
(``cache/block_files.py``)::

    DIR/                       --kv-cache-dir, shared by every model served from it
      <model>/                 ``model_dir_name(fingerprint)``; other models' directories
                               are never read, moved or deleted
        .lock                  flock: one daemon per model directory (``lock_model_dir``)
        quarantine/            files that failed validation, moved aside with a warning
                               (the newest QUARANTINE_KEEP are kept)

Hostile contents: files are opened through ``open_regular`` (``O_NOFOLLOW``, must be a
regular file), directories are checked with ``lstat`` (``real_dir``: a symlinked
``quarantine/`` or model directory is refused, never followed).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import logging
import os
import re
import stat
from pathlib import Path

log = logging.getLogger(__name__)

QUARANTINE = "quarantine"
QUARANTINE_KEEP = 16  # newest quarantined files kept for inspection; older ones are deleted
LOCK_NAME = ".lock"
NAME_RE = re.compile(r"^[0-9A-Za-z][0-9A-Za-z._-]{0,63}$")  # a plain directory name


class SnapshotDirError(Exception):
    """The cache directory cannot be used (unwritable, a symlink where a directory should
    be, ...): the daemon serves with the memory tier only."""


class SnapshotDirBusy(SnapshotDirError):
    """Another daemon holds this model's cache directory: a start-up error."""


def model_dir_name(fingerprint: str) -> str:
    """The subdirectory of one model: its fingerprint when that is a plain name (luced's
    are 32 hex digits), else a hash of it."""
    if NAME_RE.match(fingerprint) and fingerprint != QUARANTINE:
        return fingerprint
    return hashlib.sha256(fingerprint.encode()).hexdigest()[:32]


def real_dir(path: Path, create: bool) -> None:
    """Make sure ``path`` is a directory and not a symlink (created 0700 if asked)."""
    if create:
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, 0o700)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        kind = "a symlink" if stat.S_ISLNK(st.st_mode) else "not a directory"
        raise SnapshotDirError(f"{path} is {kind}; the cache does not follow it")


def open_regular(path: Path, flags: int = os.O_RDONLY) -> int:
    """An fd of ``path``, which must be a regular file and not a symlink (O_NOFOLLOW; a FIFO
    is refused without blocking); OSError otherwise."""
    fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a regular file", str(path))
    return fd


def fsync_dir(path: Path) -> None:
    """Make a rename in ``path`` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def lock_model_dir(root: str | Path, fingerprint: str) -> int:
    """Create DIR/<model>/ (0700, never through a symlink) and take its lock; returns the
    lock's fd (closing it releases the lock). Cheap, so the daemon calls it before the slow
    model load too. SnapshotDirBusy when another daemon holds it, SnapshotDirError when the
    directory cannot be used."""
    root = Path(root)
    model_dir = root / model_dir_name(fingerprint)
    try:
        root.mkdir(parents=True, exist_ok=True)  # the operator's path: symlinks allowed
        real_dir(model_dir, create=True)
        fd = os.open(
            model_dir / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
        )
    except OSError as e:
        raise SnapshotDirError(f"{model_dir}: {e.strerror or e}") from e
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise SnapshotDirBusy(f"{model_dir} is in use by another luced daemon") from None
    if not os.access(model_dir, os.W_OK | os.X_OK):
        os.close(fd)
        raise SnapshotDirError(f"{model_dir} is not writable")
    return fd


def quarantine(model_dir: Path, path: Path, reason: str, what: str) -> None:
    """Move ``path`` to ``model_dir/quarantine/`` (a numbered name if taken) and log one
    warning naming it and why; ``what`` says what the file is ("snapshot file")."""
    reason = reason.removeprefix(f"{path.name}: ")  # the log names the file anyway
    try:
        dest = move_aside(model_dir, path)
    except (OSError, SnapshotDirError) as e:
        log.warning(
            "prefix cache: skipping %s %s (%s); cannot quarantine it: %s", what, path, reason, e
        )
        return
    log.warning("prefix cache: skipping %s %s (%s); moved to %s", what, path, reason, dest)


def move_aside(model_dir: Path, path: Path) -> Path:
    """Move ``path`` into ``model_dir/quarantine/`` (a numbered name if taken; a symlinked
    quarantine/ is refused) and keep only its newest files there. -> where it went; OSError
    or SnapshotDirError when it could not."""
    qdir = model_dir / QUARANTINE
    real_dir(qdir, create=True)
    dest = qdir / path.name
    i = 1
    while os.path.lexists(dest):
        dest = qdir / f"{path.name}.{i}"
        i += 1
    os.replace(path, dest)
    os.utime(dest, follow_symlinks=False)  # its quarantine time: the pruning keeps the newest
    _prune(qdir, QUARANTINE_KEEP)
    return dest


def _prune(qdir: Path, keep: int) -> None:
    """Delete all but the `keep` most recently quarantined files (the directory would
    otherwise grow without bound outside the budget). lstat and unlink: a symlink in
    quarantine/ is removed itself, never what it points to."""

    def key(p: Path) -> tuple[int, str]:
        try:
            return os.lstat(p).st_mtime_ns, p.name
        except OSError:
            return 0, p.name

    files = sorted(qdir.iterdir(), key=key, reverse=True)
    for old in files[keep:]:
        with contextlib.suppress(OSError):
            old.unlink()
