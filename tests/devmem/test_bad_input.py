"""Bad input: each case ends in a one-line DevmemError subclass naming what is
wrong, and creates or changes nothing.  Cases that root cannot produce honestly
(permission bits do not stop root) run as the unprivileged user `nobody` in a
child process."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile

import pytest

from concordia.devmem import errors as E
from concordia.devmem import libpmem, open_backend
from concordia.devmem.devdax import DevDaxBackend

NOBODY = 65534
is_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to chown / switch to nobody")


def snapshot(*dirs) -> dict:
    """Everything observable about the files under `dirs`: names, modes, owners,
    sizes, modification times and contents."""
    out = {}
    for d in dirs:
        d = str(d)
        if not os.path.isdir(d):   # one path: its state, or that it is absent
            out[d] = _state(d) if os.path.lexists(d) else None
            continue
        for base, subdirs, files in os.walk(d):
            for name in subdirs + files:
                p = os.path.join(base, name)
                st = os.lstat(p)
                digest = None
                if os.path.isfile(p) and not os.path.islink(p):
                    with open(p, "rb") as f:
                        digest = hashlib.sha256(f.read()).hexdigest()
                out[p] = (st.st_mode, st.st_uid, st.st_size, st.st_mtime_ns, digest)
    return out


def _state(p):
    st = os.lstat(p)
    digest = None
    if os.path.isfile(p) and not os.path.islink(p):
        with open(p, "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()
    return (st.st_mode, st.st_uid, st.st_size, st.st_mtime_ns, digest)


def shm_path(name):
    """The one /dev/shm entry a test may touch: /dev/shm as a whole changes
    under other tests running in parallel."""
    return os.path.join("/dev/shm", name)


def refused(cls, fn, *dirs):
    """Call fn, expect `cls`, check the message is one line and `dirs` unchanged."""
    before = snapshot(*dirs)
    with pytest.raises(cls) as ei:
        fn()
    err = ei.value
    assert type(err) is cls, f"{type(err).__name__} is not {cls.__name__}"
    assert isinstance(err, E.DevmemError)
    text = str(err)
    assert text and "\n" not in text and text == err.one_line()
    assert snapshot(*dirs) == before
    return err


@pytest.fixture
def existing(tmp_path):
    p = tmp_path / "log"
    with open(p, "wb") as f:
        f.write(os.urandom(64 << 10))
    os.chmod(p, 0o600)
    return p


@pytest.fixture
def shm_name():
    name = f"concordia-bad-{os.getpid()}-{os.urandom(4).hex()}"
    yield name
    p = os.path.join("/dev/shm", name)
    if os.path.exists(p):
        os.unlink(p)


# -- missing path ---------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["file", "pmem"])
def test_missing_path(tmp_path, kind):
    err = refused(E.PathNotFoundError, lambda: open_backend(f"{kind}:{tmp_path / 'nope'}"), tmp_path)
    assert "nope" in str(err)


def test_missing_parent_directory_when_creating(tmp_path):
    refused(E.PathNotFoundError,
            lambda: open_backend(f"file:{tmp_path / 'no' / 'log'}", size=1 << 16, create=True),
            tmp_path)


def test_missing_shm_object(shm_name):
    refused(E.PathNotFoundError, lambda: open_backend(f"shm:{shm_name}"), shm_path(shm_name))


def test_missing_dax_device(tmp_path):
    refused(E.PathNotFoundError, lambda: open_backend("dax:/dev/dax-does-not-exist.0"), tmp_path)


# -- not a DAX device -----------------------------------------------------------------

def test_regular_file_is_not_a_dax_device(existing):
    err = refused(E.NotADaxDeviceError, lambda: open_backend(f"dax:{existing}"), existing.parent)
    assert "character device" in str(err)


def test_other_character_device_is_not_a_dax_device(tmp_path):
    err = refused(E.NotADaxDeviceError, lambda: open_backend("dax:/dev/null"), tmp_path)
    assert "1:3" in str(err) and "dax" in str(err)


def test_sysfs_without_geometry_is_not_a_dax_device(tmp_path):
    """A device that claims the dax subsystem but whose sysfs has no size."""
    from concordia.devmem.devdax import read_dax_geometry

    rdev = os.makedev(250, 3)
    node = tmp_path / "sys" / "dev" / "char" / "250:3"
    (tmp_path / "sys" / "class" / "dax").mkdir(parents=True)
    node.mkdir(parents=True)
    os.symlink(tmp_path / "sys" / "class" / "dax", node / "subsystem")
    refused(E.NotADaxDeviceError, lambda: read_dax_geometry(rdev, "dax:x", str(tmp_path / "sys")))
    (node / "size").write_text("4294967296\n")
    (node / "device").mkdir()
    (node / "device" / "align").write_text("2097152\n")
    assert read_dax_geometry(rdev, "dax:x", str(tmp_path / "sys")) == (4 << 30, 2 << 20)


# -- foreign owner ----------------------------------------------------------------------

@is_root
@pytest.mark.parametrize("kind", ["file", "pmem", "shm"])
def test_foreign_owner_refused_unless_allowed(existing, kind, shm_name):
    path = existing
    if kind == "shm":
        path = os.path.join("/dev/shm", shm_name)
        shutil.copyfile(existing, path)
        os.chmod(path, 0o600)
    os.chown(path, NOBODY, NOBODY)
    spec = f"shm:{shm_name}" if kind == "shm" else f"{kind}:{path}"
    where = shm_path(shm_name) if kind == "shm" else existing.parent
    err = refused(E.ForeignOwnerError, lambda: open_backend(spec), where)
    assert f"uid {NOBODY}" in str(err) and "allow_foreign_owner" in str(err)
    with open_backend(spec, allow_foreign_owner=True) as b:
        assert b.size == 64 << 10


@is_root
def test_foreign_owner_of_an_emulated_dax_device(tmp_path):
    p = tmp_path / "dax"
    with open(p, "wb") as f:
        f.truncate(2 << 20)
    os.chown(p, NOBODY, NOBODY)
    refused(E.ForeignOwnerError, lambda: DevDaxBackend.emulate(str(p)), tmp_path)


# -- sizes ------------------------------------------------------------------------------

@pytest.mark.parametrize("size", [0, 100, 4095, 4097, (1 << 20) + 64, -4096])
@pytest.mark.parametrize("kind", ["file", "pmem"])
def test_bad_size_when_creating(tmp_path, kind, size):
    refused(E.BadSizeError, lambda: open_backend(f"{kind}:{tmp_path / 'log'}", size=size,
                                                 create=True), tmp_path)


def test_bad_size_shm(shm_name):
    refused(E.BadSizeError, lambda: open_backend(f"shm:{shm_name}", size=1000, create=True),
            shm_path(shm_name))


def test_creating_without_a_size(tmp_path):
    refused(E.BadSizeError, lambda: open_backend(f"file:{tmp_path / 'log'}", create=True), tmp_path)


def test_existing_file_smaller_than_asked(existing):
    err = refused(E.BadSizeError, lambda: open_backend(f"file:{existing}", size=1 << 20),
                  existing.parent)
    assert str(64 << 10) in str(err) and "create=True" in str(err)


def test_existing_empty_file(tmp_path):
    p = tmp_path / "empty"
    p.touch()
    os.chmod(p, 0o600)
    refused(E.BadSizeError, lambda: open_backend(f"file:{p}"), tmp_path)


@pytest.mark.parametrize("size", [1 << 20, (2 << 20) + 4096, 6 << 20])
def test_devdax_size_not_a_multiple_of_its_alignment_or_too_large(tmp_path, size):
    p = tmp_path / "dax"
    with open(p, "wb") as f:
        f.truncate(4 << 20)
    os.chmod(p, 0o600)
    err = refused(E.BadSizeError, lambda: DevDaxBackend.emulate(str(p), alignment=2 << 20,
                                                                size=size), tmp_path)
    assert str(size) in str(err)


def test_devdax_stand_in_of_a_length_off_the_alignment(tmp_path):
    p = tmp_path / "dax"
    with open(p, "wb") as f:
        f.truncate(3 << 20)
    os.chmod(p, 0o600)
    refused(E.BadSizeError, lambda: DevDaxBackend.emulate(str(p), alignment=2 << 20), tmp_path)


@pytest.mark.parametrize("size", [None, 0, 100])
def test_memory_sizes(size):
    refused(E.BadSizeError, lambda: open_backend("memory:", size=size))


# -- read-only --------------------------------------------------------------------------

def test_read_only_file_refused_for_writing_even_for_root(existing):
    os.chmod(existing, 0o400)
    err = refused(E.ReadOnlyError, lambda: open_backend(f"file:{existing}"), existing.parent)
    assert "0400" in str(err)
    with open_backend(f"file:{existing}", readonly=True) as b:     # reading is fine
        assert b.view.readonly and b.readonly
        assert bytes(b.view[:16]) == existing.read_bytes()[:16]
        with pytest.raises(E.ReadOnlyError):
            b.persist(0, 16)


def test_create_read_only_is_contradictory(tmp_path):
    refused(E.ReadOnlyError, lambda: open_backend(f"file:{tmp_path / 'x'}", size=4096,
                                                  create=True, readonly=True), tmp_path)


# -- as an unprivileged user -------------------------------------------------------------

def as_nobody(spec, **kw) -> dict:
    """open_backend(spec, **kw) in a forked child that dropped to uid/gid nobody
    (same interpreter and modules, so nothing needs to be readable by nobody)."""
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:   # child: never returns into pytest
        code = 0
        try:
            os.close(rfd)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            try:
                open_backend(spec, **kw).close()
                out = {"ok": True}
            except E.DevmemError as e:
                out = {"ok": False, "cls": type(e).__name__, "msg": str(e)}
            os.write(wfd, json.dumps(out).encode())
        except BaseException as e:   # report anything else to the parent
            os.write(wfd, json.dumps({"ok": False, "cls": type(e).__name__, "msg": str(e)}).encode())
            code = 1
        finally:
            os._exit(code)
    os.close(wfd)
    with os.fdopen(rfd, "rb") as f:
        data = f.read()
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status), status
    return json.loads(data)


@pytest.fixture
def open_dir():
    """A directory `nobody` can traverse (pytest's tmp_path is 0700)."""
    d = tempfile.mkdtemp(prefix="concordia-perm-")
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d)


needs_nobody = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to switch to nobody")


@needs_nobody
def test_permission_denied_creating_in_a_directory_of_another_user(open_dir):
    before = snapshot(open_dir)
    got = as_nobody(f"file:{open_dir}/log", size=1 << 16, create=True)
    assert got["cls"] == "PermissionDeniedError" and "\n" not in got["msg"], got
    assert open_dir in got["msg"]
    assert snapshot(open_dir) == before


@needs_nobody
def test_permission_denied_opening_a_file_of_another_user(open_dir):
    p = os.path.join(open_dir, "log")
    with open(p, "wb") as f:
        f.write(b"\1" * 4096)
    os.chmod(p, 0o600)
    before = snapshot(open_dir)
    got = as_nobody(f"file:{p}", allow_foreign_owner=True)
    assert got["cls"] == "PermissionDeniedError", got
    got = as_nobody(f"file:{p}")        # without the permission: the owner check speaks first
    assert got["cls"] == "ForeignOwnerError", got
    assert snapshot(open_dir) == before


@needs_nobody
def test_read_only_file_of_ones_own_as_unprivileged_user(open_dir):
    p = os.path.join(open_dir, "log")
    with open(p, "wb") as f:
        f.write(b"\2" * 4096)
    os.chown(p, NOBODY, NOBODY)
    os.chmod(p, 0o400)
    before = snapshot(open_dir)
    got = as_nobody(f"file:{p}")
    assert got["cls"] == "ReadOnlyError", got
    assert as_nobody(f"file:{p}", readonly=True)["ok"]
    assert snapshot(open_dir) == before


