"""No surprises with files and Ctrl-C (issue 29).

* A named output (every benchmark's `--out` and `--plot`, `verify --repair
  --backup`) that exists is refused before any work, in one line naming it,
  exit 2, the file unchanged, unless `--force`, which replaces it whole.
* A benchmark makes its own logs: a path given to it (`bench longrun --log`)
  that holds anything is refused, exit 2, one line, the file untouched.
* Ctrl-C, a real SIGINT sent to a real child process at a point chosen by
  what it is doing (tests/cli/interrupt_child.py, never a delay): exit 130,
  the one line `error: interrupted`, no traceback, no file left that the
  command made (`dump --follow` ends on it, exit 0, as documented).
* SIGTERM (`timeout`'s, a service manager's), sent the same way: exit 143,
  the one line `error: terminated`, and nothing left either (a benchmark's
  scratch log in /dev/shm included).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys

import pytest
from click.testing import CliRunner

from concordia.tools.wal_cli import main

BENCHES = main.commands["bench"].list_commands(None)
CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "interrupt_child.py")
LOG = "file:./concordia-data/demo.log"


def _sha(path) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _one_line(stderr: str) -> str:
    lines = stderr.splitlines()
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


# -- outputs ---------------------------------------------------------------------------

LONGRUN = ["--epochs", "300", "--noretain-epochs", "0", "--state", "256K", "--log-size", "8M",
           "--samples", "2", "--bins", "2"]

# (benchmark, its arguments for a short run, the option naming the output); every benchmark is here
OUTPUTS = [
    ("append", ["--quick", "--medium", "file", "--pages", "1"], "--out"),
    ("checkpoint", ["--cpu", "--quick", "--parts", "detect"], "--out"),
    ("checkpoint", ["--cpu", "--quick", "--parts", "detect"], "--plot"),
    ("compact", ["--quick"], "--out"),
    ("devmem", ["--quick", "--tier", "memory"], "--out"),
    ("executor", ["--cpu", "--quick"], "--out"),
    ("executor-session", ["--cpu", "--quick"], "--out"),
    ("instrument", ["--quick"], "--out"),
    ("into", ["--quick"], "--out"),
    ("longrun", LONGRUN, "--out"),
    ("longrun", LONGRUN, "--plot"),
    ("model", ["--quick"], "--out"),
    ("recover", ["--quick"], "--out"),
    ("recover", ["--quick", "--plot"], "bench-recover.png"),  # --plot without --out: ./bench-recover.png
    ("restore", ["--quick"], "--out"),
    ("standby", ["--quick"], "--out"),
]


def test_every_benchmark_is_in_the_output_table():
    assert {name for name, _, _ in OUTPUTS} == set(BENCHES)


@pytest.mark.parametrize("bench,args,option", OUTPUTS, ids=[f"{b}{o}" for b, _, o in OUTPUTS])
def test_a_benchmark_refuses_an_existing_output_before_it_runs(bench, args, option, workdir):
    path = workdir / (f"existing-{option.lstrip('-')}" if option.startswith("--") else option)
    path.write_text("my notes, not a benchmark's\n")
    before = _sha(path)
    named = [option, str(path)] if option.startswith("--") else []
    res = CliRunner().invoke(main, ["bench", bench, *args, *named])
    assert res.exit_code == 2, res.output
    assert _one_line(res.stderr) == f"error: {path}: the output exists (pass --force to overwrite it)"
    assert res.stdout == "" and _sha(path) == before


def test_an_output_in_a_missing_folder_is_refused_before_the_run(workdir):
    res = CliRunner().invoke(main, ["bench", "compact", "--quick", "--out", "nowhere/bench.json"])
    assert res.exit_code == 2, res.output
    assert _one_line(res.stderr) == (f"error: {workdir / 'nowhere'}: no such folder for the output "
                                     "(create it, or name a file in a folder that exists)")
    assert res.stdout == ""


@pytest.mark.parametrize("bench,args", [("restore", ["--quick"]), ("compact", ["--quick"])])
def test_force_replaces_a_benchmark_output_whole(bench, args, workdir):
    path = workdir / "bench.json"
    path.write_text("my notes\n")
    res = CliRunner().invoke(main, ["bench", bench, *args, "--out", str(path), "--force"])
    assert res.exit_code == 0, res.output
    assert json.loads(path.read_text())["benchmark"] == bench
    assert sorted(os.listdir(workdir)) == ["bench.json", "concordia-data"]  # no temporary beside it


def test_an_output_that_is_a_symbolic_link_is_written_through_it(workdir, log_path):
    """`--out` naming a symbolic link to a file writes that file (replaced
    whole with --force), never the link itself: the link stays, pointing at
    the new file, nothing is left beside either; a link to nothing, or to what
    is not a regular file (a pipe: /dev/stdout), is refused, naming the path given."""
    import numpy as np

    real = workdir / "real.npy"
    real.write_text("my notes\n")
    link = workdir / "link.npy"
    link.symlink_to(real)
    res = CliRunner().invoke(main, ["restore", log_path, "--region", "kv", "--out", str(link)])
    assert res.exit_code == 2 and "the output exists" in _one_line(res.stderr) and real.read_text() == "my notes\n"
    res = CliRunner().invoke(main, ["restore", log_path, "--region", "kv", "--out", str(link), "--force"])
    assert res.exit_code == 0, res.output
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert np.load(real).shape == (64, 1024)
    # a link to nothing would make a file wherever it points (a link planted in a shared folder): refused
    dangling = workdir / "dangling.npy"
    dangling.symlink_to(workdir / "made.npy")
    for force in ([], ["--force"]):
        res = CliRunner().invoke(main, ["restore", log_path, "--region", "kv", "--out", str(dangling), *force])
        assert res.exit_code == 2 and _one_line(res.stderr) == (
            f"error: {dangling}: the output is a symbolic link to nothing ({workdir / 'made.npy'}) "
            "(name the file to write itself)")
    fifo, to_fifo = workdir / "fifo", workdir / "to-fifo.npy"
    os.mkfifo(fifo)
    to_fifo.symlink_to(fifo)
    res = CliRunner().invoke(main, ["restore", log_path, "--region", "kv", "--out", str(to_fifo), "--force"])
    assert res.exit_code == 2 and _one_line(res.stderr) == (
        f"error: {to_fifo}: the output exists and is not a regular file (name a file to write)")
    assert sorted(os.listdir(workdir)) == ["concordia-data", "dangling.npy", "fifo", "link.npy", "real.npy",
                                           "to-fifo.npy"]


def test_verify_repair_force_replaces_an_existing_backup(workdir, log_path):
    from .conftest import zero

    d = json.loads(CliRunner().invoke(main, ["dump", log_path, "--json"]).stdout)
    last = d["records"][-1]
    zero(log_path, last["offset"] + 64, 64)  # a torn tail: the last record cut
    backup = workdir / "log.bak"
    backup.write_text("an older backup\n")
    before = _sha(log_path)
    res = CliRunner().invoke(main, ["verify", log_path, "--repair", "--backup", str(backup)])
    assert res.exit_code == 2 and _sha(log_path) == before and backup.read_text() == "an older backup\n"
    assert _one_line(res.stderr) == f"error: {backup}: the output exists (pass --force to overwrite it)"
    res = CliRunner().invoke(main, ["verify", log_path, "--repair", "--backup", str(backup), "--force", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["repair"]["cut"] is not None
    assert backup.read_bytes()[:8] == b"CNCRDVOL" and _sha(backup) == before  # the log as it was before the cut


# -- a benchmark's own log --------------------------------------------------------------

def _text(path):
    path.write_text("my notes\n")


def _concordia_log(path):
    shutil.copyfile("concordia-data/demo.log", path)


def _one_nonzero_byte(path):
    path.write_bytes(bytes(0x3000) + b"\x01" + bytes(0x10000 - 0x3001))


# (what the path holds, how it is made, what the refusal says)
HELD = [
    ("text", _text, "the target is not empty (nonzero byte at 0x0)"),
    ("log", _concordia_log, "the target holds a Concordia log"),
    ("data", _one_nonzero_byte, "nonzero byte at 0x3000"),
    ("folder", lambda p: p.mkdir(), "not a regular file (a directory)"),
]


@pytest.mark.parametrize("what,make,says", HELD, ids=[h[0] for h in HELD])
def test_longrun_refuses_a_log_path_that_holds_anything(what, make, says, workdir):
    path = workdir / "given"
    make(path)
    before = None if path.is_dir() else _sha(path)
    res = CliRunner().invoke(main, ["bench", "longrun", *LONGRUN, "--log", f"file:{path}"])
    assert res.exit_code == 2, res.output
    line = _one_line(res.stderr)
    assert line.startswith((f"error: {path}: ", f"error: file:{path}: ")) and says in line, line
    assert path.is_dir() if before is None else _sha(path) == before


# -- Ctrl-C ----------------------------------------------------------------------------

def _interrupt(point, program, args, cwd, notes):
    return subprocess.run([sys.executable, CHILD, point, str(notes), program, *args], cwd=cwd,
                          capture_output=True, text=True, timeout=600)


def _noted(notes) -> list[str]:
    """The files the child noted it had made (logs, temporaries)."""
    if not os.path.exists(notes):
        return []
    with open(notes) as f:
        return [line.split(" ", 1)[1].strip() for line in f if line.startswith(("log ", "temporary "))]


def _left(notes) -> list[str]:
    """What of the noted files is still there, with a benchmark's own folder."""
    left = []
    for path in _noted(notes):
        folder = os.path.dirname(path)
        for p in (path, folder) if os.path.basename(folder).startswith("concordia-bench-") else (path,):
            if os.path.lexists(p):
                left.append(p)
    return left


