"""Pages checked where the bytes flow (issue 30): `restore` plans from the
log's metadata, the appliers check the pages they copy, the host checks the
records they do not copy whole meanwhile, and damage anywhere makes it start
again from a plan with every page checked (FORMAT.md R-D5), so that what it
restores or refuses is what that plan decides."""

from __future__ import annotations

import numpy as np
import pytest

from concordia import Session
from concordia.gpu_kernels import reference as ref
from concordia.restore.run import restore
from concordia.root_error import ConcordiaError
from concordia.wal import Log
from concordia.wal.planner import plan, scan

from .state import LOG_SIZE, SEGMENT

PB = 256


def _log(spec, deltas: int = 2) -> dict:
    """A base of two regions, then `deltas` epochs rewriting pages 3 and 40 of "kv"."""
    rng = np.random.default_rng(5)
    state = {"kv": rng.standard_normal(64 * 64, dtype=np.float32), "lora": rng.standard_normal(512, dtype=np.float32)}
    with Session(spec, size=LOG_SIZE, segment_size=SEGMENT, overwrite=True) as s:
        s.register("kv", state["kv"], kind="kv", page_bytes=PB)
        s.register("lora", state["lora"], kind="adapter", page_bytes=PB)
        s.checkpoint()
        for e in range(deltas):
            state["kv"][3 * 64] = state["kv"][40 * 64] = e + 0.5
            s.checkpoint()
    return state


def _page_offset(spec, region: str, page: int, k: int) -> int:
    """Where page `page` of `region` lies in the k-th record holding it (0: the first checkpoint's, -1: the newest)."""
    log = Log.open(spec, writable=False, check_pages=False)
    try:
        h = scan(log)
        rid = next(r.id for r in h.regions.values() if r.name == region)
        bs = sorted((b for b in h.batches if b.region_id == rid and page in b.page_ids.tolist()), key=lambda b: b.lsn)
        b = bs[k]
        row = b.page_ids.tolist().index(page)
        return b.offset + ref.payload_offset(b.page_ids.size) + row * b.page_bytes
    finally:
        log.close()


def _flip(spec, offset):
    with open(spec.partition(":")[2], "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x10]))


def _outcome(fn):
    """('ok', {name: bytes}) or (error class name, message) of fn()."""
    try:
        return "ok", {n: np.asarray(a).tobytes() for n, a in fn().arrays.items()}
    except ConcordiaError as exc:
        return type(exc).__name__, str(exc)


def _both(spec, mode=None):
    """restore()'s outcome, and the outcome of applying the plan made with every page checked."""
    log = Log.open(spec, writable=False, check_pages=False)
    try:
        st = {}
        now = _outcome(lambda: restore(log, mode=mode, stats=st))
        try:
            p = plan(log, **({} if mode is None else {"mode": mode}))
            checked = _outcome(lambda: restore(log, plan=p))
        except ConcordiaError as exc:
            checked = type(exc).__name__, str(exc)
        return now, checked, st
    finally:
        log.close()


def test_a_clean_log_is_restored_with_the_page_checks_left_to_the_appliers(file_log):
    state = _log(file_log, deltas=0)
    now, checked, st = _both(file_log)
    assert now == checked and now[0] == "ok"
    assert now[1]["kv"] == state["kv"].tobytes() and now[1]["lora"] == state["lora"].tobytes()
    # one record a region, each copied whole by the applier: nothing left for the host
    assert st["page_check"].startswith("deferred: 2 record(s)") and "(0 read in part)" in st["page_check"]


def test_records_read_in_part_are_checked_on_the_host_meanwhile(file_log):
    state = _log(file_log, deltas=2)
    now, checked, st = _both(file_log)
    assert now == checked and now[1]["kv"] == state["kv"].tobytes()
    assert "(1 read in part)" in st["page_check"]   # kv's first record: pages 3 and 40 come from the last delta


@pytest.mark.parametrize("mode", [None, "skip_corrupt"])
def test_damage_in_a_page_no_plan_reads_decides_as_the_checked_plan(file_log, mode):
    """A superseded page of the first checkpoint is damaged: the metadata plan never reads
    it, the host's check finds it, and the outcome is the checked plan's
    (tolerate_tail refuses, R-D5; skip_corrupt recovers what it can)."""
    _log(file_log, deltas=2)
    _flip(file_log, _page_offset(file_log, "kv", 3, 0) + 7)
    now, checked, st = _both(file_log, mode)
    assert now == checked
    if mode is None:   # refused by the checked plan, in its words
        assert now[0] == "CorruptionError" and "page CRC mismatch for page 3" in now[1]
    else:
        assert now[0] == "ok" and st["page_check"].startswith("damage met while applying a plan made from metadata "
                                                              "(the host's page checks found a damaged page)")


@pytest.mark.parametrize("mode", [None, "skip_corrupt"])
def test_damage_in_a_record_no_applier_reads_decides_as_the_checked_plan(file_log, mode):
    """The first delta is wholly superseded by the second: the host checks it whole."""
    _log(file_log, deltas=2)
    _flip(file_log, _page_offset(file_log, "kv", 40, 1) + 9)
    now, checked, st = _both(file_log, mode)
    assert now == checked
    if mode is None:
        assert now[0] == "CorruptionError" and "page CRC" in now[1]
    else:
        assert now[0] == "ok" and "(the host's page checks found a damaged page)" in st["page_check"]


@pytest.mark.parametrize("mode", [None, "skip_corrupt"])
def test_damage_in_a_page_the_applier_reads_decides_as_the_checked_plan(file_log, mode):
    _log(file_log, deltas=2)
    _flip(file_log, _page_offset(file_log, "kv", 40, -1) + 3)
    now, checked, st = _both(file_log, mode)
    assert now == checked and now[0] == "ok"   # the last epoch is a torn tail: the one before it is restored
    assert "page CRC mismatch for page 40 of region 'kv'" in st["page_check"]   # what the applier met
    assert st["page_check"].endswith("planned again, every page checked")


def test_damage_leaves_the_targets_as_they_were(file_log):
    """Through Session.recover(into=): the host's check meets the damage after
    the appliers restored everything, before any target is written."""
    state = _log(file_log, deltas=2)
    _flip(file_log, _page_offset(file_log, "lora", 1, 0) + 1)
    kv, lora = np.full_like(state["kv"], 7.0), np.full_like(state["lora"], 7.0)
    with Session(file_log, create=False) as s:
        with pytest.raises(ConcordiaError):
            s.recover(into={"kv": kv, "lora": lora})
    assert (kv == 7.0).all() and (lora == 7.0).all()


def test_the_host_checks_run_beside_the_applier(file_log, monkeypatch):
    """The host's checks are under way while the applier copies: a check that
    waits for the applier to have started is released by it (were the two
    run one after the other, the check would find the applier never began)."""
    import threading

    import concordia.wal.apply as apply_mod
    from concordia.wal.planner import PageCheck

    _log(file_log, deltas=2)
    began = threading.Event()
    check, applier = PageCheck.run, apply_mod.apply_plan_numpy

    def checks(self, read=()):
        assert began.wait(timeout=60), "the applier did not start while the host's checks ran"
        return check(self, read)

    def applies(*a, **kw):
        began.set()
        return applier(*a, **kw)

    monkeypatch.setattr(PageCheck, "run", checks)
    monkeypatch.setattr(apply_mod, "apply_plan_numpy", applies)
    now, checked, st = _both(file_log)
    assert now == checked and now[0] == "ok" and st["page_check_wait_s"] >= 0
