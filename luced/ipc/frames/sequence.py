"""Frames that act on one sequence's state besides forward: the draft (load_draft, draft),
KV snapshots (kv_layout, kv_export, kv_import), kv_share, kv_page, truncate and reset."""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field

from luced.ipc.frames.base import (
    COMPUTE_DTYPES,
    REPLIES,
    REQUESTS,
    ComputeDtype,
    Reply,
    Request,
    _check_sampling_map,
    _check_sequence,
    _op,
)
from luced.ipc.regions import Region
from luced.sampling_params import SamplingWire

# -- load_draft, draft ---------------------------------------------------------------------


@_op("load_draft", REQUESTS)
@dataclass(frozen=True)
class LoadDraft(Request):
    """Load a DFlash draft (GGUF file or safetensors directory) into this worker.

    The draft embeds its block and projects its hidden states with the TARGET's embedding
    and head. Without ``target`` this worker must hold both (its target covers the first and
    the last layer); with ``target`` (the target's GGUF) a worker that lacks them loads just
    the target's embedding and head beside the draft (a draft-only worker). Loading a
    target (``load``) afterwards drops the draft.
    """

    path: str
    dtype: ComputeDtype
    device: str
    target: str | None = None

    def _check(self) -> None:
        if not self.path or not self.device or self.target == "":
            raise self._fail("path, device and (when given) target must not be empty")


@_op("load_draft", REPLIES)
@dataclass(frozen=True)
class LoadDraftReply(Reply):
    capture_layers: tuple[int, ...]  # target layers whose outputs the ring must hold, in order
    block_size: int  # the draft's default block (anchor + proposals)
    mask_token_id: int | None  # the draft config's; None: the daemon must name one
    hidden: int
    load_s: float


@_op("draft", REQUESTS)
@dataclass(frozen=True)
class DraftBlock(Request):
    """Propose one block: ``outputs["ids"][:B]`` = [anchor, proposal 1, ..., proposal B-1].

    Context: the features of the last ``C = min(committed, ctx_window, ring_cap)`` positions
    ``[committed - C, committed)``, read in place from ``ring`` (the feature ring,
    ``[ring_cap, n_capture, hidden]``, slot = position % ring_cap). The block sits at
    positions ``committed ..``: the anchor (the last accepted token, not yet fed to the
    target) and ``B - 1`` mask tokens. ``block_size`` / ``mask_token_id`` default to the
    draft config's.

    Greedy (``sampling`` empty, or temperature 0): proposals are the argmax of each row.
    With temperature > 0 proposals are drawn from the draft's processed distributions q
    (``sampler.probs`` with these parameters minus any penalties, which the draft has no
    history for and rejection sampling does not need: any q is exact; seeded apart from
    the target by ``sampling.seed``), and ``outputs["probs"]`` (float32 ``[>= B-1, vocab]``) gets q:
    row j is the distribution proposal j + 1 was drawn from (draft output row j + 1; the
    draft's row 0, its guess for the anchor, is dropped), as ``verify_sampled`` takes it.
    """

    ring: Region
    committed: int
    anchor: int
    outputs: dict[str, Region]
    block_size: int | None = None
    mask_token_id: int | None = None
    ctx_window: int = 4096
    sampling: SamplingWire = field(default_factory=dict)
    sequence: int = 0  # whose window: a sampled draft keeps a generator per sequence

    @property
    def sampled(self) -> bool:
        """A non-empty sampling map at temperature > 0 (absent = 1, as in ``forward``)."""
        t = self.sampling.get("temperature")
        return bool(self.sampling) and (1.0 if t is None else t) > 0

    def _check(self) -> None:
        if self.committed < 1 or self.anchor < 0 or self.ctx_window < 1:
            got = f"{self.committed}, {self.anchor}, {self.ctx_window}"
            raise self._fail(f"need committed >= 1, anchor >= 0, ctx_window >= 1, got {got}")
        if self.block_size is not None and self.block_size < 2:
            raise self._fail(f"block_size must be >= 2, got {self.block_size}")
        if self.mask_token_id is not None and self.mask_token_id < 0:
            raise self._fail(f"mask_token_id must be >= 0, got {self.mask_token_id}")
        r = self.ring
        if len(r.shape) != 3 or r.dtype not in COMPUTE_DTYPES:
            got = f"{r.dtype} {list(r.shape)}"
            raise self._fail(f"ring must be float [ring_cap, n_capture, hidden], got {got}")
        _check_sampling_map(self)
        want = {"ids", "probs"} if self.sampled else {"ids"}
        if set(self.outputs) != want:
            raise self._fail(
                f"outputs must be {sorted(want)} (probs iff temperature > 0), "
                f"got {sorted(self.outputs)}"
            )
        b = self.block_size or 2
        for name, dtype, ndim, rows in (("ids", "int32", 1, b), ("probs", "float32", 2, b - 1)):
            r = self.outputs.get(name)
            if r is not None and (r.dtype != dtype or len(r.shape) != ndim or r.shape[0] < rows):
                raise self._fail(
                    f"outputs.{name} must be {dtype} with {ndim} dim(s) and >= {rows} rows, "
                    f"got {r.dtype} {list(r.shape)}"
                )


