"""The file-backed tiers (plain file, shm file, pmem file), the anonymous
`memory` tier, and what they share: opening a log file safely (mode 0600 on
creation whatever the umask, foreign owners refused, read-only files refused for
writing, nothing created or changed on bad input) and mapping it either through
libpmem or through mmap.

Device DAX is in `devdax.py`, pinned host memory in `pinned.py`.
"""

from __future__ import annotations

import errno
import mmap
import os
import stat

import numpy as np

from concordia.root_error import Hint

from . import libpmem as _libpmem
from .backend import Backend, Survives, mount_of, os_error
from .dirsync import sync_parent
from .errors import (
    BadSizeError,
    BadSpecError,
    DevmemError,
    ForeignOwnerError,
    PathNotFoundError,
    ReadOnlyError,
)

PAGE = mmap.PAGESIZE
MAP_SHARED_VALIDATE = 0x03
MAP_SYNC = 0x80000
CREATE_MODE = 0o600


# -- mappings -----------------------------------------------------------------------

def buffer_address(buf) -> int:
    """Virtual address of byte 0 of a buffer (writable or not)."""
    return int(np.frombuffer(buf, dtype=np.uint8, count=1).ctypes.data)


class MmapMapping:
    """A shared mapping made by Python's mmap; persisted with msync."""

    via = "mmap"
    is_pmem = False

    def __init__(self, fd: int, length: int, readonly: bool, try_map_sync: bool = False):
        prot = mmap.PROT_READ | (0 if readonly else mmap.PROT_WRITE)
        self.map_sync = False
        mm = None
        if try_map_sync and not readonly:
            try:   # MAP_SYNC: page faults leave the file system metadata durable (fsdax only)
                mm = mmap.mmap(fd, length, flags=MAP_SHARED_VALIDATE | MAP_SYNC, prot=prot)
                self.map_sync = True
            except OSError as exc:
                if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise
        if mm is None:
            mm = mmap.mmap(fd, length, flags=mmap.MAP_SHARED, prot=prot)
        self._mm = mm
        self.view = memoryview(mm)
        self.address = buffer_address(mm)
        self.length = length

    def msync(self, offset: int, length: int) -> None:
        start = offset - offset % mmap.ALLOCATIONGRANULARITY
        self._mm.flush(start, min(self.length, offset + length) - start)

    persist = flush = msync

    def drain(self) -> None:
        pass

    def release(self) -> None:
        try:
            self._mm.close()
        except BufferError:
            pass   # views still exported: unmapped when the last one goes
        self._mm = None


class PmemMapping:
    """A mapping made by pmem_map_file.  On real (or forced) pmem, persistence is
    user-space cache flushing (pmem_persist / pmem_flush + pmem_drain); otherwise
    pmem_msync."""

    via = "libpmem"

    def __init__(self, lib: _libpmem.Libpmem, path: str, length: int | None, readonly: bool):
        self._lib = lib
        ptr, mapped, is_pmem = lib.map_file(path, 0, 0, 0)
        if length is None:
            length = mapped
        self._ptr = ptr
        self.length = length
        self.address = lib.address(ptr)
        self.is_pmem = is_pmem
        buf = lib.ffi.buffer(ptr, length)
        view = memoryview(buf)
        self.view = view.toreadonly() if readonly else view
        self.map_sync = _has_map_sync(self.address)

    def persist(self, offset: int, length: int) -> None:
        if self.is_pmem:
            self._lib.persist(self.address + offset, length)
        else:
            self._lib.msync(self.address + offset, length)

    def flush(self, offset: int, length: int) -> None:
        if self.is_pmem:
            self._lib.flush(self.address + offset, length)
        else:
            self._lib.msync(self.address + offset, length)

    def drain(self) -> None:
        if self.is_pmem:
            self._lib.drain()

    def release(self) -> None:
        self._ptr = None   # the cdata's destructor unmaps once no buffer references it


