"""Every control frame between the daemon and its workers, with its fields.

Wire format: one msgpack map per frame (``use_bin_type=True`` / ``raw=False``, strict
types, no extension types, no pickle; ``codec.py``), sent length-prefixed by
``channel.py``::

    request   {"op": str, "seq": int, ...fields of the op}
    reply     {"seq": int, "ok": true, ...fields of the op's reply}
    failure   {"seq": int, "ok": false, "error": str}
    progress  {"seq": int, "progress": str}   (any number, before the reply)

``seq`` is chosen by the sender of a request and echoed in its reply. Bulk data never
travels in a frame: fields carry ``Region`` maps (segment, offset, shape, dtype) naming
shared memory (see ``regions.py``). A frame is at most ``codec.MAX_FRAME_BYTES``.

The ops (request fields -> reply fields):

    hello     instance, protocol            -> protocol, pid, group, devices, versions
    load      model, layers=[a, b), dtype, devices, kv_capacity, owns_embed, owns_head,
              device_splits, kv_pool, kv_block
                                            -> n_layers, hidden, vocab, layers, dtype,
                                               kv_capacity, load_s, recurrent, kv_pool,
                                               kv_chunk_bytes
    forward   n_tokens, start_pos, tokens | hidden_in, want, outputs, positions,
              sampling, top_logprobs, capture, ring, kv_slots, kv_map, kv_moves, kv_host
                                            -> n_out, position, elapsed_us
    load_draft path, dtype, device, target  -> capture_layers, block_size, mask_token_id,
                                               hidden, load_s
    draft     ring, committed, anchor, outputs, block_size, mask_token_id, ctx_window,
              sampling                      -> n, ctx, elapsed_us
    kv_layout                               -> tensors, dtype, states
    kv_export position, regions, cuts       -> position, elapsed_us
    kv_import position, regions, tokens     -> position, elapsed_us
    kv_share  sequence, source, position    -> position
    truncate  position                      -> position
    reset                                   -> (nothing)
    stats                                   -> stats
    shutdown                                -> (nothing)

The daemon opens with ``hello``; both sides check ``protocol == PROTOCOL_VERSION`` (a
mismatch raises ``ProtocolVersionError`` naming both versions). Any change to a field
bumps ``PROTOCOL_VERSION`` (2: ``project``; ``tokens`` may ride along ``hidden_in``;
3: ``load_draft`` and ``draft``; 4: ``forward`` want="verify";
5: ``kv_layout``, ``kv_export``, ``kv_import``; 6: ``project`` removed;
7: ``load`` replies ``recurrent``, the loaded layers that keep a recurrent state;
``kv_layout`` replies ``states`` and snapshots carry them as "conv.l" / "delta.l"; and
KV Flash: ``load`` ``kv_pool`` and its reply's ``kv_pool`` / ``kv_chunk_bytes``,
``forward`` ``kv_slots`` / ``kv_map`` / ``kv_moves`` / ``kv_host``: a pooled worker
cannot serve a forward without the pager's plan, so an old daemon must not drive it);
8: ``forward`` ``kv_scores`` (the KV Flash ``qk`` scores written back in shared memory);
``forward`` ``keep_state`` / ``keep_block_states`` and ``kv_export`` ``cuts``: a
snapshot's recurrent states have a leading slot axis, one per cut point (an old worker
would misread the regions), and a verify may keep a recurrent state per position;
MoE expert compute: ``load`` ``moe_hot`` / ``moe_scratch`` / ``moe_required``, its reply's
``moe_fingerprint``; ``load_experts``; ``expert_mix`` (worker to worker, see below);
9: ``forward`` ``allowed`` (a grammar's allowed-token bitmask per sampled row);
10: ``load`` and ``load_experts`` ``moe_profile`` (a routing profile's counts: both sides
must plan the same hot experts from it), ``load_experts`` ``weights`` (cold experts held
as the target holds its matrices);
11: continuous batching: ``sequence`` on the frames of one sequence, ``forward_batch``,
``reset`` ``release``;
12: ``reset`` ``keep_sampler`` (a preempted sequence frees its KV but keeps its generator);
``forward_batch`` ``allowed`` (grammar steps batched with the others), a 4th batch column
n_out and ``n_rows_out`` (greedy verify blocks batched); ``load`` ``kv_dtype``;
13: ``load`` ``kv_block`` (every sequence's K/V in one block pool per shard) and
``kv_share`` (a sequence starts on another's prefix blocks, without copying);
14: ``load`` replies ``kernels``, what runs the worker's matrices and decode attention;
15: progress notes: a worker at one of the ``SLOW`` requests (its start, a load) says twice
a second that it is still at work, so the daemon bounds its silence, not its time.

Expert compute (``luced.runtime.expert_link``): an expert worker answers ``load_experts``
from the daemon, and ``expert_mix`` from target workers over direct worker-to-worker
socketpairs that the daemon hands to both sides (SCM_RIGHTS over each worker's inbox)::

    load_experts  model, dtype, device, hot,      -> n_layers, n_held, fingerprint, load_s
                  moe_profile, weights
    expert_mix    layer, x, ids, weights          -> elapsed_us   (x is overwritten with
                                                     the answer Σ w_i · expert_i(x))

Each class validates on construction (types, then the op's own rules), so a bad frame
fails at the sender as well as at the receiver, with the field's path in the message.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Literal, Self, TypeVar

from luced.ipc.regions import Region
from luced.ipc.typed import FrameError, Record
from luced.sampling_params import SamplingParams

PROTOCOL_VERSION = 15

_ENVELOPE = frozenset({"op", "seq", "ok", "error", "progress"})  # no op may use these as fields


class ProtocolVersionError(FrameError):
    """The peer speaks another protocol version."""


@dataclass(frozen=True)
class _Frame(Record):
    OP: ClassVar[str] = ""
    KIND: ClassVar[str] = ""

    @classmethod
    def label(cls) -> str:
        return f"{cls.OP} {cls.KIND}"


@dataclass(frozen=True)
class Request(_Frame):
    KIND: ClassVar[str] = "request"


@dataclass(frozen=True)
class Reply(_Frame):
    KIND: ClassVar[str] = "reply"


@dataclass(frozen=True)
class ErrorReply:
    """``{"seq", "ok": false, "error"}``: the request failed; ``error`` says why."""

    error: str


REQUESTS: dict[str, type[Request]] = {}
REPLIES: dict[str, type[Reply]] = {}

_F = TypeVar("_F", bound=_Frame)


def _op(op: str, registry: dict[str, Any]) -> Callable[[type[_F]], type[_F]]:
    def register(cls: type[_F]) -> type[_F]:
        cls.OP = op
        clash = {f.name for f in fields(cls)} & _ENVELOPE
        if clash or op in registry:
            raise TypeError(f"{cls.__name__}: envelope key(s) {clash} or op {op!r} declared twice")
        registry[op] = cls
        return cls

    return register


def _check_protocol(version: object) -> None:
    if version != PROTOCOL_VERSION or type(version) is not int:
        raise ProtocolVersionError(
            f"protocol version mismatch: the peer speaks {version!r}, this side speaks "
            f"{PROTOCOL_VERSION} (daemon and worker come from different luced builds)"
        )


# -- hello ----------------------------------------------------------------------------------


@_op("hello", REQUESTS)
@dataclass(frozen=True)
class Hello(Request):
    instance: str  # the daemon's instance id (its segment names carry it)
    protocol: int = PROTOCOL_VERSION

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> Self:
        _check_protocol(d.get("protocol"))  # before anything else: fields may differ
        return super().from_wire(d)

    def _check(self) -> None:
        _check_protocol(self.protocol)


@_op("hello", REPLIES)
@dataclass(frozen=True)
class HelloReply(Reply):
    pid: int
    group: str  # backend group name, e.g. "cuda", "cpu:1"
    devices: tuple[str, ...]  # devices this worker drives, e.g. ("cuda:0", "cuda:1")
    versions: dict[str, str]  # {"python": ..., "torch": ..., "luced": ...}
    protocol: int = PROTOCOL_VERSION

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> Self:
        _check_protocol(d.get("protocol"))
        return super().from_wire(d)

    def _check(self) -> None:
        _check_protocol(self.protocol)


# -- load -----------------------------------------------------------------------------------

COMPUTE_DTYPES = ("float32", "bfloat16", "float16")
KV_CHUNK = 64  # KV Flash: positions per chunk, rows per pool block
ComputeDtype = Literal["float32", "bfloat16", "float16"]
# How a worker holds weight matrices (luced.runtime.qlinear): packed int4 / int8 for the
# weight-only kernels, "auto" per tensor and CPU, "dequant" the exact float path.
WEIGHT_MODES = ("auto", "int4", "int8", "dequant")
# A MoE routing profile's counts (luced.serve.routing_profile): per MoE layer, how often
# each expert was routed to, as ((layer, (count per expert, ...)), ...).
MoeCounts = tuple[tuple[int, tuple[int, ...]], ...]


def _check_weights(frame: Load | LoadExperts) -> None:
    if frame.weights not in WEIGHT_MODES:
        raise frame._fail(
            f"weights must be one of {', '.join(WEIGHT_MODES)}, got {frame.weights!r}"
        )


@_op("load", REQUESTS)
@dataclass(frozen=True)
class Load(Request):
    model: str  # path of the GGUF file
    layers: tuple[int, int]  # [a, b): the layers this worker holds
    dtype: ComputeDtype
    devices: tuple[str, ...]  # one shard per device, in layer order
    kv_capacity: int  # tokens of KV per layer
    owns_embed: bool  # holds the token embedding (accepts `tokens` in forward)
    owns_head: bool  # holds the final norm + LM head (can sample / return logits)
    # Layer indices in (a, b) where the next device's shard starts; len(devices) - 1 of them.
    device_splits: tuple[int, ...] = ()
    # KV Flash: rows of K/V per attention layer (a multiple of KV_CHUNK); 0 = a plain cache
    # of kv_capacity rows. A pooled worker needs the pager's plan in every forward.
    kv_pool: int = 0
    # MoE: routed experts kept per layer (-1: all); the rest are cold, computed by the
    # expert worker through `moe_scratch` (uint8 bytes of a daemon-owned segment) when
    # the daemon links one, else in process. `moe_required`: no in-process fallback.
    moe_hot: int = -1
    moe_scratch: Region | None = None
    moe_required: bool = False
    moe_profile: MoeCounts = ()  # the most routed experts are the hot ones; (): lowest ids
    weights: str = "dequant"  # one of WEIGHT_MODES
    # Logits independent of how tokens are grouped into calls (runtime.model.Model.load).
    batch_invariant: bool = False
    kv_dtype: str = ""  # the K/V rows' dtype; "" = dtype
    # Rows per block of one K/V pool per shard that every sequence's rows live in
    # (runtime.kv_blocks), so sequences may share a prefix's blocks (kv_share); 0: each
    # sequence's K/V contiguous on its own. Not with kv_pool (KV Flash pools per sequence).
    kv_block: int = 0

    def _check(self) -> None:
        if self.kv_block < 0 or (self.kv_block and self.kv_pool):
            raise self._fail(
                f"kv_block must be >= 0 and 0 under kv_pool, got {self.kv_block} "
                f"with kv_pool {self.kv_pool}"
            )
        if self.kv_dtype not in ("", *COMPUTE_DTYPES):
            raise self._fail(f"kv_dtype must be one of {COMPUTE_DTYPES}, got {self.kv_dtype!r}")
        if self.moe_hot < -1:
            raise self._fail(f"moe_hot must be -1 (all) or >= 0, got {self.moe_hot}")
        a, b = self.layers
        _check_weights(self)
        if not 0 <= a < b:
            raise self._fail(f"layers must be [a, b) with 0 <= a < b, got {list(self.layers)}")
        if not self.model:
            raise self._fail("model path is empty")
        if not self.devices:
            raise self._fail("devices is empty")
        if self.kv_capacity < 1:
            raise self._fail(f"kv_capacity must be >= 1, got {self.kv_capacity}")
        if len(self.device_splits) != len(self.devices) - 1:
            raise self._fail(
                f"{len(self.devices)} devices need {len(self.devices) - 1} device_splits, "
                f"got {len(self.device_splits)}"
            )
        bounds = (a, *self.device_splits, b)
        if any(lo >= hi for lo, hi in itertools.pairwise(bounds)):
            raise self._fail(f"device_splits must increase strictly inside {list(self.layers)}")
        if self.kv_pool < 0 or self.kv_pool % KV_CHUNK:
            raise self._fail(f"kv_pool must be 0 or a multiple of {KV_CHUNK}, got {self.kv_pool}")


@_op("load", REPLIES)
@dataclass(frozen=True)
class LoadReply(Reply):
    n_layers: int  # layers in the whole model
    hidden: int
    vocab: int
    layers: tuple[int, int]
    dtype: ComputeDtype
    kv_capacity: int
    load_s: float
    # The loaded layers that keep a recurrent state (Gated DeltaNet) instead of K/V rows:
    # such a state cannot be truncated, only rewound to a kept one (the daemon replays).
    recurrent: tuple[int, ...] = ()
    kv_pool: int = 0  # pool rows per layer; 0: a plain cache
    kv_chunk_bytes: int = 0  # one host-tier record of this worker (all its shards' layers)
    moe_fingerprint: str = ""  # the expert placement (runtime.experts.Placement); "": none
    # What runs the packed matrices and decode attention (runtime.native.describe):
    # "native avx2", "torch", or KERNELS_FALLBACK + ": why" (native wanted, not had).
    kernels: str = ""


KERNELS_FALLBACK = "torch fallback"  # decode runs several times slower than native


# -- forward --------------------------------------------------------------------------------

Want = Literal["sample", "logits", "topk", "hidden", "verify"]
Positions = Literal["last", "all"]

# Output regions by want: (required, optional). Shapes (rows may exceed what is used):
#   ids            int32   [n_out]             sampled (or greedy) token ids
#   logprobs       float32 [n_out]             log-probability of each chosen id
#   topk_ids       int32   [n_out, k]          k = top_logprobs
#   topk_logprobs  float32 [n_out, k]
#   logits         float32 [n_out, vocab]      raw logits after the head's scaling/softcap
#   hidden         float   [n_tokens, hidden]  boundary activations for the next shard
# n_out = 1 for positions="last", n_tokens for positions="all".
# want="verify" (DFlash, temperature > 0): the fed tokens are a drafted block [anchor,
# proposals...]; the worker runs rejection sampling (``runtime/dflash/verify.py``) of the
# proposals against ``draft_probs`` with the request's sampler and writes the step's tokens
# (accepted proposals, then the target's own token) to ``ids`` (and their logprobs, as
# "sample" reports them); the reply's ``accepted`` counts the accepted proposals, so
# ``accepted + 1`` rows are valid. Penalties apply per row, each with its own history.
OUTPUTS: dict[str, tuple[frozenset[str], frozenset[str]]] = {
    "sample": (frozenset({"ids"}), frozenset({"logprobs", "topk_ids", "topk_logprobs"})),
    "logits": (frozenset({"logits"}), frozenset()),
    "topk": (frozenset({"topk_ids", "topk_logprobs"}), frozenset({"logprobs"})),
    "hidden": (frozenset({"hidden"}), frozenset()),
    "verify": (frozenset({"ids"}), frozenset({"logprobs", "topk_ids", "topk_logprobs"})),
}
_OUTPUT_DTYPES = {
    "ids": ("int32",),
    "logprobs": ("float32",),
    "topk_ids": ("int32",),
    "topk_logprobs": ("float32",),
    "logits": ("float32",),
    "hidden": COMPUTE_DTYPES,
}
_OUTPUT_NDIM = {"ids": 1, "logprobs": 1, "topk_ids": 2, "topk_logprobs": 2, "logits": 2}


@_op("forward", REQUESTS)
@dataclass(frozen=True)
class Forward(Request):
    """Run ``n_tokens`` at positions ``start_pos ..`` through this worker's layers.

    Input: ``tokens`` (int32 ``[>= n_tokens]``, for the shard that owns the embedding) or
    ``hidden_in`` (``[>= n_tokens, hidden]``, the previous shard's ``outputs["hidden"]``).
    A later shard may get ``tokens`` beside ``hidden_in``: then they are only the ids fed
    at these positions (its sampler's history for penalties), never embedded.
    Outputs go to ``outputs`` (see ``OUTPUTS``); the worker writes rows ``[0, n_out)``.

    Write ordering (one writer per region at a time; the socket round trip orders the
    memory): the daemon writes ``tokens`` before sending; the previous shard wrote
    ``hidden_in`` before its reply, which came before this frame; this worker writes
    its outputs and ring slots before replying, and nobody reads them before the reply.

    ``start_pos`` must equal the worker's committed KV length (``truncate`` first to roll
    back). After the reply the KV holds ``start_pos + n_tokens`` positions.

    Captures: the output (after the FFN residual) of each layer in ``capture`` goes to
    ``ring`` ``[ring_cap, len(capture), hidden]`` at ``[pos % ring_cap, j]`` for the
    ``j``-th listed layer; every shard gets the whole list and writes the slots of the
    layers it holds, so each slot has exactly one writer.
    """

    n_tokens: int
    start_pos: int
    want: Want
    outputs: dict[str, Region]
    tokens: Region | None = None
    hidden_in: Region | None = None
    positions: Positions = "last"
    sampling: dict[str, int | float | None] = field(default_factory=dict)
    top_logprobs: int = 0
    capture: tuple[int, ...] = ()
    ring: Region | None = None
    draft_probs: Region | None = None  # want="verify": float32 [>= n_tokens - 1, vocab]
    # KV Flash (a worker loaded with kv_pool): the pager's plan for this step, in the
    # daemon's `kvflash` segment (layout: ``luced/engine/kvflash/transport.py``).
    kv_slots: Region | None = None  # int64 [>= n_tokens]: pool row of position start_pos + i
    kv_map: Region | None = None  # int64 [pool]: position each row holds, -1 = none
    kv_moves: Region | None = None  # int64 [m, 4]: (0 out | 1 in, chunk, block, record)
    kv_host: Region | None = None  # uint8 [records, kv_chunk_bytes]: this worker's host tier
    # float32 [2, chunks], written by the worker after the step (policy qk): per chunk, the
    # sum over its scored layers of the chunk's best query-key cosine, and that layer count.
    kv_scores: Region | None = None
    # Keep the recurrent state reached by this forward (a prefix-cache cut point: a later
    # kv_export names it in ``cuts``) until reset, kv_import or a truncate below it.
    keep_state: bool = False
    # Keep the recurrent state after every position of this forward (a DFlash verify
    # block): a truncate inside it then selects the accepted one instead of a replay.
    keep_block_states: bool = False
    # want="sample" / "verify" under a grammar: int32 [>= n_out, ceil(vocab / 32)], bit
    # i % 32 of word i // 32 of row r set when id i may be row r's token (written by the
    # daemon before the frame); the others get -inf before sampling and logprobs.
    allowed: Region | None = None
    # Which of the worker's sequences this step feeds (continuous batching keeps several;
    # each has its own KV, token history and sampler). Truncate, reset, kv_export and
    # kv_import name theirs the same way.
    sequence: int = 0

    @property
    def n_out(self) -> int:
        return 1 if self.positions == "last" else self.n_tokens

    def _check(self) -> None:
        if self.n_tokens < 1 or self.start_pos < 0:
            got = f"{self.n_tokens}, {self.start_pos}"
            raise self._fail(f"need n_tokens >= 1 and start_pos >= 0, got {got}")
        _check_sequence(self)
        _check_input(self)
        _check_outputs(self)
        self._check_sampling()
        self._check_capture()
        self._check_verify()
        _check_allowed(self)
        self._check_kv_flash()

    def _check_sampling(self) -> None:
        _check_sampling_map(self)

    def _check_capture(self) -> None:
        _check_rings(self, self.capture, () if self.ring is None else (self.ring,))
        if self.ring is not None and self.ring.shape[0] < self.n_tokens:
            n = self.n_tokens
            raise self._fail(f"ring holds {self.ring.shape[0]} positions, fewer than n_tokens {n}")

    def _check_verify(self) -> None:
        if self.want != "verify":
            if self.draft_probs is not None:
                raise self._fail('draft_probs is only for want="verify"')
            return
        q = self.draft_probs
        if self.positions != "all" or self.n_tokens < 2 or q is None:
            raise self._fail('want="verify" needs positions="all", n_tokens >= 2 and draft_probs')
        if q.dtype != "float32" or len(q.shape) != 2 or q.shape[0] < self.n_tokens - 1:
            got = f"{q.dtype} {list(q.shape)}"
            raise self._fail(f"draft_probs must be float32 [>= {self.n_tokens - 1}, vocab], {got}")

    def _check_kv_flash(self) -> None:
        _check_kv_plan(self, {name: getattr(self, name) for name in KV_PLAN}, self.n_tokens)


# A KV Flash step's plan as `forward` carries it (fields of that name), and as
# `forward_batch` carries one per sequence (`kv_plans`, maps with these keys).
KV_PLAN = ("kv_slots", "kv_map", "kv_moves", "kv_host", "kv_scores")


def _check_kv_plan(frame: Request, plan: Mapping[str, Region | None], n_tokens: int) -> None:
    slots, table, moves, host, scores = (plan.get(name) for name in KV_PLAN)
    if (slots is None) != (table is None):
        raise frame._fail("kv_slots and kv_map come together")
    if moves is not None and (table is None or host is None):
        raise frame._fail("kv_moves needs kv_map and kv_host")
    if slots is not None and (
        slots.dtype != "int64" or len(slots.shape) != 1 or slots.shape[0] < n_tokens
    ):
        got = f"{slots.dtype} {list(slots.shape)}"
        raise frame._fail(f"kv_slots must be int64 [>= {n_tokens}], got {got}")
    if table is not None and (
        table.dtype != "int64" or len(table.shape) != 1 or table.shape[0] % KV_CHUNK
    ):
        got = f"{table.dtype} {list(table.shape)}"
        raise frame._fail(f"kv_map must be int64 [pool], pool a multiple of {KV_CHUNK}; {got}")
    if moves is not None and (
        moves.dtype != "int64" or len(moves.shape) != 2 or moves.shape[1] != 4
    ):
        got = f"{moves.dtype} {list(moves.shape)}"
        raise frame._fail(f"kv_moves must be int64 [m, 4], got {got}")
    if host is not None and (host.dtype != "uint8" or len(host.shape) != 2):
        got = f"{host.dtype} {list(host.shape)}"
        raise frame._fail(f"kv_host must be uint8 [records, bytes], got {got}")
    if scores is not None and table is None:
        raise frame._fail("kv_scores needs kv_map")
    if scores is not None and (
        scores.dtype != "float32" or len(scores.shape) != 2 or scores.shape[0] != 2
    ):
        got = f"{scores.dtype} {list(scores.shape)}"
        raise frame._fail(f"kv_scores must be float32 [2, chunks], got {got}")


def _check_input(frame: Forward | ForwardBatch) -> None:
    if frame.tokens is None and frame.hidden_in is None:
        raise frame._fail("one of tokens / hidden_in must be given")
    if frame.tokens is not None:
        t = frame.tokens
        if t.dtype != "int32" or len(t.shape) != 1 or t.shape[0] < frame.n_tokens:
            got = f"{t.dtype} {list(t.shape)}"
            raise frame._fail(f"tokens must be int32 [>= {frame.n_tokens}], got {got}")
    if frame.hidden_in is not None:
        h = frame.hidden_in
        if h.dtype not in COMPUTE_DTYPES or len(h.shape) != 2 or h.shape[0] < frame.n_tokens:
            got = f"{h.dtype} {list(h.shape)}"
            raise frame._fail(f"hidden_in must be float [>= {frame.n_tokens}, hidden], got {got}")


def _check_outputs(frame: Forward | ForwardBatch) -> None:
    required, optional = OUTPUTS[frame.want]
    names = set(frame.outputs)
    if frame.top_logprobs < 0:
        raise frame._fail(f"top_logprobs must be >= 0, got {frame.top_logprobs}")
    if frame.want in ("sample", "verify") and frame.top_logprobs:
        required = required | {"topk_ids", "topk_logprobs"}
    if frame.want == "topk" and not frame.top_logprobs:
        raise frame._fail('want="topk" needs top_logprobs >= 1')
    if not required <= names or not names <= required | optional:
        raise frame._fail(
            f'want="{frame.want}" needs outputs {sorted(required)} (optional '
            f"{sorted(optional - required)}), got {sorted(names)}"
        )
    for name, r in frame.outputs.items():
        rows = frame.n_tokens if name == "hidden" else frame.n_out
        ndim = _OUTPUT_NDIM.get(name, 2)
        if r.dtype not in _OUTPUT_DTYPES[name] or len(r.shape) != ndim or r.shape[0] < rows:
            raise frame._fail(
                f"outputs.{name} must be {'/'.join(_OUTPUT_DTYPES[name])} with {ndim} "
                f"dim(s) and >= {rows} rows, got {r.dtype} {list(r.shape)}"
            )
        if name.startswith("topk_") and r.shape[1] != frame.top_logprobs:
            k = frame.top_logprobs
            raise frame._fail(f"outputs.{name} needs {k} columns, got {r.shape[1]}")


def _check_allowed(frame: Forward | ForwardBatch) -> None:
    a = frame.allowed
    if a is None:
        return
    if frame.want not in ("sample", "verify"):
        raise frame._fail('allowed is only for want="sample" / "verify"')
    if a.dtype != "int32" or len(a.shape) != 2 or a.shape[0] < frame.n_out:
        got = f"{a.dtype} {list(a.shape)}"
        raise frame._fail(f"allowed must be int32 [>= {frame.n_out}, words], got {got}")


def _check_sequence(frame: Forward | Truncate | Reset | KVExport | KVImport | KVShare) -> None:
    if frame.sequence < 0:
        raise frame._fail(f"sequence must be >= 0, got {frame.sequence}")


def _check_sampling_map(frame: Forward | DraftBlock) -> None:
    """The map must be a ``SamplingParams`` wire form (the one definition of the fields)."""
    try:
        SamplingParams.from_wire(frame.sampling)
    except ValueError as e:
        where = "" if str(e).startswith("unknown") else "sampling."
        raise frame._fail(f"{where}{e}") from None


@_op("forward", REPLIES)
@dataclass(frozen=True)
class ForwardReply(Reply):
    n_out: int  # rows written to each output region
    position: int  # committed KV length after the forward
    elapsed_us: int  # worker-side compute time
    accepted: int | None = None  # want="verify": proposals accepted (ids rows: accepted + 1)
    # MoE cold experts in this forward: calls to the expert worker, calls redone in process
    # after it failed, bytes through the scratch (both ways)
    moe_remote_calls: int = 0
    moe_fallbacks: int = 0
    moe_remote_bytes: int = 0


def _check_rings(frame: Request, capture: tuple[int, ...], rings: tuple[Region, ...]) -> None:
    """Capture layers and the feature ring(s) they go to: both or neither, each ring float
    [ring_cap >= 1, len(capture), hidden]."""
    if not capture:
        if rings:
            raise frame._fail("ring given without capture layers")
        return
    if not rings:
        raise frame._fail("capture layers given without a ring region")
    if len(set(capture)) != len(capture) or min(capture) < 0:
        raise frame._fail(f"capture layers must be distinct and >= 0: {list(capture)}")
    for r in rings:
        shape_ok = len(r.shape) == 3 and r.shape[0] >= 1 and r.shape[1] == len(capture)
        if not shape_ok or r.dtype not in COMPUTE_DTYPES:
            raise frame._fail(
                f"ring must be float [ring_cap, {len(capture)}, hidden], got "
                f"{r.dtype} {list(r.shape)}"
            )


# -- forward_batch --------------------------------------------------------------------------

BatchWant = Literal["sample", "hidden"]


@_op("forward_batch", REQUESTS)
@dataclass(frozen=True)
class ForwardBatch(Request):
    """Run several sequences' tokens through this worker's layers in one pass (continuous
    batching): every linear layer sees all ``n_tokens`` rows at once, attention and
    recurrent state run per sequence over its own KV.

    The batch description lives in shared memory: ``batch`` int32 ``[>= n_sequences, 4]``
    holds (sequence, start_pos, n_tokens, n_out) per sequence, in the order of their rows
    in ``tokens`` / ``hidden_in`` / ``outputs["hidden"]``. Each start_pos must equal that
    sequence's committed KV length (a new sequence starts at 0); a sequence appears once.
    ``want="sample"``: a sequence with n_out 1 gets the token after its last row, one with
    n_out = n_tokens a token after every row (a greedy verify block, as ``forward``'s
    positions="all"), drawn with ``sampling[i]`` and that sequence's kept sampler (as
    ``forward`` draws); the output rows are the sequences' in order, ``n_rows_out`` in all.
    ``want="hidden"``: the rows for the next shard. Write ordering as ``forward``.
    ``allowed``: a grammar's bitmask per output row (all bits set where none applies), as
    ``forward``'s. Captures (a DFlash draft's features): as ``forward``'s, with ``rings``
    holding each sequence's own ring in batch order; a sequence's n_tokens must fit its
    ring. A failed batch leaves every sequence's KV as it was.
    """

    n_sequences: int
    n_tokens: int  # rows: the sum of the sequences' n_tokens
    batch: Region
    want: BatchWant
    outputs: dict[str, Region]
    tokens: Region | None = None
    hidden_in: Region | None = None
    sampling: tuple[dict[str, int | float | None], ...] = ()
    top_logprobs: int = 0
    allowed: Region | None = None
    n_rows_out: int = 0  # output rows: the sum of the n_out column; 0 = one per sequence
    capture: tuple[int, ...] = ()
    rings: tuple[Region, ...] = ()  # one per sequence, in batch order
    # KV Flash: each sequence's plan (keys of KV_PLAN, as `forward`'s fields), batch order.
    kv_plans: tuple[dict[str, Region], ...] = ()

    @property
    def n_out(self) -> int:
        return self.n_rows_out or self.n_sequences

    def _check(self) -> None:
        if not 1 <= self.n_sequences <= self.n_out <= self.n_tokens:
            got = f"{self.n_sequences}, {self.n_out}, {self.n_tokens}"
            raise self._fail(f"need 1 <= n_sequences <= n_rows_out <= n_tokens, got {got}")
        b = self.batch
        if b.dtype != "int32" or len(b.shape) != 2 or b.shape[1] != 4:
            raise self._fail(f"batch must be int32 [n, 4], got {b.dtype} {list(b.shape)}")
        if b.shape[0] < self.n_sequences:
            raise self._fail(f"batch holds {b.shape[0]} rows, fewer than {self.n_sequences}")
        _check_input(self)
        _check_outputs(self)
        _check_allowed(self)
        _check_rings(self, self.capture, self.rings)
        if self.rings and len(self.rings) != self.n_sequences:
            n = self.n_sequences
            raise self._fail(f"rings needs one ring per sequence ({n}), got {len(self.rings)}")
        if self.kv_plans and len(self.kv_plans) != self.n_sequences:
            n, got = self.n_sequences, len(self.kv_plans)
            raise self._fail(f"kv_plans needs one plan per sequence ({n}), got {got}")
        for plan in self.kv_plans:
            unknown = plan.keys() - set(KV_PLAN)
            if unknown or "kv_slots" not in plan:
                raise self._fail(
                    f"a sequence's KV plan has kv_slots, kv_map and maybe "
                    f"{', '.join(KV_PLAN[2:])}; got {sorted(plan)}"
                )
            _check_kv_plan(self, plan, 1)
        if self.want == "sample" and len(self.sampling) != self.n_sequences:
            n = self.n_sequences
            raise self._fail(f"sampling needs one map per sequence ({n}), got {len(self.sampling)}")
        for i, params in enumerate(self.sampling):
            try:
                SamplingParams.from_wire(params)
            except ValueError as e:
                raise self._fail(f"sampling[{i}]: {e}") from None


@_op("forward_batch", REPLIES)
@dataclass(frozen=True)
class ForwardBatchReply(Reply):
    positions: tuple[int, ...]  # each sequence's committed KV length after the batch
    elapsed_us: int
    moe_remote_calls: int = 0  # as ForwardReply's
    moe_fallbacks: int = 0
    moe_remote_bytes: int = 0


# -- load_experts, expert_mix ---------------------------------------------------------------


@_op("load_experts", REQUESTS)
@dataclass(frozen=True)
class LoadExperts(Request):
    """Hold the cold experts of a target that keeps `hot` per layer (planned as the target
    plans it: ``runtime.experts.plan``), read from the GGUF's mapping."""

    model: str
    dtype: ComputeDtype
    device: str
    hot: int
    moe_profile: MoeCounts = ()  # as the target's load has it
    weights: str = "dequant"  # as the target's load has it (one of WEIGHT_MODES)

    def _check(self) -> None:
        if self.hot < 0:
            raise self._fail(f"hot must be >= 0, got {self.hot}")
        _check_weights(self)


