"""The many-pages CRC32C helper (wal/pagecrc.py, wal/_pagecrc.c): equal to the
`crc32c` package and to `crcmod` on pages of every shape, on both paths (the
compiled helper and the package fallback), and on the CRC tables of real logs."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys

import crcmod.predefined
import numpy as np
import pytest
from crc32c import crc32c

from concordia.wal import Log, pagecrc
from concordia.wal import format as F
from concordia.wal.apply import apply_plan_numpy
from concordia.wal.errors import CorruptionError, UsageError
from concordia.wal.planner import plan

CRCMOD = crcmod.predefined.mkCrcFun("crc-32c")
SIZES = [0, 1, 7, 8, 9, 63, 64, 65, 100, 255, 256, 257, 263, 511, 512, 4095, 4096, 4097, 8192 + 24, 65536]
COUNTS = [0, 1, 2, 3, 4, 5, 6, 7, 11, 64]


def _capable() -> bool:
    """This machine can build and run the helper (then a fallback would be a bug)."""
    if platform.machine().lower() not in ("x86_64", "amd64") or not (shutil.which("cc") or shutil.which("gcc")):
        return False
    try:
        with open("/proc/cpuinfo") as f:
            return "sse4_2" in f.read()
    except OSError:
        return False


def _ref(pages: np.ndarray) -> list[int]:
    return [CRCMOD(bytes(p)) for p in pages]


def _can_fold() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return all(f" {x}" in flags for x in ("avx512f", "avx512vl", "vpclmulqdq"))


@pytest.fixture(params=["folding", "crc32", "package"])
def path(request, monkeypatch):
    """Run a test on the compiled helper's two kernels and on the package fallback."""
    if request.param == "package":
        monkeypatch.setattr(pagecrc, "_lib", None)
        yield request.param
        return
    if not pagecrc.native():
        pytest.skip(f"compiled helper not in use here ({pagecrc.REASON})")
    before = pagecrc.KERNEL == "vpclmulqdq"
    on = pagecrc.use_folding(request.param == "folding")
    if request.param == "folding" and not on:
        pytest.skip("this CPU lacks AVX-512 VPCLMULQDQ")
    yield request.param
    pagecrc.use_folding(before)


def _x_pow_mod_p(e: int) -> int:
    """x^e mod the CRC32C polynomial, as an integer whose bit i is x^i."""
    r = 1
    for _ in range(e):
        r <<= 1
        if r >> 32:
            r ^= 0x11EDC6F41
    return r


def test_folding_constants_are_the_powers_of_x_they_name():
    """FOLD_K1 = x^(64 + 2048 - 1) mod P and FOLD_K2 = x^(2048 - 1) mod P, the
    coefficient of x^e at bit 63 - e (the derivation in _pagecrc.c)."""
    src = pagecrc.SOURCE.read_text()
    for name, e in (("FOLD_K1", 64 + 2048 - 1), ("FOLD_K2", 2048 - 1)):
        want = sum(1 << (63 - i) for i in range(32) if _x_pow_mod_p(e) >> i & 1)
        line = next(ln for ln in src.splitlines() if ln.startswith(f"#define {name} "))
        assert int(line.split()[2].rstrip("ul"), 16) == want, name


def test_folding_is_used_where_the_cpu_has_it():
    if not pagecrc.native():
        pytest.skip(f"compiled helper not in use here ({pagecrc.REASON})")
    assert pagecrc.KERNEL in ("vpclmulqdq", "crc32")
    if _can_fold() and not os.environ.get(pagecrc.ENV):
        assert pagecrc.KERNEL == "vpclmulqdq"


def test_backend_is_native_where_it_can_be():
    assert pagecrc.BACKEND in ("sse4.2", "crc32c")
    assert pagecrc.native() == (pagecrc.BACKEND == "sse4.2")
    if _capable() and not os.environ.get(pagecrc.ENV):
        assert pagecrc.BACKEND == "sse4.2", pagecrc.REASON