def _clean(notes):
    for p in _left(notes):  # a failing run must not leave its files behind either
        if os.path.isdir(p):
            shutil.rmtree(p, ignore_errors=True)
        elif os.path.lexists(p):
            os.unlink(p)


# (point, program, arguments, files in the working directory that must be absent afterwards)
INTERRUPTS = [
    ("imports", "concordia-wal", ["info", LOG], []),
    ("imports", "concordia", ["demo", "--help"], []),
    ("compact-write", "concordia-wal", ["compact", LOG], []),
    ("log-created", "concordia-wal", ["bench", "append", "--quick", "--medium", "shm", "--pages", "1"], []),
    ("output-write", "concordia-wal", ["bench", "compact", "--quick", "--out", "old.json", "--force"],
     [".old.json.tmp-*"]),
]


@pytest.mark.parametrize("point,program,args,absent", INTERRUPTS,
                         ids=[f"{p}:{' '.join(a[:2])}" for p, _, a, _ in INTERRUPTS])
def test_ctrl_c_is_exit_130_one_line_and_nothing_left(point, program, args, absent, workdir, request):
    notes = workdir / "notes"
    request.addfinalizer(lambda: _clean(notes))
    (workdir / "old.json").write_text('{"old": true}')
    before = _sha(workdir / "concordia-data" / "demo.log")
    res = _interrupt(point, program, args, workdir, notes)
    assert "interrupted " in notes.read_text(), (point, res.stderr)  # the interrupt landed where asked
    assert res.returncode == 130, res.stderr
    assert _one_line(res.stderr) == "error: interrupted" and res.stdout == ""
    assert _left(notes) == [], "left behind"
    assert not [p for pattern in absent for p in workdir.glob(pattern)]
    assert (workdir / "old.json").read_text() == '{"old": true}'
    if point == "compact-write":  # the log is the one before compaction, whole
        check = CliRunner().invoke(main, ["verify", LOG, "--quiet"])
        assert check.exit_code == 0, check.output
    else:
        assert _sha(workdir / "concordia-data" / "demo.log") == before


