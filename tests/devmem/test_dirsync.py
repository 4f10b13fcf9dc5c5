"""A file's name is made durable, not only its bytes: the directory is fsynced
after the log file is created and after every rename that publishes a file,
in that order.  `DirectoryFaults` records the calls and says which names a
power loss at that moment would take away (an entry no directory fsync followed)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from click.testing import CliRunner

from concordia import Session
from concordia.devmem import dirsync
from concordia.devmem.fault import DirectoryFaults
from concordia.tools.wal_cli import main as wal_main
from concordia.wal import Log


def test_the_recorder_loses_a_name_no_directory_fsync_followed(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    real_open = os.open
    with DirectoryFaults() as fs:
        os.close(os.open(a, os.O_CREAT | os.O_WRONLY, 0o600))
        assert fs.lost() == [str(a)]
        dirsync.sync_parent(a)
        assert fs.lost() == []
        os.close(os.open(b, os.O_CREAT | os.O_WRONLY, 0o600))
        os.replace(b, tmp_path / "c")
    assert fs.lost() == [str(tmp_path / "c")]
    assert os.open is real_open  # the wrappers are gone again
    assert fs.index("fsync-dir", str(tmp_path)) > fs.index("create", str(a))


def test_a_new_log_file_is_named_durably_before_its_first_byte_is_synced(tmp_path):
    path = str(tmp_path / "new.log")
    with DirectoryFaults() as fs:
        log = Log.create(f"file:{path}", size=8 << 20, segment_size=1 << 20)
        created = fs.index("create", path)
        named = fs.index("fsync-dir", str(tmp_path))
        first_sync = fs.index("persist", path)
        log.close()
    assert 0 <= created < named < first_sync, fs.calls
    assert fs.lost() == []  # a power loss now keeps the log's name


def test_a_session_on_a_new_file_leaves_no_name_to_lose(tmp_path):
    path = str(tmp_path / "s.log")
    with DirectoryFaults() as fs:
        with Session(f"file:{path}", size=8 << 20, segment_size=1 << 20) as s:
            s.register("r", np.arange(8192, dtype=np.uint8))
            s.checkpoint()
    assert fs.index("create", path) < fs.index("fsync-dir", str(tmp_path)) < fs.index("persist", path)
    assert fs.lost() == []


def test_publish_syncs_the_file_renames_then_syncs_the_directory(tmp_path):
    tmp, final = tmp_path / ".x.tmp", tmp_path / "x"
    tmp.write_bytes(b"whole")
    with DirectoryFaults() as fs:
        dirsync.publish(tmp, final)
    kinds = [c[0] for c in fs.calls]
    assert kinds.index("fsync") < kinds.index("rename") < kinds.index("fsync-dir"), fs.calls
    assert fs.calls[kinds.index("fsync")][1] == str(tmp)
    assert fs.lost() == [] and final.read_bytes() == b"whole" and not tmp.exists()


@pytest.fixture
def small_log(tmp_path):
    log = f"file:{tmp_path / 'w.log'}"
    with Session(log, size=8 << 20, segment_size=1 << 20) as s:
        s.register("r", np.arange(16384, dtype=np.uint8))
        s.checkpoint()
    return log


def test_restore_out_is_published_whole(tmp_path, small_log):
    out = tmp_path / "r.npy"
    with DirectoryFaults() as fs:
        res = CliRunner().invoke(wal_main, ["restore", small_log, "--region", "r", "--out", str(out)])
    assert res.exit_code == 0, res.output
    # the output appears whole under its name (renamed or linked from its temporary file,
    # after that file was fsynced), then its directory is fsynced
    named = [i for i, c in enumerate(fs.calls) if c[-1] == str(out) and c[0] in ("rename", "create")]
    assert len(named) == 1
    tmp = [c[1] for c in fs.calls[:named[0]] if c[0] == "fsync" and c[1] != str(out)]
    assert tmp and os.path.dirname(tmp[-1]) == str(tmp_path)
    assert any(c == ("fsync-dir", str(tmp_path)) for c in fs.calls[named[0]:])
    assert fs.lost() == []
    assert np.load(out).tobytes() == np.arange(16384, dtype=np.uint8).tobytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.npy", "w.log"]  # no temporary left


def test_a_repair_backup_is_named_durably_before_the_log_is_cut(tmp_path, small_log):
    path = small_log.split(":", 1)[1]
    with Log.open(small_log, writable=False) as lg:
        end = max(r.offset + r.length for r in lg.records())
    with open(path, "r+b") as f:  # a torn record after the last commit
        f.seek(end)
        f.write(b"\x40" + bytes(7) + b"\x01" + bytes(55))
    backup = tmp_path / "w.bak"
    with DirectoryFaults() as fs:
        res = CliRunner().invoke(wal_main, ["verify", small_log, "--repair", "--backup", str(backup), "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["repair"]["cut"] is not None
    made = max(i for i, c in enumerate(fs.calls) if c[-1] == str(backup) and c[0] in ("rename", "create"))
    named = next(i for i, c in enumerate(fs.calls) if i > made and c == ("fsync-dir", str(tmp_path)))
    cut = max(i for i, c in enumerate(fs.calls) if c == ("persist", path))
    assert 0 <= made < named < cut, fs.calls
    assert any(c[0] == "fsync" for c in fs.calls[:made])  # the copy's bytes were synced before it got the name
    assert fs.lost() == []


def test_a_benchmark_out_file_is_published_whole(tmp_path):
    from concordia.tools.common import report

    out = tmp_path / "b.json"
    with DirectoryFaults() as fs:
        report({"a": 1}, as_json=True, out=str(out), table=str)
    assert json.loads(out.read_text()) == {"a": 1}
    named = max(i for i, c in enumerate(fs.calls) if c[-1] == str(out) and c[0] in ("rename", "create"))
    assert any(c == ("fsync-dir", str(tmp_path)) for c in fs.calls[named:]) and fs.lost() == []
    assert [p.name for p in tmp_path.iterdir()] == ["b.json"]
