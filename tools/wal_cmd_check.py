"""`concordia-wal verify` and `recover --plan`: check every checksum and say
what recovery would do, without changing a byte (`verify --repair` is the one
exception, and it only ever cuts a torn tail, after a backup)."""

from __future__ import annotations

import os
import sys
import time

import click

from . import render as R
from concordia.wal.modes import RecoveryMode

from .common import MODES, Bar, check_outputs, emit_json, guarded, mode_name, open_volume

VERIFY_SCHEMA = "concordia-wal/verify/1"
PLAN_SCHEMA = "concordia-wal/plan/1"

def _recovery(out) -> dict:
    """verify's `recovery` key: what recovery in the mode restores (the one
    decision, `decide.decide`), or why it refuses."""
    if out.error is not None:
        return {"epoch": None, "error": out.error, "dropped": [], "regions": dict(out.regions),
                "exit_code": out.exit_code}
    dropped = [d.one_line() for d in out.plan.dropped] if out.plan is not None else []
    dropped += [rp.absent_reason() for rp in out.absent]  # nothing of it to restore at its epoch
    return {"epoch": out.epoch, "error": None, "dropped": dropped, "regions": dict(out.regions),
            "exit_code": out.exit_code}


def run_verify(vol, mode: str, bar=None) -> dict:
    """The documented verify JSON (docs/cli.md) for an open volume.  `bar`
    (wal_cmd_state.Bar) follows the check, and the plan's own walk when the
    check's was too long to keep (`walk_kept`).  `exit_code` is the
    decision's (R-D8)."""
    from concordia.wal.decide import counts, decide
    from concordia.wal.reader import verify

    walk: list = []
    rep = verify(vol, check_pages=True, progress=bar and bar.stage(0, 2), walk=walk)
    if walk and bar:
        bar.finish()  # the plan reuses the check's walk: no second pass to show
    out_d = decide(vol, mode, check_pages=True, walk=walk or None,
                   progress=None if walk else bar and bar.stage(1, 2))
    problems = [dict(p, counts=counts(p["kind"], mode)) for p in rep["problems"]]
    kinds = [p["kind"] for p in problems]
    out = {
        "schema": VERIFY_SCHEMA,
        "log": vol.backend.where,
        "mode": mode,
        "ok": not any(p["counts"] for p in problems),
        "problems": problems,
        "corrupt": kinds.count("corrupt"),
        "torn": kinds.count("torn"),
        "uncommitted": kinds.count("uncommitted"),
        "superblock": kinds.count("superblock"),
        "truncated": kinds.count("truncated"),
        "records": rep["records"],
        "commits": rep["commits"],
        "last_committed_epoch": rep["last_committed_epoch"],
        "incomplete_epochs": list(rep["incomplete_epochs"]),
        "bytes_checked": rep["bytes_checked"],
        "seconds": rep["seconds"],
        "gb_per_s": rep["gb_per_s"],
        "recovery": _recovery(out_d),
        "repair": None,
        "exit_code": out_d.exit_code,
    }
    return out


def _problem_line(p: dict) -> str:
    return f"{p['where']}: {p['reason']} ({p['kind']}, {p['length']} bytes)"


def _backup_path(vol) -> str:
    """`LOG.bak-<time>` (beside a file; shm objects and devices: in the
    working directory), with `-2`, `-3`, ... where that name is taken: a
    backup nobody named never replaces another one."""
    stamp = time.strftime("%Y%m%dT%H%M%S")
    path = vol.backend.path or "log"
    if vol.backend.kind not in ("file", "pmem"):
        path = os.path.basename(path)  # the copy goes to the working directory as a plain file
    base = f"{path}.bak-{stamp}"
    name, n = base, 1
    while os.path.lexists(name):
        n += 1
        name = f"{base}-{n}"
    return name


