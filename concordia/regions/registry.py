"""`RegionSet`: the regions one session protects, and the one owner of their
baselines.

A region's baseline is what the next checkpoint builds on: the page CRC table
of the last committed epoch and its digest (`Region.crcs`, `Region.digest`;
None while the log holds no state of the region this session can build on,
so that its next checkpoint writes every page).  Only the methods below assign
them, each named for what happened:

    start_base      a checkpoint writes the region whole: a zero table to fill
    keep_table      the same CRCs, moved to where a pass keeps them (host or device)
    staged          a checkpoint staged the region's pages: its new digest
    take_digests    a table pass hands its digests back (another path takes over)
    lose            a checkpoint failed (detectors may have moved past pages that
                    never committed), or the log moved under the session
    recovered       the registered arrays were restored from the log

The checkpoint pipeline fills a table it was given in place (the CRCs of the
pages it stages); every other change goes through here.

`version` rises whenever the regions or their baselines change other than by
a table pass: the checkpoint runner rebuilds its cached routes and region
table then.  `next_epoch` is the epoch the next checkpoint takes at the least
(never reused, even when an epoch fails).  `lock` is held while the regions
change and while an epoch runs over them (a resident executor's trigger runs
epochs on its own thread).
"""

from __future__ import annotations

import threading

from concordia.regions.region import Region


class RegionSet:
    """Regions by name, in registration order (see the module doc)."""

    def __init__(self, next_epoch: int = 1):
        self._by_name: dict[str, Region] = {}
        self.version = 0
        self.next_epoch = int(next_epoch)
        self.lock = threading.RLock()

    # -- the set -----------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._by_name)

    def __iter__(self):
        return iter(self._by_name.values())

    def __contains__(self, name) -> bool:
        return name in self._by_name

    def __getitem__(self, name: str) -> Region:
        return self._by_name[name]

    def get(self, name: str) -> Region | None:
        return self._by_name.get(name)

    @property
    def names(self) -> list[str]:
        return list(self._by_name)

    def as_dict(self) -> dict[str, Region]:
        """{name: Region}, a copy."""
        return dict(self._by_name)

    def kinds(self) -> dict[str, int]:
        """{kind: how many regions of it}."""
        out: dict[str, int] = {}
        for r in self._by_name.values():
            out[r.kind] = out.get(r.kind, 0) + 1
        return out

    @property
    def any_on_gpu(self) -> bool:
        return any(r.on_gpu for r in self._by_name.values())

    def add_all(self, regions) -> None:
        """List new regions, in order (the caller checked their names are free)."""
        with self.lock:
            for region in regions:
                self._by_name[region.name] = region
            self.version += 1

    def release(self) -> None:
        """Let go of every region (a closed session's): their arrays, shadows
        and baselines are no longer held here, so the caller's memory is freed
        when the caller lets go of it, without waiting for a garbage collection.
        Not under `lock`: a resident executor that could not stop holds it
        (`Session.close` then raises its error, and must not hang here); the
        dict is replaced, so an iteration still running goes on over the old one."""
        self._by_name = {}
        self.version += 1

    def changed(self) -> None:
        """The regions' checkpoint state changed other than through the methods
        below (a per-region pass may replace detector state): caches rebuild."""
        self.version += 1

    # -- epochs ------------------------------------------------------------------
    def take_epoch(self, log_next: int) -> int:
        """The epoch of the checkpoint starting now: the later of this set's next
        and the log's (`log_next`, what any writer of the log has tried); never
        taken again, even when this one fails."""
        epoch = max(self.next_epoch, int(log_next))
        self.next_epoch = epoch + 1
        return epoch

    # -- baselines ---------------------------------------------------------------
    @staticmethod
    def start_base(r: Region, table) -> None:
        """`r` is written whole this checkpoint: `table` (zeros, where the pass
        works) is filled with the CRC of every page it stages."""
        r.crcs = table
        r.digest = None

    @staticmethod
    def keep_table(r: Region, table) -> None:
        """`table` holds the same CRCs as `r`'s baseline, where the pass keeps it
        (a host table moved to the device, or back)."""
        r.crcs = table

    @staticmethod
    def staged(r: Region, digest: int) -> None:
        """`r`'s pages of this checkpoint are staged: the digest of its table."""
        r.digest = int(digest)

    @staticmethod
    def take_digests(regions, digests) -> None:
        """Each region in `regions` gets its digest from `digests` (a table pass
        hands its digests back when another path takes over)."""
        for r, d in zip(regions, digests):
            r.digest = int(d)

    def lose(self) -> None:
        """Every region's next checkpoint writes it whole: a checkpoint failed
        after its detectors may have advanced past pages that never committed,
        or another writer committed to the log since this session's last."""
        self.version += 1
        for r in self._by_name.values():
            r.crcs = None
            r.digest = None

    def recovered(self, tables: dict) -> None:
        """The registered arrays now hold a recovered epoch: `tables` maps each
        region's name to the CRC table of its new contents when the next
        checkpoint may continue from them as a delta (the log's latest epoch),
        else None (it writes the region whole)."""
        self.version += 1
        for name, r in self._by_name.items():
            r.crcs = tables.get(name)
            r.digest = None
