"""The persistent kernel's structs as the tests read them from its source
(gpu_kernels/executor.cu), to hold each to the numpy dtype the host writes."""

from __future__ import annotations

import re

from concordia.executor.persistent import KERNEL_SOURCE

CU = KERNEL_SOURCE.read_text()


def struct_fields(struct: str, source: str = CU) -> list[str]:
    """The field names of `struct` in `source`, in order (u64 fields, and
    cx_group arrays as written: `groups[CX_MAX_GROUPS]`)."""
    body = source[source.index(f"struct {struct} {{"):]
    body = body[body.index("{") + 1:body.index("};")]
    out = []
    for decl in re.findall(r"(?:u64|cx_group)\s+([^;]+);", body):
        out += [n.strip() for n in decl.split(",")]
    return out
