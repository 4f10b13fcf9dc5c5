"""One recovery truth: a conformance table, damage class x consumer -> one
expected outcome (FORMAT.md §11.1, R-D1..R-D8).

Every case damages or forges a copy of a small log built here (with the
appender, `wal/format.py`'s encoders and byte-poking helpers), and every
consumer must report the same decision about it: the epoch recovery restores
(None: recovery refuses), the exit code, and a fragment of the message.  The
consumers: `concordia-wal verify`, `info`, `recover --plan`, `restore` of
every region (the .npy it writes is compared bit for bit with the model),
`dump`, `Log.open` and `Session.recover`.  The classes of
`tests/wal/test_damage.py` are all here, and each numbered finding of the
issue that brought in the decision module has its cases (F1..F11 in the ids;
F12: the disagreements of issue 29).

Then damaged copies of a demo log (made on the CPU with the demo's own code):
`verify`, `recover --plan` and `restore` of every region agree on the epoch
and the exit code in every mode.
"""

from __future__ import annotations

import json
import re
import shutil
import struct
from dataclasses import dataclass

import numpy as np
import pytest
from click.testing import CliRunner

from concordia.devmem import MemoryBackend, open_backend
from concordia.tools.common import exit_code_of
from concordia.tools.wal_cli import main
from concordia.wal import Log
from concordia.wal import format as F
from concordia.wal.decide import RecoveryMode as M
from concordia.wal.errors import ConcordiaError

from .helpers import crc_ref, fix_header_crc, fix_segment_crc

MiB = 1 << 20
KV_PAGES, KV_PB, KV_PER = 32, 16384, 6
AD_PAGES, AD_PB, AD_PER = 8, 1024, 2
EPOCHS = 24
REGIONS = ("kv", "ad")


# --------------------------------------------------------------------------- the model


class Model:
    """Region r at epoch e: every epoch writes KV_PER / AD_PER pages chosen by
    a seed of (r, e)."""

    geom = {"kv": (KV_PAGES, KV_PB, KV_PER), "ad": (AD_PAGES, AD_PB, AD_PER)}

    def __init__(self):
        self.states = {(r, 0): np.zeros((n, pb), np.uint8) for r, (n, pb, _) in self.geom.items()}

    def write(self, r, e):
        n, pb, k = self.geom[r]
        rng = np.random.default_rng((REGIONS.index(r), e))
        ids = np.sort(rng.choice(n, k, replace=False)).astype(np.uint32)
        return ids, rng.integers(0, 256, (k, pb), dtype=np.uint8)

    def state(self, r, e):
        if (r, e) not in self.states:
            s = self.state(r, e - 1).copy()
            ids, pages = self.write(r, e)
            s[ids] = pages
            self.states[(r, e)] = s
        return self.states[(r, e)]

    def digest(self, r, e):
        return F.region_digest(F.page_crcs_of(self.state(r, e)))


MODEL = Model()


def write_epochs(log, first, last, ids):
    for e in range(first, last + 1):
        for r in REGIONS:
            pids, pages = MODEL.write(r, e)
            log.appender.append_page_batch(e, ids[r], pids, pages)
        log.appender.commit(e, {ids[r]: MODEL.digest(r, e) for r in REGIONS})


def new_log(backend):
    log = Log.create(backend, segment_size=MiB)
    ids = {"kv": log.define_region("kv", np.uint8, (KV_PAGES * KV_PB,), KV_PB, "kv"),
           "ad": log.define_region("ad", np.uint8, (AD_PAGES * AD_PB,), AD_PB, "adapter")}
    return log, ids


def image_of(log) -> bytes:
    return bytes(log.backend.array.tobytes())


def uncommitted_tail(log, ids, e):
    pids, pages = MODEL.write("kv", e)
    log.appender.append_page_batch(e, ids["kv"], pids, pages)
    log.appender.sync()


@dataclass
class Built:
    img: bytes
    recs: list  # every valid record (committed or not), LSN order
    segs: list
    sb: object
    last: int  # last committed epoch