@_op("load_experts", REPLIES)
@dataclass(frozen=True)
class LoadExpertsReply(Reply):
    n_layers: int  # MoE layers with experts held here
    n_held: int  # experts held, over all layers
    fingerprint: str  # of the target's placement it complements (load's moe_fingerprint)
    load_s: float


@_op("expert_mix", REQUESTS)
@dataclass(frozen=True)
class ExpertMix(Request):
    """One MoE layer's cold experts for n rows: x [n, hidden], ids [n, k] int32 (this
    worker's local indices, -1 skipped), weights [n, k] float32. The answer overwrites x."""

    layer: int
    x: Region
    ids: Region
    weights: Region

    def _check(self) -> None:
        n = self.x.shape[0] if len(self.x.shape) == 2 else -1
        if n < 0 or self.ids.shape != self.weights.shape or len(self.ids.shape) != 2:
            raise self._fail("x must be [n, hidden], ids and weights the same [n, k]")
        if self.ids.shape[0] != n:
            raise self._fail(f"{n} rows of x but {self.ids.shape[0]} of ids")
        if self.ids.dtype != "int32" or self.weights.dtype != "float32":
            raise self._fail("ids must be int32 and weights float32")


@_op("expert_mix", REPLIES)
@dataclass(frozen=True)
class ExpertMixReply(Reply):
    elapsed_us: int


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
    sampling: dict[str, int | float | None] = field(default_factory=dict)

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


