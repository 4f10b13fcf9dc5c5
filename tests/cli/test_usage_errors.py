"""A usage error (an unknown option or command, a bad value, a missing
argument) is one line naming the command, and exit 2, on both command lines:
never click's usage block."""

from __future__ import annotations

import subprocess
import sys

import pytest

ENTRY = {"concordia": "from concordia.tools.cli import main; main()",
         "concordia-wal": "from concordia.tools.wal_cli import main; main()"}


def _run(program, *args):
    code = f"import sys; sys.argv[0] = {program!r}; " + ENTRY[program]
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("program,args,where,says", [
    ("concordia-wal", ["info", "--nope"], "concordia-wal info", "No such option '--nope'"),
    ("concordia-wal", ["snapshot", "list"], "concordia-wal snapshot list", "Missing argument 'LOG'"),
    ("concordia-wal", ["bench", "nosuch"], "concordia-wal bench", "No such command 'nosuch'"),
    ("concordia-wal", ["nosuch"], "concordia-wal", "No such command 'nosuch'"),
    ("concordia-wal", ["recover", "file:x.log"], "concordia-wal recover", "add --plan"),
    ("concordia-wal", ["dump", "file:x.log", "--stats", "--follow"], "concordia-wal dump",
     "--stats and --follow do not go together"),
    ("concordia", ["demo", "--steps", "1"], "concordia demo", "Invalid value for '--steps'"),
    ("concordia", ["demo", "--kill-at", "soon"], "concordia demo", "is neither a step number nor 'random'"),
    ("concordia", ["standby", "shm:x", "--resume", "nocolon", "--device", "cpu"], "concordia standby",
     "is not MODULE:FUNCTION"),
    # a number that is no number: refused as a value, never taken as "no limit" or met later as damage
    ("concordia", ["standby", "shm:x", "--device", "cpu", "--lease", "nan"], "concordia standby",
     "'nan' is not a finite number"),
    ("concordia", ["standby", "shm:x", "--device", "cpu", "--timeout", "inf"], "concordia standby",
     "'inf' is not a finite number"),
    ("concordia-wal", ["dump", "file:x.log", "--follow", "--interval", "nan"], "concordia-wal dump",
     "'nan' is not a finite number"),
    ("concordia-wal", ["compact", "file:x.log", "--keep", str(1 << 32)], "concordia-wal compact",
     "is not in the range 0<=x<=4294967295"),
    ("concordia-wal", ["bench", "restore", "--threads", "0"], "concordia-wal bench restore", "x>=1"),
    ("concordia-wal", ["bench", "standby", "--gib", "nan"], "concordia-wal bench standby",
     "'nan' is not a finite number"),
    ("concordia-wal", ["bench", "recover", "--quick", "--sizes", "0"], "concordia-wal bench recover",
     "not a list of sizes in GiB above 0: '0'"),
    # what would be silently ignored or taken to mean nothing
    ("concordia-wal", ["restore", "file:x.log", "--region", "kv", "--region", "adapter", "--out", "x.npy"],
     "concordia-wal restore", "give --region once"),
    ("concordia-wal", ["dump", "file:x.log", "--interval", "5"], "concordia-wal dump", "give it with --follow"),
    ("concordia-wal", ["bench", "append", "--quick", "--total", "0"], "concordia-wal bench append",
     "'0' is no bytes: give a size above 0"),
    ("concordia-wal", ["bench", "restore", "--quick", "--epochs", "-1"], "concordia-wal bench restore", "x>=1"),
])
def test_a_usage_error_is_one_line_and_exit_2(program, args, where, says):
    _one_usage_line(_run(program, *args), where, says)


@pytest.mark.parametrize("spec", ["memory:", "pinned:"])
def test_format_refuses_a_log_that_would_end_with_the_command(spec):
    r = _run("concordia-wal", "format", spec, "--size", "16M")
    assert r.returncode == 2 and r.stderr.splitlines() == [
        f"error: {spec}: a log in the memory of the process that opens it: formatted here it would be gone when "
        "this command ends (format a log that outlives it: shm:NAME, file:PATH, hugetlb:PATH or a device)"], r.stderr


def _one_usage_line(r, where, says):
    assert r.returncode == 2, r.stderr
    lines = r.stderr.splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith(f"error: {where}: ") and says in lines[0], lines[0]
    assert lines[0].endswith(f"(see {where} --help)")
    assert "Usage:" not in r.stderr and r.stdout == ""


@pytest.mark.parametrize("program", ["concordia", "concordia-wal"])
def test_help_and_version_still_exit_0_and_a_bare_command_shows_its_help(program):
    r = _run(program, "--help")
    assert r.returncode == 0 and r.stdout.startswith(f"Usage: {program} ") and r.stderr == ""
    r = _run(program, "--version")
    assert r.returncode == 0 and r.stdout.startswith(f"{program}, version ")
    r = _run(program)
    assert r.returncode == 2 and r.stderr.startswith(f"Usage: {program} ") and r.stdout == ""
