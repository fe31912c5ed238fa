"""The worker's `forward` verb: one pass of one sequence's tokens or several sequences'.

A frame's spans are sequences' rows one after another (`frames.Span`): a prompt chunk, a
decode token, a verify window. Linear layers multiply the rows of many spans as one matrix,
reading the weights once for all of them, which is what decode is bound by; attention and
the recurrent layers run per sequence over its own caches (`runtime.ragged`). Each sequence
keeps its caches, token history and sampler in the worker (`state.SequenceState`).

Dispatch: a span's rows must come out as they would alone (batched == alone). A packed
kernel gives a row the same result whatever rows come with it, but a call over more than
`GEMV_MAX_ROWS` rows takes the dense path, whose rounding depends on the call. So the spans
of at most `GEMV_MAX_ROWS` tokens run as one group whose linears all stay on the packed
kernels (`qlinear.row_exact`), and a longer span (a prompt chunk) runs as a group of its
own, exactly as it would alone. A frame of one span is one group: the sequence's own pass.

All or nothing: everything is read and checked before the first KV write, and a failure
after it leaves every sequence at its span's start.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Sequence

import torch

from luced.ipc import frames as F
from luced.ipc.regions import Region
from luced.runtime import kv_blocks, qlinear, token_mask
from luced.runtime.decode_graph import BATCH_BUCKETS, TOKEN_BUCKETS, bucket
from luced.runtime.dflash.verify import verify_sampled
from luced.runtime.kv_blocks import PagedKVCache
from luced.runtime.kv_cache import ContextOverflow
from luced.runtime.kv_host import SharedHostTier
from luced.runtime.model import Model
from luced.runtime.ragged import Ragged
from luced.runtime.ragged import Span as RaggedSpan
from luced.runtime.sampler import (
    Sampler,
    argmax_only,
    histories,
    token_logprobs,
    write_rows,
)
from luced.runtime.state import Loaded, SequenceState, WorkerError, WorkerState, kept_sampler


@torch.inference_mode()
def forward(worker: WorkerState, req: F.Forward) -> F.ForwardReply:
    """The verb: answered from the step computed ahead when it is this frame's
    (runtime.lookahead), else computed; then the next step ahead is planned."""
    reply = worker.lookahead.take(worker, req)
    if reply is None:
        reply = compute(worker, req)
    worker.lookahead.plan(worker, req)
    return reply


@torch.inference_mode()
def compute(worker: WorkerState, req: F.Forward, fed: torch.Tensor | None = None) -> F.ForwardReply:
    """One pass of the frame's spans; `fed`: the ids to feed instead of `req.tokens`'s."""
    m = worker.model("forward")
    t0 = time.perf_counter()
    spans = req.spans
    states = [m.sequence(s.sequence) for s in spans]
    _check_spans(m, spans, states)
    hosts = _host_tier(worker, req, m)
    n_tokens = req.n_tokens
    if fed is None:
        ids, hidden_in = worker.fed_inputs(req.tokens, req.hidden_in, n_tokens, m)
    else:
        ids, hidden_in = fed, None
    outputs = _outputs(worker, req, m)
    rings = _rings(worker, req, m)
    samplers = _samplers(req, states, ids is not None)
    q = _draft_probs(worker, req, m, samplers)
    bias = None
    if req.allowed is not None:
        worker.check_width("allowed", req.allowed, (m.reply.vocab + 31) // 32)
        bias = token_mask.bias(worker.tensor(req.allowed)[: req.n_out], m.reply.vocab)
    # Checked: from here on the sequences change. A span below its sequence's committed
    # length rolls it back first (a verify window's rejected rows); a block table takes
    # the daemon's moves, then its growth (engine/kv/blocks.py), span by span as the
    # daemon made them.
    for state, span in zip(states, spans, strict=True):
        if span.start < state.position:
            state.truncate(span.start)
        state.follow(span, hosts)
    first, last = m.shards[0].model, m.shards[-1].model
    graphs = m.decode_graphs if _graphed(m, req, states) else None
    if graphs is not None:
        hidden = None  # the captured step embeds the ids itself
    elif hidden_in is None:
        assert ids is not None
        hidden = first.embed(ids.to(first.device, torch.int64))
    else:
        hidden = hidden_in.to(first.device)
    fed = ids.tolist() if ids is not None else []  # copied before the daemon reuses it
    bounds = [0, *itertools.accumulate(s.n for s in spans)]  # span j: [bounds[j], bounds[j+1])
    own = [fed[a:b] for a, b in itertools.pairwise(bounds)] if fed else [[] for _ in spans]
    recurrent = [
        (cache.recurrent, span.keep_block_states)
        for state, span in zip(states, spans, strict=True)
        for cache in state.caches
        if cache.recurrent is not None
    ]
    accepted = [-1] * len(spans)
    try:
        for rec, keep in recurrent:  # a verify window: a state per position, to cut inside
            rec.track_positions = keep
        if graphs is not None:
            assert ids is not None
            sizes = [s.n for s in spans]
            caches = [state.caches[0] for state in states]
            logits, caps = graphs.step_capturing(caches, ids, sizes, req.capture)
            _write_captures(caps, req.capture, list(spans), rings)
        else:
            assert hidden is not None
            hidden = _layers(m, hidden, spans, states, bounds, req.capture, rings, ids)
            for state, span in zip(states, spans, strict=True):
                if span.kv_scores is not None:  # KV Flash
                    kv_blocks.write_scores(state.paged(), worker.tensor(span.kv_scores))
            if req.want == "hidden":
                outputs["hidden"][:n_tokens].copy_(hidden)
            elif req.n_pooled:
                _pool(last, hidden, spans, bounds, outputs["embeddings"])
            sampled = req.want != "hidden" and req.n_out  # else they only feed (prompt chunks)
            logits = _head(last, hidden, spans, bounds) if sampled else None
        if logits is not None:
            if req.want == "logits":
                outputs["logits"][: logits.shape[0]].copy_(logits)
            else:
                argmaxed = _argmax_picks(logits, spans, samplers, bias is None, outputs)
                heads = zip(spans, states, samplers, own, strict=True)
                row = 0
                for j, (span, state, sampler, mine) in enumerate(heads):
                    part = slice(row, row + span.n_out)
                    rows_bias = None if bias is None else bias[part].to(logits.device)
                    if sampler is not None and j not in argmaxed:
                        seen = state.tokens + mine
                        if span.verify:
                            assert q is not None and ids is not None
                            window = ids[bounds[j] : bounds[j + 1]]
                            q_rows = q[span.q_row : span.q_row + span.n - 1]
                            accepted[j] = _verify(
                                logits[part], window, q_rows, outputs, row, sampler, seen, rows_bias
                            )
                        else:
                            history = histories(sampler, seen, span.n_out)
                            result = sampler.sample(logits[part], history, rows_bias)
                            write_rows(outputs, result, row=row)
                    row += span.n_out
    except BaseException:
        for state, span in zip(states, spans, strict=True):  # nothing of it stays in the KV
            for cache in state.caches:
                if cache.pos > span.start:
                    cache.truncate(span.start)
        raise
    finally:
        for rec, _ in recurrent:
            rec.track_positions = False
    for state, span, mine in zip(states, spans, own, strict=True):
        if span.keep_state:  # a prefix-cache cut point: kv_export reads it later
            for cache in state.caches:
                if cache.recurrent is not None:
                    cache.save_state()
        del state.tokens[span.start :]
        state.tokens.extend(mine)
    elapsed = time.perf_counter() - t0
    worker.forward_count += 1
    worker.tokens_processed += n_tokens
    worker.busy_s += elapsed
    return F.ForwardReply(
        positions=tuple(s.position for s in states),
        elapsed_us=int(elapsed * 1e6),
        accepted=tuple(accepted) if any(s.verify for s in spans) else (),
    )


def _check_spans(m: Loaded, spans: Sequence[F.Span], states: list[SequenceState]) -> None:
    refs: list[dict[int, int]] = [{} for _ in m.shards]  # what earlier spans leave of the pools
    for state, span in zip(states, spans, strict=True):
        if span.start > state.position:
            raise WorkerError(
                f"sequence {span.sequence} holds {state.position} positions; a span cannot "
                f"start at {span.start}"
            )
        if span.start + span.n > m.reply.kv_capacity:
            raise ContextOverflow(
                f"context overflow: sequence {span.sequence}'s positions [{span.start}, "
                f"{span.start + span.n}) exceed the KV capacity of {m.reply.kv_capacity} tokens"
            )
        state.check_table(span, refs)
        if span.kv_scores is not None and not m.block_pools:
            raise WorkerError("kv_scores needs a load with kv_block")
        if span.kv_scores is not None and not all(c.scored for c in state.paged()):
            raise WorkerError("kv_scores needs a load with kv_scored (block keys are not kept)")


def _host_tier(worker: WorkerState, req: F.Forward, m: Loaded) -> list[SharedHostTier] | None:
    """Each shard's view of the host records the spans' moves name (None without moves)."""
    moves = [move for span in req.spans for move in span.moves]
    if not moves:
        return None
    assert req.kv_host is not None  # the frame checks it
    return host_tier(worker, req.kv_host, moves, m)


def host_tier(
    worker: WorkerState, host: Region, moves: Sequence[tuple[int, int, int, int]], m: Loaded
) -> list[SharedHostTier]:
    """Each shard's view of `host`, the records `moves` name: its bytes of each record,
    the shards side by side (`LoadReply.kv_record_bytes`)."""
    if host.shape[1] != m.reply.kv_record_bytes:
        got, want = host.shape[1], m.reply.kv_record_bytes
        raise WorkerError(f"host records of {got} bytes, this worker's are {want}")
    if max(record for *_, record in moves) >= host.shape[0]:
        raise WorkerError(f"a move names a host record past the {host.shape[0]} of kv_host")
    records, hosts, offset = worker.tensor(host), [], 0
    for pool in m.block_pools:
        hosts.append(SharedHostTier(records, offset, pool.block_nbytes()))
        offset += pool.block_nbytes()
    return hosts


def _outputs(worker: WorkerState, req: F.Forward, m: Loaded) -> dict[str, torch.Tensor]:
    if req.want != "hidden" and not m.shards[-1].model.owns_head:
        raise WorkerError(f'want="{req.want}" needs the LM head; this worker has no head')
    if "logits" in req.outputs:
        worker.check_width("outputs.logits", req.outputs["logits"], m.reply.vocab)
    for name in ("hidden", "embeddings"):
        if name in req.outputs:
            worker.check_width(f"outputs.{name}", req.outputs[name], m.reply.hidden)
    return {name: worker.tensor(r) for name, r in req.outputs.items()}


def _rings(worker: WorkerState, req: F.Forward, m: Loaded) -> list[torch.Tensor | None]:
    rings = []
    for span in req.spans:
        if span.ring is not None and span.ring.shape[2] != m.reply.hidden:
            got = list(span.ring.shape)
            raise WorkerError(f"ring rows must be {m.reply.hidden} wide, got {got}")
        rings.append(worker.tensor(span.ring) if span.ring is not None else None)
    return rings


def _samplers(req: F.Forward, states: list[SequenceState], has_ids: bool) -> list[Sampler | None]:
    """Each span's kept sampler (None where it samples nothing)."""
    if req.want != "sample":
        return [None] * len(states)
    k = req.top_logprobs if {"logprobs", "topk_ids"} & req.outputs.keys() else None
    out: list[Sampler | None] = []
    for state, span in zip(states, req.spans, strict=True):
        if not span.n_out:
            out.append(None)
            continue
        sampler = kept_sampler(state, span.sampling, k)
        if sampler.params.has_penalties and (not has_ids or len(state.tokens) < span.start):
            raise WorkerError("penalties need the token history; this shard was fed hidden_in")
        if span.verify and argmax_only(sampler.params):
            raise WorkerError("a verify span needs temperature > 0 (greedy windows: n_out = n)")
        out.append(sampler)
    return out


