"""A `concordia-wal` command under cProfile, for the GPU probes:
    python3 scripts/gpu/profile_wal.py OUT [--callees PATTERN ...] -- ARGS...
runs `concordia-wal ARGS...` in this process and writes to OUT the callees
of each PATTERN (pstats regular expressions, by cumulative time), then the
top functions by own time and by cumulative time; prints OUT's start."""

import cProfile
import io
import pstats
import sys


def main(argv: list) -> None:
    out, rest = argv[0], argv[1:]
    cut = rest.index("--")
    opts, args = rest[:cut], rest[cut + 1:]
    callees = [opts[i + 1] for i, o in enumerate(opts) if o == "--callees"]
    from concordia.tools.wal_cli import main as wal

    sys.argv = ["concordia-wal", *args]
    pr = cProfile.Profile()
    pr.enable()
    try:
        wal(standalone_mode=False)
    except SystemExit:
        pass
    pr.disable()
    buf = io.StringIO()
    st = pstats.Stats(pr, stream=buf).sort_stats("cumulative")
    for pattern in callees:
        st.print_callees(pattern)
    for key in ("tottime", "cumulative"):
        st.sort_stats(key).print_stats(45)
    with open(out, "w") as f:
        f.write(buf.getvalue())
    print(buf.getvalue()[:9000])


if __name__ == "__main__":
    main(sys.argv[1:])
