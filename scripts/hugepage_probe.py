"""What it costs a fresh process to make a shm log readable by the copy engine,
and whether huge pages or populating the mapping first change it (issue 9: a
recovering process either copies the log into pinned buffers on host threads,
22-28 GB/s on the H200 machine, or pins the mapping, ~7 GB/s fresh).
Usage: python3 scripts/hugepage_probe.py OUT.json   (see scripts/gpu/hugepage_probe.sh)

Cases, each in a child process that maps the file as a recovering process would
(read-only, nothing touched yet):
  plain        register the whole mapping, then copy it to the device
  populate-N   MADV_POPULATE_READ on N threads first, then register
  huge         the same file written through a MADV_HUGEPAGE mapping (shmem
               THP, where the kernel allows it), mapped with MADV_HUGEPAGE
  overlap      host threads preadv half the file into pinned buffers while the
               main thread registers the other half: do the two add up?
"""

from __future__ import annotations

import json
import mmap
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

SIZE = 4 << 30
PORTABLE, MAPPED, READ_ONLY = 0x01, 0x02, 0x08
MADV_POPULATE_READ = 22


def read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError as exc:
        return f"unreadable: {exc}"


def meminfo(*keys: str) -> dict:
    out = {}
    for line in read("/proc/meminfo").splitlines():
        k, _, v = line.partition(":")
        if k in keys:
            out[k] = v.strip()
    return out


def system() -> dict:
    mounts = [ln for ln in read("/proc/mounts").splitlines() if " /dev/shm " in ln]
    return {
        "kernel": os.uname().release,
        "cpus": os.cpu_count(),
        "thp_enabled": read("/sys/kernel/mm/transparent_hugepage/enabled"),
        "thp_shmem_enabled": read("/sys/kernel/mm/transparent_hugepage/shmem_enabled"),
        "thp_defrag": read("/sys/kernel/mm/transparent_hugepage/defrag"),
        "dev_shm_mount": mounts,
        "meminfo": meminfo("MemTotal", "MemFree", "Shmem", "ShmemHugePages", "ShmemPmdMapped",
                           "HugePages_Total", "HugePages_Free", "Hugepagesize", "AnonHugePages"),
    }


