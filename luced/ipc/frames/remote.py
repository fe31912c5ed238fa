"""Frames for workers on other hosts: the identity of a model file (hello), ping, link, and
the carry that rides beside a request (``codec``'s envelope key "carry").

A worker on another host (``luced worker --listen``) cannot map the daemon's shared memory.
It keeps a private *mirror* of the regions it uses (``runtime.mirror``), and a request's
carry says how their bytes get there and back::

    put        region bytes the daemon writes into the mirror before the request
               (token ids, grammar masks, q rows: small, inline in the control frame)
    get        regions whose bytes the worker returns in the reply ("carried", in order:
               sampled ids, logprobs, logits, captured ring cells)
    relay_in   before the request, receive these regions' bytes from a hop's peer
    relay_out  after the request, send these regions' bytes to a hop's peer (a failed
               request sends an abort instead, so the peer fails at once)
    forget     segments the mirror drops after the request (scratch: a prefix snapshot)

``kv_files`` is the other thing only such a worker serves: its own block files, its
layers' part of the prefix cache's disk tier, kept on its host (``runtime/kv_store.py``).

A *hop* is a torch.distributed group of two workers (``link``), one per pair that moves
bulk data between hosts: hidden states from stage to stage, feature-ring rows for a
draft, KV rows of a prefix snapshot. The daemon is not a rank; it numbers each hop's
transfers (``Relay.step``) so that a receiver drops what a failed step left behind. A
local worker relays for the daemon: its shared-memory view is the daemon's own, so a
``relay_out`` of a daemon-written region moves it to the remote peer.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from luced.ipc.frames.base import REPLIES, REQUESTS, Reply, Request, _op
from luced.ipc.regions import Region
from luced.ipc.typed import Record

_SHA256 = re.compile(r"[0-9a-f]{64}")
_DIR_NAME = re.compile(r"[0-9A-Za-z][0-9A-Za-z._-]{0,63}")  # cache/files.py's NAME_RE
KEY_BYTES = 16  # a block's prefix key (cache/block_files.py)


@dataclass(frozen=True)
class FileIdentity(Record):
    """A model file as its size and SHA-256: a remote host holds its own copy, found by
    these, whatever its path there."""

    size: int
    sha256: str  # lowercase hex

    def _check(self) -> None:
        if self.size < 0 or not _SHA256.fullmatch(self.sha256):
            raise self._fail(f"need size >= 0 and a hex sha256, got {self.size}, {self.sha256!r}")


@_op("ping", REQUESTS)
@dataclass(frozen=True)
class Ping(Request):
    """Nothing to do: a remote worker's heartbeat (its round trip), or a carrier of relays."""


@_op("ping", REPLIES)
@dataclass(frozen=True)
class PingReply(Reply):
    pass


@_op("link", REQUESTS)
@dataclass(frozen=True)
class Link(Request):
    """Join hop ``hop`` as ``rank`` of a new torch.distributed group of two (gloo), through
    the TCP store at ``store`` ("host:port"), binding this end's data sockets to
    ``address``. A new ``generation`` replaces the hop's old group (a group does not
    survive a dead peer). ``timeout_s`` bounds the rendezvous and every send and receive.
    ``serve``: what this end serves on the hop rather than relays ("experts": an expert
    worker answers its peer's calls, ``runtime.expert_link.HopExperts``)."""

    hop: str
    generation: int
    rank: int
    store: str
    address: str
    timeout_s: float
    serve: str = ""

    def _check(self) -> None:
        if not self.hop or self.rank not in (0, 1) or self.generation < 0:
            raise self._fail(f"need a hop name, rank 0 or 1, generation >= 0; got {self}")
        host, _, port = self.store.rpartition(":")
        if not host or not port.isdigit() or not self.address:
            raise self._fail(f"store must be host:port and address a host, got {self.store!r}")
        if not self.timeout_s > 0:
            raise self._fail(f"timeout_s must be > 0, got {self.timeout_s}")
        if self.serve not in ("", "experts"):
            raise self._fail(f'serve must be "" or "experts", got {self.serve!r}')


@_op("link", REPLIES)
@dataclass(frozen=True)
class LinkReply(Reply):
    elapsed_us: int


@dataclass(frozen=True)
class Put(Record):
    region: Region
    data: bytes

    def _check(self) -> None:
        if len(self.data) != self.region.nbytes:
            raise self._fail(f"{len(self.data)} bytes for a region of {self.region.nbytes}")