def describe(img: bytes, last: int) -> Built:
    log = Log.open(MemoryBackend.from_bytes(img), writable=False)
    b = Built(img, list(log.records(committed_only=False)), log.volume.live_segments(), log.volume.superblock, last)
    assert log.last_committed_epoch == last and not [d for d in log.dropped if d.kind == "corrupt"]
    log.close()
    return b


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    """The logs the cases damage: two-phase commits (memory), ONE_SYNC
    commits (a file), a log with a gap in its segment numbers (a cut), and
    compacted ones (bases and catalog; with and without a commit after, and
    one whose deltas before its bases were reclaimed)."""
    out = {}
    log, ids = new_log(open_backend("memory:", size=8 * MiB))
    write_epochs(log, 1, EPOCHS, ids)
    uncommitted_tail(log, ids, EPOCHS + 1)
    out["plain"] = describe(image_of(log), EPOCHS)
    log.close()

    path = tmp_path_factory.mktemp("onesync") / "o.log"
    log = Log.create(f"file:{path}", size=8 * MiB, segment_size=MiB)
    ids = {"kv": log.define_region("kv", np.uint8, (KV_PAGES * KV_PB,), KV_PB, "kv"),
           "ad": log.define_region("ad", np.uint8, (AD_PAGES * AD_PB,), AD_PB, "adapter")}
    assert log.appender.one_sync
    write_epochs(log, 1, 12, ids)
    log.close()
    out["onesync"] = describe(path.read_bytes(), 12)

    # a cut leaves a gap in seq: epoch 9 rolls into a new segment and is never
    # committed; the writer's open frees that segment and its number is not reissued
    b = open_backend("memory:", size=8 * MiB)
    log, ids = new_log(b)
    write_epochs(log, 1, 8, ids)
    live0 = len(log.volume.live_segments())
    while len(log.volume.live_segments()) == live0:
        uncommitted_tail(log, ids, 9)
    crash = MemoryBackend.from_bytes(image_of(log))  # the writer dies here
    log.close()
    log = Log.open(crash, writable=True)
    write_epochs(log, 9, 20, ids)
    seqs = [s.seq for s in log.volume.live_segments()]
    assert any(y - x > 1 for x, y in zip(seqs, seqs[1:])), seqs
    out["gap"] = describe(image_of(log), 20)
    log.close()

    # a descriptor written again (as compaction and a writer's cut do, R-G1)
    log, ids = new_log(open_backend("memory:", size=8 * MiB))
    write_epochs(log, 1, 4, ids)
    first = next(r for r in log.records() if r.kind == F.REC_REGION and r.region_id == ids["kv"])
    log.appender.append_record(type=F.REC_REGION, epoch=0, body=bytes(first.body), region_id=ids["kv"],
                               page_bytes=KV_PB)
    write_epochs(log, 5, 8, ids)
    out["repeat"] = describe(image_of(log), 8)
    log.close()

    from concordia.wal.compaction import compact

    log, ids = new_log(open_backend("memory:", size=8 * MiB))
    write_epochs(log, 1, 16, ids)
    compact(log, 12, keep_bases=0)
    write_epochs(log, 17, 20, ids)
    assert log.volume.superblock.oldest_lsn > 0
    out["compacted"] = describe(image_of(log), 20)
    log.close()

    # one base per region kept: the deltas before it are reclaimed (oldest_epoch > 0)
    log, ids = new_log(open_backend("memory:", size=8 * MiB))
    write_epochs(log, 1, 16, ids)
    compact(log, 12, keep_bases=1)
    write_epochs(log, 17, 20, ids)
    assert log.volume.superblock.oldest_epoch > 0
    out["retained"] = describe(image_of(log), 20)
    log.close()

    log, ids = new_log(open_backend("memory:", size=8 * MiB))
    write_epochs(log, 1, 16, ids)
    compact(log, 16, keep_bases=0, reclaim=False)
    out["based"] = describe(image_of(log), 16)  # bases and catalog after the last commit
    log.close()
    return out


# --------------------------------------------------------------------------- the consumers

RUNNER = CliRunner()


def cli(*args):
    r = RUNNER.invoke(main, [str(a) for a in args])
    assert r.exception is None or isinstance(r.exception, SystemExit), (args, r.output)
    return r.exit_code, r.output


def _restored_epoch(text: str, region: str):
    m = re.search(rf"restored {region} at epoch (\d+)", text)
    return int(m.group(1)) if m else None


def consumers(path, mode: M, regions=REGIONS, tmp=None, per_region=None) -> dict:
    """{consumer: (epoch or None, exit code or None, text)} for the log file at `path`.
    per_region: {region: epoch} where a region restores another epoch than the
    outcome's (skip_corrupt), for the bit-for-bit check of Session.recover."""
    spec = f"file:{path}"
    m = mode.cli
    out = {}
    rc, text = cli("verify", spec, "--json", "--mode", m)
    doc = json.loads(text) if text.startswith("{") else None
    out["verify"] = (doc["recovery"]["epoch"] if doc else None, rc, text)
    rc, text = cli("recover", spec, "--plan", "--json", "--mode", m)
    doc = json.loads(text) if text.startswith("{") else None
    out["plan"] = (doc["epoch"] if doc else None, rc, text)
    for r in regions:
        npy = tmp / f"{r}.npy"
        rc, text = cli("restore", spec, "--region", r, "--out", npy, "--force", "--mode", m)
        e = _restored_epoch(text, r)
        if e is not None:  # what was written is the model's state at that epoch, bit for bit
            got = np.load(npy).reshape(MODEL.geom[r][0], MODEL.geom[r][1])
            assert (got == MODEL.state(r, e)).all(), (r, e)
        out[f"restore {r}"] = (e, rc, text)
    if mode is M.TOLERATE_TAIL:
        rc, text = cli("info", spec, "--json")
        doc = json.loads(text) if text.startswith("{") else None
        out["info"] = (doc["recovery"]["epoch"] if doc else None, rc, text)
        rc, text = cli("dump", spec, "--json")
        out["dump"] = (None, rc, text)
    try:
        log = Log.open(spec, writable=False, mode=mode)
    except ConcordiaError as exc:
        out["Log.open"] = (None, exit_code_of(exc), str(exc))
    else:
        out["Log.open"] = (log.last_committed_epoch or None, None,
                           "; ".join(f"{d.where}: {d.reason}" for d in log.dropped))
        log.close()
    out["Session.recover"] = _session(path, tmp, mode, per_region or {})
    return out


def _session(path, tmp, mode: M, per_region: dict):
    """Session(create=False).recover(mode=...) on a copy: the open refuses
    nothing the command lines can read (it only reads), and the mode is
    decided at recover.  Every region it returns is the model's state at
    the epoch it restores, bit for bit."""
    from concordia.session import Session

    copy = tmp / "session.log"
    shutil.copyfile(path, copy)
    try:
        s = Session(f"file:{copy}", create=False)
    except ConcordiaError as exc:
        return None, exit_code_of(exc), f"open: {exc}"
    try:
        got = s.recover(mode=mode.value)
    except ConcordiaError as exc:
        return None, exit_code_of(exc), str(exc)
    finally:
        s.close()
    e = s.last_recovery.epoch
    for r in REGIONS:
        want = per_region.get(r, e)
        if want is None:  # skip_corrupt: a region no epoch of which is whole is not returned
            assert r not in got, r
            continue
        assert (np.asarray(got[r]).reshape(MODEL.geom[r][:2]) == MODEL.state(r, want)).all(), (r, want)
    return e, None, ""


