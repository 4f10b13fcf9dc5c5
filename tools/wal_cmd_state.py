"""`concordia-wal compact`, `snapshot list|create` and `restore`: fold the
log into base snapshots, list them, and take one region's state out of the log
into a `.npy` file.  `snapshot list` and `restore` are read-only."""

from __future__ import annotations

import sys

import click

from concordia.wal.catalog import MAX_KEEP_BASES
from concordia.wal.errors import UsageError

from . import render as R
from .common import (EXIT_OK, MODES, Bar, Where, check_outputs, emit_json, guarded, mode_name, open_volume,
                     progress_bar)


def _open_log_writable(spec: str):
    """A writable Log over `spec`.  Opening for writing cuts what follows the
    last commit (FORMAT.md §10.5), so it takes the log's writer lock first: a
    live writer makes this a one-line LockedError (exit 2), not a cut under
    its feet."""
    from concordia.wal import Log

    vol = open_volume(spec)  # the same messages as the read-only commands for a bad target
    vol.close()
    log = Log.open(spec, writable=True)
    Where.target = log.backend.where
    Where.data = True
    return log


# --------------------------------------------------------------------------- compact

COMPACT_SCHEMA = "concordia-wal/compact/1"


@click.command("compact")
@click.argument("log")
@click.option("--upto", type=click.IntRange(1, None), default=None,
              help="Committed epoch to fold into new base snapshots (default: the latest).")
@click.option("--keep", type=click.IntRange(0, MAX_KEEP_BASES), default=None,
              help="Keep the K newest base snapshots of each region and drop everything older "
                   "(0 = keep everything; default: the policy the log already has).")
