"""Many regions of mixed detectors and page sizes, checkpointed through any
staging path (shared by the CPU and GPU table-pass tests)."""

from __future__ import annotations

import numpy as np

from concordia import Policy, Session

from .staging_cases import log_contents

PAGE_SIZES = (64, 256, 4096)
DETECTORS = ("shadow", "fingerprint", "versions")


def make_regions(n: int, seed: int = 0) -> list[dict]:
    """n regions: detectors and page sizes in turn, sizes that are often not a
    whole number of pages, a dtype of 1, 2 or 4 bytes."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        pb = PAGE_SIZES[i % len(PAGE_SIZES)]
        detect = DETECTORS[(i // len(PAGE_SIZES)) % len(DETECTORS)]
        dtype = (np.uint8, np.int16, np.float32)[i % 3]
        itemsize = np.dtype(dtype).itemsize
        nbytes = int(rng.integers(1, 12)) * pb + int(rng.integers(0, pb // itemsize)) * itemsize
        arr = rng.integers(0, 255, size=max(1, nbytes // itemsize)).astype(dtype)
        spec = {"name": f"t{i:05d}", "array": arr, "page_bytes": pb, "detect": detect}
        if detect == "versions":
            pages = -(-arr.nbytes // pb)
            spec["slots"] = np.zeros(pages, np.int64)  # one page per slot
        out.append(spec)
    return out


def mutate(specs: list[dict], epoch: int) -> None:
    """Change a few pages of about a third of the regions (none of some epochs'
    regions at all), bumping the version of every slot a versions region wrote."""
    rng = np.random.default_rng(1000 + epoch)
    for s in specs:
        if rng.random() > 0.35:
            continue
        flat = s["array"].reshape(-1).view(np.uint8)
        pb = s["page_bytes"]
        for _ in range(int(rng.integers(1, 4))):
            at = int(rng.integers(0, flat.size))
            flat[at] ^= 0x5A
            if "slots" in s:
                s["slots"][at // pb] += 1


def run(log, specs, *, epochs: int = 4, staging="auto", to_device=None, retain: bool = False):
    """Checkpoint `specs` `epochs` times (mutating before all but the first and
    last), then recover.  Arrays move to the device with `to_device`, which
    are refreshed from the numpy truth after every mutation.  Returns (stats,
    log contents, recovered arrays, truth).  Retention is off unless
    `retain`: its base slices are paced by the measured write rate, so two
    paths' logs hold the same checkpoint records but not always the same
    base slices beside them (retention's own tests hold those)."""
    live = {s["name"]: (to_device(s["array"]) if to_device else s["array"]) for s in specs}
    slots = {s["name"]: (to_device(s["slots"]) if to_device else s["slots"]) for s in specs if "slots" in s}
    total = sum(s["array"].nbytes for s in specs)
    stats = []
    size = -(-max(64 << 20, 8 * total) // (16 << 20)) * (16 << 20)
    with Session(log, size=size, segment_size=16 << 20, overwrite=True, staging=staging,
                 policy=Policy(retain=retain), executor="host") as ses:  # the table pass of the caller's thread
        for s in specs:
            kw = {}
            if s["detect"] == "versions":
                kw = {"kind": "adapter", "slot_versions": slots[s["name"]], "pages_per_slot": 1}
            ses.register(s["name"], live[s["name"]], page_bytes=s["page_bytes"], detect=s["detect"], **kw)
        for epoch in range(1, epochs + 1):
            if 1 < epoch < epochs:
                mutate(specs, epoch)
                if to_device:
                    for s in specs:
                        live[s["name"]].set(s["array"])
                        if "slots" in s:
                            slots[s["name"]].set(s["slots"])
            stats.append(ses.checkpoint())
        contents = log_contents(ses.log)
        got = {k: np.asarray(v) for k, v in ses.recover().items()}
    return stats, contents, got, {s["name"]: s["array"] for s in specs}
