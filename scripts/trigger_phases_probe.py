"""Where the device trigger's hold of a decode step goes (issue 32):
`bench model --parts decode` on ROWS (default every_step_resident, one
measured round of STEPS steps), each engine made with phase stamps
(`DeviceEpochs(stamps=True)`: on the driver's path each stamp adds a
one-thread launch), the last epoch's phases read after each trigger step.
The host runs ahead of the device, so a read can catch an epoch half
stamped: such samples (a phase below 0 or above 100 ms) are left out and
counted.  Prints the medians and 90th percentiles of each phase (µs) beside
the row's hold at the gate.  Diagnostic only: the figures a claim rests on
come from the bench.  Runs the Qwen3-0.6B shape on CUDA, the tiny model on
the CPU (where no engine is made: no phases).
Usage: python3 scripts/trigger_phases_probe.py [ROWS] [STEPS]"""

from __future__ import annotations

import sys

import concordia.tools.bench.model as bench
from concordia.checkpoint import device_epoch
from concordia.executor import step_trigger

rows = tuple((sys.argv[1] if len(sys.argv) > 1 else "every_step_resident").split(","))
steps = int(sys.argv[2]) if len(sys.argv) > 2 else 128
samples: dict = {}  # the engine's snapshot_max (0: the held row) -> [phases]
torn = 0
init, step = device_epoch.DeviceEpochs.__init__, step_trigger.DeviceStepTrigger.step


def stamped_init(self, session, **kw):
    kw["stamps"] = True
    init(self, session, **kw)


def sampled_step(self):
    global torn
    step(self)
    p = self.engine.phases() if self.engine.stamps is not None else None
    if p is None:
        return
    if all(0 <= us < 1e5 for us in p.values()):
        samples.setdefault(self.engine.snapshot_max, []).append(p)
    else:
        torn += 1


device_epoch.DeviceEpochs.__init__ = stamped_init
step_trigger.DeviceStepTrigger.step = sampled_step
res = bench.probe_decode(rows, steps)
for r in res["decode"]:
    t = (r["retention"] or {}).get("trigger")
    print(f"every {r['every']} {r['executor']}: overhead {r['overhead']:.4f}, trigger {t}")
print(f"phase samples: {sum(map(len, samples.values()))} kept, {torn} torn (read while the device stamped)")
for snap, ps in sorted(samples.items()):
    print(f"engines with a snapshot of at most {snap} bytes ({len(ps)} samples, both rounds)")
    for name in device_epoch.STAMPS[1:]:
        xs = sorted(p[name] for p in ps)
        print(f"  {name:>9}: median {xs[len(xs) // 2]:9.1f} us, p90 {xs[int(len(xs) * 0.9)]:9.1f} us")
