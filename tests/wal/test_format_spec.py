"""wal/FORMAT.md against the code that writes and reads the bytes it describes.

FORMAT.md is the single source of truth for every byte on media.  These tests
parse it (offset tables, record types, flags, magics, limits, formulas, the
checksum parameters and the table of where each validity condition is checked)
and compare it with `wal/format.py`, `wal/catalog.py`, the GPU staging kernel
`gpu_kernels/stage.cu` and its numpy twin.  Changing one side without the other
fails here.
"""

from __future__ import annotations

import dataclasses
import importlib
import re
import struct
from pathlib import Path

import numpy as np
import pytest

from concordia.gpu_kernels import reference as ref
from concordia.wal import format as F
from concordia.wal import planner
from concordia.wal import catalog as S
from concordia.wal.errors import CorruptionError, FormatVersionError, NotALogError

WAL_DIR = Path(F.__file__).resolve().parent
REPO = WAL_DIR.parent
SPEC = (WAL_DIR / "FORMAT.md").read_text()
KERNEL_DIR = Path(ref.__file__).resolve().parent
STAGE_CU = (KERNEL_DIR / "stage.cu").read_text()
COMMON_CUH = (KERNEL_DIR / "common.cuh").read_text()
TABLE_CU = (KERNEL_DIR / "table.cu").read_text()

MODULES = {"format": F, "catalog": S}
STRUCT_REF = re.compile(r"`(format|catalog)\.([A-Z_]+)`,\s*(\d+) bytes")
TYPE_CODES = {"u8": "B", "u16": "H", "u32": "I", "u64": "Q"}


# --------------------------------------------------------------------------- parsing FORMAT.md


def _sections(text: str) -> dict:
    """{"3.1": (title, body text)} for every numbered heading."""
    out, cur, lines = {}, None, []
    for line in text.splitlines():
        m = re.match(r"^#{2,3} (\d+(?:\.\d+)?)\.? (.*)$", line)
        if m:
            if cur:
                out[cur[0]] = (cur[1], "\n".join(lines))
            cur, lines = (m.group(1), m.group(2)), []
        elif cur:
            lines.append(line)
    if cur:
        out[cur[0]] = (cur[1], "\n".join(lines))
    return out


SECTIONS = _sections(SPEC)


def _cells(line: str) -> list:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _tables(title: str, body: str):
    """(struct reference or None, header cells, rows) of each table of a section.
    The struct a table mirrors is the first `format.NAME`, N bytes reference
    after the previous table (the section heading counts for the first)."""
    out, before, lines, i = [], title + "\n", body.splitlines(), 0
    while i < len(lines):
        if lines[i].startswith("|"):
            j = i
            while j < len(lines) and lines[j].startswith("|"):
                j += 1
            block = lines[i:j]
            m = STRUCT_REF.search(before)
            out.append((m, _cells(block[0]), [_cells(r) for r in block[2:]]))
            before, i = "", j
        else:
            before += lines[i] + "\n"
            i += 1
    return out


def _offset_tables():
    """[(section, module, NAME, stated size, rows)] of every offset table."""
    found = []
    for num, (title, body) in SECTIONS.items():
        for m, head, rows in _tables(title, body):
            if head[:3] != ["off", "type", "field"]:
                continue
            assert m is not None, f"FORMAT.md §{num}: an offset table does not name its struct"
            found.append((num, MODULES[m.group(1)], m.group(2), int(m.group(3)), rows))
    return found


OFFSET_TABLES = _offset_tables()


def _table(name: str):
    (rows,) = [t[4] for t in OFFSET_TABLES if t[2] == name]
    return rows


def _fixed_items(rows):
    """[(off, size, struct code, field)] of the fixed part of a table, and the first
    variable row (an array or an offset that depends on a count) or None."""
    items, off = [], 0
    for row in rows:
        roff, typ, field = row[0], row[1], re.match(r"\w+", row[2]).group(0)
        if not roff.isdigit() or "{" in typ:
            return items, row
        assert int(roff) == off, f"row {field!r} at {roff}, the rows before end at {off}"
        m = re.fullmatch(r"(\d+) bytes", typ)
        code = f"{m.group(1)}s" if m else TYPE_CODES[typ]
        size = struct.calcsize("<" + code)
        items.append((off, size, code, field))
        off += size
    return items, None


def _struct_items(st: struct.Struct):
    out, off = [], 0
    for n, c in re.findall(r"(\d*)([a-zA-Z?])", st.format.lstrip("<>=!@")):
        n = int(n or 1)
        if c == "s":
            out.append((off, n, f"{n}s"))
            off += n
            continue
        size = struct.calcsize("<" + c)
        for _ in range(n):
            out.append((off, size, c))
            off += size
    return out


def _find(pattern: str, text: str | None = None, flags=0):
    m = re.search(pattern, SPEC if text is None else text, flags)
    assert m, f"FORMAT.md no longer says {pattern!r}"
    return m


# --------------------------------------------------------------------------- offset tables


def test_every_struct_of_the_code_has_a_table():
    names = {(mod.__name__.rsplit(".", 1)[1], name) for _, mod, name, _, _ in OFFSET_TABLES}
    assert names == {("format", "SUPERBLOCK"), ("format", "SEGMENT_ENTRY"), ("format", "SEGMENT_HEADER"),
                     ("format", "RECORD_HEADER"), ("format", "REGION_BODY"), ("format", "COMMIT_BODY"),
                     ("catalog", "CATALOG_HEAD"), ("catalog", "CATALOG_ENTRY")}
    # every struct.Struct of the codecs is described (a new one needs a table or a reference)
    described = {m.group(2) for m in STRUCT_REF.finditer(SPEC)}
    for mod in (F, S):
        for name, value in vars(mod).items():
            if isinstance(value, struct.Struct):
                assert name in described, f"{mod.__name__}.{name} is not described in FORMAT.md"


@pytest.mark.parametrize("section,mod,name,size,rows", OFFSET_TABLES,
                         ids=[f"{t[0]}-{t[2]}" for t in OFFSET_TABLES])
def test_offset_table_equals_struct(section, mod, name, size, rows):
    st = getattr(mod, name)
    items, variable = _fixed_items(rows)
    assert [(o, s, c) for o, s, c, _ in items] == _struct_items(st), f"§{section} vs {mod.__name__}.{name}"
    assert st.size == size == sum(s for _, s, _, _ in items)
    assert getattr(mod, name + "_SIZE") == size
    if variable is not None and variable[0].isdigit():
        assert int(variable[0]) == size, f"§{section}: the variable part starts at {variable[0]}, not {size}"