def _draft_probs(
    worker: WorkerState, req: F.Forward, m: Loaded, samplers: list[Sampler | None]
) -> torch.Tensor | None:
    """The verify spans' q rows [rows, vocab], checked before any compute."""
    if req.draft_probs is None:
        return None
    if req.tokens is None:
        raise WorkerError("a verify span needs the window's token ids (tokens)")
    worker.check_width("draft_probs", req.draft_probs, m.reply.vocab)
    return worker.tensor(req.draft_probs)


def _graphed(m: Loaded, req: F.Forward, states: list[SequenceState]) -> bool:
    """Whether the load's captured step takes this frame: from ids, over the block pool's
    caches, every span a row out for every token it feeds (a decode token, a verify
    window of at most TOKEN_BUCKETS[-1]; a DFlash target's captured layers too), with no
    pooling, nor a KV Flash cache that scores or has paged blocks out. On the CPU,
    windows only while the bucket's rows stay on the packed kernels' row-exact path, as
    they would in the eager forward."""
    graphs = m.decode_graphs
    if graphs is None or req.tokens is None or req.want == "hidden":
        return False
    spans = req.spans
    if any(s.n_out != s.n or s.pool or s.keep_block_states for s in spans):
        return False
    widest = max(s.n for s in spans)
    if widest > TOKEN_BUCKETS[-1]:
        return False
    rows = bucket(len(spans), BATCH_BUCKETS) * bucket(widest, TOKEN_BUCKETS)
    if widest > 1 and graphs.pool.device.type == "cpu" and rows > qlinear.GEMV_MAX_ROWS:
        return False
    # (the captured step reads every row of the map, and scores nothing)
    return all(
        isinstance(c := state.caches[0], PagedKVCache)
        and c.pool is graphs.pool
        and not (c.scored or c.paged_blocks)
        for state in states
    )


