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
    numpy `HostKernels`).  `write` returns the record's page CRCs, or None
    when it did not write it (the caller writes it on the host); after any
    failure it says why in `error` and writes nothing more."""

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

    def write(self, res, image, info, epoch: int, lo: int, hi: int):
        if self.error is not None:
            return None
        k, count = self.k, hi - lo
        try:
            with self._own_stream():
                dst = k.mapped_view(self.registration, res)
                cursor = k.cursors(1)[0]
                crcs = k.empty_u32(count)
                ids = k.xp.arange(lo, hi, dtype=k.xp.uint32)
                k.stage(_Image(image, info.page_bytes), ids, dst, cursor, crcs, base_lsn=res.lsn, epoch=int(epoch),
                        region_id=int(info.id), salt=int(res.salt), flags=F.FLAG_BASE)
                cursor, crcs = self._read(cursor, crcs)
        except Exception as exc:  # the host writes this record and every later one
            self.error = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
            return None
        why = self._check(res, cursor, info, epoch, count)
        if why is not None:
            self.error = why
            return None
        self.records += 1
        return crcs

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

    def _read(self, cursor, crcs):
        if self.k.xp is np:
            return np.asarray(cursor), np.asarray(crcs, np.uint32)
        out = self.k.cp.asnumpy(cursor, stream=self._stream), self.k.cp.asnumpy(crcs, stream=self._stream)
        self._stream.synchronize()
        return out

    @staticmethod
    def _check(res, cursor, info, epoch: int, count: int) -> str | None:
        """Why the record in `res` is not the one asked for, or None."""
        if int(cursor[ref.CURSOR_REFUSED]) or int(cursor[ref.CURSOR_USED]) != res.length:
            return (f"the staged BASE record of region {info.name!r} took {int(cursor[ref.CURSOR_USED])} bytes "
                    f"of {res.length} ({int(cursor[ref.CURSOR_REFUSED])} refused)")
        problem = F.check_record_header_bytes(res.view)
        if problem is not None:
            return f"the staged BASE record of region {info.name!r}: {problem}"
        h = F.decode_record_header(res.view, check=False)
        want = (res.length, F.REC_PAGE_BATCH, res.lsn, int(epoch), int(info.id), count, info.page_bytes,
                F.FLAG_BASE)
        got = (h.length, h.type, h.lsn, h.epoch, h.region_id, h.count, h.page_bytes, h.flags)
        if got != want:
            return f"the staged BASE record of region {info.name!r} has header {got}, not {want}"
        return None
