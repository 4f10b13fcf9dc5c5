"""The numpy twins behind the extent pipeline (`_HostKernels`): the same calls
as `device._DeviceKernels`, on numpy arrays, results ready at once."""

from __future__ import annotations

import numpy as np

from concordia.gpu_kernels import reference as ref
from concordia.regions import Region, to_host


class _HostKernels:
    """The numpy twins behind the same pipeline (numpy regions with staging=
    "mapped" or "ring"): "device" arrays are numpy arrays and results are ready
    at once."""

    name = "cpu"
    xp = np
    failed = None

    def __init__(self):
        self.reads = 0

    def prepare(self, r: Region) -> bool:
        return True

    def detect(self, regions, known=None) -> list:
        out = []
        for r in regions:
            ids = r.dirty_pages(advance=True)
            out.append((ids, int(ids.size)))
        return out

    def empty_u32(self, n):
        return np.empty(n, np.uint32)

    def zeros_u32(self, n):
        return np.zeros(n, np.uint32)

    def cursors(self, n):
        return np.zeros((n, 4), np.uint64)

    def table(self, crcs):
        return to_host(crcs)

    def stage(self, r: Region, ids, dst, cursor, crcs, **kw) -> None:
        off = int(cursor[ref.CURSOR_USED])
        ref.stage_page_batch(r.flat, ids, dst, cursor, page_bytes=r.page_bytes, **kw)
        if int(cursor[ref.CURSOR_USED]) != off:  # written, not refused: its CRC table
            n = int(ids.size)
            crcs[:] = dst[off + 64 + 4 * n:off + 64 + 8 * n].view("<u4")

    def mapped_view(self, registration, ext):
        return ext.view

    def staging_buffer(self, nbytes: int):
        buf = np.zeros(nbytes, np.uint8)
        return buf, buf

    def update(self, table, ids, crcs) -> None:
        table[ids] = crcs

    def digest_into(self, table, out) -> None:
        out[0] = ref.region_digest(table)

    def fetch(self, slot: int, arrays: list):
        return [np.array(a) for a in arrays]

    def wait(self, handle) -> list:
        return handle

    def sync(self) -> None:
        pass