@pytest.mark.parametrize("pb", SIZES)
def test_page_crcs_equal_package_and_crcmod(path, pb):
    rng = np.random.default_rng(pb)
    for count in COUNTS if pb <= 4097 else (1, 3, 4, 5):
        pages = rng.integers(0, 256, (count, pb), dtype=np.uint8)
        got = pagecrc.page_crcs(pages)
        assert got.dtype == np.uint32 and got.shape == (count,)
        assert got.tolist() == [crc32c(p) for p in pages] == _ref(pages), (pb, count)


def test_span_crcs_of_any_lengths_and_offsets(path):
    """`span_crcs` hashes many spans of one buffer in a call: spans of every
    length in SIZES (so runs of one length take the three-lane path and the
    folding one, and the rest one lane; the largest, on the crc32 kernel, the
    package), at odd offsets, overlapping, empty."""
    rng = np.random.default_rng(7)
    base = rng.integers(0, 256, 1 << 20, dtype=np.uint8)   # 300,000 > SPAN_PACKAGE_BYTES below
    lengths = np.array([n for n in SIZES for _ in range(4)] + [0, 4096, 4096, 4096, 5, 300_000, 5], np.int64)
    offsets = rng.integers(0, base.size - lengths.max(), lengths.size)
    got = pagecrc.span_crcs(base, offsets, lengths)
    assert got.dtype == np.uint32 and got.shape == lengths.shape
    assert got.tolist() == [CRCMOD(bytes(base[o:o + n])) for o, n in zip(offsets.tolist(), lengths.tolist())]
    out = np.zeros(lengths.size, np.uint32)
    assert pagecrc.span_crcs(base, offsets, lengths, out=out) is out and out.tolist() == got.tolist()
    assert pagecrc.span_crcs(base, [], []).size == 0


def test_span_crcs_refuses_spans_outside_what_it_is_given():
    base = np.zeros(4096, np.uint8)
    for offsets, lengths in (([4000], [97]), ([-1], [4]), ([0], [-1]), ([0, 1], [1]),
                             ([4000], [2**63 - 3999]), ([0.5], [1])):   # a sum past int64; no integers
        with pytest.raises(UsageError):
            pagecrc.span_crcs(base, offsets, lengths)
    with pytest.raises(UsageError):
        pagecrc.span_crcs(base.reshape(64, 64), [0], [1])   # one flat buffer only


@pytest.mark.parametrize("shift", [1, 3, 5, 7])
def test_unaligned_and_strided_rows(path, shift):
    rng = np.random.default_rng(shift)
    raw = rng.integers(0, 256, 9 * 4200 + 16, dtype=np.uint8)
    pb = 4096 + shift
    pages = raw[shift:shift + 9 * pb].reshape(9, pb)  # rows start at odd addresses
    assert pagecrc.page_crcs(pages).tolist() == _ref(pages)
    strided = raw[shift:shift + 9 * 4200].reshape(9, 4200)[:, :pb]  # rows 4200 apart, pb long
    assert not strided.flags.c_contiguous
    assert pagecrc.page_crcs(strided).tolist() == _ref(strided)
    backwards = strided[::-1]
    assert pagecrc.page_crcs(backwards).tolist() == _ref(backwards)
    wide = raw[:8 * 4096].view(np.uint32).reshape(8, 1024)  # rows of another dtype hash as bytes
    assert pagecrc.page_crcs(wide).tolist() == _ref(raw[:8 * 4096].reshape(8, 4096))
    out = np.zeros(9, np.uint32)
    assert pagecrc.page_crcs(pages, out) is out and out.tolist() == _ref(pages)


@pytest.mark.parametrize("pb", [1, 13, 64, 256, 300, 4096, 4103, 65536])
def test_copy_page_crcs(path, pb):
    rng = np.random.default_rng(pb)
    for count in (0, 1, 2, 3, 4, 7) if pb < 65536 else (1, 4):
        raw = rng.integers(0, 256, count * pb + 3, dtype=np.uint8)
        src = raw[3:].reshape(count, pb)  # unaligned source
        dst = np.full(count * pb, 0xAA, np.uint8)
        got = pagecrc.copy_page_crcs(dst, src)
        assert np.array_equal(dst.reshape(count, pb), src)
        assert got.tolist() == _ref(src)


