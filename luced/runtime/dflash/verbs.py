"""The worker's draft verbs: ``load_draft`` and ``draft`` (see ``luced.ipc.frames``).

A DFlash draft needs three things from the target: the captured features (the daemon's
feature ring, read in place), the embedding (its block's input) and the LM head (its
hidden states -> target vocabulary). It runs either

    in the target's worker    embedding and head are the loaded target's own shards
                              (this worker holds layer 0 and the last layer)
    in its own worker         ``load_draft`` names the target GGUF and the worker loads only
                              its embedding and head (``load_target_edges``), no layers

One ``draft`` call (dflash-reference B.3, stateless: context K/V are recomputed)::

    C        = min(committed, ctx_window, ring_cap)
    features = ring[(committed - C .. committed - 1) % ring_cap]   [C, n_capture * hidden]
               (a view when the span does not wrap; two views joined when it does)
    noise    = embed([anchor] + [mask] * (B - 1))                   [B, hidden]
    h        = draft.forward(features, noise, ctx_start=committed - C)
    logits   = target head over h[1:]                               [B - 1, vocab]
    ids      = [anchor] + argmax(logits)   or, sampled, draws from q = probs(logits, params)
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import torch

from luced.gguf_file import GGUFFile
from luced.ipc import frames as F
from luced.runtime.dflash.draft import Draft, project_with_target_head
from luced.runtime.families import family_for
from luced.runtime.model import Model
from luced.runtime.sampler import Sampler, probs
from luced.runtime.state import DraftState, WorkerError, WorkerState, torch_device
from luced.runtime.weights import WeightLoader, parse_dtype
from luced.sampling_params import SamplingParams


def draft_seed(seed: int) -> int:
    """The draft's generator seed for a request seeded with `seed` (a different stream)."""
    return (seed ^ 0x5DEECE66D) % 2**63  # any constant: the streams only have to differ


def load_target_edges(path: str | Path, dtype: torch.dtype, device: torch.device) -> Model:
    """The target's embedding, final norm and head without any layer: what a draft in a
    worker of its own needs to embed its block and project its hidden states."""
    gguf = GGUFFile(path)
    family = family_for(gguf)
    cfg = family.config_from_gguf(gguf)
    none = range(cfg.n_layers, cfg.n_layers)  # empty, and ends at the last layer: owns_head
    weights = WeightLoader(gguf, dtype, device).load_all(family.weight_plan(cfg, none, True, True))
    family.prepare(cfg, weights)
    model = Model(family, cfg, weights, none, dtype, device, gguf.path)
    model.owns_embed = True  # it holds the embedding though its (empty) range starts past 0
    return model


def load(worker: WorkerState, req: F.LoadDraft) -> DraftState:
    if req.device not in worker.devices:
        raise WorkerError(
            f"load_draft names device {req.device}; this worker drives {worker.devices}"
        )
    device = torch_device(req.device)
    t0 = time.monotonic()
    m = worker.loaded
    holds_ends = m is not None and m.shards[0].model.owns_embed and m.shards[-1].model.owns_head
    same_file = req.target is None or (m is not None and Path(req.target) == m.path)
    if m is not None and holds_ends and same_file:
        embedder, head = m.shards[0].model, m.shards[-1].model
    elif req.target is not None:
        embedder = head = load_target_edges(req.target, parse_dtype(req.dtype), device)
    else:
        raise WorkerError(
            "load_draft without a target needs this worker to hold the target's embedding "
            "and head (its first and last layer); name the target GGUF to load them here"
        )
    cfg = head.cfg
    draft = Draft.load(
        req.path,
        target_hidden=cfg.hidden,
        target_n_layers=cfg.n_layers,
        dtype=req.dtype,
        device=device,
    )
    mask = draft.mask_token_id
    if mask is not None and not 0 <= mask < cfg.vocab:
        raise WorkerError(f"{req.path}: draft mask_token_id {mask} outside the target's vocab")
    reply = F.LoadDraftReply(
        capture_layers=draft.capture_layers,
        block_size=draft.block_size,
        mask_token_id=mask,
        hidden=draft.cfg.hidden,
        load_s=time.monotonic() - t0,
    )
    return DraftState(draft, embedder, head, reply)


