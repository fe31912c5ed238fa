"""What a worker's verb modules share: its loaded shards, its draft, its region views.

``WorkerState`` is the state of one worker process; ``luced.runtime.backend.Backend``
extends it with the core verbs and the frame dispatch, and the verb modules beside it
(``kv_snapshot``, ``dflash.verbs``) take a ``WorkerState``, so no module needs another's
private methods and none imports the dispatcher.

    loaded    the target's shards: one Model per device, layers [a, b) cut at
              device_splits; its sequences, each with a cache per shard, its token
              history and its kept sampler; with a block pool (load kv_block) each cache
              follows the daemon's block table, pages included (KV Flash)
    draft     a DFlash draft, beside the target or alone in the worker
    regions   shared-memory regions viewed as tensors, attached lazily by segment name;
              only segments of the daemon instance that said hello (a worker on another
              host views its mirror of them instead: ``runtime.mirror``)
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from luced.ipc import frames as F
from luced.ipc.regions import Attachments, Region
from luced.runtime.decode_graph import DecodeGraphs
from luced.runtime.device_io import DeviceIO
from luced.runtime.dflash.draft import Draft
from luced.runtime.kv_blocks import MOVE_ADOPT, BlockPool, PagedKVCache
from luced.runtime.kv_cache import KVCache
from luced.runtime.kv_host import SharedHostTier
from luced.runtime.kv_state import StateLayout, plan_states, shard_rows
from luced.runtime.lookahead import Lookahead
from luced.runtime.mirror import Mirror
from luced.runtime.model import Model
from luced.runtime.sampler import Sampler
from luced.sampling_params import SamplingParams, SamplingWire

if TYPE_CHECKING:
    from luced.runtime.kv_store import ShardBlocks
    from luced.runtime.snapshot_store import ShardSnapshots


class WorkerError(Exception):
    """A request this worker cannot serve in its current state (sent back as the error).

    The daemon sees it as ``luced.engine.executor.WorkerReplyError``: the worker lives on.
    """


def torch_device(name: str) -> torch.device:
    """The torch device behind a luced device name; raises WorkerError when unusable.

    ``cpu:N`` names a CPU group (several workers on one CPU) and is plain ``cpu`` to
    torch; ``hip:N`` is ``cuda:N`` in a ROCm build of torch.
    """
    kind, _, index = name.partition(":")
    if index and not index.isdigit():
        raise WorkerError(f"bad device name {name!r}: want KIND or KIND:INDEX")
    if kind == "cpu":
        return torch.device("cpu")
    if kind in ("cuda", "hip"):
        # A ROCm torch drives HIP devices through the torch.cuda API.
        if torch.version.hip is None and (kind == "hip" or torch.version.cuda is None):
            build = "CUDA" if torch.version.cuda else "CPU-only"
            raise WorkerError(f"device {name}: this torch is a {build} build")
        n = torch.cuda.device_count()
        i = int(index or 0)
        if i >= n:
            raise WorkerError(f"device {name}: this torch sees {n} GPU(s)")
        return torch.device("cuda", i)
    if kind == "mps":
        if not torch.backends.mps.is_available():
            raise WorkerError("device mps: not available in this torch")
        return torch.device("mps")
    raise WorkerError(f"unknown device kind in {name!r} (cpu, cuda, hip, mps)")


# A sequence's K/V on one shard: contiguous, or blocks of the shard's block pool (load
# kv_block).
SequenceCache = KVCache | PagedKVCache


@dataclass
class Shard:
    model: Model  # layers [a, b) on one device


@dataclass
class SequenceState:
    """One sequence's share of the worker: its cache on each shard, the ids it fed, the
    sampler kept for it (its generator draws on across steps)."""

    caches: list[SequenceCache]
    tokens: list[int] = field(default_factory=list)
    sampler: Sampler | None = None
    sampling: SamplingWire | None = None

    @property
    def position(self) -> int:
        return self.caches[0].pos

    @property
    def recurrent(self) -> bool:
        return any(cache.recurrent is not None for cache in self.caches)

    def paged(self) -> list[PagedKVCache]:
        """Its caches in a block pool (every one with kv_block, none without)."""
        return [c for c in self.caches if isinstance(c, PagedKVCache)]

    def truncate(self, position: int) -> None:
        """Roll back to `position` (a block table stays as it is: engine/kv/blocks.py)."""
        for cache in self.caches:
            cache.truncate(position)
        del self.tokens[position:]

    def clear(self) -> None:
        """Empty every cache, releasing a block table's blocks, and the token history."""
        for cache in self.caches:
            cache.reset()
        self.tokens.clear()

    def check_table(self, span: F.Span, refs: list[dict[int, int]] | None = None) -> None:
        """WorkerError unless the span's moves and table growth fit this sequence's block
        tables (the daemon's and this worker's are in step); no change. `refs`: per shard,
        what the frame's earlier spans leave of its pool's counts (updated here:
        `PagedKVCache.check_follow`)."""
        for i, cache in enumerate(self.caches):
            if not isinstance(cache, PagedKVCache):
                if span.table:
                    raise WorkerError("a span with a block table, but no block pool is loaded")
                continue
            if not span.table:
                raise WorkerError(f"sequence {span.sequence}: its span carries no block table")
            try:
                shard = None if refs is None else refs[i]
                cache.check_follow(span.copies, span.blocks, span.table, span.moves, shard)
            except ValueError as exc:
                raise WorkerError(
                    f"sequence {span.sequence} is out of step with the daemon's block table: {exc}"
                ) from None

    def follow(self, span: F.Span, hosts: list[SharedHostTier] | None = None) -> None:
        """Apply the span's moves, in order, through each shard's view of the host tier
        (`hosts`, needed when it has moves), then its table growth, on every shard
        (checked by `check_table`)."""
        for i, cache in enumerate(self.caches):
            if isinstance(cache, PagedKVCache):
                if span.moves:
                    assert hosts is not None  # forward checks it
                    cache.apply_moves(span.moves, hosts[i].rows)
                cache.follow(span.copies, span.blocks)

    def drop_sampler(self) -> None:
        self.sampler = self.sampling = None


