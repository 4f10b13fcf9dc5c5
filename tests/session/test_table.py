"""The table pass on the CPU (numpy twins): every region of an epoch in one
detection pass per detector group, one plan, one extent; the same records as
the per-region host path, and recovery byte-identical, with many regions."""

from __future__ import annotations

import numpy as np
import pytest

from concordia.checkpoint import staging as staging_mod
from concordia.checkpoint.table import ENTRY, RECORD, RegionTable, counts_of, plan_records
from concordia.regions.region import Region
from concordia.wal import format as fmt

from .staging_cases import assert_same_log
from .state import assert_same
from .table_cases import make_regions, run


def _region(name, nbytes, pb, detect="shadow", rid=0):
    arr = np.zeros(nbytes, np.uint8)
    r = Region(name=name, kind="opaque", page_bytes=pb, array=arr, xp=np, owner=arr, storage=(), detect=detect,
               hints={})
    r.id = rid
    r.digest = 0
    return r


def test_the_table_rows_are_64_bytes_and_lay_out_the_page_space():
    assert ENTRY.itemsize == 64 and RECORD.itemsize == 32
    rs = [_region("a", 1000, 64, rid=3), _region("b", 8192, 4096, "fingerprint", rid=1),
          _region("c", 100, 64, "versions", rid=7)]
    t = RegionTable(rs)
    assert t.entries["first_page"].tolist() == [0, 16, 18] and t.total_pages == 20
    assert t.entries["region_id"].tolist() == [3, 1, 7]
    assert {k: v.tolist() for k, v in t.groups.items()} == {(1, 64): [0], (2, 4096): [1], (3, 64): [2]}
    assert t.listed().tolist() == [2]
    assert t.max_records == 3


@pytest.mark.parametrize("seed", range(4))
def test_plan_records_cuts_as_plan_batches_and_packs_in_table_order(seed):
    rng = np.random.default_rng(seed)
    rs = [_region(f"r{i}", int(rng.integers(1, 5000)) * 64, int(rng.choice([64, 4096, 1 << 20])), rid=i)
          for i in range(40)]
    t = RegionTable(rs)
    counts = np.array([int(rng.integers(0, r.pages + 1)) if rng.random() < 0.6 else 0 for r in rs])
    recs = plan_records(t.entries, counts)
    want, lo, off = [], 0, 0
    for i, (r, c) in enumerate(zip(rs, counts)):
        for b in (staging_mod.plan_batches(r, int(c)) if c else []):
            want.append((lo + b.lo, off, b.length, i, b.hi - b.lo))
            off += b.length
        lo += int(c)
    assert recs.tolist() == want
    assert all(length == fmt.page_batch_length(n, rs[i].page_bytes) for _, _, length, i, n in want)


def test_counts_of_splits_the_sorted_dirty_pages_by_row():
    rs = [_region("a", 640, 64), _region("b", 64, 64), _region("c", 1280, 64)]
    t = RegionTable(rs)
    ids = np.array([0, 9, 11, 12, 29])
    assert counts_of(t.entries, ids, t.total_pages).tolist() == [2, 0, 3]


@pytest.fixture
def two_shm_logs():
    from .conftest import _fresh_shm_log

    a, b = _fresh_shm_log(), _fresh_shm_log()
    yield next(a), next(b)
    for g in (a, b):
        next(g, None)


@pytest.mark.parametrize("n", [1, 16, 1024])
def test_many_regions_through_a_table_pass_write_the_host_paths_records(two_shm_logs, n):
    # shm: the host path persists each record by itself, a page-cache file would sync 4,000 times
    host = run(two_shm_logs[0], make_regions(n), staging="host")
    stats, contents, got, truth = run(two_shm_logs[1], make_regions(n), staging="mapped")
    assert [st.table_pass for st in stats] == [False, True, True, True]  # the first is every region's base
    assert all(set(st.via.values()) == {"cpu-mapped"} for st in stats)
    assert_same_log(contents, host[1])
    assert [st.pages for st in stats] == [st.pages for st in host[0]]
    assert [st.log_bytes for st in stats] == [st.log_bytes for st in host[0]]
    assert [st.bytes for st in stats] == [st.bytes for st in host[0]]
    assert_same(got, truth)
    assert_same(host[2], truth)
    assert stats[-1].log_bytes == 0 and stats[-1].bytes == 0  # a clean epoch writes no record


