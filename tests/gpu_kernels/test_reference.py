"""The numpy twins of the page kernels, checked against brute force, the
`crc32c` and `crcmod` packages and the WAL's own encoder.  These are the
oracle of the GPU tests and the CPU path of the product, so they run everywhere."""

from __future__ import annotations

import pathlib
import struct

import crc32c
import numpy as np
import pytest

from concordia.gpu_kernels import reference as ref
from concordia.gpu_kernels.errors import KernelInputError
from concordia.wal import format as fmt


def rng_bytes(rng, n):
    return rng.integers(0, 256, size=n, dtype=np.uint8)


# --- CRC32C and the GF(2) arithmetic the kernels use --------------------------


def test_crc_table_matches_crcmod():
    crcmod = pytest.importorskip("crcmod.predefined")
    f = crcmod.mkCrcFun("crc-32c")
    rng = np.random.default_rng(1)
    for n in (0, 1, 7, 64, 1000):
        d = rng_bytes(rng, n).tobytes()
        assert ref.crc32c_raw(d, 0xFFFFFFFF) ^ 0xFFFFFFFF == f(d) == crc32c.crc32c(d)


@pytest.mark.parametrize("n", [0, 16, 48, 64, 200, 4096, 4160, 12288])
@pytest.mark.parametrize("parts", [1, 7, 32, 256])
def test_split_crc_equals_crc32c(n, parts):
    d = np.random.default_rng(n + parts).integers(0, 256, n, dtype=np.uint8).tobytes()
    assert ref.split_crc32c(d, parts) == crc32c.crc32c(d)


def test_shift_is_feeding_zero_bytes():
    rng = np.random.default_rng(2)
    for n in (0, 1, 5, 100, 4096):
        raw = int(rng.integers(0, 2**32))
        assert ref.crc32c_shift(raw, n) == ref.crc32c_raw(bytes(n), raw)


def test_the_kernels_powers_of_x_are_the_twins_and_shift_as_squaring_does():
    """common.cuh's X8_POW2 literal is reference.X8_POW2, each power the square of
    the one before; xpow8n from them equals x^(8n) by repeated squaring, which
    the kernels computed before, up to exponents past a region of 2^40 bytes."""
    import re

    text = (pathlib.Path(ref.__file__).parent / "common.cuh").read_text()
    body = text[text.index("X8_POW2[64] = {"):]
    body = body[body.index("{") + 1:body.index("};")]
    assert [int(v, 16) for v in re.findall(r"0x([0-9A-F]{8})u", body)] == list(ref.X8_POW2)
    assert ref.X8_POW2[0] == 1 << 23 and all(ref.X8_POW2[i + 1] == ref.gf2_multmodp(p, p)
                                             for i, p in enumerate(ref.X8_POW2[:-1]))

    def by_squaring(n: int) -> int:
        result, base = 1 << 31, 1 << 23
        while n:
            if n & 1:
                result = ref.gf2_multmodp(result, base)
            base = ref.gf2_multmodp(base, base)
            n >>= 1
        return result

    rng = np.random.default_rng(7)
    for n in list(range(0, 300)) + [int(x) for x in rng.integers(0, 2**42, 200)] + [2**63 + 5]:
        assert ref.xpow8n(n) == by_squaring(n), n


def _slicing8(data: bytes) -> int:
    """The kernels' slicing-by-8 step (common.cuh crc_tables_build/crc_dword),
    replayed on the host: a check of its table indexing."""
    t = np.zeros((8, 256), np.uint64)
    t[0] = ref.crc32c_table()
    for k in range(1, 8):
        t[k] = (t[k - 1] >> np.uint64(8)) ^ t[0][(t[k - 1] & np.uint64(0xFF)).astype(np.int64)]
    t = t.astype(np.uint32)
    crc = 0xFFFFFFFF
    for i in range(0, len(data), 8):
        lo, hi = struct.unpack_from("<II", data, i)
        lo ^= crc
        crc = (int(t[7][lo & 0xFF]) ^ int(t[6][(lo >> 8) & 0xFF]) ^ int(t[5][(lo >> 16) & 0xFF])
               ^ int(t[4][lo >> 24]) ^ int(t[3][hi & 0xFF]) ^ int(t[2][(hi >> 8) & 0xFF])
               ^ int(t[1][(hi >> 16) & 0xFF]) ^ int(t[0][hi >> 24]))
    return crc ^ 0xFFFFFFFF


