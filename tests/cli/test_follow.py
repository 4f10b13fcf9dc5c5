"""`concordia-wal dump --follow` beside a live writer in another process that
rolls over every few epochs: the follower prints every record, commits
included, and everything `dump` prints afterwards is among what it printed.

The file tier's log lives on tmpfs here (the file tier's code: pwritev,
one-sync commits, prepared segment headers; not the disk's speed), and the
writer reclaims segments the follower has passed, so 10,000 epochs (over a
thousand roll overs) fit a 32 MiB log."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from concordia.wal import Log

from .conftest import WAL

ROOT = pathlib.Path(__file__).resolve().parents[2]
EPOCHS = 10_000


def _records(path) -> list:
    with open(path) as f:
        return [json.loads(line) for line in f if line.endswith("\n")]


@pytest.mark.timeout(900)   # a writer stuck before it opens the log ends the test, not the run
@pytest.mark.parametrize("tier", ["file", "shm"])
def test_follow_prints_every_record_across_roll_overs(tier, tmp_path, request):
    name = f"concordia-test-follow-{os.getpid()}-{time.time_ns()}"
    log = f"shm:{name}" if tier == "shm" else f"file:/dev/shm/{name}.log"
    request.addfinalizer(lambda: [os.unlink(p) for p in (f"/dev/shm/{name}", f"/dev/shm/{name}.log")
                                  if os.path.exists(p)])
    with Log.create(log, size=32 << 20, segment_size=1 << 20) as lg:
        lg.define_region("r", np.uint8, (64 * 4096,), 4096, "opaque")
    out, ready = tmp_path / "follow.jsonl", tmp_path / "writer-open"
    out.touch()
    # the follower starts once the writer has the log open: that open cuts the log and writes
    # its region descriptor again at the same LSN, which a follower already past it would show twice
    writer = subprocess.Popen([sys.executable, "-m", "tests.cli.follow_writer", log, str(EPOCHS), str(out), str(ready)],
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    while not ready.exists() and writer.poll() is None:   # no clock: a loaded machine may be slow to start it
        time.sleep(0.01)
    assert ready.exists(), f"the writer ended before it opened the log: {writer.stderr.read()}"
    # the follower's notes go to a file: a pipe nobody reads while the writer runs would, once
    # full, stop the follower, and with it the writer, which waits for the follower's progress
    err_path = tmp_path / "follow.err"
    with open(out, "w") as f, open(err_path, "w") as err:
        follow = subprocess.Popen([WAL, "dump", log, "--follow", "--json", "--interval", "0.01"],
                                  stdout=f, stderr=err, text=True)
    try:
        # no limit on the whole run (a loaded machine may be slow), only on going a long while
        # with no record printed, and the follower must live as long as the writer
        seen, since = -1, time.monotonic()
        while writer.poll() is None:
            assert follow.poll() is None, f"the follower ended ({follow.returncode}): {err_path.read_text()[-2000:]}"
            size = out.stat().st_size
            if size != seen:
                seen, since = size, time.monotonic()
            elif time.monotonic() - since > 300:
                writer.kill()
                raise AssertionError(f"no record printed for 300 s: {err_path.read_text()[-2000:]}")
            time.sleep(0.05)
        w_out, w_err = writer.communicate()
        assert writer.returncode == 0, w_err
        counts = json.loads(w_out)
        assert counts["segments_taken"] > EPOCHS // 10  # a roll over every few epochs
        seen, since = -1, time.monotonic()   # the follower catches up with the writer's last epoch
        while True:
            recs = _records(out)
            if recs and recs[-1]["type"] == "commit" and recs[-1]["epoch"] == EPOCHS:
                break
            assert follow.poll() is None, err_path.read_text()[-2000:]
            size = out.stat().st_size
            if size != seen:
                seen, since = size, time.monotonic()
            assert time.monotonic() - since < 300, f"no record printed for 300 s: {err_path.read_text()[-2000:]}"
            time.sleep(0.05)
    finally:
        if writer.poll() is None:   # a failure above while it ran: it would wait for the follower for ever
            writer.kill()
            writer.wait()
        follow.send_signal(signal.SIGINT)
        try:
            code = follow.wait(timeout=20)
        except subprocess.TimeoutExpired:
            follow.kill()
            raise
    assert code == 0, err_path.read_text()[-2000:]
    followed = _records(out)
    lsns = [r["lsn"] for r in followed]
    assert lsns == sorted(set(lsns))  # LSN order, nothing twice
    assert not [r for r in followed if r["crc"] != "OK"]
    # nothing dropped: every epoch's batch and commit, in order
    assert [r["epoch"] for r in followed if r["type"] == "commit"] == list(range(1, EPOCHS + 1))
    assert [r["epoch"] for r in followed if r["type"] == "page_batch"] == list(range(1, EPOCHS + 1))
    # and what dump prints afterwards (the segments not reclaimed) is exactly what it printed there
    dump = subprocess.run([WAL, "dump", log, "--json"], capture_output=True, text=True, timeout=60)
    after = json.loads(dump.stdout)["records"] if dump.stdout else []
    assert dump.returncode == 0, (dump.stderr, [(r["type"], r["epoch"], r["problem"], r["lsn"] - r["offset"]) for r in after if r["crc"] != "OK"][:3],
                                  {k: v for k, v in json.loads(dump.stdout or "{}").items() if k != "records"})
    # (the region's name is left out: its descriptor lay in a segment reclaimed since, so
    # dump names the region by id; region_id is compared)
    same = [{k: v for k, v in r.items() if k != "region"} for r in followed]
    after = [{k: v for k, v in r.items() if k != "region"} for r in after]
    assert len(after) > 100
    by_lsn = {r["lsn"]: r for r in same}
    assert [r for r in after if by_lsn.get(r["lsn"]) != r] == []
    assert same[-len(after):] == after  # the tail of the follower's output, record for record
