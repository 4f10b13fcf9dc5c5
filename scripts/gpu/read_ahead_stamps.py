"""The child of `read_ahead_probe.py stamps`: `python -m concordia.demo.kills`
with its arguments after OUT_FILE, with the functions a read-ahead recovery
calls (STAMPED) wrapped in a clock while protect() and restore() run, so that
the times unprofiled add up where cProfile's overhead (2x) hides them.  A
wrapper costs about a microsecond a call; the children of a function are in its
time (inclusive).  Writes one line a function, slowest first, to OUT_FILE.

    python3 scripts/gpu/read_ahead_stamps.py OUT_FILE recover --log ... --prefetch
"""

from __future__ import annotations

import functools
import importlib
import sys
import time

#: (module, attribute path) of what is clocked; a function imported by name into another module is
#: clocked where it is called from (concordia.session's adapt, say)
STAMPED = [
    ("concordia.integrations.transformers", "protect"),
    ("concordia.integrations.transformers", "restore"),
    ("concordia.integrations.transformers", "_lora_parameters"),
    # the LoRA weights' move into one tensor (8.5 ms unstamped in protect at aed0bb9, a fresh H100 child)
    ("concordia.integrations.transformers", "_lora_flat"),
    ("concordia.integrations.transformers", "_unmovable"),
    ("concordia.integrations.transformers", "_laid_out"),
    ("concordia.integrations.transformers", "_initialise"),
    ("concordia.integrations.transformers", "_count_resets"),
    ("concordia.integrations.transformers", "_resume_compiled"),
    ("concordia.integrations.transformers", "Guard._sync_counters"),
    ("concordia.integrations.transformers", "Guard._restore_rng"),
    ("concordia.session", "Session.register"),
    ("concordia.session", "Session.recover"),
    ("concordia.session", "Session.refresh"),
    ("concordia.session", "Session.settle"),
    ("concordia.session", "Session._continue_from"),
    ("concordia.session", "Session.before_checkpoint"),
    ("concordia.session_register", "enroll"),
    ("concordia.session_register", "_made"),
    ("concordia.session_register", "adapt"),
    ("concordia.session_register", "logical_of"),
    ("concordia.session_register", "storage_of"),
    ("concordia.session_register", "check_same"),
    ("concordia.session_register", "resolve_detector"),
    ("concordia.session_register", "batch_pages"),
    ("concordia.session", "page_crcs"),
    ("concordia.session_register", "Region.__init__"),
    ("concordia.retention", "Retention.check_capacity"),
    ("concordia.regions.registry", "RegionSet.add_all"),
    ("concordia.regions.registry", "RegionSet.recovered"),
    ("concordia.regions.region", "Region.unchanged_view"),
    ("concordia.regions.streams", "StreamOrder.for_checkpoint"),
    ("concordia.regions.streams", "StreamOrder.after_producers"),
    ("concordia.regions.streams", "StreamOrder.before_later_work"),
    ("concordia.checkpoint.detect", "reset"),
    ("concordia.checkpoint.epoch", "EpochRunner.forget_table"),
    ("concordia.checkpoint.epoch", "EpochRunner.stream_order"),
    ("concordia.restore.run", "recover"),
    ("concordia.restore.run", "into_targets"),
    ("concordia.gpu_kernels.gpu", "copy_checked_spans"),
    ("concordia.gpu_kernels.gpu", "copy_engine"),
    # what copy_checked_spans calls (one launch, with copy_spans' checks, took 0.87 ms at 173 pairs at
    # f3d8da0, as long as the copies it replaces): the rows' table, the kernel's lookup and the table's
    # upload; the rest is its loop over the pairs.  The last two are clocked at every call while the clock
    # runs (protect and restore, the read ahead done by then): their calls' counts say how many were not its
    ("concordia.gpu_kernels.reference", "span_rows"),
    ("concordia.gpu_kernels.jit", "function"),
    ("cupy", "asarray"),
    ("concordia.restore.run", "absent_regions"),
    ("concordia.restore.run", "split_targets"),
    ("concordia.restore.run", "check_view"),
    ("concordia.restore.run", "check_presentable"),
    ("concordia.restore.run", "phases_of"),
    ("concordia.restore.ahead", "ReadAhead.take"),
    ("concordia.restore.ahead", "ReadAhead._why_not"),
    ("concordia.restore.ahead", "ReadAhead.wait"),
    ("concordia.restore.ahead", "ReadAhead.take_seeds"),
    ("concordia.restore.ahead", "Seeds.only"),
    ("concordia.restore.ahead", "Seeds.crcs"),
    ("concordia.wal.log", "Log.region_named"),
    ("concordia.wal.log", "Log.moved_on"),
]
#: PyTorch's tensor methods the integration calls (host reads wait for the device's queue)
TENSOR_METHODS = ["cpu", "tolist", "clone", "copy_", "fill_", "zero_"]
#: PyTorch's functions that allocate or launch in the integration (a kernel's first launch loads it)
TORCH_FUNCTIONS = ["cat", "stack", "zeros", "empty"]

clock: dict = {}
on = [False]


def stamped(name: str, fn):
    @functools.wraps(fn)
    def wrapper(*a, **kw):
        if not on[0]:
            return fn(*a, **kw)
        t = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            n, s = clock.get(name, (0, 0.0))
            clock[name] = (n + 1, s + time.perf_counter() - t)
    return wrapper


def install() -> None:
    for module, path in STAMPED:
        owner = importlib.import_module(module)
        *outer, attr = path.split(".")
        for part in outer:
            owner = getattr(owner, part)
        raw = owner.__dict__.get(attr) if isinstance(owner, type) else getattr(owner, attr)
        if isinstance(raw, (staticmethod, classmethod)):
            setattr(owner, attr, type(raw)(stamped(f"{module}.{path}", raw.__func__)))
        else:
            setattr(owner, attr, stamped(f"{module}.{path}", raw if raw is not None else getattr(owner, attr)))
    import torch
    import torch.utils._device

    # `with torch.device(...)` places what torch's constructors make by their identity, in a set built once, at
    # its first use: built after the wrapping it would miss the real torch.zeros and torch.empty, and every
    # tensor made under it (the demo's model and cache) would land on the CPU; built now, it holds them
    torch.utils._device._device_constructors()
    for m in TENSOR_METHODS:
        setattr(torch.Tensor, m, stamped(f"torch.Tensor.{m}", getattr(torch.Tensor, m)))
    for f in TORCH_FUNCTIONS:
        setattr(torch, f, stamped(f"torch.{f}", getattr(torch, f)))
    sync = torch.cuda.synchronize
    torch.cuda.synchronize = stamped("torch.cuda.synchronize", sync)


def main(out: str, argv: list) -> int:
    install()
    import concordia.demo.kills as kills

    inner, digest = kills._protect_and_restore, kills._digest
    began = []

    def clocked(*a, **kw):
        on[0] = True
        began.append(time.perf_counter())
        try:
            return inner(*a, **kw)
        finally:
            on[0] = False
            with open(out, "w") as f:
                for name, (n, s) in sorted(clock.items(), key=lambda kv: -kv[1][1]):
                    f.write(f"{s * 1e3:9.3f} ms {n:6d} calls  {name}\n")

    def digest_unclocked(*a, **kw):   # taken after protect() and restore(), outside their clock
        if on[0]:
            on[0] = False
            clock["(protect and restore)"] = (1, time.perf_counter() - began[-1])
        return digest(*a, **kw)

    kills._protect_and_restore, kills._digest = clocked, digest_unclocked
    return kills.main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:]))
