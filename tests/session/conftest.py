"""Logs on every tier that outlives a session and works without special hardware."""

from __future__ import annotations

import os
import uuid

import pytest


@pytest.fixture
def file_log(tmp_path):
    return f"file:{tmp_path / 'session.log'}"


def _fresh_shm_log():
    """A unique shm: log name, removed from /dev/shm afterwards."""
    name = f"concordia-test-{uuid.uuid4().hex[:12]}"
    yield f"shm:{name}"
    try:
        os.unlink(os.path.join("/dev/shm", name))
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