TERMS = [
    ("imports", "concordia-wal", ["info", LOG], []),
    ("log-created", "concordia-wal", ["bench", "append", "--quick", "--medium", "shm", "--pages", "1"], []),
    ("output-write", "concordia-wal", ["bench", "compact", "--quick", "--out", "old.json", "--force"],
     [".old.json.tmp-*"]),
    ("output-write", "concordia-wal", ["restore", LOG, "--region", "kv", "--out", "kv.npy"], ["kv.npy", ".kv.npy.*"]),
]


@pytest.mark.parametrize("point,program,args,absent", TERMS, ids=[f"{p}:{' '.join(a[:2])}" for p, _, a, _ in TERMS])
def test_sigterm_is_exit_143_one_line_and_nothing_left(point, program, args, absent, workdir, request):
    notes = workdir / "notes"
    request.addfinalizer(lambda: _clean(notes))
    (workdir / "old.json").write_text('{"old": true}')
    before = _sha(workdir / "concordia-data" / "demo.log")
    res = _interrupt(f"term:{point}", program, args, workdir, notes)
    assert "interrupted " in notes.read_text(), (point, res.stderr)  # the signal landed where asked
    assert res.returncode == 143, res.stderr
    assert _one_line(res.stderr) == "error: terminated" and res.stdout == ""
    if point == "log-created":  # the benchmark's own log, in its folder in /dev/shm, was made
        assert [p for p in _noted(notes) if os.path.basename(os.path.dirname(p)).startswith("concordia-bench-")]
    assert _left(notes) == [], "left behind"
    assert not [p for pattern in absent for p in workdir.glob(pattern)]
    assert (workdir / "old.json").read_text() == '{"old": true}'
    assert _sha(workdir / "concordia-data" / "demo.log") == before


