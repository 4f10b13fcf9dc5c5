"""`concordia.prefetch`: a fresh process's log opened, and its latest epoch
read ahead, on a thread, while the process builds what the state goes into
(its model, its cache); the recovery it asks for then copies
(`restore.ahead`, whose module doc says when a read ahead is used).

    p = concordia.prefetch("shm:agent-7", device="cupy")
    model = load_model(); cache = StaticCache(...)
    s = p.session()                       # the open Session
    guard = protect(s, cache, model)      # waits for the read to end
    state = restore(s, guard)             # a device-to-device copy a region
"""

from __future__ import annotations

import inspect
import threading
import time

from concordia.regions.errors import SessionError
from concordia.restore import run as restore_run
from concordia.restore.ahead import ReadAhead
from concordia.session import Session


class Prefetch:
    """`concordia.prefetch(log, ...)`: a thread opens `Session(log,
    create=False, **session_kw)` and reads its latest epoch ahead (module
    doc); `session()` waits for the open and returns the session."""

    def __init__(self, log, *, device=None, target="latest", gpu: int | None = None, **session_kw):
        try:  # a wrong keyword is told now, not after the caller's model is built
            inspect.signature(Session).bind(log, create=False, **session_kw)
        except TypeError as exc:
            raise SessionError(f"prefetch cannot open a Session with these keywords: {exc}", where=str(log),
                               hint="pass Session's own keywords (readonly=, executor=, ...), not create") from None
        self.ahead = ReadAhead(restore_run.on_device(device), target, gpu)
        self._session = None
        self._error: BaseException | None = None
        self._opened = threading.Event()
        # The thread waits for `go` before its first step: started, it would run on holding the GIL, and this
        # call, waiting in Thread.start() for it to start, would get the GIL back only at the next switch
        # interval (5 ms by default) or a call that lets it go; the caller's build should not wait for that.
        self._go = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(log, session_kw), name="concordia-prefetch",
                                        daemon=True)
        try:
            self._thread.start()
        finally:   # never a thread left waiting for a go that does not come
            self._go.set()

    def _run(self, log, session_kw) -> None:
        self._go.wait()
        t = time.perf_counter()
        try:
            s = Session(log, create=False, **session_kw)
        except BaseException as exc:  # the caller's session() raises it
            self._error = exc
            self.ahead.fail(f"the log did not open ({type(exc).__name__})")
            self._opened.set()
            return
        self.ahead.times["open_s"] = time.perf_counter() - t
        s.ahead = self.ahead
        self._session = s
        self._opened.set()
        self.ahead.run(s.log, s.runner.registration)

    def session(self):
        """The open Session (waits for the open, not the read); the open's
        own error, raised here, when it failed."""
        self._opened.wait()
        if self._error is not None:
            raise self._error
        return self._session

    def close(self) -> None:
        """Let the session and its read go without recovering (a model that
        did not build): waits for the open, then closes the session."""
        self._opened.wait()
        if self._session is not None:
            self._session.close()

    def __enter__(self) -> "Prefetch":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def wait(self) -> None:
        """Wait for the read too (the session's first call does)."""
        self._opened.wait()
        self.ahead.wait()


def prefetch(log, *, device: str | None = None, target="latest", gpu: int | None = None,
             **session_kw) -> Prefetch:
    """Open `log` and read its `target` epoch ahead, on a thread, while the
    caller builds what the state goes into (module doc).  device="cupy":
    onto GPU `gpu` (None: the first visible one), for CUDA tensors and CuPy
    arrays there; else to the host.  session_kw: what `Session(log,
    create=False, ...)` takes (readonly=True).  A session that writes to the
    log before it recovers lets the read go (it holds a copy of the state)."""
    return Prefetch(log, device=device, target=target, gpu=gpu, **session_kw)