def _check_kv_regions(frame: KVExport | KVImport) -> None:
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
    """

    position: int
    regions: dict[str, Region]
    cuts: tuple[int, ...] = ()
    sequence: int = 0

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
    """

    position: int
    regions: dict[str, Region]
    tokens: Region
    sequence: int = 0

    def _check(self) -> None:
        _check_sequence(self)
        if self.position < 0:
            raise self._fail(f"position must be >= 0, got {self.position}")
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


# -- truncate, reset, stats, shutdown -------------------------------------------------------


@_op("truncate", REQUESTS)
@dataclass(frozen=True)
class Truncate(Request):
    """Roll the KV cache of every shard in this worker back to ``position`` tokens."""

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


@_op("stats", REQUESTS)
@dataclass(frozen=True)
class Stats(Request):
    pass


@_op("stats", REPLIES)
@dataclass(frozen=True)
class StatsReply(Reply):
    stats: dict[str, int | float | str]  # flat: "rss_bytes", "forward_count", ...


@_op("shutdown", REQUESTS)
@dataclass(frozen=True)
class Shutdown(Request):
    """Reply, then exit. The only way a worker ends (it ignores SIGINT / SIGTERM)."""


@_op("shutdown", REPLIES)
@dataclass(frozen=True)
class ShutdownReply(Reply):
    pass


# Requests that may take minutes (the first one starts the worker's backend: torch's import;
# a load reads a whole model): the worker sends progress notes until it replies.
SLOW: tuple[type[Request], ...] = (Hello, Load, LoadDraft, LoadExperts)
