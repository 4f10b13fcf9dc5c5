"""Space before mapping: a writable open reserves a file's holes, a read-only
open of a sparse file on tmpfs reads a copy instead of mapping the holes, and
a failed create takes back exactly the file it made."""

from __future__ import annotations

import hashlib
import os
import subprocess
import uuid

import pytest

from concordia.devmem import open_backend
from concordia.devmem.errors import DevmemError


def _sha(path) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _sparse(path, size: int, data: dict[int, bytes]) -> None:
    with open(path, "wb") as f:
        f.truncate(size)
        for off, b in data.items():
            f.seek(off)
            f.write(b)


@pytest.fixture
def tmpfs(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root (the CI runs these tests as root)")
    mnt = tmp_path / f"mnt-{uuid.uuid4().hex[:8]}"
    mnt.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4M", "tmpfs", str(mnt)], capture_output=True, text=True)
    if res.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {res.stderr.strip() or res.returncode}")
    yield mnt
    if subprocess.run(["umount", str(mnt)], capture_output=True).returncode:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_writable_open_reserves_the_holes(tmp_path):
    path = tmp_path / "x.log"
    _sparse(path, 4 << 20, {8192: b"abc", (3 << 20) + 5: b"xyz"})
    before = _sha(path)
    assert os.stat(path).st_blocks * 512 < 4 << 20
    b = open_backend(f"file:{path}")
    try:
        assert os.stat(path).st_blocks * 512 >= 4 << 20
        assert bytes(b.view[8192:8195]) == b"abc"
    finally:
        b.close()
    assert _sha(path) == before


def test_read_only_open_of_a_sparse_file_on_tmpfs_reads_a_copy(tmpfs):
    path = tmpfs / "x.log"
    data = {4096: b"head", (2 << 20) + 100: b"middle", (8 << 20) - 4: b"tail"}
    _sparse(path, 8 << 20, data)  # twice the mount: its holes can never be filled
    b = open_backend(f"file:{path}", readonly=True)
    try:
        assert b.mapped_by == "pread" and b.readonly
        for off, want in data.items():
            assert bytes(b.view[off:off + len(want)]) == want
        assert int(b.array.sum()) == sum(sum(v) for v in data.values())  # every hole reads as zero
    finally:
        b.close()
    # a writer cannot reserve it: one error, the bytes as they were
    before = _sha(path)
    with pytest.raises(DevmemError, match="No space left"):
        open_backend(f"file:{path}")
    assert _sha(path) == before


def test_a_file_without_holes_is_mapped(tmpfs):
    path = tmpfs / "x.log"
    path.write_bytes(b"\1" * (1 << 20))
    b = open_backend(f"file:{path}", readonly=True)
    try:
        assert b.mapped_by == "mmap"
    finally:
        b.close()


def test_discard_removes_only_the_file_it_made(tmp_path):
    path = tmp_path / "new.log"
    b = open_backend(f"file:{path}", size=1 << 20, create=True)
    assert b.created
    b.discard()
    assert not path.exists()
    # a file put in its place since is someone else's
    b = open_backend(f"file:{path}", size=1 << 20, create=True)
    other = tmp_path / "other"
    other.write_bytes(b"not mine")
    os.replace(other, path)
    b.discard()
    assert path.read_bytes() == b"not mine"
    # and a file that existed before the open is only closed
    b = open_backend(f"file:{path}", size=1 << 20, create=True)
    assert not b.created
    b.discard()
    assert path.exists()