@pytest.mark.parametrize("pb", [256, 4096, 4103])
def test_copy_page_crcs_shared_by_threads_equals_one_run(path, pb, monkeypatch):
    """A copy large enough to be split (here at 64 KiB, 16 KiB a thread, 8
    threads whatever the cores) gives the bytes and CRCs of one run, over a
    strided source and a count that splits unevenly."""
    monkeypatch.setattr(pagecrc, "SPLIT_BYTES", 64 << 10)
    monkeypatch.setattr(pagecrc, "SPLIT_PART_BYTES", 16 << 10)
    monkeypatch.setattr(pagecrc.os, "cpu_count", lambda: 8)
    rng = np.random.default_rng(pb)
    count = (1 << 20) // pb + 5
    raw = rng.integers(0, 256, (count, pb + 64), dtype=np.uint8)
    src = raw[:, 7:7 + pb]  # rows contiguous, strided by pb + 64
    ran = []
    real = pagecrc.split

    def spy(part, n, page_bytes):
        ran.append(n)
        return real(part, n, page_bytes)

    monkeypatch.setattr(pagecrc, "split", spy)
    dst = np.zeros(count * pb, np.uint8)
    got = pagecrc.copy_page_crcs(dst, src)
    assert np.array_equal(dst.reshape(count, pb), src)
    assert got.tolist() == _ref(src)
    assert ran == ([count] if path != "package" else [])  # the helper's path splits, the package's copies once


def test_split_raises_a_part_failure_after_every_part_ended(monkeypatch):
    monkeypatch.setattr(pagecrc, "SPLIT_BYTES", 1)
    monkeypatch.setattr(pagecrc, "SPLIT_PART_BYTES", 1)
    monkeypatch.setattr(pagecrc.os, "cpu_count", lambda: 4)
    done = []

    def part(lo, hi):
        if lo == 0:
            raise ValueError("first run")
        done.append((lo, hi))

    with pytest.raises(ValueError, match="first run"):
        pagecrc.split(part, 8, 1)
    assert sorted(done) == [(2, 4), (4, 6), (6, 8)]


def test_gather_page_crcs(path):
    rng = np.random.default_rng(5)
    root = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
    for pb, aligned in ((4096, True), (4096, False), (192, True), (100, False)):
        for count in (1, 2, 3, 5, 40):
            offs = rng.integers(0, root.size - pb, count)
            if aligned:
                offs -= offs % 64
            offs[rng.random(count) < 0.3] = -1  # pages nobody wrote
            dst = np.full(count * pb, 0x55, np.uint8)
            got = pagecrc.gather_page_crcs(dst, root, offs, pb)
            want = np.stack([root[o:o + pb] if o >= 0 else np.zeros(pb, np.uint8) for o in offs])
            assert np.array_equal(dst.reshape(count, pb), want), (pb, count)
            assert got.tolist() == _ref(want)
    with pytest.raises(UsageError, match="runs past"):
        pagecrc.gather_page_crcs(np.zeros(4 * 64, np.uint8), root, [0, 0, 0, root.size - 63], 64)
    with pytest.raises(UsageError, match="destination"):
        pagecrc.gather_page_crcs(np.zeros(3 * 64, np.uint8), root, [0, 0, 0, 0], 64)


def test_bad_arguments_are_refused():
    with pytest.raises(UsageError, match="2-D"):
        pagecrc.page_crcs(np.zeros((2, 2, 2), np.uint8))
    with pytest.raises(UsageError, match="out must be"):
        pagecrc.page_crcs(np.zeros((4, 64), np.uint8), np.zeros(3, np.uint32))
    with pytest.raises(UsageError, match="destination"):
        pagecrc.copy_page_crcs(np.zeros(4 * 64, np.uint8)[::2], np.zeros((2, 64), np.uint8))
    ro = np.zeros(4 * 64, np.uint8)
    ro.flags.writeable = False
    with pytest.raises(UsageError, match="destination"):
        pagecrc.copy_page_crcs(ro, np.zeros((4, 64), np.uint8))