def _has_map_sync(address: int) -> bool:
    """Whether the kernel gave MAP_SYNC for the mapping at `address` ("sf" in
    /proc/self/smaps VmFlags)."""
    try:
        with open("/proc/self/smaps") as f:
            inside = False
            for line in f:
                head = line.split(" ", 1)[0]
                if "-" in head and ":" not in head:
                    lo, hi = (int(x, 16) for x in head.split("-"))
                    inside = lo <= address < hi
                elif inside and line.startswith("VmFlags:"):
                    return "sf" in line.split()[1:]
    except OSError:
        pass
    return False


# -- opening a log file ---------------------------------------------------------------

# Remedies that name a knob, in the words of the Python API and of the command
# lines (concordia.root_error.Hint): the command lines that only read (info,
# dump, verify, recover --plan, restore) open another user's log and never write.
FOREIGN_OWNER_HINT = Hint(api="pass allow_foreign_owner=True if this is meant",
                          cli="run the command as the log's owner; info, dump and verify only read it")
READ_ONLY_FILE_HINT = Hint(api="open it read-only (readonly=True), or chmod u+w to write it",
                           cli="chmod u+w to write it; info, dump and verify only read it")
NO_SUCH_LOG_HINT = Hint(api="check the path, or create the log (create=True)",
                        cli="check the path, or create the log with concordia-wal format")
EMPTY_FILE_HINT = Hint(api="give a size to create it",
                       cli="lay a log out in it with concordia-wal format --size SIZE")


def check_size(size: int | None, alignment: int, where: str, required: bool) -> None:
    """A size must be a positive multiple of the alignment (checked before anything
    is touched)."""
    if size is None:
        if required:
            raise BadSizeError("a size is needed to create a log", where=where,
                               hint=f"give a multiple of {alignment}")
        return
    if size < alignment:
        raise BadSizeError(f"size {size} is smaller than the minimum {alignment}", where=where,
                           hint=f"give a multiple of {alignment}")
    if size % alignment:
        raise BadSizeError(f"size {size} is not a multiple of the alignment {alignment}",
                           where=where, hint=f"round to {size - size % alignment} or "
                                             f"{size - size % alignment + alignment}")


def check_existing(st: os.stat_result, where: str, readonly: bool,
                   allow_foreign_owner: bool) -> None:
    """Refuse a log owned by another user, and writing to a file marked read-only
    (no owner write bit: honoured even for root, as an archived log is marked so)."""
    if st.st_uid != os.geteuid() and not allow_foreign_owner:
        raise ForeignOwnerError(f"owned by uid {st.st_uid}, not by uid {os.geteuid()}",
                                where=where, hint=FOREIGN_OWNER_HINT)
    if not readonly and not st.st_mode & stat.S_IWUSR:
        raise ReadOnlyError(f"file is read-only (mode {stat.S_IMODE(st.st_mode):04o})",
                            where=where, hint=READ_ONLY_FILE_HINT)


