"""The record walk the inspecting subcommands share: every valid record and
every damaged range of a volume in LSN order, as the JSON-able dicts that
`dump --json` prints (schema in docs/cli.md).  Whether a damaged range is a
torn tail or corruption, and which records fail their region descriptor, is
the reader's decision (`reader.recover`, FORMAT.md §11.1 R-D2, R-P1), taken
here from it, never made again.

Reading is left to `wal.reader.Scanner` (every checksum, the resync after a
bad header); this module only names what it found.  Walk items are the
reader's named records: `Found` (tag REC: seg, offset, header) and
`Damaged` (tag DMG: seg, offset, length, reason, hides_commit).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from concordia.wal import format as F
from concordia.wal.errors import CorruptionError
from concordia.wal.reader import Damaged, Found, Scanner, record_kind

from .common import Where

#: Scanner item tags (wal/reader.py)
REC, DMG = 0, 1


def walk(vol, *, check_pages: bool = True, from_lsn: int = 0):
    """Scanner items of every live segment whose LSN range reaches `from_lsn`
    (segments wholly below it are not read, which keeps `dump --follow` cheap
    on a long log): `Found` or `Damaged`.  A live segment with an invalid
    header is one damaged range."""
    for it in Scanner(vol, check_pages=check_pages).items(from_lsn=from_lsn):
        Where.at = it.seg.where(it.offset)
        yield it


@dataclass
class Decision:
    """What the reader decided about a walk, as dump shows it: the commit
    point (R-D2), the kind ("corrupt" / "torn") and reason of every damaged
    place by (segment, offset), and the problems outside any record (a bad
    superblock slot, truncated media, a lost catalog)."""

    commit_point_lsn: int = -1
    damaged: dict = field(default_factory=dict)  # (segment, offset) -> (kind, reason)
    outside: list = field(default_factory=list)  # Dropped


def decide_walk(vol, items) -> Decision:
    """The reader's decision over `items` (a walk of `vol`), without reading again."""
    from concordia.wal.decide import RecoveryMode
    from concordia.wal.reader import recover

    # "last": the pages of a last ONE_SYNC commit's records are checked, the
    # only ones whose damage changes what the log commits (§10.4b, R-D1)
    res = recover(vol, RecoveryMode.SKIP_CORRUPT, None, check_pages="last", items=items)
    d = Decision(res.commit_point_lsn)
    for p in res.dropped:
        if p.kind in ("corrupt", "torn") and p.segment >= 0 and p.length:
            d.damaged.setdefault((p.segment, p.offset), (p.kind, p.reason))
        elif p.kind in ("superblock", "truncated") or (p.kind == "corrupt" and not p.length):
            d.outside.append(p)
    return d


def last_commit_lsn(items, vol=None) -> int:
    """LSN of the commit point among `items` (R-D2), -1 when there is none: a
    damaged range past it is a torn tail, one before it corruption.  With
    `vol` it is the reader's (the catalog the superblock names counts);
    without, the last valid commit or a damaged segment header hiding one."""
    if vol is not None:
        return decide_walk(vol, list(items)).commit_point_lsn
    return max((it.seg.lsn(it.offset) for it in items
                if (it.tag == REC and it.header.type == F.REC_COMMIT)
                or (it.tag == DMG and it.hides_commit)), default=-1)


def region_names(vol, items) -> dict:
    """{region id: name} from the valid region descriptors among `items`."""
    names = {}
    mv = vol.backend.view
    for it in items:
        if it.tag != REC or it.header.type != F.REC_REGION:
            continue
        h, off = it.header, it.offset
        try:
            info = F.decode_region_body(F.record_body(mv, off, h.count), h.region_id, h.page_bytes)
        except Exception:  # a bad descriptor is reported by verify; here it has no name
            continue
        names[info.id] = info.name
    return names


def type_name(typ: int) -> str:
    kind = record_kind(typ)  # R-T1: the whole byte
    return F.TYPE_NAMES[kind] if kind is not None else f"0x{typ:02x}"


