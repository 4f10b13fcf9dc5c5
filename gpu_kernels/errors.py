"""Errors the kernel layer raises on bad input (shapes, page sizes, page lists).

They derive from the project's root error so a command line shows one line and
exit code 2; they are raised before anything is launched or written.
"""

from __future__ import annotations

from concordia.root_error import ConcordiaError


class KernelError(ConcordiaError):
    """A kernel was asked to do something its contract does not allow."""


class KernelInputError(KernelError):
    """An argument has the wrong size, dtype, alignment or contents."""


class KernelCompileError(KernelError):
    """A `.cu` source failed to compile for a specialisation."""


class GpuUnavailableError(KernelError):
    """A GPU launcher was called where CuPy or a CUDA device is missing."""