def _head(
    last: Model, hidden: torch.Tensor, spans: Sequence[F.Span], bounds: list[int]
) -> torch.Tensor:
    """The logits of each span's sampled rows (its last n_out), several spans' rows
    through the head as each span's own would go."""
    ends = zip(spans, bounds[1:], strict=False)
    picked = [i for s, b in ends for i in range(b - s.n_out, b)]
    exact = len(spans) > 1 and max(s.n_out for s in spans) <= qlinear.GEMV_MAX_ROWS
    with qlinear.row_exact() if exact else contextlib.nullcontext():
        return last.logits(hidden[torch.tensor(picked, device=hidden.device)])


def _groups(spans: Sequence[F.Span], invariant: bool) -> list[list[int]]:
    """Spans that run through the layers together (see the module docstring)."""
    if len(spans) == 1 or invariant:
        return [list(range(len(spans)))]
    small = [j for j, s in enumerate(spans) if s.n <= qlinear.GEMV_MAX_ROWS]
    large = [[j] for j, s in enumerate(spans) if s.n > qlinear.GEMV_MAX_ROWS]
    return ([small] if small else []) + large


def _layers(
    m: Loaded,
    hidden: torch.Tensor,
    spans: Sequence[F.Span],
    states: list[SequenceState],
    bounds: list[int],
    capture: tuple[int, ...],
    rings: list[torch.Tensor | None],
    ids: torch.Tensor | None,
) -> torch.Tensor:
    """Every shard's layers over every span, group by group; captured layer outputs go to
    each span's ring slots. -> the last layer's rows, in the frame's order."""
    groups = _groups(spans, m.shards[0].model.batch_invariant)
    if len(groups) == 1:
        return _group_layers(m, hidden, spans, states, groups[0], capture, rings, ids, bounds)
    out = torch.empty_like(hidden)
    for group in groups:
        rows = torch.cat([torch.arange(bounds[j], bounds[j + 1]) for j in group])
        part = _group_layers(
            m,
            hidden[rows.to(hidden.device)],
            spans,
            states,
            group,
            capture,
            rings,
            None if ids is None else ids[rows],
            bounds,
        )
        out = out.to(part.device)
        out[rows.to(part.device)] = part
    return out


