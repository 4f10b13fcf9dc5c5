"""The persistent executor: a resident kernel (or a CPU thread) fed by a lock-free task ring.

    ring.py   layout of the ring in memory and the pure protocol steps
    host.py   Submitter (back-pressure, waits, lazy relaunch, STOP, hot swap), Watchdog
    cpu.py    CpuExecutor, OperatorTable, numpy handlers
    persistent.py  GpuExecutor (gpu_kernels/executor.cu), GpuRing, ExecutorModule (CuPy, lazily)
    smtarget.py  SmTarget: cuBLAS plans GEMMs for fewer SMs while an executor is resident

Example::

    ring = Ring.allocate(1024)
    sub = Submitter(ring, CpuExecutor(ring, numpy_operators()))
    sub.call(Op.PING)
    sub.stop()
"""

from concordia.lazy import exports, homes_of

from .errors import (ExecutorError, ExecutorStalledError, ExecutorStoppedError, ProtocolError, RingFullError,
                     RingLayoutError)

# the rest loads on first use (`concordia.lazy`): importing the errors loads no executor
__getattr__, __dir__ = exports(__name__, homes_of({
    "cpu": ("CpuExecutor", "OperatorTable", "numpy_operators"),
    "host": ("Submitter", "SwapReport", "Watchdog"),
    "ring": ("Completion", "ConsumerState", "Op", "Result", "Ring", "Status", "TaskView"),
}))

__all__ = ["CpuExecutor", "OperatorTable", "numpy_operators", "ExecutorError", "ExecutorStalledError",
           "ExecutorStoppedError", "ProtocolError", "RingFullError", "RingLayoutError", "Submitter", "SwapReport",
           "Watchdog", "Completion", "ConsumerState", "Op", "Result", "Ring", "Status", "TaskView"]
