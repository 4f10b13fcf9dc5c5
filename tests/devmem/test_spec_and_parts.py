"""Log names, tier detection, the libpmem bindings, NUMA placement and the
up-front refusals of host registration (the GPU side is in test_cuda_host.py)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from concordia.devmem import Survives, detect_kind, open_backend, parse_spec
from concordia.devmem import errors as E
from concordia.devmem import libpmem


@pytest.mark.parametrize("spec,kind,path", [
    ("dax:/dev/dax0.0", "devdax", "/dev/dax0.0"),
    ("pmem:/mnt/pmem/log", "pmem", "/mnt/pmem/log"),
    ("shm:mylog", "shm", "/dev/shm/mylog"),
    ("shm:/dev/shm/other", "shm", "/dev/shm/other"),
    ("file:/var/tmp/log", "file", "/var/tmp/log"),
    ("pinned:", "pinned", None),
    ("memory:", "memory", None),
    ("/dev/shm/plain", "shm", "/dev/shm/plain"),
    ("/dev/null", "devdax", "/dev/null"),   # a character device is taken for DAX (then checked)
])
def test_parse_spec(spec, kind, path):
    s = parse_spec(spec)
    assert (s.kind, s.path, s.text) == (kind, path, spec)


def test_plain_paths_are_detected(tmp_path):
    assert detect_kind(str(tmp_path / "log")) in ("file", "shm")   # tmp may be tmpfs
    assert detect_kind("/dev/shm/x/y/z") == "shm"
    assert parse_spec("relative/log").path == os.path.abspath("relative/log")


def test_plain_path_opens_the_detected_tier(tmp_path):
    with open_backend(str(tmp_path / "log"), size=1 << 16, create=True) as b:
        assert b.kind == detect_kind(str(tmp_path / "log"))
    name = f"/dev/shm/concordia-plain-{os.getpid()}"
    try:
        with open_backend(name, size=1 << 16, create=True) as b:
            assert b.kind == "shm" and b.survives == Survives.PROCESS_CRASH
    finally:
        os.unlink(name)


def test_a_backend_passes_through_open_backend():
    with open_backend("memory:", size=4096) as b:
        assert open_backend(b) is b


def test_create_grows_but_never_shrinks(tmp_path):
    p = tmp_path / "log"
    with open_backend(f"file:{p}", size=8192, create=True) as b:
        b.view[:4] = b"keep"
        b.persist(0, 4)
    with open_backend(f"file:{p}", size=16384, create=True) as b:
        assert b.size == 16384 and bytes(b.view[:4]) == b"keep"
    with open_backend(f"file:{p}", size=4096) as b:          # a prefix of a larger file
        assert b.size == 4096
    assert os.path.getsize(p) == 16384


# -- libpmem bindings ----------------------------------------------------------------------

needs_libpmem = pytest.mark.skipif(not libpmem.available(), reason="libpmem1 is not installed")


@needs_libpmem
def test_libpmem_bindings_on_a_file(tmp_path):
    lib = libpmem.load("require")
    p = tmp_path / "f"
    with open(p, "wb") as f:
        f.truncate(1 << 16)
    ptr, n, is_pmem = lib.map_file(str(p))
    assert n == 1 << 16 and is_pmem == lib.is_pmem(lib.address(ptr), n)
    addr = lib.address(ptr)
    src = np.arange(4096, dtype=np.uint8)
    lib.memcpy_nodrain(addr + 4096, src)
    lib.drain()
    lib.flush(addr, 64)
    lib.drain()
    lib.persist(addr, 4096)
    lib.msync(addr + 4096, 4096)
    assert bytes(lib.ffi.buffer(ptr, n)[4096:8192]) == src.tobytes()
    del ptr                                   # unmapped by the cdata's destructor
    assert (tmp_path / "f").read_bytes()[4096:8192] == src.tobytes()


@needs_libpmem
def test_libpmem_failure_is_an_oserror_with_its_message(tmp_path):
    lib = libpmem.load("require")
    with pytest.raises(OSError) as ei:
        lib.map_file(str(tmp_path / "absent"))
    assert ei.value.errno == 2 and ei.value.strerror


@needs_libpmem
def test_libpmem_mapping_errors_become_devmem_errors(tmp_path):
    """An errno from libpmem goes through the same map as one from the OS."""
    from concordia.devmem.backend import os_error

    err = os_error(OSError(13, "pmem_map_file: Permission denied"), str(tmp_path), "cannot map")
    assert isinstance(err, E.PermissionDeniedError) and "owner" in str(err)
    assert isinstance(os_error(OSError(30, "x"), "p", "map"), E.ReadOnlyError)


def test_switch_forces_the_fallback(tmp_path, monkeypatch):
    monkeypatch.setenv(libpmem.ENV_SWITCH, "off")
    assert libpmem.load("auto") is None
    with open_backend(f"pmem:{tmp_path / 'log'}", size=1 << 16, create=True) as b:
        assert b.mapped_by == "mmap" and b.persist_path == "msync" and not b.is_pmem
        assert b.survives == Survives.HOST_CRASH    # no DAX here: honest about it


# -- NUMA ---------------------------------------------------------------------------------

def test_shm_bound_to_a_node_has_its_pages_there():
    from concordia.devmem.numa import node_of, nodes_with_memory

    node = min(nodes_with_memory())
    name = f"concordia-numa-{os.getpid()}"
    try:
        with open_backend(f"shm:{name}", size=1 << 20, create=True, numa_node=node) as b:
            b.array[:] = 1
            assert b.numa_node == node
            assert {node_of(b.address + off) for off in range(0, b.size, 64 << 10)} == {node}
    finally:
        os.unlink(f"/dev/shm/{name}")


# -- host registration: refusals that need no GPU --------------------------------------------

@pytest.mark.parametrize("kind", ["file", "pmem"])
def test_registration_refused_up_front(tmp_path, kind):
    from concordia.devmem.cuda_host import register

    with open_backend(f"{kind}:{tmp_path / 'log'}", size=1 << 16, create=True) as b:
        assert not b.gpu_mappable
        with pytest.raises(E.HostRegisterRefusedError) as ei:
            register(b)
        assert "staging ring" in str(ei.value) and "\n" not in str(ei.value)


def test_registration_without_cuda_says_so():
    from conftest import gpu_unavailable_reason

    from concordia.devmem.cuda_host import register

    if gpu_unavailable_reason() is None:
        pytest.skip("a GPU is present (test_cuda_host.py covers registration)")
    with open_backend("memory:", size=1 << 16) as b:
        with pytest.raises(E.CudaUnavailableError):
            register(b)


# -- what `survives` promises, checked by killing the writer ------------------------------

@pytest.mark.parametrize("kind", ["shm", "file"])
def test_persisted_bytes_outlive_a_killed_writer(tmp_path, kind):
    import signal

    spec = f"shm:concordia-kill-{os.getpid()}" if kind == "shm" else f"file:{tmp_path / 'log'}"
    data = np.random.default_rng(5).integers(0, 256, 1 << 16, dtype=np.uint8)
    pid = os.fork()
    if pid == 0:
        try:
            b = open_backend(spec, size=1 << 16, create=True)
            b.array[:] = data
            b.persist(0, b.size)
        finally:
            os.kill(os.getpid(), signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    with open_backend(spec) as b:
        try:
            assert b.survives >= Survives.PROCESS_CRASH
            assert np.array_equal(b.array, data)
        finally:
            if kind == "shm":
                os.unlink(b.path)


def test_a_symlinked_log_opens(tmp_path):
    with open_backend(f"file:{tmp_path / 'real'}", size=8192, create=True) as b:
        b.view[:2] = b"ok"
        b.persist(0, 2)
    os.symlink(tmp_path / "real", tmp_path / "link")
    with open_backend(f"file:{tmp_path / 'link'}") as b:
        assert bytes(b.view[:2]) == b"ok"


def test_an_os_failure_while_persisting_is_a_devmem_error_naming_the_offset():
    """The base class turns a tier's OSError (an msync hitting EIO) into a one-line
    DevmemError with backend and offset."""
    from concordia.devmem import Backend

    class FailingTier(Backend):
        kind = "file"

        def _persist(self, offset, length):
            raise OSError(5, "Input/output error")

        def _release(self):
            pass

    buf = bytearray(8192)
    b = FailingTier(path="/x/log", size=8192, alignment=4096, view=memoryview(buf), address=0)
    with pytest.raises(E.DevmemError) as ei:
        b.persist(4096, 10)
    assert str(ei.value) == "file:/x/log @ 0x1000: persist failed: Input/output error"
    with pytest.raises(E.DevmemError):
        b.flush(0, 1)
    b.close()
