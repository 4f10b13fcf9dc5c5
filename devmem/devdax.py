"""Device DAX: `/dev/daxX.Y` character devices (CXL memory, NVDIMM namespaces
in devdax mode), mapped whole (MAP_SHARED) through libpmem with length 0.

Size and alignment come from sysfs (`/sys/dev/char/M:m/size`, `.../device/align`
or `.../device/dax_region/align`); a mapping length must be a multiple of the
alignment.  Without libpmem the device is mapped with mmap; there is then no
user-space cache flush, so persisted bytes are claimed to outlive a host crash
(caches are written back), not a power loss (that needs eADR or libpmem).

Where no device exists (CI), `DevDaxBackend.emulate(path, alignment=...)` lets a
regular file stand in for one: the file's length is the device size and the
alignment is given; everything else runs the same code.
"""

from __future__ import annotations

import os
import stat

from . import libpmem as _libpmem
from .backend import Survives, os_error
from .errors import BadSizeError, NotADaxDeviceError, PathNotFoundError
from .tiers import MappedBackend, MmapMapping, PmemMapping, check_existing, check_size

__all__ = ["DevDaxBackend", "DaxGeometry", "read_dax_geometry", "SYSFS"]

SYSFS = "/sys"


class DaxGeometry(tuple):
    """(size, alignment) of a device-DAX instance."""

    __slots__ = ()

    def __new__(cls, size: int, alignment: int):
        return super().__new__(cls, (int(size), int(alignment)))

    size = property(lambda self: self[0])
    alignment = property(lambda self: self[1])


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            return int(f.read().strip(), 0)
    except (OSError, ValueError):
        return None


def read_dax_geometry(rdev: int, where: str, sysfs: str = SYSFS) -> DaxGeometry:
    """Size and alignment of the character device `rdev` from sysfs; raises
    NotADaxDeviceError when the device does not belong to the dax subsystem."""
    base = os.path.join(sysfs, "dev", "char", f"{os.major(rdev)}:{os.minor(rdev)}")
    subsystem = os.path.basename(os.path.realpath(os.path.join(base, "subsystem")))
    if subsystem != "dax":
        raise NotADaxDeviceError(f"character device {os.major(rdev)}:{os.minor(rdev)} belongs to "
                                 f"{subsystem or 'no subsystem'!r}, not dax", where=where,
                                 hint="name a /dev/daxX.Y device, or use pmem:/file: for files")
    size = next((v for v in (_read_int(os.path.join(base, "size")),
                             _read_int(os.path.join(base, "device", "size"))) if v), None)
    align = next((v for v in (_read_int(os.path.join(base, "align")),
                              _read_int(os.path.join(base, "device", "align")),
                              _read_int(os.path.join(base, "device", "dax_region", "align")))
                  if v), None)
    if not size or not align:
        raise NotADaxDeviceError("sysfs gives no size or alignment for this device", where=where,
                                 hint=f"check {base}")
    return DaxGeometry(size, align)


class DevDaxBackend(MappedBackend):
    """A whole device-DAX instance.  Survives power loss when persisted through
    libpmem; GPU-mappable (register in chunks, see cuda_host)."""

    kind = "devdax"
    gpu_mappable = True

    def __init__(self, path: str, mapping, size: int, geometry: DaxGeometry, readonly: bool,
                 emulated: bool):
        self._mapping = mapping
        self.geometry = geometry
        self.emulated = emulated
        # a stand-in file lives in the page cache, which the kernel will not pin
        self.gpu_mappable = not emulated
        self.mapped_by = mapping.via
        self.map_sync = mapping.map_sync
        if mapping.is_pmem:
            persist_path = "libpmem"
        else:
            persist_path = "msync"
        self.survives = Survives.POWER_LOSS if mapping.is_pmem else Survives.HOST_CRASH
        super().__init__(path=path, size=size, alignment=geometry.alignment, view=mapping.view,
                         address=mapping.address, is_pmem=mapping.is_pmem,
                         persist_path=persist_path, readonly=readonly)

    @classmethod
    def open(cls, path: str, *, size=None, create=False, readonly=False, libpmem="auto",
             allow_foreign_owner=False, sysfs: str = SYSFS):
        """Open the device at `path` (create only accepts an existing device).
        size None maps the whole device; otherwise it must be a multiple of the
        device alignment no larger than the device."""
        lib = _libpmem.load(libpmem, where=path)
        try:
            st = os.stat(path)
        except FileNotFoundError:
            raise PathNotFoundError("no such device", where=path,
                                    hint="list devices with `daxctl list`") from None
        except OSError as exc:
            raise os_error(exc, path, "cannot look at the device") from None
        if not stat.S_ISCHR(st.st_mode):
            raise NotADaxDeviceError("not a character device", where=path,
                                     hint="name a /dev/daxX.Y device, or use pmem:/file: for files")
        geometry = read_dax_geometry(st.st_rdev, path, sysfs)
        return cls._open_mapped(path, geometry, size, readonly, lib, emulated=False)

    @classmethod
    def emulate(cls, path: str, *, alignment: int = 2 << 20, size=None, readonly=False,
                libpmem="auto", allow_foreign_owner=False):
        """A regular file standing in for a device: its length is the device size,
        `alignment` the device alignment.  The file must exist (a device is never
        created); its owner and mode are checked as for any log file."""
        lib = _libpmem.load(libpmem, where=path)
        try:
            st = os.stat(path)
        except FileNotFoundError:
            raise PathNotFoundError("no such file to emulate a device", where=path) from None
        if not stat.S_ISREG(st.st_mode):
            raise NotADaxDeviceError("an emulated device must be a regular file", where=path)
        check_existing(st, path, readonly, allow_foreign_owner)
        if st.st_size == 0 or st.st_size % alignment:
            raise BadSizeError(f"emulated device length {st.st_size} is not a positive multiple "
                               f"of the alignment {alignment}", where=path)
        return cls._open_mapped(path, DaxGeometry(st.st_size, alignment), size, readonly, lib,
                                emulated=True)

    @classmethod
    def _open_mapped(cls, path, geometry, size, readonly, lib, emulated):
        check_size(size, geometry.alignment, path, required=False)
        if size is None:
            size = geometry.size
        if size > geometry.size:
            raise BadSizeError(f"size {size} is larger than the device ({geometry.size})",
                               where=path)
        fd = -1
        try:
            fd = os.open(path, (os.O_RDONLY if readonly else os.O_RDWR) | os.O_CLOEXEC)
            if lib is not None and not readonly:
                mapping = PmemMapping(lib, path, size, readonly)   # whole device, length 0
            else:
                mapping = MmapMapping(fd, geometry.size, readonly)
                if size < geometry.size:
                    mapping.view = mapping.view[:size]
        except BaseException as exc:
            if fd >= 0:
                os.close(fd)
            if isinstance(exc, OSError):
                raise os_error(exc, path, "cannot map the device") from None
            raise
        try:
            backend = cls(path, mapping, size, geometry, readonly, emulated)
        except BaseException:
            os.close(fd)
            raise
        if readonly:
            os.close(fd)
        else:
            backend._file_fd = fd   # a writer's: what `lock` locks
        return backend

    def info(self) -> dict:
        d = super().info()
        d.update(mapped_by=self.mapped_by, map_sync=self.map_sync, emulated=self.emulated,
                 device_size=self.geometry.size)
        return d
