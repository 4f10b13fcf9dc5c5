"""Where a fresh process's first model step goes on the GPU (the demo's
'reintegrate' phase): import, context, cuBLAS's first GEMM, the workload's
first forward, the next step; under CUDA_MODULE_LOADING=EAGER and LAZY, each
in a fresh child.  Usage: python3 scripts/first_step_probe.py OUT.json"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time


def child() -> dict:
    t = {}
    t0 = time.perf_counter()
    import cupy as cp

    t["import_cupy_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    cp.zeros(1).sum()
    cp.cuda.Device().synchronize()
    t["context_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    a = cp.ones((64, 512), cp.float32)
    (a @ cp.ones((512, 512), cp.float32)).sum()
    cp.cuda.Device().synchronize()
    t["first_gemm_s"] = time.perf_counter() - t0
    from concordia.demo import warm_model
    from concordia.demo.workload import Workload, WorkloadConfig

    t0 = time.perf_counter()
    wl = Workload(WorkloadConfig(seed=0), xp=cp)
    cp.cuda.Device().synchronize()
    t["workload_init_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    t["warm_steps"] = warm_model(wl)
    cp.cuda.Device().synchronize()
    t["warm_model_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    wl.step()
    cp.cuda.Device().synchronize()
    t["next_step_s"] = time.perf_counter() - t0
    return t


def main(out: str) -> None:
    rows = []
    for loading in ("EAGER", "LAZY", "EAGER", "LAZY"):
        env = dict(os.environ, CUDA_MODULE_LOADING=loading)
        t0 = time.perf_counter()
        p = subprocess.run([sys.executable, __file__, "--child"], capture_output=True, text=True, env=env,
                           timeout=120)
        try:
            row = json.loads(p.stdout.strip().splitlines()[-1])
        except (IndexError, json.JSONDecodeError):
            row = {"error": (p.stderr or p.stdout)[-600:]}
        row.update(module_loading=loading, process_s=time.perf_counter() - t0)
        print(json.dumps(row), flush=True)
        rows.append(row)
    with open(out, "w") as f:
        json.dump({"rows": rows}, f, indent=1)


if __name__ == "__main__":
    if sys.argv[1] == "--child":
        print(json.dumps(child()))
    else:
        main(sys.argv[1])
