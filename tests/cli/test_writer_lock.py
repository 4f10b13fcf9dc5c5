"""A live writer in another process holds the log's writer lock: the commands
that write (compact, snapshot create, verify --repair, format --force) are
refused with one line naming its pid and exit 2, and change nothing; the
readers run beside it.  A Session writing in this process keeps compact out
the same way.  And the progress bars: on stderr when it is a terminal, never
with --json or --quiet."""

from __future__ import annotations

import os
import pty
import select
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from click.testing import CliRunner

from concordia.tools.wal_cli import main
from concordia.wal import Log

from .conftest import WAL, flip, sha

WRITER = textwrap.dedent("""
    import sys
    import numpy as np
    from concordia.wal import Log, region_digest
    from concordia.wal import format as F
    log = Log.open("file:" + sys.argv[1], writable=True)
    rid = log.regions["kv"].id
    e = log.last_committed_epoch + 1
    pages = np.full((1, 4096), 7, np.uint8)
    log.appender.append_page_batch(e, rid, np.array([0], np.uint32), pages)  # not committed yet
    print("writing", flush=True)
    sys.stdin.read()
    log.close()
""")


@pytest.fixture
def writer(log_path):
    p = subprocess.Popen([sys.executable, "-c", WRITER, log_path], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "writing"
    yield p
    p.stdin.close()
    assert p.wait(timeout=30) == 0


WRITING = [
    ["compact", "{log}", "--keep", "1"],
    ["snapshot", "create", "{log}", "--region", "kv"],
    ["verify", "{log}", "--repair", "--backup", "{tmp}/never.bak"],
    ["format", "{log}", "--size", "16M", "--segment-size", "1M", "--force"],
]


@pytest.mark.parametrize("cmd", WRITING, ids=lambda c: "-".join(c[:2]).replace("{log}", "").strip("-"))
def test_writing_commands_refused_while_a_writer_is_live(cmd, log_path, writer, tmp_path):
    before = sha(log_path)
    args = [a.replace("{log}", log_path).replace("{tmp}", str(tmp_path)) for a in cmd]
    r = subprocess.run([WAL, *args], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert f"log is open for writing by another process (pid {writer.pid})" in lines[0]
    assert lines[0].startswith(f"error: file:{log_path}: ")
    assert sha(log_path) == before  # nothing cut, nothing formatted
    assert not os.path.exists(tmp_path / "never.bak")


def test_readers_run_beside_a_live_writer(log_path, writer):
    for args in (["info", log_path], ["dump", log_path, "--stats"], ["verify", log_path, "--quiet"],
                 ["recover", log_path, "--plan"], ["snapshot", "list", log_path]):
        r = subprocess.run([WAL, *args], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, (args, r.stdout, r.stderr)


def test_writing_commands_run_once_the_writer_is_gone(log_path, writer):
    writer.stdin.close()
    assert writer.wait(timeout=30) == 0
    r = subprocess.run([WAL, "compact", log_path, "--keep", "1"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def test_compact_refused_while_a_session_log_is_open_in_this_process(log_path):
    log = Log.open(f"file:{log_path}", writable=True)
    try:
        before = sha(log_path)
        r = CliRunner().invoke(main, ["compact", log_path])
        assert r.exit_code == 2
        assert f"in this process (pid {os.getpid()})" in r.output
        assert sha(log_path) == before
    finally:
        log.close()
    assert CliRunner().invoke(main, ["compact", log_path]).exit_code == 0


def test_repair_still_cuts_under_its_own_lock(log_path, tmp_path):
    log = Log.open(f"file:{log_path}", writable=False)
    last = [r for r in log.records() if r.kind == 0x03][-1]
    log.close()
    flip(log_path, last.offset + 64 + 2)
    r = CliRunner().invoke(main, ["verify", log_path, "--repair", "--backup", str(tmp_path / "b.bak")])
    assert r.exit_code == 0, r.output
    assert "cut the torn tail" in r.output
    assert CliRunner().invoke(main, ["verify", log_path, "--mode", "absolute"]).exit_code == 0


# --------------------------------------------------------------------------- progress bars

def _on_a_terminal(args: list, cwd) -> tuple[int, str, str]:
    """Run concordia-wal with stderr on a pseudo-terminal: (exit code, stdout, what the terminal showed)."""
    master, slave = pty.openpty()
    p = subprocess.Popen([WAL, *args], stdout=subprocess.PIPE, stderr=slave, cwd=cwd)
    os.close(slave)
    shown = b""
    while True:
        ready, _, _ = select.select([master], [], [], 30)
        if not ready:
            break
        try:
            chunk = os.read(master, 1 << 16)
        except OSError:  # the terminal's other end closed: the command ended
            break
        if not chunk:
            break
        shown += chunk
    out = p.stdout.read().decode()
    code = p.wait(timeout=30)
    os.close(master)
    return code, out, shown.decode(errors="replace")


@pytest.mark.parametrize("args,label", [
    (["verify", "{log}"], "verifying"),
    (["restore", "{log}", "--region", "kv", "--out", "kv.npy"], "restoring"),
    (["compact", "{log}", "--keep", "1"], "compacting"),
])
def test_progress_bar_on_a_terminal(args, label, log_path, workdir):
    code, out, shown = _on_a_terminal([a.replace("{log}", log_path) for a in args], workdir)
    assert code == 0, (out, shown)
    assert label in shown and "100%" in shown, shown
    assert label not in out


@pytest.mark.parametrize("args", [["verify", "{log}", "--json"], ["verify", "{log}", "--quiet"],
                                  ["compact", "{log}", "--keep", "1", "--json"]])
def test_no_progress_bar_with_json_or_quiet(args, log_path, workdir):
    code, out, shown = _on_a_terminal([a.replace("{log}", log_path) for a in args], workdir)
    assert code == 0, (out, shown)
    assert shown.strip() == "", shown
    if "--json" in args:
        import json

        json.loads(out)


def test_restored_file_matches_after_a_bar(log_path, workdir, history):
    code, _, _ = _on_a_terminal(["restore", log_path, "--region", "kv", "--out", "kv.npy"], workdir)
    assert code == 0
    assert np.array_equal(np.load(workdir / "kv.npy"), history[max(history)]["kv"])
