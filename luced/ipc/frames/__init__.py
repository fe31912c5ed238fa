"""Every control frame between the daemon and its workers, with its fields.

Wire format: one msgpack map per frame (``use_bin_type=True`` / ``raw=False``, strict
types, no extension types, no pickle; ``codec.py``), sent length-prefixed by
``channel.py``::

    request   {"op": str, "seq": int, ...fields of the op}
    reply     {"seq": int, "ok": true, ...fields of the op's reply}
    failure   {"seq": int, "ok": false, "error": str}
    progress  {"seq": int, "progress": str}   (any number, before the reply)

``seq`` is chosen by the sender of a request and echoed in its reply. The frames sent at
every step (``forward``, its spans and its reply: ``Record.OMIT_DEFAULTS``) leave fields at
their defaults out of their maps; the receiver fills them back. Bulk data never travels in
a frame: fields carry ``Region`` maps (segment, offset, shape, dtype) naming shared memory
(see ``regions.py``). A frame is at most ``codec.MAX_FRAME_BYTES``.

The ops (request fields -> reply fields):

    hello     instance, protocol, files     -> protocol, pid, group, devices, versions, store,
                                               prefix_cache_bytes
    load      model, layers=[a, b), dtype, devices, kv_capacity, owns_embed, owns_head,
              device_splits, kv_block, kv_blocks, kv_scored
                                            -> n_layers, hidden, vocab, layers, dtype,
                                               kv_capacity, load_s, recurrent,
                                               kv_record_bytes
    forward   spans (sequence, start, n, n_out, sampling, verify, q_row, keep_state,
              keep_block_states, ring, pool, copies, blocks, table, moves,
              kv_scores), tokens | hidden_in, want, outputs,
              top_logprobs, capture, draft_probs, allowed, kv_host
                                            -> positions, elapsed_us, accepted
    load_draft path, dtype, device, target  -> capture_layers, block_size, mask_token_id,
                                               hidden, load_s
    draft     ring, committed, anchor, outputs, block_size, mask_token_id, ctx_window,
              sampling, sequence            -> n, ctx, elapsed_us
    kv_layout                               -> tensors, dtype, states
    kv_export position, regions, cuts,      -> position, elapsed_us
              store
    kv_import position, regions, tokens,    -> position, elapsed_us
              store, blocks
    kv_forget ids                           -> dropped
    kv_share  sequence, source, position    -> position
    kv_page   sequence, moves, kv_host,     -> paged
              tokens, states, kv_states
    kv_files  action, model, part, kv_host, -> disk, done, keys, parents, tokens, more,
              records, keys, parents,          gone
              tokens, after
    truncate  position                      -> position
    reset                                   -> (nothing)
    stats                                   -> stats
    shutdown                                -> (nothing)
    ping                                    -> (nothing)
    link      hop, generation, rank, store, address, timeout_s
                                            -> elapsed_us

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
a second that it is still at work, so the daemon bounds its silence, not its time;
16: a ``sampling`` map may carry ``logit_bias`` ({"token id": bias}, a nested map);
17: one ``forward`` verb for one sequence or several (``spans``, ``Span``), replacing
``forward_batch``; a span may start below its sequence's committed length (a roll back);
want="topk" and ``positions`` removed (``Span.n_out``), verify is a span's flag;
``draft`` ``sequence`` (a kept draft sampler per sequence);
18: ``Span.pool`` and the ``embeddings`` output: a span may give one pooled row of its
last-layer states (their sum, its first or its last row) instead of sampled rows.
19: workers on other hosts (``frames/remote.py``): ``hello`` ``files`` (each model file's
size and hash) and its reply's ``store``; ``ping``; ``link`` (a hop: a torch.distributed
group of two); the envelope's ``carry`` (regions put, got and relayed beside a request)
and a reply's ``carried`` (the bytes of the regions got); ``load`` ``moe_link`` and
``link`` ``serve`` (cold experts over a hop).
20: ``kv_export`` / ``kv_import`` ``store`` and ``kv_forget``: a worker on another host
keeps its layers' prefix-cache rows in its own store, in its memory and on its disk;
``forward``, its spans and its reply leave fields at their defaults off the wire.
21: ``load`` ``decode_graphs`` (decode steps through a captured fixed-shape step).
22: ``load`` ``decode_graphs`` ``compile`` (the captured step compiled by torch.compile).
23: the daemon keeps the K/V block tables (``engine/kv/blocks.py``): ``load``
``kv_blocks`` (the pool's block count); a ``Span``'s ``copies``, ``blocks`` and ``table``
(what its table gained this step, and its length after, checked by the worker);
``kv_import`` ``blocks`` (the daemon's blocks for the imported rows); the ``truncate``
verb releases the blocks wholly past its position, a span's roll back none.
24: KV Flash over the block pool: a ``Span``'s ``moves`` (blocks paged out to host records
and back, before its table growth) and ``kv_scores``, ``forward`` ``kv_host``, ``load``
``kv_scored`` and its reply's ``kv_record_bytes``; the per-sequence pool (``load`` ``kv_pool``,
``Span.kv_plan``) is gone.
25: ``kv_page``: KV Flash moves of one sequence outside a forward (a kept lane paged out).
26: ``kv_page`` moves 2 save (a block's rows copied to a host record, the table unchanged)
and 3 adopt (a host record appended as a paged-out entry, its positions committed), and
its ``tokens`` (the adopted positions' ids): the prefix cache's blocks on disk.
27: ``kv_page`` ``states`` and ``kv_states`` (a hybrid's recurrent states saved to and
loaded from state records at block ends) and ``load`` replies ``kv_state_bytes``.
28: ``kv_files`` (list, write, read, clear a worker on another host's own block files: its
part of the prefix cache's blocks on disk, by the daemon's keys, into and out of its host
records) and ``hello``'s reply ``prefix_cache_bytes`` (the memory such a worker gives the
prefix cache's host records).

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

from luced.ipc.frames.base import (
    COMPUTE_DTYPES,
    DECODE_GRAPHS,
    PROTOCOL_VERSION,
    REPLIES,
    REQUESTS,
    WEIGHT_MODES,
    ComputeDtype,
    ErrorReply,
    MoeCounts,
    ProtocolVersionError,
    Reply,
    Request,
)
from luced.ipc.frames.forward import OUTPUTS, Forward, ForwardReply, Span, Want
from luced.ipc.frames.model import (
    KERNELS_FALLBACK,
    ExpertMix,
    ExpertMixReply,
    Hello,
    HelloReply,
    Load,
    LoadExperts,
    LoadExpertsReply,
    LoadReply,
    Shutdown,
    ShutdownReply,
    Stats,
    StatsReply,
)
from luced.ipc.frames.remote import (
    Carry,
    FileIdentity,
    KVFiles,
    KVFilesReply,
    Link,
    LinkReply,
    Ping,
    PingReply,
    Put,
    Relay,
)
from luced.ipc.frames.sequence import (
    DraftBlock,
    DraftBlockReply,
    KVExport,
    KVExportReply,
    KVForget,
    KVForgetReply,
    KVImport,
    KVImportReply,
    KVLayout,
    KVLayoutReply,
    KVPage,
    KVPageReply,
    KVShare,
    KVShareReply,
    LoadDraft,
    LoadDraftReply,
    Reset,
    ResetReply,
    Truncate,
    TruncateReply,
)
from luced.ipc.typed import FrameError

# Requests that may take minutes (the first one starts the worker's backend: torch's import;
# a load reads a whole model): the worker sends progress notes until it replies.
SLOW: tuple[type[Request], ...] = (Hello, Load, LoadDraft, LoadExperts, Link)

__all__ = [
    "COMPUTE_DTYPES",
    "DECODE_GRAPHS",
    "KERNELS_FALLBACK",
    "OUTPUTS",
    "PROTOCOL_VERSION",
    "REPLIES",
    "REQUESTS",
    "SLOW",
    "WEIGHT_MODES",
    "Carry",
    "ComputeDtype",
    "DraftBlock",
    "DraftBlockReply",
    "ErrorReply",
    "ExpertMix",
    "ExpertMixReply",
    "FileIdentity",
    "Forward",
    "ForwardReply",
    "FrameError",
    "Hello",
    "HelloReply",
    "KVExport",
    "KVExportReply",
    "KVFiles",
    "KVFilesReply",
    "KVForget",
    "KVForgetReply",
    "KVImport",
    "KVImportReply",
    "KVLayout",
    "KVLayoutReply",
    "KVPage",
    "KVPageReply",
    "KVShare",
    "KVShareReply",
    "Link",
    "LinkReply",
    "Load",
    "LoadDraft",
    "LoadDraftReply",
    "LoadExperts",
    "LoadExpertsReply",
    "LoadReply",
    "MoeCounts",
    "Ping",
    "PingReply",
    "ProtocolVersionError",
    "Put",
    "Relay",
    "Reply",
    "Request",
    "Reset",
    "ResetReply",
    "Shutdown",
    "ShutdownReply",
    "Span",
    "Stats",
    "StatsReply",
    "Truncate",
    "TruncateReply",
    "Want",
]
