"""NUMA placement for shm logs: check that a node exists and has memory, bind a
mapping's pages to it (mbind, MPOL_BIND, moving pages already placed), and ask
which node holds a page.  CXL memory in system-RAM mode shows up as a
CPU-less NUMA node, so this is how a shm log lands in CXL memory.

glibc has no mbind wrapper (it is in libnuma), so the system calls go through
libc's `syscall` with the architecture's numbers.
"""

from __future__ import annotations

import ctypes
import os
import platform

from .errors import NumaNodeError

NODE_DIR = "/sys/devices/system/node"
MPOL_BIND = 2
MPOL_MF_MOVE = 1 << 1
MPOL_F_NODE = 1 << 0
MPOL_F_ADDR = 1 << 1
_NR = {"x86_64": {"mbind": 237, "get_mempolicy": 239},
       "aarch64": {"mbind": 235, "get_mempolicy": 236}}

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def _parse_list(text: str) -> set[int]:
    out: set[int] = set()
    for part in text.strip().split(","):
        if part:
            lo, _, hi = part.partition("-")
            out.update(range(int(lo), int(hi or lo) + 1))
    return out


def nodes_with_memory(node_dir: str = NODE_DIR) -> set[int]:
    for name in ("has_memory", "online"):
        try:
            with open(os.path.join(node_dir, name)) as f:
                return _parse_list(f.read())
        except OSError:
            continue
    return set()


def check_node(node, where: str, node_dir: str = NODE_DIR) -> None:
    """Raise NumaNodeError unless `node` is a node of this machine with memory."""
    have = nodes_with_memory(node_dir)
    if isinstance(node, bool) or not isinstance(node, int) or node < 0:
        raise NumaNodeError(f"NUMA node must be a non-negative integer, not {node!r}", where=where)
    if not os.path.isdir(os.path.join(node_dir, f"node{node}")) or node not in have:
        listed = ",".join(map(str, sorted(have))) or "none"
        raise NumaNodeError(f"NUMA node {node} does not exist or has no memory", where=where,
                            hint=f"nodes with memory: {listed}")


def _syscall(name: str, *args) -> int:
    nr = _NR.get(platform.machine(), {}).get(name)
    if nr is None:
        raise NumaNodeError(f"{name} is not supported on {platform.machine()}")
    ctypes.set_errno(0)
    rc = _libc.syscall(ctypes.c_long(nr), *args)
    if rc < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return rc


def bind(address: int, length: int, node: int, where: str) -> None:
    """Bind [address, address+length) (page aligned) to `node`: future pages are
    allocated there (for tmpfs the policy is the file's), pages already mapped
    here are moved."""
    bits = 8 * ctypes.sizeof(ctypes.c_ulong)
    words = node // bits + 1
    mask = (ctypes.c_ulong * words)()
    mask[node // bits] = 1 << (node % bits)
    try:
        _syscall("mbind", ctypes.c_void_p(address), ctypes.c_ulong(length), ctypes.c_int(MPOL_BIND),
                 mask, ctypes.c_ulong(words * bits + 1), ctypes.c_uint(MPOL_MF_MOVE))
    except OSError as exc:
        raise NumaNodeError(f"cannot bind to NUMA node {node}: {exc.strerror}", where=where,
                            hint="check the node's free memory and the process's cpuset") from None


def node_of(address: int) -> int:
    """The NUMA node holding the page at `address` (the page must be present)."""
    out = ctypes.c_int(-1)
    _syscall("get_mempolicy", ctypes.byref(out), None, ctypes.c_ulong(0),
             ctypes.c_void_p(address), ctypes.c_ulong(MPOL_F_NODE | MPOL_F_ADDR))
    return out.value