def write_file(path: str, huge: bool) -> dict:
    with open(path, "wb") as f:
        f.truncate(SIZE)
    fd = os.open(path, os.O_RDWR)
    m = mmap.mmap(fd, SIZE)
    os.close(fd)
    advised = None
    if huge:
        try:
            m.madvise(mmap.MADV_HUGEPAGE)
            advised = True
        except (OSError, AttributeError) as exc:
            advised = f"{type(exc).__name__}: {exc}"
    before = meminfo("ShmemHugePages")
    t0 = time.perf_counter()
    step = 1 << 21
    blob = bytes(range(256)) * (step // 256)
    for lo in range(0, SIZE, step):
        m[lo:lo + step] = blob
    write_s = time.perf_counter() - t0
    after = meminfo("ShmemHugePages")
    m.close()
    return {"write_s": write_s, "madvise_hugepage": advised, "shmem_huge_before": before, "shmem_huge_after": after}


def child(path: str, case: str) -> dict:
    import cupy as cp
    import numpy as np

    rt = cp.cuda.runtime
    dev = cp.empty(SIZE, cp.uint8)
    cp.cuda.Device().synchronize()
    fd = os.open(path, os.O_RDONLY)
    m = mmap.mmap(fd, SIZE, prot=mmap.PROT_READ)
    row: dict = {"case": case}
    if case == "huge":
        try:
            m.madvise(mmap.MADV_HUGEPAGE)
        except OSError as exc:
            row["madvise_error"] = str(exc)
    a = np.frombuffer(m, np.uint8)
    addr = a.ctypes.data
    flags = PORTABLE | MAPPED | READ_ONLY
    if case.startswith("populate"):
        n = int(case.split("-")[1])
        piece = SIZE // n
        t0 = time.perf_counter()

        def populate(k):
            m.madvise(MADV_POPULATE_READ, k * piece, piece)

        with ThreadPoolExecutor(n) as pool:
            list(pool.map(populate, range(n)))
        row["populate_s"] = time.perf_counter() - t0
    if case == "overlap":
        half = SIZE // 2
        bufs = [cp.cuda.alloc_pinned_memory(32 << 20) for _ in range(12)]

        def fill(k):
            view = np.frombuffer(bufs[k % 12], np.uint8, 32 << 20)
            done = 0
            lo = half + k * (half // 12)
            while done < half // 12:
                n = min(32 << 20, half // 12 - done)
                got = os.preadv(fd, [memoryview(view)[:n]], lo + done)
                done += got
            return done, time.perf_counter()

        t0 = time.perf_counter()
        with ThreadPoolExecutor(12) as pool:
            futs = [pool.submit(fill, k) for k in range(12)]
            t1 = time.perf_counter()
            rt.hostRegister(addr, half, flags)
            row["register_half_s"] = time.perf_counter() - t1
            row["register_half_GBps"] = half / row["register_half_s"] / 1e9
            ends = [f.result() for f in futs]
        got = sum(n for n, _ in ends)
        row["fill_half_s"] = max(end for _, end in ends) - t0   # the fills' own finish, not the register's
        row["fill_half_GBps"] = got / row["fill_half_s"] / 1e9
        row["both_s"] = time.perf_counter() - t0
        row["both_GBps"] = SIZE / row["both_s"] / 1e9
        t0 = time.perf_counter()
        with ThreadPoolExecutor(12) as pool:
            alone = sum(n for n, _ in pool.map(fill, range(12)))
        row["fill_alone_GBps"] = alone / (time.perf_counter() - t0) / 1e9
        rt.hostUnregister(addr)
    else:
        t0 = time.perf_counter()
        rt.hostRegister(addr, SIZE, flags)
        row["register_s"] = time.perf_counter() - t0
        s = cp.cuda.Stream(non_blocking=True)
        t0 = time.perf_counter()
        for lo in range(0, SIZE, 32 << 20):
            rt.memcpyAsync(dev.data.ptr + lo, addr + lo, 32 << 20, rt.memcpyDefault, s.ptr)
        s.synchronize()
        row["copy_GBps"] = SIZE / (time.perf_counter() - t0) / 1e9
        t0 = time.perf_counter()
        rt.hostUnregister(addr)
        row["unregister_s"] = time.perf_counter() - t0
        row["make_readable_GBps"] = SIZE / (row["register_s"] + row.get("populate_s", 0.0)) / 1e9
    row["shmem_pmd_mapped"] = meminfo("ShmemPmdMapped")
    del a
    m.close()
    os.close(fd)
    return row


def main(out: str) -> None:
    doc = {"size": SIZE, "system": system(), "rows": []}
    print(json.dumps(doc["system"]), flush=True)
    plain = f"/dev/shm/concordia-hp-probe-{os.getpid()}"
    huge = plain + "-huge"
    try:
        doc["write_plain"] = write_file(plain, huge=False)
        for case in ("plain", "populate-1", "populate-8", "overlap"):
            doc["rows"].append(run_child(plain, case))
        os.unlink(plain)
        doc["write_huge"] = write_file(huge, huge=True)
        print(json.dumps(doc["write_huge"]), flush=True)
        for case in ("huge", "populate-8"):
            r = run_child(huge, case)
            r["file"] = "written with MADV_HUGEPAGE"
            doc["rows"].append(r)
    finally:
        for p in (plain, huge):
            if os.path.exists(p):
                os.unlink(p)
    with open(out, "w") as f:
        json.dump(doc, f, indent=1)


def run_child(path: str, case: str) -> dict:
    p = subprocess.run([sys.executable, __file__, "--child", path, case], capture_output=True, text=True,
                       timeout=120)
    try:
        row = json.loads(p.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        row = {"case": case, "error": (p.stderr or p.stdout)[-600:]}
    print(json.dumps(row), flush=True)
    return row


if __name__ == "__main__":
    if sys.argv[1] == "--child":
        print(json.dumps(child(sys.argv[2], sys.argv[3])))
    else:
        main(sys.argv[1])
