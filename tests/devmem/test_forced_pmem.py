"""Runs the pmem conformance class in a child process whose environment has
PMEM_IS_PMEM_FORCE=1 before libpmem loads (libpmem reads it only then)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from concordia.devmem import libpmem

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


@pytest.mark.skipif(not libpmem.available(), reason="libpmem1 is not installed")
@pytest.mark.parametrize("klass", ["TestPmemForced", "TestDevDaxEmulatedForced"])
def test_forced_pmem_conformance_in_a_child(klass, tmp_path):
    env = dict(os.environ, PMEM_IS_PMEM_FORCE="1")
    env.pop("PYTEST_XDIST_WORKER", None)
    path = os.path.join(HERE, "test_conformance.py")
    if klass not in open(path).read():
        pytest.skip(f"{klass} not defined")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        "-o", "addopts=", f"{path}::{klass}", "--basetemp", str(tmp_path / "t")],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    tail = r.stdout[-3000:] + r.stderr[-2000:]
    assert r.returncode == 0, tail
    m = re.search(r"(\d+) passed", r.stdout)
    assert m and int(m.group(1)) >= 8, tail
    assert "skipped" not in r.stdout.splitlines()[-1], tail