def _plan_cut(vol, problems: list) -> tuple[dict | None, str | None]:
    """(cut, None) or (None, why not): the torn tail to cut, which must lie in
    the last live segment, after its header."""
    torn = [p for p in problems if p["kind"] == "torn" and p["segment"] >= 0]
    if not torn:
        return None, "nothing to cut: no torn tail"
    live = vol.live_segments()
    last = live[-1]
    elsewhere = [p for p in torn if p["segment"] != last.index]
    if elsewhere:
        return None, (f"torn damage at {elsewhere[0]['where']} is not in the last segment "
                      f"(segment {last.index}); repair only cuts the tail of the last segment")
    start = min(p["offset"] for p in torn)
    from concordia.wal import format as F

    if start < last.offset + F.SEGMENT_HEADER_SIZE:
        return None, f"the header of segment {last.index} is damaged; repair cuts records, never a header"
    end = min(last.offset + last.nbytes, vol.backend.size)
    damaged = sum(p["length"] for p in torn)
    return {"segment": last.index, "offset": start, "length": end - start, "damaged_bytes": damaged,
            "lsn": last.lsn(start), "where": last.where(start)}, None


def _open_for_repair(spec: str):
    """A read-only Volume over a writable mapping of `spec` that holds the
    log's writer lock (exit 2 while a writer has the log open): what is
    checked is what is cut, and nobody appends in between."""
    from concordia.devmem import open_backend

    backend = open_backend(spec)
    try:
        backend.lock()
    except BaseException:
        backend.close()
        raise
    return open_volume(backend)  # the read-only commands' message for a target that is no log


def _repair(vol, report: dict, backup: str | None, force: bool = False) -> dict:
    """Cut the torn tail: copy the whole target to `backup` first, then zero
    from the first torn byte to the end of the last segment and persist.
    `vol` is the one `_open_for_repair` gave: its backend holds the lock.
    An existing `backup` is replaced only with `force`."""
    cut, why = _plan_cut(vol, report["problems"])
    if cut is None:
        return {"cut": None, "backup": None, "refused": why}
    from concordia.devmem.outfile import OutputFile

    path = backup or _backup_path(vol)
    src = vol.backend.array
    # complete or absent, never the log itself: the cut waits for a whole backup
    with OutputFile(path, replace=force and backup is not None, size=src.size, inputs=[vol.backend.path],
                    mode=0o600) as f:
        step = 64 << 20
        for start in range(0, src.size, step):
            f.write(memoryview(src[start:start + step]), start)
        f.commit(expect_size=src.size)
    w = vol.backend
    w.array[cut["offset"]:cut["offset"] + cut["length"]] = 0
    w.persist(cut["offset"], cut["length"])
    return {"cut": cut, "backup": path, "refused": None}


@click.command("verify")
@click.argument("log")
@click.option("--mode", type=click.Choice(MODES), default="tolerate-tail", show_default=True,
              help="Recovery mode whose rules decide what counts as a problem.")
@click.option("--repair", is_flag=True,
              help="Cut the torn tail of the last segment (after writing a backup) and verify again.")
@click.option("--backup", type=click.Path(dir_okay=False), default=None,
              help="Where --repair copies the log first (default LOG.bak-<time>).")
@click.option("--force", is_flag=True,
              help="Let --repair replace an existing --backup file (the log itself is cut only as always).")
@click.option("--quiet", "-q", is_flag=True, help="Print only the problems, nothing when clean.")
@click.option("--json", "as_json", is_flag=True, help="Print the documented JSON instead of text.")
@guarded
def verify_cmd(log, mode, repair, backup, force, quiet, as_json):
    """Check every checksum of LOG (superblock slots, segment headers, record
    headers, bodies and every page) and report every problem, not only the
    first, with segment and offset.  Read-only unless --repair, which
    takes the log's writer lock (refused, exit 2, while a writer has it
    open).  Shows a progress bar (not with --json or --quiet).

    Corruption is always a problem; a torn tail after the last commit only in
    absolute mode; an epoch without a commit (a crash between checkpoints)
    never.  Also says which epoch recovery in the mode would restore.
    --repair copies the log to --backup first; an existing --backup file is
    refused unless --force.
    Exit 0 clean, 1 problems found, 2 usage or I/O error.

    Example:

    \b
        concordia-wal verify file:./concordia-data/demo.log
        concordia-wal verify file:./concordia-data/demo.log --mode absolute --json
        concordia-wal verify file:./concordia-data/demo.log --repair --backup demo.bak --force
    """
    if backup and not repair:
        raise click.UsageError("--backup goes with --repair")
    if force and not repair:
        raise click.UsageError("--force goes with --repair (it lets the --backup file be replaced)")
    check_outputs(force, backup, logs=[log])  # before the log is opened: refused at once, in one line

    m = mode_name(mode)
    vol = _open_for_repair(log) if repair else open_volume(log)
    bar = Bar("verifying", enabled=not (as_json or quiet))
    try:
        rep = run_verify(vol, m, bar)
        if repair:
            rep["repair"] = _repair(vol, rep, backup, force)
            if rep["repair"]["cut"] is not None:
                bar.close()
                bar = Bar("verifying again", enabled=bar.enabled)
                after = run_verify(open_volume(vol.backend), m, bar)  # the superblock read afresh
                after["repair"] = rep["repair"]
                after["repair"]["problems_before"] = len(rep["problems"])
                rep = after
    finally:
        bar.close()
        vol.close()
    if as_json:
        emit_json(rep)
    elif quiet:
        for p in rep["problems"]:
            if p["counts"]:
                click.echo(_problem_line(p))
    else:
        click.echo("\n".join(_render_verify(rep)))
    sys.exit(rep["exit_code"])


