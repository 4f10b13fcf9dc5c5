"""The positions detector (`detect="positions"`): a static KV cache
[..., max_len, row] whose caller says how many positions hold data.  A
checkpoint logs the pages of the positions added since the last one in every
(batch, head) row, computed from the length alone; a length that went down
logs the region whole; a fingerprint cross-check every `check_every`
checkpoints finds writes elsewhere.  Every test makes its own cache and
replays it against recoveries of every epoch, byte for byte."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from concordia import Session
from concordia.checkpoint import detect
from concordia.errors import SessionError
from concordia.regions.region import PositionGeometry, position_page_bytes
from concordia.wal import format as fmt

SHAPE = (2, 4, 64, 32)   # batch, kv heads, max_len, head_dim: float16 rows of 64 bytes
ROWS = SHAPE[0] * SHAPE[1]


class Cache:
    """A static cache as a decode loop fills it: `grow(n)` writes positions
    [length, length + n) of every row and moves the length; `restart(n)`
    zeroes everything and writes a new prompt of n positions, counting the
    restarts in `generation` (what a caller hands seq_ids=)."""

    def __init__(self, shape=SHAPE, dtype=np.float16, seed=0):
        self.a = np.zeros(shape, dtype)
        self.length = 0
        self.generation = 0
        self.rng = np.random.default_rng(seed)

    def _fill(self, lo, hi):
        shape = self.a.shape[:-2] + (hi - lo, self.a.shape[-1])
        self.a[..., lo:hi, :] = self.rng.standard_normal(shape).astype(self.a.dtype)

    def grow(self, n):
        self._fill(self.length, self.length + n)
        self.length += n

    def restart(self, n):
        self.a[...] = 0
        self._fill(0, n)
        self.length = n
        self.generation += 1


def _log(tmp_path, name="kv.log"):
    return f"file:{tmp_path / name}"


def _register(s, cache, name="kv", **kw):
    kw.setdefault("page_bytes", position_page_bytes(cache.a.shape[-1] * cache.a.itemsize))
    return s.register(name, cache.a, kind="kv", detect="positions", length=lambda: cache.length, **kw)


def _recovered_epochs(log, want: dict, name="kv"):
    """Every epoch of `want` ({epoch: bytes}) recovered from `log` equals it."""
    with Session(log, create=False) as r:
        for epoch, truth in want.items():
            got = r.recover(epoch)[name]
            assert np.ascontiguousarray(got).tobytes() == truth, f"epoch {epoch}"


def _pages_of(lo, hi, row_bytes, page_bytes, rows=ROWS):
    """Pages a checkpoint of positions [lo, hi) must log (rows that start on a page)."""
    if hi <= lo:
        return 0
    return rows * ((hi * row_bytes - 1) // page_bytes - lo * row_bytes // page_bytes + 1)


# --- exactness -----------------------------------------------------------------


@pytest.mark.parametrize("staging", ["auto", "mapped", "ring"])
@pytest.mark.parametrize("check_every", [0, 3])
def test_every_epoch_recovers_byte_for_byte(tmp_path, staging, check_every):
    cache = Cache()
    other = np.random.default_rng(9).standard_normal((40, 70)).astype(np.float32)   # a fingerprinted neighbour
    log = _log(tmp_path)
    want = {}
    plan = [5, 0, 1, 1, 7, ("restart", 3), 2, 0, 20, 1, ("restart", 64), ("restart", 0), 9, 1, 1, 30]
    with Session(log, size=64 << 20, segment_size=4 << 20, staging=staging) as s:
        r = _register(s, cache, check_every=check_every, seq_ids=lambda: cache.generation)
        s.register("other", other, detect="fingerprint", page_bytes=256)
        for i, step in enumerate([None] + plan):
            if isinstance(step, tuple):
                cache.restart(step[1])
            elif step is not None:
                cache.grow(min(step, SHAPE[2] - cache.length))
            if i % 4 == 2:
                other[i % 40] += 1
            st = s.checkpoint()
            want[st.epoch] = cache.a.tobytes()
        assert r.missed_pages == 0 and r.shadow is None
        if staging == "mapped":   # after the first epoch the whole state is one table pass
            assert [x.table_pass for x in s.checkpoints][1:] == [True] * len(plan)
        else:
            assert {v for x in s.checkpoints for v in x.via.values()} == {"host" if staging == "auto" else "cpu-ring"}
    _recovered_epochs(log, want)


def test_a_length_gone_down_logs_the_region_whole(tmp_path):
    cache = Cache()
    log = _log(tmp_path)
    with Session(log, size=64 << 20) as s:
        r = _register(s, cache)
        cache.grow(40)
        s.checkpoint()
        cache.grow(2)
        assert s.checkpoint().pages["kv"] == ROWS * 2
        cache.restart(10)                       # a new prompt: shorter than before
        st = s.checkpoint()
        assert st.pages["kv"] == r.pages        # every page, the zeroed tail included
        e_restart, truth = st.epoch, cache.a.tobytes()
        cache.grow(1)
        assert s.checkpoint().pages["kv"] == ROWS   # and from there one row per new position again
    _recovered_epochs(log, {e_restart: truth})


def test_a_restart_past_the_old_length_needs_a_sequence_id(tmp_path):
    """A cache reset and a prompt longer than the sequence before, between
    two checkpoints: the length only grew, so without seq_ids the rewritten
    positions below the old length are not named (a cross-check finds them
    later); with seq_ids the region is logged whole at once."""
    got = {}
    for seq in (False, True):
        cache = Cache()
        log = _log(tmp_path, f"seq{seq}.log")
        with Session(log, size=64 << 20) as s:
            r = _register(s, cache, check_every=2, **({"seq_ids": lambda: cache.generation} if seq else {}))
            cache.grow(10)
            s.checkpoint()
            cache.restart(30)
            st = s.checkpoint()
            got[seq] = st.pages["kv"]
            truth = cache.a.tobytes()
            cache.grow(1)
            s.checkpoint()                       # the cross-check
            missed = r.missed_pages
            final = {s.checkpoints[-1].epoch: cache.a.tobytes()}
        with Session(log, create=False) as rd:
            assert (rd.recover(st.epoch)["kv"].tobytes() == truth) is seq
        assert missed == (0 if seq else ROWS * 10)   # positions 0..9 of every row, one page each
        _recovered_epochs(log, final)
    assert got == {False: ROWS * 20, True: ROWS * SHAPE[2]}


# --- cost: the new tokens, not the region ---------------------------------------


@pytest.mark.parametrize("max_len", [64, 4096])
@pytest.mark.parametrize("head_dim,page_bytes", [(32, 64), (32, 128), (32, 256), (64, 64), (64, 128)])
def test_pages_follow_the_new_tokens_not_the_cache(tmp_path, max_len, head_dim, page_bytes):
    cache = Cache(shape=(2, 4, max_len, head_dim))
    row = head_dim * 2
    with Session(_log(tmp_path), size=64 << 20) as s:
        r = _register(s, cache, page_bytes=page_bytes)
        cache.grow(5)
        s.checkpoint()                              # the base: every page
        for n in (1, 3, 0, 2, 1):
            lo = cache.length
            cache.grow(n)
            st = s.checkpoint()
            assert st.pages["kv"] == _pages_of(lo, lo + n, row, page_bytes)
            assert st.bytes == st.pages["kv"] * page_bytes
        # nothing kept that grows with the region: no shadow copy, no fingerprints
        assert r.shadow is None and r.fps is None and r.kv_prev is None


def test_dirty_bytes_peeks_without_moving_the_detector(tmp_path):
    cache = Cache()
    with Session(_log(tmp_path), size=64 << 20) as s:
        _register(s, cache)
        s.checkpoint()
        cache.grow(3)
        assert s.dirty_bytes() == s.dirty_bytes() == ROWS * 3 * 64
        assert s.checkpoint().pages["kv"] == ROWS * 3
        assert s.dirty_bytes() == 0


def test_row_sized_pages_write_the_least(tmp_path):
    """Why the page is one row (position_page_bytes): one decode step of a
    [8, 8, 256, 128] float16 cache, logged with pages of 256 to 4096 bytes.
    Each page costs 8 bytes beside its payload and a record's header is
    shared, so row-sized pages write the new tokens and 3% more; 4 KiB pages
    write 16 times the new tokens."""
    new = 8 * 8 * 128 * 2          # one position of every row
    logged = {}
    for pb in (256, 512, 1024, 2048, 4096):
        cache = Cache(shape=(8, 8, 256, 128))
        with Session(_log(tmp_path, f"p{pb}.log"), size=64 << 20) as s:
            _register(s, cache, page_bytes=pb)
            cache.grow(100)
            s.checkpoint()
            cache.grow(1)
            st = s.checkpoint()
        assert st.pages["kv"] == 64
        assert st.log_bytes == fmt.page_batch_length(64, pb)
        logged[pb] = st.log_bytes
    assert position_page_bytes(128 * 2) == 256
    assert sorted(logged, key=logged.get) == [256, 512, 1024, 2048, 4096]
    assert logged[256] / new < 1.04 and logged[4096] / new > 16


def test_rows_of_fewer_than_64_bytes_share_a_page():
    assert position_page_bytes(32) == 64 and position_page_bytes(96) == 192 and position_page_bytes(256) == 256
    g = PositionGeometry.of((3, 5, 16), 2, 64, "region 'kv'")   # rows of 32 bytes, two a page
    assert (g.rows, g.max_len, g.row_bytes, g.span_pages) == (3, 5, 32, None)
    # a page holds the last position of one row and the first of the next: named once
    assert detect.position_pages(g, 4, 5).tolist() == [2, 4, 7]
    assert detect.position_pages(g, 0, 5).tolist() == list(range(8))
    assert detect.position_pages(g, 3, 3).size == 0


def test_a_table_pass_lists_what_each_region_would(tmp_path):
    """detect.listed_pages (the table passes' listing of host-listed rows)
    names, per region, the pages dirty_pages names, moving each detector
    alike: positions regions sharing a geometry and a length (computed once),
    one at another length, one whose cross-check falls due, one whose length
    went down, and a slot-versions region beside them."""
    from concordia.regions.arrays import adapt, storage_of
    from concordia.regions.region import Region, resolve_detector

    def regions():
        caches = [Cache(seed=i) for i in range(5)]
        for c in caches:
            c.grow(5)                                # in the base: position 0 is old from here on
        slots = np.zeros(8, np.int64)
        out = []
        for i, c in enumerate(caches):
            arr, xp, owner = adapt(c.a, f"region 'p{i}'")
            det, hints = resolve_detector("kv", "positions", "x", arr, xp, block_tables=None, seq_lens=None,
                                          block_stamp=None, seq_ids=None, slot_versions=None, pages_per_slot=None,
                                          check_every=3 if i == 3 else 0, length=lambda c=c: c.length,
                                          page_bytes=64)
            out.append(Region(name=f"p{i}", kind="kv", page_bytes=64, array=arr, xp=xp, owner=owner,
                              storage=storage_of(owner), detect=det, hints=hints, check_every=hints["check_every"]))
        ad = np.zeros(8 * 64, np.uint8)
        arr, xp, owner = adapt(ad, "region 'v'")
        out.append(Region(name="v", kind="adapter", page_bytes=64, array=arr, xp=xp, owner=owner,
                          storage=storage_of(owner), detect="versions",
                          hints={"slot_versions": slots, "pages_per_slot": 1}))
        for r in out:
            r.crcs = np.zeros(r.pages, np.uint32)   # a base is committed
            detect.reset(r)
        return caches, slots, out

    a, b = regions(), regions()
    first = np.cumsum([0] + [r.pages for r in a[2]])[:-1].astype(np.uint64)
    for step in range(7):
        for caches, slots, _ in (a, b):
            for i, c in enumerate(caches):
                if i == 4 and step == 4:
                    c.restart(2)                      # this one's length goes down
                else:
                    c.grow(2 if i == 2 else 1)        # p2 at another length than the rest
            caches[3].a[0, 0, 0, 0] += 1              # p3 writes outside its positions: its cross-check finds it
            slots[step % 8] += 1
        together = detect.listed_pages(a[2], first)
        alone = [f + detect.dirty_pages(r, advance=True).astype(np.uint64) for r, f in zip(b[2], first)]
        assert sorted(together.tolist()) == sorted(np.concatenate(alone).tolist()), step
        assert [(r.length_prev, r.missed_pages, r.since_check) for r in a[2]] == \
            [(r.length_prev, r.missed_pages, r.since_check) for r in b[2]]
    assert a[2][3].missed_pages == 2


# --- the cross-check -------------------------------------------------------------


def test_a_write_outside_the_named_positions_is_found_at_the_cross_check(tmp_path):
    cache = Cache()
    log = _log(tmp_path)
    want = {}
    with Session(log, size=64 << 20) as s:
        r = _register(s, cache, check_every=3)
        cache.grow(10)
        s.checkpoint()                       # the base; fingerprints taken
        cache.grow(1)
        cache.a[1, 2, 4, :] += 1             # position 4 is old: the length does not name it
        missed = s.checkpoint()
        assert missed.pages["kv"] == ROWS and r.missed_pages == 0
        cache.grow(1)
        s.checkpoint()
        cache.grow(1)
        found = s.checkpoint()               # the third since the base: the cross-check
        assert r.missed_pages == 1
        assert found.pages["kv"] == ROWS + 1
        want[found.epoch] = cache.a.tobytes()
        cache.grow(1)
        st = s.checkpoint()
        assert st.pages["kv"] == ROWS and r.missed_pages == 1
        want[st.epoch] = cache.a.tobytes()
        stale = missed.epoch
    with Session(log, create=False) as rd:   # the epoch before the check lacks the write
        assert rd.recover(stale)["kv"][1, 2, 4].tobytes() != cache.a[1, 2, 4].tobytes()
    _recovered_epochs(log, want)


# --- recovery into the registered cache ----------------------------------------------


def test_a_recovery_in_place_names_every_position_next(tmp_path):
    """The length lives beside the cache and is put back after recover()
    (as an integration restores its position counters): the detector must not
    take the length it reads during the recovery for the recovered state's."""
    cache = Cache()
    log = _log(tmp_path)
    with Session(log, size=64 << 20) as s:
        _register(s, cache)
        cache.grow(5)
        s.checkpoint()
        cache.grow(1)                        # position 5 written, never checkpointed
        s.recover(into="registered")         # the cache is back at epoch 1 (5 positions) ...
        cache.length = 5                     # ... and then its length
        cache.grow(1)                        # position 5 written anew: the length is 6 again
        st = s.checkpoint()
        assert st.pages["kv"] == ROWS * 6
        truth = cache.a.tobytes()
    _recovered_epochs(log, {st.epoch: truth})


# --- frameworks and hints ------------------------------------------------------------


def test_a_torch_tensor_with_a_tensor_length(tmp_path):
    torch = pytest.importorskip("torch")
    kv = torch.zeros(SHAPE, dtype=torch.bfloat16)
    length = torch.tensor(0, dtype=torch.int64)       # as a StaticCache layer keeps cumulative_length
    gen = torch.Generator().manual_seed(0)
    log = _log(tmp_path)
    want = {}
    with Session(log, size=64 << 20) as s:
        r = s.register("kv", kv, kind="kv", length=length, page_bytes=position_page_bytes(SHAPE[-1] * 2))
        assert r.detect == "positions"                # kind="kv" with a length: "auto" takes it
        for n in (3, 1, 1, 6):
            lo = int(length)
            kv[:, :, lo:lo + n] = torch.randn(SHAPE[0], SHAPE[1], n, SHAPE[3], generator=gen).to(torch.bfloat16)
            length.add_(n)
            st = s.checkpoint()
            if st.epoch > 1:
                assert st.pages["kv"] == ROWS * n
            want[st.epoch] = kv.clone()
    with Session(log, create=False) as rd:
        for epoch, truth in want.items():
            got = rd.recover(epoch)["kv"]
            assert got.dtype == torch.bfloat16 and torch.equal(got.view(torch.int16), truth.view(torch.int16))


@pytest.mark.parametrize("array,kw,words", [
    (np.zeros(SHAPE, np.float16), {}, "needs length="),
    (np.zeros(64 * 32, np.float16), {"length": lambda: 0}, "[..., max_len, row]"),
    (np.zeros((2, 4, 64, 64), np.float16), {"length": lambda: 0, "page_bytes": 192},
     "page_bytes 192 neither divides a row of 128 bytes"),
    (np.zeros(SHAPE, np.float16), {"length": lambda: 2.5}, "not a whole number"),
    (np.zeros(SHAPE, np.float16), {"length": "8"}, "not a whole number"),
    (np.zeros(SHAPE, np.float16), {"length": np.zeros(2, np.int64)}, "2 elements"),
    (np.zeros(SHAPE, np.float16), {"length": np.zeros((), np.float32)}, "float32"),
    (np.zeros(SHAPE, np.float16), {"length": lambda: 65}, "holds 0 to 64"),
    (np.zeros(SHAPE, np.float16), {"length": lambda: -1}, "holds 0 to 64"),
    (np.zeros(SHAPE, np.float16), {"length": lambda: 0, "check_every": -1}, "check_every must be"),
    (np.zeros(SHAPE, np.float16), {"length": lambda: 0, "seq_ids": lambda: "a"}, "not an integer"),
    (np.zeros(SHAPE, np.float16), {"length": lambda: 0, "seq_ids": np.zeros(2)}, "not an integer"),
])
def test_bad_hints_are_refused_in_one_line_at_register(tmp_path, array, kw, words):
    kw = {"page_bytes": 64, **kw}
    with Session(_log(tmp_path), size=64 << 20) as s:
        with pytest.raises(SessionError) as info:
            s.register("kv", array, kind="kv", detect="positions", **kw)
        line = info.value.one_line()
        assert "\n" not in line and line.startswith("region 'kv':") and words in line, line
        assert "kv" not in s.regions and "kv" not in s.log.regions      # nothing registered, nothing written


def test_a_bad_length_at_a_checkpoint_is_refused_and_the_next_is_whole(tmp_path):
    cache = Cache()
    log = _log(tmp_path)
    with Session(log, size=64 << 20) as s:
        r = _register(s, cache)
        cache.grow(4)
        s.checkpoint()
        cache.length = 99                      # past max_len
        with pytest.raises(SessionError) as info:
            s.checkpoint()
        assert info.value.one_line().startswith("region 'kv': the length hint says 99")
        cache.length = 4
        cache.grow(2)
        st = s.checkpoint()
        assert st.pages["kv"] == r.pages       # the failed epoch never committed: written whole
    _recovered_epochs(log, {st.epoch: cache.a.tobytes()})


# --- the benchmark's decode step -----------------------------------------------------


def test_bench_decode_step_registers_the_cache_by_positions():
    from concordia.tools.wal_cli import main

    res = CliRunner().invoke(main, ["bench", "checkpoint", "--cpu", "--parts", "decode", "--decode-len", "16",
                                    "--reps", "3", "--json"])
    assert res.exit_code == 0, res.output
    d = json.loads(res.output)["decode_shaped"]
    assert d["kv_detector"] == "positions" and d["kv_page_bytes"] == 256
    for key in ("", "_adapters_clean"):
        assert d["ckpt" + "_ms" + key] > 0 and d["fingerprint_ckpt_ms" + key] > 0
    # one new token in 56 tensors of 64 rows: a 256-byte page each, where fingerprints log 4 KiB
    assert d["dirty_bytes_adapters_clean"] == 56 * 64 * 256
    assert d["fingerprint_dirty_bytes_adapters_clean"] == 56 * 64 * 4096
    # the host writes retention's bases here (the device stager writes from pinned copies on a GPU)
    assert d["base_staging"] is None and isinstance(d["retention_jobs"], int) and d["retention_bases_retain_off"] == 0
    # the same step on a resident session, its caches' length in a word: the consumer's arena epochs
    assert d["via_resident"] == ["consumer-arena"] and d["route_resident"]["why"] is None
    assert d["dirty_bytes_resident"] == d["dirty_bytes"] and d["ckpt_ms_mean_resident"] > 0
    # the adapters in one region, as protect() lays them out, and a region each for comparison: every
    # adapter page written either way (each adapter's size is a whole number of pages)
    assert d["adapter_regions"] == 1 and d["adapter_regions_lora_tensors"] == 112 and d["ckpt_ms_lora_tensors"] > 0
    assert d["dirty_bytes_lora_tensors"] == d["dirty_bytes"]


# --- the device --------------------------------------------------------------------


@pytest.mark.gpu
def test_device_paths_write_the_twins_records(tmp_path):
    """A CuPy cache through the device table pass (shm log) and the device
    ring (file log) leaves the records the numpy twin leaves, and recovers."""
    import cupy as cp

    from tests.conftest import shm_test_name
    from tests.session.staging_cases import assert_same_log, log_contents

    def run(log, to_device, staging):
        cache = Cache()
        live = to_device(cache.a) if to_device else cache.a
        with Session(log, size=64 << 20, segment_size=4 << 20, overwrite=True, staging=staging) as s:
            s.register("kv", live, kind="kv", detect="positions", page_bytes=64, length=lambda: cache.length,
                       check_every=2)
            stats = []
            for step in (None, 3, 1, ("restart", 2), 5):
                if isinstance(step, tuple):
                    cache.restart(step[1])
                elif step:
                    cache.grow(step)
                if to_device:
                    live.set(cache.a)
                stats.append(s.checkpoint())
            return stats, log_contents(s.log), np.asarray(s.recover()["kv"]), cache.a.copy()

    name = shm_test_name("kvpos")
    try:
        twin = run(_log(tmp_path, "twin.log"), None, "mapped")
        for log, label in ((f"shm:{name}", "gpu-mapped"), (_log(tmp_path, "ring.log"), "gpu-ring")):
            got = run(log, cp.asarray, "auto")
            assert all(set(st.via.values()) == {label} for st in got[0])
            assert [st.pages for st in got[0]] == [st.pages for st in twin[0]]
            assert_same_log(got[1], twin[1])
            assert got[2].tobytes() == got[3].tobytes() == twin[2].tobytes()
    finally:
        import os

        try:
            os.unlink(f"/dev/shm/{name}")
        except FileNotFoundError:
            pass


# --- length words: the positions detector without the host ------------------------


@pytest.fixture
def shm_log():
    from tests.session.conftest import _fresh_shm_log

    yield from _fresh_shm_log()


#: steps of the word tests: grow by n, ("restart", n) with a new sequence id, ("down", n) without one
WORD_PLAN = [None, 3, 1, 0, ("restart", 2), 5, ("down", 1), 4, 2]


def _word_run(log, *, words: bool, to_device=None, staging="mapped", executor=None, extra_at=None):
    """A cache through WORD_PLAN with its length and sequence id given as
    callables (the host lists its pages) or as int64 words beside it
    (`table.DET_POSITIONS`); (stats, log contents, recovered epochs, detector codes)."""
    from concordia.checkpoint.table import RegionTable
    from tests.session.staging_cases import log_contents

    cache = Cache()
    xp = np if to_device is None else to_device
    live = cache.a if to_device is None else xp.asarray(cache.a)
    length, seq = xp.zeros(1, xp.int64), xp.zeros(1, xp.int64)
    kw = dict(length=length, seq_ids=seq) if words else dict(length=lambda: cache.length,
                                                              seq_ids=lambda: cache.generation)
    want, stats = {}, []
    with Session(log, size=64 << 20, segment_size=4 << 20, overwrite=True, staging=staging,
                 **({"executor": executor} if executor else {})) as s:
        s.register("kv", live, kind="kv", detect="positions", page_bytes=64, **kw)
        for i, step in enumerate(WORD_PLAN):
            if isinstance(step, tuple):
                if step[0] == "restart":
                    cache.restart(step[1])
                else:  # the length goes down, the same sequence
                    cache.a[..., step[1]:, :] = 0
                    cache.length = step[1]
            elif step:
                cache.grow(step)
            if to_device is not None:
                live.set(cache.a)
            length[0], seq[0] = cache.length, cache.generation
            if extra_at == i:
                s.register("extra", xp.zeros(4096, xp.uint8), detect="shadow", page_bytes=4096)
            st = s.checkpoint()
            stats.append(st)
            want[st.epoch] = cache.a.tobytes()
        codes = RegionTable([s.region_set["kv"]]).entries["detector"].tolist()
        s.settle()
        # a region registered midway (`extra_at`) has no state before its first epoch: kept as it is
        got = {e: np.asarray(_host(s.recover(e, absent="keep")["kv"])).tobytes() for e in want}
        return stats, log_contents(s.log), got, want, codes


def _host(a):
    return a.get() if hasattr(a, "get") else a


def test_length_words_make_a_detector_that_names_what_the_host_lists(tmp_path):
    """A cache whose length and sequence id are int64 words beside it takes
    the positions detector a pass runs where the region is (DET_POSITIONS;
    the host's twin lists the same pages): the records and commits are those
    of the same cache with callables, through a growing length, a restart
    with a new sequence id and a length gone down; every epoch recovers."""
    from concordia.checkpoint.table import DET_LISTED, DET_POSITIONS
    from tests.session.staging_cases import assert_same_log

    listed = _word_run(_log(tmp_path, "listed.log"), words=False)
    worded = _word_run(_log(tmp_path, "words.log"), words=True)
    assert listed[4] == [DET_LISTED] and worded[4] == [DET_POSITIONS]
    assert [st.pages for st in worded[0]] == [st.pages for st in listed[0]]
    assert [st.pages["kv"] for st in worded[0]][1:4] == [ROWS * 3, ROWS, 0]
    assert all(st.table_pass for st in worded[0][1:])
    assert_same_log(worded[1], listed[1])
    assert worded[2] == worded[3]


def test_a_cache_by_length_words_takes_the_resident_route(shm_log):
    """With its length in words, a cache is no longer listed by the host: a
    resident session's epochs after the first go into the arena (the CPU
    twin of the device's EPOCH handler), each naming the new positions'
    pages, each recovered exactly."""
    from concordia.checkpoint.arena_route import VIA_CONSUMER

    stats, _, got, want, _ = _word_run(shm_log, words=True, executor="resident")
    assert all(set(st.via.values()) == {VIA_CONSUMER} for st in stats[1:]), [st.via for st in stats]
    assert [st.pages["kv"] for st in stats][1:4] == [ROWS * 3, ROWS, 0]
    assert got == want


def test_words_that_are_not_one_int64_beside_the_region_leave_it_listed():
    """A length the pass could not read where the region is stays the host's
    to list: a callable, a word of another integer type, a cross-check."""
    from concordia.checkpoint.table import DET_LISTED, detector_of
    from concordia.regions.arrays import adapt, storage_of
    from concordia.regions.region import Region, resolve_detector

    def code(length, check_every=0):
        a = np.zeros(SHAPE, np.float16)
        arr, xp, owner = adapt(a, "region 'kv'")
        det, hints = resolve_detector("kv", "positions", "kv", arr, xp, block_tables=None, seq_lens=None,
                                      block_stamp=None, seq_ids=None, slot_versions=None, pages_per_slot=None,
                                      check_every=check_every, length=length, page_bytes=64)
        return detector_of(Region(name="kv", kind="kv", page_bytes=64, array=arr, xp=xp, owner=owner,
                                  storage=storage_of(owner), detect=det, hints=hints, check_every=check_every))

    assert code(np.zeros(1, np.int64)) != DET_LISTED
    for length in (lambda: 3, np.zeros(1, np.int32), np.zeros(1, np.uint64)):
        assert code(length) == DET_LISTED
    assert code(np.zeros(1, np.int64), check_every=2) == DET_LISTED


def test_the_kernels_page_rule_names_the_pages_position_pages_lists():
    """table.cu's positions rows, as their arithmetic reads: detection counts
    each run's pages (`run_pages`: the pages positions [lo, hi) of run m
    cover, less any the run before already named) a lane a run, and the
    plan writes them run after run from a scan of those counts.  Restated
    here from the kernel's source, the count and the ids are exactly what
    `position_pages` lists, over geometries whose pages split rows, hold
    several rows, or hold the end of one run and the start of the next, for
    one new position, several, none and every one.  The H200 test runs the
    kernel itself."""

    def run_pages(m, span, rb, pb, lo, hi):
        end = m * span + hi * rb - 1
        start = (m * span + lo * rb) // pb
        if m:
            start = max(start, ((m - 1) * span + hi * rb - 1) // pb + 1)
        return start, (end // pb - start + 1 if end // pb >= start else 0)

    rng = np.random.default_rng(4)
    for rows, max_len, rb, pb in [(4, 16, 64, 64), (4, 16, 64, 256), (3, 10, 64, 128), (2, 7, 192, 64),
                                  (5, 9, 32, 64), (2, 5, 256, 1024), (8, 12, 256, 256), (64, 641, 256, 256),
                                  (64, 641, 256, 1024), (3, 3, 64, 256)]:
        if rb % pb and pb % rb:
            continue
        g = PositionGeometry(rows, max_len, rb, pb)
        span = max_len * rb
        runs = g.rows  # the kernel's nbytes / span
        cases = [(0, max_len), (max_len - 1, max_len), (0, 1), (3, 3)] + [
            tuple(sorted(rng.integers(0, max_len + 1, 2).tolist())) for _ in range(12)]
        for lo, hi in cases:
            if lo >= max_len or hi > max_len:
                continue
            want = detect.position_pages(g, lo, hi).tolist()
            got = []
            if hi > lo:
                for m in range(runs):  # lanes over runs; the plan's scan puts each run's pages after the last
                    first, count = run_pages(m, span, rb, pb, lo, hi)
                    got += range(first, first + count)
            assert got == want, (rows, max_len, rb, pb, lo, hi)
            assert sum(run_pages(m, span, rb, pb, lo, hi)[1] for m in range(runs)) * (hi > lo) == len(want)


@pytest.mark.gpu
def test_length_words_on_the_device_write_the_twins_records(tmp_path, shm_log):
    """A CuPy cache with CuPy length and sequence words: the device table
    pass (table_positions) writes the records the numpy twin writes; a
    region registered midway rebuilds the pass, which hands its detector back
    (the next epoch still names only the new positions); the resident route
    runs its epochs on the persistent kernel; every epoch recovers."""
    import cupy as cp

    from concordia.checkpoint.arena_route import VIA
    from tests.conftest import shm_test_name
    from tests.session.staging_cases import assert_same_log

    twin = _word_run(_log(tmp_path, "twin.log"), words=True)
    name = shm_test_name("kvwords")
    try:
        got = _word_run(f"shm:{name}", words=True, to_device=cp, staging="auto", executor="host")
        assert all(set(st.via.values()) == {"gpu-mapped"} for st in got[0][1:]), [st.via for st in got[0]]
        assert [st.pages for st in got[0]] == [st.pages for st in twin[0]]
        assert_same_log(got[1], twin[1])
        assert got[2] == got[3] == twin[2]
        rebuilt = _word_run(f"shm:{name}", words=True, to_device=cp, staging="auto", extra_at=3, executor="host")
        assert [st.pages["kv"] for st in rebuilt[0]] == [st.pages["kv"] for st in twin[0]]
        assert rebuilt[2] == rebuilt[3]
    finally:
        import os

        try:
            os.unlink(f"/dev/shm/{name}")
        except FileNotFoundError:
            pass
    stats, _, got, want, _ = _word_run(shm_log, words=True, to_device=cp, staging="auto", executor="resident")
    assert all(set(st.via.values()) == {VIA} for st in stats[1:]), [st.via for st in stats]
    assert [st.pages["kv"] for st in stats] == [st.pages["kv"] for st in twin[0]]
    assert got == want


def _interleaved_run(log, *, to_device=None, executor=None):
    """Three caches by length words (each its own geometry, one of pages that
    straddle its runs) between a shadow-copied and a fingerprinted region, so
    that the table's rows alternate between positions rows and flagged ones,
    through WORD_PLAN; (stats, log contents, recovered epochs, expected)."""
    from tests.session.staging_cases import log_contents

    xp = np if to_device is None else to_device
    caches = [Cache(SHAPE, seed=1), Cache((3, 2, 15, 32), seed=2), Cache((1, 3, 9, 48), seed=3)]
    pages = [64, 64, 192]   # the third: rows of 96 bytes, two to a page, nine to a run: pages straddle runs
    live = [c.a if to_device is None else xp.asarray(c.a) for c in caches]
    words = [(xp.zeros(1, xp.int64), xp.zeros(1, xp.int64)) for _ in caches]
    rng = np.random.default_rng(5)
    flagged = {"shadowed": np.zeros(3 * 4096, np.uint8), "printed": np.zeros(5 * 4096, np.uint8)}
    flagged_live = {k: v if to_device is None else xp.asarray(v) for k, v in flagged.items()}
    want, stats = {}, []
    with Session(log, size=64 << 20, segment_size=4 << 20, overwrite=True, staging="auto" if to_device else "mapped",
                 **({"executor": executor} if executor else {})) as s:
        s.register("kv0", live[0], kind="kv", detect="positions", page_bytes=pages[0], length=words[0][0],
                   seq_ids=words[0][1])
        s.register("shadowed", flagged_live["shadowed"], detect="shadow", page_bytes=4096)
        s.register("kv1", live[1], kind="kv", detect="positions", page_bytes=pages[1], length=words[1][0],
                   seq_ids=words[1][1])
        s.register("printed", flagged_live["printed"], detect="fingerprint", page_bytes=4096)
        s.register("kv2", live[2], kind="kv", detect="positions", page_bytes=pages[2], length=words[2][0],
                   seq_ids=words[2][1])
        for i, step in enumerate(WORD_PLAN):
            for c in caches:
                top = c.a.shape[-2]
                if isinstance(step, tuple):
                    if step[0] == "restart":
                        c.restart(min(step[1], top))
                    else:
                        c.a[..., step[1]:, :] = 0
                        c.length = step[1]
                elif step:
                    c.grow(min(step, top - c.length))
            for k, a in flagged.items():  # a page or two of each, some steps none
                for p in rng.choice(a.size // 4096, int(rng.integers(0, 3)), replace=False):
                    a[p * 4096 + int(rng.integers(0, 4096))] += 1
            for c, a, (length, seq) in zip(caches, live, words):
                if to_device is not None:
                    a.set(c.a)
                length[0], seq[0] = c.length, c.generation
            for k, a in flagged.items():
                if to_device is not None:
                    flagged_live[k].set(a)
            st = s.checkpoint()
            stats.append(st)
            want[st.epoch] = [c.a.tobytes() for c in caches] + [a.tobytes() for a in flagged.values()]
        s.settle()
        names = ["kv0", "kv1", "kv2", "shadowed", "printed"]
        got = {}
        for e in want:
            out = s.recover(e)
            got[e] = [np.asarray(_host(out[n])).tobytes() for n in names]
        return stats, log_contents(s.log), got, want


def test_a_table_of_alternating_positions_and_flagged_rows_recovers_every_epoch(tmp_path):
    """The twin's side of the H200 test below: every epoch of the interleaved
    table recovers byte for byte on the host's pass."""
    stats, _, got, want = _interleaved_run(_log(tmp_path, "mixed.log"))
    assert got == want
    assert all(st.table_pass for st in stats[1:]), [st.table_pass for st in stats]


@pytest.mark.gpu
def test_alternating_positions_and_flagged_rows_on_the_device_write_the_twins_records(tmp_path, shm_log):
    """A table whose rows alternate between positions rows (three caches by
    length words, one with pages straddling its runs) and rows a detector
    flags (a shadow copy, fingerprints): the plan's runs of rows of one kind
    (table.cu: kind_end, block_compact over a run's pages, positions_ids)
    give the device's pass the records the numpy twin writes, on the host's
    launches and on the persistent kernel, and every epoch recovers."""
    import cupy as cp

    from tests.session.staging_cases import assert_same_log

    twin = _interleaved_run(_log(tmp_path, "twin.log"))
    got = _interleaved_run(shm_log, to_device=cp, executor="host")
    assert all(set(st.via.values()) == {"gpu-mapped"} for st in got[0][1:]), [st.via for st in got[0]]
    assert [st.pages for st in got[0]] == [st.pages for st in twin[0]]
    assert_same_log(got[1], twin[1])
    assert got[2] == got[3] == twin[2]
    resident = _interleaved_run(shm_log, to_device=cp, executor="resident")
    assert [st.pages for st in resident[0]] == [st.pages for st in twin[0]]
    assert resident[2] == resident[3]
