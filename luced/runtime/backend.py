"""What a worker process serves: its loaded shards, their KV, sampling state, and the verbs.

``Backend.handle(request) -> reply`` answers one frame of ``luced.ipc.frames``; the
process around it (socket, signals, logging) is ``luced.runtime.worker``. Any exception
becomes an error reply (``channel.answer``), so a bad frame never ends the worker.

State per loaded model::

    shards     one Model per device, layers [a, b) cut at device_splits; hidden states
               cross between them in-process (device to device)
    sequences  by id (every frame that acts on one names it): a cache per shard, the
               token id fed at each KV position [0, position) (the sampler's history for
               penalties; ``truncate`` cuts it with the KV, ``reset`` clears it), and the
               sampler built from its first sampling forward after load / reset (or when
               the ``sampling`` map changes) and kept, so a seeded request's draws
               continue one generator across steps and truncations

A DFlash draft (``load_draft``, ``draft``; ``luced.runtime.dflash.verbs``) may sit beside
the target or alone in a worker; ``load`` drops it with the target it may lean on.

Shared memory: regions are attached lazily by segment name (``Attachments``) and viewed
in place: on the CPU the view *is* the tensor the model reads and the results are
written straight into the daemon's regions; on a GPU inputs are copied host -> device and
results device -> host (``copy_`` across devices). The worker never unlinks a segment;
``load`` drops its cached mappings because the daemon re-carves regions on reload.

A forward (``luced.runtime.forward``) is all-or-nothing: inputs and output regions are
checked before any compute, and a failure after the KV was written rolls the KV (and
token history) back.
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
from luced.runtime import experts, kv_snapshot, kv_state, native
from luced.runtime import forward as forward_verb
from luced.runtime.decode_graph import DecodeGraphs, supports
from luced.runtime.dflash import verbs as draft_verbs
from luced.runtime.expert_link import ExpertServer, HopExperts, RemoteExperts
from luced.runtime.hops import Hops
from luced.runtime.kv_blocks import BlockPool, PagedKVCache
from luced.runtime.mirror import Mirror
from luced.runtime.model import Model
from luced.runtime.state import (
    Loaded,
    SequenceCache,
    SequenceState,
    Shard,
    WorkerError,
    WorkerState,
    torch_device,
)

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
        self,
        group: str,
        devices: tuple[str, ...],
        inbox: socket.socket | None = None,
        *,
        mirror: Mirror | None = None,  # on another host than the daemon's (runtime.listen)
        hops: Hops | None = None,
    ) -> None:
        super().__init__(group, devices, mirror)
        self._moe_ahead: dict[str, int] = {}  # MoE counts of steps decoded ahead, unreported
        # Links to workers on other hosts (bulk data: runtime.hops); the carry uses them.
        self.hops = hops if hops is not None else Hops()
        # Worker-to-worker links arrive here (luced.ipc.links): a target worker's to the
        # expert worker, or, in the expert worker, one per target worker.
        self.inbox = inbox
        self.remote: RemoteExperts | HopExperts | None = None
        self.expert_server = ExpertServer(self.tensor)
        self.hops.servers["experts"] = self.expert_server.serve_hop
        self.device_problem: str | None = None
        self._load_request: F.Load | None = None  # the load in hand (reuse_load)
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
            F.KVLayout: self.kv_layout,
            F.KVExport: self.kv_export,
            F.KVImport: self.kv_import,
            F.KVForget: self.kv_forget,
            F.KVShare: self.kv_share,
            F.KVPage: self.kv_page,
            F.KVFiles: self.kv_files,
            F.Stats: self.stats,
            F.Shutdown: self.shutdown,
            F.Ping: self.ping,
            F.Link: self.link,
        }

    def handle(self, req: F.Request) -> F.Reply:
        try:
            if self.instance is None and not isinstance(
                req, F.Hello | F.Stats | F.Shutdown | F.Ping
            ):
                raise WorkerError(f"{req.OP} before hello: the daemon opens with hello")
            if not isinstance(req, F.Forward | F.Stats | F.Ping):  # it may touch a sequence
                self.lookahead.drop(self)
            return self._handlers[type(req)](req)
        except Exception as e:
            log.warning("%s failed: %s: %s", req.OP, type(e).__name__, e)
            raise

    def after_reply(self) -> None:
        """Between a reply and the next request: the step decoded ahead, if one is planned."""
        before = self._moe_counts()
        try:
            self.lookahead.run(self, forward_verb.compute)
        except Exception:  # the next frame computes its step itself
            log.exception("decoding ahead failed")
            self.lookahead.drop(self)
        for k, v in self._moe_counts().items():  # reported with the next forward's reply
            self._moe_ahead[k] = self._moe_ahead.get(k, 0) + v - before[k]

    def detach(self) -> None:
        """The daemon went away (a worker on another host serves the next one): drop its
        sequences, regions and links; keep the weights for a daemon that loads the same."""
        if self.loaded is not None:
            for sequence in list(self.loaded.sequences):
                self.loaded.release(sequence)
        if self.draft is not None:
            self.draft.samplers.clear()
        self.instance = None
        self.hops.close()
        self.attachments.close()

    def reuse_load(self, req: F.Load) -> F.LoadReply | None:
        """The reply of the load in hand when `req` asks for exactly it again (a daemon
        that reconnected), else None: the weights stay, every sequence starts empty."""
        if self.loaded is None or req != self._load_request:
            return None
        for sequence in list(self.loaded.sequences):
            self.loaded.release(sequence)
        log.info("layers %s of %s already loaded: reused", list(req.layers), req.model)
        return dataclasses.replace(self.loaded.reply, load_s=0.0)

    def close(self) -> None:
        self.loaded = self.draft = None
        if self.remote is not None:
            self.remote.close()
        self.hops.close()
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
        first: list[SequenceCache] = []  # sequence 0's caches, made now (sizes for the reply)
        blocks: list[BlockPool] = []  # with kv_block: each shard's pool
        if self.remote is not None:  # its link goes too: the daemon links after this load
            self.remote.close()
            self.remote = None
        if req.moe_link:  # the expert worker is on another host than this one
            self.remote = HopExperts(self.hops, req.moe_link)
        elif req.moe_scratch is not None and self.inbox is not None:
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
            if req.kv_block:  # one pool of blocks per shard for every sequence
                blocks.append(model.new_block_pool(req.kv_block, max_blocks=req.kv_blocks))
                cache: SequenceCache = model.new_paged_cache(
                    blocks[-1], req.kv_capacity, scored=req.kv_scored
                )
            else:
                cache = model.new_cache(req.kv_capacity)
            shards.append(Shard(model))
            first.append(cache)
        cfg = shards[0].model.cfg
        reply = F.LoadReply(
            n_layers=cfg.n_layers,
            hidden=cfg.hidden,
            vocab=cfg.vocab,
            layers=req.layers,
            dtype=req.dtype,
            kv_capacity=req.kv_capacity,
            load_s=time.monotonic() - t0,
            recurrent=tuple(layer for c in first if c.recurrent for layer in c.recurrent.shapes),
            kv_record_bytes=sum(pool.block_nbytes() for pool in blocks),
            kv_state_bytes=kv_state.record_bytes([c.recurrent for c in first]),
            moe_fingerprint=placement.fingerprint() if placement is not None else "",
            kernels=native.describe(torch_device(req.devices[0])),
        )

        def new_caches() -> list[SequenceCache]:
            if blocks:
                return [
                    s.model.new_paged_cache(b, req.kv_capacity, scored=req.kv_scored)
                    for s, b in zip(shards, blocks, strict=True)
                ]
            return [s.model.new_cache(req.kv_capacity) for s in shards]

        graphs = _decode_graphs(req, shards, blocks)
        self.loaded = Loaded(Path(req.model), shards, reply, new_caches, blocks, graphs)
        self.loaded.sequences[0] = SequenceState(first)
        self._load_request = req
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
        if self.inbox is None and self.hops.own_store is None:
            raise WorkerError("load_experts needs a worker started with --inbox (or --listen)")
        reply = self.expert_server.load(req)
        if self.inbox is not None:
            self.expert_server.serve_inbox(self.inbox)  # (on another host: hops, as linked)
        return reply

    def truncate(self, req: F.Truncate) -> F.TruncateReply:
        state = self.model("truncate").sequence(req.sequence)
        if req.position > state.position:
            raise WorkerError(
                f"cannot truncate to {req.position}: the KV holds {state.position} positions"
            )
        state.truncate(req.position)
        for cache in state.caches:  # a block table drops the blocks wholly past it
            if isinstance(cache, PagedKVCache):
                cache.release_past(req.position)
        return F.TruncateReply(position=state.position)

    def reset(self, req: F.Reset) -> F.ResetReply:
        if self.draft is not None:  # a kept draft sampler belongs to the sequence it drew for
            self.draft.samplers.pop(req.sequence, None)
        if self.loaded is None:
            if self.draft is not None:
                return F.ResetReply()  # a draft-only worker has nothing else to reset
            self.model("reset")  # raises: nothing is loaded
        m = self.model("reset")
        if req.release:
            m.release(req.sequence, keep_sampler=req.keep_sampler)
            return F.ResetReply()
        state = m.sequence(req.sequence)
        state.drop_sampler()
        state.clear()
        return F.ResetReply()

    # KV snapshots (prefix cache): luced.runtime.kv_snapshot has the copies.

    def kv_layout(self, req: F.KVLayout) -> F.KVLayoutReply:
        return kv_snapshot.layout(self, req)

    def kv_export(self, req: F.KVExport) -> F.KVExportReply:
        return kv_snapshot.export(self, req)

    def kv_import(self, req: F.KVImport) -> F.KVImportReply:
        return kv_snapshot.import_(self, req)

    def kv_forget(self, req: F.KVForget) -> F.KVForgetReply:
        return kv_snapshot.forget(self, req)

    def kv_share(self, req: F.KVShare) -> F.KVShareReply:
        shared = self.model("kv_share").share(req.sequence, req.source, req.position)
        return F.KVShareReply(position=shared)

    def kv_page(self, req: F.KVPage) -> F.KVPageReply:
        m = self.model("kv_page")
        if not m.block_pools:
            raise WorkerError("kv_page needs a load with kv_block (one block pool per shard)")
        hosts = forward_verb.host_tier(self, req.kv_host, req.moves, m) if req.moves else []
        records = None
        if req.kv_states is not None:  # a hybrid's state records (the frame pairs them)
            records = self.tensor(req.kv_states)
            if records.shape[1] != m.reply.kv_state_bytes:
                got, want = records.shape[1], m.reply.kv_state_bytes
                raise WorkerError(f"state records of {got} bytes, this worker's are {want}")
            if max(record for *_, record in req.states) >= records.shape[0]:
                raise WorkerError(f"a state names a record past the {records.shape[0]} held")
        paged = m.page(req.sequence, req.moves, hosts, req.tokens, req.states, records)
        return F.KVPageReply(paged=paged)

    def kv_files(self, req: F.KVFiles) -> F.KVFilesReply:
        """This host's part of the prefix cache's block files (runtime/kv_store.py)."""
        if self.block_files is None:
            raise WorkerError("kv_files: only a worker on another host keeps block files")
        m = self.model("kv_files")
        if not m.block_pools:
            raise WorkerError("kv_files needs a load with kv_block (one block pool per shard)")
        rows = self.tensor(req.kv_host).numpy() if req.kv_host is not None else None
        record_bytes, block = m.reply.kv_record_bytes, m.block_pools[0].block
        return self.block_files.serve(req, rows, record_bytes, block)

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
            "kv_position": max((q.position for q in m.sequences.values()), default=0) if m else 0,
            "kv_capacity": m.reply.kv_capacity if m else 0,
            "kv_sequences": len(m.sequences) if m else 0,
            "kv_bytes": _kv_bytes(m) if m else 0,
            # With a block pool (load kv_block): the blocks held (a shared one once), the
            # blocks the sequences' tables map (what they would hold without sharing), and
            # the pool's bytes.
            "kv_blocks_used": sum(p.used_blocks for p in m.block_pools) if m else 0,
            "kv_blocks_mapped": sum(p.mapped_blocks for p in m.block_pools) if m else 0,
            "kv_pool_bytes": sum(p.nbytes() for p in m.block_pools) if m else 0,
            "decode_graph_steps": m.decode_graphs.steps if m and m.decode_graphs else 0,
            "decode_graph_windows": m.decode_graphs.windows if m and m.decode_graphs else 0,
            # Forwards answered from the step decoded ahead, and such steps rolled back.
            "ahead_served": self.lookahead.served,
            "ahead_dropped": self.lookahead.dropped,
            "kernels": m.reply.kernels if m else "",
            "draft": str(self.draft.draft.path) if self.draft else "",
            "expert_calls_served": self.expert_server.calls,
            **self.hops.stats(),
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

    def ping(self, req: F.Ping) -> F.PingReply:
        return F.PingReply()

    def link(self, req: F.Link) -> F.LinkReply:
        assert self.instance is not None  # (handle refuses a link before hello)
        return self.hops.link(req, self.instance)

    def forward(self, req: F.Forward) -> F.ForwardReply:
        before = self._moe_counts()
        reply = forward_verb.forward(self, req)
        # with what the steps decoded ahead since the last reply did (served or dropped)
        ahead, self._moe_ahead = self._moe_ahead, {}
        moe = {k: v - before[k] + ahead.get(k, 0) for k, v in self._moe_counts().items()}
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


def _kv_bytes(m: Loaded) -> int:
    """Bytes of every sequence's caches (a shared block counted once: each holder's share)."""
    return sum(c.nbytes() for q in m.sequences.values() for c in q.caches)


def rss_bytes() -> int:
    """Resident set size now (Linux /proc; the peak from getrusage elsewhere)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _decode_graphs(
    req: F.Load, shards: list[Shard], blocks: list[BlockPool]
) -> DecodeGraphs | None:
    """The load's captured decode step (frames.Load.decode_graphs), or None; says which."""
    device = shards[0].model.device
    if req.decode_graphs == "off" or (req.decode_graphs == "auto" and device.type != "cuda"):
        return None
    if not blocks:
        why: str | None = "no K/V block pool (--kv-flash or --kv-block-size 0)"
    elif len(shards) > 1:
        why = "the layers span several devices"
    else:
        why = supports(shards[0].model)
    if why is not None:
        log.info("decode graphs: off, %s", why)
        return None
    compile = req.decode_graphs == "compile"
    how = "captured as CUDA graphs" if device.type == "cuda" else "run without a graph on the CPU"
    if compile:
        how += ", compiled by torch.compile on each batch size's first step"
    log.info("decode graphs: decode steps take the fixed-shape step, %s", how)
    return DecodeGraphs(shards[0].model, blocks[0], req.kv_capacity, compile=compile)