def _render_verify(rep: dict) -> list[str]:
    mode = RecoveryMode(rep["mode"]).cli  # the text speaks as --mode is typed; the JSON keeps the value
    lines = [f"verify {rep['log']} (mode {mode})"]
    for p in rep["problems"]:
        lines.append(f"{'problem' if p['counts'] else 'note':<9}{_problem_line(p)}")
    lines.append(f"checked  {rep['records']} records, {rep['commits']} commits, "
                 f"{R.size(rep['bytes_checked'])} in {rep['seconds']:.3f} s ({rep['gb_per_s']:.2f} GB/s)")
    rc = rep["recovery"]
    if rc["error"]:
        lines.append(f"recovery {mode} would refuse: {rc['error']}")
    else:
        lines.append(f"recovery {mode} restores epoch {rc['epoch'] if rc['epoch'] else '- (nothing committed)'}")
        for d in rc["dropped"]:
            lines.append(f"         gives up {d}")
    r = rep.get("repair")
    if r is not None:
        if r["cut"]:
            c = r["cut"]
            lines.append(f"repair   cut the torn tail at {c['where']} (lsn 0x{c['lsn']:x}): {c['damaged_bytes']} "
                         f"damaged bytes, zeroed to the end of segment {c['segment']} ({c['length']} bytes); "
                         f"backup {r['backup']}")
        else:
            lines.append(f"repair   nothing cut: {r['refused']}")
    n = sum(p["counts"] for p in rep["problems"])
    if not rep["ok"]:
        lines.append(f"result   {n} problem{'s' if n != 1 else ''} found")
    elif rep["exit_code"]:
        lines.append(f"result   recovery {'refuses' if rc['error'] else 'restores less than the last commit'}")
    else:
        lines.append("result   OK")
    return lines


# --------------------------------------------------------------------------- recover --plan

@click.command("recover")
@click.argument("log")
@click.option("--plan", "show_plan", is_flag=True, help="Print the recovery plan (required: nothing is applied).")
@click.option("--epoch", type=click.IntRange(1, None), default=None, help="Target epoch (default: the latest).")
@click.option("--mode", type=click.Choice(MODES), default="tolerate-tail", show_default=True,
              help="Recovery mode: what to do with damaged records.")
@click.option("--sources", is_flag=True, help="Also list every record read, with its page count.")
@click.option("--check-pages/--no-check-pages", default=True, show_default=True,
              help="CRC-check every page while planning, so damage the restore would meet is found now.")
