"""Concordia: fault tolerance for the GPU state of long-running LLM inference.

`Session` and `Policy` are imported on first use, so that importing a
sub-package (`concordia.wal`, `concordia.devmem`, ...) stays light.
"""

__version__ = "0.1.0"

__all__ = ["Session", "Policy"]


def __getattr__(name):
    if name == "Session":
        from .session import Session

        return Session
    if name == "Policy":
        from .policy import Policy

        return Policy
    raise AttributeError(f"module 'concordia' has no attribute {name!r}")
