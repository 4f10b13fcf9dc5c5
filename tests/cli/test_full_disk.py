"""The command lines on full file systems, sparse files and their own output
paths: every command that maps or writes ends in one line on stderr and exit
1 or 2, never a signal; the input is unchanged (hash before and after); no
partial output is left (the directory is listed before and after).

Each command runs in a real process, so that a SIGBUS shows as a negative
return code and fails the test.  The full file systems are small tmpfs
mounts made here (root only: the tests say so and skip otherwise); tmpfs is
where even reading a hole through a mapping allocates a page, so a full one
turns that read into a SIGBUS."""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import struct
import subprocess
import sys
import textwrap
import uuid

import pytest

from concordia.wal import format as F

from .conftest import WAL, sha

PY = os.path.join(os.path.dirname(WAL), "python")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# -- helpers ----------------------------------------------------------------------------

def run(*args, code=(1, 2), timeout=120):
    """Run concordia-wal; it must end by exit (never a signal) with a code in `code`."""
    res = subprocess.run([WAL, *map(str, args)], capture_output=True, text=True, timeout=timeout)
    assert res.returncode >= 0, f"{args}: killed by signal {-res.returncode}: {res.stderr}"
    codes = code if isinstance(code, tuple) else (code,)
    assert res.returncode in codes, (args, res.returncode, res.stdout, res.stderr)
    return res


def one_line(res) -> str:
    """The single `error: ...` line a failing command prints on stderr."""
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("error: "), res.stderr
    assert "Traceback" not in res.stderr
    return lines[0]


def listing(d) -> list[str]:
    return sorted(os.listdir(d))


def fill(d, leave: int = 0) -> None:
    """Fill the file system of directory `d` up to `leave` bytes free."""
    path = os.path.join(d, "filler")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        size, step = 0, 1 << 20
        while step >= 4096:
            try:
                os.posix_fallocate(fd, 0, size + step)
                size += step
            except OSError:
                step //= 2
        if leave:
            os.ftruncate(fd, max(0, size - leave))
    finally:
        os.close(fd)
    st = os.statvfs(d)
    assert st.f_bavail * st.f_frsize <= leave + (64 << 10)


def copy_sparse(src: str, dst: str) -> None:
    """Copy `src` to `dst` leaving every zero 4 KiB block a hole."""
    with open(src, "rb") as f, open(dst, "wb") as g:
        size = os.fstat(f.fileno()).st_size
        while True:
            block = f.read(4096)
            if not block:
                break
            if block.count(0) == len(block):
                g.seek(len(block), os.SEEK_CUR)
            else:
                g.write(block)
        g.truncate(size)


