"""Logs on every tier that outlives a session and works without special hardware."""

from __future__ import annotations

import glob
import os

import pytest

from tests.conftest import SHM_DIR, shm_test_name


@pytest.fixture
def file_log(tmp_path):
    return f"file:{tmp_path / 'session.log'}"


def _fresh_shm_log():
    """A unique shm: log name; afterwards, pass or fail, the log and every
    file a test named after it (`shm_log + "-h"`, a copy beside it) are
    removed from /dev/shm."""
    name = shm_test_name()
    yield f"shm:{name}"
    for path in glob.glob(os.path.join(SHM_DIR, glob.escape(name) + "*")):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


@pytest.fixture
def shm_log():
    yield from _fresh_shm_log()


@pytest.fixture(params=["file", "shm"])
def persistent_log(request, tmp_path):
    """A log name on a tier that outlives the session that wrote it."""
    if request.param == "file":
        yield f"file:{tmp_path / 'session.log'}"
    else:
        yield from _fresh_shm_log()