@torch.inference_mode()
def run(worker: WorkerState, state: DraftState, req: F.DraftBlock) -> F.DraftBlockReply:
    """One draft step; every input is checked before any compute."""
    t0 = time.perf_counter()
    draft, cfg = state.draft, state.draft.cfg
    block = req.block_size or draft.block_size
    mask = draft.mask_token_id if req.mask_token_id is None else req.mask_token_id
    if mask is None:
        raise WorkerError("the draft config names no mask_token_id: the request must")
    for what, tok in (("anchor", req.anchor), ("mask_token_id", mask)):
        if not 0 <= tok < state.vocab:
            raise WorkerError(f"{what} {tok} outside the target's vocabulary [0, {state.vocab})")
    n_cap = len(cfg.capture_layers)
    if tuple(req.ring.shape[1:]) != (n_cap, cfg.hidden):
        raise WorkerError(
            f"ring rows must be [{n_cap}, {cfg.hidden}] (captures, hidden), "
            f"got {list(req.ring.shape)}"
        )
    ids_out = worker.tensor(req.outputs["ids"])
    if ids_out.shape[0] < block:
        raise WorkerError(f"outputs.ids holds {ids_out.shape[0]} rows, block_size is {block}")
    params = _params(req)
    probs_out = None
    if params is not None:
        probs_out = worker.tensor(req.outputs["probs"])
        if probs_out.shape[0] < block - 1 or probs_out.shape[1] != state.vocab:
            raise WorkerError(
                f"outputs.probs must be [>= {block - 1}, {state.vocab}], "
                f"got {list(probs_out.shape)}"
            )
    ring = worker.tensor(req.ring)  # [ring_cap, n_capture, hidden], in place

    ctx = min(req.committed, req.ctx_window, ring.shape[0])
    start = req.committed - ctx
    features = _ring_rows(ring, start, ctx).reshape(ctx, n_cap * cfg.hidden)
    noise = draft.noise_embeddings(state.embedder, [req.anchor] + [mask] * (block - 1))
    hidden = draft.forward(features, noise, start)
    logits = project_with_target_head(state.head, hidden[1:])  # [B-1, vocab] float32
    if params is None:
        proposals = logits.argmax(dim=-1)
    else:
        sampler = _sampler(state, req, params)
        q = probs(logits, params)
        proposals = sampler.sample(logits).tokens  # drawn from q exactly
        assert probs_out is not None
        probs_out[: block - 1].copy_(q)
    ids_out[0] = req.anchor
    ids_out[1:block].copy_(proposals)  # int64 -> int32; device -> host
    elapsed = time.perf_counter() - t0
    worker.busy_s += elapsed
    return F.DraftBlockReply(n=block - 1, ctx=ctx, elapsed_us=int(elapsed * 1e6))


def _ring_rows(ring: torch.Tensor, start: int, n: int) -> torch.Tensor:
    """Positions [start, start + n) of the ring (n <= ring_cap): a view unless they wrap."""
    cap = ring.shape[0]
    lo = start % cap
    if lo + n <= cap:
        return ring[lo : lo + n]
    return torch.cat([ring[lo:], ring[: lo + n - cap]])


def _params(req: F.DraftBlock) -> SamplingParams | None:
    """The request's sampling parameters when it samples, None when greedy."""
    if not req.sampled:
        return None
    # Penalties would make q depend on per-row histories the draft does not keep; q without
    # them is still a proposal distribution, and the target's verify applies them to p.
    return SamplingParams.from_wire(req.sampling).without_penalties()


def _sampler(state: DraftState, req: F.DraftBlock, params: SamplingParams) -> Sampler:
    """The sequence's kept sampler (one generator across its steps), new when the map
    changes."""
    kept = state.samplers.get(req.sequence)
    if kept is None or kept[1] != req.sampling:
        if params.seed is not None:
            # The target's verify draws its uniforms from a generator with the request's
            # seed; the draft's must be a different stream, or the acceptance test would
            # reuse the very uniforms that picked the proposals (correlated, not exact).
            params = dataclasses.replace(params, seed=draft_seed(params.seed))
        kept = state.samplers[req.sequence] = (Sampler(params), dict(req.sampling))
    return kept[0]
