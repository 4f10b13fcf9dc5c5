"""No surprises from `compact`, `snapshot create` and `info` (issue 29).

* A log is never made unwritable by the tools: a compaction leaves at least
  the retention reserve free (`free_bytes >= reserve_bytes`), one on a log the
  appender found full either makes room by switching first to the bases there
  are or refuses in one line with nothing written, and `snapshot create`,
  which frees nothing, refuses the same way.  The issue's sequence (V1) of
  sessions and compactions runs to the end, and the log takes checkpoints and
  compactions afterwards.
* `--keep K` keeps the K newest bases of each region and nothing older, on
  any log; `--keep 0` keeps everything; no `--keep` applies the policy the log
  stored, which `info` prints in words (never a raw sentinel).
* `compact --json` carries its schema.

Every log is made here, by sessions of the default Policy (or retain=False),
on the CPU."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from click.testing import CliRunner

from concordia import Session
from concordia.policy import Policy
from concordia.tools.wal_cli import main
from concordia.wal import Log
from concordia.wal.errors import LogFullError

from .conftest import sha

MiB = 1 << 20
PAGE_WORDS = 1024  # uint32 words in a 4 KiB page


def wal(*args, code=(0,)):
    """Run concordia-wal in this process; a failure must be exactly one line on stderr."""
    res = CliRunner().invoke(main, [str(a) for a in args])
    assert res.exception is None or isinstance(res.exception, SystemExit), res.exception
    assert res.exit_code in code, (args, res.exit_code, res.output)
    if res.exit_code:
        lines = res.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in res.output, res.stderr
    return res


class Writer:
    """One numpy state of `pages` 4 KiB pages, checkpointed by one session
    after another into the file log at `path`: each checkpoint changes one
    word in `dirty` pages drawn from a seeded generator (a fixed walk)."""

    def __init__(self, path, *, size: int, pages: int, dirty: int, segment: int | None = None,
                 policy: Policy | None = None):
        self.spec = f"file:{path}"
        self.path = str(path)
        self.size, self.segment, self.dirty = size, segment, dirty
        self.policy = policy
        self.state = np.zeros((pages, PAGE_WORDS), np.uint32)
        self.rng = np.random.default_rng(1)
        self.epoch = 0

    def _open(self) -> Session:
        s = Session(self.spec, size=self.size, segment_size=self.segment, policy=self.policy)
        s.register("state", self.state)
        return s

    def _change(self) -> None:
        self.epoch += 1
        for p in self.rng.integers(0, self.state.shape[0], self.dirty):
            self.state[p, self.epoch % PAGE_WORDS] = self.epoch

    def session(self, checkpoints: int) -> None:
        """A session of `checkpoints` checkpoints; every one must commit."""
        with self._open() as s:
            for _ in range(checkpoints):
                self._change()
                s.checkpoint()
                assert s.epoch == self.epoch

    def fill(self) -> int:
        """Checkpoint until the log is full (LogFullError); returns the last committed epoch."""
        with self._open() as s:
            for _ in range(100_000):
                keep = self.state.copy()
                self._change()
                try:
                    s.checkpoint()
                except LogFullError:
                    self.state[:] = keep  # the state stays that of the last commit
                    self.epoch -= 1
                    return self.epoch
        raise AssertionError("the log never filled")

    def restores(self) -> bool:
        with Session(self.spec, create=False) as s:
            return np.array_equal(s.recover()["state"], self.state)


def settle(path) -> str:
    """Cut what a failed checkpoint left after the last commit (what any writer's
    open does first) and return the log's hash, so that a refusal can be
    checked to have changed nothing."""
    Log.open(f"file:{path}", writable=True).close()
    return sha(str(path))


def compact_json(spec, *args, code=(0,)):
    res = wal("compact", spec, *args, "--json", code=code)
    return json.loads(res.stdout) if res.exit_code == 0 else res


# --------------------------------------------------------------------------- V1: the issue's sequence

#: the issue's steps after which the log could no longer be written
V1 = [("session", 75), ("compact", "--keep", "1", "--upto", "47"), ("session", 75), ("compact", "--keep", "0"),
      ("session", 114), ("compact", "--keep", "0", "--upto", "202"), ("compact", "--keep", "1")]


@pytest.mark.parametrize("size,segment,pages,dirty", [
    pytest.param(16 * MiB, 2 * MiB, 320, 11, id="scaled-down"),       # every size / 4
    pytest.param(64 * MiB, None, 1280, 44, id="issue-sizes"),          # 8 MiB segments, 5 MiB of state
])
def test_the_issue_sequence_leaves_the_log_writable(tmp_path, size, segment, pages, dirty):
    w = Writer(tmp_path / "v1.log", size=size, segment=segment, pages=pages, dirty=dirty)
    spaces = []
    for step in V1:
        if step[0] == "session":
            w.session(step[1])  # a LogFullError here is the defect
            continue
        before = settle(w.path)
        rep = compact_json(w.spec, *step[1:], code=(0, 2))
        if isinstance(rep, dict):
            spaces.append(rep)
        else:  # a refusal (an --upto below what retention keeps) changes nothing
            assert "nothing was written" in rep.stderr or "older than retention keeps" in rep.stderr, rep.stderr
            assert sha(w.path) == before
    # what failed after the sequence: the next session, then compact and snapshot create
    w.session(5)
    # every compaction left at least what a session needs
    assert spaces and all(r["free_bytes"] >= r["reserve_bytes"] for r in spaces), spaces
    rep = compact_json(w.spec, "--keep", "1")
    assert rep["floor_epoch"] == w.epoch and rep["free_bytes"] >= rep["reserve_bytes"]
    wal("snapshot", "create", w.spec)
    w.session(5)
    floor = json.loads(wal("info", w.spec, "--json").stdout)["epochs"]["floor"]
    upto = max(floor, w.epoch - 2)  # an older epoch that is still restorable
    rep = compact_json(w.spec, "--keep", "0", "--upto", upto)
    assert rep["epoch"] == upto and rep["free_bytes"] >= rep["reserve_bytes"]
    w.session(5)
    assert w.restores()
    info = json.loads(wal("info", w.spec, "--json").stdout)
    assert info["space"]["writable_bytes"] >= info["space"]["reserve_bytes"]


# --------------------------------------------------------------------------- a full log

def _full_log(tmp_path, based: bool) -> Writer:
    """A log a session without retention wrote until the appender found it full;
    `based`: with two bases per region (epochs 20 and 40), kept by `compact --keep 2`."""
    w = Writer(tmp_path / "full.log", size=16 * MiB, segment=1 * MiB, pages=256, dirty=16,
               policy=Policy(retain=False))
    w.session(20)
    if based:
        wal("compact", w.spec, "--keep", "2")
        w.session(20)
        wal("compact", w.spec, "--keep", "2")
    w.fill()
    return w


@pytest.mark.parametrize("based,args,code,says", [
    # what the policy drops below the base the fold starts from is freed first: room for the new ones
    (True, ["compact", "{log}", "--keep", "1"], 0, None),
    # the policy `compact --keep 2` stored keeps the base at 40 and every delta after it: too much
    (True, ["compact", "{log}"], 2, "less than the"),
    # keeping everything frees nothing: refused
    (True, ["compact", "{log}", "--keep", "0"], 2, "does not make room"),
    # a snapshot frees nothing either
    (True, ["snapshot", "create", "{log}"], 2, "the log can append"),
    (True, ["snapshot", "create", "{log}", "--region", "state"], 2, "the log can append"),
    # no base to free below: the new bases cannot be written
    (False, ["compact", "{log}", "--keep", "1"], 2, "does not make room"),
    (False, ["snapshot", "create", "{log}"], 2, "the log can append"),
])
def test_a_full_log_is_compacted_or_refused_unchanged(tmp_path, based, args, code, says):
    w = _full_log(tmp_path, based)
    before = settle(w.path)
    res = wal(*[w.spec if a == "{log}" else a for a in args], code=(code,))
    if code:
        assert says in res.stderr and "nothing was written" in res.stderr, res.stderr
        assert sha(w.path) == before
        return
    w.session(10)  # writable again
    assert w.restores()


def test_a_full_log_switches_first_to_the_bases_there_are(tmp_path):
    w = _full_log(tmp_path, based=True)
    settle(w.path)
    dry = compact_json(w.spec, "--keep", "1", "--dry-run")
    assert dry["dry_run"] and dry["reclaim_first"] and dry["segments_freed"]
    rep = compact_json(w.spec, "--keep", "1")
    assert rep["reclaim_first"] and sorted(rep["segments_freed"]) == sorted(dry["segments_freed"])
    assert rep["folded"] == ["state"] and rep["floor_epoch"] == w.epoch
    assert rep["free_bytes"] >= rep["reserve_bytes"]


# --------------------------------------------------------------------------- --keep against what the log stored

def _session_log(tmp_path, checkpoints: int) -> Writer:
    """A log of one session with the default Policy (retention on): bases every
    few epochs; 40 checkpoints leave the 64-epoch window reaching back to
    epoch 1 (the session stores "every epoch"), 90 do not (it stores 64)."""
    tmp_path.mkdir(exist_ok=True)
    w = Writer(tmp_path / "s.log", size=16 * MiB, segment=1 * MiB, pages=64, dirty=6)
    w.session(checkpoints)
    return w


def _bases(spec) -> dict:
    snaps = json.loads(wal("snapshot", "list", spec, "--json").stdout)["snapshots"]
    out = {}
    for s in snaps:
        out.setdefault(s["region"], []).append(s["epoch"])
    return out


@pytest.mark.parametrize("checkpoints,args,kept,policy", [
    # --keep K: the K newest bases, whatever the log stored
    (40, ["--keep", "1"], 1, (1, 0)),
    (90, ["--keep", "1"], 1, (1, 0)),
    (40, ["--keep", "2"], 2, (2, 0)),
    (90, ["--keep", "2"], 2, (2, 0)),
    # --keep 0: everything
    (40, ["--keep", "0"], None, (0, 0)),
    (90, ["--keep", "0"], None, (0, 0)),
    # no --keep: the session's policy, "every epoch" for a young one, else its 64-epoch window
    (40, [], None, (0, 0)),
    (90, [], "window", (0, 64)),
])
def test_keep_means_the_newest_bases_on_any_log(tmp_path, checkpoints, args, kept, policy):
    w = _session_log(tmp_path, checkpoints)
    before = sorted(set(_bases(w.spec)["state"] + [w.epoch]))  # the compaction adds a base at the latest epoch
    floor = json.loads(wal("info", w.spec, "--json").stdout)["volume"]["oldest_epoch"]
    dry = compact_json(w.spec, *args, "--dry-run")
    rep = compact_json(w.spec, *args)
    if kept == "window":  # the newest base at or before the window's start, and every later one
        cut = max([b for b in before if b <= w.epoch - 63], default=0)
        want = [b for b in before if b >= cut]
    else:
        want = before[-kept:] if kept else before
    assert _bases(w.spec)["state"] == want
    assert rep["floor_epoch"] == (want[0] if kept else floor)
    assert rep["bases_dropped"] == len(before) - len(want)
    for k in ("epoch", "folded", "bases_kept", "bases_dropped", "floor_epoch", "segments_freed", "keep_bases",
              "keep_epochs", "reserve_bytes"):
        assert dry[k] == rep[k], k  # the dry run decides with the same function
    assert rep["schema"] == "concordia-wal/compact/1" and not rep["dry_run"]
    assert (rep["keep_bases"], rep["keep_epochs"]) == policy
    info = json.loads(wal("info", w.spec, "--json").stdout)
    assert info["retention"] == {"keep_bases": policy[0], "keep_epochs": policy[1]}  # what was stored
    assert w.restores()


def test_a_session_stores_its_window_as_the_policy(tmp_path):
    young, old = _session_log(tmp_path / "young", 40), _session_log(tmp_path / "old", 90)
    for w, epochs in ((young, 0), (old, 64)):
        info = json.loads(wal("info", w.spec, "--json").stdout)
        assert info["retention"] == {"keep_bases": 0, "keep_epochs": epochs}


def test_keep_one_frees_the_segments_below_the_new_base(tmp_path):
    w = _session_log(tmp_path, 40)
    rep = compact_json(w.spec, "--keep", "1")
    assert rep["segments_freed"] and rep["floor_epoch"] == w.epoch and rep["bases_dropped"] > 0
    again = compact_json(w.spec)  # the policy it stored applies: nothing more to do
    assert again["folded"] == [] and again["bases_dropped"] == 0
    assert (again["keep_bases"], again["keep_epochs"]) == (1, 0)


def test_an_upto_base_the_retention_drops_at_once_is_refused(tmp_path):
    w = _session_log(tmp_path, 40)
    newest = _bases(w.spec)["state"][-1]
    before = settle(w.path)
    res = compact_json(w.spec, "--keep", "1", "--upto", newest - 1, code=(2,))
    assert f"at epoch {newest - 1} would be dropped at once" in res.stderr and f"(epoch {newest})" in res.stderr
    assert sha(w.path) == before


# --------------------------------------------------------------------------- info says the policy in words

@pytest.mark.parametrize("retain,keep_bases,words,epochs", [
    (1 << 62, 0, "keeps every base and every epoch", 0),  # what earlier sessions stored for "every epoch"
    (0, 0, "keeps every base and every epoch", 0),
    (64, 0, "keeps the newest 64 epochs", 64),
    (0, 1, "keeps the newest base of each region", 0),
    (16, 2, "keeps the newest 2 bases of each region and the newest 16 epochs", 16),
])
def test_info_says_the_policy_compact_applies(tmp_path, retain, keep_bases, words, epochs):
    from concordia.wal.snapshot import Catalog, current_catalog, write_catalog

    w = _session_log(tmp_path, 40)
    with Log.open(w.spec, writable=True) as log:
        cat = current_catalog(log)
        write_catalog(log, Catalog(0, cat.entries, keep_bases, cat.floor_epoch))
        log.volume.write_superblock(retain_epochs=retain)
    text = wal("info", w.spec).stdout
    assert words in text and str(1 << 62) not in text
    d = json.loads(wal("info", w.spec, "--json").stdout)
    assert d["volume"]["retain_epochs"] == epochs and d["retention"] == {"keep_bases": keep_bases,
                                                                         "keep_epochs": epochs}
    if retain == 1 << 62:  # and compact applies it as "every epoch"
        rep = compact_json(w.spec)
        assert rep["bases_dropped"] == 0 and (rep["keep_bases"], rep["keep_epochs"]) == (0, 0)


def test_a_young_session_stores_every_epoch_as_zero(tmp_path):
    w = _session_log(tmp_path, 40)
    with Log.open(w.spec, writable=False) as log:
        assert log.volume.superblock.retain_epochs == 0 and log.volume.superblock.catalog_lsn


def _later_region(path, *, later_epochs: int = 0) -> str:
    """A log whose region "lora" was registered after epoch 2 ("kv": epochs 1
    and 2), then checkpointed `later_epochs` times (0: never)."""
    spec = f"file:{path}"
    kv, lora = np.arange(4096, dtype=np.uint32), np.full(1000, 7, np.float32)
    with Session(spec, size=16 * MiB, policy=Policy(retain=False)) as s:
        s.register("kv", kv)
        s.checkpoint()
        kv[3] = 9
        s.checkpoint()
        s.register("lora", lora)
        for t in range(later_epochs):
            lora[t] = t
            s.checkpoint()
    return spec


@pytest.mark.parametrize("later_epochs", [0, 2], ids=["never-saved", "saved-later"])
def test_compact_and_snapshot_invent_no_base_for_a_region_without_state_at_the_epoch(tmp_path, later_epochs):
    """A region registered after the epoch folded has no state there: `compact`
    and `snapshot create` give it no base (one would be zeros, and a recovery
    of the epoch would hand them back where it refuses the region), say so,
    and a recovery of the epoch still refuses it; named with --region, the
    snapshot is refused in one line, exit 1, the log untouched."""
    spec = _later_region(tmp_path / "a.log", later_epochs=later_epochs)
    before = sha(tmp_path / "a.log")
    res = wal("snapshot", "create", spec, "--epoch", 2, "--region", "lora", code=(1,))
    assert "region 'lora' has no state at epoch 2" in res.stderr
    assert sha(tmp_path / "a.log") == before
    res = wal("snapshot", "create", spec, "--epoch", 2)
    assert "snapshot kv at epoch 2" in res.stdout and "snapshot lora: no state at epoch 2" in res.stdout
    res = wal("compact", spec, "--upto", 2, "--keep", 0, "--json")
    rep = json.loads(res.stdout)
    assert rep["epoch"] == 2 and rep["absent"] == ["lora"] and "lora" not in rep["folded"] + rep["unchanged"]
    res = wal("restore", spec, "--region", "lora", "--epoch", 2, "--out", tmp_path / "l.npy", code=(1,))
    assert "region 'lora' has no state at epoch 2" in res.stderr and not (tmp_path / "l.npy").exists()
    with Session(spec, create=False) as s:
        with pytest.raises(Exception, match="region 'lora' has no state at epoch 2"):
            s.recover(2)
        if later_epochs:   # its own epochs are whole and recover as they were
            got = s.recover(2 + later_epochs)["lora"]
            want = np.full(1000, 7, np.float32)
            want[:later_epochs] = np.arange(later_epochs)
            np.testing.assert_array_equal(got, want)
    spec2 = _later_region(tmp_path / "b.log", later_epochs=later_epochs)
    res = wal("compact", spec2, "--keep", 1)   # the latest epoch: with no later save "lora" has none there
    assert ("no state at the epoch, so no base: lora" in res.stdout) == (later_epochs == 0), res.stdout


def test_a_policy_the_catalog_cannot_hold_is_refused_before_anything_is_written(tmp_path):
    """keep_bases is stored in 32 bits: 2^32 is refused in one line, the log as it was
    (it was written into the log, then failed on packing the catalog)."""
    from concordia.wal.compaction import compact
    from concordia.wal.errors import UsageError

    spec = _later_region(tmp_path / "k.log", later_epochs=1)
    before = sha(tmp_path / "k.log")
    with Log.open(spec, writable=True) as lg:
        with pytest.raises(UsageError, match=r"keep_bases must lie in \[0, 4294967295\] and keep_epochs"):
            compact(lg, keep_bases=1 << 32)
    assert sha(tmp_path / "k.log") == before


def test_a_floor_beyond_the_last_commit_is_refused_by_every_reader_not_read_as_an_empty_log(tmp_path):
    """A superblock (checksum whole) whose oldest restorable epoch lies beyond
    the last commit: every epoch read as reclaimed.  Recovery refuses, naming
    both epochs, in every reader (plan, verify, info, restore, the Session),
    rather than reporting a log with nothing committed."""
    spec = _later_region(tmp_path / "f.log", later_epochs=1)
    with Log.open(spec, writable=True) as log:
        log.volume.write_superblock(oldest_epoch=(1 << 64) - 1)
    says = f"the oldest restorable epoch the log states ({(1 << 64) - 1}) lies beyond its last commit (3)"
    for args in (["recover", spec, "--plan"], ["restore", spec, "--region", "kv", "--out", tmp_path / "kv.npy"]):
        assert says in wal(*args, code=(1,)).stderr
    for cmd in ("verify", "info"):   # (their report on stdout says why they exit 1)
        res = CliRunner().invoke(main, [cmd, spec])
        assert res.exit_code == 1 and says in res.stdout, res.output
    assert not (tmp_path / "kv.npy").exists()
    with Session(spec, create=False, readonly=True) as s:
        with pytest.raises(Exception, match=re.escape(says)):
            s.recover()


@pytest.mark.parametrize("later_epochs", [0, 3], ids=["never-saved", "saved-later"])
def test_a_region_without_a_base_still_lets_the_compaction_free_what_others_no_longer_need(tmp_path,
                                                                                       later_epochs):
    """A region with no state at the folded epoch gets no base, and so no cut
    of its own: its deltas (all after the epoch) are kept, and the others'
    older segments are still freed; every epoch kept recovers exactly."""
    from concordia.wal.compaction import compact

    spec = f"file:{tmp_path / 'f.log'}"
    kv, lora = np.arange(1 << 18, dtype=np.uint32), np.full(1000, 7, np.float32)   # kv: 1 MiB
    with Session(spec, size=64 * MiB, segment_size=1 * MiB, policy=Policy(retain=False)) as s:
        s.register("kv", kv)
        for i in range(8):
            kv[i * 1000:i * 1000 + 60000] += 1
            s.checkpoint()
        s.register("lora", lora)
        for t in range(later_epochs):
            lora[t] = t
            kv[5] += 1
            s.checkpoint()
    last = 8 + later_epochs
    with Session(spec, create=False) as s:
        want = {e: {k: np.array(v) for k, v in s.recover(e, absent="keep").items()} for e in range(8, last + 1)}
    with Log.open(spec, writable=True) as log:
        rep = compact(log, 8, keep_bases=1, upto_named=True)
    assert rep.absent == ["lora"] and rep.folded == ["kv"] and rep.segments_freed, rep
    with Session(spec, create=False) as s:
        for e, w in want.items():
            got = s.recover(e, absent="keep")
            assert all(np.array_equal(np.array(got[k]), w[k]) for k in w), e