def test_real_log_tables_and_verify(path):
    """The CRC tables the appender writes (shm-style path through the mapping,
    and with CRCs given) equal crcmod's, restore checks them, verify is clean."""
    rng = np.random.default_rng(11)
    log = Log.create("memory:", size=8 << 20, segment_size=1 << 20)
    try:
        rid = log.define_region("r", np.uint8, (64 * 4096,), 4096, "opaque")
        state = np.zeros((64, 4096), np.uint8)
        for e in range(1, 5):
            for count in (1, 3, 4, 10):
                ids = np.sort(rng.choice(64, count, replace=False))
                pages = rng.integers(0, 256, (count, 4096), dtype=np.uint8)
                state[ids] = pages
                log.appender.append_page_batch(e, rid, ids, pages)
            log.appender.commit(e, digests={rid: F.region_digest(pagecrc.page_crcs(state))})
        batches = [F.decode_page_batch(log.backend.array, r.offset) for r in log.records()
                   if r.type == F.REC_PAGE_BATCH]
        assert len(batches) == 16
        for b in batches:
            assert b.page_crcs.tolist() == _ref(b.payload) == pagecrc.page_crcs(b.payload).tolist()
        v = log.verify()
        assert v["ok"] and v["records"] >= 16, v["problems"]
        got = apply_plan_numpy(log, plan(log))["r"]
        assert np.array_equal(got.reshape(64, 4096), state)
    finally:
        log.close()


def test_damaged_page_found_on_both_paths(path):
    log = Log.create("memory:", size=4 << 20, segment_size=1 << 20)
    try:
        rid = log.define_region("r", np.uint8, (16 * 4096,), 4096, "opaque")
        pages = np.random.default_rng(2).integers(0, 256, (16, 4096), dtype=np.uint8)
        log.appender.append_page_batch(1, rid, np.arange(16), pages)
        log.appender.commit(1, digests={rid: F.region_digest(pagecrc.page_crcs(pages))})
        rec = next(r for r in log.records() if r.type == F.REC_PAGE_BATCH)
        p = plan(log)
        poff = rec.offset + F.page_batch_payload_offset(16)
        log.backend.array[poff + 5 * 4096 + 17] ^= 0x40
        with pytest.raises(CorruptionError, match="page CRC mismatch for page 5"):
            apply_plan_numpy(log, p)
        v = log.verify()
        assert not v["ok"] and any("page 5" in p["reason"] for p in v["problems"])
    finally:
        log.close()


def _child(env_extra: dict, tmp_path) -> list[str]:
    code = ("import numpy as np; from concordia.wal import pagecrc as P; "
            "a = np.arange(5 * 4099, dtype=np.uint32).view(np.uint8)[3:3 + 7 * 4099].reshape(7, 4099); "
            "print(P.BACKEND); print(P.REASON); print(' '.join(map(str, P.page_crcs(a).tolist())))")
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "cache"), **env_extra)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


def _expected() -> str:
    a = np.arange(5 * 4099, dtype=np.uint32).view(np.uint8)[3:3 + 7 * 4099].reshape(7, 4099)
    return " ".join(map(str, _ref(a)))


def test_env_forces_the_package_path(tmp_path):
    backend, reason, crcs = _child({pagecrc.ENV: "off"}, tmp_path)
    assert backend == "crc32c" and pagecrc.ENV in reason
    assert crcs == _expected()
    assert not (tmp_path / "cache").exists()  # nothing built when told not to


def test_failed_build_falls_back_silently(tmp_path):
    backend, reason, crcs = _child({"CC": "false", pagecrc.ENV: ""}, tmp_path)
    assert backend == "crc32c" and "build failed" in reason
    assert crcs == _expected()