def test_slicing_by_8_equals_crc32c():
    d = rng_bytes(np.random.default_rng(3), 512).tobytes()
    assert _slicing8(d) == crc32c.crc32c(d)


# --- page CRCs and digests -------------------------------------------------------


def test_crc32c_pages_brute_force_with_short_last_page():
    rng = np.random.default_rng(4)
    region = rng_bytes(rng, 5 * 256 + 100)
    crcs = ref.crc32c_pages(region, page_bytes=256)
    padded = np.zeros(6 * 256, np.uint8)
    padded[:region.size] = region
    assert crcs.dtype == np.uint32
    assert list(crcs) == [crc32c.crc32c(padded[i * 256:(i + 1) * 256].tobytes()) for i in range(6)]
    assert list(ref.crc32c_pages(region, [5, 0], page_bytes=256)) == [crcs[5], crcs[0]]


def test_region_digest_matches_wal():
    crcs = np.random.default_rng(5).integers(0, 2**32, 77, dtype=np.uint64).astype(np.uint32)
    assert ref.region_digest(crcs) == fmt.region_digest(crcs) == crc32c.crc32c(crcs.astype("<u4").tobytes())


# --- shadow diff ---------------------------------------------------------------


def brute_dirty(a: np.ndarray, b: np.ndarray, pb: int) -> list[int]:
    a, b = a.reshape(-1).view(np.uint8), b.reshape(-1).view(np.uint8)
    return [p for p in range(-(-a.size // pb)) if not np.array_equal(a[p * pb:(p + 1) * pb], b[p * pb:(p + 1) * pb])]


@pytest.mark.parametrize("nbytes,pb", [(64 * 1024, 4096), (64 * 1024 + 24, 4096), (10_000, 64), (4096, 4096)])
def test_shadow_diff_brute_force_and_update(nbytes, pb):
    rng = np.random.default_rng(nbytes)
    region = rng_bytes(rng, nbytes)
    shadow = region.copy()
    n = -(-nbytes // pb)
    for trial in range(4):
        hits = rng.integers(0, nbytes, size=int(rng.integers(0, 6)))
        if trial == 3:
            hits = np.append(hits, nbytes - 1)  # the short last page
        region[hits] ^= rng.integers(1, 256, size=hits.size, dtype=np.uint8)
        expect = brute_dirty(region, shadow, pb)
        got = ref.shadow_diff(region, shadow, page_bytes=pb, update=False)
        assert got.dtype == np.uint32 and list(got) == expect
        got = ref.shadow_diff(region, shadow, page_bytes=pb)
        assert list(got) == expect and np.array_equal(region, shadow)
        assert all(0 <= p < n for p in got)
    assert ref.shadow_diff(region, shadow, page_bytes=pb).size == 0


def test_shadow_diff_any_dtype_and_chunking(monkeypatch):
    monkeypatch.setattr(ref, "_CHUNK_BYTES", 3 * 4096)  # several numpy passes
    region = np.random.default_rng(6).standard_normal((40, 1000)).astype(np.float32)
    shadow = region.copy()
    region[7, 3] += 1.0
    region[39, 999] = -region[39, 999] - 1
    expect = brute_dirty(region, shadow, 4096)
    assert len(expect) == 2
    assert list(ref.shadow_diff(region, shadow, page_bytes=4096)) == expect
    assert np.array_equal(region, shadow)
    shadow[0, 0] += 1
    assert list(ref.shadow_diff(region, shadow, page_bytes=4096, update=False)) == [0]


def test_shadow_diff_rejects_bad_input():
    a = np.zeros(4096, np.uint8)
    with pytest.raises(KernelInputError, match="page_bytes"):
        ref.shadow_diff(a, a.copy(), page_bytes=100)
    with pytest.raises(KernelInputError, match="shadow"):
        ref.shadow_diff(a, np.zeros(4095, np.uint8), page_bytes=64)
    with pytest.raises(KernelInputError, match="contiguous"):
        ref.shadow_diff(np.zeros((64, 64), np.uint8)[:, ::2], np.zeros(2048, np.uint8), page_bytes=64)


# --- fingerprints ----------------------------------------------------------------

M64 = (1 << 64) - 1


def brute_fingerprint(page: bytes, pb: int) -> int:
    page = page + bytes(pb - len(page))
    s = 0
    for j in range(pb // 8):
        w = int.from_bytes(page[8 * j:8 * j + 8], "little")
        x = ((w ^ (j * ref.FP_K1 & M64)) * ref.FP_K2) & M64
        s = (s + (x ^ (x >> ref.FP_SHIFT))) & M64
    z = s ^ pb
    z = ((z ^ (z >> 30)) * ref.FP_M1) & M64
    z = ((z ^ (z >> 27)) * ref.FP_M2) & M64
    return z ^ (z >> 31)


def test_fingerprint_brute_force():
    rng = np.random.default_rng(7)
    region = rng_bytes(rng, 3 * 512 + 200)
    fps = ref.fingerprint_pages(region, page_bytes=512)
    raw = region.tobytes()
    assert [int(x) for x in fps] == [brute_fingerprint(raw[i:i + 512], 512) for i in range(0, len(raw), 512)]


def test_fingerprint_dirty_finds_every_single_word_change():
    rng = np.random.default_rng(8)
    region = rng_bytes(rng, 64 * 1024)
    fps = ref.fingerprint_pages(region, page_bytes=4096)
    assert fps.nbytes / region.nbytes <= 0.005
    for _ in range(50):
        i = int(rng.integers(0, region.size))
        region[i] ^= np.uint8(1 << int(rng.integers(0, 8)))
        assert list(ref.fingerprint_dirty(region, fps, page_bytes=4096)) == [i // 4096]
    # moving a word within the page is seen too
    w = region.view(np.uint64)
    w[[0, 1]] = w[[1, 0]]
    assert list(ref.fingerprint_dirty(region, fps, page_bytes=4096, update=False)) == [0]


# --- KV block-table scanner ------------------------------------------------------------

GEO = dict(block_size=4, kv_heads=2, head_dim=8, dtype_bytes=4)  # token 64 B, block 512 B


def write_tokens(cache, tables, lo, hi, rng):
    """Model writes: new K and V of tokens [lo, hi) of each sequence, all layers."""
    bs = GEO["block_size"]
    for s in range(len(lo)):
        for t in range(lo[s], hi[s]):
            b = tables[s, t // bs]
            cache[:, b, :, t % bs] = rng.standard_normal(cache[:, b, :, t % bs].shape) + 10


@pytest.mark.parametrize("pb", [64, 128, 512, 2048])
def test_kv_dirty_blocks_equals_pages_actually_written(pb):
    rng = np.random.default_rng(pb)
    layers, nb, seqs, maxb = 3, 24, 5, 6
    cache = np.zeros((layers, nb, 2, GEO["block_size"], GEO["kv_heads"], GEO["head_dim"]), np.float32)
    tables = np.full((seqs, maxb), -1, np.int32)
    perm = rng.permutation(nb)[:seqs * 4].reshape(seqs, 4)
    tables[:, :4] = perm
    lens = np.zeros(seqs, np.int32)
    ckpt = np.zeros(seqs, np.int32)
    for step in range(4):
        shadow = cache.copy()
        new = np.minimum(lens + rng.integers(0, 6, seqs), 16).astype(np.int32)
        if step == 2:
            new[1] = 3  # sequence 1 replaced by a shorter one: counts from token 0
            lo = np.where(new >= lens, lens, 0)
        else:
            lo = lens.copy()
        write_tokens(cache, tables, lo, new, rng)
        lens = new
        got = ref.kv_dirty_blocks(tables, lens, ckpt, num_blocks=nb, num_layers=layers, page_bytes=pb, **GEO)
        assert list(got) == brute_dirty(cache, shadow, pb)
        assert np.array_equal(ckpt, lens)


def test_kv_dirty_blocks_rejects_bad_tables():
    tables = np.array([[0, 99]], np.int32)
    with pytest.raises(KernelInputError, match="block 99"):
        ref.kv_dirty_blocks(tables, np.array([8], np.int32), np.zeros(1, np.int32),
                            num_blocks=4, page_bytes=64, **GEO)
    with pytest.raises(KernelInputError, match="table entries"):
        ref.kv_dirty_blocks(tables, np.array([12], np.int32), np.zeros(1, np.int32),
                            num_blocks=100, page_bytes=64, **GEO)


def test_expand_ranges():
    got = ref.expand_ranges(np.array([5, 0, 9]), np.array([2, 0, 3]))
    assert got.dtype == np.int64 and list(got) == [5, 6, 9, 10, 11]
    assert ref.expand_ranges(np.zeros(0, np.int64), np.zeros(0, np.int64)).size == 0


def test_adapter_dirty_pages():
    v = np.zeros(5, np.uint64)
    seen = v.copy()
    assert ref.adapter_dirty_pages(v, seen, pages_per_slot=3, num_pages=14).size == 0
    v[[1, 4]] += 1
    got = ref.adapter_dirty_pages(v, seen, pages_per_slot=3, num_pages=14)
    assert list(got) == [3, 4, 5, 12, 13] and np.array_equal(v, seen)


# --- staging -----------------------------------------------------------------------------


def test_stage_page_batch_is_the_wal_encoder():
    rng = np.random.default_rng(9)
    pb = 256
    region = rng_bytes(rng, 40 * pb + 72)  # short last page
    n = -(-region.size // pb)
    padded = np.zeros(n * pb, np.uint8)
    padded[:region.size] = region
    dst = np.full(1 << 16, 0xAA, np.uint8)  # garbage where the pad goes
    cursor = ref.new_cursor()
    batches = [np.array([0]), np.sort(rng.choice(n, 9, replace=False)), np.array([3, n - 1])]
    for k, ids in enumerate(batches):
        off = int(cursor[ref.CURSOR_USED])
        length = ref.stage_page_batch(region, ids, dst, cursor, page_bytes=pb, base_lsn=1 << 20,
                                      epoch=5 + k, region_id=2, salt=0xC0FFEE, flags=k & 1)
        want = np.zeros(length, np.uint8)
        assert fmt.encode_page_batch_into(want, lsn=(1 << 20) + off, epoch=5 + k, region_id=2, salt=0xC0FFEE,
                                          page_ids=ids, pages=padded.reshape(n, pb)[ids], page_bytes=pb,
                                          flags=k & 1) == length
        assert np.array_equal(dst[off:off + length], want)
        batch = fmt.decode_page_batch(dst[off:off + length])
        assert list(batch.page_ids) == list(ids)
    assert int(cursor[ref.CURSOR_RECORDS]) == 3 and int(cursor[ref.CURSOR_USED]) % 64 == 0


def test_stage_refuses_what_does_not_fit():
    region = np.arange(4096, dtype=np.uint8)
    dst = np.zeros(64 + 64 + 2 * 1024, np.uint8)
    cursor = ref.new_cursor()
    kw = dict(page_bytes=1024, base_lsn=0, epoch=1, region_id=0, salt=1)
    assert ref.stage_page_batch(region, [0, 1], dst, cursor, **kw) == dst.size
    before = dst.copy()
    ref.stage_page_batch(region, [2], dst, cursor, **kw)
    assert list(cursor[:3]) == [dst.size, 1, 1] and np.array_equal(dst, before)


def test_stage_rejects_unsorted_and_empty_lists():
    region = np.zeros(4096, np.uint8)
    kw = dict(page_bytes=1024, base_lsn=0, epoch=1, region_id=0, salt=1)
    with pytest.raises(KernelInputError, match="increasing"):
        ref.stage_page_batch(region, [2, 1], np.zeros(8192, np.uint8), ref.new_cursor(), **kw)
    with pytest.raises(KernelInputError, match="at least one"):
        ref.stage_page_batch(region, [], np.zeros(8192, np.uint8), ref.new_cursor(), **kw)
    with pytest.raises(KernelInputError, match="out of range"):
        ref.stage_page_batch(region, [4], np.zeros(8192, np.uint8), ref.new_cursor(), **kw)


# --- recovery scatter -------------------------------------------------------------------


def test_scatter_restores_and_reports_bad_pages():
    rng = np.random.default_rng(10)
    pb = 512
    region = rng_bytes(rng, 20 * pb + 40)
    log = np.zeros(1 << 16, np.uint8)
    cursor = ref.new_cursor(128)
    ids = np.arange(21)
    ref.stage_page_batch(region, ids, log, cursor, page_bytes=pb, base_lsn=0, epoch=1, region_id=0, salt=3)
    batch = fmt.decode_page_batch(log[128:])
    offs = ref.record_payload_offsets(128, ids.size, pb)
    target = np.zeros_like(region)
    bad = ref.scatter_pages(log, offs, ids, target, page_bytes=pb, expected_crcs=batch.page_crcs)
    assert bad.size == 0 and np.array_equal(target, region)
    # damage two payload pages: reported, and not applied
    log[int(offs[4]) + 7] ^= 0xFF
    log[int(offs[20]) + 1] ^= 0x01
    target[:] = 0
    bad = ref.scatter_pages(log, offs[::-1], ids[::-1], target, page_bytes=pb, expected_crcs=batch.page_crcs[::-1])
    assert list(bad) == [0, 16]
    assert not target[4 * pb:5 * pb].any() and not target[20 * pb:].any()
    good = np.setdiff1d(ids, [4, 20])
    assert all(np.array_equal(target[p * pb:(p + 1) * pb], region[p * pb:(p + 1) * pb]) for p in good)


def _runs_for_expand(rng, runs: int):
    """Random runs: counts (an empty run among them), staging offsets, page
    sizes, page ids near 2**32 (the uint32 ids wrap) and CRC table offsets."""
    count = rng.integers(1, 9, size=runs)
    if runs > 1:
        count[runs // 2] = 0
    first = np.cumsum(count) - count
    stage = rng.integers(0, 1 << 40, size=runs)
    pb = rng.choice([64, 4096, 65536], size=runs)
    ids = (1 << 32) - rng.integers(1, 9, size=runs)   # every run's ids near the top: most wrap past 2**32
    ids[0] = -1   # and one below zero
    table = rng.integers(0, 1 << 32, size=int(count.sum()) + 64, dtype=np.uint32)
    crc = rng.integers(0, 64, size=runs)
    return first, stage, pb, ids, crc, table, int(count.sum())


def test_expand_runs_lays_each_run_out_page_by_page():
    first, stage, pb, ids, crc, table, n = _runs_for_expand(np.random.default_rng(31), 40)
    got_stage, got_ids, got_crcs = ref.expand_runs(first, stage, pb, ids, crc, table, n)
    want_stage, want_ids, want_crcs = [], [], []
    for r in range(first.size):   # page by page, as the kernel's contract says
        end = first[r + 1] if r + 1 < first.size else n
        for j in range(int(end - first[r])):
            want_stage.append(int(stage[r]) + j * int(pb[r]))
            want_ids.append((int(ids[r]) + j) % (1 << 32))
            want_crcs.append(int(table[int(crc[r]) + j]))
    assert got_stage.dtype == np.uint64 and got_ids.dtype == np.uint32 and got_crcs.dtype == np.uint32
    assert got_stage.tolist() == want_stage and got_ids.tolist() == want_ids and got_crcs.tolist() == want_crcs
    assert [a.size for a in ref.expand_runs(first, stage, pb, ids, crc, table, 0)] == [0, 0, 0]
    assert any(i > w for i, w in zip(want_ids, want_ids[1:])), "no id wrapped"
    with pytest.raises(KernelInputError, match="run firsts"):
        ref.expand_runs(first[::-1], stage, pb, ids, crc, table, n)
    with pytest.raises(KernelInputError, match="past the end of the CRC table"):
        ref.expand_runs(first, stage, pb, ids, crc, table[:4], n)


def test_header_layout_matches_wal():
    assert ref.HEADER.format == fmt.RECORD_HEADER.format
    assert ref.TYPE_PAGE_BATCH == fmt.REC_PAGE_BATCH and ref.NO_REGION == fmt.NO_REGION
    for c in (1, 7, 8, 100):
        assert ref.page_batch_length(c, 4096) == fmt.page_batch_length(c, 4096)


@pytest.mark.parametrize("count", [0, 1, 5, 32, 33])
def test_stage_delta_writes_one_batch_and_moves_the_digest(count):
    rng = np.random.default_rng(count)
    pb, npages = 256, 100
    region = rng.integers(0, 256, size=npages * pb - 40, dtype=np.uint8)  # short last page
    ids = rng.permutation(np.append(rng.choice(npages - 1, max(0, count - 1), replace=False), npages - 1)[:count])
    table = rng.integers(0, 2**32, npages, dtype=np.uint64).astype(np.uint32)
    before = table.copy()
    dst = np.full(ref.page_batch_length(max(count, 1), pb), 0xEE, np.uint8)
    got = ref.stage_delta(region, ids.astype(np.uint32), dst, table, ref.region_digest(table), page_bytes=pb,
                          cap_pages=40, base_lsn=640, epoch=9, region_id=3, salt=0x55)
    if not 0 < count <= ref.DELTA_MAX_PAGES:
        assert got == (count, 0, 0, ref.region_digest(before))
        assert (dst == 0xEE).all() and np.array_equal(table, before)
        return
    want = np.full_like(dst, 0xEE)
    ref.stage_page_batch(region, np.sort(ids), want, ref.new_cursor(), page_bytes=pb, base_lsn=640, epoch=9,
                         region_id=3, salt=0x55)
    assert got == (count, dst.size, 1, ref.region_digest(table))
    assert dst.tobytes() == want.tobytes()
    expect = before.copy()
    expect[np.sort(ids)] = ref.crc32c_pages(region, np.sort(ids), page_bytes=pb)
    assert np.array_equal(table, expect)
    assert ref.region_digest_moved(ref.region_digest(before), npages, np.sort(ids), before[np.sort(ids)],
                                   expect[np.sort(ids)]) == got[3]


def test_stage_delta_refuses_more_pages_than_its_extent_holds():
    region = np.arange(64 * 10, dtype=np.uint8)
    table = ref.crc32c_pages(region, page_bytes=64)
    dst = np.zeros(ref.page_batch_length(2, 64), np.uint8)
    d = ref.region_digest(table)
    for cap, ids in ((2, [1, 2, 3]), (5, [1, 2, 3])):  # over the cap, then over dst
        assert ref.stage_delta(region, np.array(ids, np.uint32), dst, table, d, page_bytes=64, cap_pages=cap,
                               base_lsn=0, epoch=1, region_id=0, salt=0) == (3, 0, 0, d)
    assert not dst.any()


def test_region_digest_moved_equals_the_digest_recomputed():
    rng = np.random.default_rng(5)
    for n in (1, 2, 1000):
        table = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
        d = ref.region_digest(table)
        ids = np.sort(rng.choice(n, min(n, 7), replace=False))
        new = table.copy()
        new[ids] = rng.integers(0, 2**32, ids.size, dtype=np.uint64).astype(np.uint32)
        new[ids[0]] = table[ids[0]]  # an unchanged word moves nothing
        assert ref.region_digest_moved(d, n, ids, table[ids], new[ids]) == ref.region_digest(new)


def test_stage_delta_page_cap_is_one_warp_per_page_of_its_block():
    from concordia.gpu_kernels import gpu

    src = (pathlib.Path(__file__).resolve().parents[2] / "gpu_kernels" / "stage.cu").read_text()
    assert f"#define DELTA_THREADS {gpu.DELTA_THREADS}" in src
    assert "#define DELTA_MAX_PAGES (DELTA_THREADS / WARP)" in src
    assert gpu.DELTA_MAX_PAGES == ref.DELTA_MAX_PAGES == gpu.DELTA_THREADS // 32


def test_the_holds_twin_counts_arrivals_releases_and_timeouts():
    w = np.zeros(3, np.uint64)
    ref.hold_stream(w, 0)                       # released already: arrives, goes on
    ref.await_holds(w, 1)
    ref.release_holds(w, 0)
    assert w.tolist() == [1, 0, 0]
    ref.hold_stream(w, 5, timed_out=True)       # not released in time: broken
    ref.await_holds(w, 3, timed_out=True)       # two arrivals of three: broken
    ref.await_holds(w, 2, timed_out=True)       # both arrived: a timeout cannot break it
    assert w.tolist() == [2, 0, 2]
    ref.release_holds(w, 5)
    ref.release_holds(w, 4)                     # a release never goes back
    ref.hold_stream(w, 3, timed_out=True)       # released already
    assert w.tolist() == [3, 5, 2]


def test_span_rows_cut_each_span_into_pieces_in_order():
    span, offset, nbytes = ref.span_rows([0, 5, 10, 3], 4)
    assert span.tolist() == [1, 1, 2, 2, 2, 3]
    assert offset.tolist() == [0, 4, 0, 4, 8, 0]
    assert nbytes.tolist() == [4, 1, 4, 4, 2, 3]
    assert [a.size for a in ref.span_rows([], 4)] == [0, 0, 0]
    with pytest.raises(KernelInputError, match="a piece of 0 bytes"):
        ref.span_rows([1], 0)


def test_copy_spans_twin_copies_every_pair_and_refuses_other_sizes():
    rng = np.random.default_rng(4)
    srcs = [rng.integers(0, 256, n, dtype=np.uint8) for n in (0, 1, 17, 4096, 10_001)]
    dsts = [np.zeros(a.size // 2, np.uint16) if a.size and a.size % 2 == 0 else np.zeros(a.size, np.uint8)
            for a in srcs]   # targets of another dtype where the bytes allow it
    ref.copy_spans(list(zip(srcs, dsts)), piece=1000)
    assert all(np.array_equal(d.reshape(-1).view(np.uint8), a) for a, d in zip(srcs, dsts))
    with pytest.raises(KernelInputError, match=r"pairs\[0\]: 4 bytes into 5"):
        ref.copy_spans([(np.zeros(4, np.uint8), np.zeros(5, np.uint8))])
    with pytest.raises(KernelInputError, match="C-contiguous"):
        ref.copy_spans([(np.zeros(8, np.uint8)[::2], np.zeros(4, np.uint8))])


def test_the_batched_copys_plan_copies_what_the_twin_copies():
    """gpu.copy_plan, the host's half of the batched copy (numpy only), carried out on one byte array as
    the device would (a memcpy a copy-engine pair, a row at a time from the table): the twin's bytes. A
    pair goes to the copy engine where either address is not 16-byte aligned; empty pairs go nowhere."""
    from concordia.gpu_kernels import gpu

    rng = np.random.default_rng(24)
    sizes = [0, 1, 15, 16, 17, 4095, 5000, 3 * 4096 + 7, 70_000, 0]
    src_shift = [0, 3, 16, 0, 8, 0, 5, 0, 11, 7]
    dst_shift = [0, 0, 16, 1, 8, 0, 0, 0, 11, 0]
    mem = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
    ptrs, at = [], 4096
    for n, a, b in zip(sizes, src_shift, dst_shift):
        src = -(-at // 16) * 16 + a
        dst = -(-(src + n + 64) // 16) * 16 + b
        ptrs.append((src, dst))
        at = dst + n + 64
    want = mem.copy()
    ref.copy_spans([(want[s:s + n].copy(), want[d:d + n]) for (s, d), n in zip(ptrs, sizes)], piece=4096)
    engine, table, rows = gpu.copy_plan(ptrs, sizes, piece=4096)
    got = mem.copy()
    for s, d, n in engine.tolist():
        got[d:d + n] = got[s:s + n]
    srcs, dsts, nbytes = table.reshape(3, rows).tolist()
    for s, d, n in zip(srcs, dsts, nbytes):
        assert s % 16 == 0 and d % 16 == 0 and 0 < n <= 4096
        got[d:d + n] = got[s:s + n]
    assert np.array_equal(got, want)
    odd = {(s, d) for (s, d), n in zip(ptrs, sizes) if n and (s | d) % 16}
    assert {(s, d) for s, d, _ in engine.tolist()} == odd and len(odd) >= 3
    assert rows == ref.span_rows([n for (s, d), n in zip(ptrs, sizes) if n and not (s | d) % 16], 4096)[0].size
    with pytest.raises(KernelInputError, match="2 address pairs and 1 sizes"):
        gpu.copy_plan(ptrs[:2], sizes[:1])
    empty = gpu.copy_plan([], [])
    assert empty[0].shape == (0, 3) and empty[1].size == 0 and empty[2] == 0