@pytest.fixture
def tmpfs(tmp_path):
    """An 8 MiB tmpfs mounted for this test (unmounted afterwards)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root (the CI runs these tests as root)")
    mnt = tmp_path / f"mnt-{uuid.uuid4().hex[:8]}"
    mnt.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8M", "tmpfs", str(mnt)],
                         capture_output=True, text=True)
    if res.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {res.stderr.strip() or res.returncode}")
    yield mnt
    if subprocess.run(["umount", str(mnt)], capture_output=True).returncode:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


@pytest.fixture
def sparse_log(tmpfs, template):
    """The engine's 16 MiB test log, copied sparsely onto the 8 MiB tmpfs, which is
    then filled: reading any hole through a shared mapping is a SIGBUS there."""
    path = str(tmpfs / "demo.log")
    copy_sparse(template[0], path)
    assert os.stat(path).st_blocks * 512 < os.stat(path).st_size
    fill(tmpfs)
    return path


# -- format -----------------------------------------------------------------------------

def test_format_of_a_sparse_file_on_a_full_tmpfs(tmpfs):
    target = tmpfs / "sparse.log"
    with open(target, "wb") as f:
        f.truncate(32 << 20)
    fill(tmpfs)
    before, names = sha(target), listing(tmpfs)
    for extra in ([], ["--force"]):
        res = run("format", target, "--size", "32M", "--segment-size", "1M", *extra, code=2)
        line = one_line(res)
        assert str(target) in line and "No space left" in line
        assert sha(target) == before and listing(tmpfs) == names
        assert os.stat(target).st_size == 32 << 20


def test_format_on_a_full_tmpfs_leaves_no_file(tmpfs):
    res = run("format", tmpfs / "new.log", "--size", "16M", "--segment-size", "1M", code=2)
    assert "No space left" in one_line(res)
    assert listing(tmpfs) == []


def test_a_failed_format_removes_only_the_file_it_made(tmp_path):
    # too small for two segments: found only after the file was made
    target = tmp_path / "small.log"
    res = run("format", target, "--size", "2M", "--segment-size", "1M", code=2)
    assert "fewer than 2 segments" in one_line(res)
    assert not target.exists()
    # a file that was there before stays, byte for byte
    target.write_bytes(bytes(2 << 20))
    before = sha(target)
    res = run("format", target, "--size", "2M", "--segment-size", "1M", code=2)
    assert "fewer than 2 segments" in one_line(res)
    assert sha(target) == before


@pytest.mark.parametrize("size,seg", [("64M", "8 MiB"), ("128M", "16 MiB")])
def test_format_picks_a_segment_size_a_small_log_holds(tmp_path, size, seg):
    target = tmp_path / "x.log"
    res = run("format", target, "--size", size, code=0)
    assert f"7 segments of {seg}" in res.stdout


def test_default_segment_size():
    from concordia.wal.volume import default_segment_size

    M = 1 << 20
    assert [default_segment_size(n * M) for n in (2, 8, 16, 63, 64, 128, 511, 512, 1024, 1 << 20)] == \
        [M, M, 2 * M, 4 * M, 8 * M, 16 * M, 32 * M, 64 * M, 64 * M, 64 * M]


def test_session_create_on_a_full_tmpfs_leaves_no_file(tmpfs):
    script = textwrap.dedent(f"""
        import sys
        from concordia import Session
        from concordia.errors import ConcordiaError
        from concordia.tools.common import exit_code_of
        try:
            Session({f"file:{tmpfs}/s.log"!r}, size=16 << 20, segment_size=1 << 20)
        except ConcordiaError as exc:
            print(exc.one_line(), file=sys.stderr)
            sys.exit(exit_code_of(exc))
    """)
    res = subprocess.run([PY, "-c", script], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stderr
    assert "No space left" in res.stderr and len(res.stderr.strip().splitlines()) == 1
    assert listing(tmpfs) == []
    # and one that fails after its file was made (too small for 2 segments) takes it back
    script = script.replace("size=16 << 20", "size=2 << 20")
    res = subprocess.run([PY, "-c", script], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "fewer than 2 segments" in res.stderr, res.stderr
    assert listing(tmpfs) == []


# -- reading sparse files on a full tmpfs -----------------------------------------------

@pytest.mark.parametrize("args", [["info"], ["info", "--stats"], ["verify"], ["dump"], ["recover", "--plan"],
                                  ["snapshot", "list"], ["restore", "--region", "kv", "--out", "OUT"]],
                         ids=lambda a: "-".join(a[:2]))
def test_read_commands_on_a_sparse_log_on_a_full_tmpfs(sparse_log, tmp_path, history, args):
    """Read from a copy of the data extents (the holes are never mapped), so
    they succeed and show the log as it is."""
    import numpy as np

    out = tmp_path / "kv.npy"
    args = [str(out) if a == "OUT" else a for a in args]
    before, names = sha(sparse_log), listing(os.path.dirname(sparse_log))
    cmd, *rest = args
    res = run(cmd, *rest, sparse_log, code=0)
    assert res.stdout
    assert sha(sparse_log) == before and listing(os.path.dirname(sparse_log)) == names
    if cmd == "restore":
        assert np.array_equal(np.load(out), history[max(history)]["kv"])


@pytest.mark.parametrize("args", [["compact"], ["snapshot", "create"], ["verify", "--repair"]],
                         ids=lambda a: "-".join(a))
def test_writing_commands_on_a_sparse_log_on_a_full_tmpfs(sparse_log, args):
    """A writer reserves the holes before it maps: a full disk is one line."""
    before, names = sha(sparse_log), listing(os.path.dirname(sparse_log))
    cmd, *rest = args
    res = run(cmd, *rest, sparse_log, code=2)
    assert "No space left" in one_line(res)
    assert sha(sparse_log) == before and listing(os.path.dirname(sparse_log)) == names


@pytest.mark.parametrize("args", [["info"], ["verify"], ["dump"], ["recover", "--plan"], ["snapshot", "list"],
                                  ["compact"], ["snapshot", "create"],
                                  ["restore", "--region", "kv", "--out", "OUT"]],
                         ids=lambda a: "-".join(a))
def test_every_command_on_an_empty_sparse_file_on_a_full_tmpfs(tmpfs, tmp_path, args):
    """A 32 MiB file that is all hole (no log in it): the slot-B search and
    every read of it finish without touching a hole through a mapping."""
    target = str(tmpfs / "hole.bin")
    with open(target, "wb") as f:
        f.truncate(32 << 20)
    fill(tmpfs)
    out = tmp_path / "out.npy"
    args = [str(out) if a == "OUT" else a for a in args]
    before, names = sha(target), listing(tmpfs)
    cmd, *rest = args
    res = run(cmd, *rest, target)
    assert "not a Concordia log" in one_line(res)
    assert sha(target) == before and listing(tmpfs) == names and not out.exists()


# -- restore: its output ----------------------------------------------------------------

def test_restore_onto_a_full_tmpfs_leaves_nothing(log_path, tmpfs):
    fill(tmpfs, leave=64 << 10)  # the kv region is 256 KiB
    names, before = listing(tmpfs), sha(log_path)
    res = run("restore", log_path, "--region", "kv", "--out", tmpfs / "kv.npy", code=2)
    line = one_line(res)
    assert "kv.npy" in line and "No space left" in line
    assert listing(tmpfs) == names and sha(log_path) == before


def test_a_failed_restore_force_keeps_the_old_output(log_path, tmpfs):
    old = tmpfs / "kv.npy"
    old.write_bytes(b"the previous output\n")
    fill(tmpfs, leave=64 << 10)
    names, before = listing(tmpfs), sha(old)
    res = run("restore", log_path, "--region", "kv", "--out", old, "--force", code=2)
    assert "No space left" in one_line(res)
    assert sha(old) == before and listing(tmpfs) == names


def test_a_failed_restore_keeps_the_old_output_on_bad_data(log_path, workdir):
    """A restore that fails its checks (a page CRC) leaves --out as it was."""
    import numpy as np

    from concordia.wal import Log

    out = workdir / "kv.npy"
    run("restore", log_path, "--region", "kv", "--out", out, code=0)
    good = sha(out)
    lg = Log.open(f"file:{log_path}", writable=False)
    # the newest kv record before the last commit: damage to the last commit's own
    # records on a one-sync log drops that commit as torn (FORMAT.md R-D1), a restore that succeeds
    rec = [r for r in lg.records() if r.kind == F.REC_PAGE_BATCH and r.region_id == lg.region("kv").id
           and r.epoch < lg.last_committed_epoch][-1]
    lg.close()
    with open(log_path, "r+b") as f:  # a payload byte of that kv record
        f.seek(rec.offset + rec.length - 8)
        b = f.read(1)
        f.seek(rec.offset + rec.length - 8)
        f.write(bytes([b[0] ^ 1]))
    res = run("restore", log_path, "--region", "kv", "--out", out, "--force", code=1)
    # the refusal is one line naming the damage and where; -v lists what counts after it
    line = one_line(res)
    assert "refuses: segment " in line and "page CRC mismatch" in line, line
    assert sha(out) == good and listing(workdir) == ["concordia-data", "kv.npy"]
    assert np.load(out).shape == (64, 1024)
    res = run("restore", log_path, "--region", "kv", "--out", out, "--force", "-v", code=1)
    first, *rest = res.stderr.splitlines()
    assert first == line and rest and all(r.startswith("problem  segment ") for r in rest), res.stderr
    assert any("page CRC mismatch" in r and "(corrupt, " in r for r in rest), rest
    assert sha(out) == good and listing(workdir) == ["concordia-data", "kv.npy"]


def test_restore_onto_an_existing_output_is_one_line(log_path, workdir):
    out = workdir / "kv.npy"
    out.write_bytes(b"old")
    res = run("restore", log_path, "--region", "kv", "--out", out, code=2)
    assert one_line(res) == f"error: {out}: the output exists (pass --force to overwrite it)"
    assert out.read_bytes() == b"old" and not res.stdout


def test_restore_onto_its_own_log_is_refused(log_path, workdir):
    before = sha(log_path)
    link = workdir / "link.log"
    os.symlink(log_path, link)
    hard = workdir / "hard.log"
    os.link(log_path, hard)
    for out in (log_path, link, hard):
        res = run("restore", log_path, "--region", "kv", "--out", out, "--force", code=2)
        assert "the output is the log itself" in one_line(res)
        assert sha(log_path) == before
    res = run("restore", f"file:{log_path}", "--region", "kv", "--out", link, "--force", code=2)
    assert "the output is the log itself" in one_line(res)
    assert sha(log_path) == before
    assert sorted(listing(workdir)) == ["concordia-data", "hard.log", "link.log"]


def test_restore_output_is_complete_and_checked(log_path, workdir, history):
    import numpy as np

    out = workdir / "kv.npy"
    run("restore", log_path, "--region", "kv", "--out", out, code=0)
    assert np.array_equal(np.load(out), history[max(history)]["kv"])
    assert listing(workdir) == ["concordia-data", "kv.npy"]  # no temporary left beside it
    res = run("restore", log_path, "--region", "kv", "--out", out, code=2)
    assert "exists" in res.stderr


def test_restore_to_a_directory_or_fifo_is_refused(log_path, workdir):
    fifo = workdir / "pipe"
    os.mkfifo(fifo)
    res = run("restore", log_path, "--region", "kv", "--out", fifo, "--force", code=2)
    assert "not a regular file" in one_line(res)
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)


# -- the bench JSON and a repair's backup ------------------------------------------------

def test_bench_json_is_written_whole_or_not_at_all(tmpfs):
    from concordia.devmem.errors import DevmemError
    from concordia.tools.common import report

    out = tmpfs / "bench.json"
    report({"a": 1}, as_json=False, out=str(out), table=lambda d: "t")
    assert json.loads(out.read_text()) == {"a": 1}
    fill(tmpfs)
    before = sha(out)
    with pytest.raises(DevmemError, match="No space left"):
        report({"a": "x" * (64 << 10)}, as_json=False, out=str(out), table=lambda d: "t", force=True)
    assert sha(out) == before and listing(tmpfs) == ["bench.json", "filler"]


@pytest.mark.parametrize("bench", [
    "standby",
    pytest.param("model", marks=pytest.mark.slow),  # a tiny transformers model on the CPU, ~10 s
])
def test_bench_out_on_a_full_tmpfs_keeps_the_old_json(bench, tmpfs, tmp_path):
    # the whole run, then --out --force refused in one line: the old file as it was, no temporary left
    out = tmpfs / f"{bench}.json"
    out.write_text('{"old": true}')
    fill(tmpfs)
    before = sha(out)
    args = ["--dir", tmp_path] if bench == "model" else []
    res = run("bench", bench, "--quick", *args, "--json", "--out", out, "--force", code=2, timeout=600)
    # transformers draws its own loading bars on stderr before: the refusal is the last line, and one
    err = one_line(res) if bench == "standby" else res.stderr.strip().splitlines()[-1]
    assert err.startswith("error: ") and "No space left" in err and "Traceback" not in res.stderr
    assert not res.stdout and sha(out) == before and listing(tmpfs) == sorted([f"{bench}.json", "filler"])


def test_repair_backup_on_a_full_tmpfs(log_path, tmpfs):
    from .conftest import zero

    # a torn tail: the last record of the log cut in half
    d = json.loads(run("dump", log_path, "--json", code=0).stdout)
    last = d["records"][-1]
    zero(log_path, last["offset"] + 64, 64)
    fill(tmpfs)
    before = sha(log_path)
    res = run("verify", log_path, "--repair", "--backup", tmpfs / "backup.log", code=2)
    assert "No space left" in one_line(res)
    assert sha(log_path) == before and listing(tmpfs) == ["filler"]


# -- the other findings -----------------------------------------------------------------

def _forge_next_lsn(path: str, slot_off: int, value: int) -> None:
    with open(path, "r+b") as f:
        f.seek(slot_off)
        head = bytearray(f.read(F.SUPERBLOCK_SIZE))
        count = struct.unpack_from("<I", head, 96)[0]
        table = f.read(F.SEGMENT_ENTRY_SIZE * count)
        struct.pack_into("<Q", head, 104, value)
        struct.pack_into("<I", head, 252, F.crc32c(table, F.crc32c(bytes(head[:252]))))
        f.seek(slot_off)
        f.write(head)


def _slots(path):
    from concordia.wal import Volume

    vol = Volume.open(f"file:{path}", writable=False)
    sb = vol.superblock
    vol.close()
    return sb, (sb.sequence % 2) * sb.slot_bytes, (1 - sb.sequence % 2) * sb.slot_bytes


def test_forged_next_lsn_zero_is_reported_and_never_reused(log_path):
    from concordia.wal import Log

    sb, in_force, other = _slots(log_path)
    lsns = [r.lsn for r in Log.open(f"file:{log_path}", writable=False).records()]
    _forge_next_lsn(log_path, in_force, 0)
    res = run("verify", log_path, code=1)
    assert "would reuse LSNs" in res.stdout + res.stderr
    # a writer falls back on the other slot and writes above every LSN issued
    lg = Log.open(f"file:{log_path}", writable=True)
    assert lg.volume.superblock.next_lsn >= sb.segment_bytes
    lg.appender.commit(lg.last_committed_epoch + 1, digests={})
    new = lg.appender.write_lsn
    lg.close()
    assert new > max(lsns)
    # both slots forged: the volume is refused, never written
    _, in_force, other = _slots(log_path)
    _forge_next_lsn(log_path, in_force, 0)
    _forge_next_lsn(log_path, other, 0)
    before = sha(log_path)
    res = run("verify", log_path, code=(1, 2))
    assert "would reuse LSNs" in one_line(res)
    res = run("compact", log_path, code=(1, 2))
    assert "would reuse LSNs" in one_line(res)
    assert sha(log_path) == before


def test_dump_of_an_unknown_region_fails_naming_it(log_path):
    res = run("dump", log_path, "--region", "nosuch", code=2)
    line = one_line(res)
    assert "nosuch" in line and "kv" in line and "demo.log" in line
    assert run("dump", log_path, "--region", "kv", "--limit", "1", code=0).stdout


def test_directory_and_fifo_hints_do_not_suggest_dax(workdir):
    fifo = workdir / "fifo"
    os.mkfifo(fifo)
    for target, what in ((workdir, "a directory"), (fifo, "a FIFO")):
        for cmd in ("info", "dump"):
            line = one_line(run(cmd, target, code=2))
            assert str(target) in line and what in line and "dax:" not in line, line


def test_setup_sh_does_not_pipe_into_grep_q_under_pipefail():
    """`cmd | grep -q` under pipefail fails whenever grep leaves at its first
    match before cmd has written everything (cmd dies of SIGPIPE)."""
    text = open(os.path.join(REPO, "scripts", "setup.sh")).read()
    assert "pipefail" in text
    code = [ln.split("#", 1)[0] for ln in text.splitlines()]
    assert not [ln for ln in code if "|" in ln and "grep -q" in ln.split("|", 1)[1]], \
        "a pipe into grep -q under pipefail"
    # the hazard itself, shown: a writer with much to say after grep's first match
    demo = "set -o pipefail; { echo libpmem.so.1; head -c 8M /dev/zero | tr '\\0' x; } | grep -q libpmem"
    assert subprocess.run(["bash", "-c", demo]).returncode != 0
    fixed = "set -o pipefail; out=$(echo libpmem.so.1; head -c 8M /dev/zero | tr '\\0' x); grep -q libpmem <<<\"$out\""
    assert subprocess.run(["bash", "-c", fixed]).returncode == 0


# -- the last line of defence -----------------------------------------------------------

GUARD = textwrap.dedent("""
    import mmap, os, sys
    import numpy as np
    from concordia.tools.common import Where, install_sigbus_guard
    if sys.argv[2] == "guard":
        assert install_sigbus_guard()
    Where.target = "file:" + sys.argv[1]
    fd = os.open(sys.argv[1], os.O_RDWR)
    m = mmap.mmap(fd, os.fstat(fd).st_size)
    print(int(np.frombuffer(m, np.uint8).sum()))
