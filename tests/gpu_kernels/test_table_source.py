"""gpu_kernels/table.cu against the Python side it shares bytes with, read
from the source (no GPU needed): its structs are the numpy dtypes of
concordia.checkpoint.table field for field, and the page-batch header it
writes is the one wal.format encodes (as test_format_spec holds stage.cu)."""

from __future__ import annotations

import pathlib
import re
import struct

import numpy as np

from concordia.checkpoint.table import ENTRY, PLAN, RECORD
from concordia.wal import format as F
from tests.wal.test_format_spec import _c_expr, _cdefine

TABLE_CU = (pathlib.Path(__file__).resolve().parents[2] / "gpu_kernels" / "table.cu").read_text()
SIZES = {"u64": 8, "u32": 4}


def _struct(name: str) -> list[tuple[str, int]]:
    body = re.search(rf"struct {name} \{{(.*?)\}};", TABLE_CU, re.S).group(1)
    out = []
    for ctype, names in re.findall(r"(u64|u32) ([^;]+);", body):
        out += [(n.strip(), SIZES[ctype]) for n in names.split(",")]
    return out


def test_the_structs_are_the_numpy_rows():
    for name, dtype in (("TableEntry", ENTRY), ("TableRecord", RECORD), ("TablePlan", PLAN)):
        fields = _struct(name)
        assert [f for f, _ in fields] == list(dtype.names), name
        assert [n for _, n in fields] == [dtype.fields[f][0].itemsize for f in dtype.names], name
        offsets = np.cumsum([0] + [n for _, n in fields])[:-1].tolist()
        assert offsets == [dtype.fields[f][1] for f in dtype.names], name


def test_record_layout_constants_and_payload_offset():
    assert _cdefine(TABLE_CU, "HEADER_BYTES") == F.RECORD_HEADER_SIZE
    assert _cdefine(TABLE_CU, "TYPE_PAGE_BATCH") == F.REC_PAGE_BATCH
    expr = re.search(r"record_payload_off\(u64 count\) \{ return ([^;]+); \}", TABLE_CU).group(1)
    off = _c_expr(expr, {"HEADER_BYTES": F.RECORD_HEADER_SIZE})
    for count in (1, 2, 7, 8, 9, 4096, F.MAX_BATCH_PAGES):
        assert off(count=count) == F.page_batch_payload_offset(count)
    # index entry i at HEADER_BYTES + 4 i, its CRC count words later, the zero pad up to the payload
    assert "index = reinterpret_cast<u32*>(out + HEADER_BYTES)" in TABLE_CU
    assert "index[rec.count + i] = crc" in TABLE_CU
    assert "pad_lo = (HEADER_BYTES + 8ull * rec.count) / 4, pad_hi = record_payload_off(rec.count) / 4" in TABLE_CU


def test_header_words_equal_the_format():
    body = TABLE_CU[TABLE_CU.index("write_table_header"):]
    words = dict(re.findall(r"\bh\[(\d+)\] = ([^;]+);", body))
    assert sorted(int(k) for k in words) == list(range(16)) and words["15"] == "~hc"
    rng = np.random.default_rng(3)
    fns = {int(k): _c_expr(v, {"TYPE_PAGE_BATCH": F.REC_PAGE_BATCH}) for k, v in words.items() if k != "15"}
    for pb in (64, 4096, 1 << 20):
        for _ in range(10):
            count = int(rng.integers(1, 5000))
            f = dict(length=F.page_batch_length(count, pb), lsn=int(rng.integers(1, 1 << 62)),
                     epoch=int(rng.integers(1, 1 << 62)), region_id=int(rng.integers(0, 1 << 32)),
                     salt=int(rng.integers(1, 1 << 32)), body_crc=int(rng.integers(0, 1 << 32)), count=count, flags=0)
            head = struct.pack("<15I", *(fns[i](page_bytes=pb, **f) for i in range(15)))
            head += struct.pack("<I", F.crc32c(head))
            assert head == F.encode_record_header(type=F.REC_PAGE_BATCH, page_bytes=pb, **f), (pb, f)
    stores = body[body.index("uint4* out"):]
    assert re.search(r"out\[3\].*out\[2\].*out\[1\].*__threadfence_system\(\);\s*out\[0\] =", stores, re.S)
