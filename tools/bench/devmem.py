"""`concordia-wal bench devmem`: sequential write + persist bandwidth of each
memory tier, as a ratio to a raw memcpy into anonymous memory measured in the
same run (the ceiling no tier can beat on this host).

Each pass copies `chunk`-sized blocks from a source buffer into the tier's
mapping and persists each block before the next, as the WAL appender does.
Every target (the ceiling included) is written once untimed first, so page
faults are not measured; the best of `--repeat` timed passes is reported.
"""

from __future__ import annotations

import mmap
import os
import time

import click
import numpy as np

from concordia.devmem import libpmem, open_backend

from ..common import BYTES, SIZE, check_outputs, guarded, report
from .files import SHM_DIR, Scratch, force_option

TIERS = ("memory", "shm", "file", "pmem", "pmem-nolibpmem", "devdax-emulated", "pinned")


def _passes(dst: np.ndarray, src: np.ndarray, chunk: int, persist, repeat: int) -> float:
    """Best seconds over `repeat` timed passes of chunked copy (+ persist)."""
    n = len(dst)

    def one():
        for off in range(0, n, chunk):
            end = min(n, off + chunk)
            np.copyto(dst[off:end], src[off:end])
            if persist is not None:
                persist(off, end - off)

    one()                                     # fault every page in, untimed
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        one()
        best = min(best, time.perf_counter() - t0)
    return best


def _ceiling(size: int, src: np.ndarray, chunk: int, repeat: int) -> float:
    mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        dst = np.frombuffer(mm, dtype=np.uint8)
        secs = _passes(dst, src, chunk, None, repeat)
        del dst
    finally:
        mm.close()
    return secs


def _open(tier: str, scratch: Scratch, workdir: str | None, size: int):
    """(backend, path of its file or None), or (None, reason) when the tier is
    not here.  Files go in `scratch`'s folders (in /dev/shm for shm, in
    `workdir`, default the temporary folder, for the others)."""
    if tier == "memory":
        return open_backend("memory:", size=size), None
    if tier == "shm":
        path = scratch.path("shm", SHM_DIR)
        return open_backend(f"shm:{path}", size=size, create=True), path
    if tier == "file":
        path = scratch.path("file.log", workdir)
        return open_backend(f"file:{path}", size=size, create=True), path
    if tier in ("pmem", "pmem-nolibpmem"):
        mode = "off" if tier == "pmem-nolibpmem" else "require"
        if mode == "require" and not libpmem.available():
            return None, "libpmem not installed"
        path = scratch.path(f"{tier}.log", workdir)
        return open_backend(f"pmem:{path}", size=size, create=True, libpmem=mode), path
    if tier == "devdax-emulated":
        from concordia.devmem.devdax import DevDaxBackend

        align = 2 << 20
        if size % align:
            return None, f"size not a multiple of {align}"
        path = scratch.path("dax-standin", workdir)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.fchmod(fd, 0o600)
            os.ftruncate(fd, size)
        finally:
            os.close(fd)
        return DevDaxBackend.emulate(path, alignment=align), path
    if tier == "pinned":
        from concordia.devmem.errors import CudaUnavailableError

        try:
            return open_backend("pinned:", size=size), None
        except CudaUnavailableError as exc:
            return None, exc.message
    raise click.BadParameter(f"unknown tier {tier!r}")


def run(size: int, chunk: int, repeat: int, tiers, workdir: str | None, scratch: Scratch) -> dict:
    """Measure; returns the JSON document."""
    src = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8)
    ceiling_s = _ceiling(size, src, chunk, repeat)
    ceiling = size / ceiling_s / 1e9
    rows, skipped = [], {}
    for tier in tiers:
        backend, extra = _open(tier, scratch, workdir, size)
        if backend is None:
            skipped[tier] = extra
            continue
        try:
            secs = _passes(backend.array, src, chunk, backend.persist, repeat)
            gbps = size / secs / 1e9
            rows.append({"tier": tier, "kind": backend.kind, "persist_path": backend.persist_path,
                         "is_pmem": backend.is_pmem, "survives": backend.survives.name.lower(),
                         "gb_per_s": round(gbps, 3), "ratio_to_memcpy": round(gbps / ceiling, 4)})
        finally:
            backend.close()
            if extra:
                scratch.discard(extra)  # the space back before the next tier
    return {
        "benchmark": "devmem",
        "what": "sequential write + persist per chunk, best of repeat passes, warm mapping",
        "size": size, "chunk": chunk, "repeat": repeat, "libpmem": libpmem.available(),
        "ceiling": {"what": "memcpy into anonymous memory, same chunks, no persist",
                    "gb_per_s": round(ceiling, 3)},
        "results": rows, "skipped": skipped,
    }


def _table(doc: dict) -> str:
    lines = [f"devmem: {doc['size'] >> 20} MiB in {doc['chunk'] >> 10} KiB chunks, "
             f"best of {doc['repeat']}; ceiling memcpy {doc['ceiling']['gb_per_s']:.2f} GB/s",
             f"{'tier':<18}{'persist':<9}{'survives':<15}{'GB/s':>8}{'ratio':>8}"]
    for r in doc["results"]:
        lines.append(f"{r['tier']:<18}{r['persist_path']:<9}{r['survives']:<15}"
                     f"{r['gb_per_s']:>8.2f}{r['ratio_to_memcpy']:>8.3f}")
    for tier, why in doc["skipped"].items():
        lines.append(f"{tier:<18}skipped: {why}")
    return "\n".join(lines)


@click.command("devmem")
@click.option("--size", type=BYTES, default="256M", show_default=True, help="bytes written per pass")
@click.option("--chunk", type=SIZE, default="1M", show_default=True, help="bytes per persist")
@click.option("--repeat", type=click.IntRange(min=1), default=3, show_default=True, help="timed passes (best kept)")
@click.option("--tier", "tiers", multiple=True, type=click.Choice(TIERS),
              help="tiers to measure (default: all that exist here)")
@click.option("--dir", "workdir", type=click.Path(file_okay=False), default=None,
              help="where file and pmem logs go, in a folder of the run's own (default: the temporary folder)")
@click.option("--quick", is_flag=True, help="16 MiB, one timed pass (CI smoke run)")
@click.option("--json", "as_json", is_flag=True, help="print JSON instead of the table")
@click.option("--out", type=click.Path(dir_okay=False), default=None, help="also write JSON here")
@force_option("--out")
@guarded
def command(size, chunk, repeat, tiers, workdir, quick, as_json, out, force):
    """Write + persist bandwidth of every memory tier beside raw memcpy.

    Example:

    \b
        concordia-wal bench devmem --quick
        concordia-wal bench devmem --size 1G --tier shm --tier pmem --json
    """
    check_outputs(force, out)  # before the run: a long benchmark is not refused at its end
    if quick:
        size, repeat = 16 << 20, 1
    size -= size % 4096                       # whole pages: every tier maps pages
    if size <= 0 or chunk <= 0 or repeat < 1:
        raise click.BadParameter("size (at least one 4 KiB page), chunk and repeat must be positive")
    if workdir is not None and not os.path.isdir(workdir):
        raise click.BadParameter(f"{workdir}: no such folder", param_hint="--dir")
    with Scratch("devmem") as scratch:  # every file of the run goes, however it ends
        doc = run(size, chunk, repeat, tiers or TIERS, workdir, scratch)
    report(doc, as_json=as_json, out=out, table=_table, force=force)
