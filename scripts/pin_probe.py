"""Host-to-device copy rates from a shm mapping pinned in different ways (see
scripts/gpu/pin_probe.sh).  Usage: python3 scripts/pin_probe.py OUT.json"""

from __future__ import annotations

import json
import mmap
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import cupy as cp
import numpy as np

SIZE = 4 << 30
PIECE = 64 << 20
PORTABLE, MAPPED, READ_ONLY = 0x01, 0x02, 0x08
rt = cp.cuda.runtime


def mapping(writable: bool):
    fd = os.open(PATH, os.O_RDWR if writable else os.O_RDONLY)
    m = mmap.mmap(fd, SIZE, prot=mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0))
    os.close(fd)
    a = np.frombuffer(m, np.uint8)
    return m, a, a.ctypes.data


def pin(addr: int, pieces: list, flags: int, threads: int) -> float:
    t0 = time.perf_counter()

    def one(lo_n):
        cp.cuda.Device(0).use()
        rt.hostRegister(addr + lo_n[0], lo_n[1], flags)

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, pieces))
    return time.perf_counter() - t0


def unpin(addr: int, pieces: list) -> float:
    t0 = time.perf_counter()
    for lo, _ in pieces:
        rt.hostUnregister(addr + lo)
    return time.perf_counter() - t0


def copy_rate(addr: int, dev, piece: int) -> float:
    s = cp.cuda.Stream(non_blocking=True)
    best = 1e9
    for _ in range(2):
        t0 = time.perf_counter()
        for lo in range(0, SIZE, piece):
            n = min(piece, SIZE - lo)
            rt.memcpyAsync(dev.data.ptr + lo, addr + lo, n, rt.memcpyDefault, s.ptr)
        s.synchronize()
        best = min(best, time.perf_counter() - t0)
    return SIZE / best / 1e9


def main(out: str) -> None:
    global PATH
    PATH = f"/dev/shm/concordia-pin-probe-{os.getpid()}"
    with open(PATH, "wb") as f:
        f.truncate(SIZE)
    m, a, addr = mapping(True)
    a[:] = 1
    dev = cp.empty(SIZE, cp.uint8)
    rows = []
    cases = [
        ("whole, 1 GiB pieces, 1 thread, rw, portable|mapped", True, 1 << 30, PORTABLE | MAPPED, 1),
        ("64 MiB pieces, 8 threads, rw, portable|mapped", True, PIECE, PORTABLE | MAPPED, 8),
        ("64 MiB pieces, 1 thread, rw, portable|mapped", True, PIECE, PORTABLE | MAPPED, 1),
        ("64 MiB pieces, 8 threads, ro, portable|mapped|read-only", False, PIECE, PORTABLE | MAPPED | READ_ONLY, 8),
        ("whole, 1 GiB pieces, 1 thread, ro, portable|mapped|read-only", False, 1 << 30,
         PORTABLE | MAPPED | READ_ONLY, 1),
    ]
    try:
        for name, writable, piece, flags, threads in cases:
            mm, aa, ad = (m, a, addr) if writable else mapping(False)
            pieces = [(lo, min(piece, SIZE - lo)) for lo in range(0, SIZE, piece)]
            row = {"case": name}
            try:
                row["pin_s"] = pin(ad, pieces, flags, threads)
                row["copy_GBps_per_piece_copies"] = copy_rate(ad, dev, piece)
                row["copy_GBps_32MiB_copies"] = copy_rate(ad, dev, 32 << 20)
                row["unpin_s"] = unpin(ad, pieces)
            except Exception as exc:
                row["error"] = f"{type(exc).__name__}: {exc}"
            rows.append(row)
            print(json.dumps(row), flush=True)
        host = cp.cuda.alloc_pinned_memory(1 << 30)
        ha = np.frombuffer(host, np.uint8, 1 << 30)
        ha[:] = 1
        s = cp.cuda.Stream(non_blocking=True)
        t0 = time.perf_counter()
        for _ in range(4):
            rt.memcpyAsync(dev.data.ptr, ha.ctypes.data, 1 << 30, rt.memcpyHostToDevice, s.ptr)
        s.synchronize()
        rows.append({"case": "cudaHostAlloc buffer (ceiling)", "copy_GBps": 4 * (1 << 30) / (time.perf_counter() - t0) / 1e9})
        print(json.dumps(rows[-1]), flush=True)
    finally:
        os.unlink(PATH)
    with open(out, "w") as f:
        json.dump({"size": SIZE, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
