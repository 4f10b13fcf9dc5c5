"""A hint names the knob of the interface in use (issue 29, "No surprises").

The same refusal, met from the command line and from Python, table-driven:
the command line's one line names options and commands (`--force`,
`--mode point-in-time`, `concordia-wal format`) and never a Python argument;
the exception a Python caller gets names the argument (`overwrite=True`,
`mode='point_in_time'`) and never a command-line option.  Then the other
surprises of the issue: `verify --repair --backup F` on an existing F takes
`--force`, `concordia standby` refuses a volatile log for what it is, and
the README's detector table says what `detect`'s default picks."""

from __future__ import annotations

import json
import os
import re
import subprocess

import numpy as np
import pytest
from click.testing import CliRunner

from concordia.errors import ConcordiaError
from concordia.tools.wal_cli import main
from concordia.wal import Log

from .conftest import WAL, flip, sha
from .test_damaged import layout

#: what a command line's hint must never hold: Python arguments and spellings
PYTHON_WORDS = re.compile(r"\w+=(True|False)\b|\w+='|Session\(|Log\.open|\breplace=|"
                          r"\b(tolerate|point_in|skip)_\w+")
#: what a Python caller's hint must never hold: a command-line option
CLI_WORDS = re.compile(r"(^|[\s(])--[a-z]|concordia-wal")


def one_line(res) -> str:
    """The single `error: ...` line a failing command printed on stderr."""
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    assert "Traceback" not in res.stderr
    return lines[0]


def hint_of(line: str) -> str:
    """The last parenthesised part of an error line: its hint."""
    assert line.endswith(")"), line
    depth = 0
    for i in range(len(line) - 1, -1, -1):
        depth += {")": 1, "(": -1}.get(line[i], 0)
        if depth == 0:
            return line[i + 1:-1]
    raise AssertionError(line)


def python_error(call) -> ConcordiaError:
    with pytest.raises(ConcordiaError) as e:
        call()
    return e.value


# -- the table: how to make the refusal, what each face's hint says ----------------

def _missing(d):
    return {"log": str(d / "nope.log")}


def _empty(d):
    (d / "empty.log").write_bytes(b"")
    return {"log": str(d / "empty.log")}


def _read_only(d, log_path):
    os.chmod(log_path, 0o444)
    return {"log": log_path}


def _foreign(d, log_path):
    if os.geteuid() != 0:
        pytest.skip("giving a file to another user needs root")
    os.chown(log_path, 12345, 12345)
    return {"log": log_path}


def _truncated(d, log_path):
    with Log.open(log_path, writable=False) as lg:
        vol_end = max(s.offset + s.nbytes for s in lg.volume.live_segments())
    os.truncate(log_path, vol_end)  # shorter than the 16 MiB its superblock declares
    return {"log": log_path}


def _corrupt(d, log_path):
    lay = layout(log_path)
    flip(log_path, lay["payload"][2], 5)  # a page before the last commit
    return {"log": log_path}


def _out_exists(d, log_path):
    out = d / "kv.npy"
    out.write_bytes(b"mine")
    return {"log": log_path, "out": str(out)}


def _plain(d, log_path):
    return {"log": log_path}


def _plan(log):
    from concordia.wal import plan

    with Log.open(log, writable=False) as lg:
        return plan(lg)


def _restore_npy(log, out):
    from concordia.wal import plan
    from concordia.wal.apply import restore_region_npy

    with Log.open(log, writable=False) as lg:
        restore_region_npy(lg, plan(lg), "kv", out, replace=False)


