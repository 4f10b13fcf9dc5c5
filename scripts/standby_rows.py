"""The rows of a standby chain's table in docs/results/standby.md, from the
JSON `concordia-wal bench standby --follow --json` wrote:

    python scripts/standby_rows.py docs/results/standby-follow.json

One row a takeover: kill to decoding; detect (of it, the part a poll running
at the kill took); isolate (the open's walk and cut); restore; the first
decode step; the epoch; the mirror's epochs applied at the takeover and while
following; the warm-up's resync; and, for an early takeover, kill to the log
held and confirmed (the lock's moment, and the open's walk and cut, which
for such a takeover run beside the decode, in brackets)."""

from __future__ import annotations

import json
import re
import sys


def _ms(s) -> str:
    return "-" if s is None else f"{s * 1e3:,.1f}"


def row(name: str, r: dict) -> str:
    o = r["restore"].get("open", {})
    m = re.search(r"(\d+) epoch\(s\) applied at takeover, (\d+) while following", r["restore"].get("via", ""))
    mirror = f"{m.group(1)} / {int(m.group(2)):,}" if m else "(no mirror: the log planned and read)"
    poll = r.get("detect_in_poll_s")
    detect = _ms(r["kill_to_detect_s"]) + ("" if poll is None else f" ({_ms(poll)})")
    resync = r["warm"].get("mirror_s")
    confirmed = r.get("kill_to_confirmed_s")
    walk_cut = f"walk {_ms(o.get('walk_s', 0))}, cut {_ms(o.get('cut_s', 0))}"
    # an early takeover's open (walk, cut) is its confirmation's, beside the decode
    isolate = _ms(r["isolate_s"]) + ("" if confirmed is not None else
                                     f" ({_ms(o.get('walk_s', 0))}, {_ms(o.get('cut_s', 0))})")
    early = "" if confirmed is None else f"{_ms(confirmed)} (lock {_ms(r.get('kill_to_locked_s'))}; {walk_cut})"
    return (f"| {name} | {_ms(r['kill_to_decoding_s'])} ms | {detect} | {isolate} | {_ms(r['restore_s'])} | "
            f"{r['first_decode_s'] * 1e3:.2f} | {r['epoch']:,} | {mirror} | "
            f"{'' if resync is None or m is None else f'{resync:.2f} s'} | {early} |")


def main(path: str) -> None:
    with open(path) as f:
        d = json.load(f)
    print("| standby | kill to decoding | detect (of it in a poll) | isolate (walk, cut) | restore | decode | epoch "
          "| mirror: applied at takeover / while following | warm-up resync | kill to confirmed (lock) |")
    print("|---|---:|---:|---:|---:|---:|---:|---|---:|---:|")
    print(row("warm", d["warm"]))
    for i, h in enumerate(d["hot_trials"], 1):
        print(row(f"hot {i}", h))
    sb = d["standby"]
    print(f"\nmedian {sb['median_s']:.3f} s, max {sb['max_s']:.3f} s over {sb['trials']} hot takeovers"
          + (f"; {sb['early']} early, kill to confirmed median {sb['median_to_confirmed_s']:.3f} s"
             if sb.get("median_to_confirmed_s") is not None else ""))


if __name__ == "__main__":
    main(sys.argv[1])
