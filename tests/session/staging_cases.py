"""One checkpoint workload run through any staging path, and what its log holds,
so the paths can be compared record for record (shared by the CPU and GPU tests)."""

from __future__ import annotations

import numpy as np

from concordia import Session
from concordia.wal import format as fmt

from .state import KINDS, LOG_SIZE, PAGE, SEGMENT, make_state, mutate

EPOCHS = 4  # a base, two deltas, one clean epoch


def run_workload(log, *, staging="auto", to_device=None, seed=0, detect=None, recover=True):
    """Checkpoint make_state(seed) and its mutations through `staging`, with the
    arrays moved by `to_device` (None: numpy).  The numpy arrays stay the truth;
    device copies are refreshed in place after every mutation.  Returns
    (stats, the log's page batches and commits, recovered arrays, truth)."""
    state = make_state(seed)
    arrays = {k: (to_device(v) if to_device else v) for k, v in state.items()}
    stats = []
    with Session(log, size=LOG_SIZE, segment_size=SEGMENT, overwrite=True, staging=staging,
                 executor="host") as s:  # the staging paths are the caller's thread's
        for name, arr in arrays.items():
            s.register(name, arr, kind=KINDS[name], page_bytes=PAGE[name], detect=(detect or {}).get(name, "auto"))
        for epoch in range(1, EPOCHS + 1):
            if 1 < epoch < EPOCHS:
                mutate(state, epoch)
                if to_device:
                    for k, v in state.items():
                        arrays[k].set(v)
            stats.append(s.checkpoint())
        contents = log_contents(s.log)
        got = {k: np.asarray(v) for k, v in s.recover().items()} if recover else None
    return stats, contents, got, state


def log_contents(log) -> dict:
    """Committed page batches (header fields other than LSN and salt, the whole
    body) in log order, and every commit's accounting and digests."""
    batches = []
    for rec in log.records(committed_only=True):
        if rec.kind == fmt.REC_PAGE_BATCH:
            b = rec.page_batch()
            batches.append({"epoch": rec.epoch, "region": rec.region_id, "flags": rec.flags,
                            "length": rec.length, "count": rec.count, "page_bytes": rec.page_bytes,
                            "ids": np.asarray(b.page_ids).tolist(), "body": bytes(rec.body)})
    commits = [(c.epoch, c.record_count, c.record_bytes, dict(c.digests)) for c in log.commits]
    return {"batches": batches, "commits": commits}


def assert_same_log(a: dict, b: dict) -> None:
    assert len(a["batches"]) == len(b["batches"]), (len(a["batches"]), len(b["batches"]))
    for x, y in zip(a["batches"], b["batches"]):
        assert {k: v for k, v in x.items() if k != "body"} == {k: v for k, v in y.items() if k != "body"}
        assert x["body"] == y["body"], (x["epoch"], x["region"])
    assert a["commits"] == b["commits"]


def page_batches_by_epoch(contents: dict) -> dict:
    out: dict = {}
    for b in contents["batches"]:
        out.setdefault(b["epoch"], {}).setdefault(b["region"], 0)
        out[b["epoch"]][b["region"]] += b["count"]
    return out
