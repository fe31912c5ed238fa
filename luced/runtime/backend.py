"""What a worker process serves: its loaded shards, their KV, sampling state, and the verbs.

``Backend.handle(request) -> reply`` answers one frame of ``luced.ipc.frames``; the
process around it (socket, signals, logging) is ``luced.runtime.worker``. Any exception
becomes an error reply (``channel.answer``), so a bad frame never ends the worker.

State per loaded model::

    shards    one (Model, KVCache) per device, layers [a, b) cut at device_splits;
              hidden states cross between them in-process (device to device)
    tokens    the token id fed at each KV position [0, position): the sampler's history
              for penalties; ``truncate`` cuts it with the KV, ``reset`` clears it
    sampler   built from the first sampling forward after load / reset (or when the
              ``sampling`` map changes) and kept, so a seeded request's draws continue
              one generator across steps and truncations

A DFlash draft (``load_draft``, ``draft``; ``luced.runtime.dflash.verbs``) may sit beside
the target or alone in a worker; ``load`` drops it with the target it may lean on.

Shared memory: regions are attached lazily by segment name (``Attachments``) and viewed
in place: on the CPU the view *is* the tensor the model reads and the results are
written straight into the daemon's regions; on a GPU inputs are copied host -> device and
results device -> host (``copy_`` across devices). The worker never unlinks a segment;
``load`` drops its cached mappings because the daemon re-carves regions on reload.

A forward is all-or-nothing: inputs and output regions are checked before any compute,
and a failure after the KV was written rolls the KV (and token history) back.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import logging
import os
import platform
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from luced.ipc import frames as F
from luced.runtime import batch_verbs, experts, kv_flash_step, kv_snapshot, native, token_mask
from luced.runtime.dflash import verbs as draft_verbs
from luced.runtime.dflash.verify import verify_sampled
from luced.runtime.expert_link import ExpertServer, RemoteExperts
from luced.runtime.kv_blocks import BlockPool
from luced.runtime.kv_cache import ContextOverflow
from luced.runtime.kv_pool import PooledKVCache, chunk_nbytes
from luced.runtime.model import Model
from luced.runtime.sampler import (
    Sampler,
    histories,
    sample,
    token_logprobs,
    write_rows,
)
from luced.runtime.state import (
    Loaded,
    SequenceCache,
    Shard,
    WorkerError,
    WorkerState,
    kept_sampler,
    torch_device,
)
from luced.sampling_params import SamplingParams

log = logging.getLogger(__name__)

TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "int16": torch.int16,
    "uint16": torch.uint16,
    "int32": torch.int32,
    "uint32": torch.uint32,
    "int64": torch.int64,
}


class Backend(WorkerState):
    """The state of one worker process and its verbs (see the module docstring)."""

    def __init__(
        self, group: str, devices: tuple[str, ...], inbox: socket.socket | None = None
    ) -> None:
        super().__init__(group, devices)
        # Worker-to-worker links arrive here (luced.ipc.links): a target worker's to the
        # expert worker, or, in the expert worker, one per target worker.
        self.inbox = inbox
        self.remote: RemoteExperts | None = None
        self.expert_server = ExpertServer(self.tensor)
        self.device_problem: str | None = None
        try:  # checked now, reported by hello: the daemon learns it with a clear message
            self.torch_devices = tuple(torch_device(d) for d in devices)
        except WorkerError as e:
            self.device_problem = str(e)
            self.torch_devices = ()
        self._handlers: dict[type[F.Request], Callable[..., F.Reply]] = {
            F.Hello: self.hello,
            F.Load: self.load,
            F.Forward: self.forward,
            F.LoadDraft: self.load_draft,
            F.LoadExperts: self.load_experts,
            F.DraftBlock: self.draft_block,
            F.Truncate: self.truncate,
            F.Reset: self.reset,
            F.ForwardBatch: self.forward_batch,
            F.KVLayout: self.kv_layout,
            F.KVExport: self.kv_export,
            F.KVImport: self.kv_import,
            F.KVShare: self.kv_share,
            F.Stats: self.stats,
            F.Shutdown: self.shutdown,
        }

    def handle(self, req: F.Request) -> F.Reply:
        try:
            if self.instance is None and not isinstance(req, F.Hello | F.Stats | F.Shutdown):
                raise WorkerError(f"{req.OP} before hello: the daemon opens with hello")
            sequence = getattr(req, "sequence", None)
            releasing = getattr(req, "release", False)
            if sequence is not None and self.loaded is not None and not releasing:
                self.loaded.select(sequence)  # the frame acts on that sequence's state
            return self._handlers[type(req)](req)
        except Exception as e:
            log.warning("%s failed: %s: %s", req.OP, type(e).__name__, e)
            raise

    def close(self) -> None:
        self.loaded = self.draft = None
        if self.remote is not None:
            self.remote.close()
        self.attachments.close()  # unmap only; the daemon unlinks

    # -- verbs ---------------------------------------------------------------------------

    def hello(self, req: F.Hello) -> F.HelloReply:
        if self.device_problem:
            raise WorkerError(self.device_problem)
        self.instance = req.instance
        return F.HelloReply(
            pid=os.getpid(), group=self.group, devices=self.devices, versions=versions()
        )

    def load(self, req: F.Load) -> F.LoadReply:
        unknown = [d for d in req.devices if d not in self.devices]
        if unknown:
            raise WorkerError(f"load names device(s) {unknown}; this worker drives {self.devices}")
        # Drop the old model first: two models at once may not fit. Cached mappings go
        # too, since the daemon re-carves its regions for the new model.
        self.loaded = self.draft = None  # the draft may use the old target's embedding / head
        self.attachments.close()
        t0 = time.monotonic()
        a, b = req.layers
        log.info("loading %s layers [%d, %d) on %s", req.model, a, b, ",".join(req.devices))
        bounds = (a, *req.device_splits, b)
        shards = []
        blocks: list[BlockPool] = []  # with kv_block: each shard's pool
        if self.remote is not None:  # its link goes too: the daemon links after this load
            self.remote.close()
            self.remote = None
        if req.moe_scratch is not None and self.inbox is not None:
            self.remote = RemoteExperts(self.inbox, req.moe_scratch, self.tensor)
        placement = self._plan_experts(req)
        split = placement if placement is not None and not placement.all_hot else None
        for i, name in enumerate(req.devices):
            model = Model.load(
                req.model,
                layers=bounds[i : i + 2],
                dtype=req.dtype,
                device=torch_device(name),
                weights=req.weights,
                batch_invariant=req.batch_invariant,
                experts=split.hot if split else None,  # read only the hot experts
                kv_dtype=req.kv_dtype or None,
            )
            if i == 0:
                check_load(req, model)
            if split:
                experts.place(model, split, cold=self.remote, required=req.moe_required)
            if req.kv_pool:  # every family pools; a recurrent layer keeps its state unpooled
                pool = min(req.kv_pool, -(-req.kv_capacity // F.KV_CHUNK) * F.KV_CHUNK)
                cache: SequenceCache = model.new_pool_cache(pool, req.kv_capacity)
            elif req.kv_block:  # one pool of blocks per shard for every sequence
                blocks.append(model.new_block_pool(req.kv_block))
                cache = model.new_paged_cache(blocks[-1], req.kv_capacity)
            else:
                cache = model.new_cache(req.kv_capacity)
            shards.append(Shard(model, cache))
        cfg = shards[0].model.cfg
        pooled = [s.cache for s in shards if isinstance(s.cache, PooledKVCache)]
        reply = F.LoadReply(
            n_layers=cfg.n_layers,
            hidden=cfg.hidden,
            vocab=cfg.vocab,
            layers=req.layers,
            dtype=req.dtype,
            kv_capacity=req.kv_capacity,
            load_s=time.monotonic() - t0,
            recurrent=tuple(
                layer for s in shards if s.cache.recurrent for layer in s.cache.recurrent.shapes
            ),
            kv_pool=pooled[0].pool if pooled else 0,
            kv_chunk_bytes=sum(chunk_nbytes(c) for c in pooled),
            moe_fingerprint=placement.fingerprint() if placement is not None else "",
            kernels=native.describe(torch_device(req.devices[0])),
        )

        def new_caches() -> list[SequenceCache]:
            if req.kv_pool:  # each sequence its own pool, mapped by its own pager's plans
                pool = pooled[0].pool
                return [s.model.new_pool_cache(pool, req.kv_capacity) for s in shards]
            if blocks:
                return [
                    s.model.new_paged_cache(b, req.kv_capacity)
                    for s, b in zip(shards, blocks, strict=True)
                ]
            return [s.model.new_cache(req.kv_capacity) for s in shards]

        self.loaded = Loaded(Path(req.model), shards, reply, new_caches, blocks)
        return reply

    def _plan_experts(self, req: F.Load) -> experts.Placement | None:
        """`moe_hot` experts per layer for this worker's shards (None: every expert local,
        or no routed experts)."""
        if req.moe_hot < 0:
            return None
        try:
            return experts.plan_for(req.model, req.moe_hot, dict(req.moe_profile))
        except ValueError as exc:
            raise WorkerError(f"moe_hot: {exc}") from None

    def load_experts(self, req: F.LoadExperts) -> F.LoadExpertsReply:
        if self.inbox is None:
            raise WorkerError("load_experts needs a worker started with --inbox")
        reply = self.expert_server.load(req)
        self.expert_server.serve_inbox(self.inbox)
        return reply

    def truncate(self, req: F.Truncate) -> F.TruncateReply:
        m = self.model("truncate")
        if req.position > m.position:
            raise WorkerError(
                f"cannot truncate to {req.position}: the KV holds {m.position} positions"
            )
        m.truncate(req.position)
        return F.TruncateReply(position=m.position)

    def reset(self, req: F.Reset) -> F.ResetReply:
        if req.release:
            # Another sequence may be selected: its sampler is not this one's to drop.
            if self.loaded is not None:
                self.model("reset").release(req.sequence, keep_sampler=req.keep_sampler)
            return F.ResetReply()
        self.drop_samplers()
        if self.draft is not None and self.loaded is None:
            return F.ResetReply()  # a draft-only worker has nothing else to reset
        self.model("reset").truncate(0)
        return F.ResetReply()

    # KV snapshots (prefix cache): luced.runtime.kv_snapshot has the copies.

    def kv_layout(self, req: F.KVLayout) -> F.KVLayoutReply:
        return kv_snapshot.layout(self, req)

    def kv_export(self, req: F.KVExport) -> F.KVExportReply:
        return kv_snapshot.export(self, req)

    def kv_import(self, req: F.KVImport) -> F.KVImportReply:
        return kv_snapshot.import_(self, req)

    def kv_share(self, req: F.KVShare) -> F.KVShareReply:
        shared = self.model("kv_share").share(req.sequence, req.source, req.position)
        return F.KVShareReply(position=shared)

    def stats(self, req: F.Stats) -> F.StatsReply:
        m = self.loaded
        stats: dict[str, int | float | str] = {
            "pid": os.getpid(),
            "group": self.group,
            "rss_bytes": rss_bytes(),
            "uptime_s": round(time.monotonic() - self.started, 3),
            "forward_count": self.forward_count,
            "tokens_processed": self.tokens_processed,
            "busy_s": round(self.busy_s, 6),
            "model": str(m.path) if m else "",
            "kv_position": m.position if m else 0,
            "kv_capacity": m.reply.kv_capacity if m else 0,
            "kv_bytes": sum(s.cache.nbytes() for s in m.shards) if m else 0,
            # With a block pool (load kv_block): the blocks held (a shared one once), the
            # blocks the sequences' tables map (what they would hold without sharing), and
            # the pool's bytes.
            "kv_blocks_used": sum(p.used_blocks for p in m.block_pools) if m else 0,
            "kv_blocks_mapped": sum(p.mapped_blocks for p in m.block_pools) if m else 0,
            "kv_pool_bytes": sum(p.nbytes() for p in m.block_pools) if m else 0,
            "kernels": m.reply.kernels if m else "",
            "draft": str(self.draft.draft.path) if self.draft else "",
            "expert_calls_served": self.expert_server.calls,
        }
        for key in ("cold_calls", "fallbacks"):
            stats[f"moe_{key}"] = sum(s.get(key, 0) for s in self._splits())
        for key, value in (self.remote.stats if self.remote else {}).items():
            stats[f"moe_{key}"] = value
        return F.StatsReply(stats=stats)

    def _splits(self) -> list[dict[str, int]]:
        shards = self.loaded.shards if self.loaded else []
        return [sp.stats for s in shards if (sp := getattr(s.model, "expert_split", None))]

    def shutdown(self, req: F.Shutdown) -> F.ShutdownReply:
        return F.ShutdownReply()  # the serving loop ends after sending this

    @torch.inference_mode()
    def forward(self, req: F.Forward) -> F.ForwardReply:
        m = self.model("forward")
        t0 = time.perf_counter()
        start, n = req.start_pos, req.n_tokens
        # Everything is checked and resolved before any compute: a bad request changes nothing.
        ids, hidden_in = self._inputs(req, m)
        outputs = self._outputs(req, m)
        ring = self._ring(req, m)
        sampler = self._sampler(req, m) if req.want in ("sample", "verify") else None
        if sampler is not None and sampler.params.has_penalties and len(m.tokens) != start:
            raise WorkerError("penalties need the token history; this shard was fed hidden_in")
        q = self._draft_probs(req, m, sampler)
        bias = self._allowed(req, m)
        # KV Flash: host-tier copies and the step's rows, before any K/V write
        plan = {name: getattr(req, name) for name in F.KV_PLAN}
        kv_flash_step.apply_plan(self, m, [s.cache for s in m.shards], start, n, plan)
        first, last = m.shards[0].model, m.shards[-1].model
        if hidden_in is None:
            assert ids is not None
            hidden = first.embed(ids.to(first.device, torch.int64))
        else:
            hidden = hidden_in.to(first.device)
        fed = ids.tolist() if ids is not None else []  # copied before the daemon reuses it
        accepted = None
        moe_before = self._moe_counts()
        recurrent = [s.cache.recurrent for s in m.shards if s.cache.recurrent is not None]
        try:
            for rec in recurrent:  # a verify block: a state per position, to cut inside it
                rec.track_positions = req.keep_block_states
            hidden = self._run(m, hidden, start, req.capture, ring, ids)
            if req.kv_scores is not None:
                kv_flash_step.write_scores([s.cache for s in m.shards], self.tensor(req.kv_scores))
            if req.want == "hidden":
                outputs["hidden"][:n].copy_(hidden)
            elif q is not None:
                assert sampler is not None and ids is not None
                logits = last.logits(hidden)
                accepted = self._verify(m, logits, ids, q, outputs, sampler, fed, bias)
            else:
                rows = hidden[-1:] if req.positions == "last" else hidden
                self._head_outputs(req, m, last.logits(rows), outputs, sampler, fed, bias)
        except BaseException:
            m.truncate(start)  # nothing of a failed forward stays in the KV
            raise
        finally:
            for rec in recurrent:
                rec.track_positions = False
        if req.keep_state:  # a prefix-cache cut point: kv_export reads it later
            for shard in m.shards:
                if shard.cache.recurrent is not None:
                    shard.cache.save_state()
        m.tokens.extend(fed)
        elapsed = time.perf_counter() - t0
        self.forward_count += 1
        self.tokens_processed += n
        self.busy_s += elapsed
        moe = {k: v - moe_before[k] for k, v in self._moe_counts().items()}
        return F.ForwardReply(
            n_out=req.n_out,
            position=m.position,
            elapsed_us=int(elapsed * 1e6),
            accepted=accepted,
            **moe,
        )

    def forward_batch(self, req: F.ForwardBatch) -> F.ForwardBatchReply:
        before = self._moe_counts()
        reply = batch_verbs.forward_batch(self, req)
        moe = {k: v - before[k] for k, v in self._moe_counts().items()}
        return dataclasses.replace(reply, **moe)

    def _moe_counts(self) -> dict[str, int]:
        remote = self.remote.stats if self.remote else {}
        return {
            "moe_remote_calls": remote.get("remote_calls", 0),
            "moe_fallbacks": sum(s["fallbacks"] for s in self._splits()),
            "moe_remote_bytes": remote.get("remote_bytes", 0),
        }

    def load_draft(self, req: F.LoadDraft) -> F.LoadDraftReply:
        self.draft = None  # first: the old draft's memory may be needed for the new one
        self.draft = draft_verbs.load(self, req)
        return self.draft.reply

    def draft_block(self, req: F.DraftBlock) -> F.DraftBlockReply:
        if self.draft is None:
            raise WorkerError("draft before load_draft: no draft is loaded")
        return draft_verbs.run(self, self.draft, req)

    # -- forward helpers -----------------------------------------------------------------

    def _run(
        self,
        m: Loaded,
        hidden: torch.Tensor,
        start: int,
        capture: tuple[int, ...],
        ring: torch.Tensor | None,
        ids: torch.Tensor | None,
    ) -> torch.Tensor:
        """Every shard's layers in order; captured layer outputs go to their ring slots.
        `ids` (the fed tokens) reach every shard: Gemma 4's layers read per-token inputs."""
        for shard in m.shards:
            hidden, caps = shard.model.forward_layers(
                hidden.to(shard.model.device), shard.cache, start, capture, ids=ids
            )
            if ring is not None:
                # Slot of position p is p % ring_cap; this worker writes only its layers.
                slots = torch.arange(start, start + hidden.shape[0]) % ring.shape[0]
                for j, layer in enumerate(capture):
                    if layer in caps:
                        ring[slots, j] = caps[layer].to("cpu", ring.dtype)
        return hidden

    def _head_outputs(
        self,
        req: F.Forward,
        m: Loaded,
        logits: torch.Tensor,  # [n_out, vocab] float32, on the head's device
        out: dict[str, torch.Tensor],
        sampler: Sampler | None,
        fed: list[int],
        bias: torch.Tensor | None = None,
    ) -> None:
        n_out = logits.shape[0]
        if req.want == "logits":
            out["logits"][:n_out].copy_(logits)
            return
        if sampler is not None:
            mask = None if bias is None else bias[:n_out]
            result = sampler.sample(logits, histories(sampler, m.tokens + fed, n_out), mask)
        else:  # want="topk": the model's own distribution, chosen = argmax, no draw
            result = sample(logits, SamplingParams(temperature=0, logprobs=req.top_logprobs))
        write_rows(out, result)

    def _verify(
        self,
        m: Loaded,
        logits: torch.Tensor,  # [n, vocab] float32: every position of the block
        block: torch.Tensor,
        q: torch.Tensor,
        out: dict[str, torch.Tensor],
        sampler: Sampler,
        fed: list[int],
        bias: torch.Tensor | None = None,
    ) -> int:
        """want="verify": rejection sampling of the block's proposals against q; the step's
        tokens (and their logprobs) to `out`; returns the proposals accepted."""
        n = logits.shape[0]
        history = histories(sampler, m.tokens + fed, n)
        bias = None if bias is None else bias[:n]
        p = sampler.probs(logits, history, bias)
        result = verify_sampled(block, p, q.to(p.device), sampler.generator(p.device), budget=n)
        k = len(result.tokens)  # rows 0..k-1: token j follows block[0..j]
        tokens = torch.tensor(result.tokens, device=logits.device)
        if sampler.params.logprobs is None:
            out["ids"][:k].copy_(tokens)
        else:
            rows = history[:k] if history is not None else None
            mask = None if bias is None else bias[:k]
            write_rows(out, token_logprobs(logits[:k], sampler.params, tokens, rows, mask))
        return result.num_accepted

    def _sampler(self, req: F.Forward, m: Loaded) -> Sampler:
        k = req.top_logprobs if {"logprobs", "topk_ids"} & req.outputs.keys() else None
        return kept_sampler(m, req.sampling, k)

    def _allowed(self, req: F.Forward, m: Loaded) -> torch.Tensor | None:
        """A grammar's mask as a logit bias [n_out, vocab], checked before any compute."""
        if req.allowed is None:
            return None
        vocab = m.reply.vocab
        self.check_width("allowed", req.allowed, (vocab + 31) // 32)
        return token_mask.bias(self.tensor(req.allowed)[: req.n_out], vocab)

    def _draft_probs(
        self, req: F.Forward, m: Loaded, sampler: Sampler | None
    ) -> torch.Tensor | None:
        """want="verify": the draft's q rows [n - 1, vocab], checked before any compute."""
        if req.want != "verify":
            return None
        assert req.draft_probs is not None and sampler is not None
        if req.tokens is None:
            raise WorkerError('want="verify" needs the block\'s token ids (tokens)')
        if sampler.params.greedy:
            raise WorkerError('want="verify" needs temperature > 0 (greedy blocks: "sample")')
        self.check_width("draft_probs", req.draft_probs, m.reply.vocab)
        return self.tensor(req.draft_probs)[: req.n_tokens - 1]

    def _inputs(self, req: F.Forward, m: Loaded) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(token ids or None, hidden rows or None): [n] int32 / [n, hidden] views; the
        embedding owner gets ids only, a later shard hidden rows (and maybe the ids)."""
        start, n = req.start_pos, req.n_tokens
        if start != m.position:
            raise WorkerError(
                f"forward at start_pos {start}, but the KV holds {m.position} positions "
                "(truncate first to roll back)"
            )
        if start + n > m.reply.kv_capacity:
            raise ContextOverflow(
                f"context overflow: positions [{start}, {start + n}) exceed the KV capacity "
                f"of {m.reply.kv_capacity} tokens"
            )
        return self.fed_inputs(req.tokens, req.hidden_in, n, m)

    def _ring(self, req: F.Forward, m: Loaded) -> torch.Tensor | None:
        if req.ring is None:
            return None
        if req.ring.shape[2] != m.reply.hidden:
            got = list(req.ring.shape)
            raise WorkerError(f"ring rows must be {m.reply.hidden} wide, got {got}")
        return self.tensor(req.ring)

    def _outputs(self, req: F.Forward, m: Loaded) -> dict[str, torch.Tensor]:
        if req.want != "hidden" and not m.shards[-1].model.owns_head:
            raise WorkerError(f'want="{req.want}" needs the LM head; this worker has no head')
        if "logits" in req.outputs:
            self.check_width("outputs.logits", req.outputs["logits"], m.reply.vocab)
        if "hidden" in req.outputs:
            self.check_width("outputs.hidden", req.outputs["hidden"], m.reply.hidden)
        return {name: self.tensor(r) for name, r in req.outputs.items()}


def check_load(req: F.Load, model: Model) -> None:
    """The load frame's claims against the model file (first shard, before the rest load)."""
    cfg = model.cfg
    a, b = req.layers
    if b > cfg.n_layers:
        raise WorkerError(f"layers [{a}, {b}) outside the model's {cfg.n_layers} layers")
    if req.owns_embed != (a == 0) or req.owns_head != (b == cfg.n_layers):
        raise WorkerError(
            f"layers [{a}, {b}) of {cfg.n_layers} mean owns_embed={a == 0}, "
            f"owns_head={b == cfg.n_layers}; the frame says {req.owns_embed}, {req.owns_head}"
        )
    if req.kv_capacity > cfg.context_length:
        raise WorkerError(
            f"kv_capacity {req.kv_capacity} exceeds the model's context length {cfg.context_length}"
        )


def versions() -> dict[str, str]:
    try:
        luced = importlib.metadata.version("luced")
    except importlib.metadata.PackageNotFoundError:
        luced = "unknown"
    return {
        "luced": luced,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "executable": sys.executable,
    }


def rss_bytes() -> int:
    """Resident set size now (Linux /proc; the peak from getrusage elsewhere)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