@dataclass(frozen=True)
class Relay(Record):
    """Transfer ``step`` of ``hop``: the regions' bytes, one after another."""

    hop: str
    step: int
    regions: tuple[Region, ...]

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.regions)

    def _check(self) -> None:
        if not self.hop or self.step < 0 or not self.regions:
            raise self._fail("a relay names its hop, a step >= 0 and at least one region")


@dataclass(frozen=True)
class Carry(Record):
    """What moves beside one request (module docstring)."""

    put: tuple[Put, ...] = ()
    get: tuple[Region, ...] = ()
    relay_in: tuple[Relay, ...] = ()
    relay_out: tuple[Relay, ...] = ()
    forget: tuple[str, ...] = ()

    @property
    def empty(self) -> bool:
        return not (self.put or self.get or self.relay_in or self.relay_out or self.forget)


@_op("kv_files", REQUESTS)
@dataclass(frozen=True)
class KVFiles(Request):
    """One action on this worker's own K/V block files (a worker on another host: its
    layers' part of the prefix cache's disk tier, ``runtime/kv_store.py``), the files of
    ``DIR/<model>/blocks/<part>/`` under its ``--kv-cache-dir``. The daemon's block store
    decides every key and record; the worker only executes. Keys and parents are packed
    (16 bytes each), a block's token ids too (int32 LE, the pool's block of them)::

        list   the files' keys, parents and tokens after key ``after`` in key order, a page
        write  records ``records`` of ``kv_host`` copied now, written in the background as
               the blocks (parents[i], tokens[i]), in order
        read   records ``records`` of ``kv_host`` filled with the blocks ``keys``, in order,
               stopping at the first one missing or bad
        clear  every file of the part deleted

    Any action opens the part first where it is not open (a scan)."""

    action: Literal["list", "write", "read", "clear"]
    model: str  # the model's directory (the daemon's fingerprint of the file)
    part: str  # the worker's part (engine/kv/block_store.py part_name)
    kv_host: Region | None = None  # write, read: this worker's host records
    records: tuple[int, ...] = ()
    keys: bytes = b""  # read
    parents: bytes = b""  # write
    tokens: bytes = b""  # write
    after: bytes = b""  # list: the last key of the page before (none: from the first)

    def _check(self) -> None:
        for name in ("model", "part"):
            value = getattr(self, name)
            if not _DIR_NAME.fullmatch(value):
                raise self._fail(f"{name} must be a plain directory name, got {value!r}")
        if len(self.after) not in (0, KEY_BYTES):
            raise self._fail(f"after must be a key of {KEY_BYTES} bytes, got {len(self.after)}")
        n = len(self.records)
        on_records = self.action in ("write", "read")
        packed = {"read": ("keys",), "write": ("parents", "tokens")}.get(self.action, ())
        extra = [f for f in ("keys", "parents", "tokens") if getattr(self, f) and f not in packed]
        if not on_records and (extra or n or self.kv_host is not None):
            raise self._fail(f"{self.action} takes no blocks, records or kv_host")
        if not on_records:
            return
        if extra or not n:
            raise self._fail(f"{self.action} takes records and {' and '.join(packed)} only")
        host = self.kv_host
        if host is None or host.dtype != "uint8" or len(host.shape) != 2:
            got = f"{host.dtype} {list(host.shape)}" if host is not None else "none"
            raise self._fail(f"kv_host must be uint8 [records, bytes], got {got}")
        if min(self.records) < 0 or len(set(self.records)) != n:
            raise self._fail(f"records must be distinct and >= 0, got {list(self.records)}")
        keys = self.keys if self.action == "read" else self.parents
        if len(keys) != n * KEY_BYTES:
            raise self._fail(f"{n} records take {n * KEY_BYTES} bytes of keys, got {len(keys)}")
        if self.action == "write" and (not self.tokens or len(self.tokens) % (4 * n)):
            raise self._fail(
                f"tokens must be {n} blocks of int32 ids, got {len(self.tokens)} bytes"
            )


@_op("kv_files", REPLIES)
@dataclass(frozen=True)
class KVFilesReply(Reply):
    disk: bool  # False: no --kv-cache-dir there (or it is unusable): nothing was done
    done: int = 0  # list: keys; write: blocks taken; read: blocks read; clear: files deleted
    keys: bytes = b""  # list: the page, in key order
    parents: bytes = b""
    tokens: bytes = b""
    more: bool = False  # list: keys past this page
    gone: bytes = b""  # keys that left the part since the last reply (evicted, a failed write)