@pytest.mark.skipif(not _capable(), reason="needs an x86 CPU with SSE4.2 and a C compiler")
def test_fresh_cache_builds_once(tmp_path):
    backend, _, crcs = _child({pagecrc.ENV: ""}, tmp_path)
    assert backend == "sse4.2" and crcs == _expected()
    built = list((tmp_path / "cache" / "concordia").glob("libconcordia_pagecrc-*.so"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    assert _child({pagecrc.ENV: ""}, tmp_path)[0] == "sse4.2"
    assert built[0].stat().st_mtime_ns == stamp  # the cached library is reused
    assert not list((tmp_path / "cache" / "concordia").glob("*.so.*")) and \
        len(list((tmp_path / "cache" / "concordia").iterdir())) == 1  # no temporary left behind


def test_page_batch_tables(path):
    """The ids and page CRCs tables and their CRC in one call, as the encoder
    writes them; None (the caller's checked path) for bad ids or without the helper."""
    rng = np.random.default_rng(11)
    for count, pb in ((1, 4096), (3, 64), (64, 4096), (5, 4160)):
        pages = rng.integers(0, 256, (count, pb), dtype=np.uint8)
        for ids in (np.sort(rng.choice(1 << 20, count, replace=False)).astype(np.uint32),
                    np.arange(count, dtype=np.int64) * 3 + (0xFFFFFFFF - 3 * count + 3)):
            tables = np.full(8 * count, 0xEE, np.uint8)
            got = pagecrc.page_batch_tables(pages, ids, tables)
            if path == "package":
                assert got is None
                continue
            assert tables[:4 * count].view("<u4").tolist() == ids.tolist()
            assert tables[4 * count:].view("<u4").tolist() == _ref(pages)
            assert got == crc32c(tables)
    if path == "package":
        return
    pages = np.zeros((3, 64), np.uint8)
    for bad in ([1, 1, 2], [2, 1, 3], [-1, 0, 1], [0, 1, 1 << 32]):
        assert pagecrc.page_batch_tables(pages, np.array(bad, np.int64), np.zeros(24, np.uint8)) is None
    assert pagecrc.page_batch_tables(pages, np.arange(3, dtype=np.int32), np.zeros(24, np.uint8)) is None


def test_copy_page_batch(path):
    """A page batch written in place: tables, zero padding and payload as the
    encoder writes them; for bad ids neither the header slot nor the payload is
    touched (nothing at all without the helper)."""
    rng = np.random.default_rng(12)
    for count, pb in ((1, 4096), (3, 64), (7, 4096), (64, 4160)):
        pages = rng.integers(0, 256, (count, pb), dtype=np.uint8)
        ids = np.sort(rng.choice(1 << 20, count, replace=False)).astype(np.uint32)
        poff = F.page_batch_payload_offset(count)
        record = np.full(poff + count * pb, 0xEE, np.uint8)  # stale bytes, as in a recycled segment
        got = pagecrc.copy_page_batch(record, pages, ids, poff)
        if path == "package":
            assert got is None and (record == 0xEE).all()
            continue
        want = np.zeros_like(record)
        F.encode_page_batch_into(want, lsn=0, epoch=1, region_id=0, salt=1, page_ids=ids, pages=pages,
                                 page_bytes=pb)
        assert record[64:].tobytes() == want[64:].tobytes()
        assert got == crc32c(want[64:64 + 8 * count])  # the header's body CRC
    if path == "package":
        return
    poff = F.page_batch_payload_offset(3)
    record = np.full(poff + 3 * 64, 0xEE, np.uint8)
    for bad in ([1, 1, 2], [0, 1, 1 << 32]):
        assert pagecrc.copy_page_batch(record, np.zeros((3, 64), np.uint8), np.array(bad, np.int64), poff) is None
        assert (record[:64] == 0xEE).all() and (record[poff:] == 0xEE).all()


def test_env_keeps_the_crc32_kernel(tmp_path):
    if not _capable():
        pytest.skip("needs an x86 CPU with SSE4.2 and a C compiler")
    code = ("import numpy as np; from concordia.wal import pagecrc as P; "
            "a = np.arange(5 * 4099, dtype=np.uint32).view(np.uint8)[3:3 + 7 * 4099].reshape(7, 4099); "
            "print(P.BACKEND, P.KERNEL); print(' '.join(map(str, P.page_crcs(a).tolist())))")
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "cache"), **{pagecrc.ENV: "crc32"})
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    kinds, crcs = out.stdout.splitlines()
    assert kinds == "sse4.2 crc32" and crcs == _expected()



