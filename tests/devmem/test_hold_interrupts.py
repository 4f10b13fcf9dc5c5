"""`outfile.hold_interrupts`: the two steps that make a name and remember it
hold Ctrl-C and SIGTERM back.  Real signals, raised by this process at itself
inside the block (`signal.raise_signal` runs a handler before it returns, so
nothing here depends on timing); the process's own handlers are put back
after each test."""

from __future__ import annotations

import signal
import threading

import pytest

from concordia.devmem.outfile import hold_interrupts

SIGNALS = (signal.SIGINT, signal.SIGTERM)


@pytest.fixture
def handlers():
    """A recording handler for SIGINT and SIGTERM; the test's handlers back after."""
    saved = {sig: signal.getsignal(sig) for sig in SIGNALS}
    seen = []

    def record(signum, frame):
        seen.append(signum)

    for sig in SIGNALS:
        signal.signal(sig, record)
    try:
        yield seen, record
    finally:
        for sig, h in saved.items():
            signal.signal(sig, h)


def test_both_signals_wait_for_the_block_then_each_lands_once_in_order(handlers):
    seen, record = handlers
    with hold_interrupts():
        signal.raise_signal(signal.SIGTERM)
        signal.raise_signal(signal.SIGINT)
        signal.raise_signal(signal.SIGTERM)   # the same signal again: delivered once
        assert seen == []                     # nothing while the block runs
    assert seen == [signal.SIGTERM, signal.SIGINT]
    assert all(signal.getsignal(sig) is record for sig in SIGNALS)


def test_a_held_signal_whose_handler_raises_ends_the_block_there_with_every_handler_back(handlers):
    _, record = handlers

    def stop(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    after = []
    with pytest.raises(KeyboardInterrupt):
        with hold_interrupts():
            signal.raise_signal(signal.SIGTERM)
            after.append("the block ran to its end")
    assert after == ["the block ran to its end"]
    assert signal.getsignal(signal.SIGTERM) is stop and signal.getsignal(signal.SIGINT) is record


def test_a_signal_without_a_python_handler_is_left_alone(handlers):
    seen, _ = handlers
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    with hold_interrupts():
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN   # not taken over
        signal.raise_signal(signal.SIGTERM)                          # ignored, as before
        signal.raise_signal(signal.SIGINT)
    assert seen == [signal.SIGINT]
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN


def test_outside_the_main_thread_the_block_runs_as_it_is(handlers):
    _, record = handlers
    inside = []

    def work():
        with hold_interrupts():
            inside.append({sig: signal.getsignal(sig) for sig in SIGNALS})

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert inside == [{sig: record for sig in SIGNALS}]
