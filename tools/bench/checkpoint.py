"""`concordia-wal bench checkpoint`: delta checkpoints on the GPU, against
ceilings measured in the same run.

Four parts (GPU):
  detect   shadow diff over regions of several sizes and dirty fractions, as
           read bandwidth (region + shadow bytes / time) over the device-memory
           read bandwidth of a plain read kernel on the same buffers;
  stage    page-batch records written by the GPU straight into pinned host
           memory, as bandwidth over a pinned device-to-host copy of the same
           bytes;
  e2e      one dirty page: detect, stage into a real log on a /dev/shm
           mapping registered with CUDA, persist, commit with region digests
           (the Session's device path: two small reads of the device), once
           per detector: shadow diff, fingerprints, and `stores` (the page
           written by an instrumented kernel, found in the PTX store tracker's
           bitmap, with the default fingerprint cross-check every 8th
           checkpoint); against host-side scanning (whole region to pinned
           host, numpy compare with a host shadow, append the delta, commit);
  kv       the KV block-table scanner for a fixed number of new tokens as the
           cache grows (the cache is never read, so the time should stay flat);
  regions  `Session.checkpoint()` of 1 to 1,024 regions sharing 1 GiB, one
           dirty page each (fingerprints): one table pass whatever the count,
           beside the floor of one read of the regions at the HBM read
           ceiling plus the dirty pages at the pinned device-to-host ceiling,
           both measured in the run, and host scanning of the same bytes;
  decode   one decode step's checkpoint of a model's state: 56 KV tensors of a
           2-byte dtype ([batch 8, kv heads 8, max length, head dim 128], one
           new token per sequence) and 112 small LoRA adapter tensors, all
           updated (an online adapter update) or all clean.  The KV tensors
           are registered as a static cache is (detect="positions", one
           256-byte row a page, the length advanced by each step; the
           adapters by fingerprints), and again with fingerprints and the
           bench's page size for comparison (keys `fingerprint_*`).  The
           adapters lie in one tensor registered as one region, as protect()
           lays out a PEFT model's LoRA weights; keys `*_lora_tensors` register
           them a region each, as protect() did before.
Device times come from CUDA events (median of repeats after warm-up);
end-to-end times from the host clock around whole checkpoints.

`--cpu` runs the numpy twins instead (the CPU path), with numpy's own copy
bandwidth as the ceiling.

Example:

    concordia-wal bench checkpoint --json --plot checkpoint.png
    concordia-wal bench checkpoint --cpu --quick
"""

from __future__ import annotations

import os
import statistics
import time

import click
import numpy as np

from concordia.checkpoint.staging import page_crc_table
from concordia.gpu_kernels import reference as ref
from concordia.gpu_kernels.errors import GpuUnavailableError
from concordia.sizes import parse_size
from concordia.tools.common import check_outputs, guarded, report, require_cupy

from . import kernels
from .files import Scratch, force_option, save_figure

GiB = 1 << 30
MiB = 1 << 20

# which entry point each part measures: the product's (`Session`) or a component
MEASURED_THROUGH = {
    "detect": "component: the detection kernels (gpu_kernels.gpu launchers, reference twins with --cpu)",
    "stage": "component: the staging kernel (gpu_kernels.gpu.stage_page_batch)",
    "e2e": "public entry point: Session.checkpoint of one dirty page (gpu_checkpoint_s_*); "
           "detect_kernel_s_* is a component (the detector kernel alone); host_scan_checkpoint_s the "
           "alternative it replaces (whole region to the host, numpy diff, the log's appender)",
    "kv": "component: the KV block scanner (gpu_kernels.gpu.kv_dirty_blocks)",
    "decode_shaped": "public entry point: Session.checkpoint of a decode step's regions (ckpt_ms*; its "
                     "detect/stage/commit/other split from CheckpointStats); device_ms* is a component (the "
                     "device work a pending Session.checkpoint queues, timed between CUDA events); floor_ms a "
                     "ceiling (the state at HBM speed, the new bytes at D2H speed)",
}

DEFAULT = {
    "regions": "1,16,64,256,1024",
    "regions_total": "1G",
    "decode_len": "1024",
    "sizes": "256M,1G,4G,16G",
    "fractions": "page,0.001,0.01,0.1,0.5",
    "e2e_sizes": "256M,1G,4G,8G",
    "stage_region": "1G",
    "kv_cache_sizes": "1G,4G,16G,64G,256G",
}
QUICK = {
    "regions": "1,16,64",
    "regions_total": "64M",
    "decode_len": "64",
    "sizes": "64M,256M",
    "fractions": "page,0.01,0.5",
    "e2e_sizes": "64M,256M",
    "stage_region": "256M",
    "kv_cache_sizes": "1G,16G,256G",
}
CPU_DEFAULT = {**DEFAULT, "sizes": "64M,256M", "e2e_sizes": "64M,256M", "stage_region": "256M",
               "regions": "1,16,64,256", "regions_total": "64M", "decode_len": "64"}
CPU_QUICK = {
    "regions": "1,16",
    "regions_total": "4M",
    "decode_len": "8",
    "sizes": "4M,16M",
    "fractions": "page,0.01,0.5",
    "e2e_sizes": "4M,16M",
    "stage_region": "16M",
    "kv_cache_sizes": "1G,16G",
}


E2E_DETECTORS = ("shadow", "fingerprint", "stores")
FLIP_SRC = r"""
extern "C" __global__ void flip_bytes(unsigned char* r, const long long* at, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) r[at[i]] ^= (unsigned char)0xA5;
}
"""


def _sizes(text: str, option: str) -> list[int]:
    """'256M,1G' -> positive byte counts; anything else names `option`."""
    try:
        sizes = [parse_size(t) for t in text.split(",") if t.strip()]
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint=option) from None
    if not sizes or min(sizes) <= 0:
        raise click.BadParameter(f"{text!r}: give one or more sizes above zero", param_hint=option)
    return sizes


def _counts(text: str, option: str) -> list[int]:
    """'1,16,64' -> positive whole numbers; anything else names `option`."""
    try:
        out = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        out = []
    if not out or min(out) <= 0:
        raise click.BadParameter(f"{text!r}: give one or more whole numbers above zero", param_hint=option)
    return out


def _fractions(text: str) -> list[str | float]:
    """'page,0.01,0.5' -> 'page' (one page) and fractions of the pages in (0, 1]."""
    out: list[str | float] = []
    for t in (t.strip() for t in text.split(",")):
        if t == "page":
            out.append(t)
        elif t:
            try:
                f = float(t)
            except ValueError:
                f = -1.0
            if not 0 < f <= 1:
                raise click.BadParameter(f"{t!r} is neither 'page' nor a fraction in (0, 1]",
                                         param_hint="--fractions")
            out.append(f)
    if not out:
        raise click.BadParameter(f"{text!r}: give 'page' or fractions in (0, 1]", param_hint="--fractions")
    return out


