"""No surprises on damaged logs (issue 29): what the crash campaign found at
the edges of the commands that read a log, each held by a test that makes its
own data.

* `recover --plan --json` prints the documented object in every outcome: a
  log with nothing committed and a refusal included, every key there.
* `snapshot list` on a log nothing can be read from is exit 1 and one line,
  never an empty list and 0; its `--json` object is the one `--help` and
  docs/cli.md describe.
* `dump --follow` shows a base slice that retention wrote after the last
  commit, the first record of a new segment, although no commit follows it.
* `Session(name, create=False)` creates nothing: a name that holds no log is
  refused in one line naming it; and a file called `memory` is a file, never
  formatted as the memory tier.

The recovery decision itself (every consumer, every mode, Session.recover
included) is held by tests/wal/test_recovery_conformance.py.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from click.testing import CliRunner

from concordia.tools.wal_cli import main
from concordia.wal import Log
from concordia.wal import format as F

from .conftest import zero
from .test_json_schemas import check, documented

MiB = 1 << 20
PAGE = 4096


def run(*args):
    res = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=True)
    assert res.exception is None or isinstance(res.exception, SystemExit), (args, res.output)
    assert "Traceback" not in res.output
    return res


# --------------------------------------------------------------------------- recover --plan --json


def _every_plan_key(doc: dict) -> None:
    """Every key of the plan schema is there (not only those check() can reach
    through a region): a refusal and an empty log plan no region."""
    check("plan", doc)
    top = {k.split(".")[0].removesuffix("[]") for k in documented("plan")}
    assert top <= set(doc), top - set(doc)


def test_plan_json_of_a_log_with_nothing_committed_is_the_documented_object(tmp_path):
    log = tmp_path / "empty.log"
    Log.create(f"file:{log}", size=8 * MiB, segment_size=MiB).close()
    res = run("recover", log, "--plan", "--json")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    _every_plan_key(doc)
    assert doc["epoch"] is None and doc["regions"] == {} and doc["error"] is None and doc["exit_code"] == 0
    text = run("recover", log, "--plan")
    assert text.exit_code == 0 and "nothing committed" in text.stdout


@pytest.mark.parametrize("mode", ["tolerate-tail", "absolute", "point-in-time", "skip-corrupt"])
def test_plan_json_of_a_refusal_keeps_every_documented_key(log_path, mode):
    # the first segment's header zeroed: the region descriptors it holds are unreadable,
    # so no mode restores anything (R-D6)
    lg = Log.open(f"file:{log_path}", writable=False)
    first = lg.volume.live_segments()[0]
    lg.close()
    zero(log_path, first.offset, 256)  # the first live segment's header
    res = run("recover", log_path, "--plan", "--json", "--mode", mode)
    assert res.exit_code == 1, res.output
    doc = json.loads(res.stdout)
    _every_plan_key(doc)
    assert doc["epoch"] is None and doc["error"] and doc["exit_code"] == 1
    assert doc["target"] == "latest" and doc["mode"] == mode.replace("-", "_")
    assert f"segment {first.index} @ 0x{first.offset:x}" in doc["error"]
    assert res.stderr == ""  # the refusal is the object, not a line beside it


# --------------------------------------------------------------------------- snapshot list


@pytest.mark.parametrize("damage", ["segments zeroed", "segment header", "truncated"])
def test_snapshot_list_of_a_log_nothing_can_be_read_from_is_one_line_and_exit_1(log_path, damage):
    lg = Log.open(f"file:{log_path}", writable=False)
    segs = lg.volume.live_segments()
    lg.close()
    if damage == "segments zeroed":
        zero(log_path, segs[0].offset, sum(s.nbytes for s in segs))
    elif damage == "segment header":
        zero(log_path, segs[0].offset + 64, 64)
    else:
        os.truncate(log_path, segs[0].offset + 1000)  # inside the first segment, at no multiple of a page
    res = run("snapshot", "list", log_path)
    assert res.exit_code == 1, (damage, res.output)
    lines = res.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    assert f"segment {segs[0].index} @ 0x" in lines[0] or "truncated" in lines[0], lines[0]
    doc = json.loads(run("snapshot", "list", log_path, "--json").stdout)
    assert doc["exit_code"] == 1 and doc["error"] == lines[0].removeprefix("error: ")


def test_snapshot_list_help_docs_and_json_agree(log_path):
    helptext = run("snapshot", "list", "--help").stdout
    assert "JSON list" not in helptext and "JSON object" in " ".join(helptext.split())
    # a log with bases: a compaction of the test log
    assert run("compact", log_path, "--keep", "1").exit_code == 0
    res = run("snapshot", "list", log_path, "--json")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    check("snapshots", doc)
    keys = documented("snapshots")
    assert {k for k in keys if "." not in k} == set(doc)
    assert doc["snapshots"] and set(doc["snapshots"][0]) == {k.split(".", 1)[1] for k in keys
                                                            if k.startswith("snapshots[].")}
    assert doc["schema"] == "concordia-wal/snapshots/1" and doc["error"] is None


# --------------------------------------------------------------------------- dump --follow


def _base_batch_in_a_new_segment(path: str) -> int:
    """A log whose last record is a BASE batch (as retention writes one after
    a commit) that rolled into a new segment, with no commit after it (the
    writer stopped there).  Returns its LSN."""
    from concordia.wal.snapshot import _append_base_batch

    log = Log.create(f"file:{path}", size=8 * MiB, segment_size=MiB)
    log.define_region("r", np.uint8, (64 * PAGE,), PAGE, "opaque")
    e = 0
    while log.appender.pos + 2 * F.page_batch_length(8, PAGE) < log.appender.seg.offset + MiB:
        e += 1
        log.appender.append_page_batch(e, 0, np.arange(8, dtype=np.uint32), np.full((8, PAGE), e, np.uint8))
        log.appender.commit(e, digests={0: 0})
    seg = log.appender.seg.index
    pages = np.full((16, PAGE), 7, np.uint8)
    lsn, _ = _append_base_batch(log, e, log.regions["r"], 0, 16, lambda lo, hi: pages[lo:hi])
    assert log.appender.seg.index != seg  # it did roll over
    log.close()
    return lsn


def test_follow_shows_a_base_slice_after_the_last_commit_in_a_new_segment(tmp_path, monkeypatch):
    from concordia.tools import wal_cmd_inspect

    path = str(tmp_path / "f.log")
    lsn = _base_batch_in_a_new_segment(path)
    polls = []

    def stop_after_three_polls(_interval):  # Ctrl-C after the third poll: no clock involved
        polls.append(1)
        if len(polls) >= 3:
            raise KeyboardInterrupt

    monkeypatch.setattr(wal_cmd_inspect.time, "sleep", stop_after_three_polls)
    res = run("dump", path, "--follow", "--json")
    assert res.exit_code == 0, res.output
    shown = [json.loads(line)["lsn"] for line in res.stdout.splitlines() if line.strip()]
    everything = [r["lsn"] for r in json.loads(run("dump", path, "--json").stdout)["records"]]
    assert shown == everything and shown[-1] == lsn


# --------------------------------------------------------------------------- Session(create=False)


# (a missing file: or shm: name was refused already; what created a log was a
# name the session took for the memory tier, and overwrite=True beside create=False)
@pytest.mark.parametrize("name, kw", [
    ("memory", {}),                 # a file called memory in the working directory, a typo of memory:
    ("pinned", {"size": 8 * MiB}),
    ("memory:", {}),                # the memory tier holds no log before this process makes one
    ("memory:", {"readonly": True}),
    ("file:{dir}/absent.log", {"overwrite": True}),
    ("shm:concordia-test-absent-{pid}", {"overwrite": True}),
], ids=["memory", "pinned", "memory-tier", "memory-tier-readonly", "file-overwrite", "shm-overwrite"])
def test_session_without_create_creates_nothing(tmp_path, monkeypatch, name, kw):
    from concordia.errors import ConcordiaError
    from concordia.session import Session

    monkeypatch.chdir(tmp_path)
    name = name.format(dir=tmp_path, pid=os.getpid())
    shm = f"/dev/shm/concordia-test-absent-{os.getpid()}"
    with pytest.raises(ConcordiaError) as ei:
        s = Session(name, create=False, **kw)
        s.close()  # a session that opened: the test fails on the raises above
    msg = str(ei.value)
    assert "\n" not in msg and name.split(":", 1)[-1 if name != "memory:" else 0] in msg, msg
    assert type(ei.value).__name__ in ("PathNotFoundError", "NotALogError", "SessionError"), type(ei.value)
    assert os.listdir(tmp_path) == [] and not os.path.exists(shm)


def test_a_file_called_memory_is_a_file_and_is_never_formatted_unasked(tmp_path, monkeypatch):
    from concordia.errors import TargetNotEmptyError
    from concordia.session import Session

    monkeypatch.chdir(tmp_path)
    mine = b"notes of mine " * 4096
    (tmp_path / "memory").write_bytes(mine[:8 * PAGE])
    with pytest.raises(TargetNotEmptyError) as ei:
        Session("memory")
    assert str(tmp_path / "memory") in str(ei.value)
    assert (tmp_path / "memory").read_bytes() == mine[:8 * PAGE]
