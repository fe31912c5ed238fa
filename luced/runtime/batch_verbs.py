"""The worker's `forward_batch` verb: several sequences' tokens in one pass (continuous
batching). Linear layers see every row at once; attention and recurrent state run per
sequence over its own caches (`runtime.ragged`). Each sequence keeps its token history and
sampler in the worker's `Loaded` (`SequenceState`), exactly as a `forward` of it alone
would leave them, so a sequence may be stepped alone or in a batch from one step to the
next."""

from __future__ import annotations

import itertools
import time

import torch

from luced.ipc import frames as F
from luced.runtime import kv_flash_step, token_mask
from luced.runtime.kv_cache import ContextOverflow
from luced.runtime.ragged import Ragged, Span
from luced.runtime.sampler import histories, write_rows
from luced.runtime.state import (
    SequenceState,
    WorkerError,
    WorkerState,
    kept_sampler,
)


def forward_batch(worker: WorkerState, req: F.ForwardBatch) -> F.ForwardBatchReply:
    m = worker.model("forward_batch")
    t0 = time.perf_counter()
    # Everything is read and checked before any compute: a bad batch changes nothing.
    table = worker.tensor(req.batch)[: req.n_sequences].tolist()
    sequences = [seq for seq, _, _, _ in table]
    if len(set(sequences)) != len(sequences):
        raise WorkerError(f"a sequence appears twice in the batch: {sequences}")
    rows = [(seq, start, n) for seq, start, n, _ in table]
    if any(n < 1 for _, _, n in rows) or sum(n for _, _, n in rows) != req.n_tokens:
        raise WorkerError(f"the batch's rows {rows} do not add up to n_tokens {req.n_tokens}")
    n_out = [out for _, _, _, out in table]
    if any(out not in (1, n) for out, (_, _, n) in zip(n_out, rows, strict=True)):
        raise WorkerError(f"each sequence's n_out must be 1 or its n_tokens, got {table}")
    if req.want == "sample" and sum(n_out) != req.n_out:
        raise WorkerError(f"the batch's n_out column {n_out} does not add up to {req.n_out}")
    states = [m.state(seq) for seq in sequences]
    for state, (seq, start, n) in zip(states, rows, strict=True):
        if start != state.position:
            raise WorkerError(f"sequence {seq} is at position {state.position}, not {start}")
        if start + n > m.reply.kv_capacity:
            raise ContextOverflow(
                f"sequence {seq}: positions [{start}, {start + n}) exceed the KV capacity "
                f"of {m.reply.kv_capacity} tokens"
            )
    rings = [worker.tensor(r) for r in req.rings]
    for ring, (seq, _, n) in zip(rings, rows, strict=False):
        if ring.shape[2] != m.reply.hidden or ring.shape[0] < n:
            raise WorkerError(
                f"sequence {seq}: its ring {list(ring.shape)} cannot take {n} rows "
                f"{m.reply.hidden} wide"
            )
    if bool(req.kv_plans) != bool(m.reply.kv_pool):
        raise WorkerError("a KV Flash worker takes a plan per sequence (kv_plans), others none")
    first, last = m.shards[0].model, m.shards[-1].model
    ids, hidden = worker.fed_inputs(req.tokens, req.hidden_in, req.n_tokens, m)
    if req.want == "sample" and not last.owns_head:
        raise WorkerError('want="sample" needs the LM head; this worker has no head')
    outputs = {name: worker.tensor(r) for name, r in req.outputs.items()}
    k = req.top_logprobs if {"logprobs", "topk_ids"} & req.outputs.keys() else None
    samplers = []  # want="hidden" samples nothing (its sampling is empty)
    if req.want == "sample":
        samplers = [kept_sampler(s, p, k) for s, p in zip(states, req.sampling, strict=True)]
    bias = None  # grammar masks, a row per output row (all-allowed rows add 0)
    if req.allowed is not None:
        worker.check_width("allowed", req.allowed, (m.reply.vocab + 31) // 32)
        bias = token_mask.bias(worker.tensor(req.allowed)[: req.n_out], m.reply.vocab)
    if hidden is None:
        assert ids is not None
        hidden = first.embed(ids.to(first.device, torch.int64))
    fed = ids.tolist() if ids is not None else []  # copied before the daemon reuses it
    fed_at = [(start, n) for _, start, n in rows]
    bounds = [0]
    for _, _, n in rows:
        bounds.append(bounds[-1] + n)  # sequence j's rows: [bounds[j], bounds[j + 1])
    own = [fed[a:b] for a, b in itertools.pairwise(bounds)] if fed else [[] for _ in rows]
    try:
        for state, plan, (_, start, n) in zip(states, req.kv_plans, rows, strict=False):
            kv_flash_step.apply_plan(worker, m, state.caches, start, n, plan)
        for i, shard in enumerate(m.shards):
            spans = [Span(s.caches[i], a, n) for s, (a, n) in zip(states, fed_at, strict=True)]
            batch = Ragged(spans)
            hidden, caps = shard.model.forward_layers(
                hidden.to(shard.model.device), batch, batch, req.capture, ids=ids
            )
            _write_captures(rings, req.capture, caps, fed_at, bounds)
        for state, plan in zip(states, req.kv_plans, strict=False):
            if (scores := plan.get("kv_scores")) is not None:
                kv_flash_step.write_scores(state.caches, worker.tensor(scores))
        if req.want == "hidden":
            outputs["hidden"][: req.n_tokens].copy_(hidden)
        else:
            # Each sequence's sampled rows: its last, or all of a verify block's.
            picked = [i for j, end in enumerate(bounds[1:]) for i in range(end - n_out[j], end)]
            logits = last.logits(hidden[torch.tensor(picked, device=hidden.device)])
            row = 0
            for j, (state, sampler) in enumerate(zip(states, samplers, strict=True)):
                part = slice(row, row + n_out[j])
                history = histories(sampler, state.tokens + own[j], n_out[j])
                part_bias = None if bias is None else bias[part].to(logits.device)
                write_rows(outputs, sampler.sample(logits[part], history, part_bias), row=row)
                row += n_out[j]
    except BaseException:
        for state, (_, start, _) in zip(states, rows, strict=True):
            _undo(state, start)
        raise
    for state, tokens in zip(states, own, strict=True):
        state.tokens.extend(tokens)
    worker.forward_count += 1
    worker.tokens_processed += req.n_tokens
    elapsed = time.perf_counter() - t0
    worker.busy_s += elapsed
    positions = tuple(s.position for s in states)
    return F.ForwardBatchReply(positions=positions, elapsed_us=int(elapsed * 1e6))


def _write_captures(
    rings: list[torch.Tensor],
    capture: tuple[int, ...],
    caps: dict[int, torch.Tensor],
    fed_at: list[tuple[int, int]],
    bounds: list[int],
) -> None:
    """Each sequence's captured layer outputs into its own ring, slot = position % ring_cap
    (as `forward` writes them; this worker writes only the layers it holds)."""
    for j, layer in enumerate(capture):
        if layer not in caps:
            continue
        rows = caps[layer].to("cpu")
        for ring, (start, n), at in zip(rings, fed_at, bounds, strict=False):
            slots = torch.arange(start, start + n) % ring.shape[0]
            ring[slots, j] = rows[at : at + n].to(ring.dtype)


def _undo(state: SequenceState, start: int) -> None:
    """Nothing of a failed batch stays in a sequence's KV."""
    for cache in state.caches:
        if cache.pos > start:
            cache.truncate(start)
