"""Under KV Flash, what each lane holds in the workers' block pool, and the kept lanes'
page-outs.

A running lane keeps at most its pager's quota resident, plus its step's block (`cap`
positions), however long its sequence; a kept lane (a finished prompt, engine/kv/
finished.py) holds its resident blocks, whole, whatever its positions. The KV budget
charges these (engine/kv/budget.py), so a long conversation's kept prompt is charged the
few blocks it keeps in the pool, not its length, and the next turn's admission leaves it
there to be shared.

A kept lane never runs, so it has no pager: when room is needed for kept lanes (the kept
limit, or the budget reclaiming room for running ones) `page_out` moves its resident
blocks but its sinks to host records, least recently used lane first. It stays whole and
shareable: a sharer's pager pages in what it needs (its own copy; the record stays). The
moves wait in `moves` until the engine sends them to the workers (`kv_page`) before the
next forward; the blocks they free may be that forward's growth.

Host records: the running slots may page out a whole context each, and the kept lanes
hold at most `records` of their own (counted per lane: a record two kept lanes share
counts twice, so the bound is safe).
"""

from __future__ import annotations

from collections.abc import Iterable

from luced.engine.kv.blocks import PAGED, BlockTables, Move


class Holdings:
    def __init__(self, tables: BlockTables, cap: int, sink_blocks: int, records: int) -> None:
        """cap: the positions a running lane holds at most; records: the host records the
        kept lanes may hold together."""
        self.tables = tables
        self.cap = cap
        self.sink_blocks = sink_blocks
        self.records = records
        self.moves: dict[int, list[Move]] = {}  # lane -> page-outs the workers have not made

    def resident(self, lane: int, n: int | None = None) -> int:
        """The positions of `lane`'s resident blocks (of those holding its first n)."""
        table = self.tables.table(lane)
        if n is not None:
            table = table[: -(-n // self.tables.block)]
        return sum(b != PAGED for b in table) * self.tables.block

    def common(self, lane: int, source: int, n: int) -> int:
        """Of `lane`'s first n positions, those in resident blocks `source` holds too (the
        source pays for them), at most n."""
        mine, theirs = self.tables.table(lane), self.tables.table(source)
        both = zip(mine[: -(-n // self.tables.block)], theirs, strict=False)
        return min(n, sum(a == b != PAGED for a, b in both) * self.tables.block)

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
        room = min(self.tables.free_records, self.records - self.host_records(kept))
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