def _group_layers(
    m: Loaded,
    hidden: torch.Tensor,
    spans: Sequence[F.Span],
    states: list[SequenceState],
    group: list[int],
    capture: tuple[int, ...],
    rings: list[torch.Tensor | None],
    ids: torch.Tensor | None,
    bounds: list[int],
) -> torch.Tensor:
    """One group's rows (the spans of `group`, in order) through every shard."""
    exact = qlinear.row_exact() if len(group) > 1 else contextlib.nullcontext()
    with exact:
        for i, shard in enumerate(m.shards):
            if len(group) == 1:
                (j,) = group
                start: int | Ragged = spans[j].start
                cache = states[j].caches[i]
            else:
                start = cache = Ragged(
                    [RaggedSpan(states[j].caches[i], spans[j].start, spans[j].n) for j in group]
                )
            hidden, caps = shard.model.forward_layers(
                hidden.to(shard.model.device), cache, start, capture, ids=ids
            )
            _write_captures(caps, capture, [spans[j] for j in group], [rings[j] for j in group])
    return hidden


def _argmax_picks(
    logits: torch.Tensor,
    spans: Sequence[F.Span],
    samplers: list[Sampler | None],
    unmasked: bool,
    outputs: dict[str, torch.Tensor],
) -> set[int]:
    """The spans whose tokens are their rows' argmax and nothing else (`argmax_only`), picked
    in one call rather than a call per span (the same ids: each row's argmax is its own);
    -> their indices."""
    if not unmasked:
        return set()
    rows: list[int] = []
    picked: set[int] = set()
    row = 0
    for j, (span, sampler) in enumerate(zip(spans, samplers, strict=True)):
        if sampler is not None and not span.verify and argmax_only(sampler.params):
            rows.extend(range(row, row + span.n_out))
            picked.add(j)
        row += span.n_out
    if len(picked) < 2:  # one span's call is already one call
        return set()
    best = logits.argmax(dim=-1).to("cpu", torch.int32)  # every row: no copy of the logits
    at = torch.tensor(rows)
    outputs["ids"][at] = best[at]
    return picked


