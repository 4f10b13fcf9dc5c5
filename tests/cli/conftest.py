"""Logs made by the engine for the command-line tests: a 16 MiB file volume
with 1 MiB segments holding two regions (`kv`, `adapter`) and committed
epochs that run into a second segment, built once per session and copied
into each test's own directory as ./concordia-data/demo.log (the path the
--help examples use)."""

from __future__ import annotations

import hashlib
import os
import shutil

import numpy as np
import pytest

from concordia.wal import Log, region_digest
from concordia.wal import format as F

EPOCHS = 16
KV_SHAPE = (64, 1024)  # float32: 64 pages of 4 KiB
AD_BYTES = 3000  # uint8: 3 pages of 1 KiB, the last one short


def _pages(arr: np.ndarray, pb: int) -> np.ndarray:
    flat = arr.reshape(-1).view(np.uint8)
    n = -(-flat.size // pb)
    out = np.zeros(n * pb, np.uint8)
    out[:flat.size] = flat
    return out.reshape(n, pb)


def build_log(path: str, *, epochs: int = EPOCHS, seed: int = 0) -> dict:
    """Write a log at `path`; returns the region images after every epoch."""
    rng = np.random.default_rng(seed)
    log = Log.create(f"file:{path}", size=16 << 20, segment_size=1 << 20)
    kv = np.zeros(KV_SHAPE, np.float32)
    ad = np.zeros(AD_BYTES, np.uint8)
    rid = log.define_region("kv", kv.dtype.str, kv.shape, 4096, "kv")
    aid = log.define_region("adapter", "|u1", ad.shape, 1024, "adapter")
    history = {}
    for e in range(1, epochs + 1):
        n = 64 if e == 1 else 16
        ids = np.arange(64, dtype=np.uint32) if e == 1 else np.sort(rng.choice(64, n, replace=False)).astype(np.uint32)
        kv[ids] = rng.standard_normal((n, KV_SHAPE[1])).astype(np.float32)
        kp = _pages(kv, 4096)
        log.appender.append_page_batch(e, rid, ids, kp[ids])
        ad[(e * 37) % AD_BYTES:(e * 37) % AD_BYTES + 9] = e
        ap = _pages(ad, 1024)
        log.appender.append_page_batch(e, aid, np.arange(ap.shape[0], dtype=np.uint32), ap)
        log.appender.commit(e, digests={rid: region_digest(F.page_crcs_of(kp)),
                                        aid: region_digest(F.page_crcs_of(ap))})
        history[e] = {"kv": kv.copy(), "adapter": ad.copy()}
    log.close()
    return history


@pytest.fixture(scope="session")
def template(tmp_path_factory):
    d = tmp_path_factory.mktemp("template")
    path = str(d / "demo.log")
    history = build_log(path)
    return path, history


@pytest.fixture
def workdir(tmp_path, template, monkeypatch):
    """A directory holding ./concordia-data/demo.log (a fresh copy), made the cwd."""
    data = tmp_path / "concordia-data"
    data.mkdir()
    shutil.copyfile(template[0], data / "demo.log")
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture
def log_path(workdir) -> str:
    return str(workdir / "concordia-data" / "demo.log")


@pytest.fixture
def history(template) -> dict:
    return template[1]


def sha(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def flip(path: str, offset: int, bit: int = 0) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ (1 << bit)]))


def zero(path: str, offset: int, length: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(bytes(length))


WAL = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                   ".venv", "bin", "concordia-wal")