# -- libpmem -------------------------------------------------------------------------------

def test_libpmem_required_but_missing(tmp_path, monkeypatch):
    monkeypatch.setattr(libpmem, "SONAME", "libpmem-not-installed.so.1")
    err = refused(E.LibpmemUnavailableError,
                  lambda: open_backend(f"pmem:{tmp_path / 'log'}", size=1 << 16, create=True,
                                       libpmem="require"), tmp_path)
    assert "libpmem-not-installed.so.1" in str(err) and "apt-get install libpmem1" in str(err)
    with open_backend(f"pmem:{tmp_path / 'log'}", size=1 << 16, create=True) as b:   # auto: fallback
        assert b.mapped_by == "mmap" and b.persist_path == "msync"


def test_libpmem_required_but_switched_off(tmp_path, monkeypatch):
    monkeypatch.setenv(libpmem.ENV_SWITCH, "off")
    refused(E.LibpmemUnavailableError,
            lambda: open_backend(f"pmem:{tmp_path / 'log'}", size=1 << 16, create=True,
                                 libpmem="require"), tmp_path)


def test_bad_libpmem_mode(tmp_path):
    refused(E.BadSpecError, lambda: open_backend(f"file:{tmp_path / 'x'}", libpmem="maybe"), tmp_path)


# -- NUMA --------------------------------------------------------------------------------------

