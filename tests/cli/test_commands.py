"""Each subcommand on logs made by the engine, through click's runner and
through real processes: what it prints, its exit code, and that what it
restores is the state the engine committed."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from click.testing import CliRunner

from concordia.tools.wal_cli import main

from .conftest import EPOCHS, WAL, flip, sha


def cli(*args, code=0):
    res = CliRunner().invoke(main, [str(a) for a in args])
    assert res.exception is None or isinstance(res.exception, SystemExit), res.exception
    assert res.exit_code == code, (args, res.exit_code, res.output)
    return res


def test_format_refuses_then_forces(workdir):
    target = str(workdir / "new.log")
    r = cli("format", target, "--size", "8M", "--segment-size", "1M")
    assert "formatted file:" in r.output and "7 segments of 1 MiB" in r.output
    again = cli("format", target, "--size", "8M", code=2)
    assert "refusing to format: the target holds a Concordia log" in again.stderr
    junk = workdir / "junk.bin"
    junk.write_bytes(bytes(4096 * 3) + b"\x01" + bytes(4095))
    r = cli("format", str(junk), "--size", "8M", code=2)
    assert "is not empty (nonzero byte at 0x3000)" in r.stderr
    cli("format", str(junk), "--size", "8M", "--segment-size", "2M", "--force")
    assert json.loads(cli("info", str(junk), "--json").output)["volume"]["segment_bytes"] == 2 << 20
    r = cli("format", target, "--size", "lots", code=2)
    assert "not a size" in r.output


def test_info_text_and_json(log_path):
    text = cli("info", log_path, "--stats", "-x").output
    for want in ("persist path  msync", "A @ 0x000000", "[OK]", "kv", "adapter", f"{EPOCHS} committed (1..{EPOCHS})",
                 "records by type", "status        OK", "00000000: 434e 4352 4456 4f4c"):
        assert want in text, want
    d = json.loads(cli("info", log_path, "--json").output)
    assert d["ok"] and d["epochs"]["last"] == EPOCHS and d["target"]["kind"] == "file"
    assert [r["name"] for r in d["regions"]] == ["kv", "adapter"]
    assert sum(s["state"] == "live" for s in d["segments"]) == 2
    assert all(s["ok"] for s in d["slots"]) and sum(s["in_force"] for s in d["slots"]) == 1


def test_info_marks_a_bad_segment_header(log_path):
    d = json.loads(cli("info", log_path, "--json").output)
    seg = [s for s in d["segments"] if s["state"] == "live"][1]
    flip(log_path, seg["offset"] + 80)
    d = json.loads(cli("info", log_path, "--json", code=1).output)
    bad = [s for s in d["segments"] if s["index"] == seg["index"]][0]
    assert bad["header_ok"] is False and "CRC mismatch" in bad["problem"]
    assert "[BAD]" in cli("info", log_path, code=1).output


def test_dump_filters_and_lines(log_path):
    lines = cli("dump", log_path).output.splitlines()
    assert len(lines) == 2 + 3 * EPOCHS
    assert all(ln.startswith("lsn: 0x") and "crc: OK" in ln for ln in lines)
    commits = cli("dump", log_path, "--type", "commit").output.splitlines()
    assert len(commits) == EPOCHS and all("type: commit" in ln for ln in commits)
    kv = json.loads(cli("dump", log_path, "--region", "kv", "--json").output)["records"]
    assert {r["region"] for r in kv} == {"kv"} and len(kv) == EPOCHS + 1
    e3 = json.loads(cli("dump", log_path, "--epoch", "3", "--json").output)["records"]
    assert [r["type"] for r in e3] == ["page_batch", "page_batch", "commit"]
    start = e3[0]["lsn"]
    r = json.loads(cli("dump", log_path, "--start", hex(start), "--end", str(e3[2]["lsn"]), "--json").output)
    assert [x["lsn"] for x in r["records"]] == [e3[0]["lsn"], e3[1]["lsn"]]
    assert len(cli("dump", log_path, "--limit", "4").output.splitlines()) == 4
    st = json.loads(cli("dump", log_path, "--stats", "--json").output)["stats"]
    assert st["by_type"]["commit"]["records"] == EPOCHS and st["total"]["bad"] == 0
    cli("dump", log_path, "--type", "bogus", code=2)


def test_dump_marks_damage(log_path):
    recs = json.loads(cli("dump", log_path, "--json").output)["records"]
    victim = [r for r in recs if r["type"] == "page_batch"][5]
    flip(log_path, victim["offset"] + victim["length"] - 1)
    out = json.loads(cli("dump", log_path, "--json", code=1).output)["records"]
    bad = [r for r in out if r["crc"] == "BAD"]
    assert len(bad) == 1 and bad[0]["offset"] == victim["offset"] and bad[0]["type"] == "page_batch"
    assert "page CRC mismatch" in bad[0]["problem"] and bad[0]["tail"] is False


@pytest.mark.parametrize("epoch", [1, 7, EPOCHS])
def test_restore_matches_the_engine(workdir, log_path, history, epoch):
    for region in ("kv", "adapter"):
        out = workdir / f"{region}-{epoch}.npy"
        r = cli("restore", log_path, "--region", region, "--epoch", epoch, "--out", out)
        assert f"restored {region} at epoch {epoch}" in r.output
        np.testing.assert_array_equal(np.load(out), history[epoch][region])
    cli("restore", log_path, "--region", "kv", "--out", workdir / f"kv-{epoch}.npy", code=2)
    cli("restore", log_path, "--region", "nope", "--out", workdir / "x.npy", code=2)


def test_recover_plan(log_path):
    before = sha(log_path)
    d = json.loads(cli("recover", log_path, "--plan", "--json").output)
    assert d["epoch"] == EPOCHS and d["regions"]["kv"]["pages"] == 64 and d["dropped"] == []
    assert d["bytes_to_read"] <= d["naive_bytes"]
    d5 = json.loads(cli("recover", log_path, "--plan", "--epoch", 5, "--json").output)
    assert d5["epoch"] == 5
    assert "plan     file:" in cli("recover", log_path, "--plan", "--sources").output
    cli("recover", log_path, code=2)
    cli("recover", log_path, "--plan", "--epoch", EPOCHS + 5, code=2)
    assert sha(log_path) == before


def test_recover_plan_falls_back_point_in_time(log_path):
    recs = json.loads(cli("dump", log_path, "--json").output)["records"]
    victim = [r for r in recs if r["type"] == "page_batch" and r["epoch"] == 10][0]
    flip(log_path, victim["offset"] + victim["length"] - 1)
    r = cli("recover", log_path, "--plan", code=1)
    assert f"segment {victim['segment']} @ 0x{victim['offset']:x}" in r.stderr
    d = json.loads(cli("recover", log_path, "--plan", "--mode", "point-in-time", "--json", code=1).output)
    assert d["epoch"] == 9 and d["dropped"][0]["offset"] == victim["offset"]


def test_snapshot_and_compact(workdir, log_path, history):
    assert "no base snapshots" in cli("snapshot", "list", log_path).output
    dry = cli("compact", log_path, "--keep", "1", "--dry-run")
    assert "would fold epoch" in dry.output
    before = sha(log_path)
    cli("compact", log_path, "--keep", "1", "--dry-run", "--json")
    assert sha(log_path) == before
    r = cli("snapshot", "create", log_path, "--region", "kv", "--epoch", 8)
    assert "snapshot kv at epoch 8: 64 pages" in r.output
    snaps = json.loads(cli("snapshot", "list", log_path, "--json").output)["snapshots"]
    assert [(s["region"], s["epoch"]) for s in snaps] == [("kv", 8)]
    out = workdir / "kv8.npy"
    cli("restore", log_path, "--region", "kv", "--epoch", 8, "--out", out)
    np.testing.assert_array_equal(np.load(out), history[8]["kv"])
    cli("snapshot", "create", log_path, "--region", "nope", code=2)


def test_compact(workdir, log_path, history):
    r = cli("compact", log_path, "--keep", "1", "--json")
    rep = json.loads(r.output)
    assert rep["epoch"] == EPOCHS and sorted(rep["folded"]) == ["adapter", "kv"] and not rep["dry_run"]
    snaps = json.loads(cli("snapshot", "list", log_path, "--json").output)["snapshots"]
    assert {(s["region"], s["epoch"]) for s in snaps} == {("kv", EPOCHS), ("adapter", EPOCHS)}
    out = workdir / "kv.npy"
    cli("restore", log_path, "--region", "kv", "--out", out)
    np.testing.assert_array_equal(np.load(out), history[EPOCHS]["kv"])


def test_subprocess_round(log_path, workdir):
    """The installed entry point, as a shell runs it."""
    r = subprocess.run([WAL, "verify", log_path, "--json"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["ok"] is True
    r = subprocess.run([WAL, "dump", log_path], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and len(r.stdout.splitlines()) == 2 + 3 * EPOCHS
    r = subprocess.run([WAL, "restore", log_path, "--region", "nope", "--out", "x.npy"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    # a reader that leaves early is not an error
    p = subprocess.run(f"'{WAL}' dump '{log_path}' | head -1", shell=True, capture_output=True, text=True,
                       timeout=60)
    assert p.stdout.startswith("lsn: 0x") and "Traceback" not in p.stderr


WRITER = textwrap.dedent("""
    import sys, time
    import numpy as np
    from concordia.wal import Log
    log = Log.open("file:" + sys.argv[1], writable=True)
    rid = log.regions["kv"].id
    first = log.last_committed_epoch + 1
    for e in range(first, first + int(sys.argv[2])):
        log.appender.append_page_batch(e, rid, np.array([e % 64], np.uint32), np.full((1, 4096), e % 251, np.uint8))
        log.appender.commit(e)
        time.sleep(0.05)
    log.close()
""")


def test_dump_follow_tails_a_live_writer(log_path):
    follow = subprocess.Popen([WAL, "dump", log_path, "--follow", "--type", "commit", "--json", "--interval", "0.05"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        seen = []
        deadline = time.monotonic() + 300
        writer = None
        while time.monotonic() < deadline:
            line = follow.stdout.readline()
            if not line:
                break
            seen.append(json.loads(line)["epoch"])
            if seen[-1] == EPOCHS and writer is None:
                writer = subprocess.Popen([sys.executable, "-c", WRITER, log_path, "6"])
            if seen[-1] == EPOCHS + 6:
                break
        assert seen == list(range(1, EPOCHS + 7)), seen
        assert writer.wait(timeout=300) == 0
    finally:
        follow.send_signal(signal.SIGINT)
        try:
            code = follow.wait(timeout=60)
        except subprocess.TimeoutExpired:
            follow.kill()
            raise
    assert code == 0, follow.stderr.read()