def kept_sampler(
    holder: SequenceState,
    sampling: SamplingWire,
    logprobs: int | None,
) -> Sampler:
    """The kept sampler, or a new one when none exists or the sampling map changed;
    `logprobs` (None or top k) as the frame's outputs ask."""
    if holder.sampler is None or holder.sampling != sampling:
        holder.sampler = Sampler(SamplingParams.from_wire(sampling))
        holder.sampling = dict(sampling)
    if holder.sampler.params.logprobs != logprobs:
        # Logprobs are computed beside the draw and never touch the generator.
        holder.sampler.params = dataclasses.replace(holder.sampler.params, logprobs=logprobs)
    return holder.sampler


# Sequence ids a worker holds at once: a bound on the caches a daemon can make it allocate.
MAX_SEQUENCES = 256


@dataclass
class Loaded:
    """The loaded target and the sequences it holds. Every frame that acts on one sequence
    (forward's spans, truncate, reset, kv_export, kv_import, kv_share) names it; a sequence
    named for the first time starts empty."""

    path: Path
    shards: list[Shard]
    reply: F.LoadReply
    new_caches: Callable[[], list[SequenceCache]]  # a new sequence's, per shard
    block_pools: list[BlockPool] = field(default_factory=list)  # per shard, with kv_block
    # Decode steps through the captured fixed-shape step (load decode_graphs), or None.
    decode_graphs: DecodeGraphs | None = None
    sequences: dict[int, SequenceState] = field(default_factory=dict)

    def sequence(self, sequence: int) -> SequenceState:
        """`sequence`'s state, made empty on first use (bounded by MAX_SEQUENCES)."""
        state = self.sequences.get(sequence)
        if state is None:
            if not 0 <= sequence < MAX_SEQUENCES:
                raise WorkerError(f"sequence {sequence} outside [0, {MAX_SEQUENCES})")
            if len(self.sequences) >= MAX_SEQUENCES:
                raise WorkerError(f"{MAX_SEQUENCES} sequences are live: release one first")
            state = self.sequences[sequence] = SequenceState(self.new_caches())
        return state

    def release(self, sequence: int, keep_sampler: bool = False) -> None:
        """Forget `sequence` and free its caches (a finished request); the next frame that
        names it starts it anew. `keep_sampler`: only its KV and tokens go, its sampler
        stays (a preempted request's generator draws on where it stopped)."""
        state = self.sequences.pop(sequence, None)
        if state is None:
            return
        for cache in state.caches:
            if isinstance(cache, PagedKVCache):  # its blocks go back to the shard's pool
                cache.free()
        if keep_sampler and state.sampler is not None:
            self.sequences[sequence] = SequenceState(
                self.new_caches(), sampler=state.sampler, sampling=state.sampling
            )

    def page(
        self,
        sequence: int,
        moves: Sequence[tuple[int, int, int, int]],
        hosts: list[SharedHostTier],
        tokens: Sequence[int] = (),
        states: Sequence[tuple[int, int, int]] = (),
        state_records: torch.Tensor | None = None,
    ) -> int:
        """Moves of `sequence`'s block tables outside a forward (`kv_page`: a kept lane paged
        out, the block store's saves, a restored prefix adopted): checked on every shard
        first (WorkerError: nothing changed), then applied in order through each shard's
        view of the host tier (`hosts`, with moves). Adopted entries commit their positions,
        whose ids `tokens` are (its token history grows by them); a sequence named for the
        first time by an adopt starts empty. A hybrid's `states` (`frames.KVPage`) go
        through the worker's state records (`state_records`, uint8 [n, kv_state_bytes],
        the records named checked): the saves first, the load with the adopts. -> its
        PAGED entries."""
        adopts = sum(1 for kind, *_ in moves if kind == MOVE_ADOPT)
        state = self.sequence(sequence) if adopts else self.sequences.get(sequence)
        caches = state.paged() if state is not None else []
        if not caches or state is None:
            raise WorkerError(f"kv_page: sequence {sequence} holds no block table")
        block = caches[0].pool.block
        if len(tokens) != adopts * block:
            raise WorkerError(
                f"kv_page: {adopts} adopted blocks hold {adopts * block} positions, "
                f"the frame names {len(tokens)} token ids"
            )
        if tokens and not 0 <= min(tokens) <= max(tokens) < self.reply.vocab:
            raise WorkerError(f"kv_page: token ids must lie in [0, {self.reply.vocab})")
        position = state.position
        recurrent = [cache.recurrent for cache in caches]
        try:
            plan = plan_states(recurrent, states, position + adopts * block, adopts > 0)
        except ValueError as exc:
            raise WorkerError(f"kv_page: sequence {sequence}: {exc}") from None
        try:
            for cache in caches:
                length = len(cache.table) + adopts
                cache.check_follow((), (), length, moves, {})
        except ValueError as exc:
            raise WorkerError(
                f"kv_page: sequence {sequence} is out of step with the daemon's block table: {exc}"
            ) from None
        rows = shard_rows(state_records, recurrent) if state_records is not None else []
        for rec, saves, mine in zip(recurrent, plan.saves, rows, strict=False):
            for snap, record in saves:
                assert rec is not None  # a shard with saves has recurrent layers
                StateLayout(rec).write(snap, mine[record])
        for i, cache in enumerate(caches):
            if plan.load is not None and cache.recurrent is not None:  # the adopted end's
                loaded = StateLayout(cache.recurrent).read(rows[i][plan.load])
                cache.recurrent.load(position + adopts * block, loaded)
                cache.recurrent.save()  # kept: a roll back may come back to it
            if moves:
                cache.apply_moves(moves, hosts[i].rows)
        if adopts:
            del state.tokens[position:]
            state.tokens.extend(tokens)
        return caches[0].paged_blocks

    def share(self, sequence: int, source: int, n: int) -> int:
        """Start `sequence` (emptied first) on `source`'s first n positions: each shard's
        paged cache takes the source's table entries that hold them (blocks, and PAGED
        entries: a kept prompt's paged-out blocks), without copying. Returns n."""
        if not self.block_pools:
            raise WorkerError("kv_share needs a load with kv_block (one block pool per shard)")
        origin = self.sequences.get(source)
        if origin is None:
            raise WorkerError(f"kv_share: sequence {source} holds no KV")
        if n > origin.position:
            raise WorkerError(
                f"kv_share: sequence {source} holds {origin.position} positions, not {n}"
            )
        state = self.sequence(sequence)
        state.clear()  # its blocks go first, as the daemon's table's did
        shared = set()
        try:
            for mine, theirs in zip(state.caches, origin.caches, strict=True):
                assert isinstance(mine, PagedKVCache) and isinstance(theirs, PagedKVCache)
                shared.add(mine.share(theirs, n))
        except ValueError as exc:  # a recurrent cache: its state is not in blocks
            state.clear()
            raise WorkerError(f"kv_share: {exc}") from None
        (positions,) = shared  # every shard's pool has the same block size
        state.tokens[:] = origin.tokens[:positions]
        return positions


