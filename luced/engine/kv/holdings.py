"""What each lane holds in the workers' block pool, and the kept lanes' page-outs to host
records (engine/kv/host.py): the KV budget's charges (engine/kv/budget.py) wherever kept
lanes may page out, which is under KV Flash and wherever finished prompts are kept.

Without KV Flash (`cap` None) a running lane holds its positions, as the budget charges
them anyway; a kept lane (a finished prompt, engine/kv/finished.py) its resident
positions. Under KV Flash a running lane keeps at most its pager's quota resident, plus
its step's block (`cap` positions), however long its sequence; a kept lane holds its
resident blocks, whole, whatever its positions. So a long conversation's kept prompt is
charged the few blocks it keeps in the pool, not its length, and the next turn's
admission leaves it there to be shared. A sharer is credited what its source pays for:
under KV Flash the resident blocks both hold, without it the shared positions but those
in the source's paged-out blocks (the sharer pages them in: its own).

A kept lane never runs, so it has no pager: when room is needed for kept lanes (the kept
limit under KV Flash, or the budget reclaiming room for running ones) `page_out` moves its
resident blocks but its sinks (its first block without KV Flash) to host records, least
recently used lane first. It stays whole and shareable: a sharer pages in what it needs
(its own copy; the record stays): its pager under KV Flash, its first span every paged-out
block without it (engine/runner.py). The moves wait in `moves` until the engine sends
them to the workers (`kv_page`) before the next forward; the blocks they free may be
that forward's growth.

Host records: the kept lanes hold at most `records` of their own (counted per lane: a
record two kept lanes share counts twice, so the bound is safe); under KV Flash the
running slots may page out a whole context each beside them. Records the prefix cache's
block store holds in memory count as available: it gives them up for a page-out.
"""

from __future__ import annotations

from collections.abc import Iterable

from luced.engine.kv.blocks import PAGED, BlockTables, Move

# Without KV Flash a kept lane keeps its first block resident, as KV Flash's sink.
FIRST_BLOCKS = 1


class Holdings:
    def __init__(
        self, tables: BlockTables, cap: int | None, sink_blocks: int, records: int
    ) -> None:
        """cap: under KV Flash, the positions a running lane holds at most (None without:
        its positions); records: the host records the kept lanes may hold together."""
        self.tables = tables
        self.cap = cap
        self.sink_blocks = sink_blocks
        self.records = records
        self.moves: dict[int, list[Move]] = {}  # lane -> page-outs the workers have not made

    def resident(self, lane: int, n: int | None = None) -> int:
        """The positions of `lane`'s resident blocks (of those holding its first n)."""
        t = self.tables
        if n is None:  # the whole table: no scan (the budget asks this for every kept lane)
            return (t.length(lane) - t.paged(lane)) * t.block
        blocks = -(-n // t.block)
        return sum(b != PAGED for b in t.table(lane)[:blocks]) * t.block

    @property
    def flash(self) -> bool:
        """Whether running lanes page (KV Flash): charged at most `cap`."""
        return self.cap is not None

    def own(self, lane: int, held: int, kept: bool) -> int:
        """The positions `lane` holds in the pool, `held` its reservation: a running lane's
        (at most `cap` under KV Flash), a kept lane's resident ones (its reservation until
        it has a table)."""
        if not kept:
            return held if self.cap is None else min(held, self.cap)
        if not self.tables.length(lane):
            return held
        resident = self.resident(lane)
        return resident if self.cap is not None else min(held, resident)

    def common(self, lane: int, source: int, n: int) -> int:
        """Of `lane`'s first n positions, those `source` pays for, at most n: under KV
        Flash those in resident blocks both hold; without, all but those in the source's
        paged-out blocks (`lane` pages them in, so they are its own)."""
        b = self.tables.block
        if self.cap is None:
            paged = [j for j in self.tables.host(source) if j * b < n]
            return max(0, n - sum(min(n, (j + 1) * b) - j * b for j in paged))
        mine, theirs = self.tables.table(lane), self.tables.table(source)[: -(-n // b)]
        both = zip(mine[: -(-n // b)], theirs, strict=False)
        return min(n, sum(a == c != PAGED for a, c in both) * b)

    def host_records(self, lanes: Iterable[int]) -> int:
        """Host records `lanes` hold (a record shared by two counts twice)."""
        return sum(self.tables.paged(lane) for lane in lanes)

    def page_out(self, lane: int, kept: Iterable[int], n: int | None = None) -> bool:
        """Page `lane`'s resident blocks but its sinks (of those holding its first n) out
        to host records, within the kept lanes' records (`kept`, counted with `lane`'s
        new ones); False (nothing changed) when they hold only sinks or records are short."""
        table = self.tables.table(lane)
        limit = len(table) if n is None else -(-n // self.tables.block)
        out = [j for j in range(self.sink_blocks, limit) if table[j] != PAGED]
        room = min(self.tables.available_records, self.records - self.host_records(kept))
        if not out or len(out) > room:
            return False
        self.moves.setdefault(lane, []).extend(self.tables.page_out(lane, j) for j in out)
        return True

    def forget(self, lane: int) -> None:
        """`lane` is freed: its page-outs are moot (its blocks and records go with it)."""
        self.moves.pop(lane, None)

    def take(self) -> dict[int, tuple[Move, ...]]:
        """The page-outs to send, by lane (forgotten here)."""
        moves, self.moves = self.moves, {}
        return {lane: tuple(m) for lane, m in moves.items()}