def test_every_stated_struct_size():
    for m in STRUCT_REF.finditer(SPEC):
        mod, name, size = MODULES[m.group(1)], m.group(2), int(m.group(3))
        assert getattr(mod, name).size == size, name
        if hasattr(mod, name + "_SIZE"):
            assert getattr(mod, name + "_SIZE") == size, name


def test_variable_parts():
    _, var = _fixed_items(_table("REGION_BODY"))
    assert var[:3] == [str(F.REGION_BODY_SIZE), "u64{ndim}", "shape"]
    _, var = _fixed_items(_table("COMMIT_BODY"))
    elem = re.fullmatch(r"\((.*)\)\{n_regions\}", var[1]).group(1)
    codes = "".join(TYPE_CODES[t.split()[0]] for t in elem.split(","))
    assert struct.Struct("<" + codes).format == F.COMMIT_DIGEST.format
    _, var = _fixed_items(_table("CATALOG_HEAD"))
    assert var[1] == "entry{n_entries}"
    assert int(re.match(r"(\d+) bytes each", var[2]).group(1)) == S.CATALOG_ENTRY_SIZE


def test_crc_coverage_equals_crc_offset():
    """Each "CRC32C of bytes `[0, N)`" row sits at offset N and N is the code's constant."""
    for name, const in (("SUPERBLOCK", F.SUPERBLOCK_CRC_OFF), ("SEGMENT_HEADER", F.SEGMENT_HEADER_CRC_OFF),
                        ("RECORD_HEADER", F.RECORD_HEADER_CRC_OFF)):
        (row,) = [r for r in _table(name) if "CRC32C of bytes" in r[3]]
        covered = int(re.search(r"`\[0, (\d+)\)`", row[3]).group(1))
        assert int(row[0]) == covered == const, name


def test_record_header_field_offsets_and_names():
    rows = _table("RECORD_HEADER")
    offs = [F.OFF_LENGTH, F.OFF_TYPE, F.OFF_FLAGS, F.OFF_RESERVED0, F.OFF_REGION, F.OFF_LSN, F.OFF_EPOCH,
            F.OFF_SALT, F.OFF_BODY_CRC, F.OFF_COUNT, F.OFF_PAGE_BYTES, F.OFF_AUX, F.OFF_RESERVED1,
            F.OFF_HEADER_CRC]
    assert [int(r[0]) for r in rows] == offs
    assert len([n for n in vars(F) if n.startswith("OFF_")]) == len(offs)
    assert list(F.RecordHeader._fields) == [r[2] for r in rows if r[2] != "reserved"]


def _check_fields(raw: bytes, rows, values: dict, where: str):
    """Read each named field of `raw` at the table's offset and type."""
    items, _ = _fixed_items(rows)
    seen = set()
    for off, size, code, field in items:
        got = struct.unpack_from("<" + code, raw, off)[0]
        if field == "reserved":
            assert not any(raw[off:off + size]), f"{where}: reserved bytes at {off}"
        elif field in values:
            assert got == values[field], f"{where}: field {field} at {off}"
            seen.add(field)
    return seen


def _magic(rows):
    (row,) = [r for r in rows if r[2] == "magic"]
    return re.search(r"`(\w+)`", row[3]).group(1).encode()


def test_superblock_fields_where_the_table_puts_them():
    rows = _table("SUPERBLOCK")
    assert _magic(rows) == F.VOLUME_MAGIC
    vals = dict(uuid=bytes(range(16)), sequence=3, volume_bytes=11 << 30, slot_bytes=4096,
                segments_off=1 << 20, segment_bytes=64 << 20, segment_count=2, next_lsn=0x1000_0001,
                next_segment_seq=0x22, oldest_lsn=0x33, oldest_epoch=0x44, catalog_lsn=0x55,
                retain_epochs=0x66, retain_bytes=0x77, created_ns=0x88, compat=0x99, incompat=0,
                ro_compat=0xAA, major=F.MAJOR_VERSION, minor=F.MINOR_VERSION, flags=0)
    entries = (F.SegmentEntry(0x111, 0x21, 0x333, F.SEG_LIVE, 0x444), F.SegmentEntry(0, 0, 0, F.SEG_FREE, 0))
    raw = F.encode_superblock(F.Superblock(segments=entries, **vals))
    seen = _check_fields(raw, rows, vals, "superblock")
    assert seen | {"segments"} == set(F.Superblock._fields)
    (crc_row,) = [r for r in rows if r[2] == "crc"]
    # "CRC32C of bytes [0, 252) followed by the segment table"
    assert struct.unpack_from("<I", raw, int(crc_row[0]))[0] == F.crc32c(raw[F.SUPERBLOCK_SIZE:],
                                                                          F.crc32c(raw[:F.SUPERBLOCK_CRC_OFF]))
    erows = _table("SEGMENT_ENTRY")
    _check_fields(raw[F.SUPERBLOCK_SIZE:], erows, entries[0]._asdict(), "segment entry 0")
    assert list(F.SegmentEntry._fields) == [r[2] for r in erows if r[2] != "reserved"]
    states = dict((int(v), k) for v, k in re.findall(r"(\d) = (\w+)", [r for r in erows if r[2] == "state"][0][3]))
    assert states == {F.SEG_FREE: "free", F.SEG_LIVE: "live"}
    assert F.decode_superblock(raw).segments == entries


def test_segment_header_fields_where_the_table_puts_them():
    rows = _table("SEGMENT_HEADER")
    assert _magic(rows) == F.SEGMENT_MAGIC
    vals = dict(uuid=bytes(range(16, 32)), seq=0x12, base_lsn=0x3400_0000, segment_bytes=64 << 20, index=5,
                salt=0xDEADBEEF, prev_seq=0x11, prev_header_crc=0xCAFEF00D, created_ns=0x56, compat=1,
                incompat=0, ro_compat=2)
    raw = F.encode_segment_header(F.SegmentHeader(**vals))
    vals.update(major=F.MAJOR_VERSION, minor=F.MINOR_VERSION, header_crc=F.crc32c(raw[:252]))
    seen = _check_fields(raw, rows, vals, "segment header")
    assert seen == set(F.SegmentHeader._fields) | {"major", "minor"}
    assert int(_find(r"Records start at offset (\d+)\.").group(1)) == F.SEGMENT_HEADER_SIZE


def test_record_header_fields_where_the_table_puts_them():
    vals = dict(length=0x1_0000_0040, type=0x81, flags=0x03, region_id=0xAABBCCDD, lsn=0x0102030405060708,
                epoch=0x1112131415161718, salt=0x21222324, body_crc=0x31323334, count=0x41424344,
                page_bytes=0x51525340, aux=0x6162636465666768)
    raw = F.encode_record_header(**vals)
    vals["header_crc"] = F.crc32c(raw[:60])
    assert _check_fields(raw, _table("RECORD_HEADER"), vals, "record header") == set(F.RecordHeader._fields)


