"""A log written before region descriptors carried a logical dtype (volume
format 1.0 with no feature bit, descriptors with zero reserved bytes) still
reads: its regions, their dtypes and every committed array.

`golden/v1_0_log.bin.gz` was written by the encoder of that version (four
regions: float16 kv, int32 table, bool mask, complex64 z; two epochs) and
`golden/v1_0_arrays.npz` holds the arrays as of its last commit.
"""

import gzip
import pathlib

import numpy as np
import pytest

from concordia.wal import Log
from concordia.wal import format as F

HERE = pathlib.Path(__file__).parent / "golden"


@pytest.fixture
def old_log(tmp_path):
    p = tmp_path / "old.log"
    p.write_bytes(gzip.decompress((HERE / "v1_0_log.bin.gz").read_bytes()))
    return p


def test_old_log_descriptors(old_log):
    log = Log.open(str(old_log))
    try:
        assert log.volume.superblock.incompat == 0
        regs = log.regions
        assert {n: r.dtype for n, r in regs.items()} == {"kv": "<f2", "table": "<i4", "mask": "|b1", "z": "<c8"}
        assert log.last_committed_epoch == 2
    finally:
        log.close()


def test_old_log_recovers(old_log):
    from concordia import Session

    want = np.load(HERE / "v1_0_arrays.npz")
    with Session(f"file:{old_log}", create=False) as s:
        got = s.recover()
    assert set(got) == set(want.files)
    for name in want.files:
        assert isinstance(got[name], np.ndarray)
        assert got[name].dtype == want[name].dtype, name
        assert got[name].tobytes() == want[name].tobytes(), name