def test_a_region_registered_later_gets_its_base_and_the_table_follows(tmp_path):
    from concordia import Session

    specs = make_regions(8)
    with Session(f"file:{tmp_path / 'x.log'}", size=64 << 20, segment_size=4 << 20, overwrite=True, staging="mapped") as s:
        for sp in specs[:6]:
            s.register(sp["name"], sp["array"], page_bytes=sp["page_bytes"], detect="shadow")
        s.checkpoint()
        specs[0]["array"].reshape(-1).view(np.uint8)[0] ^= 1
        assert s.checkpoint().table_pass
        late = np.arange(5000, dtype=np.uint8)
        s.register("late", late, page_bytes=256)
        st = s.checkpoint()
        assert not st.table_pass and st.base == ["late"]
        late[300] ^= 1
        specs[1]["array"].reshape(-1).view(np.uint8)[-1] ^= 1
        st = s.checkpoint()
        assert st.table_pass and st.pages["late"] == 1 and st.pages[specs[1]["name"]] == 1
        got = s.recover()
    assert got["late"].tobytes() == late.tobytes()
    for sp in specs[:6]:
        assert got[sp["name"]].tobytes() == sp["array"].tobytes()


def test_a_failed_table_pass_leaves_the_log_and_the_session_usable(tmp_path, monkeypatch):
    from concordia import Session
    from concordia.checkpoint import host as host_mod

    specs = make_regions(12)
    with Session(f"file:{tmp_path / 'x.log'}", size=64 << 20, segment_size=4 << 20, overwrite=True, staging="mapped") as s:
        for sp in specs:
            s.register(sp["name"], sp["array"], page_bytes=sp["page_bytes"], detect="fingerprint")
        s.checkpoint()
        at1 = {sp["name"]: sp["array"].copy() for sp in specs}
        for sp in specs:
            sp["array"].reshape(-1).view(np.uint8)[0] ^= 1

        def failing(*a, **kw):
            raise OSError("injected failure while staging")

        monkeypatch.setattr(host_mod.ref, "stage_page_batch", failing)
        with pytest.raises(OSError):
            s.checkpoint()
        monkeypatch.undo()
        assert all(v.tobytes() == at1[k].tobytes() for k, v in s.recover().items())
        st = s.checkpoint()  # every region written whole again, then deltas by the table
        assert sorted(st.base) == sorted(at1) and not st.table_pass
        specs[3]["array"].reshape(-1).view(np.uint8)[1] ^= 1
        assert s.checkpoint().table_pass
        got = s.recover()
    for sp in specs:
        assert got[sp["name"]].tobytes() == sp["array"].tobytes()


def test_an_epoch_larger_than_a_segment_is_staged_region_by_region(tmp_path):
    from concordia import Session

    arrays = [np.random.default_rng(i).integers(0, 255, 3 << 20, dtype=np.uint8) for i in range(3)]
    with Session(f"file:{tmp_path / 'x.log'}", size=64 << 20, segment_size=4 << 20, overwrite=True,
                 staging="mapped") as s:
        for i, a in enumerate(arrays):
            s.register(f"r{i}", a, page_bytes=4096, detect="fingerprint")
        s.checkpoint()
        for a in arrays:
            a[::4096] ^= 1  # every page: 9 MiB of records, more than a 4 MiB segment holds
        st = s.checkpoint()
        assert st.table_pass and st.pages == {f"r{i}": 768 for i in range(3)}
        arrays[1][5] ^= 1
        st = s.checkpoint()
        assert st.table_pass and st.pages == {"r0": 0, "r1": 1, "r2": 0}
        got = s.recover()
    for i, a in enumerate(arrays):
        assert got[f"r{i}"].tobytes() == a.tobytes()


def test_a_changed_array_is_refused_before_a_table_pass_writes(tmp_path):
    from concordia import Session
    from concordia.errors import ShapeChangedError

    a, b = np.arange(3000, dtype=np.int32), np.zeros(5000, np.uint8)
    with Session(f"file:{tmp_path / 'x.log'}", size=64 << 20, segment_size=4 << 20, overwrite=True,
                 staging="mapped") as s:
        s.register("a", a, page_bytes=256)
        s.register("b", b, page_bytes=256, detect="fingerprint")
        s.checkpoint()
        b[7] = 1
        assert s.checkpoint().table_pass
        before = s.log.appender.write_lsn
        a.shape = (1000, 3)  # same memory, new shape
        b[9] = 1
        with pytest.raises(ShapeChangedError, match="region 'a'"):
            s.checkpoint()
        assert s.log.appender.write_lsn == before


