"""The demo and the reference workload it protects, apart from the runtime.

`run` is `concordia demo` (a decode loop killed with SIGKILL and recovered
bit-exact; its children are `python -m concordia.demo worker|resume ...`);
`workload` is the reference workload (a small paged-KV decoder with a LoRA
adapter updated online) that the demo, the tests and `bench recover` drive.
"""

from .run import format_report, pick_kill_step, run_demo, warm_model

__all__ = ["format_report", "pick_kill_step", "run_demo", "warm_model"]
