"""The record walk the inspecting subcommands share: every valid record and
every damaged range of a volume in LSN order, as the JSON-able dicts that
`dump --json` prints (schema in docs/cli.md), with the torn-tail / corruption
call of FORMAT.md §5.5 made the same way the reader makes it.

Reading is left to `wal.reader.Scanner` (every checksum, the resync after a
bad header); this module only names what it found.
"""

from __future__ import annotations

from concordia.wal import format as F
from concordia.wal.reader import Scanner

from .common import Where

#: Scanner item tags (wal/reader.py)
REC, DMG = 0, 1


def walk(vol, *, check_pages: bool = True, from_lsn: int = 0):
    """Scanner items of every live segment whose LSN range reaches `from_lsn`
    (segments wholly below it are not read, which keeps `dump --follow` cheap
    on a long log): (REC, seg, offset, header tuple) or (DMG, seg, offset,
    length, reason[, hides_commit]).  A live segment with an invalid header
    is one damaged range."""
    for it in Scanner(vol, check_pages=check_pages).items(from_lsn=from_lsn):
        Where.at = it[1].where(it[2])
        yield it


def last_commit_lsn(items) -> int:
    """LSN of the last valid commit record among `items` (or of a damaged
    segment header hiding one), -1 when there is none: a damaged range past it
    is a torn tail, one before it corruption (FORMAT.md §5.5).  Walks with and
    without page checks agree on it (they differ only in page payload CRCs)."""
    return max((it[1].lsn(it[2]) for it in items
                if (it[0] == REC and it[3][1] & F.TYPE_MASK == F.REC_COMMIT)
                or (it[0] == DMG and len(it) > 5 and it[5])), default=-1)


def region_names(vol, items) -> dict:
    """{region id: name} from the valid region descriptors among `items`."""
    names = {}
    mv = vol.backend.view
    for it in items:
        if it[0] != REC or it[3][1] & F.TYPE_MASK != F.REC_REGION:
            continue
        h, off = it[3], it[2]
        try:
            info = F.decode_region_body(mv[off + 64:off + 64 + h[9]], h[4], h[10])
        except Exception:  # a bad descriptor is reported by verify; here it has no name
            continue
        names[info.id] = info.name
    return names


def type_name(typ: int) -> str:
    return F.TYPE_NAMES.get(typ & F.TYPE_MASK, f"0x{typ:02x}")


def _desc(vol, h, off: int) -> str:
    """A short type-specific summary of a valid record's body."""
    mv = vol.backend.view
    kind = h[1] & F.TYPE_MASK
    try:
        if kind == F.REC_PAGE_BATCH:
            return "base" if h[2] & F.FLAG_BASE else ""
        if kind == F.REC_COMMIT:
            hdr = F.RecordHeader(*F._unpack_header(mv, off))
            c = F.decode_commit_body(mv[off + 64:off + 64 + h[9]], hdr)
            return (f"commit records={c.record_count} bytes={c.record_bytes} digests={len(c.digests)} "
                    f"prev=0x{c.prev_commit_lsn:x}")
        if kind == F.REC_REGION:
            r = F.decode_region_body(mv[off + 64:off + 64 + h[9]], h[4], h[10])
            shape = ",".join(str(s) for s in r.shape)
            layout = f" layout={r.dtype}" if r.logical else ""
            fw = f" framework={r.framework}" if r.framework != "array" else ""
            return (f"define {r.name} {r.logical_dtype}[{shape}]{layout}{fw} kind={r.kind} "
                    f"page_bytes={r.page_bytes} pages={r.pages}")
        if kind == F.REC_CATALOG:
            from concordia.wal.snapshot import decode_catalog_body

            cat = decode_catalog_body(mv[off + 64:off + 64 + h[9]])
            return f"catalog seq={cat.sequence} bases={len(cat.entries)} floor={cat.floor_epoch} prev=0x{h[11]:x}"
    except Exception as exc:  # the body fails its own rules: say so, do not stop
        return f"undecodable body: {' '.join(str(exc).split())}"
    return ""


def record_dict(vol, it, names: dict, tail: bool) -> dict:
    """The dump JSON form of one Scanner item (docs/cli.md, `dump --json`)."""
    seg, off = it[1], it[2]
    lsn = seg.lsn(off)
    if it[0] == REC:
        h = it[3]
        kind = h[1] & F.TYPE_MASK
        rid = h[4]
        return {
            "lsn": lsn, "segment": seg.index, "offset": off, "where": seg.where(off),
            "type": type_name(h[1]), "type_code": h[1], "flags": h[2], "base": bool(h[2] & F.FLAG_BASE),
            "epoch": h[6], "region_id": None if rid == F.NO_REGION else rid,
            "region": None if rid == F.NO_REGION else names.get(rid, f"#{rid}"),
            "pages": h[9] if kind == F.REC_PAGE_BATCH else 0,
            "page_bytes": h[10], "length": h[0], "crc": "OK", "problem": None, "tail": False,
            "desc": _desc(vol, h, off),
        }
    length, reason = it[3], it[4]
    d = {
        "lsn": lsn, "segment": seg.index, "offset": off, "where": seg.where(off),
        "type": "damaged", "type_code": None, "flags": None, "base": False, "epoch": None,
        "region_id": None, "region": None, "pages": 0, "page_bytes": 0, "length": length,
        "crc": "BAD", "problem": reason, "tail": tail, "desc": ("torn tail: " if tail else "") + reason,
    }
    # the header may be intact and only the body bad: show what it says
    mv = vol.backend.view
    if off >= seg.offset + F.SEGMENT_HEADER_SIZE and off + 64 <= vol.backend.size \
            and F.check_record_header_bytes(mv, off) is None:
        h = F.RECORD_HEADER.unpack_from(mv, off)
        if h[5] == lsn:
            rid = h[4]
            d.update(type=type_name(h[1]), type_code=h[1], flags=h[2], base=bool(h[2] & F.FLAG_BASE),
                     epoch=h[6], region_id=None if rid == F.NO_REGION else rid,
                     region=None if rid == F.NO_REGION else names.get(rid, f"#{rid}"),
                     pages=h[9] if h[1] & F.TYPE_MASK == F.REC_PAGE_BATCH else 0, page_bytes=h[10])
    return d
