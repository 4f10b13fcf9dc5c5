"""Byte counts as a person types them: `4096`, `64M`, `1GiB`, `1.5G` (binary
units).  Used by `Policy.parse` and by every command line; pure (no click, no
I/O), so the runtime never imports the command line for it.

A size is a whole number of bytes in [0, MAX_SIZE]: MAX_SIZE is the largest
file offset the OS takes (a signed 64-bit `off_t`).  Anything else raises a
one-line `ValueError` naming the text, never a silent truncation or an
overflow further down.
"""

from __future__ import annotations

import re
from fractions import Fraction

MAX_SIZE = (1 << 63) - 1

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)?\s*$", re.IGNORECASE)
_UNIT = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_HINT = "use e.g. 4096, 64M, 1GiB"


def parse_size(text) -> int:
    """'64M', '1GiB', '4096' -> bytes.  Raises ValueError (one line) for text
    that is not a size, a fraction of a byte, or more than MAX_SIZE."""
    m = _SIZE.match(str(text))
    if not m:
        raise ValueError(f"not a size: {text!r} ({_HINT})")
    n = Fraction(m.group(1)) * _UNIT[m.group(2).lower()]
    if n.denominator != 1:
        raise ValueError(f"not a whole number of bytes: {text!r} is {float(n):.1f} bytes ({_HINT})")
    if n > MAX_SIZE:
        raise ValueError(f"size too large: {text!r} is more than {MAX_SIZE} bytes (8 EiB)")
    return int(n)