""")


def test_sigbus_guard_turns_a_fault_into_one_line(tmpfs):
    """With every known mapping made safe, a SIGBUS still possible (a file cut
    under a reader, a failing disk) ends in one line and exit 2."""
    target = str(tmpfs / "hole.bin")
    with open(target, "wb") as f:
        f.truncate(16 << 20)
    fill(tmpfs)
    env = dict(os.environ)
    env.pop("PYTHONFAULTHANDLER", None)
    bare = subprocess.run([PY, "-c", GUARD, target, "bare"], capture_output=True, text=True, env=env, timeout=60)
    assert bare.returncode == -signal.SIGBUS  # the fault is real
    res = subprocess.run([PY, "-c", GUARD, target, "guard"], capture_output=True, text=True, env=env, timeout=60)
    assert res.returncode == 2, res
    line = one_line(res)
    assert f"file:{target}" in line and "SIGBUS" in line


def test_region_and_epoch_errors_are_one_line_naming_the_log(log_path, workdir):
    for args in (["restore", log_path, "--region", "nosuch", "--out", workdir / "x.npy"],
                 ["snapshot", "create", log_path, "--region", "nosuch"],
                 ["restore", log_path, "--region", "kv", "--epoch", "999", "--out", workdir / "x.npy"],
                 ["recover", log_path, "--plan", "--epoch", "999"]):
        line = one_line(run(*args, code=2))
        assert "demo.log" in line, line
    assert listing(workdir) == ["concordia-data"]


def test_demo_on_a_full_tmpfs_leaves_no_log(tmpfs):
    demo = os.path.join(os.path.dirname(WAL), "concordia")
    res = subprocess.run([demo, "demo", "--log", f"file:{tmpfs}/demo.log", "--steps", "8", "--kill-at", "3",
                          "--device", "cpu"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 2, res
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1 and "No space left" in errors[0] and "Traceback" not in res.stderr
    assert listing(tmpfs) == []


def test_format_finds_data_in_a_large_sparse_file(tmp_path):
    """The check for data reads the file's data extents, not its holes."""
    target = tmp_path / "big.bin"
    with open(target, "wb") as f:
        f.truncate(8 << 30)
        f.seek((7 << 30) + 5)
        f.write(b"x")
    before = os.stat(target).st_blocks
    line = one_line(run("format", target, "--size", "8G", code=2))
    assert f"nonzero byte at 0x{(7 << 30) + 5:x}" in line
    assert os.stat(target).st_blocks == before and os.stat(target).st_size == 8 << 30