def _pool(
    last: Model, hidden: torch.Tensor, spans: Sequence[F.Span], bounds: list[int], out: torch.Tensor
) -> None:
    """Each pooling span's row of `out` (`frames.Span.pool`), in span order."""
    k = 0
    for j, span in enumerate(spans):
        if not span.pool:
            continue
        a, b = bounds[j], bounds[j + 1]
        rows = {"sum": slice(a, b), "first": slice(a, a + 1), "last": slice(b - 1, b)}[span.pool]
        out[k].copy_(last.final_hidden(hidden[rows]).float().sum(0))
        k += 1


def _write_captures(
    caps: dict[int, torch.Tensor],
    capture: tuple[int, ...],
    spans: list[F.Span],
    rings: list[torch.Tensor | None],
) -> None:
    """Each span's captured layer outputs into its own ring, slot = position % ring_cap
    (this worker writes only the layers it holds)."""
    for j, layer in enumerate(capture):
        if layer not in caps:
            continue
        rows = caps[layer].to("cpu")
        at = 0
        for span, ring in zip(spans, rings, strict=True):
            if ring is not None:
                slots = torch.arange(span.start, span.start + span.n) % ring.shape[0]
                ring[slots, j] = rows[at : at + span.n].to(ring.dtype)
            at += span.n


def _verify(
    logits: torch.Tensor,  # [n, vocab] float32: every position of the window
    window: torch.Tensor,  # [n] the fed ids: anchor, proposals
    q: torch.Tensor,  # [n - 1, vocab] the draft's distributions
    out: dict[str, torch.Tensor],
    row: int,
    sampler: Sampler,
    seen: list[int],
    bias: torch.Tensor | None,
) -> int:
    """A verify span: rejection sampling of the window's proposals against q; the step's
    tokens (and their logprobs) to `out` from `row`; returns the proposals accepted."""
    n = logits.shape[0]
    history = histories(sampler, seen, n)
    p = sampler.probs(logits, history, bias)
    result = verify_sampled(window, p, q.to(p.device), sampler.generator(p.device), budget=n)
    k = len(result.tokens)  # rows 0..k-1: token j follows window[0..j]
    tokens = torch.tensor(result.tokens, device=logits.device)
    if sampler.params.logprobs is None:
        out["ids"][row : row + k].copy_(tokens)
    else:
        rows = history[:k] if history is not None else None
        mask = None if bias is None else bias[:k]
        write_rows(out, token_logprobs(logits[:k], sampler.params, tokens, rows, mask), row=row)
    return result.num_accepted