def test_ctrl_c_and_sigterm_at_once_are_one_stop(workdir, request):
    # the two land together (during a long call into C, say): the first handler lets the second go,
    # with no "signal ignored due to race condition" traceback; Ctrl-C's is handled first
    notes = workdir / "notes"
    request.addfinalizer(lambda: _clean(notes))
    res = _interrupt("both:log-created", "concordia-wal",
                     ["bench", "append", "--quick", "--medium", "shm", "--pages", "1"], workdir, notes)
    assert "interrupted " in notes.read_text(), res.stderr
    assert res.returncode == 130, res.stderr
    assert _one_line(res.stderr) == "error: interrupted" and res.stdout == ""
    assert _left(notes) == [], "left behind"


def test_sigterm_ends_dump_follow_as_ctrl_c_does(workdir, request):
    notes = workdir / "notes"
    request.addfinalizer(lambda: _clean(notes))
    res = _interrupt("term:follow-poll", "concordia-wal", ["dump", LOG, "--follow"], workdir, notes)
    assert "interrupted " in notes.read_text(), res.stderr
    assert res.returncode == 0 and res.stderr == ""


def test_a_command_run_in_process_puts_the_signal_handlers_back(monkeypatch):
    import signal

    from concordia.tools import entry

    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    monkeypatch.setattr(sys, "argv", ["concordia-wal", "--help"])
    with pytest.raises(SystemExit) as e:
        entry.concordia_wal()
    assert e.value.code == 0
    assert {sig: signal.getsignal(sig) for sig in before} == before


# the same rule for the other commands that write, which kept it before these changes
HELD_BEFORE = [
    ("output-write", "concordia-wal", ["restore", LOG, "--region", "kv", "--out", "kv.npy"], ["kv.npy", ".kv.npy.*"],
     130),
    ("format", "concordia-wal", ["format", "file:new.log", "--size", "16M"], ["new.log"], 130),
    ("session-checkpoint", "concordia-wal", ["bench", "longrun", *LONGRUN, "--log", "file:new.log"], ["new.log"],
     130),
    ("follow-poll", "concordia-wal", ["dump", LOG, "--follow"], [], 0),
]


@pytest.mark.parametrize("point,program,args,absent,code", HELD_BEFORE,
                         ids=[f"{p}:{a[0]}" for p, _, a, _, _ in HELD_BEFORE])
def test_ctrl_c_in_the_other_writers(point, program, args, absent, code, workdir, request):
    notes = workdir / "notes"
    request.addfinalizer(lambda: _clean(notes))
    res = _interrupt(point, program, args, workdir, notes)
    assert "interrupted " in notes.read_text(), (point, res.stderr)
    assert res.returncode == code, res.stderr
    if code:
        assert _one_line(res.stderr) == "error: interrupted"
    else:  # dump --follow: Ctrl-C is how it ends
        assert res.stderr == ""
    assert _left(notes) == [] and not [p for pattern in absent for p in workdir.glob(pattern)]
