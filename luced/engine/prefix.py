"""Where a new sequence's prompt is computed already, and where its own is kept for later.

At admission a sequence starts on the longest prefix of its prompt that is held
elsewhere: a running sequence's prompt blocks or a finished one's kept in the pool
(engine/kv/finished.py), shared in the workers' block pool without computing or copying
them (`Target.share`); or the prefix cache's: where the target keeps blocks by prefix key
(engine/kv/block_store.py), its whole blocks in host records or on disk (adopted by its
table, paged in by its first span, or under KV Flash as its pager keeps them; with a
draft's feature rings their captured rows copied back into its ring), else a snapshot
restored into its slot (a copy; the snapshot arena, maybe read from disk first). Sharing
wins a tie: it copies nothing. A sequence arriving while another one is still prefilling
a prefix of its prompt, WAIT_TO_SHARE positions or more past anything held now, waits
for that prefill to pass and shares it (`hold`): requests sent together with one system
prompt compute it once.

When a prompt is in the KV its whole blocks are saved in the block store, or, for the
other targets, its snapshot (`save`), restorable at its chat-turn boundaries too. A recurrent
model's state exists only where a chunk ended, so its chunks end at the latest
MAX_STATE_CUTS turn starts and the workers keep the state there (the prefix cache's
exact-cut mode); with the block store at those turn starts snapped down to block ends and
at the prompt's last block end, where the store keeps the states beside the blocks.

A resumed (preempted) sequence reuses nothing: an import would start its sampler over.
Nor does an embedding sequence, whose pooled rows need every position computed, and its
KV is neither shared nor saved (an encoder keeps none).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable

from luced.cache.index import common_prefix
from luced.cache.prefix_cache import PrefixCache
from luced.engine.executor import WorkerReplyError
from luced.engine.kv.block_store import BlockStore
from luced.engine.kv.budget import KVBudget
from luced.engine.kv.finished import FinishedPrefixes
from luced.engine.kv.prefix_blocks import PrefixBlocks
from luced.engine.request import Sequence
from luced.engine.target import Target
from luced.text.turns import TurnMarker

log = logging.getLogger(__name__)

# Chat-turn boundaries whose recurrent state a hybrid's snapshot keeps besides its end (the
# latest ones: a conversation that branches does so near its end). Each costs one state.
MAX_STATE_CUTS = 4

# Prompt positions worth waiting for another request's prefill to share: fewer cost about
# as much to compute as to wait for.
WAIT_TO_SHARE = 64


class PrefixReuse:
    def __init__(
        self,
        target: Target,
        cache: PrefixCache | None,
        turns: TurnMarker | None,
        kv: KVBudget,
        observe: Callable[[str, float], None],
        finished: FinishedPrefixes | None = None,
    ) -> None:
        """finished: the finished sequences kept in the pool (None: none are kept)."""
        self.target = target
        self.finished = finished
        self.turns = turns
        self.kv = kv
        self.observe = observe
        self.shared_tokens = 0  # prompt positions shared from running or kept sequences
        self.running_blocks = PrefixBlocks()  # the running sequences' computed prompts
        # Workers on other hosts keep their part of each snapshot: tell them what the
        # cache drops, batched per turn of the loop.
        self._dropped: list[str] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self.cache = cache  # after the above: the setter wires the cache to them

    @property
    def cache(self) -> PrefixCache | None:
        return self._cache

    @cache.setter
    def cache(self, cache: PrefixCache | None) -> None:
        self._cache = cache
        blocks = cache.blocks if cache is not None else None
        self.store = blocks if isinstance(blocks, BlockStore) else None  # the arena's place
        if cache is not None and any(s.spec.remote for s in self.target.executor.slots):
            cache.on_drop = self._drop_remote

    def _source(
        self, seq: Sequence, running: Iterable[Sequence]
    ) -> tuple[int, int, Sequence | None]:
        """Where the longest prefix of `seq`'s prompt (all but its last token, which is fed
        to sample from) is held: a running sequence's KV, at most its prompt (shared blocks
        are computed as a fresh prefill computes them) and, without KV Flash, its resident
        blocks (not those restored from disk and not paged in yet: the sharer would page in
        copies the budget does not charge it), or a finished one kept in the pool.
        -> (its lane, positions, the running sequence or None); lane -1 when none."""
        best: tuple[int, int, Sequence | None] = (-1, 0, None)
        if not self.target.shares_prefixes:
            return best
        blocks, holding = self.running_blocks, {}
        tables = self.target.blocks if self.target.flash is None else None
        for other in running:
            if other is seq or other.slot < 0 or other.pooler is not None:
                continue
            held = min(other.computed, len(other.prompt))
            if tables is not None and tables.paged(other.slot):
                held = min(held, tables.resident_prefix(other.slot) * tables.block)
            blocks.hold(other.slot, other.prompt, held)
            holding[other.slot] = other
        blocks.keep_only(holding.keys())  # those gone, and `seq` itself
        lane, n = blocks.longest(seq.prompt[:-1])
        if n:
            best = (lane, n, holding[lane])
        if self.finished is not None:
            lane, n = self.finished.match(seq.prompt)
            if n > best[1]:
                best = (lane, n, None)
        return best

    def hold(self, seq: Sequence, running: list[Sequence]) -> bool:
        """Whether `seq` should wait for a running prefill of its prompt's beginning: it
        starts waiting when that prefill will hold WAIT_TO_SHARE positions more than any
        sequence holds now, and then waits until the prefill has passed them. A kept lane
        it would start on becomes the last to be reclaimed, so its own admission does not
        give that lane up to make room."""
        if seq.generated or seq.pooler is not None or not self.target.shares_prefixes:
            return False
        lane, held, source = self._source(seq, running)
        if source is None and held:
            self.kv.touch(lane)
        coming = max(
            (
                common_prefix(seq.prompt[:-1], other.prompt)
                for other in running
                if other.prefilling and not other.generated and other.pooler is None
            ),
            default=0,
        )
        threshold = 1 if seq.waits_to_share else WAIT_TO_SHARE
        seq.waits_to_share = coming - held >= threshold
        return seq.waits_to_share

    async def reuse(self, seq: Sequence, running: list[Sequence]) -> int:
        """Start `seq` (just admitted, its slot empty) on the longest prefix held elsewhere;
        -> the positions that need no computing (its `computed`)."""
        if seq.generated or seq.pooler is not None:
            return 0  # recomputed (a resumed one's sampler lives on in the slot), or pooled
        prompt = seq.prompt
        hit = None
        if self.cache is not None:
            self.observe("prefix_queries", len(prompt))
            hit = self.cache.lookup(prompt)
        lane, common, source = self._source(seq, running)
        arena = hit.n if hit is not None else 0
        reused = 0
        if self.store is not None:
            keys = self.store.match(prompt)
            if len(keys) * self.store.block > max(common, arena):
                reused = await self._restore_blocks(seq, keys)
        if not reused and common and common >= arena:
            reused = await self._share(seq, lane, common, source)
        if not reused and hit is not None:
            reused = await self._restore(seq, hit)
        seq.computed = reused
        seq.handle.cached_tokens = reused
        seq.cuts = self._cut_points(prompt, reused)
        return reused

    async def _share(self, seq: Sequence, lane: int, n: int, source: Sequence | None) -> int:
        """Start `seq` on `lane`'s first n positions: a running `source`'s, or a kept one's
        (no feature ring: a target with a draft keeps none)."""
        try:
            shared = await self.target.share(seq.slot, lane, n)
        except WorkerReplyError as exc:  # the slot is reset: restore or compute instead
            log.warning("sharing %d prompt tokens of lane %d failed: %s", n, lane, exc)
            return 0
        if source is not None:
            seq.ring_floor = self.target.share_ring(
                seq.slot, lane, shared, source.ring_floor, source.computed
            )
        else:
            self.kv.touch(lane)
            self.observe("prefix_kept_hits", shared)
        self.shared_tokens += shared
        self.observe("prefix_shared", shared)
        if lane in self.kv.held:  # charged once, to the lane that holds it
            self.kv.share(seq.slot, lane, shared)  # (a kept lane may be given up meanwhile)
        return shared

    async def _restore(self, seq: Sequence, hit) -> int:
        assert self.cache is not None

        def floor(n: int) -> None:
            seq.ring_floor = n

        mover = self.target.mover(seq.slot, 0, floor)
        try:
            restored = await self.cache.restore(hit, mover)
        except WorkerReplyError as exc:  # a refused import changes nothing: prefill it all
            log.warning("prefix cache: restoring %s failed (%s); prefilling", hit.entry_id, exc)
            await self.target.reset(seq.slot)
            await self.cache.drop(hit.entry_id)  # e.g. its remote part is lost: never again
            return 0
        self.observe("prefix_hits", restored)
        return restored

    async def _restore_blocks(self, seq: Sequence, keys: list[bytes]) -> int:
        """Start `seq` on its prompt's blocks in memory or on disk (a failure prefills them
        instead)."""
        assert self.store is not None and self.cache is not None
        try:
            restored = await self.store.restore(seq.slot, seq.prompt, keys)
        except WorkerReplyError as exc:  # the slot is reset: share, restore or compute
            log.warning("prefix cache: restoring %d blocks failed: %s", len(keys), exc)
            return 0
        if restored:
            if self.store.rings is not None:  # its ring holds the rows from there on
                seq.ring_floor = self.store.rings.floor(len(seq.prompt), restored)
            self.cache.count_hit(restored)
            self.observe("prefix_hits", restored)
        return restored

    def _drop_remote(self, entry_id: str) -> None:
        self._dropped.append(entry_id)
        if len(self._dropped) == 1:  # the first of this turn: one frame takes them all
            task = asyncio.get_running_loop().create_task(self._forget_dropped())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _forget_dropped(self) -> None:
        ids, self._dropped = self._dropped, []
        await self.target.transfer.forget(ids)

    def _cut_points(self, prompt: list[int], cached: int) -> tuple[int, ...]:
        """Where the prompt's snapshot may be restored besides its end: the chat-turn
        boundaries. A recurrent model's state exists only where its prefill stopped, so for
        it these are the restored position and the latest MAX_STATE_CUTS boundaries past
        it (the prefill stops and keeps the state at each: exact-cut mode). The block
        store's prompts restore at any block end, but a hybrid's only where a state is
        kept: its boundaries snapped down to block ends and its last whole block's end
        (the next turn's prompt extends it), beside the restored position."""
        if self.cache is None or (self.store is not None and not self.target.recurrent):
            return ()
        cuts = self.turns.cuts(prompt) if self.turns is not None else []
        if not self.target.recurrent:
            return tuple(cuts)
        if self.store is not None:
            b = self.store.block
            turns = sorted({c // b * b for c in cuts if cached < c // b * b < len(prompt)})
            return tuple(sorted({cached, *turns[-MAX_STATE_CUTS:], len(prompt) // b * b} - {0}))
        later = [c for c in cuts if cached < c < len(prompt)][-MAX_STATE_CUTS:]
        return (cached, *later) if cached else tuple(later)

    async def save(self, seq: Sequence) -> None:
        """Save the prompt's whole blocks in the block store, or where there is none
        snapshot the prompt's KV (the slot holds exactly the prompt, or more for an
        attention-only model), restorable at its cut points and its end. The disk copies
        are written in the background."""
        if self.cache is None or seq.pooler is not None:
            return
        prompt = seq.prompt
        if self.store is not None:
            await self.store.save(seq.slot, prompt, seq.cuts, seq.ring_floor)
            return
        if self.target.resident(seq.slot, len(prompt)) < len(prompt):
            log.debug(
                "prefix cache: no snapshot of %d tokens: KV Flash paged blocks of it out",
                len(prompt),
            )
            return
        mover = self.target.mover(seq.slot, seq.computed, lambda n: None)
        try:
            await self.cache.save(prompt, len(prompt), mover, seq.cuts)
        except WorkerReplyError as exc:  # the request goes on; only the snapshot is lost
            log.warning("prefix cache: snapshot of %d tokens failed: %s", len(prompt), exc)
