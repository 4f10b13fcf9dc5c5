"""The device restore's transfer plan and host fill, run with the numpy twin of
the scatter kernel: chunking, merged copies across records, copies cut between
chunks, several regions and page sizes, every tier's read path, damage."""

from __future__ import annotations

import contextlib
import os

import numpy as np
import pytest

from concordia import Session
from concordia.restore.device import STAGE_ALIGN, apply_transfer_numpy, transfer_plan
from concordia.wal import Log
from concordia.wal.apply import apply_plan_numpy
from concordia.wal.compaction import fold_source
from concordia.wal.errors import CorruptionError
from concordia.wal.planner import plan

from .state import LOG_SIZE, SEGMENT, make_state, mutate, register_all


def _history(spec, epochs=4):
    """A log with a base and `epochs - 1` deltas of every kind, plus a region of
    8 KiB pages whose last page is short."""
    state = make_state(3)
    state["big"] = np.arange(70_001, dtype=np.float32)
    with Session(spec, size=LOG_SIZE, segment_size=SEGMENT, overwrite=True) as s:
        register_all(s, {k: v for k, v in state.items() if k != "big"})
        s.register("big", state["big"], kind="kv", page_bytes=8192)
        for e in range(epochs):
            if e:
                mutate(state, e)
                state["big"][e * 997] = -e
                state["big"][-1] = e
            s.checkpoint()
    return state


