"""The forward frame: one step's spans of one or several sequences (section "forward" of
the package docstring)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

from luced.ipc.frames.base import (
    COMPUTE_DTYPES,
    REPLIES,
    REQUESTS,
    Reply,
    Request,
    _check_rings,
    _check_sampling_map,
    _op,
)
from luced.ipc.regions import Region
from luced.ipc.typed import Record
from luced.sampling_params import SamplingWire

# -- forward --------------------------------------------------------------------------------

Want = Literal["sample", "logits", "hidden"]
# A span's pooled row (`Span.pool`): the sum of its rows' last-layer states after the
# final norm, its first row's or its last row's ("": none).
Pool = Literal["", "sum", "first", "last"]

# Output regions by want: (required, optional). Shapes (rows may exceed what is used):
#   ids            int32   [n_out]             sampled (or greedy) token ids
#   logprobs       float32 [n_out]             log-probability of each chosen id
#   topk_ids       int32   [n_out, k]          k = top_logprobs
#   topk_logprobs  float32 [n_out, k]
#   logits         float32 [n_out, vocab]      raw logits after the head's scaling/softcap
#   hidden         float   [n_tokens, hidden]  boundary activations for the next shard
#   embeddings     float32 [n_pooled, hidden]  one row per span with a `pool`, in span order
# n_out is the sum of the spans' n_out: each span's output rows follow the previous span's.
# `embeddings` comes with "sample" or "logits" whenever a span pools (required then).
OUTPUTS: dict[str, tuple[frozenset[str], frozenset[str]]] = {
    "sample": (
        frozenset({"ids"}),
        frozenset({"logprobs", "topk_ids", "topk_logprobs", "embeddings"}),
    ),
    "logits": (frozenset({"logits"}), frozenset({"embeddings"})),
    "hidden": (frozenset({"hidden"}), frozenset()),
}
_OUTPUT_DTYPES = {
    "ids": ("int32",),
    "logprobs": ("float32",),
    "topk_ids": ("int32",),
    "topk_logprobs": ("float32",),
    "logits": ("float32",),
    "hidden": COMPUTE_DTYPES,
    "embeddings": ("float32",),
}
_OUTPUT_NDIM = {"ids": 1, "logprobs": 1, "topk_ids": 2, "topk_logprobs": 2, "logits": 2}


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

    ``pool`` (an embedding's span, with ``n_out`` 0): the last shard writes one row of
    ``outputs["embeddings"]`` from the span's last-layer states after the final norm: their
    float32 sum ("sum"; the daemon adds a long input's chunks and divides), the span's
    first row ("first": [CLS], in the span from position 0) or its last ("last").
    """

    OMIT_DEFAULTS: ClassVar[bool] = True  # a decode step's span is mostly defaults

    sequence: int
    start: int
    n: int
    n_out: int = 1
    sampling: SamplingWire = field(default_factory=dict)
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
    pool: Pool = ""
    # A block-pool load (Load.kv_block): what the daemon's table of this sequence gained
    # for this step (engine/kv/blocks.py has the rules): copy-on-write copies (logical
    # block, src, dst), applied first, then the pool blocks appended; `table` is the
    # table's length after both, which the worker checks (0: no block pool).
    copies: tuple[tuple[int, int, int], ...] = ()
    blocks: tuple[int, ...] = ()
    table: int = 0
    # KV Flash over the block pool: the host-tier moves the daemon made in this sequence's
    # table, applied in order before `copies` and `blocks`: (0 out: pool block -> host
    # record, the entry becomes paged out | 1 in: host record -> pool block, logical block,
    # pool block, host record of `Forward.kv_host`).
    moves: tuple[tuple[int, int, int, int], ...] = ()
    # float32 [2, blocks], written after the step (a load with kv_scored): per logical
    # block, the sum over this worker's scored layers of its best query-key cosine, and
    # that layer count (the `qk` policy's scores).
    kv_scores: Region | None = None

    def _check(self) -> None:
        if self.sequence < 0 or self.start < 0 or self.n < 1 or self.q_row < 0:
            got = f"sequence {self.sequence}, start {self.start}, n {self.n}, q_row {self.q_row}"
            raise self._fail(f"need sequence, start, q_row >= 0 and n >= 1; got {got}")
        if self.n_out not in (0, 1, self.n):
            raise self._fail(f"n_out must be 0, 1 or n ({self.n}), got {self.n_out}")
        if self.verify and (self.n < 2 or self.n_out != self.n):
            raise self._fail("a verify span feeds n >= 2 tokens with n_out = n")
        if self.pool and self.n_out:
            raise self._fail(f"a pooling span samples nothing: n_out must be 0, got {self.n_out}")
        if self.ring is not None and self.ring.shape[0] < self.n:
            raise self._fail(f"its ring holds {self.ring.shape[0]} positions, fewer than {self.n}")
        _check_table(self)
        _check_moves(self)
        _check_sampling_map(self)


