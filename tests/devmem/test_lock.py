"""The advisory writer lock: `Backend.lock()` takes flock(LOCK_EX | LOCK_NB) on
the file or device under the mapping; a second writer, in another process or
in this one, is refused with a one-line LockedError naming the holder's pid;
readers take no lock; close gives it back."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from concordia.devmem import open_backend
from concordia.devmem.devdax import DevDaxBackend
from concordia.devmem.errors import LockedError
from concordia.tools.common import EXIT_USAGE, exit_code_of

SIZE = 4 << 20

HOLDER = textwrap.dedent("""
    import sys
    from concordia.devmem import open_backend
    from concordia.devmem.devdax import DevDaxBackend
    spec = sys.argv[1]
    if spec.startswith("emulate:"):
        b = DevDaxBackend.emulate(spec[8:], alignment=1 << 20)
    else:
        b = open_backend(spec)
    b.lock()
    print("locked", flush=True)
    sys.stdin.read()  # hold it until the test closes our stdin
    b.close()
""")


class Holder:
    """Another process holding the writer lock of `spec`."""

    def __init__(self, spec: str):
        self.p = subprocess.Popen([sys.executable, "-c", HOLDER, spec], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)
        line = self.p.stdout.readline()
        assert line.strip() == "locked", line

    def release(self) -> None:
        self.p.stdin.close()
        assert self.p.wait(timeout=30) == 0


def _spec(tier: str, tmp_path, name: str) -> str:
    if tier == "shm":
        return f"shm:concordia-locktest-{os.getpid()}-{name}"
    path = tmp_path / name
    if tier == "emulate":
        with open(path, "wb") as f:
            f.truncate(SIZE)
        return f"emulate:{path}"
    return f"{tier}:{path}"


def _open(spec: str, **kw):
    if spec.startswith("emulate:"):
        return DevDaxBackend.emulate(spec[8:], alignment=1 << 20, **kw)
    return open_backend(spec, **kw)


@pytest.fixture(params=["file", "shm", "pmem", "emulate"])
def spec(request, tmp_path):
    s = _spec(request.param, tmp_path, "log")
    if not s.startswith("emulate:"):
        open_backend(s, size=SIZE, create=True).close()
    yield s
    if request.param == "shm":
        os.unlink("/dev/shm/" + s[4:])


def test_second_process_is_refused_with_the_holders_pid(spec):
    h = Holder(spec)
    try:
        b = _open(spec)
        try:
            with pytest.raises(LockedError) as ei:
                b.lock()
            text = str(ei.value)
            assert f"log is open for writing by another process (pid {h.p.pid})" in text
            assert "\n" not in text and exit_code_of(ei.value) == EXIT_USAGE  # as a command line reports it
            assert not b.locked
        finally:
            b.close()
        r = _open(spec, readonly=True)  # readers take no lock
        r.lock()  # a read-only backend has nothing to lock
        assert not r.locked
        r.close()
    finally:
        h.release()
    b = _open(spec)  # the holder is gone: free again
    b.lock()
    assert b.locked
    b.close()


def test_second_open_in_one_process_and_close_releases(spec):
    a = _open(spec)
    a.lock()
    a.lock()  # twice on one backend: harmless
    b = _open(spec)
    with pytest.raises(LockedError, match=f"in this process \\(pid {os.getpid()}\\)"):
        b.lock()
    a.close()
    b.lock()
    assert b.locked
    b.close()
    assert not b.locked


def test_a_dead_holder_leaves_no_lock(spec):
    p = subprocess.Popen([sys.executable, "-c", HOLDER, spec], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "locked"
    p.kill()
    p.wait(timeout=30)
    b = _open(spec)
    b.lock()
    assert b.locked
    b.close()


def test_volatile_tiers_have_nothing_to_lock():
    m = open_backend("memory:", size=1 << 20)
    m.lock()
    assert not m.locked
    m.close()