@_op("draft", REPLIES)
@dataclass(frozen=True)
class DraftBlockReply(Reply):
    n: int  # proposals written (block_size - 1); ids rows written: n + 1
    ctx: int  # context positions the draft read (C)
    elapsed_us: int


# -- KV snapshots ---------------------------------------------------------------------------
#
# A prefix-cache snapshot of a worker is one region per KV tensor of its layers, named
# "k.{layer}" / "v.{layer}" (global layer index), each [n_kv_heads, >= n, head_dim] in the
# cache dtype, in a daemon-owned segment (the snapshot arena). Rows [0, n) along the token
# axis (axis 1) are the K / V of positions [0, n). The worker copies straight between its
# cache and those regions (device <-> host on a GPU); nothing is serialized.
#
# A recurrent layer (Gated DeltaNet) has no rows but a state per cut point, one region
# each with a leading slot axis: "conv.{layer}" [slots, kernel - 1, channels] cache dtype,
# "delta.{layer}" [slots, heads, key_dim, value_dim] float32. A state sums up every
# position, so it exists only where a forward stopped: kv_export writes slot i from the
# state at cuts[i]; kv_import reads one slot (the daemon passes the slot of the cut it
# restores: a prefix cache in exact-cut mode restores only at an entry's cuts).

_KV_NAME = re.compile(r"^[kv]\.(0|[1-9][0-9]{0,5})$")
_STATE_NAME = re.compile(r"^(conv|delta)\.(0|[1-9][0-9]{0,5})$")
_STORE_ID = re.compile(r"^[0-9a-f]{1,64}$")


def _check_kv_regions(frame: KVExport | KVImport) -> None:
    if frame.store:
        if frame.regions:
            raise frame._fail("regions must be empty when store names the snapshot")
        if not _STORE_ID.match(frame.store):
            raise frame._fail(f"store must be a snapshot id (hex digits), got {frame.store!r}")
        return
    if not frame.regions:
        raise frame._fail("regions is empty")
    for name, r in frame.regions.items():
        if _STATE_NAME.match(name):
            continue  # a recurrent state: any shape, checked against the layer by the worker
        if not _KV_NAME.match(name):
            raise frame._fail(
                f'region name {name!r} is not "k.<layer>", "v.<layer>", "conv.<layer>" '
                'or "delta.<layer>"'
            )
        if len(r.shape) != 3 or r.dtype not in COMPUTE_DTYPES or r.shape[1] < frame.position:
            raise frame._fail(
                f"regions.{name} must be float [n_kv_heads, >= {frame.position}, head_dim], "
                f"got {r.dtype} {list(r.shape)}"
            )


@_op("kv_layout", REQUESTS)
@dataclass(frozen=True)
class KVLayout(Request):
    """Which KV tensors this worker's shards hold, for sizing snapshot regions."""


@_op("kv_layout", REPLIES)
@dataclass(frozen=True)
class KVLayoutReply(Reply):
    # (name, n_kv_heads, head_dim) per tensor: "k.{layer}", "v.{layer}" for every layer of
    # every shard, in layer order. One token of a tensor is n_kv_heads * head_dim values.
    tensors: tuple[tuple[str, int, int], ...]
    dtype: ComputeDtype  # the cache dtype (= the load dtype)
    # (name, shape, dtype) per recurrent state tensor: "conv.{layer}", "delta.{layer}" for
    # every recurrent layer, in layer order (no token axis; see the section comment).
    states: tuple[tuple[str, tuple[int, ...], str], ...] = ()