def test_body_fields_where_the_tables_put_them():
    body = F.encode_commit_body(7, 0x1234_5678_9A, 0x4000_0040, {3: 0xD1, 1: 0xD0})
    _check_fields(body, _table("COMMIT_BODY"), dict(record_count=7, record_bytes=0x1234_5678_9A,
                                                    first_lsn=0x4000_0040, n_regions=2), "commit")
    assert struct.unpack_from("<4I", body, F.COMMIT_BODY_SIZE) == (1, 0xD0, 3, 0xD1)  # "ids increasing"

    body = F.encode_region_body("kv cache", "<f2", (3, 5), 4096, "kv")
    _check_fields(body, _table("REGION_BODY"), dict(name_len=8, dtype_len=3, kind_len=2, ndim=2,
                                                    nbytes=30), "region descriptor")
    assert body[16:32] == struct.pack("<2Q", 3, 5) and body[32:] == b"kv cache<f2kv"

    e = planner.BaseEntry(region_id=4, epoch=0x55, first_lsn=0x1000, last_lsn=0x2000, records=3,
                          pages=0x77, digest=0xABCDEF01)
    body = S.encode_catalog_body(S.Catalog(sequence=9, entries=(e,), keep_bases=2, floor_epoch=0x33))
    _check_fields(body, _table("CATALOG_HEAD"), dict(sequence=9, n_entries=1, keep_bases=2, floor_epoch=0x33),
                  "catalog")
    fields = dataclasses.asdict(e)
    seen = _check_fields(body[S.CATALOG_HEAD_SIZE:], _table("CATALOG_ENTRY"), fields, "catalog entry")
    assert seen == set(fields)


def test_internals_record_table_agrees():
    """docs/internals.md repeats the record header for the kernels: same rows."""
    text = (REPO / "docs" / "internals.md").read_text()
    part = text.split("## WAL record layout", 1)[1]
    rows = [_cells(line) for line in part.splitlines() if re.match(r"^\| \d+ \|", line)][:14]
    assert [r[:3] for r in rows] == [r[:3] for r in _table("RECORD_HEADER")]


# --------------------------------------------------------------------------- types, flags, limits


def test_record_types():
    (_, head, rows), = [t for t in _tables(*SECTIONS["5.2"]) if t[1][0] == "type"]
    table = {int(r[0].split()[0], 16): r[1].split(" (")[0] for r in rows}
    assert table == {F.REC_PAGE_BATCH: "page batch", F.REC_REGION: "region descriptor",
                     F.REC_COMMIT: "commit", F.REC_CATALOG: "snapshot catalog",
                     F.REC_SNAPSHOT: "snapshot marker", F.REC_PAD | F.TYPE_IGNORABLE: "pad"}
    assert set(F.TYPE_NAMES) == {t & F.TYPE_MASK for t in table}
    type_row = [r for r in _table("RECORD_HEADER") if r[2] == "type"][0][3]
    assert f"bit 7 (0x{F.TYPE_IGNORABLE:02X})" in type_row and F.TYPE_MASK == 0xFF ^ F.TYPE_IGNORABLE
    assert f"type = 0x{F.REC_PAD | F.TYPE_IGNORABLE:02X}" in SECTIONS["5.4"][1]


def test_flags_and_no_region():
    flags_row = [r for r in _table("RECORD_HEADER") if r[2] == "flags"][0][3]
    assert 1 << int(_find(r"bit (\d) = BASE", flags_row).group(1)) == F.FLAG_BASE
    assert 1 << int(_find(r"bit (\d) = ONE_SYNC", flags_row).group(1)) == F.FLAG_ONE_SYNC
    assert int(_find(r"\(ONE_SYNC, (0x[0-9A-Fa-f]+)\)").group(1), 16) == F.FLAG_ONE_SYNC
    assert planner.FLAG_BASE == F.FLAG_BASE
    region_row = [r for r in _table("RECORD_HEADER") if r[2] == "region_id"][0][3]
    assert int(_find(r"(0x[0-9A-F]+) when", region_row).group(1), 16) == F.NO_REGION
    # records of no region say so: commit, catalog (FORMAT.md §8, §12.2)
    assert SECTIONS["8"][1].count(f"`region_id` 0x{F.NO_REGION:X}") == 1
    assert SECTIONS["12.2"][1].count(f"`region_id` 0x{F.NO_REGION:X}") == 1


def test_versions_and_feature_masks():
    for name in ("SUPERBLOCK", "SEGMENT_HEADER"):
        rows = {r[2]: r[3] for r in _table(name)}
        assert int(rows["major"].split(";")[0]) == F.MAJOR_VERSION
        assert int(rows["minor"].split(";")[0]) == F.MINOR_VERSION
    assert "Version 1.0 defines two bits" in SECTIONS["2.3"][1]
    assert F.KNOWN_COMPAT == F.KNOWN_RO_COMPAT == 0
    assert F.KNOWN_INCOMPAT == F.FEATURE_LOGICAL_DTYPE | F.FEATURE_IMAGE_BASES == 0x3
    assert "| incompat | 0 (0x1) | LOGICAL_DTYPE |" in SECTIONS["2.3"][1]
    assert "| incompat | 1 (0x2) | IMAGE_BASES |" in SECTIONS["2.3"][1]
    assert SPEC.startswith(f"# Concordia volume format, version {F.MAJOR_VERSION}.{F.MINOR_VERSION}\n")


def test_limits():
    assert 2 ** int(_find(r"\(V-B2\) `0 < segment_count <= 2\^(\d+)`").group(1)) == F.MAX_SEGMENTS
    m = _find(r"\(V-P1\) `1 <= count <= 2\^(\d+)`, `page_bytes` a nonzero multiple of (\d+), at most (\d+) MiB")
    assert (2 ** int(m.group(1)), int(m.group(2)), int(m.group(3)) << 20) == (
        F.MAX_BATCH_PAGES, F.RECORD_ALIGN, F.MAX_PAGE_BYTES)
    assert int(_find(r"`n_regions <= (\d+)`").group(1)) == F.MAX_COMMIT_REGIONS
    assert 2 ** int(_find(r"`n_entries <= 2\^(\d+)`").group(1)) == S.MAX_CATALOG_ENTRIES
    assert _find(r"name_len \((\d+)\.\.(\d+)\)").groups() == ("1", str(F.MAX_NAME))
    assert _find(r"ndim \((\d+)\.\.(\d+)\)").groups() == ("0", str(F.MAX_NDIM))
    assert _find(r"matching `(\^[^`]*\$)`").group(1) == F._DTYPE_RE.pattern
    assert _find(r"kind, ASCII `(\^[^`]*\$)`").group(1) == F._KIND_RE.pattern
    assert int(_find(r"Every record starts (\d+)-byte aligned").group(1)) == F.RECORD_ALIGN


