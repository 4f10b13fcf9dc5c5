"""Image entries (FORMAT.md §12.2, ENTRY_IMAGE): an epoch that wrote a region
whole is that region's base, listed in the catalog as the epoch's own page
batches, so nothing is written twice.  What a reader does with one: restores
from it, refuses a volume whose feature it does not know, and treats a broken
one as a broken base (falls back, or names it)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from concordia import Session
from concordia.errors import ConcordiaError
from concordia.policy import Policy
from concordia.wal import Log
from concordia.wal import format as F
from concordia.wal.catalog import ENTRY_IMAGE, Catalog, decode_catalog_body, encode_catalog_body
from concordia.wal.compaction import Compaction
from concordia.wal.planner import plan, scan
from concordia.wal.snapshot import current_catalog, image_entry, list_snapshots, write_catalog

from .test_bad_input import one_line

MiB = 1 << 20


def _epoch_range(log, epoch: int) -> tuple:
    """(lowest LSN of the epoch's records, its commit's LSN, its commit's digests), from a scan."""
    h = scan(log, payload=False)
    c = h.commits[epoch]
    return min(b.lsn for b in h.batches if b.epoch == epoch and not b.base), c.lsn, c.digests


def _lora_image_at_12(log):
    """(the image entry of "lora" at epoch 12, the epoch's first LSN and commit LSN)."""
    rid = log.regions["lora"].id
    first, commit, digests = _epoch_range(log, 12)
    return image_entry(log, rid, 16, 12, first, commit, digests[rid]), first, commit


def _switch_to(log, entry):
    """Compact at epoch 12 keeping only it: "kv" folded, "lora" listed by `entry`."""
    job = Compaction(log, 12, regions=["kv"], images={"lora": entry})
    while not job.step():
        pass
    return job.finish(keep_epochs=1)


def _session_with_whole_writes(log: str, epochs: int = 12):
    """A session (retention off: the switches here are the test's) whose region
    "lora" every epoch writes whole, and "kv" one page a epoch."""
    lora = np.zeros((16, 1024), np.uint32)   # 64 KiB, 16 pages
    kv = np.zeros((64, 1024), np.uint32)     # 256 KiB, 64 pages
    s = Session(log, size=16 * MiB, segment_size=1 * MiB, overwrite=True, policy=Policy(retain=False))
    s.register("lora", lora)
    s.register("kv", kv)
    for e in range(1, epochs + 1):
        lora[:, e % 1024] = e      # every page
        kv[e % 64, 0] = e          # one page
        s.checkpoint()
    return s, lora, kv


def test_an_image_entry_is_the_base_a_recovery_reads_and_costs_no_record(shm_log):
    s, lora, kv = _session_with_whole_writes(shm_log)
    with s:
        log = s.log
        entry, first, commit = _lora_image_at_12(log)
        assert entry is not None and entry.image and entry.flags == ENTRY_IMAGE
        assert entry.records >= 1 and first <= entry.last_lsn < commit and entry.pages == 16
        written = log.appender.write_lsn
        rep = _switch_to(log, entry)
        assert rep.imaged == ["lora"] and rep.folded == ["kv"] and rep.floor_epoch == 12
        # the kv base was written (its pages), nothing for lora: only its catalog entry
        assert rep.bytes_written == kv.nbytes and log.appender.write_lsn - written < kv.nbytes + 64 * 1024
        assert log.volume.superblock.incompat & F.FEATURE_IMAGE_BASES
        snaps = {x.region: x for x in list_snapshots(log)}
        assert snaps["lora"].image and not snaps["kv"].image and snaps["lora"].to_json()["image"] is True
        p = plan(log)
        assert p.regions["lora"].base_epoch == 12 and not any(src.batch.base for src in p.regions["lora"].sources)
        assert rep.segments_freed  # the epochs before 12 are gone
    with Session(shm_log, create=False) as r:
        got = r.recover()
        assert np.array_equal(got["lora"], lora) and np.array_equal(got["kv"], kv)
    # the session writes on from there; the image stays the base of what follows
    with Session(shm_log, create=False, policy=Policy(retain=False)) as s:
        s.register("lora", lora)
        s.register("kv", kv)
        kv[5, 5] = 99
        s.checkpoint()
    with Session(shm_log, create=False) as r:
        got = r.recover()
        assert np.array_equal(got["lora"], lora) and np.array_equal(got["kv"], kv)
        assert r.last_recovery is not None


def test_an_epoch_that_did_not_write_the_region_whole_gives_no_image(shm_log):
    s, lora, kv = _session_with_whole_writes(shm_log)
    with s:
        rid = s.log.regions["kv"].id
        first, commit, digests = _epoch_range(s.log, 12)
        assert image_entry(s.log, rid, 64, 12, first, commit, digests[rid]) is None


def _with_catalog(log, entry) -> None:
    """Make a catalog listing `entry` (and nothing else) current, feature bit set."""
    log.volume.enable_incompat(F.FEATURE_IMAGE_BASES)
    prev = current_catalog(log)
    write_catalog(log, Catalog(0, (entry,), prev.keep_bases, prev.floor_epoch))


def test_an_image_entry_that_does_not_cover_the_region_or_lists_the_wrong_records_is_not_used(shm_log):
    # A catalog that claims an image of "kv" at an epoch that wrote one page of it, and one of
    # "lora" listing a record more than there are: neither is a base.  With nothing reclaimed
    # the chains go back to the first epoch and recovery is exact; the plan says why.
    s, lora, kv = _session_with_whole_writes(shm_log)
    with s:
        log = s.log
        kv_id = log.regions["kv"].id
        good, _, _ = _lora_image_at_12(log)
        lying = dataclasses.replace(good, region_id=kv_id, pages=64, digest=_epoch_range(log, 12)[2][kv_id])
        _with_catalog(log, lying)
        p = plan(log)
        assert p.regions["kv"].base_epoch is None
        got = s.recover()
        assert np.array_equal(got["kv"], kv) and np.array_equal(got["lora"], lora)
        counted = dataclasses.replace(good, records=good.records + 1)
        _with_catalog(log, counted)
        assert plan(log).regions["lora"].base_epoch is None
        assert np.array_equal(s.recover()["lora"], lora)


def test_a_reclaimed_log_whose_image_is_damaged_is_refused_in_one_line(shm_log):
    # Once the epochs before the image are reclaimed, a damaged image leaves the
    # region nothing to start from: recovery names the damage, never zeros.  (A
    # region given up this way and asked for alone once ended in a KeyError.)
    s, lora, kv = _session_with_whole_writes(shm_log)
    with s:
        log = s.log
        entry, _, _ = _lora_image_at_12(log)
        _switch_to(log, entry)
        rec = [b for b in scan(log, payload=False).batches if b.region_id == entry.region_id and b.epoch == 12][0]
        view = log.volume.backend.view
        view[rec.offset + rec.length - 1] ^= 0xFF   # the last byte of the record's last page
    with Session(shm_log, create=False) as r:
        with pytest.raises(ConcordiaError) as err:
            r.recover()
        one_line(err.value, "corrupt")
        # skip_corrupt gives the region up, saying so, and restores the rest
        got = r.recover(mode="skip_corrupt")
        assert "lora" not in got and np.array_equal(got["kv"], kv)
        dropped = r.last_recovery.to_json()["dropped"]
        assert dropped[0]["region"] == "lora" and "page CRC mismatch" in dropped[0]["reason"], dropped
        assert {d["region"] for d in dropped} <= {"lora", None}   # and the damaged record itself
        got = r.recover(mode="skip_corrupt", regions=["lora"])   # asked for alone: given up, no traceback
        assert got == {} and r.last_recovery.to_json()["dropped"][0]["region"] == "lora"


def test_an_unknown_entry_flag_is_a_damaged_catalog_and_an_older_reader_refuses_the_feature(shm_log, monkeypatch):
    from concordia.wal.catalog import BaseEntry
    from concordia.wal.errors import CorruptionError, FormatVersionError

    body = encode_catalog_body(Catalog(1, (BaseEntry(1, 2, 64, 128, 1, 4, 0, 0x2),)))
    with pytest.raises(CorruptionError) as err:
        decode_catalog_body(body)
    one_line(err.value, "entry 0", "flags 0x2")
    s, lora, kv = _session_with_whole_writes(shm_log, epochs=3)
    with s:
        s.log.volume.enable_incompat(F.FEATURE_IMAGE_BASES)
    monkeypatch.setattr(F, "KNOWN_INCOMPAT", F.FEATURE_LOGICAL_DTYPE)  # a reader of before the feature
    with pytest.raises(FormatVersionError) as err:
        Log.open(shm_log, writable=False)
    one_line(err.value, "0x2")


def test_info_names_the_feature_bits_it_knows():
    from concordia.tools import render as R
    from concordia.tools.wal_cmd_inspect import INCOMPAT_NAMES

    assert R.features(0) == "none"
    assert R.features(0x3, INCOMPAT_NAMES) == "0x3 (LOGICAL_DTYPE, IMAGE_BASES)"
    assert R.features(0x6, INCOMPAT_NAMES) == "0x6 (IMAGE_BASES, unknown bits 2)"


def test_image_bases_off_writes_every_base_and_leaves_the_feature_clear(shm_log):
    # For a reader older than the feature (a standby not yet updated): the same
    # whole-state rewrites, every base written as BASE records, the bit never set
    assert Policy.parse("image_bases=off,keep_epochs=4") == Policy(image_bases=False, keep_epochs=4)
    with pytest.raises(ConcordiaError) as err:
        Policy.parse("image_bases=maybe")
    one_line(err.value, "image_bases", "on or off")
    kv = np.zeros((64, 1024), np.uint32)
    for on in (True, False):
        with Session(shm_log, size=16 * MiB, segment_size=1 * MiB, overwrite=True,
                     policy=Policy(image_bases=on)) as s:
            s.register("kv", kv)
            for t in range(1, 61):
                kv[:] = t
                s.checkpoint()
            counts = dict(s.retention.counts)
            bit = s.log.volume.superblock.incompat & F.FEATURE_IMAGE_BASES
            kinds = {x.image for x in list_snapshots(s.log)}
            assert np.array_equal(s.recover()["kv"], kv)
        if on:
            assert counts["images"] > 0 and bit and kinds == {True}, counts
        else:
            assert counts.get("images", 0) == 0 and counts["bases"] > 0 and not bit and kinds == {False}, counts