class OpenedFile:
    """A descriptor on a log file, checked and sized; `created` says whether this
    call made it (so a later failure can take it back)."""

    def __init__(self, path: str, *, size: int | None, create: bool, readonly: bool,
                 allow_foreign_owner: bool, alignment: int):
        where = path
        check_size(size, alignment, where, required=False)
        self.path, self.created, self.fd = path, False, -1
        self._identity: tuple[int, int] | None = None   # (st_dev, st_ino) of a file this call made
        try:
            st = os.stat(path)
        except FileNotFoundError:
            st = None
        except OSError as exc:
            raise os_error(exc, where, "cannot look at the log") from None
        if st is None:
            if not create:
                raise PathNotFoundError("no such file", where=where, hint=NO_SUCH_LOG_HINT)
            check_size(size, alignment, where, required=True)
            self._create(path, size)
            return
        if not stat.S_ISREG(st.st_mode):
            raise BadSpecError(f"not a regular file ({_file_type(st.st_mode)})", where=where,
                               hint=_not_regular_hint(st.st_mode))
        check_existing(st, where, readonly, allow_foreign_owner)
        length = st.st_size
        if size is None:
            if length == 0:
                raise BadSizeError("file is empty", where=where, hint=EMPTY_FILE_HINT)
            if length % alignment and not readonly:
                # a reader maps the length there is (a log cut short anywhere reads as
                # truncated, FORMAT.md V-B8); a writer needs whole pages
                raise BadSizeError(f"file length {length} is not a multiple of the alignment "
                                   f"{alignment}", where=where)
            size = length
        elif length < size and not create:
            raise BadSizeError(f"file is {length} bytes, smaller than the {size} asked for",
                               where=where, hint="pass create=True to grow it")
        try:
            fd = os.open(path, (os.O_RDONLY if readonly else os.O_RDWR) | os.O_CLOEXEC)
        except OSError as exc:
            raise os_error(exc, where, "cannot open") from None
        self.fd = fd
        st2 = os.fstat(fd)
        if (st2.st_dev, st2.st_ino) != (st.st_dev, st.st_ino):   # replaced under us
            self.close()
            raise DevmemError("the file changed while it was opened", where=where,
                              hint="try again")
        if length < size:
            try:
                self._grow(size)
            except BaseException:
                # what a failed fallocate may have added goes again; the bytes
                # that were there are not touched
                try:
                    os.ftruncate(fd, length)
                except OSError:
                    pass
                self.close()
                raise
        elif not readonly and st2.st_blocks * 512 < size:
            # holes (a sparse file, or one cut and grown again): a store into one
            # on a full file system is a SIGBUS, so reserve them now, while a
            # full disk is still an error; the bytes themselves do not change
            self._reserve(size)
        self.size = size

    def _create(self, path: str, size: int) -> None:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW,
                         CREATE_MODE)
        except OSError as exc:
            raise os_error(exc, path, "cannot create") from None
        self.fd, self.created = fd, True
        st = os.fstat(fd)
        self._identity = (st.st_dev, st.st_ino)
        try:
            os.fchmod(fd, CREATE_MODE)   # the umask may have taken bits away; never add any
            self._grow(size)
            sync_parent(path)   # the new name survives a power loss, not only the bytes synced later
        except BaseException:
            self.discard()
            raise
        self.size = size

    def _grow(self, size: int) -> None:
        try:
            # reserve the blocks: a sparse file would SIGBUS on a later store when full
            os.posix_fallocate(self.fd, 0, size)
        except OSError as exc:
            if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL):
                os.ftruncate(self.fd, size)
            else:
                raise os_error(exc, self.path, f"cannot make the file {size} bytes") from None

    def _reserve(self, size: int) -> None:
        """Allocate the holes of an existing file (its length and bytes stay)."""
        try:
            os.posix_fallocate(self.fd, 0, size)
        except OSError as exc:
            if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL):
                return   # nothing to reserve with: stores find out, as before
            self.close()
            raise os_error(exc, self.path, f"cannot reserve the {size} bytes of the file "
                                           f"(it has holes)") from None

    def discard(self) -> None:
        """Undo this call: close, and unlink the file when this call created it."""
        self.close()
        if self.created:
            discard_created(self.path, self._identity)
            self.created = False

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def discard_created(path: str, identity: tuple[int, int] | None) -> None:
    """Unlink `path` when it is still the file this process created
    (`identity` = (st_dev, st_ino) at creation): a failed create takes back
    exactly what it made, never a file that replaced it since."""
    try:
        st = os.lstat(path)
        if identity is not None and (st.st_dev, st.st_ino) == tuple(identity):
            os.unlink(path)
    except OSError:
        pass