@dataclass
class DraftState:
    draft: Draft
    embedder: Model  # holds the target's token embedding
    head: Model  # holds the target's LM head
    reply: F.LoadDraftReply
    # Each sequence's kept sampler and the map it was built from (a sampled window draws
    # on one generator across the sequence's steps).
    samplers: dict[int, tuple[Sampler, dict]] = field(default_factory=dict)

    @property
    def vocab(self) -> int:
        return self.head.cfg.vocab


class WorkerState:
    """One worker's loaded target, draft, region views and counters (module docstring)."""

    def __init__(self, group: str, devices: tuple[str, ...], mirror: Mirror | None = None) -> None:
        self.group = group
        self.devices = devices
        self.instance: str | None = None  # the daemon's, from hello
        self.loaded: Loaded | None = None
        self.draft: DraftState | None = None
        # A GPU worker page-locks each segment it maps (runtime/device_io.py).
        self.device_io = DeviceIO(devices)
        # The daemon's segments, mapped; on another host, the mirror standing for them.
        self.attachments: Attachments | Mirror = (
            mirror
            if mirror is not None
            else Attachments(
                on_attach=lambda seg: self.device_io.attach(seg.name, seg.address(), seg.size),
                on_close=lambda seg: self.device_io.detach(seg.name),
            )
        )
        # A worker on another host keeps its layers' part of the prefix cache itself
        # (runtime.listen): K/V block files, or snapshot rows where the daemon keeps those.
        self.block_files: ShardBlocks | None = None
        self.snapshots: ShardSnapshots | None = None
        self.lookahead = Lookahead()  # the step decoded ahead (frames.Forward.ahead)
        self.forward_count = 0
        self.tokens_processed = 0
        self.busy_s = 0.0
        self.started = time.monotonic()

    def model(self, op: str) -> Loaded:
        """The loaded target; WorkerError naming `op` when none is."""
        if self.loaded is None:
            raise WorkerError(f"{op} before load: no model is loaded")
        return self.loaded

    def _check_segment(self, region: Region) -> None:
        prefix = f"/luced-{self.instance}-"
        if not region.segment.startswith(prefix):
            raise WorkerError(
                f"region segment {region.segment} does not belong to daemon instance "
                f"{self.instance}"
            )

    def bytes_of(self, region: Region) -> torch.Tensor:
        """A region's bytes as a uint8 tensor view (no copy)."""
        self._check_segment(region)
        if not region.nbytes:
            return torch.empty(0, dtype=torch.uint8)
        return torch.frombuffer(self.attachments.buffer(region), dtype=torch.uint8)

    def tensor(self, region: Region) -> torch.Tensor:
        """A torch view of a shared-memory region (no copy; host memory)."""
        self._check_segment(region)
        array = self.attachments.view(region)  # attaches on first use; checks bounds
        if region.dtype == "bfloat16":  # numpy holds the raw bits as uint16
            return torch.from_numpy(array).view(torch.bfloat16)
        return torch.from_numpy(array)

    def upload(self, region: Region, device: torch.device) -> torch.Tensor:
        """A region's view on `device`: no copy on the CPU, one DMA from a page-locked
        segment, a staged copy from one CUDA refused."""
        return self.device_io.upload(self.tensor(region), device, region.segment)

    def fed_inputs(
        self, tokens: Region | None, hidden_in: Region | None, n: int, m: Loaded
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(token ids or None, hidden rows or None): [n] int32 / [n, hidden] views; the
        embedding owner gets ids only, a later shard hidden rows (and maybe the ids)."""
        owns_embed = m.shards[0].model.owns_embed
        ids = None
        if tokens is not None:
            ids = self.tensor(tokens)[:n]
            lo, hi = (int(v) for v in torch.aminmax(ids))
            if lo < 0 or hi >= m.reply.vocab:
                raise WorkerError(f"token ids must lie in [0, {m.reply.vocab}), got [{lo}, {hi}]")
        if hidden_in is None:
            if not owns_embed:
                raise WorkerError(f"layers {list(m.reply.layers)} take hidden_in, not tokens")
            return ids, None
        if owns_embed:
            raise WorkerError("this worker owns the embedding: send tokens, not hidden_in")
        self.check_width("hidden_in", hidden_in, m.reply.hidden)
        # Tokens beside hidden_in are only the history of this shard's sampler.
        return ids, self.tensor(hidden_in)[:n]

    @staticmethod
    def check_width(what: str, region: Region, width: int) -> None:
        if region.shape[1] != width:
            raise WorkerError(f"{what} must have {width} columns, got {list(region.shape)}")
