"""Start a child that prints a number per committed epoch, let it print some
lines, SIGKILL it wherever it is, and return every number it printed."""

from __future__ import annotations

import signal
import sys
import subprocess
import time


def kill_after_lines(args: list, lines: int, pause: float, *, wait_s: float = 60) -> list:
    """Run `args`, read `lines` lines of its stdout (at most `wait_s` seconds),
    sleep `pause`, SIGKILL it; the numbers of every line it printed, in order.
    A child that ended by itself fails the caller's test (with its stderr)."""
    p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    got = []
    deadline = time.monotonic() + wait_s
    while len(got) < lines and time.monotonic() < deadline:
        ln = p.stdout.readline()
        if not ln:
            break
        got.append(ln.strip())
    time.sleep(pause)
    p.send_signal(signal.SIGKILL)
    # read through the same buffered reader: readline may have read further lines ahead into
    # it, which communicate() (reading the descriptor itself) would never see
    out, err = p.stdout.read(), p.stderr.read()
    p.wait(timeout=30)
    assert p.returncode == -signal.SIGKILL, (out[-2000:], err[-2000:])
    return [int(x) for x in got + out.split() if x.isdigit()]


def run_child(child: str, *args, timeout: float = 120):
    """Run the child script `child` (python -c) with `args` to its end or its
    own SIGKILL: (the finished process, the last number it printed or None)."""
    r = subprocess.run([sys.executable, "-c", child, *map(str, args)], capture_output=True, text=True,
                       timeout=timeout)
    lines = [ln for ln in r.stdout.split() if ln.isdigit()]
    return r, (int(lines[-1]) if lines else None)


def kill_at_random_lines(child: str, path: str, rounds: int, lines: int, rng, check) -> int:
    """`rounds` times: run `child` on `path` (to epoch 100,000, no kill point of
    its own), SIGKILL it after `lines` to 3 x `lines` printed epochs and up to
    50 ms more, and `check(path, seen)` the log (which returns the epoch it
    holds, at least the last one printed); the last epoch checked."""
    seen = 0
    for _ in range(rounds):
        nums = kill_after_lines([sys.executable, "-c", child, path, "0", "100000", "none"],
                                lines + rng.randint(0, 2 * lines), rng.random() * 0.05)
        if nums:
            seen = nums[-1]
        seen = check(path, seen)
        assert seen > 0
    return seen
