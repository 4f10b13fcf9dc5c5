"""InstrumentError is one class whichever of `concordia.errors` and
`concordia.instrument` is imported first (each order in a fresh interpreter)."""

from __future__ import annotations

import subprocess
import sys

import pytest

ORDERS = {
    "instrument first": "import concordia.instrument.errors as ie; import concordia.errors as e",
    "errors first": "import concordia.errors as e; import concordia.instrument.errors as ie",
}


@pytest.mark.parametrize("order", sorted(ORDERS))
def test_one_class_in_either_import_order(order):
    code = (ORDERS[order] + "; from concordia.devmem.errors import ConcordiaError;"
            " assert e.InstrumentError is ie.InstrumentError;"
            " assert issubclass(ie.InstrumentError, ConcordiaError); print('ok')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr
