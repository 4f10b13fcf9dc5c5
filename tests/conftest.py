"""Shared fixtures.  GPU tests carry the `gpu` marker and skip, with the reason,
where CuPy or a CUDA device is missing."""

from __future__ import annotations

import functools

import pytest


@functools.lru_cache(maxsize=1)
def gpu_unavailable_reason() -> str | None:
    try:
        import cupy
    except Exception as exc:  # ImportError or a broken CUDA install
        return f"CuPy not importable ({type(exc).__name__}: {exc})"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:
        return f"no CUDA device ({exc})"
    if n < 1:
        return "no CUDA device"
    return None


def pytest_collection_modifyitems(config, items):
    reason = gpu_unavailable_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=f"gpu test: {reason}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def hugetlb_mount():
    """A directory on a hugetlbfs with free 2 MiB pages (set up as root and put
    back afterwards, see tests/hugepages.py); skips with the reason where none
    can be had."""
    from tests.hugepages import hugetlbfs

    with hugetlbfs() as (where, why):
        if where is None:
            pytest.skip(f"hugetlb tier: {why}")
        yield where