def _chain(rng, lengths: list[int], size: int) -> np.ndarray:
    """A buffer of `size` random bytes with `lengths` written as length words back to back from 0."""
    buf = rng.integers(0, 256, size, dtype=np.uint8)
    pos = 0
    for n in lengths:
        if pos + 8 > size:
            break
        buf[pos:pos + 8] = np.frombuffer(int(n).to_bytes(8, "little"), np.uint8)
        pos += max(int(n), 64)
    return buf


@pytest.mark.parametrize("tail", ["end", "short", "unaligned", "overrun", "zero", "huge"])
def test_walk_lengths_follows_the_chain_and_stops_where_the_python_walk_stops(path, tail):
    """The helper's walk (arena.Arena._walk's) and the pure loop give the same
    offsets: records laid back to back, then each way a walk stops."""
    rng = np.random.default_rng(sum(map(ord, tail)))
    lengths = [64 * int(k) for k in rng.integers(1, 40, 300)]
    stop = {"end": [], "short": [32], "unaligned": [64 * 3 + 8], "overrun": [1 << 20], "zero": [0],
            "huge": [(1 << 64) - 64]}[tail]
    size = sum(lengths) + 64 * 64
    buf = _chain(rng, lengths + stop, size)
    used = sum(lengths) if tail == "end" else size
    want = np.cumsum([0] + lengths[:-1]).astype(np.int64)
    for walk in (pagecrc.walk_lengths, pagecrc.pure_walk_lengths):
        got = walk(buf, used)
        assert got.dtype == np.int64
        assert got.tolist() == want.tolist()
    offs, rows = pagecrc.walk_lengths(buf, used, headers=True)   # each header's bytes, as the walk met them
    assert offs.tolist() == want.tolist() and rows.shape == (want.size, 64)
    assert np.array_equal(rows, buf[want[:, None] + np.arange(64)])
    # a `used` inside a record stops before it; past the buffer it is the buffer
    k = next(i for i in range(100, len(lengths)) if lengths[i] > 64)
    cut = int(want[k]) + 64
    assert pagecrc.walk_lengths(buf, cut).tolist() == want[:k].tolist() == pagecrc.pure_walk_lengths(buf, cut).tolist()
    assert pagecrc.walk_lengths(buf, 10 * size).tolist() == pagecrc.pure_walk_lengths(buf, 10 * size).tolist()
    assert pagecrc.walk_lengths(buf, 0).size == 0 == pagecrc.walk_lengths(buf, 63).size


def test_walk_lengths_takes_one_flat_byte_array():
    for bad in (np.zeros((2, 64), np.uint8), np.zeros(128, np.uint16), np.zeros(256, np.uint8)[::2], b"x" * 128):
        with pytest.raises(UsageError):
            pagecrc.walk_lengths(bad, 128)


@pytest.mark.parametrize("chunk", [1, 7, 300, 4096])
@pytest.mark.parametrize("to_end", [False, True])
def test_walk_lengths_in_chunks_finds_what_one_call_finds(path, monkeypatch, chunk, to_end):
    """The helper finds WALK_CHUNK records a call and goes on from where it
    stopped: the offsets and header bytes are those of one walk, whatever the
    chunk, a chunk ending where `used` does included (`to_end`)."""
    rng = np.random.default_rng(7)
    lengths = [64 * int(k) for k in rng.integers(1, 9, 300)]
    buf = _chain(rng, lengths + [0], sum(lengths) + 4096)
    used = sum(lengths) if to_end else buf.size
    want = np.cumsum([0] + lengths[:-1]).astype(np.int64)
    monkeypatch.setattr(pagecrc, "WALK_CHUNK", chunk)
    offs, rows = pagecrc.walk_lengths(buf, used, headers=True)
    assert offs.tolist() == want.tolist() == pagecrc.walk_lengths(buf, used).tolist()
    assert offs.tolist() == pagecrc.pure_walk_lengths(buf, used).tolist()
    assert np.array_equal(rows, buf[want[:, None] + np.arange(64)])