def flip_byte(spec: str, offset: int, mask: int) -> None:
    """Damage one byte of a file log in place."""
    with open(spec.partition(":")[2], "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ mask]))


def _restore_both(spec, chunk_bytes):
    log = Log.open(spec, writable=False, check_pages=False)
    try:
        p = plan(log)
        want = apply_plan_numpy(log, p)
        tr = transfer_plan(log, p, chunk_bytes=chunk_bytes)
        got = apply_transfer_numpy(log, tr)
        return tr, want, got
    finally:
        log.close()


def _check_layout(tr):
    seen = set()
    stage_off, page_ids, _ = tr.page_tables(np)
    region_index = np.repeat(tr.run_region, tr.run_count)
    for c in range(tr.chunks):
        lo, hi = int(tr.page_lo[c]), int(tr.page_lo[c + 1])
        assert hi > lo
        assert tr.used[c] <= tr.chunk_bytes + STAGE_ALIGN
        cps = tr.copies[c]
        assert (cps[:, 2] % STAGE_ALIGN == 0).all() and (cps[:, 1] > 0).all()
        for k in range(lo, hi):
            rp = tr.regions[int(region_index[k])]
            at, pb = int(stage_off[k]), rp.region.page_bytes
            assert at % 16 == 0 and at + pb <= tr.used[c]
            inside = (cps[:, 2] <= at) & (at + pb <= cps[:, 2] + cps[:, 1])
            assert inside.sum() == 1  # each page lies in exactly one copy of its chunk
            seen.add((int(region_index[k]), int(page_ids[k])))
        ri = region_index[lo:hi]
        assert (np.diff(ri) >= 0).all()  # grouped by region within the chunk
    assert len(seen) == tr.pages


@pytest.mark.parametrize("chunk_bytes", [4096, 64 << 10, 1 << 20, 32 << 20])
def test_transfer_restores_what_the_host_applier_restores(persistent_log, chunk_bytes):
    _history(persistent_log)
    tr, want, got = _restore_both(persistent_log, chunk_bytes)
    _check_layout(tr)
    assert set(got) == set(want)
    for name in want:
        assert got[name].dtype == want[name].dtype and got[name].shape == want[name].shape
        assert got[name].tobytes() == want[name].tobytes(), name
    if chunk_bytes >= 1 << 20:
        assert tr.chunks <= 2  # small pages of many records merge into few copies
    else:
        assert tr.chunks > 4


def test_memory_copy_path_when_the_tier_has_no_descriptor(persistent_log, monkeypatch):
    import concordia.restore.device as rd

    _history(persistent_log)
    monkeypatch.setattr(rd, "_source_of", lambda log: (None, log.backend.array, False))
    tr, want, got = _restore_both(persistent_log, 64 << 10)
    for name in want:
        assert got[name].tobytes() == want[name].tobytes(), name


def test_a_damaged_page_names_its_region_page_and_record(file_log):
    _history(file_log, epochs=1)
    log_off = _damaged_adapter_page(file_log)
    log = Log.open(file_log, writable=False, check_pages=False)
    try:
        # planned without page checks (the planner's own check would refuse the
        # epoch first): the damage is then found where the page lands
        p = plan(log, check_pages=False)
        tr = transfer_plan(log, p, chunk_bytes=64 << 10)
        with pytest.raises(CorruptionError) as e:
            apply_transfer_numpy(log, tr)
        # the host applier and compaction's fold meet the same page: one check,
        # the same words at the same offset (wal.apply.bad_page)
        with pytest.raises(CorruptionError) as host:
            apply_plan_numpy(log, p)
        rp = p.regions["adapter"]
        with pytest.raises(CorruptionError) as fold:
            fold_source(rp)(0, rp.region.pages)
    finally:
        log.close()
    msg = str(e.value)
    assert "page CRC mismatch for page" in msg and "'adapter'" in msg and "segment" in msg and "@ 0x" in msg
    assert ", stored 0x" in msg and ", computed 0x" in msg
    assert msg == str(host.value) == str(fold.value)
    assert msg.split(": ", 1)[0].endswith(f"@ {log_off:#x}")  # the damaged page's own offset


def _damaged_adapter_page(file_log) -> int:
    """Flip one byte of a page of the "adapter" region, found through the
    transfer plan (so that the damage is in a page a restore reads); returns
    that page's offset in the log."""
    log = Log.open(file_log, writable=False, check_pages=False)
    try:
        tr = transfer_plan(log, plan(log), chunk_bytes=64 << 10)
        region_index = np.repeat(tr.run_region, tr.run_count)
        k = int(np.flatnonzero(region_index == [rp.name for rp in tr.regions].index("adapter"))[3])
        c = int(np.searchsorted(tr.page_lo, k, side="right") - 1)
        cps = tr.copies[c]
        at = int(tr.page_tables(np)[0][k])
        row = int(np.flatnonzero((cps[:, 2] <= at) & (at < cps[:, 2] + cps[:, 1]))[0])
        log_off = int(cps[row, 0] + at - cps[row, 2])
    finally:
        log.close()
    flip_byte(file_log, log_off + 5, 0x40)
    return log_off


def _sentinels(log) -> dict:
    """A target of each region's layout, filled with a pattern no restore writes."""
    out = {}
    for name, info in log.regions.items():
        a = np.empty(info.shape, np.dtype(info.dtype))
        a.reshape(-1).view(np.uint8)[...] = np.arange(a.nbytes, dtype=np.uint64).astype(np.uint8) ^ 0xA5
        out[name] = a
    return out


def damage_leaves_targets_as_they_were(file_log, apply, xp=np) -> None:
    """apply(log, plan, into) -> {name: array}, into a target of each region's
    layout on `xp` (sentinel bytes): on the log as written every target is
    returned holding what the host applier restores; with a damaged page in
    one region it raises, and every target still holds its sentinel."""
    host = getattr(xp, "asnumpy", np.asarray)
    _history(file_log, epochs=1)
    for damaged in (False, True):
        if damaged:
            _damaged_adapter_page(file_log)
        log = Log.open(file_log, writable=False, check_pages=False)
        try:
            p = plan(log, check_pages=not damaged)   # unchecked: the restore is the one to meet the damage
            sent = _sentinels(log)
            into = {n: xp.array(a) for n, a in sent.items()}
            if not damaged:
                got, want = apply(log, p, into), apply_plan_numpy(log, p)
                for name in want:
                    assert got[name] is into[name] and host(into[name]).tobytes() == want[name].tobytes(), name
                continue
            with pytest.raises(CorruptionError, match="page CRC mismatch"):
                apply(log, p, into)
            for name, v in into.items():
                assert host(v).tobytes() == sent[name].tobytes(), name
        finally:
            log.close()


def test_damage_found_by_the_twin_leaves_every_target_as_it_was(file_log):
    """The device path's numpy twin stages what it restores and writes the
    targets only once every page checked out."""
    damage_leaves_targets_as_they_were(file_log, lambda log, p, into: apply_transfer_numpy(
        log, transfer_plan(log, p, chunk_bytes=64 << 10), into=into))


def test_a_restore_into_targets_writes_none_of_them_when_one_region_is_damaged(file_log):
    """`restore(into=)`, the entry behind `Session.recover(into=)`: damage in
    one region leaves every target as it was, the regions restored before the
    damage included."""
    from concordia.restore.run import restore

    damage_leaves_targets_as_they_were(file_log, lambda log, p, into: restore(
        log, plan=p, into={n: (a, np) for n, a in into.items()}).arrays)


@contextlib.contextmanager
def _one_checkpoint(spec, seed):
    """(state, log): `state` checkpointed once by a Session into `spec`, then
    the log opened read-only as a recovering reader opens it."""
    state = make_state(seed)
    with Session(spec, size=LOG_SIZE, segment_size=SEGMENT) as s:
        register_all(s, state)
        s.checkpoint()
    log = Log.open(spec, writable=False, check_pages=False)
    try:
        yield state, log
    finally:
        log.close()


def test_empty_plan_regions_filter(shm_log):
    with _one_checkpoint(shm_log, 1) as (state, log):
        tr = transfer_plan(log, plan(log), regions=["sched"])
        got = apply_transfer_numpy(log, tr)
    assert list(got) == ["sched"] and got["sched"].tobytes() == state["sched"].tobytes()


def test_file_backed_tiers_are_read_with_preadv(persistent_log):
    from concordia.restore.device import _source_of

    _history(persistent_log, epochs=1)
    log = Log.open(persistent_log, writable=False, check_pages=False)
    try:
        fd, arr, owned = _source_of(log)
        assert fd is not None and owned
        try:   # the descriptor reads the log's own bytes
            assert os.pread(fd, 4096, 8192) == bytes(log.backend.array[8192:8192 + 4096])
        finally:
            os.close(fd)
    finally:
        log.close()


def test_a_restore_counts_the_whole_pieces_it_would_pin(shm_log):
    """`pins_ahead`'s small-restore rule weighs the pieces a restore pins, not
    the bytes it reads: records spread over the log pin a piece each."""
    from concordia.restore.device import bytes_to_pin, pieces_read

    _history(shm_log)
    log = Log.open(shm_log, writable=False, check_pages=False)
    try:
        tr = transfer_plan(log, plan(log), chunk_bytes=64 << 10)
        piece = 64 << 10
        per_chunk, order = pieces_read(tr, piece)
        assert sorted(order) == sorted(set(order)) and set(order) == {k for ks in per_chunk for k in ks}
        for c, ks in enumerate(per_chunk):   # each chunk's copies lie within its pieces
            assert all(lo // piece in ks and (lo + n - 1) // piece in ks for lo, n, _ in tr.copies[c].tolist())
        got = bytes_to_pin(log.backend, order, piece)   # nothing kept pinned here
        assert got == sum(min(piece, log.backend.size - k * piece) for k in order)
        assert got >= tr.bytes_copied and len(order) > 1
    finally:
        log.close()


def test_a_small_restore_limit_that_is_no_number_is_one_line_naming_it(shm_log, monkeypatch):
    import concordia.restore.device as rd
    from concordia.wal.errors import UsageError

    _history(shm_log, epochs=1)
    monkeypatch.setattr(rd, "PIN_SMALL_BYTES", None)   # what CONCORDIA_PIN_SMALL_BYTES=1G leaves
    monkeypatch.setenv("CONCORDIA_PIN_SMALL_BYTES", "1G")
    log = Log.open(shm_log, writable=False, check_pages=False)
    try:
        with pytest.raises(UsageError) as ei:
            rd.pins_ahead(log.backend, "auto", 1)
        assert "CONCORDIA_PIN_SMALL_BYTES='1G'" in str(ei.value) and "\n" not in str(ei.value)
        assert not rd.pins_ahead(log.backend, "copy", 1)   # a restore that copies never asks
    finally:
        log.close()


@pytest.mark.parametrize("value", ["both", "auto"])
def test_a_large_restore_way_that_is_none_is_one_line_naming_it(shm_log, monkeypatch, value):
    import concordia.restore.device as rd
    from concordia.wal.errors import UsageError

    _history(shm_log, epochs=1)
    monkeypatch.setattr(rd, "READ_LARGE", value)   # what CONCORDIA_RESTORE_READ=both leaves
    log = Log.open(shm_log, writable=False, check_pages=False)
    try:
        with pytest.raises(UsageError) as ei:
            rd.pins_ahead(log.backend, "auto", rd.PIN_SMALL_BYTES + 1)
        assert f"CONCORDIA_RESTORE_READ={value!r}" in str(ei.value) and "\n" not in str(ei.value)
        assert rd.pins_ahead(log.backend, "auto", 1)   # a small restore never asks
        for way in ("pin", "copy"):
            monkeypatch.setattr(rd, "READ_LARGE", way)
            assert rd.pins_ahead(log.backend, "auto", rd.PIN_SMALL_BYTES + 1) == (way == "pin")
    finally:
        log.close()


def test_a_plan_with_no_pages_to_read_is_an_empty_transfer(shm_log):
    with _one_checkpoint(shm_log, 2) as (_state, log):
        p = plan(log)
        for rp in p.regions.values():
            rp.sources.clear()  # as for a region none of whose pages was ever written
        tr = transfer_plan(log, p)
    assert tr.pages == 0 and tr.chunks == 0 and tr.bytes_copied == 0


def _one_past_the_last_row(src):
    rows = src.rows.copy()  # a record taken whole is a read-only view of a shared range
    rows[-1] = src.batch.page_ids.size
    return rows


def _whole_but_shifted_by_one(src):
    from concordia.wal.planner import ascending

    return ascending(1, src.batch.page_ids.size)  # still taken whole: laid out without a pass over its rows


@pytest.mark.parametrize("bad_rows", [_one_past_the_last_row, _whole_but_shifted_by_one])
def test_a_plan_naming_rows_a_record_lacks_is_refused_as_the_host_applier_refuses_it(shm_log, bad_rows):
    from concordia.wal.errors import WalError
    from concordia.wal.planner import is_ascending

    with _one_checkpoint(shm_log, 5) as (_state, log):
        p = plan(log)
        src = p.regions["adapter"].sources[0]
        assert is_ascending(src.rows) and is_ascending(src.page_ids)
        src.rows = bad_rows(src)
        with pytest.raises(WalError) as e:
            transfer_plan(log, p)
        with pytest.raises(WalError) as h:
            apply_plan_numpy(log, p)
    assert str(e.value) == str(h.value) and "names rows or pages out of range" in str(e.value)


def test_a_base_is_laid_out_as_runs_of_pages_cut_only_where_chunks_end(shm_log):
    """A region of 256-byte pages (a KV row a page) is one run in its base: the
    layout costs per run, and only chunk ends cut it; a delta's scattered rows
    are a run each.  The per-page tables expanded from the runs restore it."""
    kv = np.random.default_rng(3).standard_normal(16384, dtype=np.float32)  # 256 pages of 256 bytes
    with Session(shm_log, size=LOG_SIZE, segment_size=SEGMENT, overwrite=True) as s:
        s.register("kv", kv, kind="kv", page_bytes=256)
        s.checkpoint()
        log = Log.open(shm_log, writable=False, check_pages=False)
        try:
            tr = transfer_plan(log, plan(log), chunk_bytes=16 << 10)
            assert tr.pages == 256 and tr.run_count.size == tr.chunks == 4  # 64 pages a chunk
            assert apply_transfer_numpy(log, tr)["kv"].tobytes() == kv.tobytes()
        finally:
            log.close()
        kv[[64 * 3, 64 * 100, 64 * 101, 64 * 200]] += 1  # pages 3, 100, 101, 200
        s.checkpoint()
    log = Log.open(shm_log, writable=False, check_pages=False)
    try:
        tr = transfer_plan(log, plan(log), chunk_bytes=1 << 20)
        # the base's pages around the three delta runs (3, 100-101, 200), and those runs
        assert tr.pages == 256 and tr.run_count.size == 4 + 3
        stage, ids, crcs = tr.page_tables(np)
        assert sorted(ids.tolist()) == list(range(256)) and stage.dtype == np.uint64 and crcs.dtype == np.uint32
        _check_layout(tr)
        assert apply_transfer_numpy(log, tr)["kv"].tobytes() == kv.tobytes()
    finally:
        log.close()


@pytest.mark.parametrize("chunk_bytes", [4096, 3 << 14, 1 << 16])
def test_chunks_found_on_lists_are_those_numpys_searches_find(persistent_log, chunk_bytes, monkeypatch):
    """Over few runs the layout's chunk search is `bisect` on lists, which keeps
    the GIL (numpy's searchsorted lets go of it at every call, and beside a busy
    thread each call waits to get it back); over many, numpy's.  The same
    transfer either way."""
    import concordia.restore.device as device

    _history(persistent_log)
    log = Log.open(persistent_log, writable=False)
    p = plan(log)
    laid = {}
    for runs in (1 << 40, 0):   # every layout on lists, then every one on numpy's searches
        monkeypatch.setattr(device, "LIST_SEARCH_RUNS", runs)
        tr = transfer_plan(log, p, chunk_bytes=chunk_bytes)
        laid[runs] = tr
    a, b = laid[1 << 40], laid[0]
    assert a.chunks == b.chunks > 1 and np.array_equal(a.page_lo, b.page_lo)
    for k in ("run_region", "run_id", "run_crc", "run_stage", "run_pb", "run_count", "run_source"):
        assert np.array_equal(getattr(a, k), getattr(b, k)), k
    rng = np.random.default_rng(7)
    cnt = rng.integers(1, 50, 300).astype(np.int64)
    pb = rng.choice([64, 256, 4096], 300).astype(np.int64)
    pos = np.cumsum(-(-(cnt * pb) // STAGE_ALIGN) * STAGE_ALIGN) - (-(-(cnt * pb) // STAGE_ALIGN) * STAGE_ALIGN)
    first = np.cumsum(cnt) - cnt
    n = int(cnt.sum())
    got = {}
    for runs in (1 << 40, 0):
        monkeypatch.setattr(device, "LIST_SEARCH_RUNS", runs)
        got[runs] = device._chunk_starts(first, pos + pb, pos, pb, cnt, n, chunk_bytes)
    assert np.array_equal(got[1 << 40], got[0]) and got[0][-1] == n
