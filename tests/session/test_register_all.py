"""`Session.register_all`: several regions in one call, all or none.  Every
region is checked, and the log's room for one image of them all, before any
is registered; a refusal (one line naming its region) leaves the session and
the log as they were, so the same call can be made again once mended.
`protect()` registers a model's regions through it."""

from __future__ import annotations

import numpy as np
import pytest

from concordia import Session
from concordia.regions.errors import DuplicateRegionError, SessionError, UnsupportedArrayError

from .test_bad_input import one_line

MiB = 1 << 20


def _regions(n: int = 5, nbytes: int = 8192) -> list[dict]:
    return [dict(name=f"r{i}", array=np.full(nbytes, i, np.uint8), page_bytes=4096) for i in range(n)]


def test_all_are_registered_in_order_and_checkpoint_and_recover(file_log):
    with Session(file_log, size=16 * MiB) as s:
        s.register("first", np.zeros(64, np.uint8), page_bytes=64)
        got = s.register_all(_regions())
        assert [r.name for r in got] == [f"r{i}" for i in range(5)]
        assert s.region_set.names == ["first"] + [f"r{i}" for i in range(5)]
        assert s.checkpoint().epoch == 1
    with Session(file_log, create=False) as s:
        back = s.recover()
        assert all((back[f"r{i}"] == i).all() for i in range(5))


@pytest.mark.parametrize("bad, error, words", [
    (dict(kind="nope"), SessionError, ["region 'r3'", "unknown kind 'nope'"]),
    (dict(page_bytes=100), SessionError, ["region 'r3'", "page_bytes must be a positive multiple of 64"]),
    (dict(array=np.zeros(0, np.uint8)), UnsupportedArrayError, ["region 'r3'", "the array is empty"]),
    (dict(array=np.zeros((4, 4), np.uint8)[:, ::2]), UnsupportedArrayError, ["region 'r3'", "C-contiguous"]),
    (dict(name="r1"), DuplicateRegionError, ["region 'r1'", "already registered"]),
    (dict(name="first"), DuplicateRegionError, ["region 'first'", "already registered"]),
    (dict(colour="blue"), SessionError, ["unknown argument 'colour'"]),
])
def test_one_bad_region_registers_none_and_names_it(file_log, bad, error, words):
    specs = _regions()
    specs[3] = {**specs[3], **bad}
    with Session(file_log, size=16 * MiB) as s:
        s.register("first", np.zeros(64, np.uint8), page_bytes=64)
        before = s.region_set.version
        with pytest.raises(error) as err:
            s.register_all(specs)
        one_line(err.value, *words)
        assert s.region_set.names == ["first"] and s.region_set.version == before
        assert sorted(s.log.regions) == ["first"]   # no descriptor was written
        assert len(s.register_all(_regions())) == 5   # the call, mended, goes through
        assert s.checkpoint().epoch == 1


def test_room_is_checked_for_all_of_them_together_naming_the_first_that_does_not_fit(shm_log):
    """Each region alone fits the log; together they do not: none is registered, and the error names the
    region at which one image of the state stops fitting."""
    with Session(shm_log, size=8 * MiB, segment_size=1 * MiB, overwrite=True) as s:
        specs = [dict(name=f"part{i}", array=np.zeros(2 * MiB, np.uint8)) for i in range(4)]
        with pytest.raises(SessionError) as err:
            s.register_all(specs)
        one_line(err.value, "region 'part2'", "the log holds 7340032 bytes", "needs")   # 3 x 2 MiB and a segment
        assert s.region_set.names == [] and not s.log.regions
        assert len(s.register_all(specs[:2])) == 2
        assert s.checkpoint().epoch == 1


def test_a_recovering_session_finds_the_regions_the_log_holds(file_log):
    with Session(file_log, size=16 * MiB) as s:
        s.register_all(_regions())
        s.checkpoint()
    targets = _regions()
    for spec in targets:
        spec["array"] = np.zeros_like(spec["array"])
    with Session(file_log, create=False) as s:
        got = s.register_all(targets)
        assert [r.id for r in got] == [int(s.log.regions[f"r{i}"].id) for i in range(5)]
        s.recover(into="registered")
        assert all((t["array"] == i).all() for i, t in enumerate(targets))
        mismatched = [dict(name="r0", array=np.zeros(4096, np.uint8))]
    with Session(file_log, create=False) as s:
        with pytest.raises(SessionError) as err:   # held to the log's descriptor, as register() is
            s.register_all(mismatched)
        one_line(err.value, "region 'r0'", "shape")


def test_a_dict_for_the_list_or_an_entry_that_is_not_a_dict_is_one_line(file_log):
    with Session(file_log, size=16 * MiB) as s:
        with pytest.raises(SessionError) as err:
            s.register_all(_regions()[0])
        one_line(err.value, "a list of dicts")
        with pytest.raises(SessionError) as err:
            s.register_all([_regions()[0], ("r9", np.zeros(64, np.uint8))])
        one_line(err.value, "not a tuple")
        version = s.region_set.version
        assert s.register_all([]) == [] and s.region_set.version == version   # nothing to list: nothing rebuilt
        assert s.region_set.names == []


def test_register_all_takes_registers_arguments_with_its_defaults():
    """One list of register's arguments and their defaults: register_all's
    (`session_register.OPTIONS`) is held to `Session.register`'s signature."""
    import inspect

    from concordia.session_register import ARGUMENTS, OPTIONS

    params = inspect.signature(Session.register).parameters
    assert ARGUMENTS == set(params) - {"self"}
    assert OPTIONS == {n: p.default for n, p in params.items() if p.default is not inspect.Parameter.empty}