# --------------------------------------------------------------------------- byte poking


def rec(b: Built, kind, epoch, region=None, base=False, nth=0):
    rid = None if region is None else REGIONS.index(region)
    got = [r for r in b.recs if r.kind == kind and r.epoch == epoch
           and (rid is None or r.region_id == rid) and bool(r.flags & F.FLAG_BASE) == base]
    return got[nth]


def fix_body(img, r_off):
    """Recompute a generic-body record's body CRC, then its header CRC."""
    count = struct.unpack_from("<I", img, r_off + F.OFF_COUNT)[0]
    struct.pack_into("<I", img, r_off + F.OFF_BODY_CRC, crc_ref(bytes(img[r_off + 64:r_off + 64 + count])))
    fix_header_crc(img, r_off)


def fix_tables(img, r_off):
    """Recompute a page batch's body CRC (index + CRC tables), then its header CRC."""
    count = struct.unpack_from("<I", img, r_off + F.OFF_COUNT)[0]
    struct.pack_into("<I", img, r_off + F.OFF_BODY_CRC, crc_ref(bytes(img[r_off + 64:r_off + 64 + 8 * count])))
    fix_header_crc(img, r_off)


def newest_slot(b):
    return (b.sb.sequence % 2) * b.sb.slot_bytes


def page_flip(r):
    def f(img, b):
        img[r(b).offset + r(b).length - 100] ^= 0x01
    return f


def kv10(b):
    return rec(b, F.REC_PAGE_BATCH, 10, "kv")


def d_length_zero(img, b):
    img[kv10(b).offset:kv10(b).offset + 8] = bytes(8)


def d_length_changed(img, b):
    struct.pack_into("<Q", img, kv10(b).offset, kv10(b).length + 64)


def d_type(byte, fix=True):
    def f(img, b):
        img[kv10(b).offset + F.OFF_TYPE] = byte
        if fix:
            fix_header_crc(img, kv10(b).offset)
    return f


def d_header_crc(img, b):
    img[kv10(b).offset + 61] ^= 0xFF


def d_zero_record(kind, epoch):
    def f(img, b):
        r = rec(b, kind, epoch)
        img[r.offset:r.offset + r.length] = bytes(r.length)
    return f


def d_stale_salt(img, b):
    struct.pack_into("<I", img, kv10(b).offset + F.OFF_SALT, 0x5A5A5A5A)
    fix_header_crc(img, kv10(b).offset)


def d_chain(i):
    def f(img, b):
        s = b.segs[i]
        struct.pack_into("<I", img, s.offset + 96, 0x12345678)
        fix_segment_crc(img, s.offset)
    return f


def d_last_segment_header(img, b):
    img[b.segs[-1].offset + 70] ^= 0x01


def d_newest_slot(img, b):
    img[newest_slot(b) + 70] ^= 0x01


def d_both_slots(img, b):
    img[70] ^= 0x01
    img[b.sb.slot_bytes + 70] ^= 0x01


def d_slot_magic(img, b):
    off = newest_slot(b)
    img[off:off + 8] = bytes(8)


def d_commit_field(epoch, field_off, delta):
    def f(img, b):
        r = rec(b, F.REC_COMMIT, epoch)
        o = r.offset + 64 + field_off
        struct.pack_into("<Q", img, o, struct.unpack_from("<Q", img, o)[0] + delta)
        fix_body(img, r.offset)
    return f


def d_unsorted_digests(img, b):
    d_unsorted_digests_of(10)(img, b)


def d_unsorted_digests_of(epoch):
    def f(img, b):
        r = rec(b, F.REC_COMMIT, epoch)
        o = r.offset + 64 + F.COMMIT_BODY_SIZE
        a, c = bytes(img[o:o + 8]), bytes(img[o + 8:o + 16])
        img[o:o + 16] = c + a
        fix_body(img, r.offset)
    return f


def d_flag(img, b):
    img[kv10(b).offset + F.OFF_FLAGS] |= 0x04
    fix_header_crc(img, kv10(b).offset)


def d_page_id(img, b):
    r = kv10(b)
    struct.pack_into("<I", img, r.offset + 64 + 4 * (r.count - 1), KV_PAGES + 8)
    fix_tables(img, r.offset)


def d_foreign_region(img, b):
    r = rec(b, F.REC_PAGE_BATCH, 10, "ad")
    struct.pack_into("<I", img, r.offset + F.OFF_REGION, 7)
    fix_header_crc(img, r.offset)