@_op("kv_export", REQUESTS)
@dataclass(frozen=True)
class KVExport(Request):
    """Copy K/V rows [0, position) of every layer into ``regions`` (see the section comment).

    ``regions`` names exactly the tensors of ``kv_layout``; ``position`` <= the committed KV
    length. A recurrent state's region is ``[len(cuts), *state]``: slot i gets the state at
    ``cuts[i]`` (ascending, the last == ``position`` == the committed length; the others
    kept by ``forward`` ``keep_state``); empty ``cuts`` means ``(position,)``. Everything
    is checked before the first copy; the KV is never changed. The worker writes the
    regions before replying; nobody reads them before the reply.

    ``store`` (a worker on another host): keep the rows in this worker's own snapshot
    store under that id instead (``regions`` empty): in its memory, and on its host's
    disk when it has a directory (``runtime/snapshot_store.py``).
    """

    position: int
    regions: dict[str, Region]
    cuts: tuple[int, ...] = ()
    sequence: int = 0
    store: str = ""

    @property
    def state_cuts(self) -> tuple[int, ...]:
        return self.cuts or (self.position,)

    def _check(self) -> None:
        _check_sequence(self)
        if self.position < 0:
            raise self._fail(f"position must be >= 0, got {self.position}")
        cuts = list(self.state_cuts)
        if cuts != sorted(set(cuts)) or cuts[-1] != self.position or (cuts[0] < 1 < len(cuts)):
            raise self._fail(f"cuts must ascend to position {self.position}, got {cuts}")
        _check_kv_regions(self)
        spans = sorted(
            (r.segment, r.offset, r.offset + r.nbytes, name) for name, r in self.regions.items()
        )
        for a, b in itertools.pairwise(spans):  # two destinations in the same bytes: a bug
            if a[0] == b[0] and b[1] < a[2]:
                raise self._fail(f"regions {a[3]} and {b[3]} overlap")


@_op("kv_export", REPLIES)
@dataclass(frozen=True)
class KVExportReply(Reply):
    position: int  # rows exported
    elapsed_us: int


@_op("kv_import", REQUESTS)
@dataclass(frozen=True)
class KVImport(Request):
    """Replace this worker's KV (all shards) with rows [0, position) of ``regions``.

    The regions' token axis may be longer than ``position``: any prefix of a snapshot can be
    restored. ``tokens`` (int32 ``[>= position]``) are the ids at those positions: the new
    token history (penalties). Sampler state is dropped as by ``reset``. Everything is
    checked before the KV is touched (a rejected import changes nothing); after the reply
    the KV holds ``position`` positions. The daemon wrote the regions before the frame.

    ``store``: the rows come from this worker's own snapshot store (``kv_export``
    ``store``), ``regions`` empty; an id it does not hold (any more) is refused, and
    changes nothing.
    """

    position: int
    regions: dict[str, Region]
    tokens: Region
    sequence: int = 0
    store: str = ""
    # A block-pool load: the sequence's table after the import, the daemon's fresh blocks
    # covering [0, position) (its old blocks are released first).
    blocks: tuple[int, ...] = ()

    def _check(self) -> None:
        _check_sequence(self)
        if self.position < 0:
            raise self._fail(f"position must be >= 0, got {self.position}")
        if min(self.blocks, default=0) < 0 or len(set(self.blocks)) != len(self.blocks):
            raise self._fail(f"blocks must be distinct pool blocks >= 0, got {self.blocks}")
        _check_kv_regions(self)
        t = self.tokens
        if t.dtype != "int32" or len(t.shape) != 1 or t.shape[0] < self.position:
            got = f"{t.dtype} {list(t.shape)}"
            raise self._fail(f"tokens must be int32 [>= {self.position}], got {got}")


@_op("kv_import", REPLIES)
@dataclass(frozen=True)
class KVImportReply(Reply):
    position: int  # committed KV length now
    elapsed_us: int


@_op("kv_forget", REQUESTS)
@dataclass(frozen=True)
class KVForget(Request):
    """Drop these snapshots from this worker's own store, memory and disk (the daemon
    dropped them from its prefix cache). Ids it does not hold are ignored."""

    ids: tuple[str, ...]

    def _check(self) -> None:
        bad = [i for i in self.ids if not _STORE_ID.match(i)]
        if bad:
            raise self._fail(f"ids must be snapshot ids (hex digits), got {bad[:4]}")


@_op("kv_forget", REPLIES)
@dataclass(frozen=True)
class KVForgetReply(Reply):
    dropped: int  # of the ids, those it held


# -- truncate, reset, stats, shutdown -------------------------------------------------------


@_op("truncate", REQUESTS)
@dataclass(frozen=True)
class Truncate(Request):
    """Roll the KV cache of every shard in this worker back to ``position`` tokens; a
    block table (load ``kv_block``) releases the blocks wholly past it, as the daemon's
    does (``engine/kv/blocks.py``)."""

    position: int
    sequence: int = 0

    def _check(self) -> None:
        _check_sequence(self)
        if self.position < 0:
            raise self._fail(f"position must be >= 0, got {self.position}")


@_op("truncate", REPLIES)
@dataclass(frozen=True)
class TruncateReply(Reply):
    position: int  # committed KV length now


