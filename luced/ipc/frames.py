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
    forward   spans (sequence, start, n, n_out, sampling, verify, q_row, keep_state,
              keep_block_states, ring, kv_plan), tokens | hidden_in, want, outputs,
              top_logprobs, capture, draft_probs, allowed
                                            -> positions, elapsed_us, accepted
    load_draft path, dtype, device, target  -> capture_layers, block_size, mask_token_id,
                                               hidden, load_s
    draft     ring, committed, anchor, outputs, block_size, mask_token_id, ctx_window,
              sampling, sequence            -> n, ctx, elapsed_us
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
16: one ``forward`` verb for one sequence or several (``spans``, ``Span``), replacing
``forward_batch``; a span may start below its sequence's committed length (a roll back);
want="topk" and ``positions`` removed (``Span.n_out``), verify is a span's flag;
``draft`` ``sequence`` (a kept draft sampler per sequence).

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

PROTOCOL_VERSION = 16

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

Want = Literal["sample", "logits", "hidden"]

# Output regions by want: (required, optional). Shapes (rows may exceed what is used):
#   ids            int32   [n_out]             sampled (or greedy) token ids
#   logprobs       float32 [n_out]             log-probability of each chosen id
#   topk_ids       int32   [n_out, k]          k = top_logprobs
#   topk_logprobs  float32 [n_out, k]
#   logits         float32 [n_out, vocab]      raw logits after the head's scaling/softcap
#   hidden         float   [n_tokens, hidden]  boundary activations for the next shard
# n_out is the sum of the spans' n_out: each span's output rows follow the previous span's.
OUTPUTS: dict[str, tuple[frozenset[str], frozenset[str]]] = {
    "sample": (frozenset({"ids"}), frozenset({"logprobs", "topk_ids", "topk_logprobs"})),
    "logits": (frozenset({"logits"}), frozenset()),
    "hidden": (frozenset({"hidden"}), frozenset()),
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
# A KV Flash step's plan for one sequence (`Span.kv_plan`'s keys), in the daemon's
# `kvflash` segment (layout: ``luced/engine/kvflash/transport.py``):
#   kv_slots   int64 [>= n]: pool row of position start + i
#   kv_map     int64 [pool]: position each row holds, -1 = none
#   kv_moves   int64 [m, 4]: (0 out | 1 in, chunk, block, record)
#   kv_host    uint8 [records, kv_chunk_bytes]: this worker's host tier
#   kv_scores  float32 [2, chunks], written by the worker after the step (policy qk): per
#              chunk, the sum over its scored layers of the chunk's best query-key cosine,
#              and that layer count
KV_PLAN = ("kv_slots", "kv_map", "kv_moves", "kv_host", "kv_scores")


@dataclass(frozen=True)
class Span(Record):
    """One sequence's rows in a ``forward``: ``n`` tokens at positions ``start ..``.

    ``start`` may lie below the sequence's committed KV length: the sequence is rolled back
    there first (a DFlash verify's rejected rows; a recurrent state kept per position is
    selected, else ``start`` must be where one is kept). A sequence the worker does not
    hold starts empty, at 0.

    ``n_out``: 0 feeds only (a prompt chunk before the last), 1 gives the row after the last
    token, ``n`` a row after every token (a verify window, or logits of every position).
    ``sampling`` is the sequence's ``SamplingParams`` wire map: its kept sampler draws with
    it (a seeded generator draws on across steps). ``verify``: the tokens are a drafted
    window [anchor, proposals...]; the worker rejection-samples the proposals against the
    draft's q (``Forward.draft_probs`` rows ``q_row ..``) and writes the step's tokens (the
    accepted proposals, then its own), ``accepted + 1`` rows (``ForwardReply.accepted``).
    """

    sequence: int
    start: int
    n: int
    n_out: int = 1
    sampling: dict[str, int | float | None] = field(default_factory=dict)
    verify: bool = False
    q_row: int = 0
    # Keep the recurrent state reached by this span (a prefix-cache cut point: a later
    # kv_export names it in ``cuts``) until reset, kv_import or a roll back below it.
    keep_state: bool = False
    # Keep the recurrent state after every position (a DFlash verify window): a roll back
    # inside it then selects the accepted one instead of a replay.
    keep_block_states: bool = False
    # The sequence's feature ring (DFlash captures), float [ring_cap, len(capture), hidden].
    ring: Region | None = None
    kv_plan: dict[str, Region] = field(default_factory=dict)  # KV Flash (keys of KV_PLAN)

    def _check(self) -> None:
        if self.sequence < 0 or self.start < 0 or self.n < 1 or self.q_row < 0:
            got = f"sequence {self.sequence}, start {self.start}, n {self.n}, q_row {self.q_row}"
            raise self._fail(f"need sequence, start, q_row >= 0 and n >= 1; got {got}")
        if self.n_out not in (0, 1, self.n):
            raise self._fail(f"n_out must be 0, 1 or n ({self.n}), got {self.n_out}")
        if self.verify and (self.n < 2 or self.n_out != self.n):
            raise self._fail("a verify span feeds n >= 2 tokens with n_out = n")
        if self.ring is not None and self.ring.shape[0] < self.n:
            raise self._fail(f"its ring holds {self.ring.shape[0]} positions, fewer than {self.n}")
        unknown = self.kv_plan.keys() - set(KV_PLAN)
        if unknown:
            raise self._fail(f"kv_plan keys are among {list(KV_PLAN)}; got {sorted(unknown)}")
        _check_kv_plan(self, self.kv_plan, self.n)
        _check_sampling_map(self)


@_op("forward", REQUESTS)
@dataclass(frozen=True)
class Forward(Request):
    """Run the spans' tokens through this worker's layers in one pass: one sequence's
    prompt chunk, decode token or verify window, or several sequences' at once (continuous
    batching). Linear layers see the rows of every span; attention and recurrent state run
    per sequence over its own KV.

    Input: ``tokens`` (int32 ``[>= n_tokens]``, for the shard that owns the embedding) or
    ``hidden_in`` (``[>= n_tokens, hidden]``, the previous shard's ``outputs["hidden"]``),
    the spans' rows one after another. A later shard may get ``tokens`` beside
    ``hidden_in``: then they are only the ids fed (its samplers' history for penalties).
    ``want="hidden"`` writes every row for the next shard; ``"sample"`` each span's output
    rows (``Span.n_out``) drawn by its sampler; ``"logits"`` those rows' logits.
    ``allowed``: a grammar's bitmask per output row (every bit set where none applies):
    bit i % 32 of word i // 32 of row r is set when id i may be row r's token.

    Write ordering (one writer per region at a time; the socket round trip orders the
    memory): the daemon writes ``tokens``, ``allowed`` and q rows before sending; the
    previous shard wrote ``hidden_in`` before its reply, which came before this frame; this
    worker writes its outputs and ring slots before replying, and nobody reads them before
    the reply.

    Captures: the output (after the FFN residual) of each layer in ``capture`` goes to each
    span's ``ring`` at ``[pos % ring_cap, j]`` for the ``j``-th listed layer; every shard
    gets the whole list and writes the slots of the layers it holds, so each slot has
    exactly one writer. All or nothing: a failure leaves every sequence's KV at its span's
    start.
    """

    spans: tuple[Span, ...]
    want: Want
    outputs: dict[str, Region]
    tokens: Region | None = None
    hidden_in: Region | None = None
    top_logprobs: int = 0
    capture: tuple[int, ...] = ()
    draft_probs: Region | None = None  # float32 [>= q rows, vocab]: verify spans' q rows
    allowed: Region | None = None  # int32 [>= n_out, ceil(vocab / 32)]

    @property
    def n_tokens(self) -> int:
        return sum(s.n for s in self.spans)

    @property
    def n_out(self) -> int:
        return sum(s.n_out for s in self.spans)

    def _check(self) -> None:
        if not self.spans:
            raise self._fail("a forward needs at least one span")
        sequences = [s.sequence for s in self.spans]
        if len(set(sequences)) != len(sequences):
            raise self._fail(f"a sequence appears twice: {sequences}")
        _check_input(self)
        _check_outputs(self)
        _check_rings(self, self.capture, tuple(s.ring for s in self.spans if s.ring))
        if self.capture and any(s.ring is None for s in self.spans):
            raise self._fail("with capture layers every span names its ring")
        if self.want != "sample" and any(s.verify for s in self.spans):
            raise self._fail('a verify span needs want="sample"')
        self._check_verify()
        _check_allowed(self)

    def _check_verify(self) -> None:
        q = self.draft_probs
        ends = [s.q_row + s.n - 1 for s in self.spans if s.verify]
        if not ends:
            if q is not None:
                raise self._fail("draft_probs without a verify span")
            return
        if q is None or q.dtype != "float32" or len(q.shape) != 2 or q.shape[0] < max(ends):
            got = "none" if q is None else f"{q.dtype} {list(q.shape)}"
            raise self._fail(f"draft_probs must be float32 [>= {max(ends)}, vocab], got {got}")


def _check_kv_plan(frame: Record, plan: Mapping[str, Region | None], n_tokens: int) -> None:
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


def _check_input(frame: Forward) -> None:
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


def _check_outputs(frame: Forward) -> None:
    required, optional = OUTPUTS[frame.want]
    names = set(frame.outputs)
    if frame.top_logprobs < 0:
        raise frame._fail(f"top_logprobs must be >= 0, got {frame.top_logprobs}")
    if frame.want == "sample" and frame.top_logprobs:
        required = required | {"topk_ids", "topk_logprobs"}
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


def _check_allowed(frame: Forward) -> None:
    a = frame.allowed
    if a is None:
        return
    if frame.want != "sample":
        raise frame._fail('allowed is only for want="sample"')
    if a.dtype != "int32" or len(a.shape) != 2 or a.shape[0] < frame.n_out:
        got = f"{a.dtype} {list(a.shape)}"
        raise frame._fail(f"allowed must be int32 [>= {frame.n_out}, words], got {got}")


def _check_sequence(frame: Truncate | Reset | KVExport | KVImport | KVShare) -> None:
    if frame.sequence < 0:
        raise frame._fail(f"sequence must be >= 0, got {frame.sequence}")


def _check_sampling_map(frame: Span | DraftBlock) -> None:
    """The map must be a ``SamplingParams`` wire form (the one definition of the fields)."""
    try:
        SamplingParams.from_wire(frame.sampling)
    except ValueError as e:
        where = "" if str(e).startswith("unknown") else "sampling."
        raise frame._fail(f"{where}{e}") from None


@_op("forward", REPLIES)
@dataclass(frozen=True)
class ForwardReply(Reply):
    positions: tuple[int, ...]  # each span's sequence's committed KV length after the forward
    elapsed_us: int  # worker-side compute time
    # Per span: proposals its verify accepted (ids rows: accepted + 1); -1 for other spans.
    accepted: tuple[int, ...] = ()
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
