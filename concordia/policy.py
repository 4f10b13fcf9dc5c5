"""When to checkpoint: every N steps, every T milliseconds, or once B bytes are
dirty, whichever comes first.  The policy is pure bookkeeping; the session asks
it at every `step()` and takes the checkpoint."""

from __future__ import annotations

import dataclasses
import numbers
import time

from concordia.errors import SessionError
from concordia.sizes import parse_size


@dataclasses.dataclass
class Policy:
    """every_steps / every_ms / every_bytes: None disables that trigger.  With
    all three None, checkpoints happen only when `checkpoint()` is called."""

    every_steps: int | None = None
    every_ms: float | None = None
    every_bytes: int | None = None

    def __post_init__(self):
        for name in ("every_steps", "every_ms", "every_bytes"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, numbers.Real) and not isinstance(v, bool) and v > 0):
                raise SessionError(f"{name} must be a positive number, not {v!r}", where="policy")
        self._steps = 0
        self._since = time.monotonic()

    @classmethod
    def parse(cls, text: str) -> "Policy":
        """'steps=4,ms=500,bytes=64M' -> Policy (for command lines).  Bad text
        raises a one-line SessionError naming the trigger."""
        convert = {"steps": ("every_steps", int), "ms": ("every_ms", float), "bytes": ("every_bytes", parse_size)}
        kw = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, _, val = part.partition("=")
            key = key.strip()
            if key not in convert:
                raise SessionError(f"unknown trigger {key!r} (use steps=, ms=, bytes=)", where=f"policy {text!r}")
            field, conv = convert[key]
            try:
                kw[field] = conv(val.strip())
            except ValueError:
                what = "a size (e.g. 64M)" if key == "bytes" else "a number"
                raise SessionError(f"{key}={val.strip()!r} is not {what}", where=f"policy {text!r}") from None
        return cls(**kw)

    @property
    def needs_dirty_bytes(self) -> bool:
        return self.every_bytes is not None

    def note_step(self, n: int = 1) -> None:
        self._steps += n

    def due(self, dirty_bytes: int | None = None) -> str | None:
        """The trigger that fires now, or None."""
        if self.every_steps is not None and self._steps >= self.every_steps:
            return "steps"
        if self.every_ms is not None and (time.monotonic() - self._since) * 1e3 >= self.every_ms:
            return "time"
        if self.every_bytes is not None and dirty_bytes is not None and dirty_bytes >= self.every_bytes:
            return "bytes"
        return None

    def reset(self) -> None:
        """A checkpoint was taken."""
        self._steps = 0
        self._since = time.monotonic()