def test_slot_and_segment_geometry():
    m = _find(r"`slot_bytes = align\((\d+) \+ (\d+)\*segment_count, (\d+)\)`")
    head, entry, al = (int(g) for g in m.groups())
    assert (head, entry) == (F.SUPERBLOCK_SIZE, F.SEGMENT_ENTRY_SIZE)
    for n in (1, 2, 120, 121, 1000, F.MAX_SEGMENTS):
        assert F.slot_bytes_for(n) == -(-(head + entry * n) // al) * al
    assert int(_find(r"nonzero multiples of (\d+) MiB").group(1)) << 20 == F.SEGMENT_ALIGN
    assert "sequence number `n` is always written into slot `n % 2`" in SPEC.replace("Sequence", "sequence")
    assert F.SLOT_COUNT == 2


def _align64(n):  # FORMAT.md §1: rounds n up to a multiple of 64
    return -(-n // 64) * 64


def _formula(text: str):
    expr = text.replace("align64", "_align64").replace("*", " * ")
    return lambda **kw: eval(expr, {"_align64": _align64}, kw)  # text of FORMAT.md, not of a log


def test_length_formulas():
    page_batch = _formula(_find(r"length\s+== (64 \+ align64\(8\*count\) \+ count\*page_bytes)").group(1))
    generic = _formula(_find(r"`length = (64 \+ align64\(count\))`").group(1))
    commit = _formula(_find(r"\(V-C1\) `count == (32 \+ 8\*n_regions)`").group(1))
    catalog = _formula(_find(r"\(V-K1\) .*?`count == (32 \+ 48 \* n_entries)`", flags=re.S).group(1))
    payload = _formula(_find(r"page i at (64 \+ align64\(8\*count\)) \+ i\*page_bytes").group(1))
    for count in (1, 2, 7, 8, 9, 1000):
        for pb in (64, 4096, 65536):
            assert page_batch(count=count, page_bytes=pb) == F.page_batch_length(count, pb)
        assert payload(count=count) == F.page_batch_payload_offset(count) == ref.payload_offset(count)
        assert generic(count=count) == F.record_length(count)
        digests = {i: i for i in range(count % 50)}
        assert commit(n_regions=len(digests)) == len(F.encode_commit_body(1, 2, 3, digests))
    entries = tuple(planner.BaseEntry(i, 1, 64, 128, 1, 1, 0) for i in range(3))
    assert catalog(n_entries=3) == len(S.encode_catalog_body(S.Catalog(1, entries)))


def _crc_bitwise(data: bytes, poly_reflected: int, init: int, xorout: int) -> int:
    crc = init
    for b in data:
        crc ^= b
        for _ in range(8):
            crc = (crc >> 1) ^ (poly_reflected if crc & 1 else 0)
    return crc ^ xorout


def _reflect32(v: int) -> int:
    return int(f"{v:032b}"[::-1], 2)


def test_checksum_parameters():
    m = _find(r"polynomial (0x[0-9A-F]+), reflected, initial\s+value (0x[0-9A-F]+), final xor (0x[0-9A-F]+); "
              r"`crc32c\(b\"123456789\"\) == (0x[0-9A-F]+)`")
    poly, init, xorout, check = (int(g, 16) for g in m.groups())
    rpoly = _reflect32(poly)
    assert _crc_bitwise(b"123456789", rpoly, init, xorout) == check == F.crc32c(b"123456789")
    data = np.random.default_rng(5).integers(0, 256, 333, dtype=np.uint8).tobytes()
    assert _crc_bitwise(data, rpoly, init, xorout) == F.crc32c(data)
    assert F.crc32c(b"") == F.CRC_OF_EMPTY
    # the GPU kernels and their numpy twin use the same polynomial
    assert int(re.search(r"#define CRC_POLY (0x[0-9A-Fa-f]+)u", COMMON_CUH).group(1), 16) == rpoly == ref.POLY


# --------------------------------------------------------------------------- the GPU staging kernel


def _cdefine(text: str, name: str) -> int:
    m = re.search(rf"^#define {name} (\S+)", text, re.M)
    assert m, f"#define {name} not found"
    return int(re.sub(r"(?i)u?l*$", "", m.group(1)), 0)


def _c_expr(expr: str, defines: dict):
    """A C integer expression of stage.cu as a Python function of its variables."""
    e = re.sub(r"\b(0x[0-9A-Fa-f]+|\d+)(?:ull|ul|u)\b", r"\1", expr)
    e = re.sub(r"\(u32\)\(", "U32(", e)
    e = re.sub(r"\(u32\)(\w+)", r"U32(\1)", e)
    e = re.sub(r"\(u64\)", "", e)
    for k, v in defines.items():
        e = re.sub(rf"\b{k}\b", str(v), e)
    return lambda **kw: eval(e, {"U32": lambda x: x & 0xFFFFFFFF}, kw) & 0xFFFFFFFF_FFFFFFFF


def test_stage_kernel_constants():
    assert _cdefine(COMMON_CUH, "RECORD_HEADER_BYTES") == F.RECORD_HEADER_SIZE == ref.HEADER_BYTES
    assert _cdefine(COMMON_CUH, "TYPE_PAGE_BATCH") == F.REC_PAGE_BATCH == ref.TYPE_PAGE_BATCH
    assert ref.HEADER.format == F.RECORD_HEADER.format
    assert (ref.RECORD_ALIGN, ref.NO_REGION, ref.MAX_PAGE_BYTES) == (F.RECORD_ALIGN, F.NO_REGION, F.MAX_PAGE_BYTES)
    expr = re.search(r"page_batch_payload_off\(u64 count\) \{\s*return ([^;]+);\s*\}", COMMON_CUH).group(1)
    off = _c_expr(expr, {"RECORD_HEADER_BYTES": _cdefine(COMMON_CUH, "RECORD_HEADER_BYTES")})
    for count in (1, 2, 7, 8, 9, 15, 16, 17, 4096, F.MAX_BATCH_PAGES):
        assert off(count=count) == F.page_batch_payload_offset(count)
    # tables right after the header (index, then CRCs), zero pad up to the payload
    assert "index = reinterpret_cast<u32*>(rec + RECORD_HEADER_BYTES)" in STAGE_CU
    assert "crc_table = index + count" in STAGE_CU
    assert "pad_lo = (RECORD_HEADER_BYTES + 8 * count) / 4, pad_hi = page_batch_payload_off(count) / 4" in STAGE_CU


def test_the_one_header_writer_writes_the_format_bytes():
    """Evaluate the 16 header words common.cuh's write_record_header (the one
    writer: write_page_batch_header for stage.cu's and table.cu's page
    batches, table.cu's commit) assembles and compare the bytes with
    format.encode_record_header for the same fields, page batches and commits."""
    body = COMMON_CUH[COMMON_CUH.index("void write_record_header"):]
    body = body[:body.index("\n}\n")]
    words = dict(re.findall(r"\bh\[(\d+)\] = ([^;]+);", body))
    assert sorted(int(k) for k in words) == list(range(16)) and words["15"] == "~hc"
    n = int(_find(r"for \(int w = 0; w < (\d+); \+\+w\) hc = crc_word\(T, hc, h\[w\]\);", body).group(1))
    assert "u32 hc = 0xFFFFFFFFu;" in body and 4 * n == F.RECORD_HEADER_CRC_OFF
    assert _cdefine(COMMON_CUH, "TYPE_COMMIT") == F.REC_COMMIT and _cdefine(COMMON_CUH, "NO_REGION") == F.NO_REGION
    rng = np.random.default_rng(11)
    fns = {int(k): _c_expr(v, {}) for k, v in words.items() if k != "15"}
    cases = []
    for pb in (64, 4096, 1 << 20):  # page batches: aux 0, flags 0 or BASE
        for _ in range(20):
            count = int(rng.integers(1, 5000))
            cases.append(dict(type=F.REC_PAGE_BATCH, page_bytes=pb, aux=0, length=F.page_batch_length(count, pb),
                              count=count, flags=int(rng.choice([0, F.FLAG_BASE])),
                              region_id=int(rng.integers(0, 1 << 32))))
    for _ in range(20):  # commits: no region, the previous commit's LSN in aux
        count = F.COMMIT_BODY_SIZE + F.COMMIT_DIGEST_SIZE * int(rng.integers(0, 70000))
        cases.append(dict(type=F.REC_COMMIT, page_bytes=0, aux=int(rng.integers(0, 1 << 62)), flags=0,
                          length=F.record_length(count), count=count, region_id=F.NO_REGION))
    for f in cases:
        f.update(lsn=int(rng.integers(1, 1 << 62)), epoch=int(rng.integers(1, 1 << 62)),
                 salt=int(rng.integers(1, 1 << 32)), body_crc=int(rng.integers(0, 1 << 32)))
        head = struct.pack("<15I", *(fns[i](**f) for i in range(15)))
        head += struct.pack("<I", F.crc32c(head))
        assert head == F.encode_record_header(**f), f
    # FORMAT.md §6.1: words [16, 64) first, a system fence, then [0, 16) with the length word
    stores = body[body.index("uint4* out"):]
    assert re.search(r"out\[3\].*out\[2\].*out\[1\].*__threadfence_system\(\);\s*out\[0\] =", stores, re.S)
    # a page batch's header is the one writer's with its type and aux 0
    batch = COMMON_CUH[COMMON_CUH.index("void write_page_batch_header"):]
    batch = batch[:batch.index("\n}\n")]
    assert ("write_record_header(T, rec, length, TYPE_PAGE_BATCH, flags, lsn, epoch, region_id, salt, body_crc, "
            "count,\n                        page_bytes, 0);") in batch
    # every kernel that finishes a record calls it; none assembles a header of its own
    for name in ("stage.cu", "table.cu"):
        text = (REPO / "gpu_kernels" / name).read_text()
        assert "write_page_batch_header(" in text and not re.search(r"\bh\[0\] =", text), name
    commit = TABLE_CU[TABLE_CU.index("void commit_warp("):]  # table_commit and the one-block epoch call it
    assert ("write_record_header(T, rec, length, TYPE_COMMIT, 0, lsn_base + p.bytes, epoch, NO_REGION, salt,\n"
            "                            crc_of_raw(raw, body), body, 0, prev_commit);") in commit
    stage = STAGE_CU[STAGE_CU.index("stage_finalize"):]
    assert "write_page_batch_header(T, dst + off, length, lsn_base + off, epoch, region_id, salt, flags, count, " \
           "PAGE_BYTES,\n                            page_batch_body_crc(raw, count));" in stage


def test_reference_stager_writes_the_format_bytes():
    """The numpy twin of stage.cu (the GPU tests' oracle) and the CPU encoder agree
    byte for byte, short last page and BASE flag included."""
    pb = 256
    region = np.random.default_rng(3).integers(0, 256, 9 * pb + 100, dtype=np.uint8)
    ids = np.array([0, 3, 4, 9], np.uint32)
    length = F.page_batch_length(ids.size, pb)
    dst = np.zeros(64 + length, np.uint8)
    cursor = ref.new_cursor()
    cursor[ref.CURSOR_USED] = 64
    ref.stage_page_batch(region, ids, dst, cursor, page_bytes=pb, base_lsn=0x4000, epoch=5, region_id=2,
                         salt=0x1234, flags=F.FLAG_BASE)
    pages = np.zeros((ids.size, pb), np.uint8)
    padded = np.zeros(10 * pb, np.uint8)
    padded[:region.size] = region
    pages[:] = padded.reshape(10, pb)[ids]
    want = np.zeros(length, np.uint8)
    F.encode_page_batch_into(want, lsn=0x4040, epoch=5, region_id=2, salt=0x1234, page_ids=ids, pages=pages,
                             page_bytes=pb, flags=F.FLAG_BASE)
    assert np.array_equal(dst[64:], want)


# --------------------------------------------------------------------------- validity conditions


# a condition is defined where its label in parentheses is followed by its text;
# "(V-C4)," or "(V-N1)." are references
DEFINITION = re.compile(r"\((V-[A-Z]\d+)\)(?=\s)")


def _conditions_defined() -> set:
    return set(DEFINITION.findall(SPEC))


def _checker_table() -> dict:
    (_, head, rows), = [t for t in _tables(*SECTIONS["13"])]
    assert head == ["condition", "checked by"]
    return {r[0]: re.findall(r"`([\w.]+)`", r[1]) for r in rows}


def test_every_condition_names_a_checker_that_exists():
    table = _checker_table()
    assert set(table) == _conditions_defined()
    for cond, names in table.items():
        assert names, cond
        for name in names:
            mod, *attrs = name.split(".")
            obj = importlib.import_module(f"concordia.wal.{mod}")
            for a in attrs:
                obj = getattr(obj, a)
            assert callable(obj), f"{cond}: {name}"


def test_every_condition_is_stated_in_order():
    """Labels run V-X1, V-X2, ... without gaps, each defined once."""
    labels = DEFINITION.findall(SPEC)
    assert len(labels) == len(set(labels))
    by = {}
    for lab in labels:
        by.setdefault(lab[2], []).append(int(lab[3:]))
    for letter, nums in by.items():
        assert nums == list(range(1, len(nums) + 1)), letter


def _slot(**changes):
    vals = dict(uuid=bytes(16), sequence=0, volume_bytes=8 << 20, slot_bytes=4096, segments_off=1 << 20,
                segment_bytes=1 << 20, segment_count=2, next_lsn=1 << 20, next_segment_seq=1, oldest_lsn=0,
                oldest_epoch=0, catalog_lsn=0, retain_epochs=0, retain_bytes=0, created_ns=1,
                segments=(F.SegmentEntry(0, 0, 0, 0, 0),) * 2)
    vals.update(changes)
    return bytearray(F.encode_superblock(F.Superblock(**vals)))


def _fix_sb_crc(raw: bytearray) -> bytearray:
    count = struct.unpack_from("<I", raw, 96)[0]
    crc = F.crc32c(raw[256:256 + 32 * count], F.crc32c(raw[:252]))
    struct.pack_into("<I", raw, 252, crc)
    return raw


def _poke(raw: bytearray, off: int, fmt: str, value) -> bytearray:
    struct.pack_into(fmt, raw, off, value)
    return raw


SUPERBLOCK_CASES = [
    ("V-B1", lambda: _fix_sb_crc(_poke(_slot(), 0, "8s", b"CNCRDXXX")), NotALogError, "magic"),
    ("V-B2", lambda: _fix_sb_crc(_poke(_slot(), 96, "<I", 0)), CorruptionError, "segment count 0"),
    ("V-B2", lambda: _fix_sb_crc(_poke(_slot(), 72, "<Q", 8192)), CorruptionError, "slot size"),
    ("V-B3", lambda: _poke(_slot(), 104, "<Q", 7), CorruptionError, "CRC mismatch"),
    ("V-B4", lambda: _fix_sb_crc(_poke(_slot(), 8, "<I", 2)), FormatVersionError, "major version 2"),
    ("V-B4", lambda: _fix_sb_crc(_poke(_slot(), 24, "<Q", 4)), FormatVersionError, "incompatible"),
    ("V-B5", lambda: _fix_sb_crc(_poke(_slot(), 200, "<B", 1)), CorruptionError, "reserved"),
    ("V-B6", lambda: _fix_sb_crc(_poke(_slot(), 88, "<Q", 3 << 19)), CorruptionError, "geometry"),
    ("V-B6", lambda: _fix_sb_crc(_poke(_slot(), 64, "<Q", 2 << 20)), CorruptionError, "geometry"),
    ("V-B9", lambda: _fix_sb_crc(_poke(_slot(), 104, "<Q", 0)), CorruptionError, "would reuse LSNs"),
    ("V-B9", lambda: _fix_sb_crc(_poke(_slot(segments=(F.SegmentEntry(1 << 20, 1, 5, F.SEG_LIVE, 7),
                                                       F.SegmentEntry(0, 0, 0, 0, 0)), next_lsn=2 << 20,
                                                       next_segment_seq=2), 104, "<Q", (2 << 20) - 64)),
     CorruptionError, "would reuse LSNs"),
    ("V-B9", lambda: _fix_sb_crc(_poke(_slot(segments=(F.SegmentEntry(1 << 20, 1, 5, F.SEG_LIVE, 7),
                                                       F.SegmentEntry(0, 0, 0, 0, 0)), next_lsn=2 << 20,
                                                       next_segment_seq=2), 112, "<Q", 1)),
     CorruptionError, "next_segment_seq 1"),
    ("V-B9", lambda: _fix_sb_crc(_poke(_slot(), 120, "<Q", (1 << 63) - 1)), CorruptionError,
     "oldest_lsn 0x7fffffffffffffff lies beyond next_lsn"),
    ("V-B9", lambda: _fix_sb_crc(_poke(_slot(), 136, "<Q", 1 << 40)), CorruptionError, "catalog_lsn .* beyond next_lsn"),
]


@pytest.mark.parametrize("cond,make,exc,diag", SUPERBLOCK_CASES, ids=[f"{c[0]}-{c[3]}" for c in SUPERBLOCK_CASES])
def test_superblock_conditions(cond, make, exc, diag):
    F.decode_superblock(bytes(_slot()))  # the undamaged slot is valid
    with pytest.raises(exc, match=diag):
        F.decode_superblock(bytes(make()))


def _seg_header():
    return bytearray(F.encode_segment_header(F.SegmentHeader(bytes(16), 1, 1 << 20, 1 << 20, 0, 5, 0, 0, 1)))


def _fix_seg_crc(raw):
    return _poke(raw, 252, "<I", F.crc32c(raw[:252]))


@pytest.mark.parametrize("cond,make,diag", [
    ("V-S1", lambda: _fix_seg_crc(_poke(_seg_header(), 0, "8s", b"CNCRDVOL")), "bad segment magic"),
    ("V-S1", lambda: _fix_seg_crc(_poke(_seg_header(), 8, "<I", 2)), "major version 2"),
    ("V-S1", lambda: _fix_seg_crc(_poke(_seg_header(), 24, "<Q", 4)), "features 0x4"),
    ("V-S2", lambda: _poke(_seg_header(), 64, "<Q", 3), "CRC mismatch"),
    ("V-S2", lambda: _fix_seg_crc(_poke(_seg_header(), 100, "<I", 1)), "reserved"),
    ("V-S2", lambda: _fix_seg_crc(_poke(_seg_header(), 200, "<B", 1)), "reserved"),
])
def test_segment_header_conditions(cond, make, diag):
    assert F.decode_segment_header(bytes(_seg_header()))[1] is None
    hdr, why = F.decode_segment_header(bytes(make()))
    assert hdr is None and diag in why, why


def _fix_rec_crc(raw):
    return _poke(raw, 60, "<I", F.crc32c(raw[:60]))


def _commit_record():
    buf = bytearray(F.record_length(F.COMMIT_BODY_SIZE))
    F.encode_record_into(buf, type=F.REC_COMMIT, lsn=0x1100, epoch=2, salt=9,
                         body=F.encode_commit_body(1, 128, 0x1000, {}), aux=0x1000)
    return buf


@pytest.mark.parametrize("cond,make,diag", [
    ("V-R2", lambda: _poke(_commit_record(), 24, "<Q", 3), "header CRC mismatch"),
    ("V-R3", lambda: _fix_rec_crc(_poke(_commit_record(), 0, "<Q", 0)), "not a positive multiple of 64"),
    ("V-R3", lambda: _fix_rec_crc(_poke(_commit_record(), 0, "<Q", 100)), "not a positive multiple of 64"),
    ("V-R4", lambda: _fix_rec_crc(_poke(_commit_record(), 10, "<H", 1)), "reserved"),
    ("V-R4", lambda: _fix_rec_crc(_poke(_commit_record(), 56, "<I", 1)), "reserved"),
])
def test_record_header_conditions(cond, make, diag):
    assert F.check_record_header_bytes(bytes(_commit_record())) is None
    assert diag in F.check_record_header_bytes(bytes(make()))


def _batch():
    pages = np.arange(3 * 64, dtype=np.uint8).reshape(3, 64)
    buf = np.zeros(F.page_batch_length(3, 64), np.uint8)
    F.encode_page_batch_into(buf, lsn=0x2000, epoch=1, region_id=0, salt=1, page_ids=[1, 4, 6], pages=pages,
                             page_bytes=64)
    return buf


def _fix_tables(buf, count=3):
    struct.pack_into("<I", buf, 36, F.crc32c(buf[64:64 + 8 * count]))
    return _fix_rec_crc(buf)


@pytest.mark.parametrize("cond,make,diag", [
    ("V-P1", lambda: _fix_rec_crc(_poke(_batch(), 40, "<I", 0)), "count 0 out of range"),
    ("V-P1", lambda: _fix_rec_crc(_poke(_batch(), 44, "<I", 100)), "not a positive multiple of 64"),
    ("V-P2", lambda: _fix_rec_crc(_poke(_batch(), 0, "<Q", 64 * 7)), "disagrees with 3 pages"),
    ("V-P3", lambda: _poke(_batch(), 64, "<I", 2), "page table CRC mismatch"),
    ("V-P4", lambda: _fix_tables(_poke(_batch(), 68, "<I", 1)), "not strictly increasing"),
    ("V-P4", lambda: _poke(_batch(), 64 + 24, "<B", 1), "padding is not zero"),
    ("V-P5", lambda: _poke(_batch(), 128 + 64 + 5, "<B", 0xEE), "page CRC mismatch for page 4"),
])
def test_page_batch_conditions(cond, make, diag):
    hdr = F.decode_record_header(bytes(_batch()))
    assert F.page_batch_problem(_batch(), hdr) is None
    buf = make()
    problem = F.page_batch_problem(buf, F.decode_record_header(bytes(buf), check=False))
    assert problem is not None and diag in problem[0], problem


def _region(**changes):
    body = bytearray(F.encode_region_body("r", "<f4", (4, 4), 128, "kv"))
    for off, fmt, value in changes.get("pokes", ()):
        struct.pack_into(fmt, body, off, value)
    return bytes(body) + changes.get("extra", b"")


@pytest.mark.parametrize("cond,body,page_bytes,diag", [
    ("V-G1", _region(extra=b"x"), 128, "fields need"),
    ("V-G1", _region(pokes=[(0, "<H", 0)]), 128, "name length 0"),
    ("V-G1", _region(pokes=[(5, "<B", 1)]), 128, "fields need"),
    ("V-G5", _region(pokes=[(7, "<B", 1)]), 128, "reserved"),
    ("V-G5", _region(pokes=[(6, "<B", 2)]), 128, "framework 2"),
    ("V-G2", _region(pokes=[(16 + 16 + 1, "<B", ord("q"))]), 128, "not allowed"),
    ("V-G2", _region(pokes=[(16 + 16 + 4, "<B", ord("K"))]), 128, "not allowed"),
    ("V-G2", _region(pokes=[(16 + 16, "<B", 0xFF)]), 128, "not valid"),
    ("V-G3", _region(pokes=[(8, "<Q", 65)]), 128, "disagrees with shape"),
    ("V-G4", _region(), 96, "not a positive multiple of 64"),
    ("V-G4", _region(), 0, "not a positive multiple of 64"),
])
def test_region_descriptor_conditions(cond, body, page_bytes, diag):
    assert F.decode_region_body(_region(), 0, 128).pages == 1
    with pytest.raises(CorruptionError, match=diag):
        F.decode_region_body(body, 0, page_bytes)


def test_commit_and_catalog_body_conditions():
    hdr = F.decode_record_header(bytes(_commit_record()))
    good = F.encode_commit_body(1, 2, 3, {0: 5, 1: 6})
    assert F.decode_commit_body(good, hdr).digests == {0: 5, 1: 6}
    with pytest.raises(CorruptionError, match="names 2 regions in a 40-byte body"):  # V-C1
        F.decode_commit_body(good[:-8], hdr)
    with pytest.raises(CorruptionError, match="regions"):  # V-C1: n_regions <= 65536
        F.decode_commit_body(_poke(bytearray(good), 24, "<I", F.MAX_COMMIT_REGIONS + 1), hdr)
    with pytest.raises(CorruptionError, match="reserved"):
        F.decode_commit_body(_poke(bytearray(good), 28, "<I", 1), hdr)

    e = planner.BaseEntry(0, 1, 64, 128, 1, 1, 0)
    good = S.encode_catalog_body(S.Catalog(1, (e,)))
    assert S.decode_catalog_body(good).entries == (e,)
    for body, diag in [
        (good + bytes(48), "lists 1 bases in a 128-byte body"),
        (bytes(_poke(bytearray(good), 8, "<I", S.MAX_CATALOG_ENTRIES + 1)), "bases"),
        (bytes(_poke(bytearray(good), 24, "<Q", 1)), "reserved"),
        (bytes(_poke(bytearray(good), 32 + 44, "<I", 2)), "malformed"),
        (bytes(_poke(bytearray(good), 32 + 16, "<Q", 256)), "malformed"),  # first_lsn > last_lsn
        (bytes(_poke(bytearray(good), 32 + 4, "<I", 0)), "malformed"),  # records == 0
    ]:
        with pytest.raises(CorruptionError, match=diag):  # V-K1
            S.decode_catalog_body(body)


def test_counted_in_epoch_is_v_n1():
    counted = {(t, fl) for t in range(256) for fl in (0, F.FLAG_BASE, F.FLAG_ONE_SYNC)
               if F.counted_in_epoch(t, fl)}
    # of the known types only non-BASE page batches count (V-N1, §8 record_count)
    known = {(t, fl) for t, fl in counted if t & F.TYPE_MASK in F.TYPE_NAMES}
    assert known == {(F.REC_PAGE_BATCH, 0), (F.REC_PAGE_BATCH, F.FLAG_ONE_SYNC),
                     (F.REC_PAGE_BATCH | F.TYPE_IGNORABLE, 0),
                     (F.REC_PAGE_BATCH | F.TYPE_IGNORABLE, F.FLAG_ONE_SYNC)}


# --------------------------------------------------------------------------- citations


def _citable() -> set:
    """Section numbers of FORMAT.md, and "N.k" for item k of a numbered list in §N."""
    out = set(SECTIONS)
    for num, (_, body) in SECTIONS.items():
        out.update(f"{num}.{k}" for k in re.findall(r"(?m)^(\d+)\. ", body))
    return out


def test_every_section_citation_in_the_code_exists():
    ok = _citable()
    bad = []
    for folder in ("wal", "concordia", "tools", "gpu_kernels"):
        for path in sorted((REPO / folder).rglob("*.py")):
            for n, line in enumerate(path.read_text().splitlines(), 1):
                for cite in re.findall(r"§(\d+(?:\.\d+)?)", line):
                    if cite not in ok:
                        bad.append(f"{path.relative_to(REPO)}:{n}: §{cite}")
    assert not bad, "citations of FORMAT.md sections that do not exist: " + ", ".join(bad)


def test_every_constant_of_format_py_cites_its_section():
    """Each top-level constant has a FORMAT.md citation on its line or in the
    comment block of its section."""
    banner, after_rule = None, False
    missing = []
    for line in (WAL_DIR / "format.py").read_text().splitlines():
        if after_rule:  # the comment under a "# ----" rule names the section
            banner = line if "§" in line else None
        after_rule = line.startswith("# ---")
        if line.startswith("class ") or line.startswith("def "):
            continue
        m = re.match(r"^([A-Z][A-Z0-9_]*)(?:,\s*[A-Z][A-Z0-9_]*)*\s*=", line)
        if m and "§" not in line and banner is None:
            missing.append(m.group(1))
    assert not missing, missing
    for name, value in vars(F).items():
        if isinstance(value, struct.Struct):
            assert re.search(rf"`format\.{name}`", SPEC), name


# --------------------------------------------------------------------------- conditions that need the volume


def _volume_image():
    from concordia.devmem import open_backend
    from concordia.wal.volume import Volume

    vol = Volume.create(open_backend("memory:", size=4 << 20), segment_size=1 << 20)
    seg = vol.take_segment(None)  # superblock sequence 1, in slot B
    return vol, seg, bytearray(vol.backend.array.tobytes())


def _open_image(img):
    from concordia.devmem import MemoryBackend
    from concordia.wal.volume import Volume

    return Volume.open(MemoryBackend.from_bytes(bytes(img)))


def test_v_b7_a_slot_holds_only_its_own_parity():
    vol, _, img = _volume_image()
    raw = F.encode_superblock(vol.superblock._replace(sequence=3))  # odd: belongs in slot B
    img[:len(raw)] = raw  # written into slot A
    opened = _open_image(img)
    assert opened.superblock.sequence == 1
    ((where, why),) = opened.slot_problems
    assert where.startswith("superblock slot A") and "belongs to the other slot" in why


@pytest.mark.parametrize("cond,off,fmt,value,diag", [
    ("V-S3", 40, "16s", b"\x01" * 16, "another volume"),
    ("V-S3", 80, "<I", 1, "says index 1"),
    ("V-S3", 72, "<Q", 2 << 20, "size 2097152"),
    ("V-S4", 84, "<I", 0x5A5A5A5A, "disagrees with the superblock"),
    ("V-S4", 64, "<Q", 1 << 30, "disagrees with the superblock"),
])
def test_segment_header_against_the_superblock(cond, off, fmt, value, diag):
    vol, seg, img = _volume_image()
    assert vol.check_segment_header(seg, None) is None
    struct.pack_into(fmt, img, seg.offset + off, value)
    struct.pack_into("<I", img, seg.offset + 252, F.crc32c(img[seg.offset:seg.offset + 252]))
    opened = _open_image(img)
    (live,) = opened.live_segments()
    assert diag in opened.check_segment_header(live, None)


# --------------------------------------------------------------------------- numbered rules (R-*)

RULE = re.compile(r"\((R-[A-Z]\d+)\)(?=\s)")


def _rule_table() -> dict:
    (_, head, rows), = [t for t in _tables(*SECTIONS["13.1"])]
    assert head == ["rule", "decided by"]
    return {r[0]: re.findall(r"`([\w.]+)`", r[1]) for r in rows}


def test_every_rule_names_a_function_that_exists():
    table = _rule_table()
    defined = RULE.findall(SPEC)
    assert len(defined) == len(set(defined)), "a rule is defined twice"
    assert set(table) == set(defined)
    for rule, names in table.items():
        assert names, rule
        for name in names:
            mod, *attrs = name.split(".")
            obj = importlib.import_module(f"concordia.wal.{mod}")
            for a in attrs:
                obj = getattr(obj, a)


def test_rules_are_numbered_in_order():
    by = {}
    for lab in RULE.findall(SPEC):
        by.setdefault(lab[2], []).append(int(lab[3:]))
    for letter, nums in by.items():
        assert sorted(nums) == list(range(1, len(nums) + 1)), letter


def test_every_rule_is_cited_by_the_code_and_every_citation_exists():
    """The code cites each rule where it applies it (`R-D4` in a comment or a
    message), and cites no rule FORMAT.md does not define."""
    defined = set(RULE.findall(SPEC))
    cited, bad = set(), []
    for folder in ("wal", "tools", "concordia"):
        for path in sorted((REPO / folder).rglob("*.py")):
            for n, line in enumerate(path.read_text().splitlines(), 1):
                for r in re.findall(r"\bR-[A-Z]\d+\b", line):
                    cited.add(r)
                    if r not in defined:
                        bad.append(f"{path.relative_to(REPO)}:{n}: {r}")
    assert not bad, bad
    assert defined <= cited, sorted(defined - cited)


def test_r_t1_the_type_is_the_whole_byte():
    from concordia.wal.reader import record_kind

    assert record_kind(F.REC_PAGE_BATCH) == F.REC_PAGE_BATCH
    assert record_kind(F.REC_PAD | F.TYPE_IGNORABLE) == F.REC_PAD
    assert record_kind(F.REC_PAGE_BATCH | F.TYPE_IGNORABLE) is None  # 0x81: unknown, ignorable
    assert record_kind(F.REC_PAD) is None  # 0x7E: unknown, not ignorable
    assert {t for t in range(256) if record_kind(t) is not None} == {1, 2, 3, 4, 5, 0xFE}


def test_v_c1_unsorted_commit_digests_are_refused():
    body = F.COMMIT_BODY.pack(0, 0, 0, 2, 0) + F.COMMIT_DIGEST.pack(3, 1) + F.COMMIT_DIGEST.pack(1, 2)
    hdr = F.RecordHeader(64 + 48, F.REC_COMMIT, 0, F.NO_REGION, 1 << 20, 1, 1, 0, len(body), 0, 0, 0)
    with pytest.raises(CorruptionError, match="not sorted"):
        F.decode_commit_body(body, hdr)