CASES = [
    # id, setup(d[, log_path]), argv, words the CLI hint holds, Python call, words the Python hint holds
    ("missing-path", _missing, lambda a: ["info", a["log"]], "create the log with concordia-wal format",
     lambda a: Log.open(a["log"], writable=False), "create=True"),
    ("empty-file", _empty, lambda a: ["info", a["log"]], "concordia-wal format --size SIZE",
     lambda a: Log.open(a["log"], writable=False), "give a size"),
    ("read-only-file", _read_only, lambda a: ["compact", a["log"]], "chmod u+w to write it; info, dump and verify",
     lambda a: Log.open(a["log"]), "readonly=True"),
    ("foreign-owner", _foreign, lambda a: ["compact", a["log"]], "run the command as the log's owner",
     lambda a: Log.open(a["log"]), "allow_foreign_owner=True"),
    ("truncated-media", _truncated, lambda a: ["compact", a["log"]], "info, dump, verify and restore read what is left",
     lambda a: Log.open(a["log"]), "writable=False"),
    ("corruption-tolerate-tail", _corrupt, lambda a: ["restore", a["log"], "--region", "kv", "--out", "kv.npy"],
     "use --mode point-in-time or --mode skip-corrupt to fall back",
     lambda a: _plan(a["log"]), "mode='point_in_time' or 'skip_corrupt'"),
    ("too-small-to-format", lambda d: {"log": str(d / "small.log")},
     lambda a: ["format", a["log"], "--size", "1M"], "a larger --size or a smaller --segment-size",
     lambda a: Log.create(a["log"], size=1 << 20), "a smaller segment_size"),
    ("format-over-a-log", _plain, lambda a: ["format", a["log"], "--size", "16M"], "pass --force to format it anyway",
     lambda a: Log.create(a["log"], size=16 << 20), "pass overwrite=True"),
    ("restore-output-exists", _out_exists,
     lambda a: ["restore", a["log"], "--region", "kv", "--out", a["out"]], "pass --force to overwrite it",
     lambda a: _restore_npy(a["log"], a["out"]), "pass replace=True"),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_a_hint_names_the_knob_of_the_interface_in_use(case, workdir, log_path):
    _id, setup, argv, cli_words, call, api_words = case
    args = setup(workdir, log_path) if setup.__code__.co_argcount == 2 else setup(workdir)
    before = {p: sha(p) for p in (args["log"], args.get("out")) if p and os.path.isfile(p)}

    res = CliRunner().invoke(main, argv(args))
    assert res.exit_code in (1, 2), res.output
    line = one_line(res)
    hint = hint_of(line)
    assert cli_words in hint, line
    assert not PYTHON_WORDS.search(hint), line

    err = python_error(lambda: call(args))  # in the same process, after the command
    api_hint = hint_of(str(err))
    assert api_words in api_hint and api_words in str(err), str(err)
    assert not CLI_WORDS.search(api_hint), str(err)
    for path, digest in before.items():
        assert sha(path) == digest, f"{path} changed"


def test_a_log_held_by_a_writer_names_the_readers_of_each_interface(workdir, log_path):
    writer = Log.open(log_path)  # holds the writer lock, as a running Session would
    try:
        line = one_line(CliRunner().invoke(main, ["compact", log_path]))
        assert "log is open for writing" in line
        assert "info, dump and verify without --repair only read" in hint_of(line)
        err = python_error(lambda: Log.open(log_path))
        assert "writable=False" in str(err) and "readonly=True" in str(err)
        assert not CLI_WORDS.search(hint_of(str(err))), str(err)
    finally:
        writer.close()


def test_the_installed_command_speaks_its_own_words(workdir):
    r = subprocess.run([WAL, "info", str(workdir / "nope.log")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip().endswith("(check the path, or create the log with concordia-wal format)"), r.stderr


def test_a_hint_renders_when_shown_not_when_raised(tmp_path):
    from concordia.root_error import API, CLI, Hint, interface, speaking

    err = ConcordiaError("refused", where="x", hint=Hint(api="pass overwrite=True", cli="pass --force"))
    assert str(err) == "x: refused (pass overwrite=True)"
    with speaking(CLI):
        assert str(err) == "x: refused (pass --force)"
        with speaking(API):
            assert err.one_line() == "x: refused (pass overwrite=True)"
        assert interface() == CLI
    assert err.one_line(CLI) == "x: refused (pass --force)" and interface() == API
    with pytest.raises(ValueError):
        speaking("gui")
    res = CliRunner().invoke(main, ["info", str(tmp_path / "nope.log")])
    assert res.exit_code == 2 and interface() == API  # the command's words ended with the command


# -- verify --repair --backup F: F exists ------------------------------------------

def _torn(log_path) -> None:
    lay = layout(log_path)
    flip(log_path, lay["last_commit"][1] + 64 + 3)  # the last commit's body: a torn tail


def test_verify_repair_onto_an_existing_backup_takes_force(workdir, log_path):
    _torn(log_path)
    backup = workdir / "demo.bak"
    backup.write_bytes(b"an older backup")
    log_before = sha(log_path)

    res = CliRunner().invoke(main, ["verify", log_path, "--repair", "--backup", str(backup)])
    assert res.exit_code == 2
    line = one_line(res)
    assert line == f"error: {backup}: the output exists (pass --force to overwrite it)"
    assert backup.read_bytes() == b"an older backup" and sha(log_path) == log_before

    res = CliRunner().invoke(main, ["verify", log_path, "--repair", "--backup", str(backup), "--force", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["repair"]["backup"] == str(backup)
    with open(backup, "rb") as f:
        assert f.read(8) == b"CNCRDVOL" and os.path.getsize(backup) == 16 << 20
    assert sha(str(backup)) == log_before  # the log as it was before the cut
    assert sha(log_path) != log_before  # the torn tail was cut, after the backup


def test_verify_force_without_repair_is_a_usage_error(log_path):
    res = CliRunner().invoke(main, ["verify", log_path, "--force"])
    assert res.exit_code == 2
    assert "--force goes with --repair" in one_line(res)


def test_verify_repair_never_replaces_a_backup_nobody_named(workdir, log_path, monkeypatch):
    import time

    _torn(log_path)
    stamp = "20261202T120000"
    monkeypatch.setattr(time, "strftime", lambda fmt, *a: stamp)  # the clock stands still
    taken = [f"{log_path}.bak-{stamp}", f"{log_path}.bak-{stamp}-2"]  # a second's default names, used
    for p in taken:
        with open(p, "wb") as f:
            f.write(b"someone's")
    res = CliRunner().invoke(main, ["verify", log_path, "--repair", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["repair"]["backup"] == f"{log_path}.bak-{stamp}-3"
    for p in taken:
        with open(p, "rb") as f:
            assert f.read() == b"someone's"


# -- concordia standby on a volatile tier ----------------------------------------

@pytest.mark.parametrize("spec", ["memory:", "pinned:"])
def test_standby_refuses_a_volatile_log_for_what_it_is(spec):
    from concordia.errors import StandbyError
    from concordia.standby import Standby
    from concordia.tools.cli import main as app

    res = CliRunner().invoke(app, ["standby", spec, "--device", "cpu"])
    assert res.exit_code == 2, res.output
    line = one_line(res)
    assert line.startswith(f"error: {spec}: ") and "no other process can follow it" in line, line
    assert "size" not in line, line
    with pytest.raises(StandbyError, match="no other process can follow it"):
        Standby(spec, device="cpu")


# -- the README's detector table ----------------------------------------------------

def test_the_readme_names_the_default_detector_and_what_it_picks():
    import inspect

    from concordia.session import Session

    default = inspect.signature(Session.register).parameters["detect"].default
    readme = open(os.path.join(os.path.dirname(__file__), "..", "..", "README.md"), encoding="utf-8").read()
    rows = {m.group(1): m.group(0) for m in re.finditer(r"^\| `(\w+)`[^\n]*", readme, re.M)}
    defaults = [name for name, row in rows.items() if "(default)" in row.split("|")[1]]
    assert defaults == [default], defaults

    s = Session("memory:", size=16 << 20)
    try:
        picked = {
            "shadow": s.register("opaque", np.zeros(4096, np.uint8)).detect,
            "blocks": s.register("kv", np.zeros((4, 2, 16, 2, 64), np.float32), kind="kv",
                                 block_tables=np.zeros((1, 4), np.int32), seq_lens=np.zeros(1, np.int32)).detect,
            "versions": s.register("adapter", np.zeros(4096, np.uint8), kind="adapter",
                                   slot_versions=np.zeros(1, np.uint64), pages_per_slot=1).detect,
        }
    finally:
        s.close()
    assert picked == {"shadow": "shadow", "blocks": "blocks", "versions": "versions"}
    row = rows[default]
    for name in picked:  # the default's row says what it picks, in the order the code tries
        assert f"`{name}`" in row, row
    assert row.index("`blocks`") < row.index("`versions`") < row.index("`shadow`"), row
