"""When to checkpoint: every N steps, every T milliseconds, or once B bytes are
dirty, whichever comes first.  The policy is pure bookkeeping; the session asks
it at every `step()` and takes the checkpoint.

It also says what the log keeps (retention, on by default; `concordia.retention`
does the work after each checkpoint): a region gets a new base snapshot once
the deltas logged since its newest base pass `base_every_bytes`, every epoch
among the newest `keep_epochs` (and every epoch committed within the last
`keep_seconds`) stays restorable, and compaction frees what nothing kept still
needs, writing about `slice_bytes` after any one checkpoint (more when the
measured write rate would fill the log first)."""

from __future__ import annotations

import dataclasses
import numbers
import time

from concordia.regions.errors import SessionError
from concordia.sizes import parse_size


@dataclasses.dataclass
class Policy:
    """every_steps / every_ms / every_bytes: None disables that trigger.  With
    all three None, checkpoints happen only when `checkpoint()` is called.

    retain: automatic bases and compaction (False: the log only grows, until
    `concordia-wal compact`).  base_every_bytes: delta bytes after which a
    region gets a new base (None: a quarter of the region, so a recovery reads
    at most 1.25 images of it, and at least a 64th of a segment, so a small
    region is not based every few steps); an epoch that writes the region
    whole counts as a base.  keep_epochs / keep_seconds: the window of
    epochs that stays restorable (None: no window of that kind); when the log
    cannot hold the window, the log wins and the window shrinks (older
    targets are refused, naming the oldest kept epoch).  Each switch stores
    the window in the log (as a count of epochs, 0 while it reaches back to
    the first), which is what `concordia-wal compact` keeps when given no
    --keep.  slice_bytes: BASE
    bytes written after one checkpoint while a base is being written (None:
    64 KiB, or twice what that checkpoint wrote when more, so that a slice
    costs about what the checkpoint did and a base outpaces the deltas); more
    when the write rate measured over the checkpoints and the free space say
    the log would fill before the base is in force (`concordia.retention`).
    image_bases: an epoch that writes a region whole is that region's base
    (an image entry, FORMAT.md §12.2: nothing is written twice); the log
    then carries the IMAGE_BASES feature, which readers older than it refuse
    in one line.  False keeps the log readable by them (every base is
    written as BASE records), for a standby or tool not yet updated."""

    every_steps: int | None = None
    every_ms: float | None = None
    every_bytes: int | None = None
    retain: bool = True
    base_every_bytes: int | None = None
    keep_epochs: int | None = 64
    keep_seconds: float | None = None
    slice_bytes: int | None = None
    image_bases: bool = True

    def __post_init__(self):
        for name in ("retain", "image_bases"):
            if not isinstance(getattr(self, name), bool):
                raise SessionError(f"{name} must be True or False, not {getattr(self, name)!r}", where="policy")
        for name in ("every_steps", "every_ms", "every_bytes", "base_every_bytes", "keep_epochs", "keep_seconds",
                     "slice_bytes"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, numbers.Real) and not isinstance(v, bool) and v > 0):
                raise SessionError(f"{name} must be a positive number, not {v!r}", where="policy")
        self._steps = 0
        self._since = time.monotonic()

    @classmethod
    def parse(cls, text: str) -> "Policy":
        """'steps=4,ms=500,bytes=64M,keep_epochs=16,slice_bytes=1M' -> Policy
        (for command lines).  Triggers: steps=, ms=, bytes=; retention: retain=
        (on/off), base_every_bytes= and slice_bytes= (sizes), keep_epochs= (a
        whole number), keep_seconds= (seconds), image_bases= (on/off); `none`
        unsets an optional field.
        Fields left out keep the constructor's defaults, and the constructor
        checks the values.  Bad text raises a one-line SessionError naming the
        field."""
        kw = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, eq, val = part.partition("=")
            key, val = key.strip(), val.strip()
            if key not in _PARSE:
                raise SessionError(f"unknown field {key!r} (use {', '.join(k + '=' for k in _PARSE)})",
                                   where=f"policy {text!r}")
            field, conv, what = _PARSE[key]
            if field in kw:
                raise SessionError(f"{key}= is given twice", where=f"policy {text!r}")
            if not eq:
                raise SessionError(f"{key} has no value ({key}=...)", where=f"policy {text!r}")
            if val.lower() == "none" and field not in ("retain", "image_bases"):
                kw[field] = None
                continue
            try:
                kw[field] = conv(val)
            except ValueError:
                raise SessionError(f"{key}={val!r} is not {what}", where=f"policy {text!r}") from None
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


def _whole(text: str) -> int:
    return int(text)


def _finite(text: str) -> float:
    v = float(text)
    if v != v or v in (float("inf"), float("-inf")):
        raise ValueError(text)
    return v


def _on_off(text: str) -> bool:
    v = text.lower()
    if v in ("on", "true", "yes", "1"):
        return True
    if v in ("off", "false", "no", "0"):
        return False
    raise ValueError(text)


# Policy.parse: key -> (field, conversion, what a good value is); the constructor checks the value
_PARSE = {
    "steps": ("every_steps", _whole, "a whole number"),
    "ms": ("every_ms", _finite, "a number"),
    "bytes": ("every_bytes", parse_size, "a size (e.g. 64M)"),
    "retain": ("retain", _on_off, "on or off"),
    "base_every_bytes": ("base_every_bytes", parse_size, "a size (e.g. 64M)"),
    "keep_epochs": ("keep_epochs", _whole, "a whole number"),
    "keep_seconds": ("keep_seconds", _finite, "a number"),
    "slice_bytes": ("slice_bytes", parse_size, "a size (e.g. 64M)"),
    "image_bases": ("image_bases", _on_off, "on or off"),
}