def test_a_table_pass_reports_every_region_as_the_per_region_path_does(tmp_path):
    """The table pass's statistics (pages, via, JSON) are those of a
    checkpoint built region by region: same keys in registration order,
    plain ints, one path name each; and they stay what they were."""
    import json

    from concordia import CheckpointStats, Session

    arrays = {f"r{i}": np.zeros(4096 * (i + 1), np.uint8) for i in range(20)}
    with Session(f"file:{tmp_path / 'x.log'}", size=64 << 20, segment_size=4 << 20, overwrite=True,
                 staging="mapped") as s:
        for name, a in arrays.items():
            s.register(name, a, page_bytes=4096, detect="fingerprint")
        s.checkpoint()
        arrays["r3"][5] = 1
        arrays["r17"][4096 * 2] = 1
        st = s.checkpoint()
        assert st.table_pass
        want_pages = {name: (1 if name in ("r3", "r17") else 0) for name in arrays}
        d = st.to_json()
        assert list(d) == ["epoch", "reason", "pages", "base", "bytes", "log_bytes", "detect_ms", "stage_ms",
                           "commit_ms", "via", "device_reads", "table_pass", "executor", "total_ms"]
        assert d["pages"] == want_pages and list(d["pages"]) == list(arrays)
        assert all(type(v) is int for v in d["pages"].values())
        assert d["via"] == dict.fromkeys(arrays, "cpu-mapped") and d["bytes"] == 2 * 4096
        assert json.loads(json.dumps(d)) == d
        assert st.pages == want_pages and st.via == d["via"] and st.base == []
        arrays["r0"][0] = 1
        s.checkpoint()
        assert st.pages == want_pages  # a later pass leaves this one's figures alone
        again = CheckpointStats(st.epoch, st.reason, dict(st.pages), [], st.bytes, st.log_bytes, st.detect_ms,
                                st.stage_ms, st.commit_ms, dict(st.via), st.device_reads, True)
        assert again == st and repr(again) == repr(st)
        st.pages = {"x": 1}
        assert st.pages == {"x": 1} and st.via == d["via"]


def test_a_torch_tensor_resized_in_place_is_refused_on_the_table_path(tmp_path):
    """A tensor's storage can change under the same Python object (resize_,
    set_): the table pass's check finds it before anything is written."""
    torch = pytest.importorskip("torch", reason="torch is not installed")
    from concordia import Session
    from concordia.errors import ShapeChangedError

    with Session(f"file:{tmp_path / 'x.log'}", size=64 << 20, segment_size=4 << 20, overwrite=True,
                 staging="mapped") as s:
        t = torch.zeros(4096, dtype=torch.float32)
        u = torch.zeros(2048, dtype=torch.int32)
        s.register("t", t, page_bytes=4096)
        s.register("u", u, page_bytes=4096, detect="fingerprint")
        s.checkpoint()
        t[3] = 1
        assert s.checkpoint().table_pass
        # A storage of the registered size at the registered address is the
        # same memory to the pass (nothing tells them apart, and reading it is
        # safe), so every new storage here is made away from that address: the
        # allocator may hand the freed first storage back to the next tensor.
        registered, spares = t.data_ptr(), []

        def elsewhere(new):
            while new.data_ptr() == registered:
                spares.append(new)
                new = new.clone()
            return new

        for change in (lambda: t.resize_(8192), lambda: t.set_(elsewhere(torch.zeros(4096))),
                       lambda: t.untyped_storage().resize_(0)):
            before = s.log.appender.write_lsn
            keep = elsewhere(t.clone())
            change()
            assert t.data_ptr() != registered or t.untyped_storage().nbytes() == 0
            with pytest.raises(ShapeChangedError, match="region 't'"):
                s.checkpoint()
            assert s.log.appender.write_lsn == before
            t.set_(keep)  # a new storage again: still refused
            with pytest.raises(ShapeChangedError, match="region 't'"):
                s.checkpoint()


def test_an_array_changed_before_the_table_is_made_is_refused(tmp_path):
    """The table keeps the arrays' state when it is made (the first pass after
    the regions change): one changed just before that is still refused."""
    from concordia import Session
    from concordia.errors import ShapeChangedError

    a, b = np.arange(3000, dtype=np.int32), np.zeros(5000, np.uint8)
    with Session(f"file:{tmp_path / 'x.log'}", size=64 << 20, segment_size=4 << 20, overwrite=True,
                 staging="mapped") as s:
        s.register("a", a, page_bytes=256)
        s.register("b", b, page_bytes=256, detect="fingerprint")
        s.checkpoint()  # the bases: no table yet
        before = s.log.appender.write_lsn
        a.shape = (1000, 3)
        with pytest.raises(ShapeChangedError, match="region 'a'"):
            s.checkpoint()
        assert s.log.appender.write_lsn == before
        a.shape = (3000,)
        b[1] = 1
        assert s.checkpoint().table_pass
