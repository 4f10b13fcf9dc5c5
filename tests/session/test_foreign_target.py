"""Every path that formats a log makes one check first: a target that exists
and holds something that is not a log is refused, named in one line, and left
byte for byte as it was, unless overwriting was asked for (Session's
overwrite=True, `concordia demo --force`, `concordia-wal format --force`)."""

from __future__ import annotations

import hashlib
import os

import numpy as np
import pytest
from click.testing import CliRunner

from concordia import Session
from concordia.demo import run_demo
from concordia.errors import TargetNotEmptyError
from concordia.tools.cli import main as concordia_main
from concordia.tools.wal_cli import main as wal_main
from concordia.wal import Log

TEXT = b"my notes, not a log\n" * 1024  # 20 KiB: a length a log could have


def _digest(path) -> tuple[int, str]:
    with open(path, "rb") as f:
        data = f.read()
    return len(data), hashlib.sha256(data).hexdigest()


@pytest.fixture
def foreign(tmp_path):
    p = tmp_path / "notes.txt"
    p.write_bytes(TEXT)
    return p


def test_session_refuses_a_foreign_file_and_leaves_it_unchanged(foreign):
    before = _digest(foreign)
    with pytest.raises(TargetNotEmptyError) as ei:
        Session(f"file:{foreign}")
    msg = str(ei.value)
    assert "\n" not in msg and str(foreign) in msg and "is not empty (nonzero byte at 0x0)" in msg
    assert "overwrite=True" in msg
    assert _digest(foreign) == before  # not grown to 256 MiB, not zeroed
    # create=False names it as no log, also without touching it
    with pytest.raises(Exception):
        Session(f"file:{foreign}", create=False)
    assert _digest(foreign) == before


def test_a_file_of_a_length_no_log_has_is_refused_unchanged(tmp_path):
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"x" * 4000)
    before = _digest(odd)
    for make in (lambda: Session(f"file:{odd}"), lambda: Log.create(f"file:{odd}", size=8 << 20)):
        with pytest.raises(Exception) as ei:
            make()
        assert "\n" not in str(ei.value) and str(odd) in str(ei.value)
    assert _digest(odd) == before


def test_session_formats_a_foreign_file_when_told_to(foreign):
    with Session(f"file:{foreign}", overwrite=True, size=8 << 20, segment_size=1 << 20) as s:
        s.register("r", np.arange(4096, dtype=np.uint8))
        s.checkpoint()
    assert os.path.getsize(foreign) == 8 << 20
    with Session(f"file:{foreign}", create=False) as s:  # now it is a log: opened, not refused
        assert s.epoch == 1


def test_a_log_is_created_on_an_absent_an_empty_or_an_all_zero_file(tmp_path):
    empty = tmp_path / "empty.log"
    empty.touch()
    zero = tmp_path / "zero.log"
    zero.write_bytes(bytes(1 << 20))
    with Session(f"file:{tmp_path / 'absent.log'}", size=8 << 20, segment_size=1 << 20) as s:
        assert s.epoch == 0
    with Session(f"file:{zero}", size=8 << 20, segment_size=1 << 20) as s:
        assert s.epoch == 0
    Log.create(f"file:{empty}", size=8 << 20, segment_size=1 << 20).close()
    assert os.path.getsize(empty) == 8 << 20


def test_log_create_refuses_an_existing_log_and_a_dirty_backend(tmp_path):
    path = tmp_path / "a.log"
    Log.create(f"file:{path}", size=8 << 20, segment_size=1 << 20).close()
    before = _digest(path)
    with pytest.raises(TargetNotEmptyError, match="holds a Concordia log"):
        Log.create(f"file:{path}", size=8 << 20, segment_size=1 << 20)
    assert _digest(path) == before
    Log.create(f"file:{path}", size=8 << 20, segment_size=1 << 20, overwrite=True).close()
    assert _digest(path) != before  # a new uuid


def test_demo_refuses_a_foreign_file_and_leaves_it_unchanged(foreign):
    before = _digest(foreign)
    with pytest.raises(TargetNotEmptyError, match="--force"):
        run_demo(log=f"file:{foreign}", steps=8, kill_at=3, every=2, device="cpu")
    assert _digest(foreign) == before
    res = CliRunner().invoke(concordia_main, ["demo", "--log", f"file:{foreign}", "--steps", "8",
                                              "--kill-at", "3", "--device", "cpu"])
    assert res.exit_code == 2, res.output
    line = res.output.strip()
    assert "\n" not in line and "refusing to format" in line and "--force" in line, res.output
    assert "Traceback" not in res.output
    assert _digest(foreign) == before


def test_demo_replaces_its_own_log_and_a_foreign_file_with_force(tmp_path, foreign):
    from concordia.wal.volume import check_format_target

    log = f"file:{tmp_path / 'demo.log'}"
    Log.create(log, size=8 << 20, segment_size=1 << 20).close()  # as a previous run leaves it
    check_format_target(log, allow_log=True)  # the demo's check lets its own log through
    with pytest.raises(TargetNotEmptyError):
        check_format_target(log)
    rep = run_demo(log=f"file:{foreign}", steps=8, kill_at=3, every=2, device="cpu", force=True)
    assert rep["identical"]
    with Log.open(f"file:{foreign}", writable=False) as lg:
        assert lg.last_committed_epoch >= 1


def test_format_refuses_without_force_through_the_same_check(foreign):
    before = _digest(foreign)
    res = CliRunner().invoke(wal_main, ["format", f"file:{foreign}", "--size", "8M", "--segment-size", "1M"])
    assert res.exit_code == 2
    assert "refusing to format: the target is not empty" in res.output and "--force" in res.output
    assert _digest(foreign) == before
    res = CliRunner().invoke(wal_main, ["format", f"file:{foreign}", "--size", "8M", "--segment-size", "1M",
                                        "--force"])
    assert res.exit_code == 0, res.output


def test_session_refuses_a_backend_holding_foreign_bytes():
    from concordia.devmem import MemoryBackend

    data = (TEXT * 64)[:1 << 20]
    b = MemoryBackend.from_bytes(data)
    with pytest.raises(TargetNotEmptyError, match="nonzero byte"):
        Session(b)
    assert bytes(b.view) == data
