"""Damaged logs, table-driven: a bit flip in every structure, truncations,
zeroed ranges, random bytes, an empty file, a directory, a missing path and
a file nobody may read.  Every read-only subcommand must end with the
documented exit code, at most one line on stderr and never a traceback,
name the segment and offset where the damage is, and leave the input
byte-for-byte unchanged."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile

import pytest
from click.testing import CliRunner

from concordia.tools.wal_cli import main
from concordia.wal import Log

from .conftest import WAL, flip, sha, zero


def layout(path: str) -> dict:
    """Offsets of the structures of a clean log, found through the engine."""
    log = Log.open(f"file:{path}", writable=False)
    try:
        recs = list(log.records())
        vol = log.volume
        batches = [r for r in recs if r.kind == 0x01]
        commits = [r for r in recs if r.kind == 0x03]
        seg1 = [s for s in vol.live_segments() if s.seq == 2][0]
        mid = batches[len(batches) // 2 - 2]
        return {
            "slot_a": 0, "slot_b": vol.superblock.slot_bytes,
            "seg1_header": seg1.offset, "seg1_index": seg1.index,
            "batch": (mid.segment, mid.offset),
            "payload": (mid.segment, mid.offset, mid.offset + mid.length - 100),
            "commit": (commits[3].segment, commits[3].offset),
            "last_commit": (commits[-1].segment, commits[-1].offset),
            "seg1_end": seg1.offset + seg1.nbytes,
        }
    finally:
        log.close()


def _cases():
    """(id, damage(path, lay), expected verify exit code, expected 'segment N @ 0xOFF' or None)."""
    return [
        ("slot-A-bitflip", lambda p, l: flip(p, l["slot_a"] + 64), 1, "slot A"),
        ("slot-B-bitflip", lambda p, l: flip(p, l["slot_b"] + 100, 3), 1, "slot B"),
        ("both-slots", lambda p, l: (flip(p, l["slot_a"] + 64), flip(p, l["slot_b"] + 64)), 1, "superblock"),
        ("segment-header", lambda p, l: flip(p, l["seg1_header"] + 70), 1,
         lambda l: f"segment {l['seg1_index']} @ 0x{l['seg1_header']:x}"),
        ("record-header", lambda p, l: flip(p, l["batch"][1] + 24), 1,
         lambda l: f"segment {l['batch'][0]} @ 0x{l['batch'][1]:x}"),
        ("page-payload", lambda p, l: flip(p, l["payload"][2], 5), 1,
         lambda l: f"segment {l['payload'][0]} @ 0x{l['payload'][1]:x}"),
        ("commit-record", lambda p, l: flip(p, l["commit"][1] + 64 + 3), 1,
         lambda l: f"segment {l['commit'][0]} @ 0x{l['commit'][1]:x}"),
        ("zeroed-range", lambda p, l: zero(p, l["batch"][1], 4096), 1,
         lambda l: f"segment {l['batch'][0]} @ 0x{l['batch'][1]:x}"),
        ("truncated-in-segment", lambda p, l: os.truncate(p, l["seg1_header"] + 0x20000), 1,
         lambda l: f"segment {l['seg1_index']} @ 0x"),
        ("truncated-to-slot", lambda p, l: os.truncate(p, 4096), 1, None),
        # every live segment whole, the free ones cut off: the log reads, nothing more can be written
        ("truncated-after-segments", lambda p, l: os.truncate(p, l["seg1_end"]), 1, "truncated"),
        # cut at a length that is no multiple of a page: read as truncated all the same (V-B8)
        ("truncated-unaligned", lambda p, l: os.truncate(p, 5000), 1, "truncated"),
    ]


CASES = _cases()
READ_ONLY = [["info", "{log}"], ["dump", "{log}"], ["verify", "{log}", "--quiet"], ["recover", "{log}", "--plan"],
             ["info", "{log}", "--json"], ["verify", "{log}", "--json"], ["snapshot", "list", "{log}"],
             ["dump", "{log}", "--stats", "--json"]]


def argv(template, log):
    return [a.replace("{log}", log) for a in template]


def run(args):
    res = CliRunner().invoke(main, args, catch_exceptions=True)
    assert res.exception is None or isinstance(res.exception, SystemExit), \
        f"{args}: escaped {type(res.exception).__name__}: {res.exception}"
    assert "Traceback" not in res.output
    assert len(res.stderr.splitlines()) <= 1, f"{args}: stderr {res.stderr!r}"
    return res


@pytest.mark.parametrize("name,damage,code,where", CASES, ids=[c[0] for c in CASES])
def test_damaged_log(log_path, name, damage, code, where):
    lay = layout(log_path)
    damage(log_path, lay)
    before = sha(log_path)
    # a truncated end is a torn tail by FORMAT.md §5.5: only absolute mode
    # calls it a problem, so the table checks the truncations in that mode
    mode = ["--mode", "absolute"] if name.startswith("truncated") and name != "truncated-after-segments" else []
    res = run(["verify", "--quiet", log_path] + mode)
    assert res.exit_code == code, (name, res.output)
    text = res.output
    if where is not None:
        want = where(lay) if callable(where) else where
        first = text.splitlines()[0]
        assert want in first, (name, first)
    for args in READ_ONLY:
        r = run(argv(args, log_path))
        assert r.exit_code in (0, 1, 2), (name, args, r.exit_code)
        if code == 2:
            assert r.exit_code == 2, (name, args, r.output)
        if r.exit_code and r.stderr:
            assert r.stderr.startswith("error: ")
    assert sha(log_path) == before, f"{name}: a read-only command changed the log"


def test_verify_reports_every_problem(log_path):
    """Three independent damages: all three are listed, in LSN order."""
    lay = layout(log_path)
    log = Log.open(f"file:{log_path}", writable=False)
    pbs = [r for r in log.records() if r.kind == 0x01]
    log.close()
    targets = [pbs[2], pbs[8], pbs[14]]
    for r in targets:
        flip(log_path, r.offset + r.length - 10)
    res = run(["verify", "--quiet", log_path])
    assert res.exit_code == 1
    lines = res.output.splitlines()
    for r in targets:
        assert any(f"segment {r.segment} @ 0x{r.offset:x}: page CRC mismatch" in ln for ln in lines), lines
    assert lay["slot_a"] == 0


@pytest.mark.parametrize("kind", ["random", "empty", "directory", "missing", "unformatted"])
def test_not_a_log(tmp_path, kind):
    p = tmp_path / "x.log"
    if kind == "random":
        p.write_bytes(os.urandom(1 << 20))
    elif kind == "empty":
        p.write_bytes(b"")
    elif kind == "directory":
        p.mkdir()
    elif kind == "unformatted":
        p.write_bytes(bytes(1 << 20))
    before = sha(str(p)) if p.is_file() else None
    for args in READ_ONLY:
        r = run(argv(args, str(p)))
        want = 1 if kind in ("random", "unformatted") else 2
        assert r.exit_code == want, (kind, args, r.output)
        assert r.stderr.startswith("error: ") and len(r.stderr.splitlines()) == 1
        if kind in ("random", "unformatted"):
            assert "not a Concordia log (no superblock magic at offset 0)" in r.stderr
    if before is not None:
        assert sha(str(p)) == before


def test_random_bytes_subprocess(tmp_path):
    """The same through a real process: exit status and stderr as a shell sees them."""
    p = tmp_path / "noise.bin"
    p.write_bytes(os.urandom(1 << 20))
    r = subprocess.run([WAL, "info", str(p)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    assert r.stderr.strip() == f"error: file:{p}: not a Concordia log (no superblock magic at offset 0)"
    assert r.stdout == ""


def as_nobody(args) -> tuple[int, str, str]:
    """Run `concordia-wal ARGS` in a forked child that dropped to uid/gid nobody
    (the same interpreter: the project's Python lives where nobody cannot go).
    Returns (exit status, stdout, stderr)."""
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: never returns into pytest
        code = 70
        try:
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            os.dup2(out_w, 1)
            os.dup2(err_w, 2)
            import sys

            sys.stdout = os.fdopen(1, "w", closefd=False)
            sys.stderr = os.fdopen(2, "w", closefd=False)
            try:
                main(list(args), prog_name="concordia-wal")
                code = 0
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else 1
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)
    os.close(out_w)
    os.close(err_w)
    with os.fdopen(out_r) as fo, os.fdopen(err_r) as fe:
        out, err = fo.read(), fe.read()
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), out, err


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to switch to the user nobody")
def test_no_permission_as_nobody(log_path):
    d = tempfile.mkdtemp(prefix="concordia-cli-perm-")
    try:
        os.chmod(d, 0o755)  # nobody may enter the directory, not read the file
        p = os.path.join(d, "demo.log")
        shutil.copyfile(log_path, p)
        os.chmod(p, 0o600)
        before = sha(p)
        for args in (["info", p], ["verify", p], ["dump", p, "--limit", "1"], ["recover", p, "--plan"]):
            code, out, err = as_nobody(args)
            assert code == 2, (args, out, err)
            assert len(err.splitlines()) == 1 and "Permission denied" in err, err
            assert "Traceback" not in err
        assert sha(p) == before
    finally:
        shutil.rmtree(d)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to switch to the user nobody")
def test_an_output_folder_without_permission_is_named_as_the_outputs(log_path):
    d = tempfile.mkdtemp(prefix="concordia-cli-perm-")
    try:
        os.chmod(d, 0o755)
        p = os.path.join(d, "demo.log")
        shutil.copyfile(log_path, p)
        os.chmod(p, 0o644)               # nobody may read the log
        out = os.path.join(d, "ro")
        os.mkdir(out, 0o555)              # but not write in the output's folder
        code, _, err = as_nobody(["restore", p, "--region", "kv", "--out", os.path.join(out, "kv.npy")])
        assert code == 2 and len(err.splitlines()) == 1, err
        assert "cannot create the output: Permission denied (write the output where you may" in err, err
        assert "log's owner" not in err and os.listdir(out) == []
    finally:
        shutil.rmtree(d)


def test_repair_cuts_only_a_torn_tail(log_path, tmp_path):
    lay = layout(log_path)
    seg, off = lay["last_commit"]
    flip(log_path, off + 64 + 2)  # the last commit's body: its epoch is now a torn tail
    original = sha(log_path)
    r = run(["verify", log_path, "--mode", "absolute", "--quiet"])
    assert r.exit_code == 1 and f"segment {seg} @ 0x{off:x}" in r.output
    assert run(["verify", log_path]).exit_code == 0  # tolerated by default
    assert sha(log_path) == original
    backup = str(tmp_path / "before-repair.bak")
    r = run(["verify", log_path, "--repair", "--backup", backup])
    assert r.exit_code == 0, r.output
    assert f"cut the torn tail at segment {seg} @ 0x{off:x}" in r.output
    assert sha(backup) == original
    assert sha(log_path) != original
    after = run(["verify", log_path, "--mode", "absolute", "--json"])
    assert after.exit_code == 0, after.output
    # the epochs committed before the cut are all still there
    log = Log.open(f"file:{log_path}", writable=False)
    assert log.last_committed_epoch == 15
    log.close()


def test_repair_refuses_corruption(log_path, tmp_path):
    lay = layout(log_path)
    flip(log_path, lay["payload"][2])
    before = sha(log_path)
    backup = str(tmp_path / "never.bak")
    r = run(["verify", log_path, "--repair", "--backup", backup])
    assert r.exit_code == 1
    assert "nothing cut: nothing to cut: no torn tail" in r.output
    assert not os.path.exists(backup)
    assert sha(log_path) == before


def test_dump_from_a_start_lsn_equals_the_filtered_full_dump(log_path):
    # dump reads page payloads only from --start on (a header walk gives names
    # and the last commit); what it prints must be the full dump filtered, the
    # torn-tail call included, on a log with a damaged payload in the middle and
    # a torn record after the last commit
    import json

    import numpy as np

    lay = layout(log_path)
    # a record after the last commit, then torn (a bit flip in its header), and
    # a damaged page payload in the middle of the log
    log = Log.open(f"file:{log_path}", writable=True)
    reg = next(iter(log.regions.values()))
    lsn = log.appender.append_page_batch(log.last_committed_epoch + 1, reg.id, [0],
                                         np.ones((1, reg.page_bytes), np.uint8))
    log.close()
    log = Log.open(f"file:{log_path}", writable=False)
    rec = [r for r in log.records(committed_only=False) if r.lsn == lsn][0]
    log.close()
    flip(log_path, rec.offset + 24)
    flip(log_path, lay["payload"][2], 5)
    full = CliRunner().invoke(main, ["dump", log_path, "--json"])
    recs = json.loads(full.output)["records"]
    damaged = [r for r in recs if r["crc"] == "BAD"]
    assert any(not r["tail"] for r in damaged) and any(r["tail"] for r in damaged)
    lsns = [r["lsn"] for r in recs]
    for start in (lsns[1], damaged[0]["lsn"], damaged[0]["lsn"] + 1, lsns[len(lsns) // 2], lsns[-1], lsns[-1] + 1):
        for extra in ([], ["--end", str(lsns[-2])], ["--limit", "3"], ["--type", "damaged"]):
            got = CliRunner().invoke(main, ["dump", log_path, "--json", "--start", str(start), *extra])
            want = [r for r in recs if r["lsn"] >= start]
            if "--end" in extra:
                want = [r for r in want if r["lsn"] < lsns[-2]]
            if "--type" in extra:
                want = [r for r in want if r["crc"] == "BAD"]
            if "--limit" in extra:
                want = want[:3]
            assert json.loads(got.output)["records"] == want, (start, extra)
            bad = any(r["crc"] == "BAD" and not r["tail"] for r in want)
            assert got.exit_code == (1 if bad else 0), (start, extra, got.exit_code)
