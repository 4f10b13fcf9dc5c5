"""The CuPy launchers against their numpy twins on a real device: the same
page lists, the same fingerprints and CRCs, byte-identical records (in device
memory and in pinned host memory written directly by the GPU), bit-exact
recovery scatter.  Outputs are poisoned first so unwritten bytes show."""

from __future__ import annotations

import crc32c
import numpy as np
import pytest

from concordia.gpu_kernels import reference as ref

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def cp():
    import cupy

    return cupy


@pytest.fixture(scope="module")
def gpu():
    from concordia.gpu_kernels import gpu

    return gpu


def rand_region(rng, nbytes):
    return rng.integers(0, 256, size=nbytes, dtype=np.uint8)


def dirty(rng, region, npages, pb, frac):
    """Flip bytes in a random `frac` of pages (at least one)."""
    k = max(1, int(npages * frac))
    pages = rng.choice(npages, size=k, replace=False)
    at = np.minimum(pages * pb + rng.integers(0, pb, size=k), region.size - 1)
    region[at] ^= np.uint8(0x5A)
    return np.unique(at // pb)


SIZES = [(4096, 256 * 4096), (4096, 300 * 4096 + 1000), (64, 10_000), (65536, 40 * 65536 + 48)]


@pytest.mark.parametrize("pb,nbytes", SIZES)
def test_crc32c_pages_equals_crc32c_package(cp, gpu, pb, nbytes):
    rng = np.random.default_rng(nbytes)
    host = rand_region(rng, nbytes)
    dev = cp.asarray(host)
    got = gpu.crc32c_pages(dev, page_bytes=pb).get()
    padded = np.zeros(ref.num_pages(nbytes, pb) * pb, np.uint8)
    padded[:nbytes] = host
    want = [crc32c.crc32c(padded[i:i + pb].tobytes()) for i in range(0, padded.size, pb)]
    assert list(got) == want
    ids = np.sort(rng.choice(len(want), size=min(7, len(want)), replace=False)).astype(np.uint32)
    assert list(gpu.crc32c_pages(dev, cp.asarray(ids), page_bytes=pb).get()) == [want[i] for i in ids]
    assert gpu.region_digest(cp.asarray(got)) == ref.region_digest(got)


def test_region_digest_odd_lengths(cp, gpu):
    rng = np.random.default_rng(1)
    for n in (0, 1, 3, 1023, 1025, 100_000):
        crcs = rng.integers(0, 2**32, size=n, dtype=np.uint64).astype(np.uint32)
        assert gpu.region_digest(cp.asarray(crcs)) == ref.region_digest(crcs)


@pytest.mark.parametrize("pb,nbytes", SIZES)
@pytest.mark.parametrize("frac", [0.0, 0.01, 0.5])
def test_shadow_diff_matches_twin(cp, gpu, pb, nbytes, frac):
    rng = np.random.default_rng(int(frac * 100) + nbytes)
    host = rand_region(rng, nbytes)
    hshadow = host.copy()
    if frac:
        dirty(rng, host, ref.num_pages(nbytes, pb), pb, frac)
    host[-1] ^= 1  # the short last page, when there is one
    dev, dshadow = cp.asarray(host), cp.asarray(hshadow)
    want = ref.shadow_diff(host, hshadow, page_bytes=pb)
    got = gpu.shadow_diff(dev, dshadow, page_bytes=pb).get()
    assert got.dtype == np.uint32 and np.array_equal(got, want)
    assert np.array_equal(dshadow.get(), hshadow)
    assert gpu.shadow_diff(dev, dshadow, page_bytes=pb).size == 0


@pytest.mark.parametrize("pb,nbytes", SIZES)
def test_fingerprints_match_twin(cp, gpu, pb, nbytes):
    rng = np.random.default_rng(nbytes + 3)
    host = rand_region(rng, nbytes)
    dev = cp.asarray(host)
    fps = gpu.fingerprint_pages(dev, page_bytes=pb)
    assert np.array_equal(fps.get(), ref.fingerprint_pages(host, page_bytes=pb))
    hfps = fps.get()
    dirty(rng, host, ref.num_pages(nbytes, pb), pb, 0.1)
    dev[...] = cp.asarray(host)
    want = ref.fingerprint_dirty(host, hfps, page_bytes=pb)
    got = gpu.fingerprint_dirty(dev, fps, page_bytes=pb).get()
    assert np.array_equal(got, want) and np.array_equal(fps.get(), hfps)


def _stage_both(cp, gpu, rng, pb, nbytes, batches, dst_dev, dst_host_view):
    host = rand_region(rng, nbytes)
    dev = cp.asarray(host)
    twin_dst = np.full(dst_dev.size, 0xAA, np.uint8)
    twin_cur, cur = ref.new_cursor(), gpu.new_cursor()
    for k, ids in enumerate(batches):
        kw = dict(page_bytes=pb, base_lsn=7 << 30, epoch=3 + k, region_id=k, salt=0xDEADBEEF, flags=k & 1)
        lt = ref.stage_page_batch(host, ids, twin_dst, twin_cur, **kw)
        lg = gpu.stage_page_batch(dev, cp.asarray(ids, dtype=cp.uint32), dst_dev, cur, **kw)
        assert lt == lg
    cp.cuda.get_current_stream().synchronize()
    assert np.array_equal(cur.get(), twin_cur)
    got = dst_host_view() if dst_host_view else dst_dev.get()
    used = int(twin_cur[ref.CURSOR_USED])
    assert np.array_equal(got[:used], twin_dst[:used])
    return twin_cur


@pytest.mark.parametrize("pb,nbytes", SIZES)
def test_staged_records_byte_identical_in_device_memory(cp, gpu, pb, nbytes):
    rng = np.random.default_rng(nbytes + 5)
    n = ref.num_pages(nbytes, pb)
    batches = [np.array([0]), np.array([n - 1]), np.sort(rng.choice(n, size=max(1, n // 3), replace=False)),
               np.arange(n)]
    need = sum(ref.page_batch_length(b.size, pb) for b in batches)
    dst = cp.full(need + 4096, 0xAA, cp.uint8)
    _stage_both(cp, gpu, rng, pb, nbytes, batches, dst, None)


def test_staged_records_byte_identical_in_pinned_host_memory(cp, gpu):
    rng = np.random.default_rng(11)
    pb, nbytes = 4096, 1000 * 4096 + 512
    n = ref.num_pages(nbytes, pb)
    batches = [np.sort(rng.choice(n, size=s, replace=False)) for s in (1, 17, 500)]
    need = sum(ref.page_batch_length(b.size, pb) for b in batches)
    host, dev = gpu.pinned_buffer(need + 8192)
    host[:] = 0xAA
    _stage_both(cp, gpu, rng, pb, nbytes, batches, dev, lambda: host.copy())


def test_staging_refuses_what_does_not_fit(cp, gpu):
    pb = 4096
    dev = cp.asarray(rand_region(np.random.default_rng(12), 16 * pb))
    dst = cp.full(ref.page_batch_length(2, pb) + 64, 0xAA, cp.uint8)
    cur = gpu.new_cursor()
    kw = dict(page_bytes=pb, base_lsn=0, epoch=1, region_id=0, salt=1)
    first = gpu.stage_page_batch(dev, cp.asarray([1, 2], dtype=cp.uint32), dst, cur, **kw)
    gpu.stage_page_batch(dev, cp.asarray([3], dtype=cp.uint32), dst, cur, **kw)
    c = cur.get()
    assert list(c[:3]) == [first, 1, 1]
    assert (dst[first:].get() == 0xAA).all()


@pytest.mark.parametrize("pb,nbytes", SIZES)
def test_scatter_restores_bit_exact_and_reports_damage(cp, gpu, pb, nbytes):
    rng = np.random.default_rng(nbytes + 7)
    host = rand_region(rng, nbytes)
    n = ref.num_pages(nbytes, pb)
    ids = np.arange(n, dtype=np.uint32)
    log = np.zeros(ref.page_batch_length(n, pb) + 256, np.uint8)
    ref.stage_page_batch(host, ids, log, ref.new_cursor(256), page_bytes=pb, base_lsn=0, epoch=1,
                         region_id=0, salt=9)
    crcs = log[256 + 64 + 4 * n:256 + 64 + 8 * n].view("<u4").copy()
    offs = ref.record_payload_offsets(256, n, pb)
    order = rng.permutation(n)
    target = cp.full(nbytes, 0x33, cp.uint8)
    bad = gpu.scatter_pages(cp.asarray(log), cp.asarray(offs[order]), cp.asarray(ids[order]), target,
                            page_bytes=pb, expected_crcs=cp.asarray(crcs[order]))
    assert bad.size == 0 and np.array_equal(target.get(), host)
    hit = rng.choice(n, size=min(3, n), replace=False)
    log[offs[hit].astype(np.int64) + 5] ^= 0x80
    target[...] = 0x33
    twin_target = np.full(nbytes, 0x33, np.uint8)
    want = ref.scatter_pages(log, offs[order], ids[order], twin_target, page_bytes=pb, expected_crcs=crcs[order])
    got = gpu.scatter_pages(cp.asarray(log), cp.asarray(offs[order]), cp.asarray(ids[order]), target,
                            page_bytes=pb, expected_crcs=cp.asarray(crcs[order])).get()
    assert np.array_equal(got, want) and len(want) == len(hit)
    assert np.array_equal(target.get(), twin_target)


def test_expand_runs_matches_twin(cp, gpu):
    from tests.gpu_kernels.test_reference import _runs_for_expand

    for runs in (1, 40, 5000):   # one run; an empty run among many; more runs than a block has threads
        args = _runs_for_expand(np.random.default_rng(runs), runs)
        want = ref.expand_runs(*args)
        got = gpu.expand_runs(*args, page_bytes=4096)
        assert all(g.dtype == w.dtype and np.array_equal(g.get(), w) for g, w in zip(got, want)), runs


def _spans(rng):
    """(sources, target sizes and offsets) of spans of every alignment: sizes around a piece and a 16-byte word,
    starting at odd offsets of one buffer, one empty."""
    sizes = [0, 1, 15, 16, 17, 4095, 5000, 3 * 4096 + 7, 70_000, 300_001]
    shifts = [0, 3, 16, 1, 8, 0, 5, 0, 11, 16]
    return [rand_region(rng, n) for n in sizes], sizes, shifts


def _targets(xp, sizes, shifts):
    """Target views at `shifts` past 16-byte boundaries of one poisoned buffer (each apart from the others):
    a shift of 0 or 16 is an aligned target, which with an aligned source takes the kernel's 16-byte path."""
    buf = xp.full(sum(sizes) + sum(shifts) + 80 * len(sizes), 0xA5, xp.uint8)
    out, at = [], 0
    for n, k in zip(sizes, shifts):
        at = -(-at // 16) * 16
        out.append(buf[at + k:at + k + n])
        at += k + n + 64
    return buf, out


def test_copy_spans_matches_twin_at_every_alignment(cp, gpu):
    """One launch copies every pair, aligned or not, cut into rows of a piece or less: the same bytes as the
    twin, and nothing between the targets written."""
    rng = np.random.default_rng(21)
    srcs, sizes, shifts = _spans(rng)
    # rows of many spans cut in pieces (at 64: more rows than the grid has blocks); one row a span
    for piece in (64, 4096, 1 << 20):
        hbuf, htargets = _targets(np, sizes, shifts)
        ref.copy_spans(list(zip(srcs, htargets)), piece=piece)
        dbuf, dtargets = _targets(cp, sizes, shifts)
        dsrcs = []
        for a, k in zip(srcs, shifts):   # sources at odd addresses as well
            host = np.zeros(a.size + k, np.uint8)
            host[k:] = a
            dsrcs.append(cp.asarray(host)[k:])
        gpu.copy_spans(list(zip(dsrcs, dtargets)), piece=piece)
        assert np.array_equal(dbuf.get(), hbuf), piece
        assert all(np.array_equal(t, a) for t, a in zip(htargets, srcs))
    aligned = [n for n, t, s in zip(sizes, dtargets, dsrcs) if n and (t.data.ptr | s.data.ptr) % 16 == 0]
    assert any(n % 16 for n in aligned) and any(n >= 4096 for n in aligned)   # 16-byte words with a byte tail
    rows = ref.span_rows(sizes, 64)[0].size
    assert rows > gpu._sm_count(cp.cuda.Device().id) * 16   # the blocks stride over rows


def test_copy_spans_uploads_its_table_without_cupys_pinned_pool(cp, gpu):
    """The row table goes up from pageable memory (`gpu.upload`): a pinned allocator that refuses every
    call is never asked, and the copies and the uploaded values are right."""
    def refuse(size):
        raise AssertionError(f"CuPy's pinned pool was asked for {size} bytes")

    rng = np.random.default_rng(22)
    srcs = [cp.asarray(rng.integers(0, 256, n, dtype=np.uint8)) for n in (16, 4096, 70000)]
    dsts = [cp.zeros_like(a) for a in srcs]
    host = rng.integers(0, 1 << 63, 1000, dtype=np.uint64)
    cp.cuda.set_pinned_memory_allocator(refuse)
    try:
        gpu.copy_spans(list(zip(srcs, dsts)), piece=1024)
        up = gpu.upload(host[::2])   # a strided array goes up as its contiguous copy
        empty = gpu.upload(np.zeros(0, np.int64))
        scalar = gpu.upload(np.array(5, np.int64))
    finally:
        cp.cuda.set_pinned_memory_allocator(cp.get_default_pinned_memory_pool().malloc)
    assert all(cp.array_equal(a, b) for a, b in zip(srcs, dsts))
    assert up.dtype == np.uint64 and np.array_equal(up.get(), host[::2])
    assert empty.shape == (0,) and empty.dtype == np.int64
    assert scalar.shape == () and int(scalar) == 5


def test_copy_addresses_copies_raw_pairs_once_the_kernel_is_loaded(cp, gpu, monkeypatch):
    """Raw (source, target) addresses, aligned or not, a zero size among them: the twin's bytes, in one launch
    where copy_spans is loaded; False and nothing written where it is not, as a caller that then copies
    itself needs."""
    from concordia.gpu_kernels import jit
    from concordia.gpu_kernels.errors import KernelInputError

    rng = np.random.default_rng(23)
    srcs, sizes, shifts = _spans(rng)
    hbuf, htargets = _targets(np, sizes, shifts)
    ref.copy_spans(list(zip(srcs, htargets)), piece=4096)
    dbuf, dtargets = _targets(cp, sizes, shifts)
    dsrcs = []
    for a, k in zip(srcs, shifts):
        host = np.zeros(a.size + k, np.uint8)
        host[k:] = a
        dsrcs.append(cp.asarray(host)[k:])
    pairs = [(a.data.ptr, b.data.ptr) for a, b in zip(dsrcs, dtargets)]
    before = dbuf.copy()
    monkeypatch.setattr(jit, "is_loaded", lambda *a, **k: False)
    assert gpu.copy_addresses(pairs, sizes, piece=4096) is False
    cp.cuda.get_current_stream().synchronize()
    assert cp.array_equal(dbuf, before)   # nothing queued
    monkeypatch.undo()
    gpu.copy_spans_ready()
    launches = []   # one row table goes up a launch
    real = gpu.upload
    monkeypatch.setattr(gpu, "upload", lambda host: launches.append(1) or real(host))
    assert gpu.copy_addresses(pairs, sizes, piece=4096) is True
    assert np.array_equal(dbuf.get(), hbuf) and launches == [1]
    assert any((s | t) % 16 for s, t in pairs) and 0 in sizes   # the copy engine's pairs, and an empty one
    with pytest.raises(KernelInputError, match="2 address pairs and 1 sizes"):
        gpu.copy_addresses(pairs[:2], sizes[:1])


def test_copy_spans_refuses_pairs_of_other_sizes_naming_the_pair(cp, gpu):
    from concordia.gpu_kernels.errors import KernelInputError

    with pytest.raises(KernelInputError, match=r"pairs\[1\]: 8 bytes into 9"):
        gpu.copy_spans([(cp.zeros(4, cp.uint8), cp.zeros(4, cp.uint8)), (cp.zeros(8, cp.uint8), cp.zeros(9, cp.uint8))])


def test_region_digests_read_back_together_equal_each_ones_twin(cp, gpu):
    rng = np.random.default_rng(5)
    crcs = [rng.integers(0, 1 << 32, size=n, dtype=np.uint32) for n in (1, 255, 4096, 70000)]
    assert gpu.region_digests([cp.asarray(c) for c in crcs]) == [ref.region_digest(c) for c in crcs]
    assert gpu.region_digests([]) == []


def test_kv_scanner_matches_twin(cp, gpu):
    rng = np.random.default_rng(13)
    geo = dict(block_size=16, kv_heads=8, head_dim=128, dtype_bytes=2)
    layers, nb, seqs, maxb = 4, 4096, 64, 64
    tables = np.full((seqs, maxb), -1, np.int32)
    tables[:, :48] = rng.permutation(nb)[:seqs * 48].reshape(seqs, 48)
    lens = rng.integers(0, 48 * 16, seqs).astype(np.int32)
    ckpt = np.maximum(lens - rng.integers(0, 40, seqs), 0).astype(np.int32)
    ckpt[:4] = lens[:4] + 5  # replaced sequences: count from 0
    for pb in (1024, 4096, 65536):
        hckpt, dckpt = ckpt.copy(), cp.asarray(ckpt)
        want = ref.kv_dirty_blocks(tables, lens, hckpt, num_blocks=nb, num_layers=layers, page_bytes=pb, **geo)
        got = gpu.kv_dirty_blocks(cp.asarray(tables), cp.asarray(lens), dckpt, num_blocks=nb,
                                  num_layers=layers, page_bytes=pb, **geo)
        assert np.array_equal(got.get(), want) and np.array_equal(dckpt.get(), hckpt)


def test_adapter_scanner_matches_twin(cp, gpu):
    v = np.zeros(100, np.uint64)
    seen = v.copy()
    v[[0, 17, 99]] = [1, 4, 2]
    dv, dseen = cp.asarray(v), cp.asarray(seen)
    want = ref.adapter_dirty_pages(v, seen, pages_per_slot=5, num_pages=498)
    got = gpu.adapter_dirty_pages(dv, dseen, pages_per_slot=5, num_pages=498)
    assert np.array_equal(got.get(), want) and np.array_equal(dseen.get(), seen)


def test_precompile_loads_each_module_once(cp):
    from concordia.gpu_kernels import jit

    specs = jit.page_specs(4096) + [("crc32c", {})]
    jit.precompile(specs)
    before = jit.loaded()
    jit.precompile(specs)
    assert jit.loaded() == before
    assert jit.module("stage", {"PAGE_BYTES": 4096}) is jit.module("stage", {"PAGE_BYTES": 4096})


@pytest.mark.parametrize("n", [1, 63, 64, 65, 4096, 65536 + 17, 2_097_152])
@pytest.mark.parametrize("frac", [0.0, 1e-5, 0.3, 1.0])
def test_compact_flags_in_one_launch(cp, gpu, n, frac):
    rng = np.random.default_rng(n)
    flags = (rng.random(n) < frac).astype(np.uint8) * rng.integers(1, 256, n, dtype=np.uint8)
    ids = cp.full(n + 8, 0xDEADBEEF, cp.uint32)
    count = cp.full(1, 7, cp.uint64)
    gpu.launch_compact(cp.asarray(flags), ids, count)
    want = np.flatnonzero(flags).astype(np.uint32)
    k = int(count.get()[0])
    assert k == want.size
    assert np.array_equal(ids[:k].get(), want)
    assert (ids[k:].get() == 0xDEADBEEF).all()  # nothing past the count


def test_fast_stage_and_scatter_write_what_the_checked_launchers_write(cp, gpu):
    rng = np.random.default_rng(3)
    pb, npages = 4096, 300
    host = rand_region(rng, npages * pb)
    region = cp.asarray(host)
    want_ids = np.sort(rng.choice(npages, 37, replace=False)).astype(np.uint32)
    length = ref.page_batch_length(want_ids.size, pb)
    dst = cp.full(length + 128, 0xEE, cp.uint8)
    ids = cp.full(npages, 0xFFFFFFFF, cp.uint32)
    ids[:want_ids.size] = cp.asarray(want_ids)
    cursor, slot, crcs = cp.zeros(4, cp.uint64), cp.zeros(1, cp.uint64), cp.zeros(want_ids.size, cp.uint32)
    got = gpu.launch_stage(region, ids, int(want_ids.size), dst.data.ptr, dst.size, cursor, slot, crcs,
                           page_bytes=pb, base_lsn=4096, epoch=5, region_id=2, salt=0x1234)
    assert got == length
    twin = np.full(length + 128, 0xEE, np.uint8)
    ref.stage_page_batch(host, want_ids, twin, ref.new_cursor(), page_bytes=pb, base_lsn=4096, epoch=5,
                         region_id=2, salt=0x1234)
    assert dst.get().tobytes() == twin.tobytes()
    table = cp.zeros(npages, cp.uint32)
    gpu.launch_scatter_u32(table, ids, crcs, int(want_ids.size))
    want = np.zeros(npages, np.uint32)
    want[want_ids] = ref.crc32c_pages(host, want_ids, page_bytes=pb)
    assert np.array_equal(table.get(), want)


@pytest.mark.parametrize("detector", ["shadow", "fingerprint"])
@pytest.mark.parametrize("frac", [1e-3, 0.3])
def test_detectors_list_their_dirty_pages(cp, gpu, detector, frac):
    rng = np.random.default_rng(11)
    pb, nbytes = 4096, 500 * 4096 + 100
    host = rand_region(rng, nbytes)
    region = cp.asarray(host)
    npages = ref.num_pages(nbytes, pb)
    before = region.copy()
    keep = gpu.fingerprint_pages(region, page_bytes=pb) if detector == "fingerprint" else before
    want = dirty(rng, host, npages, pb, frac)
    region[...] = cp.asarray(host)
    flags = cp.full(npages, 7, cp.uint8)
    for cap in (1000, 3):
        lst, count = cp.full(cap, 0xFFFFFFFF, cp.uint32), cp.zeros(1, cp.uint32)
        shadow = keep.copy()
        if detector == "shadow":
            gpu.launch_shadow_diff(region, shadow, flags, page_bytes=pb, update=True, found=(lst, count))
        else:
            gpu.launch_fingerprint(region, shadow, flags, page_bytes=pb, update=True, found=(lst, count))
        assert np.array_equal(cp.flatnonzero(flags).get(), want)
        assert int(count.get()[0]) == want.size
        listed = lst.get()[:min(cap, want.size)]
        assert np.unique(listed).size == listed.size and set(listed.tolist()) <= set(want.tolist())
        if cap >= want.size:
            assert sorted(listed.tolist()) == want.tolist()


@pytest.mark.parametrize("count", [0, 1, 7, 32, 33])
@pytest.mark.parametrize("where", ["device", "pinned"])
def test_stage_delta_equals_twin(cp, gpu, count, where):
    rng = np.random.default_rng(100 + count)
    pb, npages = 4096, 300
    nbytes = npages * pb - 1000  # short last page
    host = rand_region(rng, nbytes)
    region = cp.asarray(host)
    ids = rng.permutation(np.append(rng.choice(npages - 1, max(0, count - 1), replace=False), npages - 1)[:count])
    ids = ids.astype(np.uint32)
    table = rng.integers(0, 2**32, npages, dtype=np.uint64).astype(np.uint32)
    length = ref.page_batch_length(max(1, min(count, 32)), pb) + 192
    twin_dst, twin_table = np.full(length, 0xEE, np.uint8), table.copy()
    kw = dict(page_bytes=pb, cap_pages=32, base_lsn=1 << 20, epoch=12, region_id=4, salt=0xABCD)
    want = ref.stage_delta(host, ids, twin_dst, twin_table, ref.region_digest(table), **kw)
    if where == "device":
        dst = cp.full(length, 0xEE, cp.uint8)
        read = dst.get
    else:
        h, dst = gpu.pinned_buffer(length)
        h[:] = 0xEE
        read = lambda: h.copy()  # noqa: E731
    dev_table = cp.asarray(table)
    got = gpu.stage_delta(region, cp.asarray(ids), dst, dev_table, ref.region_digest(table), **kw)
    assert got == want
    assert read().tobytes() == twin_dst.tobytes()
    assert np.array_equal(dev_table.get(), twin_table)
    if got[2]:
        assert got[3] == gpu.region_digest(dev_table)


def test_stage_delta_refuses_a_record_larger_than_its_extent(cp, gpu):
    region = cp.asarray(rand_region(np.random.default_rng(2), 64 * 4096))
    table = gpu.crc32c_pages(region, page_bytes=4096)
    d = gpu.region_digest(table)
    dst = cp.zeros(ref.page_batch_length(2, 4096), cp.uint8)
    got = gpu.stage_delta(region, cp.asarray(np.array([9, 3, 5], np.uint32)), dst, table, d, page_bytes=4096,
                          cap_pages=32, base_lsn=0, epoch=1, region_id=0, salt=0)
    assert got == (3, 0, 0, d)
    assert not bool(dst.any()) and gpu.region_digest(table) == d


def test_the_stream_holds_write_the_words_their_twin_writes(cp, gpu):
    """hold_stream / await_holds / release_holds against reference's twin:
    the same sequence (released holds, a hold and a wait that time out, a
    release that never goes back) leaves the same three words."""
    t = np.zeros(3, np.uint64)
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        w = cp.zeros(3, cp.uint64)              # zeroed on the stream the kernels run on
        gpu.launch_hold(w, 0, 0)
        gpu.launch_await_holds(w, 1, 0)
        gpu.launch_release_holds(w, 0)
        gpu.launch_hold(w, 5, 1000)             # 1 us: times out
        gpu.launch_await_holds(w, 3, 1000)
        gpu.launch_await_holds(w, 2, 1000)
        gpu.launch_release_holds(w, 5)
        gpu.launch_release_holds(w, 4)
        gpu.launch_hold(w, 3, 10**9)
    s.synchronize()
    ref.hold_stream(t, 0)
    ref.await_holds(t, 1)
    ref.release_holds(t, 0)
    ref.hold_stream(t, 5, timed_out=True)
    ref.await_holds(t, 3, timed_out=True)
    ref.await_holds(t, 2, timed_out=True)
    ref.release_holds(t, 5)
    ref.release_holds(t, 4)
    ref.hold_stream(t, 3, timed_out=True)
    assert cp.asnumpy(w).tobytes() == t.tobytes()


def test_a_hold_stops_its_stream_until_released(cp, gpu):
    """Work queued behind a hold on one stream waits for the release queued on
    another (non-blocking) stream, and the hold does not time out."""
    held, other = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    w = cp.zeros(3, cp.uint64)
    x = cp.zeros(1, cp.int32)
    scratch = cp.zeros(3, cp.uint64)            # every kernel loaded now: under CUDA's lazy loading a
    gpu.launch_hold(scratch, 0, 0)              # kernel's first launch may wait for a hold that spins
    gpu.launch_await_holds(scratch, 1, 0)
    gpu.launch_release_holds(scratch, 0)
    x += 0
    seen = x.copy()
    cp.cuda.Device().synchronize()              # zeroed before the non-blocking streams use them
    with held:
        gpu.launch_hold(w, 1, 10 * 10**9)
        x += 1
    with other:
        gpu.launch_await_holds(w, 1, 10 * 10**9)
        seen = x.copy()                         # read while the hold keeps `held` before x += 1
        gpu.launch_release_holds(w, 1)
    held.synchronize()
    other.synchronize()
    assert int(seen[0]) == 0 and int(x[0]) == 1
    assert cp.asnumpy(w).tolist() == [1, 1, 0]