def _dirty_count(frac, npages: int) -> int:
    return 1 if frac == "page" else max(1, int(npages * frac))


# --- regions and decode: Session.checkpoint() of many regions ----------------------

DECODE = {"kv_tensors": 56, "batch": 8, "kv_heads": 8, "head_dim": 128, "adapter_tensors": 112, "rank": 16,
          "hidden": 1024}


def _shm_room(need: int) -> str | None:
    free = os.statvfs("/dev/shm")
    if free.f_bavail * free.f_frsize < need + 512 * MiB:
        return f"/dev/shm has too little space for a {need >> 20} MiB log"
    return None


def _session_steps(runner, arrays: dict, step, reps: int, *, staging: str, tag: str, options=None,
                   retain: bool = True, wait: bool = True, executor: str = "host") -> dict:
    """Register `arrays` (fingerprint detector and the bench's page size,
    unless `options` gives a name other `register` arguments) in a Session on
    a shm log of their own (retention on unless `retain` is False), checkpoint
    the base, then `reps` + 2 times: step(i) (the caller's writes), wait for
    the device, time one checkpoint.  Median of the last `reps`, with what the
    checkpoints did and the medians of their phases: detect, stage and commit
    as `CheckpointStats` times them, `other_ms` the rest of the call
    (retention's slice, the stream order, the statistics).  wait=False: each
    checkpoint leaves its epoch pending and the next one commits it (its
    time is that call's: the last epoch's finish and commit, this one's
    launch; phases are not split then; on the GPU, `device_ms` is the
    median device time of the work such a call queues, timed alone).
    executor="resident": the session's epochs after its first two are arena
    epochs of the resident executor (the persistent kernel's on a GPU),
    durable when the call returns; the arena's epochs are taken on (and
    retention runs) at the call that finds it full: `ckpt_ms_mean` counts
    those calls where the median does not."""
    from concordia.policy import Policy
    from concordia.session import Session

    total = sum(int(a.nbytes) for a in arrays.values())
    seg = 64 * MiB
    # room for retention (on by default) to write a second base image beside the deltas
    need = -(-(total * 5 // 2 + (reps + 4) * (total // 16 + 2 * MiB) + 4 * seg) // seg) * seg
    why = _shm_room(need)
    if why:
        return {"error": why}
    log = runner.scratch.log(f"steps-{tag}")
    try:
        with Session(log, size=need, segment_size=seg, staging=staging, policy=Policy(retain=retain),
                     executor=executor) as s:
            for k, a in arrays.items():
                s.register(k, a, **((options or {}).get(k) or {"page_bytes": runner.pb, "detect": "fingerprint"}))
            s.checkpoint()
            times, phases, last = [], [], None
            for i in range(reps + 2):
                step(i)
                runner.sync()
                t0 = time.perf_counter()
                last = s.checkpoint(wait=wait)
                times.append(time.perf_counter() - t0)
                phases.append((last.detect_ms, last.stage_ms, last.commit_ms,
                               times[-1] * 1e3 - last.detect_ms - last.stage_ms - last.commit_ms))
            pending = last.pending
            s.settle()
            queued = []  # device time of the epoch a pending checkpoint queues (GPU only)
            if pending and hasattr(runner, "queued_ms"):
                for i in range(reps + 2, 2 * reps + 2):
                    step(i)
                    runner.sync()
                    queued.append(runner.queued_ms(lambda: s.checkpoint(wait=False))[0])
                s.settle()
            t = statistics.median(times[2:])
            med = [statistics.median(p[j] for p in phases[2:]) for j in range(4)]
            resident = {} if s.resident is None else {
                "ckpt_ms_mean": statistics.fmean(times[2:]) * 1e3, "route": s.resident.info()["route"]}
            return {"ckpt_ms": t * 1e3, "ckpt_ms_min": min(times[2:]) * 1e3, "dirty_pages": sum(last.pages.values()),
                    **resident,
                    "dirty_bytes": last.bytes, "log_bytes": last.log_bytes, "device_reads": last.device_reads,
                    "table_pass": last.table_pass, "via": sorted(set(last.via.values())),
                    "pending": pending, **({"device_ms": statistics.median(queued)} if queued else {}),
                    # who wrote retention's bases (the device, from pinned copies, or the host), how many
                    "base_staging": s.retention.base_staging, "retention_jobs": s.retention.counts["jobs"],
                    "retention_bases": s.retention.counts["bases"],
                    **({} if pending else {"detect_ms": med[0], "stage_ms": med[1],
                                                               "commit_ms": med[2], "other_ms": med[3]})}
    except Exception as exc:  # reported in the row, the bench goes on
        return {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        runner.scratch.discard(log)


def _regions_part(runner, counts: list[int], total: int, rng, reps: int) -> tuple[list, dict]:
    """(rows, ceilings): one row per region count, the regions views of one
    buffer of `total` bytes, one page of each dirtied before every checkpoint."""
    pb = runner.pb
    big = runner.random_region(total)
    ceil = runner.ceilings(big)
    rows = []
    for n in counts:
        size = max(1, total // n // pb) * pb
        views = {f"r{i:04d}": big[i * size:(i + 1) * size] for i in range(n)}

        def step(i, n=n, size=size):
            at = np.arange(n, dtype=np.int64) * size + (int(rng.integers(0, size // pb)) * pb + 7)
            runner.flip(big, at)

        row = {"regions": n, "region_bytes": size}
        row.update(_session_steps(runner, views, step, reps, staging=runner.staging, tag="r"))
        row["floor_ms"] = (n * size / ceil["hbm_read_Bps"] + n * pb / ceil["d2h_Bps"]) * 1e3
        row["host_scan_ms"] = ceil["host_scan_s"] * 1e3 * (n * size) / total
        rows.append(row)
        del views
    del big
    runner.free()
    return rows, ceil


def _decode_part(runner, max_len: int, rng, reps: int) -> dict:
    """One decode step of a model's state: every KV tensor gains one token per
    sequence (every head), then every adapter tensor is rewritten or none.
    The KV tensors are registered as the product registers a static cache
    (detect="positions", the length the step advanced; keys as they were),
    then with fingerprints (keys `fingerprint_*`), for comparison.  The
    adapters lie in one tensor registered as one region, as protect() lays
    out LoRA weights; keys `*_lora_tensors` register them a region each."""
    from concordia.regions.region import FLAT_ALIGN, position_page_bytes

    d = DECODE
    kv = {f"kv{i:02d}": runner.random_region(d["batch"] * d["kv_heads"] * max_len * d["head_dim"] * 2)
          .view(runner.xp.int16).reshape(d["batch"], d["kv_heads"], max_len, d["head_dim"])
          for i in range(d["kv_tensors"])}
    ad = {}
    for i in range(d["adapter_tensors"]):
        shape = (d["rank"], d["hidden"]) if i % 2 == 0 else (d["hidden"] * (1 + (i // 2) % 2), d["rank"])
        ad[f"lora{i:03d}"] = runner.xp.asarray(np.random.default_rng(i).standard_normal(shape, dtype=np.float32))
    flat, views = _flat_adapters(runner.xp, ad)
    # the adapters as protect() registers a PEFT model's: one region holding them all (keys without a
    # suffix), and a region each (keys `*_lora_tensors`), for comparison
    layouts = {"flat": ({**kv, "lora": flat}, views), "tensors": ({**kv, **ad}, list(ad.values()))}
    arrays = layouts["flat"][0]
    row_page = position_page_bytes(d["head_dim"] * 2)
    length = [0]  # positions holding data: the length hint of every KV tensor
    positions = {k: {"kind": "kv", "detect": "positions", "page_bytes": row_page, "length": lambda: length[0]}
                 for k in kv}
    out = {"kv_tensors": d["kv_tensors"], "adapter_tensors": d["adapter_tensors"],
           "adapter_regions": len(layouts["flat"][0]) - len(kv),
           "adapter_regions_lora_tensors": len(layouts["tensors"][0]) - len(kv),
           "adapter_layout": f"one region, each adapter at a multiple of {FLAT_ALIGN} bytes (protect()'s); "
                             "keys *_lora_tensors: a region each",
           "max_len": max_len,
           "kv_dtype": "int16 (2 bytes, bf16-sized)", "state_bytes": sum(int(a.nbytes) for a in arrays.values()),
           "kv_detector": "positions", "kv_page_bytes": row_page, "fingerprint_page_bytes": runner.pb}
    # the same caches with their length in a word beside them (a resident session's device pass reads it)
    word = runner.xp.zeros(1, runner.xp.int64)
    words = {k: {"kind": "kv", "detect": "positions", "page_bytes": row_page, "length": word} for k in kv}
    # (KV options, key prefix, adapters rewritten, key suffix, retention on, wait, executor, adapters' layout)
    runs = [(positions, "", True, "", True, True, "host", "flat"),
            (positions, "", False, "_adapters_clean", True, True, "host", "flat"),
            (positions, "", True, "_retain_off", False, True, "host", "flat"),
            (positions, "", True, "_pending", True, False, "host", "flat"),
            (words, "", True, "_resident", True, True, "resident", "flat"),
            (positions, "", True, "_lora_tensors", True, True, "host", "tensors"),
            (None, "fingerprint_", True, "", True, True, "host", "flat"),
            (None, "fingerprint_", False, "_adapters_clean", True, True, "host", "flat")]
    for options, prefix, touched, key, retain, wait, executor, layout in runs:
        regions, adapters = layouts[layout]
        start = 0 if touched else reps + 2
        length[0] = start  # the base checkpoint holds every position; new ones are written from here
        word[0] = start

        def step(i, touched=touched, start=start, adapters=adapters):
            pos = (i + start) % max_len  # past max_len: a new prompt, the length goes down
            for a in kv.values():
                a[:, :, pos, :] += 1
            length[0] = pos + 1
            word[0] = pos + 1
            if touched:   # an optimizer's step: each weight on its own
                for a in adapters:
                    a *= 0.999
        got = _session_steps(runner, regions, step, reps, staging=runner.staging, tag="d", options=options,
                             retain=retain, wait=wait, executor=executor)
        for k, v in got.items():
            out[prefix + k + key] = v
    ceil = runner.ceilings(None) or runner.ceilings(next(iter(kv.values())).reshape(-1).view(runner.xp.uint8))
    if "dirty_bytes" in out:
        out["floor_ms"] = (out["state_bytes"] / ceil["hbm_read_Bps"] + out["dirty_bytes"] / ceil["d2h_Bps"]) * 1e3
    del kv, ad, arrays, layouts, flat, views, regions, adapters, step   # (the loop's last layout's too)
    runner.free()
    return out


def _flat_adapters(xp, ad: dict):
    """(one float32 array holding every adapter of `ad` in order, the gaps
    zero; [each adapter's view of it]): the layout protect() gives a PEFT
    model's LoRA weights (`flat_layout`)."""
    from concordia.regions.region import flat_layout

    offsets, total = flat_layout([int(a.size) for a in ad.values()], 4)
    flat = xp.zeros(total, xp.float32)
    views = []
    for a, o in zip(ad.values(), offsets):
        v = flat[o:o + a.size].reshape(a.shape)
        v[...] = a
        views.append(v)
    return flat, views


# --- GPU -----------------------------------------------------------------------


class _Gpu:
    def __init__(self, page_bytes: int, reps: int):
        cp = require_cupy(GpuUnavailableError, where="bench checkpoint", hint="run with --cpu for the CPU path")
        from concordia.gpu_kernels import gpu, jit

        self.cp, self.gpu, self.jit = cp, gpu, jit
        self.pb, self.reps = page_bytes, reps
        jit.precompile(jit.page_specs(page_bytes) + [("crc32c", {})] + list(kernels.SPECS))
        props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
        self.device = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
        self.sms = int(props["multiProcessorCount"])
        self.xp = cp
        self.staging = "auto"
        self._ceil = None

    def sync(self):
        self.cp.cuda.get_current_stream().synchronize()

    def flip(self, buf, at):
        """buf[at] ^= 0xA5 (one launch)."""
        cp = self.cp
        idx = cp.asarray(at)
        buf[idx] = buf[idx] ^ cp.uint8(0xA5)

    def ceilings(self, buf) -> dict:
        """HBM read and pinned device-to-host bandwidth, and host scanning of
        `buf` (copy to pinned host, numpy compare with a host shadow), once."""
        if self._ceil is not None or buf is None:
            return self._ceil
        cp = self.cp
        from cupyx import empty_pinned

        chunk = buf[:min(buf.size, 256 * MiB)]
        pinned = empty_pinned(buf.size, np.uint8)
        stream = cp.cuda.get_current_stream()
        d2h = chunk.size / self.time(lambda: cp.cuda.runtime.memcpyAsync(pinned.ctypes.data, chunk.data.ptr,
                                                                          chunk.size, 2, stream.ptr), reps=5)
        shadow = buf.get()
        scans = []
        for _ in range(2):
            t0 = time.perf_counter()
            cp.cuda.runtime.memcpyAsync(pinned.ctypes.data, buf.data.ptr, buf.size, 2, stream.ptr)
            stream.synchronize()
            ref.shadow_diff(pinned, shadow, page_bytes=self.pb, update=False)
            scans.append(time.perf_counter() - t0)
        self._ceil = {"hbm_read_Bps": self.read_bw(buf), "d2h_Bps": d2h, "host_scan_s": min(scans),
                      "host_scan_bytes": int(buf.size)}
        del pinned, shadow
        return self._ceil

    def time(self, fn, reps=None, warm=2) -> float:
        """Median seconds of fn() between CUDA events."""
        cp = self.cp
        for _ in range(warm):
            fn()
        out = []
        for _ in range(reps or self.reps):
            a, b = cp.cuda.Event(), cp.cuda.Event()
            a.record()
            fn()
            b.record()
            b.synchronize()
            out.append(cp.cuda.get_elapsed_time(a, b) / 1e3)
        return statistics.median(out)

    def queued_ms(self, fn, spin_ms: float = 20.0):
        """(milliseconds of device work that fn() queues without waiting for
        it, fn()'s result): a spin of `spin_ms` is queued first, so that the
        host has queued all of fn's work before the device reaches it and the
        events around it time the device alone, with no gaps between launches."""
        cp = self.cp
        if getattr(self, "_spin", None) is None:
            rate_khz = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["clockRate"]
            self._spin = (self.jit.function("bandwidth", "spin_probe", {}), cp.zeros(1, cp.uint32), rate_khz)
        k, sink, rate_khz = self._spin
        k((1,), (32,), (np.int64(int(rate_khz * spin_ms)), sink))
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record()
        out = fn()
        b.record()
        b.synchronize()
        return cp.cuda.get_elapsed_time(a, b), out

    def random_region(self, nbytes: int):
        cp = self.cp
        r = cp.empty(nbytes, cp.uint8)
        step = 256 * MiB
        for lo in range(0, nbytes, step):
            n = min(step, nbytes - lo)
            r[lo:lo + n] = cp.random.random(-(-n // 4), dtype=cp.float32).view(cp.uint8)[:n]
        return r

    def free(self):
        self.cp.get_default_memory_pool().free_all_blocks()

    def read_bw(self, buf) -> float:
        cp = self.cp
        k = self.jit.function("bandwidth", "read_probe", {})
        sink = cp.zeros(1024, cp.uint32)
        n = buf.size // 16
        grid = (self.sms * 8,)
        t = self.time(lambda: k(grid, (256,), (buf, np.uint64(n), sink)))
        return n * 16 / t

    def copy_bw(self, buf) -> float:
        cp = self.cp
        dst = cp.empty_like(buf)
        t = self.time(lambda: dst.__setitem__(Ellipsis, buf))
        del dst
        return 2 * buf.size / t

    def dirty(self, region, npages: int, count: int, rng):
        cp = self.cp
        pages = np.sort(rng.choice(npages, size=count, replace=False))
        at = pages * self.pb + rng.integers(0, min(self.pb, region.size - pages.max() * self.pb), size=count)
        idx = cp.asarray(at)
        region[idx] = region[idx] ^ cp.uint8(0xA5)
        return pages

    # detect ---------------------------------------------------------------------
    def detect(self, sizes, fractions, rng) -> list[dict]:
        cp, gpu = self.cp, self.gpu
        rows = []
        for size in sizes:
            region = self.random_region(size)
            shadow = region.copy()
            read = self.read_bw(region)
            copy = self.copy_bw(region)
            npages = ref.num_pages(size, self.pb)
            flags = cp.empty(npages, cp.uint8)
            for frac in fractions:
                shadow[...] = region
                count = _dirty_count(frac, npages)
                self.dirty(region, npages, count, rng)
                # update=False keeps the dirty set for every repeat
                t = self.time(lambda: gpu.launch_shadow_diff(region, shadow, flags, page_bytes=self.pb, update=False))
                found = int(cp.count_nonzero(flags))
                bw = 2 * size / t
                rows.append({"region_bytes": size, "dirty_pages": count, "fraction": frac if frac == "page" else float(frac),
                             "found": found, "diff_s": t, "diff_read_Bps": bw, "hbm_read_Bps": read,
                             "d2d_copy_Bps": copy, "ratio_to_read": bw / read})
                assert found == count, (found, count)
            del region, shadow, flags
            self.free()
        return rows

    # stage ----------------------------------------------------------------------
    def stage(self, region_bytes, fractions, rng) -> list[dict]:
        cp, gpu = self.cp, self.gpu
        region = self.random_region(region_bytes)
        npages = ref.num_pages(region_bytes, self.pb)
        biggest = max(_dirty_count(f, npages) for f in fractions)
        cap = ref.page_batch_length(biggest, self.pb) + 4096
        host, dst = gpu.pinned_buffer(cap)
        src = cp.empty(cap, cp.uint8)
        cursor = gpu.new_cursor()
        crcs = cp.empty(biggest, cp.uint32)
        rows = []
        for frac in fractions:
            count = _dirty_count(frac, npages)
            ids = cp.asarray(np.sort(rng.choice(npages, size=count, replace=False)).astype(np.uint32))
            length = ref.page_batch_length(count, self.pb)

            def one():
                cursor.fill(0)
                gpu.stage_page_batch(region, ids, dst, cursor, page_bytes=self.pb, base_lsn=0, epoch=1,
                                     region_id=0, salt=1, crcs=crcs[:count])

            t_stage = self.time(one)
            assert int(cursor.get()[ref.CURSOR_RECORDS]) == 1
            stream = cp.cuda.get_current_stream()
            t_d2h = self.time(lambda: cp.cuda.runtime.memcpyAsync(host.ctypes.data, src.data.ptr, length, 2, stream.ptr))
            rows.append({"region_bytes": region_bytes, "dirty_pages": count,
                         "fraction": frac, "record_bytes": length, "stage_s": t_stage,
                         "stage_Bps": length / t_stage, "pinned_d2h_Bps": length / t_d2h,
                         "ratio_to_d2h": t_d2h / t_stage})
        del region, dst, src
        self.free()
        return rows

    # end to end -----------------------------------------------------------------
    def e2e(self, sizes, rng, reps) -> list[dict]:
        """Per region size: `Session.checkpoint()` of one dirty page on a shm
        log, once per flag detector (the product path, everything included),
        with the detector kernel alone timed by CUDA events; then host-side
        scanning of the same region into a log of its own."""
        cp = self.cp
        from concordia.devmem import open_backend
        from concordia.wal import Log

        rows = []
        for size in sizes:
            region = self.random_region(size)
            npages = ref.num_pages(size, self.pb)
            row = {"region_bytes": size, "dirty_pages": 1, "log": "shm"}
            for detector in E2E_DETECTORS:
                row.update(self._session_e2e(region, npages, rng, reps, detector))
                if detector != "stores":
                    row[f"detect_kernel_s_{detector}"] = self._detect_kernel(region, npages, detector)
                self.free()

            # host-side scanning of the same region
            from cupyx import empty_pinned

            log_bytes = 256 * MiB
            spec = self.scratch.log("host-scan")
            backend = open_backend(spec, size=log_bytes, create=True)
            try:
                log = Log.create(backend, size=log_bytes, segment_size=32 * MiB)
                app = log.appender
                rid = log.define_region(f"r{size}", "uint8", (size,), self.pb, "opaque")
                pinned = empty_pinned(size, np.uint8)
                hshadow = region.get()
                hcrcs = ref.crc32c_pages(hshadow, page_bytes=self.pb)
                stream = cp.cuda.get_current_stream()
                epoch = 0

                def host_checkpoint():
                    nonlocal epoch
                    epoch += 1
                    cp.cuda.runtime.memcpyAsync(pinned.ctypes.data, region.data.ptr, size, 2, stream.ptr)
                    stream.synchronize()
                    ids = ref.shadow_diff(pinned, hshadow, page_bytes=self.pb)
                    if ids.size:
                        length = ref.page_batch_length(ids.size, self.pb)
                        res = app.reserve(length)
                        cur = ref.new_cursor()
                        ref.stage_page_batch(pinned, ids, res.view, cur, page_bytes=self.pb, base_lsn=res.lsn,
                                             epoch=epoch, region_id=rid, salt=res.salt)
                        hcrcs[ids] = page_crc_table(res.view, 0, ids.size)
                        app.persist(res)
                    app.commit(epoch, digests={rid: ref.region_digest(hcrcs)})
                    return ids.size

                host_reps = 3 if size <= GiB else 2
                htimes = []
                for i in range(host_reps + 1):
                    self.dirty(region, npages, 1, rng)
                    cp.cuda.get_current_stream().synchronize()
                    t0 = time.perf_counter()
                    assert host_checkpoint() == 1
                    htimes.append(time.perf_counter() - t0)
                t_host = statistics.median(htimes[1:])
                del pinned, hshadow
                log.close()
            finally:
                backend.close()
                self.scratch.discard(spec)
            row["host_scan_checkpoint_s"] = t_host
            for detector in E2E_DETECTORS:
                t = row.get(f"gpu_checkpoint_s_{detector}")
                if t:
                    row[f"speedup_{detector}"] = t_host / t
            best = [d for d in ("fingerprint", "shadow") if row.get(f"speedup_{d}")]
            if best:  # the e2e row's detector: the one that reads the region once, when it ran
                row["detector"] = best[0]
                row["gpu_checkpoint_s"] = row[f"gpu_checkpoint_s_{best[0]}"]
                row["speedup"] = row[f"speedup_{best[0]}"]
            rows.append(row)
            del region
            self.free()
        return rows

    def _detect_kernel(self, region, npages, detector) -> float:
        """CUDA-event time of the detector kernel alone (flags and page list, no update)."""
        cp, gpu = self.cp, self.gpu
        flags = cp.empty(npages, cp.uint8)
        found = (cp.empty(32, cp.uint32), cp.zeros(1, cp.uint32))
        flat = region.reshape(-1).view(cp.uint8)
        if detector == "shadow":
            keep = flat.copy()
            fn = lambda: gpu.launch_shadow_diff(flat, keep, flags, page_bytes=self.pb, update=False,  # noqa: E731
                                                found=found)
        else:
            keep = gpu.fingerprint_pages(flat, page_bytes=self.pb)
            fn = lambda: gpu.launch_fingerprint(flat, keep, flags, page_bytes=self.pb, update=False,  # noqa: E731
                                                found=found)
        t = self.time(fn)
        del keep, flags
        return t

    def _session_e2e(self, region, npages, rng, reps, detector) -> dict:
        """One dirty page through `Session.checkpoint()` itself (routing, checks,
        statistics, commit), on a shm log of its own holding the base.  With
        `stores` the page is written by a kernel compiled under
        `instrument.enable(track_stores=True)`, which the tracker sees."""
        from concordia import instrument
        from concordia.session import Session

        cp = self.cp
        log = self.scratch.log(f"e2e-{detector}")
        seg = 64 * MiB
        # the base goes in 8 MiB records, seven to a 64 MiB segment
        need = -(-(region.nbytes * 5 // 4 + 4 * seg) // seg) * seg
        free = os.statvfs("/dev/shm")
        if free.f_bavail * free.f_frsize < need + 512 * MiB:
            return {f"session_error_{detector}": f"/dev/shm has too little space for a {need >> 20} MiB log"}
        try:
            if detector == "stores":
                instrument.disable()
                instrument.enable(track_stores=True)
                flip = cp.RawModule(code=FLIP_SRC).get_function("flip_bytes")

                def dirty():
                    page = int(rng.integers(npages))
                    at = cp.asarray([min(page * self.pb + int(rng.integers(self.pb)), region.size - 1)])
                    flip((1,), (32,), (region, at, np.int32(1)))
            else:
                def dirty():
                    self.dirty(region, npages, 1, rng)
            with Session(log, size=need, segment_size=seg, executor="host") as s:  # the caller's passes
                s.register("r", region, page_bytes=self.pb, detect=detector)
                s.checkpoint()
                times, reads, via = [], [], None
                for _ in range(reps + 2):
                    dirty()
                    cp.cuda.get_current_stream().synchronize()
                    t0 = time.perf_counter()
                    st = s.checkpoint()
                    times.append(time.perf_counter() - t0)
                    assert st.pages == {"r": 1}, st.pages
                    via = st.via["r"]
                    reads.append(st.device_reads)
            return {f"gpu_checkpoint_s_{detector}": statistics.median(times[2:]), f"via_{detector}": via,
                    f"device_reads_{detector}": max(reads[2:])}
        except Exception as exc:  # reported beside the row, the bench goes on
            return {f"session_error_{detector}": f"{type(exc).__name__}: {exc}"}
        finally:
            if detector == "stores":
                instrument.disable()
            self.scratch.discard(log)

    # kv ---------------------------------------------------------------------------
    def kv(self, cache_sizes, rng, seqs=256, new_tokens=1) -> list[dict]:
        cp, gpu = self.cp, self.gpu
        geo = dict(block_size=16, kv_heads=8, head_dim=128, dtype_bytes=2)
        layers = 8
        block_bytes = ref.kv_layout(num_blocks=1, **geo)["block"]
        rows = []
        for cache in cache_sizes:
            nb = max(256, cache // (layers * block_bytes))
            maxb = 64
            tables = cp.asarray(rng.integers(0, nb, size=(seqs, maxb)).astype(np.int32))
            lens = cp.asarray(rng.integers(new_tokens, maxb * 16 - 1, seqs).astype(np.int32))
            ckpt = lens - new_tokens
            kw = dict(num_blocks=nb, num_layers=layers, page_bytes=self.pb, **geo)
            self.jit.precompile([self.jit.kv_spec(page_bytes=self.pb, **geo)])

            def scan():
                c = ckpt.copy()
                return gpu.kv_dirty_blocks(tables, lens, c, **kw)

            t = self.time(scan)
            pages = int(scan().size)
            diff_equiv = 2 * layers * nb * block_bytes
            rows.append({"cache_bytes": layers * nb * block_bytes, "num_blocks": nb, "layers": layers,
                         "seqs": seqs, "new_tokens_per_seq": new_tokens, "dirty_pages": pages,
                         "scan_s": t, "shadow_diff_bytes_avoided": diff_equiv})
        return rows


# --- CPU -----------------------------------------------------------------------


class _Cpu:
    device = "cpu (numpy twins)"
    xp = np
    staging = "mapped"  # the table pass on the numpy twins

    def __init__(self, page_bytes: int, reps: int):
        self.pb, self.reps = page_bytes, reps
        self._ceil = None

    def sync(self):
        pass

    def free(self):
        pass

    def flip(self, buf, at):
        buf[at] ^= 0xA5

    def ceilings(self, buf) -> dict:
        """numpy's copy bandwidth stands for both ceilings; host scanning is the shadow compare."""
        if self._ceil is not None or buf is None:
            return self._ceil
        dst = np.empty_like(buf)
        copy = buf.size / self.time(lambda: np.copyto(dst, buf))
        shadow = buf.copy()
        scan = self.time(lambda: ref.shadow_diff(buf, shadow, page_bytes=self.pb, update=False))
        self._ceil = {"hbm_read_Bps": copy, "d2h_Bps": copy, "host_scan_s": scan, "host_scan_bytes": int(buf.size)}
        return self._ceil

    def time(self, fn, reps=None, warm=1) -> float:
        for _ in range(warm):
            fn()
        out = []
        for _ in range(reps or self.reps):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
        return statistics.median(out)

    def random_region(self, nbytes, rng=None):
        return (rng or np.random.default_rng(nbytes)).integers(0, 256, size=nbytes, dtype=np.uint8)

    def dirty(self, region, npages, count, rng):
        pages = np.sort(rng.choice(npages, size=count, replace=False))
        region[np.minimum(pages * self.pb + 7, region.size - 1)] ^= 0xA5
        return pages

    def detect(self, sizes, fractions, rng):
        rows = []
        for size in sizes:
            region = self.random_region(size, rng)
            shadow = region.copy()
            dst = np.empty_like(region)
            copy = 2 * size / self.time(lambda: np.copyto(dst, region))
            npages = ref.num_pages(size, self.pb)
            for frac in fractions:
                shadow[...] = region
                count = _dirty_count(frac, npages)
                self.dirty(region, npages, count, rng)
                t = self.time(lambda: ref.shadow_diff(region, shadow, page_bytes=self.pb, update=False))
                bw = 2 * size / t
                rows.append({"region_bytes": size, "dirty_pages": count, "fraction": frac, "diff_s": t,
                             "diff_read_Bps": bw, "memcpy_Bps": copy, "ratio_to_memcpy": bw / copy})
        return rows

    def stage(self, region_bytes, fractions, rng):
        region = self.random_region(region_bytes, rng)
        npages = ref.num_pages(region_bytes, self.pb)
        rows = []
        for frac in fractions:
            count = _dirty_count(frac, npages)
            ids = np.sort(rng.choice(npages, size=count, replace=False))
            length = ref.page_batch_length(count, self.pb)
            dst = np.empty(length, np.uint8)
            src = np.empty(length, np.uint8)
            t = self.time(lambda: ref.stage_page_batch(region, ids, dst, ref.new_cursor(), page_bytes=self.pb,
                                                       base_lsn=0, epoch=1, region_id=0, salt=1))
            tc = self.time(lambda: np.copyto(dst, src))
            rows.append({"region_bytes": region_bytes, "dirty_pages": count, "fraction": frac,
                         "record_bytes": length, "stage_s": t, "stage_Bps": length / t,
                         "memcpy_Bps": length / tc, "ratio_to_memcpy": tc / t})
        return rows

    def e2e(self, sizes, rng, reps):
        rows = []
        for size in sizes:
            region = self.random_region(size, rng)
            shadow = region.copy()
            npages = ref.num_pages(size, self.pb)
            dst = np.zeros(1 << 20, np.uint8)
            times = []
            for _ in range(reps):
                self.dirty(region, npages, 1, rng)
                t0 = time.perf_counter()
                ids = ref.shadow_diff(region, shadow, page_bytes=self.pb)
                ref.stage_page_batch(region, ids, dst, ref.new_cursor(), page_bytes=self.pb, base_lsn=0,
                                     epoch=1, region_id=0, salt=1)
                times.append(time.perf_counter() - t0)
                assert ids.size == 1
            rows.append({"region_bytes": size, "dirty_pages": 1, "cpu_checkpoint_s": statistics.median(times)})
        return rows

    def kv(self, cache_sizes, rng, seqs=256, new_tokens=1):
        geo = dict(block_size=16, kv_heads=8, head_dim=128, dtype_bytes=2)
        layers = 8
        block_bytes = ref.kv_layout(num_blocks=1, **geo)["block"]
        rows = []
        for cache in cache_sizes:
            nb = max(256, cache // (layers * block_bytes))
            tables = rng.integers(0, nb, size=(seqs, 64)).astype(np.int32)
            lens = rng.integers(new_tokens, 64 * 16 - 1, seqs).astype(np.int32)
            ckpt = lens - new_tokens
            t = self.time(lambda: ref.kv_dirty_blocks(tables, lens, ckpt.copy(), num_blocks=nb, num_layers=layers,
                                                      page_bytes=self.pb, **geo))
            rows.append({"cache_bytes": layers * nb * block_bytes, "num_blocks": nb, "layers": layers, "seqs": seqs,
                         "new_tokens_per_seq": new_tokens, "scan_s": t})
        return rows


# --- report ----------------------------------------------------------------------


def _summary(result: dict) -> dict:
    s = {}
    det = [r for r in result["detect"] if r.get("ratio_to_read") is not None]
    if det:
        s["shadow_diff_min_ratio_to_hbm_read"] = min(r["ratio_to_read"] for r in det)
        s["shadow_diff_goal"] = 0.85
    st = [r for r in result["stage"] if "ratio_to_d2h" in r and r["record_bytes"] >= 64 * MiB]
    if st:
        s["staging_min_ratio_to_pinned_d2h_(records>=64MiB)"] = min(r["ratio_to_d2h"] for r in st)
        s["staging_goal"] = 0.85
    e2e = [r for r in result["e2e"] if "speedup" in r]
    if e2e:
        s["e2e_min_speedup_one_page"] = min(r["speedup"] for r in e2e)
        s["e2e_goal"] = 300
        for d in E2E_DETECTORS:
            got = [r[f"speedup_{d}"] for r in e2e if f"speedup_{d}" in r]
            if got:
                s[f"e2e_min_speedup_one_page_{d}"] = min(got)
    kv = result["kv"]
    if kv:
        ts = [r["scan_s"] for r in kv]
        s["kv_scan_max_over_min"] = max(ts) / min(ts)
    return s


def _table(result: dict) -> str:
    lines = [f"device: {result['device']}  page_bytes: {result['page_bytes']}"]
    lines.append("detect (shadow diff)")
    for r in result["detect"]:
        ratio = r.get("ratio_to_read", r.get("ratio_to_memcpy"))
        lines.append(f"  {r['region_bytes'] / MiB:>8.0f} MiB  dirty {r['dirty_pages']:>9}  "
                     f"{r['diff_s'] * 1e3:9.3f} ms  {r['diff_read_Bps'] / 1e9:8.1f} GB/s  ratio {ratio:.2f}")
    lines.append("stage (records)")
    for r in result["stage"]:
        ratio = r.get("ratio_to_d2h", r.get("ratio_to_memcpy"))
        lines.append(f"  dirty {r['dirty_pages']:>9}  {r['record_bytes'] / MiB:9.2f} MiB  "
                     f"{r['stage_s'] * 1e3:9.3f} ms  {r['stage_Bps'] / 1e9:8.1f} GB/s  ratio {ratio:.2f}")
    lines.append("end to end, one dirty page")
    for r in result["e2e"]:
        if "host_scan_checkpoint_s" in r:
            for d in E2E_DETECTORS:
                if f"speedup_{d}" in r:
                    lines.append(f"  {r['region_bytes'] / MiB:>8.0f} MiB  {d:<11} gpu "
                                 f"{r[f'gpu_checkpoint_s_{d}'] * 1e3:9.3f} ms  host scan "
                                 f"{r['host_scan_checkpoint_s'] * 1e3:10.1f} ms  speedup {r[f'speedup_{d}']:8.1f}x")
                elif f"session_error_{d}" in r:
                    lines.append(f"  {r['region_bytes'] / MiB:>8.0f} MiB  {d:<11} {r[f'session_error_{d}']}")
        else:
            lines.append(f"  {r['region_bytes'] / MiB:>8.0f} MiB  cpu {r['cpu_checkpoint_s'] * 1e3:9.3f} ms")
    lines.append("kv scanner, fixed new tokens")
    for r in result["kv"]:
        lines.append(f"  cache {r['cache_bytes'] / GiB:8.1f} GiB  {r['scan_s'] * 1e6:9.1f} us")
    if result.get("regions"):
        c = result["regions_ceilings"]
        lines.append(f"regions, one dirty page each (HBM read {c['hbm_read_Bps'] / 1e9:.0f} GB/s, "
                     f"device to host {c['d2h_Bps'] / 1e9:.1f} GB/s)")
        for r in result["regions"]:
            got = f"{r['ckpt_ms']:9.3f} ms" if "ckpt_ms" in r else r.get("error", "?")
            lines.append(f"  {r['regions']:>5} x {r['region_bytes'] / MiB:9.2f} MiB  {got}  floor "
                         f"{r['floor_ms']:7.3f} ms  host scan {r['host_scan_ms']:9.1f} ms")
    d = result.get("decode_shaped")
    if d:
        nan = float("nan")
        for prefix, what in (("", f"KV by positions, {d.get('kv_page_bytes')}-byte pages"),
                             ("fingerprint_", f"KV by fingerprints, {d.get('fingerprint_page_bytes')}-byte pages")):
            lines.append(f"decode step ({d['kv_tensors']} KV + {d['adapter_tensors']} adapter tensors, "
                         f"{d['state_bytes'] / MiB:.0f} MiB, {what}): "
                         + (f"{d[prefix + 'ckpt_ms']:.3f} ms adapters updated, "
                            f"{d.get(prefix + 'ckpt_ms_adapters_clean', nan):.3f} ms adapters clean, "
                            f"{d.get(prefix + 'log_bytes', 0) / MiB:.2f} MiB logged"
                            if prefix + "ckpt_ms" in d else d.get(prefix + "error", "?")))
        for key, what in (("", "adapters updated"), ("_adapters_clean", "adapters clean"),
                          ("_retain_off", "adapters updated, retention off"),
                          ("_lora_tensors", "adapters updated, a region each")):
            if "detect_ms" + key in d:
                lines.append(f"  positions, {what}: {d['ckpt_ms' + key]:.3f} ms = detect {d['detect_ms' + key]:.3f}"
                             f" + stage {d['stage_ms' + key]:.3f} + commit {d['commit_ms' + key]:.3f}"
                             f" + other {d['other_ms' + key]:.3f} ms (medians)")
        if "ckpt_ms_pending" in d:
            lines.append(f"  positions, adapters updated, wait=False: {d['ckpt_ms_pending']:.3f} ms a call "
                         f"(pending: {d['pending_pending']}; the last epoch's finish and commit, this one's launch)")
        if "ckpt_ms_resident" in d:
            lines.append(f"  positions by length words, adapters updated, a resident session: "
                         f"{d['ckpt_ms_resident']:.3f} ms median, {d['ckpt_ms_mean_resident']:.3f} ms mean "
                         f"(via {', '.join(d['via_resident'])}; its arenas taken on at the calls that fill them)")
    for k, v in result["summary"].items():
        lines.append(f"{k}: {v:.3g}" if isinstance(v, float) else f"{k}: {v}")
    return "\n".join(lines)


def _plot(result: dict, path: str, *, replace: bool) -> None:
    """Four panels; a part that was not run (--parts) gets an empty panel
    saying so (log axes cannot be drawn without data)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(2, 2, figsize=(12, 9))
    det, st, e2e, kv = result["detect"], result["stage"], result["e2e"], result["kv"]
    titles = {(0, 0): ("shadow diff", det), (0, 1): ("staging", st), (1, 0): ("one dirty page, end to end", e2e),
              (1, 1): ("KV scanner, fixed new tokens", kv)}
    for (i, j), (title, rows) in titles.items():
        if not rows:
            ax[i, j].set_axis_off()
            ax[i, j].set_title(title)
            ax[i, j].text(0.5, 0.5, "not run (--parts)", ha="center", va="center", transform=ax[i, j].transAxes)
    if det:
        for size in sorted({r["region_bytes"] for r in det}):
            rs = [r for r in det if r["region_bytes"] == size]
            ax[0, 0].plot([r["dirty_pages"] for r in rs], [r["diff_read_Bps"] / 1e9 for r in rs], "o-",
                          label=f"{size / GiB:g} GiB")
        ceil = [r.get("hbm_read_Bps", r.get("memcpy_Bps")) for r in det]
        ax[0, 0].axhline(statistics.median(ceil) / 1e9, ls="--", c="k", label="read ceiling")
        ax[0, 0].set(xscale="log", xlabel="dirty pages", ylabel="GB/s read", title="shadow diff")
        ax[0, 0].legend(fontsize=8)
    if st:
        ax[0, 1].plot([r["record_bytes"] for r in st], [r["stage_Bps"] / 1e9 for r in st], "o-", label="staging")
        ax[0, 1].plot([r["record_bytes"] for r in st],
                      [r.get("pinned_d2h_Bps", r.get("memcpy_Bps")) / 1e9 for r in st], "s--", label="ceiling (copy)")
        ax[0, 1].set(xscale="log", xlabel="record bytes", ylabel="GB/s", title="staging")
        ax[0, 1].legend(fontsize=8)
    if e2e:
        xs = [r["region_bytes"] / GiB for r in e2e]
        if "host_scan_checkpoint_s" in e2e[0]:
            for d in E2E_DETECTORS:
                pts = [(r["region_bytes"] / GiB, r[f"gpu_checkpoint_s_{d}"] * 1e3) for r in e2e
                       if f"gpu_checkpoint_s_{d}" in r]
                if pts:
                    ax[1, 0].plot(*zip(*pts), "o-", label=f"gpu ({d})")
            ax[1, 0].plot(xs, [r["host_scan_checkpoint_s"] * 1e3 for r in e2e], "s--", label="host scan")
        else:
            ax[1, 0].plot(xs, [r["cpu_checkpoint_s"] * 1e3 for r in e2e], "o-", label="cpu")
        ax[1, 0].set(xscale="log", yscale="log", xlabel="region GiB", ylabel="ms per checkpoint",
                     title="one dirty page, end to end")
        ax[1, 0].legend(fontsize=8)
    if kv:
        ax[1, 1].plot([r["cache_bytes"] / GiB for r in kv], [r["scan_s"] * 1e6 for r in kv], "o-")
        ax[1, 1].set(xscale="log", xlabel="KV cache GiB", ylabel="us", title="KV scanner, fixed new tokens",
                     ylim=(0, None))
    fig.suptitle(f"Concordia checkpoint: {result['device']}")
    fig.tight_layout()
    save_figure(fig, path, replace=replace)  # complete or absent, like the JSON


@click.command("checkpoint")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of the table.")
@click.option("--out", type=click.Path(dir_okay=False), help="Also write the JSON to this file.")
@click.option("--plot", type=click.Path(dir_okay=False), help="Write a PNG of the four curves.")
@click.option("--quick", is_flag=True, help="Small sizes (CI smoke test).")
@click.option("--cpu", is_flag=True, help="Run the numpy twins (no GPU needed).")
@click.option("--sizes", help="Region sizes for the detect sweep, e.g. 256M,1G,4G,16G.")
@click.option("--fractions", help="Dirty fractions: 'page' (one page) and floats, e.g. page,0.01,0.5.")
@click.option("--e2e-sizes", help="Region sizes for the end-to-end comparison, e.g. 256M,1G,4G,8G.")
@click.option("--stage-region", help="Region size for the staging sweep.")
@click.option("--kv-cache-sizes", help="KV cache sizes for the scanner sweep (not allocated).")
@click.option("--regions", "region_counts", help="Region counts for the regions sweep, e.g. 1,16,64,256,1024.")
@click.option("--regions-total", help="Bytes the regions of the sweep share, e.g. 1G.")
@click.option("--decode-len", help="Max length of the decode-shaped KV tensors, e.g. 1024.")
@click.option("--page-bytes", type=int, default=4096, show_default=True)
@click.option("--reps", type=click.IntRange(min=1), default=10, show_default=True, help="Timed repeats (median).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--parts", default="detect,stage,e2e,kv,regions,decode", show_default=True,
              help="Which parts to run (the others are reported empty).")
@force_option("--out", "--plot")
@guarded
def command(as_json, out, plot, quick, cpu, sizes, fractions, e2e_sizes, stage_region, kv_cache_sizes,
            region_counts, regions_total, decode_len, page_bytes, reps, seed, parts, force):
    """Delta checkpoint: shadow diff vs device read bandwidth, staging vs
    pinned device-to-host copies, one dirty page end to end vs host-side
    scanning, the KV scanner vs cache size, checkpoints of 1 to 1,024
    regions, and one decode step of a model's state.  Needs a CUDA device
    unless --cpu.

    Example:

    \b
        concordia-wal bench checkpoint --json --out checkpoint.json --plot checkpoint.png
    """
    check_outputs(force, out, plot)  # before the run: a long benchmark is not refused at its end
    ref.check_page_bytes(page_bytes)
    preset = (CPU_QUICK if quick else CPU_DEFAULT) if cpu else (QUICK if quick else DEFAULT)
    opt = {"sizes": sizes, "fractions": fractions, "e2e_sizes": e2e_sizes, "stage_region": stage_region,
           "kv_cache_sizes": kv_cache_sizes, "regions_total": regions_total}
    cfg = {k: (v or preset[k]) for k, v in opt.items()}
    cfg["regions"] = region_counts or preset["regions"]
    cfg["decode_len"] = decode_len or preset["decode_len"]
    # every option is checked before any device work starts
    fr = _fractions(cfg["fractions"])
    swept = {k: _sizes(cfg[k], "--" + k.replace("_", "-")) for k in opt if k != "fractions"}
    counts = _counts(cfg["regions"], "--regions")
    max_len = _counts(cfg["decode_len"], "--decode-len")[0]
    want = {p.strip() for p in parts.split(",") if p.strip()}
    names = ("detect", "stage", "e2e", "kv", "regions", "decode")
    unknown = want - set(names)
    if unknown:
        raise click.BadParameter(f"unknown part {sorted(unknown)[0]!r} (use {', '.join(names)})",
                                 param_hint="--parts")
    rng = np.random.default_rng(seed)
    runner = _Cpu(page_bytes, reps) if cpu else _Gpu(page_bytes, reps)
    runner.scratch = Scratch("checkpoint")
    with runner.scratch:  # the parts' own logs, gone however the run ends
        result = _run(runner, cfg, want, swept, fr, counts, max_len, rng, reps, page_bytes, cpu)
    report(result, as_json=as_json, out=out, table=_table, force=force)
    if plot:  # after the JSON is out: a machine without matplotlib still keeps the figures
        _plot(result, plot, replace=force)


def _run(runner, cfg, want, swept, fr, counts, max_len, rng, reps, page_bytes, cpu) -> dict:
    result = {"bench": "checkpoint", "device": runner.device, "page_bytes": page_bytes, "reps": reps,
              "config": cfg, "cpu": bool(cpu), "parts": sorted(want),
              "measured_through": MEASURED_THROUGH}
    result["detect"] = runner.detect(swept["sizes"], fr, rng) if "detect" in want else []
    result["stage"] = runner.stage(swept["stage_region"][0], fr, rng) if "stage" in want else []
    result["e2e"] = runner.e2e(swept["e2e_sizes"], rng, max(3, reps)) if "e2e" in want else []
    result["kv"] = runner.kv(swept["kv_cache_sizes"], rng) if "kv" in want else []
    result["regions"], result["regions_ceilings"] = (
        _regions_part(runner, counts, swept["regions_total"][0], rng, max(3, reps)) if "regions" in want else ([], {}))
    result["decode_shaped"] = _decode_part(runner, max_len, rng, max(3, reps)) if "decode" in want else {}
    result["summary"] = _summary(result)
    return result