@_op("kv_share", REQUESTS)
@dataclass(frozen=True)
class KVShare(Request):
    """Start the (empty) ``sequence`` on the first ``position`` positions of ``source``:
    the K/V blocks that hold them are shared, not copied (a load with ``kv_block``); a
    block either writes into next is copied first."""

    sequence: int
    source: int
    position: int

    def _check(self) -> None:
        _check_sequence(self)
        if self.source < 0 or self.source == self.sequence:
            raise self._fail(f"source must be another sequence >= 0, got {self.source}")
        if self.position < 0:
            raise self._fail(f"position must be >= 0, got {self.position}")


@_op("kv_share", REPLIES)
@dataclass(frozen=True)
class KVShareReply(Reply):
    position: int  # the positions shared (committed in the sequence now)


@_op("kv_page", REQUESTS)
@dataclass(frozen=True)
class KVPage(Request):
    """Host-tier moves of ``sequence``'s block table outside a forward, applied in order on
    every shard, each (kind, logical block, pool block, host record of ``kv_host``): 0 out
    and 1 in as a span's (``Span.moves``: a kept lane paged out to make room), 2 save (the
    block's rows copied to the record, the table unchanged: the prefix cache's block store
    writes it to disk) and 3 adopt (pool block -1: the record becomes the table's next
    entry, paged out, its positions committed; a restored prefix, paged in by the next
    span). ``tokens``: the ids of the adopted positions, appended to the token history.

    ``states`` (a hybrid's recurrent state records, rows of ``kv_states``: the prefix
    cache's states at block ends, runtime/kv_state.py), each (kind, position, record):
    0 save (the state kept at that position copied to the record; applied before the
    moves) and 1 load (the record becomes the state at the position the adopts end at:
    a recurrent sequence adopts only with it)."""

    sequence: int
    moves: tuple[tuple[int, int, int, int], ...]
    kv_host: Region
    tokens: tuple[int, ...] = ()
    states: tuple[tuple[int, int, int], ...] = ()
    kv_states: Region | None = None

    def _check(self) -> None:
        _check_sequence(self)
        if not self.moves and not self.states:
            raise self._fail("moves and states must not both be empty")
        for state in self.states:
            kind, position, record = state
            if kind not in (0, 1) or min(position, record) < 0:
                raise self._fail(
                    f"a state is (0 save | 1 load, position >= 0, record >= 0), got {list(state)}"
                )
        if sum(1 for kind, *_ in self.states if kind == 1) > 1:
            raise self._fail("a frame loads one state at most")
        if any(kind == 1 for kind, *_ in self.states) and not any(m[0] == 3 for m in self.moves):
            raise self._fail("a state is loaded with adopt moves only")
        rows = self.kv_states
        if (rows is None) != (not self.states):
            raise self._fail("kv_states comes with states, and only with them")
        if rows is not None and (rows.dtype != "uint8" or len(rows.shape) != 2):
            raise self._fail(
                f"kv_states must be uint8 [records, bytes], got {rows.dtype} {list(rows.shape)}"
            )
        for move in self.moves:
            kind, j, block, record = move
            adopt = kind == 3
            if kind not in (0, 1, 2, 3) or min(j, record) < 0 or (block == -1) != adopt:
                raise self._fail(
                    "a move is (0 out | 1 in | 2 save, logical block >= 0, pool block >= 0, "
                    f"record >= 0) or (3 adopt, logical block, -1, record), got {list(move)}"
                )
            if block < -1:
                raise self._fail(f"pool block must be >= 0, got {list(move)}")
        if self.tokens and not any(m[0] == 3 for m in self.moves):
            raise self._fail("tokens come with adopt moves only")
        host = self.kv_host
        if host.dtype != "uint8" or len(host.shape) != 2:
            raise self._fail(
                f"kv_host must be uint8 [records, bytes], got {host.dtype} {list(host.shape)}"
            )


@_op("kv_page", REPLIES)
@dataclass(frozen=True)
class KVPageReply(Reply):
    paged: int  # the sequence's PAGED entries now


@_op("reset", REQUESTS)
@dataclass(frozen=True)
class Reset(Request):
    """Drop the sequence's KV and sampler state (the draft's too); weights stay loaded.
    ``release``: forget the sequence and free its caches (a finished request of a batch);
    with ``keep_sampler`` the sequence keeps its sampler (its seeded generator's place) and
    only its KV and token history go (a preempted request, recomputed later)."""

    sequence: int = 0
    release: bool = False
    keep_sampler: bool = False

    def _check(self) -> None:
        _check_sequence(self)


@_op("reset", REPLIES)
@dataclass(frozen=True)
class ResetReply(Reply):
    pass
