"""The daemon's handle on the target model: its workers, shared regions and sequences.

The target may be split (``placement.py``): one worker per backend group, in layer order,
each holding a contiguous layer range as one or more shards (one per device); the
executor (``executor.py``) keeps them alive. The workers hold every running sequence, by
slot: its KV, token history and sampler. This module owns what lives beside them in the
daemon: the shared regions, each slot's feature ring (DFlash captures) and KV Flash pager,
the draft, and the per-sequence KV operations (release, share, snapshot export and
import). One step's forward through the workers is ``runner.py``'s.

Segments ``<name>-io``, ``<name>-act``, ``<name>-ring<slot>`` (name "target" by default;
created by the daemon, attached by the workers, unlinked by the daemon)::

    io   tokens         int32   [step_tokens]             daemon writes the ids to feed
         ids            int32   [step_tokens]             last worker: sampled / argmax ids
         logprobs       float32 [step_tokens]             last worker: chosen-token logprobs
         topk_ids       int32   [step_tokens * 20]        last worker: top-k ids (k <= 20)
         topk_logprobs  float32 [step_tokens * 20]        last worker: their logprobs
    act  boundary-k     dtype   [step_tokens, hidden]     worker k writes, worker k+1 reads
         logits         float32 [logit_rows, vocab]       last worker writes
         allowed        int32   [step_tokens, ceil(vocab/32)]  daemon writes a grammar's
                                                          masks (a bit per id, constraint.py)
         embeddings     float32 [sequences, hidden]     last worker: a pooled row per
                                                          embedding span (pooling.py)
    draft (with speculation)
         draft_ids      int32   [slots * block]           the draft's worker: a window's ids
         draft_probs    float32 [slots * (block-1), vocab]  q rows of sampled windows
    ring<slot> (with a DFlash draft)                      see feature_ring.py

step_tokens is the step's token budget (`--max-step-tokens`). With a block pool and
finished prompts kept, or with KV Flash, blocks are paged out to host records
(``engine/kv/host.py``: segment ``<name>-kvhost``); with KV Flash (`kv_flash`), each
running slot's pager (``engine/kv/pager.py``) bounds the blocks its table keeps resident,
paging the others out before each span (``kvflash/transport.py``: ``<name>-kvflash``).

``act`` is sized from the first load reply (hidden, vocab) and kept across restarts.
Write ordering: a region's writer writes before the frame (daemon) or before its reply
(worker); its reader reads only after that. Frames are sent one at a time, in order, so
each region has one writer at any moment and no locks are needed.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Callable, Sequence

import numpy as np

from luced.cache.layout import TensorSpec
from luced.engine.executor import (
    Deadlines,
    Executor,
    Slot,
    WorkerDied,
    WorkerHandle,
    WorkerReplyError,
)
from luced.engine.experts import ExpertWorker
from luced.engine.feature_ring import FeatureRing
from luced.engine.hops import Hops
from luced.engine.kv.blocks import BlockTables, pool_blocks
from luced.engine.kv.holdings import FIRST_BLOCKS, Holdings
from luced.engine.kv.host import HostRecords, kept_records, store_records
from luced.engine.kv.pager import Pager, PagerConfig
from luced.engine.kv.state_records import StateRecords
from luced.engine.kv_transfer import KVTransfer
from luced.engine.kvflash.lanes import FlashLanes
from luced.engine.placement import (
    TargetPlacement,
    WorkerSpec,
    local_device,
    parse_device,
    worker_spec,
)
from luced.engine.remote import RemoteSettings, RemoteWorker
from luced.engine.ring_relay import RingRelay
from luced.ipc.frames import (
    KVShare,
    KVShareReply,
    Load,
    LoadDraft,
    LoadDraftReply,
    Reset,
    Stats,
    StatsReply,
    Truncate,
)
from luced.ipc.regions import Region, RegionAllocator, required_bytes, view
from luced.ipc.shm import Segment, ShmOwner

log = logging.getLogger(__name__)

# DFlash rollback of a recurrent state (a hybrid target): "select" keeps the state after
# each position of a verify window (the recurrent form) and a roll back inside it picks
# the accepted one; "replay" rewinds to the window's start and feeds the kept tokens again
# (one more forward per rejected window). tools/bench_dflash.py --rollback measures both.
ROLLBACK = "select"

MAX_TOP_LOGPROBS = 20
MAX_BLOCK = 64  # longest draft window a request may use


def _flash_blocks(placement: TargetPlacement, kv_flash: PagerConfig | None) -> TargetPlacement:
    """The placement with KV Flash's block as the pool's (it pages the pool's blocks)."""
    if kv_flash is None:
        return placement
    if placement.kv_block not in (0, kv_flash.block):
        raise ValueError(
            f"KV Flash pages blocks of {kv_flash.block} rows, not the placement's "
            f"{placement.kv_block}"
        )
    return dataclasses.replace(placement, kv_block=kv_flash.block)


class Target:
    """The target model behind its workers (see the module docstring)."""

    def __init__(
        self,
        owner: ShmOwner,
        placement: TargetPlacement,
        on_state_change: Callable[[], None] | None = None,
        name: str = "target",  # segment name prefix: several targets may share one owner
        kv_flash: PagerConfig | None = None,  # each sequence's resident bound and policy
        deadlines: Deadlines | None = None,  # of worker calls and starts (default: Deadlines())
        sequences: int = 1,  # slots: the sequences the workers hold at once
        step_tokens: int | None = None,  # tokens one step feeds (--max-step-tokens)
        remote: RemoteSettings | None = None,  # to reach workers on other hosts (tcp://)
    ) -> None:
        self.owner = owner
        # Default: a prompt chunk beside a draft window of 16 for every sequence.
        self.step_tokens = step_tokens or placement.max_batch_tokens + 16 * sequences
        self.sequences = sequences
        # KV Flash: each running slot's pager over the block tables (`pager`).
        self.flash = FlashLanes(kv_flash, sequences, placement.kv_capacity) if kv_flash else None
        self.name = name
        self.placement = placement = _flash_blocks(placement, kv_flash)
        deadlines = deadlines or Deadlines()

        def remote_worker(spec: WorkerSpec, on_exit: Callable) -> RemoteWorker:
            assert remote is not None
            return RemoteWorker(spec, owner.instance, owner, remote, on_exit, deadlines)

        self.executor = Executor(
            owner.instance,
            placement.workers,
            self._load,
            on_state_change,
            deadlines,
            inboxes=placement.moe_expert is not None,
            remote=remote_worker if remote is not None else None,
        )
        self.ring_relay: RingRelay | None = None  # a draft on another host: its rings' rows
        self.hops = Hops(self.executor, timeout=deadlines.call)
        self.experts = (
            ExpertWorker(owner, name, placement, self.executor, self.hops)
            if placement.moe_expert
            else None
        )
        self.transfer = KVTransfer(self.executor, owner.instance)
        self.load_s, self.n_layers, self.hidden, self.vocab = 0.0, 0, 0, 0
        self._rings: dict[int, FeatureRing] = {}  # each slot's, while captures are on
        self.capture: tuple[tuple[int, ...], int, str] | None = None  # layers, cap, dtype
        self.regions: dict[str, Region] = {}
        self.arrays: dict[str, np.ndarray] = {}
        # Recurrent layers of each pipeline worker's load, by its layer range.
        self._recurrent: dict[tuple[int, int], tuple[int, ...]] = {}
        self.rollback: str = ROLLBACK  # how a verify's rejected rows leave a recurrent state
        self.draft: LoadDraftReply | None = None  # the DFlash draft, when one is loaded
        self._draft_path: str | None = None
        self._draft_device = ""
        # The K/V block tables of the workers' pools (a load with kv_block): sized for the
        # slots' whole contexts until the engine sizes them from its account (`size_blocks`).
        self.blocks: BlockTables | None = None
        self.host: HostRecords | None = None  # the tables' host records, when they have any
        self.store_records = 0  # of them, the prefix cache's block store's (`size_blocks`)
        self.store_bytes = 0  # what those may take (--prefix-cache-bytes), sized at `start`
        self.states: StateRecords | None = None  # a hybrid's, for the block store (`start`)
        if placement.kv_block:
            self.size_blocks(sequences * placement.kv_capacity, sequences)
        self.lookup_drafts = False  # n-gram windows (`enable_lookup_drafts`)
        self.block_size = 0  # the longest draft window (with speculation)

    def size_blocks(
        self, positions: int, lanes: int, kept: int = 0, store: int = 0
    ) -> Holdings | None:
        """The workers' pools hold `positions` (the KV account's) for at most `lanes`
        tables at once (`pool_blocks`); before the first load. The lanes past the running
        slots (finished sequences' kept prompts) keep at most `kept` positions, paged out
        to host records under pressure (`kept_records` of them). With KV Flash each running
        slot keeps at most its pager's quota resident, the kept lanes at most `kept`
        positions resident, and the host records are `FlashLanes.records`. `store`: bytes
        of host records more for the prefix cache's block store (sized at start,
        `store_records`; a hybrid's states take a share, `states`). -> with kept lanes'
        host records, what the lanes hold (the budget's)."""
        block, flash = self.placement.kv_block, self.flash
        if not block:
            return None
        kept_lanes = lanes - self.sequences
        if flash is None:
            n = pool_blocks(positions, lanes, block)
            kept_host = kept_records(kept, block, kept_lanes)
            paging = kept_host
        else:
            n = flash.blocks_for(pool_blocks(kept, kept_lanes, block) if kept_lanes > 0 else 0)
            kept_host = flash.kept_records(kept, max(0, kept_lanes))
            paging = flash.records(kept, max(0, kept_lanes))  # the running slots' too
        self.store_records = store_records(self.placement.kv_capacity, block) if store else 0
        self.store_bytes = store
        if self.blocks is not None and self.blocks.n_blocks != n and self.n_layers:
            raise RuntimeError(
                "the block pool is sized before the workers load (make the engine first)"
            )
        records = paging + self.store_records
        self.blocks = BlockTables(n, block, records)
        self.host = HostRecords(records) if records else None
        if flash is not None:
            return flash.holdings(self.blocks, kept_host)
        return Holdings(self.blocks, None, FIRST_BLOCKS, kept_host) if kept_host else None

    # -- lifecycle -----------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return self.executor.ready

    @property
    def restart_error(self) -> str | None:
        """Why a dead worker could not be started again (it is retried with backoff)."""
        return self.executor.restart_error

    def watch(self, callback: Callable[[], None]) -> None:
        """Call `callback` (in place of the constructor's) whenever a worker starts, is
        loaded, dies or fails to restart."""
        self.executor.on_state_change = callback

    async def start(self) -> None:
        """Start and load every worker (concurrently), then carve the shared regions."""
        self._make_io()
        if self.experts is not None:
            self.experts.carve()
            await self.experts.start()  # first: the pipeline workers link as they load
        await self.executor.start()
        self._make_act()
        if self.host is not None and not self.host.regions:
            _carve_host_records(self)

    async def close(self) -> None:
        await self.executor.close()
        self.transfer.close()

    def _carve(self, name: str, specs: dict[str, tuple[list[int], str]]) -> Segment:
        segment = self.owner.create(f"{self.name}-{name}", required_bytes(specs.values()))
        alloc = RegionAllocator.for_segment(segment)
        for key, (shape, dtype) in specs.items():
            region = alloc.alloc(key, shape, dtype)
            self.regions[key] = region
            self.arrays[key] = view(segment, region)
        return segment

    def _make_io(self) -> None:
        n = self.step_tokens
        self._carve(
            "io",
            {
                "tokens": ([n], "int32"),
                "ids": ([n], "int32"),
                "logprobs": ([n], "float32"),
                "topk_ids": ([n * MAX_TOP_LOGPROBS], "int32"),
                "topk_logprobs": ([n * MAX_TOP_LOGPROBS], "float32"),
            },
        )

    def _make_act(self) -> None:
        n, dt = self.step_tokens, self.placement.dtype
        n_boundaries = len(self.executor.slots) - 1
        specs = {f"boundary-{k}": ([n, self.hidden], dt) for k in range(n_boundaries)}
        specs["logits"] = ([self.placement.logit_rows, self.vocab], "float32")
        specs["allowed"] = ([n, (self.vocab + 31) // 32], "int32")
        specs["embeddings"] = ([self.sequences, self.hidden], "float32")  # a row per span
        self._carve("act", specs)

    @property
    def prompt_chunk(self) -> int:
        """Positions one prompt chunk spans (chunks end at its multiples): --max-batch-tokens,
        fewer with KV Flash, whose step must fit a sequence's quota beside its sink (and
        may straddle one more block)."""
        chunk = self.placement.max_batch_tokens
        return self.flash.prompt_chunk(chunk) if self.flash is not None else chunk

    def pager(self, slot: int) -> Pager | None:
        """`slot`'s KV Flash pager over its block table (`FlashLanes.pager`; None without
        KV Flash)."""
        return self.flash.pager(slot) if self.flash is not None else None

    def resident(self, slot: int, n: int) -> int:
        """How many of `slot`'s first n positions a snapshot may copy: all of them, but
        under KV Flash only up to its first paged-out block."""
        return self.flash.resident(slot, n) if self.flash is not None else n

    async def _load(self, slot: Slot, worker: WorkerHandle) -> LoadDraftReply | None:
        """The executor's loader: a pipeline slot gets its layers (and the draft back after
        a restart); the draft's own worker its draft and the target's edges."""
        p, plan = self.placement, slot.plan
        if slot.role == "experts":
            assert self.experts is not None
            await self.experts.load(slot, worker)
            return None
        if plan is None:
            reply = await self._load_draft_into(worker, target=p.model)
            await self.hops.ensure()  # its hop, when it is on another host
            return reply
        reply = await worker.load(
            Load(
                model=p.model,
                layers=plan.layers,
                dtype=p.dtype,  # type: ignore[arg-type]
                devices=plan.devices,
                kv_capacity=p.kv_capacity,
                owns_embed=plan.owns_embed,
                owns_head=plan.owns_head,
                device_splits=plan.device_splits,
                kv_scored=self.flash is not None and self.flash.cfg.policy == "qk",
                moe_hot=-1 if p.moe_hot is None else p.moe_hot,
                moe_profile=p.moe_profile,
                **(self.experts.load_fields(slot) if self.experts else {}),
                weights=p.weights_mode,
                batch_invariant=p.batch_invariant,
                kv_dtype=p.kv_dtype,
                kv_block=self.blocks.block if self.blocks else 0,
                kv_blocks=self.blocks.n_blocks if self.blocks else 0,
                decode_graphs=p.decode_graphs,
            )
        )
        if self.experts is not None:
            await self.experts.pipeline_loaded(slot, worker, reply)
        if self.host is not None:
            self.host.loaded(
                plan.layers,
                reply.kv_record_bytes,
                slot.spec.group,
                reply.kv_state_bytes,
                slot.spec.remote,
            )
        self.load_s = max(self.load_s, reply.load_s)
        self._recurrent[plan.layers] = reply.recurrent
        self.n_layers, self.hidden, self.vocab = reply.n_layers, reply.hidden, reply.vocab
        if self._draft_path is not None and self.executor.draft_slot is None:
            await self._load_draft_into(worker)  # a restarted worker gets its draft back
        await self.hops.ensure()  # its hops to workers on other hosts, when both ends are up
        return None

    # -- sequences -----------------------------------------------------------------------

    def check_in_sync(self) -> None:
        if not self.executor.in_sync:
            raise WorkerDied("a model worker was restarted; the request must start over")

    async def release(self, slot: int, keep_sampler: bool = False) -> None:
        """Forget `slot`'s sequence in every worker (its caches are freed); with
        `keep_sampler` the workers keep its sampler (a preempted sequence resumes there)."""
        if self.blocks is not None:  # first: a worker that fails forgets it too
            self.blocks.free(slot)
        if self.flash is not None:
            self.flash.forget(slot)
        reset = Reset(sequence=slot, release=True, keep_sampler=keep_sampler)
        await asyncio.gather(*(w.call(reset) for w in self.executor.workers()))

    async def reset(self, slot: int) -> None:
        """Empty `slot`'s sequence in every worker (its sampler dropped): in sync again,
        unless a worker is gone."""
        if self.blocks is not None:
            self.blocks.free(slot)
        if self.flash is not None:
            self.flash.forget(slot)
        reset = Reset(sequence=slot)
        await asyncio.gather(*(w.call(reset) for w in self.executor.workers()))
        self.executor.in_sync = True

    async def truncate(self, slot: int, position: int) -> None:
        """Roll `slot`'s sequence back to `position` in every worker (the next span's start
        does this too; this is for a failed step's undo)."""
        if self.blocks is not None:  # the blocks wholly past it go, as in the workers
            self.blocks.truncate(slot, position)
        if self.flash is not None:
            self.flash.truncate(slot, position)
        frame = Truncate(position=position, sequence=slot)
        await asyncio.gather(*(w.call(frame) for w in self.executor.workers()))

    @property
    def recurrent(self) -> bool:
        """Whether some layer keeps a recurrent state (a hybrid such as qwen35): its KV
        cannot be cut at any position, and a prefix snapshot does not cover it."""
        return any(self._recurrent.values())

    @property
    def shares_prefixes(self) -> bool:
        """Whether a sequence may start on another's prefix blocks (`share`): the workers
        hold every sequence's K/V in one block pool, and no per-sequence state outside the
        K/V and the feature ring (a recurrent state) would need it. Paged-out blocks are
        shared too (their host records)."""
        return self.placement.kv_block > 0 and not self.recurrent

    async def share(self, slot: int, source: int, n: int) -> int:
        """Start `slot` (empty) on `source`'s first n committed positions, sharing their
        K/V blocks in every worker instead of computing or copying them. Returns the
        positions shared. If a worker refuses, every worker's copy of `slot` is reset and
        the error raised."""
        if not self.shares_prefixes:
            raise ValueError("this target does not share prefixes (shares_prefixes)")
        frame = KVShare(sequence=slot, source=source, position=n)
        try:
            if self.blocks is not None:  # the source's blocks, as each worker takes them
                self.blocks.free(slot)
                try:
                    self.blocks.share(slot, source, n)
                except ValueError as exc:  # as a worker would refuse it
                    raise WorkerReplyError(f"kv_share: {exc}") from None
            replies = await asyncio.gather(*(w.call(frame) for w in self.executor.workers()))
        except BaseException:
            with contextlib.suppress(Exception):
                await self.reset(slot)  # in sync again (empty) unless a worker is gone
            raise
        shared = {r.position for r in replies if isinstance(r, KVShareReply)}
        if shared != {n}:
            await self.reset(slot)
            raise WorkerReplyError(f"the workers shared {sorted(shared)} positions, not {n}")
        if (pager := self.pager(slot)) is not None:
            pager.sync(n)  # a fresh start: its blocks as if it had planned them
        return n

    def share_ring(self, slot: int, source: int, n: int, floor: int, position: int) -> int:
        """Copy `source`'s captures of positions below n into `slot`'s ring (the draft reads
        them as the prefix's context). The source's ring holds a position only from its
        floor on and within ring_cap of what it has fed, rejected window rows included (at
        most MAX_BLOCK past its position). -> the floor of `slot`'s ring."""
        mine, theirs = self.ring(slot), self.ring(source)
        if mine is None or theirs is None:
            return 0
        lo = max(floor, position + MAX_BLOCK - mine.ring_cap, 0)
        if lo < n:
            self.put_ring(slot, lo, theirs.rows(lo, n))
        return min(lo, n)

    def put_ring(self, slot: int, start: int, rows: np.ndarray) -> None:
        """Write captures of positions [start, start + len(rows)) into `slot`'s ring (a
        shared or restored prefix's), and tell a draft on another host they changed."""
        ring = self.ring(slot)
        assert ring is not None, "captures are off"
        ring.put(start, rows)
        if self.ring_relay is not None:
            self.ring_relay.wrote(slot, start)

    # -- captures and the draft ------------------------------------------------------------

    def enable_capture(self, layers: Sequence[int], ring_cap: int, dtype: str = "float32") -> None:
        """From now on every forward captures `layers` into its sequence's ring."""
        if self.capture is not None:
            raise RuntimeError("captures are already enabled")
        if not self.hidden:
            raise RuntimeError("start the target first (the ring width is the model's)")
        bad = [layer for layer in layers if not 0 <= layer < self.n_layers]
        if bad:
            raise ValueError(f"capture layers {bad} outside the model's {self.n_layers} layers")
        self.capture = (tuple(layers), ring_cap, dtype)

    def ring(self, slot: int) -> FeatureRing | None:
        """`slot`'s feature ring, made on first use (None while captures are off). A slot
        keeps its ring for the sequences that follow in it: each reads only rows it wrote
        (`Sequence.ring_floor`)."""
        if self.capture is None:
            return None
        ring = self._rings.get(slot)
        if ring is None:
            layers, cap, dtype = self.capture
            name = f"{self.name}-ring{slot}"
            ring = self._rings[slot] = FeatureRing(
                self.owner, layers, cap, self.hidden, dtype, name
            )
        return ring

    async def load_draft(
        self,
        path: str,
        device: str | None = None,
        ring_cap: int = 4096,
        block_size: int = 16,
        python: str | None = None,
    ) -> LoadDraftReply:
        """Load the draft and start capturing its feature layers into the rings.

        The draft embeds its window and projects its output with the target's embedding and
        head. It joins the target's worker when that worker holds both (an unsplit target)
        and `device` is None or one of that worker's devices; otherwise it gets a worker of
        its own on `device` (default: the head's device), which loads the target's
        embedding and head beside it. Either way it reads the rings in place.
        """
        if not 2 <= block_size <= MAX_BLOCK:
            raise ValueError(f"block size {block_size} outside [2, {MAX_BLOCK}]")
        self._draft_path = path
        slots = self.executor.slots
        first = slots[0]
        assert first.plan is not None
        if device is None and len(slots) == 1:
            device = first.plan.devices[0]
        device = device or slots[-1].plan.devices[-1]  # type: ignore[union-attr]
        group = parse_device(device)[1]
        self._draft_device = device
        if len(slots) == 1 and device in first.plan.devices and group == first.spec.group:
            reply = await self._load_draft_into(self.executor.workers()[0])
        else:
            spec = worker_spec(device, {group: python or first.spec.python}, first.spec.threads)
            started = await self.executor.add_draft_slot(spec)
            assert isinstance(started, LoadDraftReply)
            reply = started
            if spec.remote:
                await self._relay_rings()
        if reply.mask_token_id is None:
            raise ValueError(f"{path}: the draft config names no mask_token_id")
        self.draft = reply
        self.enable_capture(reply.capture_layers, min(ring_cap, self.placement.kv_capacity))
        self._make_draft(block_size)
        return reply

    async def _relay_rings(self) -> None:
        """A draft on another host reads the rings' rows through a local pipeline worker
        (the last one), over the hop "draft" (``ring_relay.py``); inline without one."""
        draft = self.executor.draft_slot
        assert draft is not None
        local = [s for s in self.executor.slots if not s.spec.remote]
        hop = self.hops.add("draft", local[-1], draft) if local else None
        await self.hops.ensure()
        self.ring_relay = RingRelay(hop, local[-1] if local else None)

    def enable_lookup_drafts(self, block_size: int) -> None:
        """Room for a model-free drafter's windows (``--draft ngram``): its proposals are
        point masses, whose q rows the runner writes for a sampled verify."""
        if not 2 <= block_size <= MAX_BLOCK:
            raise ValueError(f"block size {block_size} outside [2, {MAX_BLOCK}]")
        self.lookup_drafts = True
        self._make_draft(block_size)

    def _make_draft(self, block_size: int) -> None:
        """Every slot's window ids and q rows (a sampled verify of every running sequence
        may share one step)."""
        slots = self.sequences
        self.block_size = block_size
        self._carve(
            "draft",
            {
                "draft_ids": ([slots * block_size], "int32"),  # slot s: [s * block, ..)
                "draft_probs": ([slots * (block_size - 1), self.vocab], "float32"),
            },
        )

    async def _load_draft_into(
        self, worker: WorkerHandle, target: str | None = None
    ) -> LoadDraftReply:
        return await worker.load_draft(
            LoadDraft(
                path=str(self._draft_path),
                dtype=self.placement.dtype,  # type: ignore[arg-type]
                device=local_device(self._draft_device),
                target=target,
            )
        )

    # -- status --------------------------------------------------------------------------

    def flash_status(self) -> dict | None:
        """KV Flash counters (`FlashLanes.status`), or None without KV Flash."""
        return self.flash.status() if self.flash is not None else None

    async def stats(self) -> dict:
        """The first worker's stats, plus every worker's under "workers"."""
        replies = await asyncio.gather(*(w.call(Stats()) for w in self.executor.workers()))
        per = [dict(r.stats) for r in replies if isinstance(r, StatsReply)]
        return {**per[0], "workers": per}

    def describe(self) -> list[dict]:
        return self.executor.describe()

    def moe_status(self) -> dict | None:
        """Expert-worker counters (remote calls, in-process fallbacks, bytes), or None."""
        return dict(self.experts.totals) if self.experts is not None else None

    # -- KV snapshots (the copies: kv_transfer.py) ---------------------------------------

    async def kv_layout(self) -> list[TensorSpec]:
        """Every tensor of a snapshot: each worker's K/V in layer order, then the ring."""
        return await self.transfer.layout(self.ring(0))

    def mover(self, slot: int, position: int, floor: Callable[[int], None]) -> KVMover:
        """The prefix cache's handle on `slot`'s KV (`PrefixCache.save` / `restore`):
        `position` is what the slot holds now; `floor(n)` learns the ring floor a restore
        leaves."""
        return KVMover(self, slot, position, floor)


def _carve_host_records(t: Target) -> None:
    """Once every worker loaded: size the block store's records (--prefix-cache-bytes over
    one record of every worker, within what each worker on another host gives them, its
    hello's `prefix_cache_bytes`; a hybrid's recurrent states take their share first),
    then carve the host records (and KV Flash's and the states' segments). A hybrid with a
    worker on another host keeps snapshots: its store gets no records (its states' moves
    and files are not kept on other hosts)."""
    host, tables = t.host, t.blocks
    assert host is not None and tables is not None
    layers = [s.plan.layers for s in t.executor.slots if s.plan is not None]
    if t.store_records:
        size = t.store_bytes
        remote = any(spec.remote for spec, _ in t.placement.workers)
        if t.recurrent and remote:
            size = 0
        elif t.recurrent:
            t.states, size = host.split_states(layers, size)
        limits = [
            s.handle.hello.prefix_cache_bytes if s.handle and s.handle.hello else None
            for s in t.executor.slots
            if s.plan is not None
        ]
        t.store_records = host.size_store(tables, layers, t.store_records, size, limits)
    if host.records:
        block_bytes = host.carve(t.owner, t.name, layers, tables)
        if t.flash is not None:
            t.flash.carve(t.owner, t.name, len(layers), tables, block_bytes)
    if t.states is not None:
        t.states.carve(t.owner, t.name)


class KVMover:
    """One sequence's snapshot copies (``cache.prefix_cache.KVMover``)."""

    def __init__(
        self, target: Target, slot: int, position: int, floor: Callable[[int], None]
    ) -> None:
        self.target, self.slot, self.position, self._floor = target, slot, position, floor

    async def kv_layout(self) -> list[TensorSpec]:
        return await self.target.kv_layout()

    async def export_kv(
        self, n: int, regions: dict[str, Region], cuts: Sequence[int] = (), entry: str = ""
    ) -> None:
        """Copy positions [0, n) (n <= position) into `regions`; all or nothing. A recurrent
        model's state regions get one slot per cut (ascending to n; the workers kept those
        states). A worker on another host keeps its part as `entry`. The KV is never
        changed."""
        t = self.target
        t.check_in_sync()
        if not 0 <= n <= self.position:
            raise ValueError(f"cannot export {n} positions: {self.position} are committed")
        if t.resident(self.slot, n) < n:
            raise ValueError("KV Flash: a snapshot copies resident blocks only (prompt <= pool)")
        cuts = tuple(cuts) if t.recurrent else ()
        await t.transfer.export(n, regions, t.ring(self.slot), cuts, self.slot, entry)

    async def import_kv(
        self, n: int, regions: dict[str, Region], tokens: Region, entry: str = ""
    ) -> None:
        """Restore positions [0, n) from a snapshot (its token axis may be longer than n;
        a worker on another host imports its own copy of `entry`);
        `tokens` (int32 [>= n]) are the ids at those positions. All or nothing: regions are
        checked first (a bad one changes nothing); if a worker fails after that, every
        worker's copy of the slot is reset and the first error raised."""
        t = self.target
        if not 0 <= n <= t.placement.kv_capacity:
            cap = t.placement.kv_capacity
            raise ValueError(f"cannot import {n} positions into a KV of {cap}")
        pager = t.pager(self.slot)
        if pager is not None and n > pager.cfg.pool_tokens:
            raise WorkerReplyError(f"a snapshot of {n} positions exceeds the KV Flash pool")
        if tokens.dtype != "int32" or len(tokens.shape) != 1 or tokens.shape[0] < n:
            raise ValueError(f"tokens must be int32 [>= {n}], got {tokens.dtype} {tokens.shape}")
        ring = t.ring(self.slot)
        frames = await t.transfer.import_frames(n, regions, tokens, ring, self.slot, entry)
        t.executor.in_sync = False  # the shards may disagree until every one has imported
        try:
            if t.blocks is not None:  # the rows go to fresh blocks of the daemon's choosing
                t.blocks.free(self.slot)
                blocks = t.blocks.grow(self.slot, n)
                frames = [dataclasses.replace(f, blocks=blocks) for f in frames]
            await t.transfer.import_(frames, regions.get("ring"), ring)
        except BaseException:
            self.position = 0
            with contextlib.suppress(Exception):
                await t.reset(self.slot)  # in sync again (empty) unless a worker is gone
            raise
        t.executor.in_sync = True
        self.position = n
        if pager is not None:
            pager.sync(n)  # a fresh start: its blocks as if it had planned them
        if ring is not None:
            # A snapshot of N positions holds valid ring rows only from N - ring_cap on.
            self._floor(max(0, regions["ring"].shape[0] - ring.ring_cap))
            if t.ring_relay is not None:
                t.ring_relay.wrote(self.slot, 0)
