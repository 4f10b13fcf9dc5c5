"""The reference workload: deterministic, serves several sequences, updates in place."""

from __future__ import annotations

import numpy as np

from concordia.demo.workload import DONE, META_STEP, Workload, WorkloadConfig

SMALL = WorkloadConfig(d_model=128, n_heads=4, n_kv_heads=2, d_ff=256, vocab=256,
                       num_blocks=32, n_requests=10, new_tokens=(4, 12))


def test_two_runs_are_bit_identical():
    a, b = Workload(SMALL), Workload(SMALL)
    a.run(40)
    b.run(40)
    sa, sb = a.snapshot(), b.snapshot()
    for name in sa:
        assert sa[name].tobytes() == sb[name].tobytes(), name


def test_state_arrays_are_updated_in_place():
    w = Workload(SMALL)
    ids = {name: id(arr) for name, (arr, _) in w.regions().items()}
    before = w.snapshot()
    w.run(10)
    after = w.snapshot()
    assert {name: id(arr) for name, (arr, _) in w.regions().items()} == ids
    assert not np.array_equal(before["kv"], after["kv"])
    assert not np.array_equal(before["adapter"], after["adapter"])
    assert int(after["meta"][META_STEP]) == 10


def test_requests_are_admitted_served_and_completed():
    w = Workload(SMALL)
    infos = []
    w.run(200, on_step=lambda _w, info: infos.append(info))
    assert max(i["running"] for i in infos) > 1  # several sequences at once
    finished = sorted(r for i in infos for r in i["finished"])
    assert finished == list(range(SMALL.n_requests))
    assert (w.tables.req_state == DONE).all()
    assert (w.tables.block_owner == -1).all()  # every block returned
    out = w.outputs()
    for r in w.requests:
        assert len(out[r.id]) == r.max_new
        assert all(0 <= t < SMALL.vocab for t in out[r.id])


def test_continuing_from_a_copied_state_matches_an_uninterrupted_run():
    ref = Workload(SMALL)
    ref.run(30)
    part = Workload(SMALL)
    part.run(13)
    saved = part.snapshot()
    fresh = Workload(SMALL)
    fresh.load_state(saved)
    fresh.run(30)
    for name, arr in ref.snapshot().items():
        assert arr.tobytes() == fresh.snapshot()[name].tobytes(), name