@click.option("--json", "as_json", is_flag=True, help="Print the documented JSON instead of text.")
@guarded
def recover_cmd(log, show_plan, epoch, mode, sources, check_pages, as_json):
    """Print the recovery plan for LOG without applying it: for every region,
    the base snapshot and committed deltas read, pages and bytes, segments
    touched, and what damage made it give up.  Read-only.

    Restoring into a running program is done through the Session API;
    `concordia-wal restore` writes one region to a .npy file.
    Exit 0 when nothing is given up, 1 when the plan drops damaged data,
    the mode refuses it, or a region has no state at the epoch (absent: it
    was registered after it).

    Example:

    \b
        concordia-wal recover file:./concordia-data/demo.log --plan
        concordia-wal recover file:./concordia-data/demo.log --plan --epoch 2 --json
        concordia-wal recover file:./concordia-data/demo.log --plan --no-check-pages --sources
    """
    if not show_plan:
        raise click.UsageError("recover only plans here: add --plan (restore writes a region to .npy; "
                               "the Session API restores into a running program)")
    from concordia.wal.decide import decide

    m = mode_name(mode)
    target = "latest" if epoch is None else epoch
    vol = open_volume(log)
    try:
        out = decide(vol, m, target=target, check_pages=check_pages)
        out.raise_usage()
        d = plan_document(vol.backend.where, m, target, out)
    finally:
        vol.close()
    if as_json:
        emit_json(d)  # every outcome, a refusal and an empty log included: the documented object
    elif out.error is not None:
        click.echo(f"error: recovery {mode} refuses: {out.error}", err=True)
    elif out.plan is None:
        click.echo(f"plan     {d['log']}: nothing committed, nothing to restore")
    else:
        click.echo("\n".join(_render_plan(d, sources)))
    sys.exit(d["exit_code"])


def plan_document(where: str, mode: str, target, out) -> dict:
    """`recover --plan --json` (docs/cli.md, schema plan) for the decision
    `out`: every documented key in every outcome.  A refusal (`error` says
    why) and a log with nothing committed plan no region: `epoch` is null and
    the counts are zero."""
    from concordia.wal.planner import DEFAULT_BANDWIDTH

    d = {"schema": PLAN_SCHEMA, "log": where, "target": target, "epoch": None, "mode": mode,
         "bytes_to_read": 0, "naive_bytes": 0, "bandwidth": DEFAULT_BANDWIDTH, "est_seconds": 0.0,
         "segments": [], "regions": {}, "absent": {}, "dropped": []}
    if out.plan is not None:
        d.update(out.plan.to_json())
    d.update(problems=[p.to_json() for p in out.problems], error=out.error, exit_code=out.exit_code)
    return d


def _render_plan(d: dict, sources: bool) -> list[str]:
    lines = [f"plan     {d['log']}: epoch {d['epoch']} (target {d['target']}, mode {RecoveryMode(d['mode']).cli})"]
    rows = []
    for name, r in d["regions"].items():
        rows.append([name, r["epoch"], "-" if r["base_epoch"] is None else r["base_epoch"], r["pages"],
                     r["pages_read"], r["zero_pages"], R.size(r["bytes_to_read"]), r["records"],
                     ",".join(map(str, r["segments"])) or "-",
                     "-" if r["digest"] is None else f"0x{r['digest']:08x}"])
    lines += R.table(rows, ["region", "epoch", "base", "pages", "read", "zero", "bytes", "records",
                            "segments", "digest"])
    if sources:
        for name, r in d["regions"].items():
            for s in r["sources"]:
                lines.append(f"  {name}: lsn 0x{s['lsn']:x} epoch {s['epoch']} segment {s['segment']}"
                             f"{' base' if s['base'] else ''}: {s['pages']} pages")
    naive = d["naive_bytes"]
    lines.append(f"read     {R.size(d['bytes_to_read'])} of {R.size(naive)} a full replay reads, "
                 f"segments {','.join(map(str, d['segments'])) or '-'}, about {d['est_seconds'] * 1e3:.1f} ms "
                 f"at {d['bandwidth'] / 1e9:.0f} GB/s")
    for x in d["dropped"]:
        gave = ""
        if x["gave_up"]:
            a, b = x["gave_up"]["epochs"]
            gave = f"; gave up epochs {a}..{b}" + (f" of {', '.join(x['gave_up']['regions'])}"
                                                   if x["gave_up"]["regions"] else "")
        lines.append(f"dropped  {x['where']}: {x['reason']}{gave}")
    for x in d["absent"].values():
        lines.append(f"absent   {x['reason']}")
    listed = {x["where"] for x in d["dropped"]}
    for p in d.get("problems", ()):
        if p["where"] not in listed:
            lines.append(f"problem  {p['where']}: {p['reason']} ({p['kind']})")
    return lines