def d_descriptor_page_bytes(img, b):
    r = next(r for r in b.recs if r.kind == F.REC_REGION and r.region_id == 0)
    struct.pack_into("<I", img, r.offset + F.OFF_PAGE_BYTES, KV_PB // 2)
    fix_header_crc(img, r.offset)


def d_descriptor_padding(region_id):
    """A bit of the zero fill after a region descriptor's body (its body CRC
    does not cover it, §5.3): the descriptor is damaged, so every page batch
    of the region names a region no descriptor defines (R-P1)."""
    def f(img, b):
        r = next(r for r in b.recs if r.kind == F.REC_REGION and r.region_id == region_id)
        assert r.length > 64 + r.count
        img[r.offset + r.length - 1] ^= 0x01
    return f


def d_redefine(img, b):
    r = [r for r in b.recs if r.kind == F.REC_REGION and r.region_id == 0][-1]
    body = bytes(img[r.offset + 64:r.offset + 64 + r.count])
    i = body.rindex(b"kv")  # the kind text: same length, another kind
    img[r.offset + 64 + i:r.offset + 66 + i] = b"kx"
    fix_body(img, r.offset)


def d_ignorable_at_end(img, b):
    """A valid record of an unknown ignorable type (0xC0, generic body) at the
    write position, after the last record."""
    last = b.recs[-1]
    seg = next(s for s in b.segs if s.index == last.segment)
    off = last.offset + last.length
    body = b"a later version's record"
    rec_bytes = bytearray(64 + F.align64(len(body)))
    rec_bytes[64:64 + len(body)] = body
    F.encode_record_header_into(rec_bytes, length=len(rec_bytes), type=0xC0, lsn=seg.lsn(off), epoch=0,
                                salt=seg.salt, body_crc=crc_ref(body), count=len(body))
    img[off:off + len(rec_bytes)] = rec_bytes


def d_base_page(epoch):
    def f(img, b):
        r = rec(b, F.REC_PAGE_BATCH, epoch, "kv", base=True)
        img[r.offset + r.length - 100] ^= 0x01
    return f


def d_catalog_byte(img, b):
    r = next(r for r in b.recs if r.kind == F.REC_CATALOG and r.lsn == b.sb.catalog_lsn)
    img[r.offset + 64 + 40] ^= 0x01


def d_catalog_zero(img, b):
    r = next(r for r in b.recs if r.kind == F.REC_CATALOG and r.lsn == b.sb.catalog_lsn)
    img[r.offset:r.offset + r.length] = bytes(r.length)


def d_below_oldest(img, b):
    """The first record of the first live segment lies below oldest_lsn
    (compaction reclaimed it): damage to it is never read (R-D3)."""
    s = b.segs[0]
    assert s.base_lsn + 256 < b.sb.oldest_lsn
    img[s.offset + 256 + 61] ^= 0xFF


def d_all_gone(img, b):
    img[b.sb.segments_off:] = bytes(len(img) - b.sb.segments_off)


def d_truncate_last(img, b):
    r = rec(b, F.REC_COMMIT, 20)
    del img[r.offset // 4096 * 4096:]  # the media end inside the last commit's page


def d_truncate_unaligned(img, b):
    r = rec(b, F.REC_COMMIT, 20)
    del img[r.offset + 100:]  # the media end inside the last commit, at no multiple of 4096


def set_superblock(img, b, field_off, value):
    """Write a u64 field of the superblock in force and fix the slot's CRC
    (FORMAT.md §3.1: bytes [0, 252) followed by the segment table)."""
    off = newest_slot(b)
    struct.pack_into("<Q", img, off + field_off, value)
    table = bytes(img[off + 256:off + 256 + 32 * b.sb.segment_count])
    struct.pack_into("<I", img, off + 252, crc_ref(bytes(img[off:off + 252]) + table))


def d_catalog_names_a_commit(img, b):
    set_superblock(img, b, 136, rec(b, F.REC_COMMIT, b.last).lsn)  # catalog_lsn


def d_catalog_segment_header(img, b):
    """Flip the header of the segment that holds the catalog in force (and
    the bases it lists): the bases are unknown, and the deltas before them
    were reclaimed."""
    s = next(s for s in b.segs if s.base_lsn <= b.sb.catalog_lsn < s.end_lsn)
    img[s.offset + 70] ^= 0x01


def d_onesync_last(img, b):
    r = rec(b, F.REC_PAGE_BATCH, b.last, "kv")
    img[r.offset + r.length - 100] ^= 0x01


def d_onesync_last_header(img, b):
    r = rec(b, F.REC_PAGE_BATCH, b.last, "ad")
    img[r.offset + 61] ^= 0xFF


def d_none(img, b):
    pass


def d_commit_header(field_off, fmt, value):
    return d_commit_header_of(11, field_off, fmt, value)


def d_commit_header_of(epoch, field_off, fmt, value):
    def f(img, b):
        r = rec(b, F.REC_COMMIT, epoch)
        struct.pack_into(fmt, img, r.offset + field_off, value(b, r))
        fix_header_crc(img, r.offset)
    return f


def d_commit_flag(img, b):
    r = rec(b, F.REC_COMMIT, 10)
    img[r.offset + F.OFF_FLAGS] |= F.FLAG_BASE
    fix_header_crc(img, r.offset)


def d_commit_padding(img, b):
    r = rec(b, F.REC_COMMIT, 10)
    img[r.offset + r.length - 1] = 0x01  # the zero fill after the body (§5.3)
    fix_header_crc(img, r.offset)


def d_segment_salt(img, b):
    s = b.segs[1]
    struct.pack_into("<I", img, s.offset + 84, 0x01020304)
    fix_segment_crc(img, s.offset)


def d_lsn(img, b):
    struct.pack_into("<Q", img, kv10(b).offset + F.OFF_LSN, kv10(b).lsn + 64)
    fix_header_crc(img, kv10(b).offset)


# --------------------------------------------------------------------------- the table

TT, AB, PIT, SK = M.TOLERATE_TAIL, M.ABSOLUTE, M.POINT_IN_TIME, M.SKIP_CORRUPT


@dataclass(frozen=True)
class Case:
    id: str
    log: str
    damage: object
    mode: M
    epoch: int | None  # what recovery restores (None: it refuses)
    rc: int  # the exit code of every command
    says: str  # a fragment of the message (verify's, the plan's and Log.open's)
    regions: tuple = ()  # (region, epoch) where a region restores another epoch (skip_corrupt)
    # consumers that cannot take part, and why (each named in the case)
    without: tuple = ()


C = Case
REFUSE = (None, 1)
CASES = [
    # the classes of test_damage.py, on a two-phase log (middle: epoch 10; tail: uncommitted 25)
    C("length word zeroed", "plain", d_length_zero, TT, *REFUSE, "zero length word"),
    C("length word changed", "plain", d_length_changed, TT, *REFUSE, "record header CRC mismatch"),
    C("type unknown", "plain", d_type(0x33), TT, *REFUSE, "unknown record type 0x33"),
    C("type flipped", "plain", d_type(F.REC_COMMIT, fix=False), TT, *REFUSE, "record header CRC mismatch"),
    C("header CRC", "plain", d_header_crc, TT, *REFUSE, "record header CRC mismatch"),
    C("page CRC", "plain", page_flip(kv10), TT, *REFUSE, "page CRC mismatch"),
    C("missing commit", "plain", d_zero_record(F.REC_COMMIT, 10), TT, *REFUSE, "a commit is missing (V-C3)"),
    C("missing last commit", "plain", d_zero_record(F.REC_COMMIT, EPOCHS), TT, EPOCHS - 1, 0, "zero length word"),
    C("torn tail", "plain", page_flip(lambda b: rec(b, F.REC_PAGE_BATCH, EPOCHS + 1)), TT, EPOCHS, 0,
      "page CRC mismatch"),
    C("torn tail absolute", "plain", page_flip(lambda b: rec(b, F.REC_PAGE_BATCH, EPOCHS + 1)), AB, *REFUSE,
      "page CRC mismatch"),
    C("stale salt", "plain", d_stale_salt, TT, *REFUSE, "stale record"),
    C("broken chain", "plain", d_chain(1), TT, *REFUSE, "segment chain broken"),
    C("last segment header", "plain", d_last_segment_header, TT, *REFUSE, "segment header CRC mismatch"),
    C("one superblock slot bad", "plain", d_newest_slot, TT, EPOCHS, 1, "the other slot is used"),
    C("both superblock slots bad", "plain", d_both_slots, TT, *REFUSE, "both superblock slots are invalid"),
    C("page CRC point-in-time", "plain", page_flip(kv10), PIT, 9, 1, "page CRC mismatch"),
    C("page CRC skip-corrupt", "plain", page_flip(kv10), SK, EPOCHS, 1, "page CRC mismatch",
      (("kv", 9), ("ad", EPOCHS))),
    C("header CRC skip-corrupt", "plain", d_header_crc, SK, 9, 1, "record header CRC mismatch"),
    C("clean two-phase log", "plain", d_none, TT, EPOCHS, 0, ""),
    # F1: segment numbers with gaps after a cut; the superblock fallback
    C("F1 clean log with a seq gap", "gap", d_none, TT, 20, 0, ""),
    C("F1 forged link after a seq gap", "gap", d_chain(1), TT, *REFUSE, "segment chain broken"),
    C("F1 in-force slot flipped, seq gap", "gap", d_newest_slot, TT, 20, 1, "the other slot is used"),
    C("F1 in-force slot flipped", "plain", d_newest_slot, PIT, EPOCHS, 1, "the other slot is used"),
    C("F1 in-force slot unreadable (slot B found)", "plain", d_slot_magic, TT, EPOCHS, 1, "the other slot is used"),
    C("F1 in-force slot flipped, seq gap, skip", "gap", d_newest_slot, SK, 20, 1, "the other slot is used"),
    # F2: a dropped ONE_SYNC commit is never committed, for every consumer
    C("F2 clean one-sync log", "onesync", d_none, TT, 12, 0, ""),
    C("F2 one-sync last commit dropped (page)", "onesync", d_onesync_last, TT, 11, 0, "sync did not complete"),
    C("F2 one-sync last commit dropped (header)", "onesync", d_onesync_last_header, TT, 11, 0,
      "sync did not complete"),
    C("F2 one-sync last commit dropped, skip", "onesync", d_onesync_last, SK, 11, 0, "sync did not complete"),
    C("F2 one-sync damage before an earlier commit", "onesync",
      page_flip(lambda b: rec(b, F.REC_PAGE_BATCH, 5, "kv")), TT, *REFUSE, "page CRC mismatch"),
    # F3: a commit failing V-C4 commits nothing
    C("F3 commit counts one record more", "plain", d_commit_field(10, 0, 1), TT, *REFUSE, "(V-C4)"),
    C("F3 commit counts more bytes", "plain", d_commit_field(10, 8, 64), TT, *REFUSE, "(V-C4)"),
    C("F3 V-C4 point-in-time", "plain", d_commit_field(10, 0, 1), PIT, 9, 1, "(V-C4)"),
    C("F3 V-C4 skip-corrupt", "plain", d_commit_field(10, 0, 1), SK, 9, 1, "(V-C4)"),
    # F4: tolerate_tail refuses a corrupt log whichever region is asked
    C("F4 adapter damage refuses kv too", "plain", page_flip(lambda b: rec(b, F.REC_PAGE_BATCH, 10, "ad")), TT,
      *REFUSE, "page CRC mismatch"),
    # F5, F6: bases and the catalog are behind a commit point
    C("F5 clean compacted log", "compacted", d_none, TT, 20, 0, ""),
    C("F5 damaged base", "compacted", d_base_page(12), TT, *REFUSE, "page CRC mismatch"),
    C("F5 damaged base point-in-time", "compacted", d_base_page(12), PIT, 16, 1, "page CRC mismatch"),
    C("F6 clean based log", "based", d_none, TT, 16, 0, ""),
    C("F6 damaged base after the last commit", "based", d_base_page(16), TT, *REFUSE, "page CRC mismatch"),
    C("F6 damaged catalog after the last commit", "based", d_catalog_byte, TT, *REFUSE, "body CRC mismatch"),
    C("F6 lost catalog after the last commit", "based", d_catalog_zero, TT, *REFUSE, "catalog"),
    # F7: below oldest_lsn nothing is read
    C("F7 damage below oldest_lsn", "compacted", d_below_oldest, TT, 20, 0, ""),
    # F8: a damaged header of the last segment hides commits: no consumer settles quietly
    C("F8 last segment header, skip", "plain", d_last_segment_header, SK, 20, 1, "segment header CRC mismatch"),
    C("F8 last segment header, point-in-time", "plain", d_last_segment_header, PIT, 20, 1,
      "segment header CRC mismatch"),
    # F9: page batches against their descriptor
    C("F9 page id past the region", "plain", d_page_id, TT, *REFUSE, "(R-P1)"),
    C("F9 page size differs from the descriptor", "plain", d_descriptor_page_bytes, TT, *REFUSE, "(R-P1)"),
    C("F9 batch of an undefined region", "plain", d_foreign_region, TT, *REFUSE, "(R-P1)"),
    C("F9 page id past the region, skip", "plain", d_page_id, SK, EPOCHS, 1, "(R-P1)",
      (("kv", 9), ("ad", EPOCHS))),
    # F10: exit codes mean one thing
    # a Session opens its log for writing, which refuses truncated media
    C("F10 truncated in the last segment", "gap", d_truncate_last, TT, 19, 1, "truncated"),
    C("F10 all data gone", "plain", d_all_gone, TT, *REFUSE, "segment header"),
    # F11: the spec gaps, settled
    C("F11 type 0x81 is not a page batch", "plain", d_type(0x81), TT, *REFUSE, "body of"),
    C("F11 unknown ignorable type is skipped", "plain", d_ignorable_at_end, TT, EPOCHS, 0, ""),
    C("F11 unknown record flag", "plain", d_flag, TT, *REFUSE, "unknown record flags"),
    C("F11 unsorted commit digests", "plain", d_unsorted_digests, TT, *REFUSE, "not sorted"),
    C("F11 type 0x7e is not a pad", "plain", d_type(0x7E), TT, *REFUSE, "unknown record type 0x7e"),
    C("F11 BASE flag on a commit", "plain", d_commit_flag, TT, *REFUSE, "unknown record flags"),
    # more of FORMAT.md's conditions, forged from its layouts
    C("V-C2 commit epoch goes back", "plain", d_commit_header(F.OFF_EPOCH, "<Q", lambda b, r: 10), TT,
      *REFUSE, "(V-C2)"),
    C("V-C3 commit names a wrong predecessor", "plain", d_commit_header(F.OFF_AUX, "<Q", lambda b, r: 64), TT,
      *REFUSE, "(V-C3)"),
    C("V-C3 point-in-time", "plain", d_commit_header(F.OFF_AUX, "<Q", lambda b, r: 64), PIT, 10, 1, "(V-C3)"),
    C("generic body padding not zero", "plain", d_commit_padding, TT, *REFUSE, "padding is not zero"),
    C("V-S4 segment salt disagrees with the table", "plain", d_segment_salt, TT, *REFUSE,
      "disagrees with the superblock"),
    C("V-R5 record lsn off by 64", "plain", d_lsn, TT, *REFUSE, "stale record"),
    C("page CRC absolute", "plain", page_flip(kv10), AB, *REFUSE, "page CRC mismatch"),
    C("torn tail point-in-time", "plain", page_flip(lambda b: rec(b, F.REC_PAGE_BATCH, EPOCHS + 1)), PIT,
      EPOCHS, 0, "page CRC mismatch"),
    C("F2 one-sync last commit dropped, point-in-time", "onesync", d_onesync_last, PIT, 11, 0,
      "sync did not complete"),
    C("F2 one-sync last commit dropped, absolute", "onesync", d_onesync_last, AB, *REFUSE, "torn tail"),
    C("F11 descriptor repeated as it was", "repeat", d_none, TT, 8, 0, ""),
    C("F11 descriptor repeated with another kind", "repeat", d_redefine, TT, *REFUSE, "(R-G1)"),
    C("F11 descriptor repeated with another kind, skip", "repeat", d_redefine, SK, 8, 1, "(R-G1)"),
    # F12 (issue 29): the disagreements the crash campaign found, settled
    # V-B8: media of any length are read, the missing bytes as zero, reported as truncated
    C("F12 cut at an unaligned length", "gap", d_truncate_unaligned, TT, 19, 1, "truncated"),
    C("F12 cut at an unaligned length, skip", "gap", d_truncate_unaligned, SK, 19, 1, "truncated"),
    # R-D1: a last commit that commits nothing, with nothing damaged before it, is the torn tail
    C("F12 last commit counts one record more", "plain", d_commit_field(EPOCHS, 0, 1), TT, EPOCHS - 1, 0,
      "(V-C4)"),
    C("F12 last commit counts one record more, absolute", "plain", d_commit_field(EPOCHS, 0, 1), AB, *REFUSE,
      "(V-C4)"),
    C("F12 last commit counts one record more, point-in-time", "plain", d_commit_field(EPOCHS, 0, 1), PIT,
      EPOCHS - 1, 0, "(V-C4)"),
    C("F12 last commit repeats an epoch", "plain",
      d_commit_header_of(EPOCHS, F.OFF_EPOCH, "<Q", lambda b, r: EPOCHS - 1), TT, EPOCHS - 1, 0, "(V-C2)"),
    C("F12 last commit repeats an epoch, skip", "plain",
      d_commit_header_of(EPOCHS, F.OFF_EPOCH, "<Q", lambda b, r: EPOCHS - 1), SK, EPOCHS - 1, 0, "(V-C2)"),
    # §5.5, R-D2: a commit failing V-C1 is a damaged record, torn after the last valid commit
    C("F12 last commit's digests unsorted", "plain", d_unsorted_digests_of(EPOCHS), TT, EPOCHS - 1, 0,
      "not sorted"),
    C("F12 last commit's digests unsorted, absolute", "plain", d_unsorted_digests_of(EPOCHS), AB, *REFUSE,
      "not sorted"),
    # R-D2: a catalog_lsn naming a record that is no catalog is corruption, for every consumer
    C("F12 catalog_lsn names a commit", "compacted", d_catalog_names_a_commit, TT, *REFUSE,
      "snapshot catalog the superblock names"),
    C("F12 catalog_lsn names a commit, point-in-time", "compacted", d_catalog_names_a_commit, PIT, 19, 1,
      "snapshot catalog the superblock names"),
    C("F12 catalog_lsn names a commit, skip", "compacted", d_catalog_names_a_commit, SK, 20, 1,
      "snapshot catalog the superblock names"),
    # R-D4: skip_corrupt, a damaged batch whose header names its region: only that region falls back
    C("F12 damaged adapter batch, skip", "plain", page_flip(lambda b: rec(b, F.REC_PAGE_BATCH, 10, "ad")), SK,
      EPOCHS, 1, "page CRC mismatch", (("kv", EPOCHS), ("ad", 9))),
    C("F12 kv's descriptor damaged, skip", "plain", d_descriptor_padding(0), SK, EPOCHS, 1, "(R-P1)",
      (("kv", None), ("ad", EPOCHS))),
    # ...and on a one-sync log, where the last commit is dropped as torn (§10.4b) and the one
    # before it is partial: a live read-only open's plans judge the last commits as it did
    C("F12 ad's descriptor damaged, one-sync, skip", "onesync", d_descriptor_padding(1), SK, 11, 1, "(R-P1)",
      (("kv", 11), ("ad", None))),
    C("F12 damaged batch of the last epoch, skip", "plain",
      page_flip(lambda b: rec(b, F.REC_PAGE_BATCH, EPOCHS, "kv")), SK, EPOCHS, 1, "page CRC mismatch",
      (("kv", EPOCHS - 1), ("ad", EPOCHS))),
    # R-D5: the catalog lost where deltas were reclaimed: no region's chain starts from zero.
    # (Log.open reads what the log commits, R-D1..R-D3; whether a chain is whole is the plan's)
    C("F12 damaged catalog of a reclaimed log, point-in-time", "retained", d_catalog_byte, PIT, *REFUSE,
      "body CRC mismatch", without=("Log.open",)),
    C("F12 damaged catalog of a reclaimed log, skip", "retained", d_catalog_byte, SK, *REFUSE,
      "body CRC mismatch"),
    C("F12 header of the catalog's segment, reclaimed, point-in-time", "retained", d_catalog_segment_header, PIT,
      *REFUSE, "segment header CRC mismatch", without=("Log.open",)),
    # R-D6: damage that hides every region descriptor leaves nothing to restore
    C("F12 header of the catalog's segment, point-in-time", "compacted", d_catalog_segment_header, PIT, *REFUSE,
      "segment header CRC mismatch", without=("Log.open",)),
    C("F12 header of the catalog's segment, skip", "compacted", d_catalog_segment_header, SK, *REFUSE,
      "segment header CRC mismatch"),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_conformance(logs, case, tmp_path):
    b = logs[case.log]
    img = bytearray(b.img)
    case.damage(img, b)
    path = tmp_path / "log"
    path.write_bytes(bytes(img))
    want_regions = dict(case.regions)
    got = consumers(path, case.mode, tmp=tmp_path, per_region=want_regions)
    report = {k: (e, rc) for k, (e, rc, _) in got.items()}
    for name, (epoch, rc, text) in got.items():
        if name in case.without:
            continue
        if name == "dump":
            assert rc == case.rc, (name, report, text[-400:])
            continue
        if name.startswith("restore "):
            want = want_regions.get(name.split()[1], case.epoch)
            assert (epoch, rc) == (want, case.rc), (name, report, text[-400:])
            continue
        if name == "Log.open" and case.mode is SK:
            continue  # a SKIP_CORRUPT open reads on past damage: the per-region fallback is the plan's
        assert epoch == case.epoch, (name, report, text[-400:])
        if rc is not None:
            assert rc == case.rc, (name, report, text[-400:])
    for name in ("verify", "plan", "Log.open"):
        if name not in case.without:
            assert case.says in got[name][2], (name, case.says, got[name][2][-600:])


def test_messages_name_absolute_offsets(logs, tmp_path):
    """R-O1: `segment N @ 0xOFF` names the byte offset in the target."""
    b = logs["plain"]
    img = bytearray(b.img)
    r = kv10(b)
    page_flip(kv10)(img, b)
    (tmp_path / "log").write_bytes(bytes(img))
    rc, text = cli("verify", f"file:{tmp_path / 'log'}", "--quiet")
    assert rc == 1 and f"segment {r.segment} @ 0x{r.offset:x}: page CRC mismatch" in text
    seg = next(x for x in b.segs if x.index == r.segment)
    assert r.offset - seg.offset != r.offset  # the offset inside its segment would be another number
    at = int(re.search(r"\(at 0x([0-9a-f]+)\)", text).group(1), 16)
    assert r.offset < at < r.offset + r.length and img[at:at + KV_PB] != b.img[at:at + KV_PB]


def test_table_covers_every_class_of_test_damage_and_forty_new_cases():
    from . import test_damage

    ids = {c.id for c in CASES}
    assert {name for name, *_ in test_damage.TABLE} <= ids
    new = [c for c in CASES if c.id not in {name for name, *_ in test_damage.TABLE} and c.damage is not d_none]
    assert len(new) >= 40, len(new)
    for n in range(1, 13):
        assert any(c.id.startswith(f"F{n} ") for c in CASES), f"finding {n} has no case"


# --------------------------------------------------------------------------- demo logs

DEMO_REGIONS = ("kv", "adapter", "sched", "tokens", "meta")


@pytest.fixture(scope="module")
def demo_log(tmp_path_factory):
    from concordia.demo import run_demo

    d = tmp_path_factory.mktemp("demo")
    rep = run_demo(log=f"file:{d / 'demo.log'}", steps=12, kill_at=7, every=4, device="cpu")
    assert rep["identical"]
    data = (d / "demo.log").read_bytes()
    log = Log.open(MemoryBackend.from_bytes(data), writable=False)
    recs = list(log.records(committed_only=False))
    ids = {n: log.regions[n].id for n in DEMO_REGIONS}
    last = log.last_committed_epoch
    sb = log.volume.superblock
    log.close()
    assert last >= 2
    return data, recs, ids, last, sb


def write_sparse(path, img) -> None:
    """Write `img` leaving its all-zero MiB as holes (a demo log is 128 MiB,
    mostly zero: this keeps each damaged copy cheap)."""
    view = np.frombuffer(img, np.uint8)
    with open(path, "wb") as f:
        f.truncate(len(img))
        for lo in range(0, len(img), MiB):
            chunk = view[lo:lo + MiB]
            if chunk.any():
                f.seek(lo)
                f.write(chunk.tobytes())


def _demo_batch(recs, ids, region, epoch):
    return next(r for r in recs if r.kind == F.REC_PAGE_BATCH and r.region_id == ids[region] and r.epoch == epoch)


def demo_page(region, epoch):
    def f(img, recs, ids, last, sb):
        if epoch == "last":  # any record the last commit counts
            r = next(r for r in recs if r.kind == F.REC_PAGE_BATCH and r.epoch == last and not r.flags)
        else:
            r = _demo_batch(recs, ids, region, epoch)
        img[r.offset + r.length - 7] ^= 0x10
    return f


def demo_header(img, recs, ids, last, sb):
    r = _demo_batch(recs, ids, "sched", 2)
    img[r.offset + 61] ^= 0xFF


def demo_slot(img, recs, ids, last, sb):
    img[(sb.sequence % 2) * sb.slot_bytes + 70] ^= 0x01


def demo_last_commit(img, recs, ids, last, sb):
    r = next(r for r in recs if r.kind == F.REC_COMMIT and r.epoch == last)
    img[r.offset:r.offset + r.length] = bytes(r.length)


DEMO_DAMAGE = {"kv page, epoch 2": demo_page("kv", 2), "sched header, epoch 2": demo_header,
               "in-force slot": demo_slot, "adapter page, epoch 4": demo_page("adapter", 4),
               "last commit lost": demo_last_commit}


@pytest.mark.parametrize("mode", [TT, PIT, SK], ids=lambda m: m.cli)
@pytest.mark.parametrize("damage", list(DEMO_DAMAGE), ids=list(DEMO_DAMAGE))
def test_demo_log_consumers_agree(demo_log, damage, mode, tmp_path):
    data, recs, ids, last, sb = demo_log
    img = bytearray(data)
    DEMO_DAMAGE[damage](img, recs, ids, last, sb)
    path = tmp_path / "demo.log"
    write_sparse(path, img)
    spec, m = f"file:{path}", mode.cli
    rc_v, text = cli("verify", spec, "--json", "--mode", m)
    v = json.loads(text)["recovery"]
    rc_p, text = cli("recover", spec, "--plan", "--json", "--mode", m)
    p = json.loads(text)
    plan_regions = {n: r["epoch"] for n, r in p.get("regions", {}).items()}
    restored, codes = {}, {rc_v, rc_p}
    for n in DEMO_REGIONS:
        rc, text = cli("restore", spec, "--region", n, "--out", tmp_path / f"{n}.npy", "--force", "--mode", m)
        restored[n] = _restored_epoch(text, n)
        codes.add(rc)
    assert len(codes) == 1, (damage, rc_v, rc_p, codes)
    assert v["epoch"] == p["epoch"], (v, p.get("error"))
    want = {n: e for n, e in v["regions"].items()} if v["error"] is None else {n: None for n in DEMO_REGIONS}
    assert restored == want, (restored, want)
    if p.get("error") is None:
        assert plan_regions == want
    # what each damage means, as the table above settles it for its class
    if damage in ("kv page, epoch 2", "sched header, epoch 2", "adapter page, epoch 4"):
        assert codes == {1} and (v["epoch"] is None) == (mode is TT)
        if mode is PIT:
            assert v["epoch"] == (3 if "epoch 4" in damage else 1)
    elif damage == "in-force slot":
        assert codes == {1} and v["epoch"] == last
    else:  # the last commit lost at the end of the data: a clean end one commit earlier
        assert codes == {0} and v["epoch"] == last - 1
