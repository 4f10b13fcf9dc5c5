"""How a session takes regions on: `Session.register` (one) and
`Session.register_all` (several, all or none), through `enroll`.

Each region is made in full before any is taken on (`_made`: its arguments
checked, its array adapted, its detector resolved, and, when the log holds
the region already, held to the log's descriptor).  Then, for all of them at
once: the names are held unique, one image of the state with them all must
fit the log (`Retention.check_capacity`), store trackers start, and the log
gets a descriptor of each region it lacks.  Only then does the session list
them; a failure on the way lists none, and stops the trackers it started.
A descriptor already written stays in the log, uncommitted until the next
commit, and a later register of that name finds it (`Log.region_named`).

One call for a model's regions (a Qwen3's 173) settles, checks the log's
room and counts the regions once, not once a region.
"""

from __future__ import annotations

import numpy as np

from concordia.checkpoint.staging import batch_pages
from concordia.regions.arrays import adapt, logical_of, storage_of
from concordia.regions.errors import DuplicateRegionError, SessionError, UnsupportedArrayError
from concordia.regions.region import DETECTORS, KINDS, Region, check_same, resolve_detector
from concordia.regions.streams import StreamOrder
from concordia.wal import format as fmt

#: what `register` takes beside name and array, with its defaults
OPTIONS = dict(kind="opaque", page_bytes=4096, detect="auto", block_tables=None, seq_lens=None, block_stamp=None,
               seq_ids=None, slot_versions=None, pages_per_slot=None, length=None, check_every=None, stream=None)
ARGUMENTS = frozenset(OPTIONS) | {"name", "array"}


def enroll(session, specs: list, writer) -> list[Region]:
    """Take on the regions `specs` ([{"name": ..., "array": ..., and any of
    `OPTIONS`}]) with `session` (open and settled by the caller), all or
    none (the module doc); `writer(doing)` is the log, writable.  Returns
    the new regions in order."""
    log, known = session.log, session.region_set
    capacity = log.volume.segment_bytes - fmt.SEGMENT_HEADER_SIZE
    fits: set = set()   # page sizes whose page fits a record of a segment
    made, names = [], set()
    for spec in specs:
        region, info = _made(log, spec, capacity, fits, lambda n: n in known or n in names)
        names.add(region.name)
        made.append((region, info))
    session.retention.check_capacity([(r.name, r.array.nbytes, r.page_bytes) for r, _ in made])
    started = []
    try:
        for region, info in made:
            if region.detect == "stores":
                region.track_stores(region.check_every)
                started.append(region)
        if session.resident is not None:  # a new kind's handler is in the table before an epoch can see it
            session.resident.regions_added([region for region, _ in made])   # (a handler unused is harmless)
        for region, info in made:   # last: a descriptor written stays in the log
            if info is not None:
                region.id = int(info.id)
            else:  # the log lacks it: a descriptor is written
                region.id = int(writer(f"register region {region.name!r}").define_region(
                    region.name, region.array.dtype.str, region.shape, region.page_bytes, region.kind,
                    logical=region.logical, framework=region.framework))
    except BaseException:
        for region in started:
            region.untrack()
        raise
    out = [region for region, _ in made]
    if out:   # (none: the cached routes stay as they are)
        known.add_all(out)
    return out


def _made(log, spec: dict, capacity: int, fits: set, taken) -> tuple:
    """(Region, the log's descriptor of it or None) of one `register`
    call's arguments, each checked (`taken(name)`: whether the name is
    registered already); nothing is started or written."""
    if not isinstance(spec, dict):
        raise SessionError(f"a region to register is a dict of register's arguments, not a {type(spec).__name__}",
                           hint='register_all([{"name": "kv", "array": kv, "kind": "kv"}, ...])')
    unknown = spec.keys() - ARGUMENTS
    if unknown or "name" not in spec or "array" not in spec:
        what = f"unknown argument {sorted(unknown)[0]!r}" if unknown else "a region needs a name and an array"
        raise SessionError(what, where=f"region {spec.get('name')!r}")
    o = {**OPTIONS, **spec}
    name, kind, page_bytes, detect = o["name"], o["kind"], o["page_bytes"], o["detect"]
    where = f"region {name!r}"
    if not isinstance(name, str) or not name or len(name) > 255:
        raise SessionError("a region name is a non-empty string of at most 255 characters", where=where)
    if kind not in KINDS:
        raise SessionError(f"unknown kind {kind!r} (use {', '.join(KINDS)})", where=where)
    if detect not in DETECTORS:
        raise SessionError(f"unknown detector {detect!r} (use {', '.join(DETECTORS)})", where=where)
    if not isinstance(page_bytes, (int, np.integer)) or page_bytes <= 0 or page_bytes % 64:
        raise SessionError(f"page_bytes must be a positive multiple of 64, not {page_bytes!r}", where=where)
    page_bytes = int(page_bytes)
    if page_bytes not in fits:   # one page must fit a record of a segment
        batch_pages(page_bytes, capacity, where)
        fits.add(page_bytes)
    if taken(name):
        raise DuplicateRegionError("a region of this name is already registered", where=where)
    info = log.region_named(name)   # in a recovering session: its dtype was checked when written
    arr, xp, owner = adapt(o["array"], where, None if info is None else info.logical_dtype)
    if not arr.flags.c_contiguous:
        raise UnsupportedArrayError("the array is not C-contiguous", where=where,
                                    hint="protect the contiguous base array")
    if arr.nbytes == 0:
        raise UnsupportedArrayError("the array is empty", where=where)
    if arr.dtype.kind not in "biufc":
        raise UnsupportedArrayError(f"dtype {arr.dtype} cannot be logged", where=where)
    logical, framework = logical_of(owner, None if info is None else info.logical_dtype)
    detect, hints = resolve_detector(kind, detect, where, arr, xp, block_tables=o["block_tables"],
                                     seq_lens=o["seq_lens"], block_stamp=o["block_stamp"], seq_ids=o["seq_ids"],
                                     slot_versions=o["slot_versions"], pages_per_slot=o["pages_per_slot"],
                                     check_every=o["check_every"], length=o["length"], page_bytes=page_bytes)
    stream = o["stream"]
    region = Region(name=name, kind=kind, page_bytes=page_bytes, array=arr, xp=xp, owner=owner,
                    storage=storage_of(owner), detect=detect, hints=hints, logical=logical,
                    framework=framework, stream=stream, check_every=hints.get("check_every", 0))
    if stream is not None:
        StreamOrder.of([(owner, stream)])  # refuse a stream of an unknown kind now
    if info is not None:
        check_same(info, region)
    return region, info