@click.option("--dry-run", "dry_run", is_flag=True, help="Say what would be written and freed; change nothing.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@guarded
def compact_cmd(log, upto, keep, dry_run, as_json):
    """Fold each region's newest base and the deltas after it into a new base
    snapshot at epoch --upto, then let retention give back the segments
    nobody needs: --keep K keeps the K newest bases of each region (epochs
    before the oldest kept one are no longer restorable), --keep 0 keeps
    everything, and without --keep the policy the log already has applies
    (`info` shows it).  One superblock write switches to the result, so a
    crash leaves either the old log or the new one.  A compaction that would
    leave the log less free space than a session needs to go on is refused
    before anything is written.  Shows a progress bar (not with --json).

    Refused (exit 2) while a writer has the log open: opening for writing
    cuts any uncommitted tail, so it takes the log's writer lock.

    Example:

    \b
        concordia-wal compact file:./concordia-data/demo.log --keep 1 --dry-run
        concordia-wal compact file:./concordia-data/demo.log --keep 1
    """
    from concordia.wal.compaction import Keep, compact, decide, resolve_keep

    # --keep K is the whole policy of this run: K bases, no window of epochs
    keep_bases, keep_epochs = (None, None) if keep is None else (keep, 0)
    if dry_run:
        from concordia.wal import Log

        vol = open_volume(log)
        lg = Log.open(vol.backend, writable=False)
        try:
            policy = resolve_keep(lg, keep_bases, keep_epochs)
            rep = decide(lg, upto, keep=policy, upto_named=upto is not None).report().to_json()
            for k in ("records_written", "oldest_lsn", "seconds", "source"):
                del rep[k]
        finally:
            lg.close()
    else:
        lg = _open_log_writable(log)
        bar = Bar("compacting", enabled=not as_json)
        try:
            rep = compact(lg, upto, keep_bases=keep_bases, keep_epochs=keep_epochs, progress=bar.absolute,
                          upto_named=upto is not None).to_json()
        finally:
            bar.close()
            lg.close()
    rep = {"schema": COMPACT_SCHEMA, "dry_run": dry_run, **rep}
    if as_json:
        emit_json(rep)
    else:
        would = "would " if dry_run else ""
        policy = Keep(rep["keep_bases"], rep["keep_epochs"]).describe()
        if rep["reclaim_first"]:
            click.echo(f"room {would}switch first with no new base, freeing segments for the new ones")
        click.echo(f"compact {would}fold epoch {rep['epoch']}: "
                   f"{', '.join(rep['folded']) or 'nothing'} ({R.size(rep['bytes_written'])} of new bases)"
                   + (f"; already based: {', '.join(rep['unchanged'])}" if rep["unchanged"] else "")
                   + (f"; no state at the epoch, so no base: {', '.join(rep['absent'])}" if rep["absent"] else ""))
        click.echo(f"retention {would}keep {rep['bases_kept']} bases, drop {rep['bases_dropped']} "
                   f"(keeps {policy}); restorable from epoch {rep['floor_epoch'] or 1}")
        freed = rep["segments_freed"]
        click.echo(f"segments {would}free {len(freed)}" + (f" ({', '.join(map(str, freed))})" if freed else "")
                   + f"; {R.size(rep['free_bytes'])} free after (a session needs {R.size(rep['reserve_bytes'])})")
    sys.exit(EXIT_OK)


# --------------------------------------------------------------------------- snapshot

@click.group("snapshot")
def snapshot_grp():
    """List and create base snapshots (full images of a region at an epoch).

    Example:

    \b
        concordia-wal snapshot list file:./concordia-data/demo.log
    """


SNAPSHOTS_SCHEMA = "concordia-wal/snapshots/1"


def snapshot_rows(vol, h=None) -> list:
    """The current catalog's bases, as `snapshot list --json` prints them
    (`h`: the History a decision scanned, else the log is scanned)."""
    from concordia.wal.planner import scan

    h = h if h is not None else scan(vol, payload=False)
    out = []
    for b in sorted(h.bases, key=lambda b: (b.region_id, b.epoch)):
        r = h.regions.get(b.region_id)
        out.append({"region": r.name if r else f"#{b.region_id}", "region_id": b.region_id,
                    "epoch": b.epoch, "records": b.records, "pages": b.pages,
                    "bytes": b.pages * (r.page_bytes if r else 0), "first_lsn": b.first_lsn,
                    "last_lsn": b.last_lsn, "digest": b.digest, "image": b.image})
    return out


@snapshot_grp.command("list")
@click.argument("log")
@click.option("--json", "as_json", is_flag=True,
              help="Print the documented JSON object (schema, log, floor_epoch, snapshots, error, "
                   "exit_code) instead of a table.")
@guarded
def snapshot_list(log, as_json):
    """List the base snapshots the current catalog holds.  Read-only.

    Every checksum is checked, as info checks them: exit 0 when the log is
    clean, 1 when it holds damage that counts or its recovery refuses (one
    line on stderr names the first problem; verify lists them all).

    Example:

    \b
        concordia-wal snapshot list file:./concordia-data/demo.log --json
    """
    from concordia.wal.decide import decide

    vol = open_volume(log)
    try:
        out = decide(vol, check_pages=True)  # what info decides: R-D7, R-D8
        h = out.history
        rows = snapshot_rows(vol, h)
        where = vol.backend.where
    finally:
        vol.close()
    why = _first_problem(out)
    if as_json:
        emit_json({"schema": SNAPSHOTS_SCHEMA, "log": where, "floor_epoch": h.floor_epoch, "snapshots": rows,
                   "error": why, "exit_code": out.exit_code})
    elif not rows:
        click.echo("no base snapshots (every region is restored from its deltas)")
    else:
        click.echo("\n".join(R.table(
            [[s["region"], s["epoch"], "image" if s["image"] else "base", s["records"], s["pages"], R.size(s["bytes"]),
              f"0x{s['first_lsn']:x}..0x{s['last_lsn']:x}", f"0x{s['digest']:08x}"] for s in rows],
            ["region", "epoch", "kind", "records", "pages", "bytes", "lsn", "digest"], indent="")))
    if why is not None and not as_json:
        click.echo(f"error: {why}", err=True)
    sys.exit(out.exit_code)


def _first_problem(out) -> str | None:
    """One line for a decision that does not exit 0: the first problem that
    counts (and how many more), else why recovery refuses."""
    if out.exit_code == EXIT_OK:
        return None
    if out.problems:
        more = len(out.problems) - 1
        return str(out.problems[0]) + (f" (and {more} more; run concordia-wal verify)" if more else
                                       " (run concordia-wal verify)")
    if out.error is not None:
        return f"recovery {out.mode.value} refuses: {out.error}"
    if out.absent:
        return f"recovery {out.mode.value} restores less than the last commit: {out.absent[0].absent_reason()}"
    return f"recovery {out.mode.value} restores less than the last commit (run concordia-wal verify)"


@snapshot_grp.command("create")
@click.argument("log")
@click.option("--region", "regions", multiple=True, help="Region to snapshot (repeatable; default: all).")
@click.option("--epoch", type=click.IntRange(1, None), default=None,
              help="Committed epoch the snapshot shows (default: the latest).")
@guarded
def snapshot_create(log, regions, epoch):
    """Write a base snapshot of each region at a committed epoch, built from
    the log itself (newest base plus deltas, every page CRC-checked), and
    list it in a new catalog.  Shows a progress bar.  Refused (exit 2) while
    a writer has the log open, and before anything is written when the bases
    do not fit or would leave the log less free space than a session needs
    (a snapshot frees nothing: `compact` does).

    Example:

    \b
        concordia-wal snapshot create file:./concordia-data/demo.log --region kv
    """
    from concordia.wal.apply import absent_names, check_present
    from concordia.wal.compaction import check_snapshot_room, fold_source
    from concordia.wal.planner import plan_history, scan
    from concordia.wal.snapshot import create_base_snapshot

    lg = _open_log_writable(log)
    try:
        known = list(lg.regions)
        for name in regions:
            if name not in known:
                raise UsageError(f"no region {name!r} in this log (regions: {', '.join(known) or 'none'})",
                                 where=lg.backend.where)
        names = list(regions) or known
        p = plan_history(scan(lg), "latest" if epoch is None else epoch, "tolerate_tail", regions=names)
        if regions:   # a region named with no state at the epoch: refused, as restore refuses it
            check_present(p, names, where=lg.backend.where)
        # (every region: those with no state at the epoch, registered later, get no base: it would be invented)
        absent = absent_names(p, names)
        names = [n for n in names if n not in absent]
        check_snapshot_room(lg, names)  # every base and catalog, before the first is written
        total = sum(p.regions[n].region.pages * p.regions[n].region.page_bytes for n in names)
        made = []
        with progress_bar(total, "snapshot") as bar:
            for name in names:
                rp = p.regions[name]
                e = create_base_snapshot(lg, name, fold_source(rp), p.epoch, progress=bar.update)
                made.append((name, e))
    finally:
        lg.close()
    for name, e in made:
        click.echo(f"snapshot {name} at epoch {e.epoch}: {e.pages} pages in {e.records} records, "
                   f"lsn 0x{e.first_lsn:x}..0x{e.last_lsn:x}, digest 0x{e.digest:08x}")
    for name in absent:
        click.echo(f"snapshot {name}: no state at epoch {p.epoch} (registered later), so no base")


# --------------------------------------------------------------------------- restore

@click.command("restore")
@click.argument("log")
@click.option("--region", required=True, multiple=True, help="Region to restore (one).")
@click.option("--epoch", type=click.IntRange(1, None), default=None, help="Committed epoch (default: the latest).")
@click.option("--out", "out", required=True, type=click.Path(dir_okay=False),
              help="The .npy file to write (dtype and shape of the region).")
@click.option("--mode", type=click.Choice(MODES),
              default="tolerate-tail", show_default=True, help="Recovery mode.")
@click.option("--force", is_flag=True, help="Overwrite --out when it exists.")
@click.option("-v", "--verbose", is_flag=True,
              help="On a refusal, list after its one line every problem that counts in the mode.")
@guarded
def restore_cmd(log, region, epoch, out, mode, force, verbose):
    """Write one region's state at a committed epoch to a .npy file, every
    page checked against its CRC and the region against the digest its commit
    states.  Read-only on the log.  Shows a progress bar.  (Restoring into
    GPU arrays is done through the Session API.)

    The file is written beside --out under a temporary name, its space
    reserved first, and renamed into place only once complete and checked:
    a failed restore leaves --out as it was.  --out naming the log itself
    is refused (exit 2).

    A refusal is one line on stderr naming what and where (exit 1 for
    damage, 2 for usage or I/O); -v adds a `problem` line for each damaged
    range that counts in the mode (verify lists them all).  A region with no
    state at the epoch (registered after it) is refused, exit 1, nothing
    written: it has no bytes there to restore, zeros or other.

    Example:

    \b
        concordia-wal restore file:./concordia-data/demo.log --region kv --out kv.npy --force
        concordia-wal restore file:./concordia-data/demo.log --region adapter --out adapter.npy --mode point-in-time -v
    """
    if len(region) > 1:   # (a second --region would otherwise replace the first, unsaid)
        raise click.UsageError(f"restore writes one region to one file, not {len(region)}: give --region once")
    region = region[0]
    import numpy as np

    from concordia.devmem.outfile import check_not_input
    from concordia.wal.apply import check_present, restore_region_npy
    from concordia.wal.decide import counts, decide
    from concordia.wal.planner import scan

    check_outputs(force, out, logs=[log])  # before the scan: refused at once, in one line
    m = mode_name(mode)
    vol = open_volume(log)
    try:
        # the .npy is renamed over --out once complete: were --out the log, that
        # would replace the log by a region of it
        check_not_input(out, [vol.backend.path])
        # every page checked before deciding (R-D5): the plan and the copy meet the same damage
        h = scan(vol, check_pages=True)
        names = {r.name for r in h.regions.values()}
        if region not in names and h.result is not None and any(
                counts(d.kind, m) for d in h.result.dropped):
            # the log is damaged: its descriptors may be what was lost (R-D8: exit 1, not usage)
            click.echo(f"error: {vol.backend.where}: no region {region!r} readable in this damaged log "
                       f"(regions: {', '.join(sorted(names)) or 'none'}); run concordia-wal verify", err=True)
            _list_problems(h.result.dropped, m, verbose)
            sys.exit(1)
        if region not in names:
            raise UsageError(f"no region {region!r} in this log (regions: {', '.join(sorted(names)) or 'none'})",
                             where=vol.backend.where)
        decision = decide(vol, m, target="latest" if epoch is None else epoch, regions=[region], history=h)
        decision.raise_usage()
        p = decision.plan
        if p is None or region not in p.regions:
            why = decision.error or f"region {region!r} cannot be restored at any epoch"
            click.echo(f"error: recovery {mode} refuses: {why}", err=True)  # one line: -v or verify list the rest
            _list_problems(decision.problems, m, verbose)
            sys.exit(decision.exit_code or 1)
        rp = p.regions[region]
        check_present(p, [region], where=vol.backend.where)  # no state at the epoch: refused, nothing written
        bar = Bar("restoring")
        try:
            restore_region_npy(vol, p, region, out, progress=bar.absolute, replace=force,
                               inputs=[vol.backend.path])
        finally:
            bar.close()
    finally:
        vol.close()
    r = rp.region
    click.echo(f"restored {region} at epoch {rp.epoch}: {r.logical_dtype}{list(r.shape)}, {r.pages} pages "
               f"({rp.pages_read} read from {len(rp.sources)} records, {rp.zero_page_ids.size} zero) -> {out}")
    if np.dtype(r.dtype).name != r.logical_dtype:
        # numpy's .npy header cannot name an ml_dtypes type: the file holds the bytes in their layout
        click.echo(f"note: {out} holds the {r.logical_dtype} data in its byte layout {r.dtype} "
                   f"(numpy.load('{out}').view(ml_dtypes.{r.logical_dtype}) reads it as {r.logical_dtype})")
    for d in p.dropped:
        click.echo(f"dropped  {d.one_line()}", err=True)
    listed = {d.damage.where for d in p.dropped}
    for d in decision.problems:
        if d.where not in listed:
            click.echo(f"problem  {d}", err=True)
    if decision.exit_code and rp.epoch != decision.target_epoch:
        click.echo(f"partial  {region} restored at epoch {rp.epoch}, not {decision.target_epoch}", err=True)
    sys.exit(decision.exit_code)


def _list_problems(dropped, mode: str, verbose: bool) -> None:
    """restore -v: after a refusal's one line, the damaged ranges that count in `mode`."""
    from concordia.wal.decide import counts

    if verbose:
        for d in dropped:
            if counts(d.kind, mode):
                click.echo(f"problem  {d}", err=True)
