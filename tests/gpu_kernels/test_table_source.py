"""gpu_kernels/table.cu against the Python side it shares bytes with, read
from the source (no GPU needed): its structs are the numpy dtypes of
concordia.checkpoint.table field for field, and its records are laid out and
finished by common.cuh's page-batch helpers and one header writer (which
tests/wal/test_format_spec.py holds against wal.format)."""

from __future__ import annotations

import pathlib
import re

import numpy as np

from concordia.checkpoint.table import ENTRY, PLAN, RECORD

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


def test_record_layout_is_the_one_of_common_cuh():
    """table.cu lays records out with common.cuh's page-batch helpers (held
    against the format in tests/wal/test_format_spec.py), not its own."""
    assert not re.search(r"#define (RECORD_)?HEADER_BYTES|#define TYPE_PAGE_BATCH", TABLE_CU)
    assert "u64 record_payload_off" not in TABLE_CU and "u64 record_length" not in TABLE_CU
    # index entry i at RECORD_HEADER_BYTES + 4 i, its CRC count words later, the zero pad up to the payload
    assert "index = reinterpret_cast<u32*>(out + RECORD_HEADER_BYTES)" in TABLE_CU
    assert "index[rec.count + i] = crc" in TABLE_CU
    assert ("pad_lo = (RECORD_HEADER_BYTES + 8ull * rec.count) / 4, pad_hi = page_batch_payload_off(rec.count) / 4"
            in TABLE_CU)
    assert "bytes = full * page_batch_length(per, pb) + (rem ? page_batch_length(rem, pb) : 0)" in TABLE_CU


def test_the_table_finalizes_with_the_one_header_writer():
    body = TABLE_CU[TABLE_CU.index("table_finalize"):]
    assert ("write_page_batch_header(T, out, rec.length, lsn_base + rec.offset, epoch, e.region_id, salt, 0,\n"
            "                                    rec.count, e.page_bytes, page_batch_body_crc(raw, rec.count));") in body