def _desc(vol, h, off: int) -> str:
    """A short type-specific summary of a valid record's body."""
    mv = vol.backend.view
    kind = record_kind(h.type)
    body = F.record_body(mv, off, h.count)
    try:
        if kind == F.REC_PAGE_BATCH:
            return "base" if h.flags & F.FLAG_BASE else ""
        if kind == F.REC_COMMIT:
            c = F.decode_commit_body(body, h)
            return (f"commit records={c.record_count} bytes={c.record_bytes} digests={len(c.digests)} "
                    f"prev=0x{c.prev_commit_lsn:x}")
        if kind == F.REC_REGION:
            r = F.decode_region_body(body, h.region_id, h.page_bytes)
            shape = ",".join(str(s) for s in r.shape)
            layout = f" layout={r.dtype}" if r.logical else ""
            fw = f" framework={r.framework}" if r.framework != "array" else ""
            return (f"define {r.name} {r.logical_dtype}[{shape}]{layout}{fw} kind={r.kind} "
                    f"page_bytes={r.page_bytes} pages={r.pages}")
        if kind == F.REC_CATALOG:
            from concordia.wal.snapshot import decode_catalog_body

            cat = decode_catalog_body(body)
            return f"catalog seq={cat.sequence} bases={len(cat.entries)} floor={cat.floor_epoch} prev=0x{h.aux:x}"
    except Exception as exc:  # the body fails its own rules: say so, do not stop
        return f"undecodable body: {' '.join(str(exc).split())}"
    return ""


def _region_fields(h, names: dict) -> dict:
    rid = h.region_id
    return {"region_id": None if rid == F.NO_REGION else rid,
            "region": None if rid == F.NO_REGION else names.get(rid, f"#{rid}")}


def record_dict(vol, it, names: dict, tail: bool) -> dict:
    """The dump JSON form of one Scanner item (docs/cli.md, `dump --json`)."""
    seg, off = it.seg, it.offset
    lsn = seg.lsn(off)
    if it.tag == REC:
        h = it.header
        return {
            "lsn": lsn, "segment": seg.index, "offset": off, "where": seg.where(off),
            "type": type_name(h.type), "type_code": h.type, "flags": h.flags, "base": bool(h.flags & F.FLAG_BASE),
            "epoch": h.epoch, **_region_fields(h, names),
            "pages": h.count if h.type == F.REC_PAGE_BATCH else 0,
            "page_bytes": h.page_bytes, "length": h.length, "crc": "OK", "problem": None, "tail": False,
            "desc": _desc(vol, h, off),
        }
    d = {
        "lsn": lsn, "segment": seg.index, "offset": off, "where": seg.where(off),
        "type": "damaged", "type_code": None, "flags": None, "base": False, "epoch": None,
        "region_id": None, "region": None, "pages": 0, "page_bytes": 0, "length": it.length,
        "crc": "BAD", "problem": it.reason, "tail": tail, "desc": ("torn tail: " if tail else "") + it.reason,
    }
    # the header may be intact and only the body bad: show what it says
    mv = vol.backend.view
    h = None
    if off >= seg.offset + F.SEGMENT_HEADER_SIZE:
        try:
            h = F.decode_record_header(mv, off)  # past the mapping's end: refused as damaged
        except CorruptionError:
            pass  # the header is damaged too: nothing it says is shown
    if h is not None and h.lsn == lsn:
        d.update(type=type_name(h.type), type_code=h.type, flags=h.flags, base=bool(h.flags & F.FLAG_BASE),
                 epoch=h.epoch, **_region_fields(h, names),
                 pages=h.count if h.type == F.REC_PAGE_BATCH else 0, page_bytes=h.page_bytes)
    return d


def as_decided(it, decision: Decision):
    """`it`, or the damaged range the decision makes of it (a record failing
    R-P1 walks as valid and is damaged by the decision), and whether it is a
    torn tail (R-D2)."""
    key = (it.seg.index, it.offset)
    kind_reason = decision.damaged.get(key)
    if it.tag == REC:
        if kind_reason is None:
            return it, False
        it = Damaged(DMG, it.seg, it.offset, it.header.length, kind_reason[1])
    if kind_reason is not None:
        return it, kind_reason[0] == "torn"
    return it, it.seg.lsn(it.offset) > decision.commit_point_lsn


__all__ = ["REC", "DMG", "Found", "Damaged", "Decision", "walk", "decide_walk", "last_commit_lsn",
           "region_names", "type_name", "record_dict", "as_decided"]
