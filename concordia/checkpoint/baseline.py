"""Where a region's next checkpoint continues from when its array was filled
from the log by someone else: a standby's takeover hands over arrays that hold
the log's latest epoch, and `Session.adopt` continues from them as a delta."""

from __future__ import annotations

import numpy as np

from concordia.checkpoint.staging import page_crcs
from concordia.regions.errors import SessionError
from concordia.regions.streams import StreamOrder
from concordia.wal import format as fmt


def adopted(log, regions, epoch: int, *, where: str) -> tuple[dict, dict]:
    """(tables, how) for the registered `regions` said to hold `log`'s latest
    committed epoch `epoch`: each region's page CRC table, computed where it
    lives and held to the digest the log's latest commit naming it states
    (SessionError naming the region when it differs; nothing is adopted then),
    and {name: "delta" or "whole"}.  A region the log does not hold, holds
    with another page size, or whose digest no kept commit states (retention
    reclaimed them), has no table: it is written whole."""
    latest = int(log.last_committed_epoch or 0)
    if int(epoch) != latest or not latest:
        raise SessionError(f"epoch {epoch} is not the log's latest committed epoch ({latest or 'none'})",
                           where=where, hint="recover(into='registered') restores an older one")
    infos = {r.name: log.regions.get(r.name) for r in regions}
    ids = {info.id for info in infos.values() if info is not None}
    stated: dict = {}   # region id -> its digest in the latest commit that states it, in one pass back
    for c in reversed(log.commits):
        for rid in ids.intersection(c.digests).difference(stated):
            stated[rid] = c.digests[rid]
        if len(stated) == len(ids):
            break
    tables, how = {}, {}
    # the hashes follow the writes queued on each region's producer stream (each read back on the host)
    StreamOrder.for_checkpoint(regions).after_producers()
    for r in regions:
        info = infos[r.name]
        want = None if info is None or info.page_bytes != r.page_bytes else stated.get(info.id)
        if want is None:
            how[r.name] = "whole"
            continue
        crcs = page_crcs(r)
        host = np.asarray(crcs if isinstance(crcs, np.ndarray) else crcs.get(), np.uint32)
        if fmt.region_digest(host) != want:
            raise SessionError(f"the array does not hold epoch {epoch}: its pages differ from the digest the log "
                               f"states", where=f"region {r.name!r}")
        tables[r.name] = crcs
        how[r.name] = "delta"
    return tables, how
