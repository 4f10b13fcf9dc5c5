"""The snapshot catalog's entry type and its codec (FORMAT.md §12.2), pure: no
I/O, imported by the planner (which reads catalogs) and by `snapshot` (which
writes them) alike.

Catalog record (type 0x04, generic record: header `count` = body bytes, `aux` =
LSN of the catalog it replaces, `epoch` = newest base epoch listed)::

    head   <QIIQQ   sequence, entries, keep_bases, floor_epoch, reserved(0)   32 bytes
    entry  <IIQQQQII region_id, records, epoch, first_lsn, last_lsn, pages,
                    digest, flags                                            48 bytes each

A base of region R at epoch E is the set of BASE page batches of R with epoch
E and LSN in [first_lsn, last_lsn]; there must be `records` of them, together
covering every page of the region once; `digest` is the region digest.  An
image entry (flags bit 0, IMAGE) names instead the page batches without BASE
that committed epoch E wrote of R, which together cover every page of it: an
epoch that wrote the region whole is its base, and nothing is written twice.
`floor_epoch` is the oldest epoch retention still restores (0 = every epoch);
`keep_bases` the retention policy that produced the catalog (0 = keep all).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from concordia.wal.errors import CorruptionError, WalError

# FORMAT.md §12.2: catalog body = head (32 bytes) + entries (48 bytes each);
# V-K1 bounds the entry count
CATALOG_HEAD = struct.Struct("<QIIQQ")
CATALOG_HEAD_SIZE = 32
CATALOG_ENTRY = struct.Struct("<IIQQQQII")
CATALOG_ENTRY_SIZE = 48
#: the most bases of each region a retention policy keeps: the head's keep_bases field is 32 bits
MAX_KEEP_BASES = 0xFFFFFFFF
MAX_CATALOG_ENTRIES = 1 << 20
#: entry flag bit 0: an image entry (the base is epoch E's own page batches)
ENTRY_IMAGE = 0x1
KNOWN_ENTRY_FLAGS = ENTRY_IMAGE

assert CATALOG_HEAD.size == CATALOG_HEAD_SIZE and CATALOG_ENTRY.size == CATALOG_ENTRY_SIZE


@dataclass(frozen=True)
class BaseEntry:
    """A catalog entry: the base snapshot of one region at one epoch, made of the
    BASE page batches of that region and epoch with LSN in [first_lsn, last_lsn]
    (or, for an image entry, of the committed page batches without BASE that
    the epoch wrote of the region, covering it whole)."""

    region_id: int
    epoch: int
    first_lsn: int
    last_lsn: int
    records: int
    pages: int
    digest: int
    flags: int = 0

    @property
    def image(self) -> bool:
        """The base is the epoch's own page batches (ENTRY_IMAGE), not BASE ones."""
        return bool(self.flags & ENTRY_IMAGE)


@dataclass(frozen=True)
class Catalog:
    sequence: int
    entries: tuple  # BaseEntry, sorted by (region_id, epoch)
    keep_bases: int = 0
    floor_epoch: int = 0
    lsn: int = 0  # where it lies in the log (0 = not written / none)

    @property
    def newest_epoch(self) -> int:
        return max((e.epoch for e in self.entries), default=0)

    def of_region(self, region_id: int) -> list:
        return sorted((e for e in self.entries if e.region_id == region_id), key=lambda e: e.epoch)


EMPTY_CATALOG = Catalog(sequence=0, entries=())


def encode_catalog_body(cat: Catalog) -> bytes:
    entries = sorted(cat.entries, key=lambda e: (e.region_id, e.epoch))
    if len(entries) > MAX_CATALOG_ENTRIES:
        raise WalError(f"a catalog lists at most {MAX_CATALOG_ENTRIES} bases")
    return CATALOG_HEAD.pack(cat.sequence, len(entries), cat.keep_bases, cat.floor_epoch, 0) + b"".join(
        CATALOG_ENTRY.pack(e.region_id, e.records, e.epoch, e.first_lsn, e.last_lsn, e.pages,
                           e.digest & 0xFFFFFFFF, e.flags)
        for e in entries
    )


def decode_catalog_body(body, *, lsn: int = 0) -> Catalog:
    """Decode a catalog body (untrusted: every count is checked against the
    length).  Raises CorruptionError without `where` (the caller adds it)."""
    body = memoryview(body).cast("B")
    if len(body) < CATALOG_HEAD_SIZE:
        raise CorruptionError(f"catalog body of {len(body)} bytes is shorter than its head")
    seq, n, keep, floor, r = CATALOG_HEAD.unpack_from(body, 0)
    if r:
        raise CorruptionError("reserved catalog bytes are not zero")
    if n > MAX_CATALOG_ENTRIES or CATALOG_HEAD_SIZE + n * CATALOG_ENTRY_SIZE != len(body):
        raise CorruptionError(f"catalog lists {n} bases in a {len(body)}-byte body")
    entries = []
    for i in range(n):
        rid, recs, ep, lo, hi, pages, dig, fl = CATALOG_ENTRY.unpack_from(body, CATALOG_HEAD_SIZE + i * CATALOG_ENTRY_SIZE)
        if fl & ~KNOWN_ENTRY_FLAGS or lo > hi or recs == 0:
            raise CorruptionError(f"catalog entry {i} is malformed (lsn {lo}..{hi}, {recs} records, flags 0x{fl:x})")
        entries.append(BaseEntry(rid, ep, lo, hi, recs, pages, dig, fl))
    return Catalog(sequence=seq, entries=tuple(entries), keep_bases=keep, floor_epoch=floor, lsn=lsn)