def _check_table(span: Span) -> None:
    """The table fields: blocks and copies only with a table, that many entries at least,
    copies at logical blocks inside it, pool blocks >= 0 and each named once."""
    if span.table <= 0:
        if span.blocks or span.copies or span.table < 0:
            raise span._fail(f"blocks and copies need a table length >= 1, got {span.table}")
        return
    if len(span.blocks) > span.table:
        raise span._fail(f"{len(span.blocks)} blocks appended to a table of {span.table}")
    named = list(span.blocks) + [dst for _, _, dst in span.copies]
    if min(named, default=0) < 0 or len(set(named)) != len(named):
        raise span._fail(f"pool blocks must be >= 0 and new ones distinct, got {named}")
    logical = [j for j, _, _ in span.copies]
    if any(not 0 <= j < span.table - len(span.blocks) for j in logical) or any(
        src < 0 for _, src, _ in span.copies
    ):
        raise span._fail(f"copies must name blocks of the table before growth: {span.copies}")
    if len(set(logical)) != len(logical):
        raise span._fail(f"a logical block is copied twice: {logical}")


def _check_moves(span: Span) -> None:
    """Moves: of a table, each (0 | 1, logical block before growth, pool block, record)
    with every number >= 0; kv_scores float32 [2, blocks]."""
    if span.moves and span.table <= 0:
        raise span._fail("moves need a block table (table >= 1)")
    for move in span.moves:
        kind, j, block, record = move
        if kind not in (0, 1) or min(j, block, record) < 0 or j >= span.table - len(span.blocks):
            raise span._fail(
                f"a move is (0 out | 1 in, logical block of the table before growth, pool "
                f"block >= 0, record >= 0), got {list(move)}"
            )
    r = span.kv_scores
    if r is not None and (r.dtype != "float32" or len(r.shape) != 2 or r.shape[0] != 2):
        raise span._fail(f"kv_scores must be float32 [2, blocks], got {r.dtype} {list(r.shape)}")


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

    OMIT_DEFAULTS: ClassVar[bool] = True

    spans: tuple[Span, ...]
    want: Want
    outputs: dict[str, Region]
    tokens: Region | None = None
    hidden_in: Region | None = None
    top_logprobs: int = 0
    capture: tuple[int, ...] = ()
    draft_probs: Region | None = None  # float32 [>= q rows, vocab]: verify spans' q rows
    allowed: Region | None = None  # int32 [>= n_out, ceil(vocab / 32)]
    # Decode one step ahead (runtime.lookahead): after replying, feed each span's sampled
    # token and write that step's rows here, regions like `outputs` (none: no step ahead).
    ahead: dict[str, Region] = field(default_factory=dict)
    # This worker's host tier, uint8 [records, LoadReply.kv_record_bytes]: the records the
    # spans' moves name (required when one has moves).
    kv_host: Region | None = None

    @property
    def n_tokens(self) -> int:
        return sum(s.n for s in self.spans)

    @property
    def n_out(self) -> int:
        return sum(s.n_out for s in self.spans)

    @property
    def n_pooled(self) -> int:
        return sum(bool(s.pool) for s in self.spans)

    def _check(self) -> None:
        if not self.spans:
            raise self._fail("a forward needs at least one span")
        sequences = [s.sequence for s in self.spans]
        if len(set(sequences)) != len(sequences):
            raise self._fail(f"a sequence appears twice: {sequences}")
        if self.want == "hidden" and self.n_pooled:
            raise self._fail('a pooling span goes to the last shard (want "sample" or "logits")')
        _check_input(self)
        _check_outputs(self)
        _check_rings(self, self.capture, tuple(s.ring for s in self.spans if s.ring))
        if self.capture and any(s.ring is None for s in self.spans):
            raise self._fail("with capture layers every span names its ring")
        if self.want != "sample" and any(s.verify for s in self.spans):
            raise self._fail('a verify span needs want="sample"')
        self._check_verify()
        _check_allowed(self)
        _check_host(self)
        if self.ahead and (
            self.want != "sample"
            or {k: r.shape for k, r in self.ahead.items()}
            != {k: r.shape for k, r in self.outputs.items()}
        ):
            raise self._fail('ahead needs want="sample" and regions shaped as the outputs')

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


def _check_host(frame: Forward) -> None:
    host = frame.kv_host
    if host is None:
        if any(s.moves for s in frame.spans):
            raise frame._fail("a span with moves needs kv_host (the host tier's records)")
        return
    if host.dtype != "uint8" or len(host.shape) != 2:
        raise frame._fail(
            f"kv_host must be uint8 [records, bytes], got {host.dtype} {list(host.shape)}"
        )


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
    if frame.n_pooled:
        required = required | {"embeddings"}
    if not required <= names or not names <= required | optional:
        raise frame._fail(
            f'want="{frame.want}" needs outputs {sorted(required)} (optional '
            f"{sorted(optional - required)}), got {sorted(names)}"
        )
    for name, r in frame.outputs.items():
        rows = {"hidden": frame.n_tokens, "embeddings": frame.n_pooled}.get(name, frame.n_out)
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


@_op("forward", REPLIES)
@dataclass(frozen=True)
class ForwardReply(Reply):
    OMIT_DEFAULTS: ClassVar[bool] = True

    positions: tuple[int, ...]  # each span's sequence's committed KV length after the forward
    elapsed_us: int  # worker-side compute time
    # Per span: proposals its verify accepted (ids rows: accepted + 1); -1 for other spans.
    accepted: tuple[int, ...] = ()
    # MoE cold experts in this forward: calls to the expert worker, calls redone in process
    # after it failed, bytes through the scratch (both ways)
    moe_remote_calls: int = 0
    moe_fallbacks: int = 0
    moe_remote_bytes: int = 0
