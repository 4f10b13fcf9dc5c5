"""BASE records written by the page kernels (`BaseStager`): retention's slices
of a base image, read by the device from the job's pinned host copy and
written with their page CRCs straight into the log mapping, so that the host
neither copies nor hashes them.  The records are the ones the host path
writes (`wal.snapshot._append_base_batch`), byte for byte: the same staging
kernel as a checkpoint's page batches (`gpu_kernels/stage.cu`, its numpy twin
`reference.stage_page_batch` on the host kernels), with the BASE flag.

The device works on a stream of its own: the image is a host copy no step
writes, and the log's reservation is this writer's alone, so nothing orders
it against the producers, and waiting for it never waits for their step."""

from __future__ import annotations

import contextlib
import dataclasses

import numpy as np

from concordia.gpu_kernels import reference as ref
from concordia.wal import format as F


@dataclasses.dataclass
class _Image:
    """What the kernels' `stage` reads: the image as flat bytes, its page size."""

    flat: object
    page_bytes: int


class BaseStager:
    """Writes one BASE page batch of a region's image into a log reservation
    with `kernels` (`DeviceKernels` with the log's CUDA `registration`, or the
    numpy `HostKernels`).  `write` says whether it wrote the record (checked
    as a reader checks it); when it did not, the caller writes it on the
    host.  After any failure it says why in `error` and writes nothing more."""

    def __init__(self, kernels, registration=None):
        self.k = kernels
        self.registration = registration
        self.error: str | None = None
        self.records = 0
        self._stream = None

    def writer(self, image):
        """The `stage` callable of `wal.compaction.Compaction` for one region
        whose image is `image` (device-readable flat bytes: pinned host
        memory seen by the device, or a numpy array for the host kernels)."""
        return lambda res, info, epoch, lo, hi: self.write(res, image, info, epoch, lo, hi)

    def write(self, res, image, info, epoch: int, lo: int, hi: int) -> bool:
        if self.error is not None:
            return False
        k = self.k
        try:
            with self._own_stream():
                dst = k.mapped_view(self.registration, res)
                cursor = k.cursors(1)[0]
                ids = k.xp.arange(lo, hi, dtype=k.xp.uint32)
                k.stage(_Image(image, info.page_bytes), ids, dst, cursor, k.empty_u32(hi - lo), base_lsn=res.lsn,
                        epoch=int(epoch), region_id=int(info.id), salt=int(res.salt), flags=F.FLAG_BASE)
                cursor = self._read(cursor)
        except Exception as exc:  # the host writes this record and every later one
            self.error = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
            return False
        self.error = self._check(res, cursor, info, epoch, lo, hi)
        if self.error is not None:
            return False
        self.records += 1
        return True

    @contextlib.contextmanager
    def _own_stream(self):
        cp = getattr(self.k, "cp", None)
        if cp is None:
            yield
            return
        if self._stream is None:
            self._stream = cp.cuda.Stream(non_blocking=True)
        with self._stream:
            yield

    def _read(self, cursor) -> np.ndarray:
        if self.k.xp is np:
            return cursor
        out = self.k.cp.asnumpy(cursor, stream=self._stream)
        self._stream.synchronize()
        return out

    @staticmethod
    def _check(res, cursor, info, epoch: int, lo: int, hi: int) -> str | None:
        """Why the record in `res` is not the one asked for (pages [lo, hi) of
        region `info` at `epoch`, whole, as the reader checks a page batch,
        its payload aside: the page CRCs are the kernel's), or None."""
        where = f"the staged BASE record of region {info.name!r}"
        if int(cursor[ref.CURSOR_REFUSED]) or int(cursor[ref.CURSOR_USED]) != res.length:
            return (f"{where} took {int(cursor[ref.CURSOR_USED])} bytes of {res.length} "
                    f"({int(cursor[ref.CURSOR_REFUSED])} refused)")
        problem = F.check_record_header_bytes(res.view)
        if problem is not None:
            return f"{where}: {problem}"
        h = F.decode_record_header(res.view, check=False)
        want = (res.length, F.REC_PAGE_BATCH, res.lsn, int(epoch), int(info.id), hi - lo, info.page_bytes,
                F.FLAG_BASE)
        got = (h.length, h.type, h.lsn, h.epoch, h.region_id, h.count, h.page_bytes, h.flags)
        if got != want:
            return f"{where} has header {got}, not {want}"
        problem = F.page_batch_problem(res.view, h, check_pages=False)
        if problem is not None:
            return f"{where}: {problem[0]}"
        ids = res.view[F.page_batch_index_offset(hi - lo):][:4 * (hi - lo)].view("<u4")
        if int(ids[0]) != lo or int(ids[-1]) != hi - 1:  # strictly increasing (checked): lo..hi-1 exactly
            return f"{where} lists pages {int(ids[0])}..{int(ids[-1])}, not {lo}..{hi - 1}"
        return None
