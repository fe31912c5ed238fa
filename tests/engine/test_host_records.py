"""The host tier's segment (engine/kv/host.py): sized to what /dev/shm can hold, the
records past it taken from the block tables, so a write can never SIGBUS the workers."""

from __future__ import annotations

import logging

import pytest

from luced.engine.kv.blocks import BlockTables, RecordsExhausted
from luced.engine.kv.host import HostRecords
from luced.ipc.shm import ShmOwner

LAYERS = [(0, 2), (2, 4)]  # two workers
RECORD = [3000, 1000]  # bytes of one record in each


def host_for(records: int) -> HostRecords:
    host = HostRecords(records)
    for span, size in zip(LAYERS, RECORD, strict=True):
        host.loaded(span, size, "cpu")
    return host


def test_records_past_the_room_are_taken_from_the_tables_with_a_warning(caplog) -> None:
    tables, host = BlockTables(8, 16, records=100), host_for(100)
    with ShmOwner() as owner, caplog.at_level(logging.WARNING):
        block_bytes = host.carve(owner, "t", LAYERS, tables, room=10 * 4000 + 3999)
        assert block_bytes == 4000
        assert host.records == tables.records == tables.free_records == 10
        assert [r.shape for r in host.regions] == [(10, 3000), (10, 1000)]
        assert "10 of 100 fit" in caplog.text
        tables.write(0, 0, 16 * 8)
        for j in range(8):
            tables.page_out(0, j)
        tables.write(1, 0, 16 * 3)
        tables.page_out(1, 0)
        tables.page_out(1, 1)  # the tenth and last record
        with pytest.raises(RecordsExhausted):
            tables.page_out(1, 2)


def test_records_within_the_room_are_all_carved(caplog) -> None:
    tables, host = BlockTables(8, 16, records=6), host_for(6)
    with ShmOwner() as owner, caplog.at_level(logging.WARNING):
        host.carve(owner, "t", LAYERS, tables, room=1 << 30)
        assert host.records == tables.records == 6
        assert [r.shape for r in host.regions] == [(6, 3000), (6, 1000)]
    assert "fit" not in caplog.text


def test_records_in_use_cannot_be_resized() -> None:
    tables = BlockTables(4, 16, records=4)
    tables.write(0, 0, 32)
    tables.page_out(0, 1)
    with pytest.raises(ValueError, match="in use"):
        tables.resize_records(2)


def test_the_store_records_fit_each_remote_worker_s_memory() -> None:
    """--prefix-cache-bytes over one block of every worker, no more than a worker on another
    host gives (its own --prefix-cache-bytes over its record), at least a context's."""
    least = 4
    for nbytes, limits, want in [
        (100 * 4000, (), 100),
        (100 * 4000, (None, 30 * 1000), 30),  # the second worker's 1000-byte records
        (100 * 4000, (None, 1000), least),  # never below a context's
        (10 * 4000, (None, 1 << 30), 10),
        (0, (None, 1 << 30), 0),  # no block store
    ]:
        tables, host = BlockTables(8, 16, records=2 + least), host_for(2 + least)
        assert host.size_store(tables, LAYERS, least, nbytes, limits) == want
        assert tables.records == host.records == 2 + want


def test_a_remote_worker_reloaded_after_the_carve_empties_its_records() -> None:
    """`epoch` counts reloads of workers on other hosts once the records exist (their
    mirror of them starts empty), never a local worker's restart or the first loads."""
    tables, host = BlockTables(8, 16, records=6), host_for(6)
    host.loaded((2, 4), 1000, "tcp://b:7070", remote=True)  # before the carve: the first load
    assert host.epoch == 0
    with ShmOwner() as owner:
        host.carve(owner, "t", LAYERS, tables, room=1 << 30)
        host.loaded((0, 2), 3000, "cpu")
        assert host.epoch == 0
        host.loaded((2, 4), 1000, "tcp://b:7070", remote=True)
        assert host.epoch == 1
