"""Text rendering shared by the `concordia-wal` subcommands: sizes, check
marks, hex dumps and the fixed-format record line of `dump`.

Every line here is meant to be read by a person and grepped by a script, so
column widths are fixed and values never contain the separator."""

from __future__ import annotations

import datetime


def size(n: int | None) -> str:
    """1536 -> '1.5 KiB' (binary units; bytes below 1 KiB stay exact)."""
    if n is None:
        return "-"
    n = int(n)
    if abs(n) < 1024:
        return f"{n} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024.0
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if n != int(n) else f"{int(n)} {unit}"
    return f"{n} B"  # unreachable


def mark(ok: bool | None) -> str:
    """[OK] / [BAD] beside a checksum; '[--]' where nothing is checked."""
    if ok is None:
        return "[--]"
    return "[OK]" if ok else "[BAD]"


def when(ns: int) -> str:
    if not ns:
        return "-"
    try:
        return datetime.datetime.fromtimestamp(ns / 1e9, datetime.timezone.utc).strftime(
            "%Y-%m-%d %H:%M:%S UTC")
    except (OverflowError, OSError, ValueError):
        return f"{ns} ns (out of range)"


def hexdump(data: bytes, base: int = 0, indent: str = "    ") -> list[str]:
    """xxd-style lines: offset, 16 bytes in hex, printable ASCII."""
    out = []
    for i in range(0, len(data), 16):
        chunk = bytes(data[i:i + 16])
        hx = " ".join(chunk[j:j + 2].hex() for j in range(0, len(chunk), 2))
        asc = "".join(chr(b) if 32 <= b < 127 else "." for b in chunk)
        out.append(f"{indent}{base + i:08x}: {hx:<39}  {asc}")
    return out


def features(mask: int, names: dict | None = None) -> str:
    """A feature mask: 'none' or the set bits, by name where `names` ({bit
    value: name}, FORMAT.md §2.3) knows them."""
    if not mask:
        return "none"
    names = names or {}
    known = [names[1 << b] for b in range(64) if mask >> b & 1 and (1 << b) in names]
    unknown = [str(b) for b in range(64) if mask >> b & 1 and (1 << b) not in names]
    parts = known + ([f"unknown bits {', '.join(unknown)}"] if unknown else [])
    return f"0x{mask:x} ({', '.join(parts)})"


#: the fixed columns of `dump` (documented in docs/cli.md)
RECORD_LINE = ("lsn: 0x{lsn:016x}  seg: {segment:>4}  off: 0x{offset:09x}  type: {type:<10}  "
               "epoch: {epoch:>6}  region: {region:<12}  pages: {pages:>6}  bytes: {length:>10}  "
               "crc: {crc:<4}{desc}")


def record_line(r: dict) -> str:
    """One `dump` line from the JSON form of a record (see docs/cli.md)."""
    region = r["region"] if r["region"] is not None else "-"
    desc = f"  {r['desc']}" if r.get("desc") else ""
    return RECORD_LINE.format(lsn=r["lsn"], segment=r["segment"], offset=r["offset"], type=r["type"],
                              epoch=r["epoch"] if r["epoch"] is not None else "-",
                              region=_clip(str(region), 12), pages=r["pages"], length=r["length"],
                              crc=r["crc"], desc=desc).rstrip()


def _clip(text: str, n: int) -> str:
    text = text.replace(" ", "_")
    return text if len(text) <= n else text[: n - 1] + "~"


def table(rows: list[list[str]], header: list[str], indent: str = "  ") -> list[str]:
    """Left-aligned columns, widths from the content."""
    cols = [header] + rows
    widths = [max(len(str(r[i])) for r in cols) for i in range(len(header))]
    fmt = indent + "  ".join(f"{{:<{w}}}" for w in widths)
    return [fmt.format(*header).rstrip()] + [fmt.format(*map(str, r)).rstrip() for r in rows]
