"""A model of log histories for planner tests.

`ModelHistory` builds a planner `History` straight from operations (write
pages, commit, take a base snapshot, compact with retention) and keeps, beside
it, the brute-force state of every region at every committed epoch: the oracle
a plan's restore must equal.  `ops_strategy` draws random operation lists for
hypothesis; `drive(ops, sink)` plays them against any sink with the same
methods (the model, or a real log wrapped by the tests).
"""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from concordia.wal.format import page_crcs_of, region_digest
from concordia.wal.planner import BaseEntry, Commit, History, RegionMeta, ScannedBatch

PAGE = 64  # small pages keep the property tests fast

REGIONS = [
    ("kv", "<u2", (7, 32)),  # 448 bytes: 7 pages, last one full
    ("ad", "<f4", (50,)),  # 200 bytes: 4 pages, last one short
    ("tb", "|u1", (130,)),  # 130 bytes: 3 pages, last one short
]


def padded_pages(arr: np.ndarray, page_bytes: int) -> np.ndarray:
    flat = np.ascontiguousarray(arr).reshape(-1).view(np.uint8)
    n = -(-flat.size // page_bytes)
    out = np.zeros(n * page_bytes, np.uint8)
    out[: flat.size] = flat
    return out.reshape(n, page_bytes)


def digest_of(arr: np.ndarray, page_bytes: int) -> int:
    return region_digest(page_crcs_of(padded_pages(arr, page_bytes)))


class State:
    """Live region contents the operations change (the 'GPU')."""

    def __init__(self):
        self.arrays = {n: np.zeros(shape, dtype) for n, dtype, shape in REGIONS}

    def write(self, name, page_ids, seed):
        a = self.arrays[name]
        flat = a.reshape(-1).view(np.uint8)
        rng = np.random.default_rng(seed)
        for p in page_ids:
            lo, hi = p * PAGE, min((p + 1) * PAGE, flat.size)
            flat[lo:hi] = rng.integers(0, 256, hi - lo, dtype=np.uint8)


# ops: ("write", region, page_ids tuple, seed) | ("commit",) | ("snapshot", region)
#      | ("compact", keep) -- keep = number of bases retained per region (0 = keep all)


@st.composite
def ops_strategy(draw, max_ops=30):
    ops = []
    n = draw(st.integers(4, max_ops))
    for _ in range(n):
        kind = draw(st.sampled_from(["write", "write", "write", "commit", "commit", "snapshot", "compact"]))
        if kind == "write":
            name, dtype, shape = draw(st.sampled_from(REGIONS))
            pages = -(-int(np.prod(shape)) * np.dtype(dtype).itemsize // PAGE)
            ids = draw(st.sets(st.integers(0, pages - 1), min_size=1, max_size=pages))
            ops.append(("write", name, tuple(sorted(ids)), draw(st.integers(0, 2**31))))
        elif kind == "commit":
            ops.append(("commit",))
        elif kind == "snapshot":
            ops.append(("snapshot", draw(st.sampled_from([r[0] for r in REGIONS]))))
        else:
            ops.append(("compact", draw(st.sampled_from([0, 1, 2]))))
    ops.append(("commit",))
    return ops


def drive(ops, sink):
    """Play ops against `sink` (write(name, ids, pages_u8) / commit(digests) /
    snapshot(name) / compact(keep)), keeping the live state and the oracle.
    Returns {epoch: {name: array copy}} for every committed epoch."""
    state = State()
    pending = {}  # name -> set of page ids dirty since the last commit
    oracle = {}
    epoch = 0
    for op in ops:
        if op[0] == "write":
            _, name, ids, seed = op
            state.write(name, ids, seed)
            pending.setdefault(name, set()).update(ids)
        elif op[0] == "commit":
            epoch += 1
            page_bytes = PAGE
            for name in sorted(pending):
                ids = np.array(sorted(pending[name]), dtype=np.int64)
                pages = padded_pages(state.arrays[name], page_bytes)[ids]
                sink.write(epoch, name, ids, pages)
            digests = {n: digest_of(a, PAGE) for n, a in state.arrays.items()}
            sink.commit(epoch, digests)
            pending = {}
            oracle[epoch] = {n: a.copy() for n, a in state.arrays.items()}
        elif op[0] == "snapshot":
            if epoch:
                sink.snapshot(op[1], epoch, oracle[epoch][op[1]])
        elif op[0] == "compact":
            if epoch:
                sink.compact(epoch, op[1], oracle[epoch])
    return oracle


class ModelHistory:
    """A sink that builds a planner History in memory."""

    def __init__(self):
        self.regions = {}
        for i, (name, dtype, shape) in enumerate(REGIONS):
            nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
            self.regions[i] = RegionMeta(i, name, dtype, tuple(shape), PAGE, nbytes)
        self.id_of = {r.name: r.id for r in self.regions.values()}
        self.batches = []
        self.commits = {}
        self.bases = []
        self.floor = 0
        self.lsn = 4096
        self.epoch_first = None
        self.segment_of_lsn = lambda lsn: lsn // 65536

    def _batch(self, epoch, rid, ids, pages, base):
        ids = np.asarray(ids, dtype=np.uint32)
        pages = np.ascontiguousarray(pages, dtype=np.uint8)
        length = 64 + ((8 * ids.size + 63) // 64) * 64 + pages.size
        b = ScannedBatch(lsn=self.lsn, epoch=epoch, region_id=rid, base=base, page_ids=ids,
                  page_crcs=page_crcs_of(pages), page_bytes=PAGE, segment=self.segment_of_lsn(self.lsn),
                  offset=self.lsn, length=length, payload=pages)
        self.lsn += length
        self.batches.append(b)
        return b

    def write(self, epoch, name, ids, pages):
        if self.epoch_first is None:
            self.epoch_first = self.lsn
        self._batch(epoch, self.id_of[name], ids, pages, False)

    def commit(self, epoch, digests):
        first = self.epoch_first if self.epoch_first is not None else self.lsn
        n = sum(1 for b in self.batches if not b.base and b.epoch == epoch)
        self.commits[epoch] = Commit(epoch=epoch, lsn=self.lsn, first_lsn=first,
                                     digests={self.id_of[k]: v for k, v in digests.items()},
                                     records=n, segment=self.segment_of_lsn(self.lsn), offset=self.lsn)
        self.lsn += 128
        self.epoch_first = None

    def snapshot(self, name, epoch, arr):
        rid = self.id_of[name]
        pages = padded_pages(arr, PAGE)
        first = self.lsn
        recs = 0
        for lo in range(0, pages.shape[0], 3):  # several records per base
            ids = np.arange(lo, min(lo + 3, pages.shape[0]))
            self._batch(epoch, rid, ids, pages[ids], True)
            recs += 1
        self.bases = [b for b in self.bases if not (b.region_id == rid and b.epoch == epoch)]
        self.bases.append(BaseEntry(rid, epoch, first, self.lsn - 1, recs, pages.shape[0],
                                    digest_of(arr, PAGE)))

    def compact(self, epoch, keep, arrays=None):
        """Bases at `epoch` for every region (the oracle supplies contents), then
        retention: keep the newest `keep` bases per region (0 = all)."""
        for name, arr in (arrays or {}).items():
            self.snapshot(name, epoch, arr)
        if keep:
            kept = []
            for rid in self.regions:
                mine = sorted((b for b in self.bases if b.region_id == rid), key=lambda b: -b.epoch)
                kept += mine[:keep]
            self.bases = kept
            # every region has a base at the compaction epoch; the floor is the
            # oldest epoch every region can still be restored at
            self.floor = max(min(b.epoch for b in self.bases if b.region_id == rid) for rid in self.regions)
            # reclaim: per region the deltas up to its newest base at or below the
            # floor, commits below the floor, bases no longer listed
            cut = {rid: max(b.epoch for b in self.bases if b.region_id == rid and b.epoch <= self.floor)
                   for rid in self.regions}
            live = {(b.region_id, b.epoch) for b in self.bases}
            self.batches = [b for b in self.batches
                            if (b.base and (b.region_id, b.epoch) in live)
                            or (not b.base and b.epoch > cut[b.region_id])]
            # a commit stays while any region may still read a delta of its
            # epoch (as compact.needed_from keeps it on media): dropping it would
            # make that delta look uncommitted
            min_cut = min(cut.values())
            self.commits = {e: c for e, c in self.commits.items() if e >= self.floor or e > min_cut}

    def history(self, damage=()):
        return History(regions=dict(self.regions), batches=list(self.batches), commits=dict(self.commits),
                       bases=list(self.bases), damage=list(damage), floor_epoch=self.floor)