def _file_type(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return "not a file"


def _not_regular_hint(mode: int) -> str:
    """What to do instead: only a character device can be a device-DAX log."""
    if stat.S_ISCHR(mode):
        return "use dax: for a device-DAX character device"
    if stat.S_ISDIR(mode):
        return "name a file inside the directory, e.g. DIR/concordia.log"
    return "a log is a regular file or a device-DAX character device"


def _allocates_on_read(path: str) -> bool:
    """Whether reading a hole of a file under `path` through a shared mapping
    allocates a page (tmpfs, hugetlbfs): on a full mount that read is a SIGBUS.
    Other file systems map the zero page there."""
    mount = mount_of(path)
    return mount is not None and mount[0] in ("tmpfs", "hugetlbfs")


def has_holes(fd: int, size: int) -> bool:
    """Whether [0, size) of the file holds a hole (SEEK_HOLE; st_blocks first,
    which is cheap and never undercounts a file without holes)."""
    st = os.fstat(fd)
    if st.st_blocks * 512 >= size:
        return False
    try:
        return os.lseek(fd, 0, os.SEEK_HOLE) < size
    except OSError:
        return True   # no SEEK_HOLE: st_blocks said there is less than the length


class CopiedMapping(MmapMapping):
    """A read-only image of a sparse file in anonymous memory: the data
    extents (SEEK_DATA / SEEK_HOLE) are read in with pread(2), the holes stay
    untouched zero pages.  Used for read-only opens of sparse files where
    reading a hole through a mapping would allocate (tmpfs, hugetlbfs): there
    a full mount turns that read into a SIGBUS, here into nothing at all
    (holes read as zero) or an I/O error naming the place.  drain and release
    are MmapMapping's (an mmap either way); only persisting differs.  It is a copy:
    bytes a writer adds later do not show (a writer's log is never sparse:
    its blocks are reserved when it is created or opened for writing)."""

    via = "pread"
    is_pmem = False
    map_sync = False

    def __init__(self, fd: int, length: int, where: str):
        mm = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        view = memoryview(mm)
        pos = 0
        try:
            while pos < length:
                try:
                    start = os.lseek(fd, pos, os.SEEK_DATA)
                except OSError as exc:
                    if exc.errno == errno.ENXIO:
                        break   # only a hole from here to the end
                    raise
                end = min(length, os.lseek(fd, start, os.SEEK_HOLE))
                if end <= start:
                    end = length   # a file that cannot say where its data ends: read it all
                pos = start
                while pos < end:
                    n = os.preadv(fd, [view[pos:end]], pos)
                    if n <= 0:
                        end = pos   # the file shrank: what is missing reads as zero
                        break
                    pos += n
                pos = max(pos, end)
        except OSError as exc:
            view.release()
            mm.close()
            raise os_error(exc, f"{where} @ {pos:#x}", "read failed") from None
        self._mm = mm
        self.view = view.toreadonly()
        view.release()
        self.address = buffer_address(mm)
        self.length = length

    def persist(self, offset: int, length: int) -> None:
        pass   # read-only: Backend.persist refuses before it gets here

    flush = msync = persist


class MappedBackend(Backend):
    """A backend whose bytes are one MmapMapping or PmemMapping (`_mapping`):
    persistence is whatever that mapping does."""

    def _persist(self, offset, length):
        self._mapping.persist(offset, length)

    def _flush(self, offset, length):
        self._mapping.flush(offset, length)

    def _drain(self):
        self._mapping.drain()

    def _release(self):
        self._mapping.release()


class FileBackedBackend(MappedBackend):
    """A tier over one mapped file; subclasses pick the mapping and capabilities."""

    use_libpmem = False      # map through pmem_map_file when libpmem loads
    try_map_sync = False

    def __init__(self, path: str, mapping, opened: OpenedFile, readonly: bool, alignment: int):
        self._mapping = mapping
        self.created = opened.created
        self._created_identity = opened._identity if opened.created else None
        self.map_sync = mapping.map_sync
        if mapping.is_pmem:
            persist_path = "libpmem"
        else:
            persist_path = self.volatile_persist_path or "msync"
        super().__init__(path=path, size=opened.size, alignment=alignment, view=mapping.view,
                         address=mapping.address, is_pmem=mapping.is_pmem,
                         persist_path=persist_path, readonly=readonly)
        self.mapped_by = mapping.via
        # the file itself, for a writer: what `lock` locks (the mapping keeps its own)
        self._file_fd = -1 if readonly else os.dup(opened.fd)

    volatile_persist_path: str | None = None

    def discard(self) -> None:
        """Close, and unlink the file when this open created it (and it is
        still that file): how a create that fails later leaves nothing behind.
        A file that existed before is only closed."""
        self.close()
        if self.created:
            discard_created(self.path, self._created_identity)
            self.created = False

    @classmethod
    def open(cls, path: str, *, size=None, create=False, readonly=False, libpmem="auto",
             allow_foreign_owner=False, alignment: int = PAGE, **extra):
        lib = _libpmem.load(libpmem, where=path)
        opened = OpenedFile(path, size=size, create=create, readonly=readonly,
                            allow_foreign_owner=allow_foreign_owner, alignment=alignment)
        try:
            mapping = cls._map(opened, lib if cls.use_libpmem else None, readonly)
            backend = cls(path, mapping, opened, readonly, alignment, **extra)
        except OSError as exc:
            opened.discard()
            raise os_error(exc, path, "cannot map") from None
        except BaseException:
            opened.discard()
            raise
        opened.close()   # the mapping holds the file
        return backend

    @classmethod
    def _map(cls, opened: OpenedFile, lib, readonly: bool):
        if lib is not None and not readonly:
            # pmem_map_file maps the whole file; the view covers the first `size` bytes
            return PmemMapping(lib, opened.path, opened.size, readonly)
        if readonly and has_holes(opened.fd, opened.size) and _allocates_on_read(opened.path):
            return CopiedMapping(opened.fd, opened.size, opened.path)
        return MmapMapping(opened.fd, opened.size, readonly, try_map_sync=cls.try_map_sync)

    def info(self) -> dict:
        d = super().info()
        d.update(mapped_by=self.mapped_by, map_sync=self.map_sync)
        return d



#: sync_file_range(2) flag: start writeback of dirty pages in the range, do not wait
SYNC_FILE_RANGE_WRITE = 2
_sync_file_range = None  # libc's function once looked up; False where there is none


def _writeback_call():
    global _sync_file_range
    if _sync_file_range is None:
        try:
            import ctypes

            fn = ctypes.CDLL(None, use_errno=True).sync_file_range  # the GIL is released in the call
            fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
            fn.restype = ctypes.c_int
            _sync_file_range = fn
        except (OSError, AttributeError):
            _sync_file_range = False
    return _sync_file_range


class FileBackend(FileBackedBackend):
    """A plain file in the page cache: mmap + msync; survives a host crash once
    persisted.  Recent kernels refuse to pin page-cache file mappings for the GPU,
    so writers go through a staging ring."""

    kind = "file"
    survives = Survives.HOST_CRASH
    gpu_mappable = False

    def write_at(self, offset: int, buffers) -> None:
        """Store `buffers` (bytes-like objects, back to back) at `offset` with
        pwritev(2) instead of through the view.  The bytes land in the same
        page-cache pages the mapping shows (Linux keeps a MAP_SHARED mapping and
        write(2) of the same file coherent), so the view sees them at once, and
        they are durable after `persist` of the range like stored bytes.  Unlike
        stores through the view, this takes no page fault on pages a previous
        msync left write-protected: the cheaper way for a writer to put whole
        records into a page-cache file."""
        bufs = [memoryview(b).cast("B") for b in buffers]
        total = sum(len(b) for b in bufs)
        if not self._check(offset, total):
            return
        while bufs:
            try:
                done = os.pwritev(self._file_fd, bufs, offset)
            except OSError as exc:
                raise os_error(exc, f"{self.where} @ {offset:#x}", "write failed") from None
            offset += done
            while bufs and done >= len(bufs[0]):
                done -= len(bufs[0])
                bufs.pop(0)
            if bufs and done:
                bufs[0] = bufs[0][done:]

    def start_writeback(self, offset: int, length: int) -> None:
        """Have the kernel start writing [offset, offset+length) to the device now
        (sync_file_range(2) with SYNC_FILE_RANGE_WRITE): the call submits the I/O
        (some 50 µs per MiB on a virtual disk) and does not wait for it to finish,
        so that a later `persist` of a larger range finds most of it written and
        waits only for the rest.  Durability still comes from `persist` alone (this
        flushes no device cache and no metadata), which also reports any write
        error, so this is a hint: a no-op where the call does not exist or fails."""
        fn = _writeback_call()
        if fn and self._check(offset, length) and self._file_fd >= 0:
            fn(self._file_fd, offset, length, SYNC_FILE_RANGE_WRITE)


class SharedPagesBackend(FileBackedBackend):
    """A file whose pages are the memory every process maps (tmpfs, hugetlbfs):
    it outlives the writing process, not the host, and persist orders nothing."""

    survives = Survives.PROCESS_CRASH
    gpu_mappable = True
    volatile_persist_path = "none"

    def _persist(self, offset, length):
        pass   # the bytes are already where every process sees them

    _flush = _persist


class ShmBackend(SharedPagesBackend):
    """A file in /dev/shm (tmpfs), optionally bound to one NUMA node (CXL memory in
    system-RAM mode appears as a node).  It outlives the writing process, not the
    host; nothing needs persisting for that, so persist only checks the range.
    The GPU can write it directly after host registration."""

    kind = "shm"

    def __init__(self, path, mapping, opened, readonly, alignment, numa_node=None):
        super().__init__(path, mapping, opened, readonly, alignment)
        self.numa_node = numa_node
        if numa_node is not None:
            from .numa import bind
            # the file's pages already exist (fallocate): map them here first so the
            # bind moves them; later pages follow the file's policy
            int(self.array[::PAGE].sum())
            bind(self.address, -(-self.size // PAGE) * PAGE, numa_node, where=path)

    @classmethod
    def open(cls, path, *, numa_node=None, **kw):
        if numa_node is not None:
            from .numa import check_node
            check_node(numa_node, where=path)
        return super().open(path, numa_node=numa_node, **kw)

    def info(self):
        d = super().info()
        d["numa_node"] = self.numa_node
        return d


class PmemBackend(FileBackedBackend):
    """A file on an fsdax mount mapped with pmem_map_file (MAP_SYNC where the
    kernel gives it).  `is_pmem` is libpmem's honest answer: True means
    user-space flushes make bytes power-loss safe (persist_path "libpmem"),
    False means they go through msync.  Without libpmem: mmap (trying MAP_SYNC)
    and msync, which on a DAX file system also writes back the CPU caches.
    The kernel refuses long-term pins of fsdax pages: not GPU-mappable."""

    kind = "pmem"
    survives = Survives.POWER_LOSS
    gpu_mappable = False
    use_libpmem = True
    try_map_sync = True

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        # honest about the medium: without DAX (no user-space flushes, no MAP_SYNC)
        # this is a page-cache file and msync only reaches a host-crash guarantee
        if not (self.is_pmem or self.map_sync):
            self.survives = Survives.HOST_CRASH


class MemoryBackend(Backend):
    """An anonymous private-to-this-process mapping: volatile, for tests and
    for crash images (`from_bytes`)."""

    kind = "memory"
    survives = Survives.GPU_LOSS
    gpu_mappable = True
    ALIGNMENT = 64

    def __init__(self, size: int):
        mm = mmap.mmap(-1, size, flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)
        self._mm = mm
        super().__init__(path=None, size=size, alignment=self.ALIGNMENT, view=memoryview(mm),
                         address=buffer_address(mm), persist_path="none")

    @classmethod
    def open(cls, size: int | None) -> "MemoryBackend":
        check_size(size, cls.ALIGNMENT, "memory:", required=True)
        return cls(size)

    @classmethod
    def from_bytes(cls, data) -> "MemoryBackend":
        """A memory backend holding a copy of `data` (e.g. a crash image)."""
        data = memoryview(data).cast("B")
        if len(data) == 0:
            raise BadSizeError("cannot make an empty memory backend", where="memory:")
        b = cls(len(data))
        b.view[:] = data
        return b

    def _persist(self, offset, length):
        pass

    def _release(self):
        try:
            self._mm.close()
        except BufferError:
            pass