@pytest.mark.parametrize("node", [4096, -1, "0"])
def test_numa_node_that_does_not_exist(shm_name, node):
    err = refused(E.NumaNodeError, lambda: open_backend(f"shm:{shm_name}", size=1 << 16,
                                                        create=True, numa_node=node), shm_path(shm_name))
    assert str(node) in str(err)


def test_numa_node_on_a_tier_without_numa(tmp_path):
    refused(E.BadSpecError, lambda: open_backend(f"file:{tmp_path / 'x'}", size=4096, create=True,
                                                 numa_node=0), tmp_path)


# -- names ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("spec", ["", "file:", "pmem:", "dax:", "shm:", "memory:x", "pinned:/x",
                                  "tape:/dev/st0"])
def test_bad_names(spec, tmp_path):
    refused(E.BadSpecError, lambda: open_backend(spec, size=4096), tmp_path)


def test_directory_is_not_a_log(tmp_path):
    refused(E.BadSpecError, lambda: open_backend(f"file:{tmp_path}"), tmp_path)


def test_pinned_without_cuda():
    from conftest import gpu_unavailable_reason

    if gpu_unavailable_reason() is None:
        pytest.skip("a GPU is present: pinned memory works (TestPinned covers it)")
    refused(E.CudaUnavailableError, lambda: open_backend("pinned:", size=4096))


def test_a_create_the_disk_cannot_hold_leaves_no_file(tmp_path):
    """The blocks are reserved before any store (a store into a hole of a full
    disk is a SIGBUS): a size the file system cannot give is an error, and the
    file the create made is taken back."""
    with pytest.raises(E.DevmemError) as info:
        open_backend(f"file:{tmp_path / 'log'}", size=1 << 60, create=True)
    assert "\n" not in str(info.value) and str(tmp_path / "log") in str(info.value)
    assert os.listdir(tmp_path) == []


def test_taking_back_a_create_spares_a_file_that_replaced_it(tmp_path):
    from concordia.devmem.tiers import discard_created
    path = tmp_path / "log"
    path.write_bytes(b"mine")
    st = os.stat(path)
    other = tmp_path / "other"
    other.write_bytes(b"theirs")
    os.replace(other, path)
    discard_created(str(path), (st.st_dev, st.st_ino))
    assert path.read_bytes() == b"theirs"
    discard_created(str(path), (os.stat(path).st_dev, os.stat(path).st_ino))
    assert not path.exists()
