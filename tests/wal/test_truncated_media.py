"""V-B8: media shorter than the volume their superblock declares (a file cut
after it was formatted) are reported and read, never written."""

from __future__ import annotations

import os

import pytest

from concordia.devmem import open_backend
from concordia.wal import Log
from concordia.wal.errors import CorruptionError

from .helpers import MiB, build_log, replay


def test_cut_file_reads_but_refuses_a_writer(tmp_path):
    path = str(tmp_path / "cut.log")
    log, model, rid = build_log(open_backend(f"file:{path}", size=8 * MiB, create=True), epochs=6)
    live_end = max(s.offset + s.nbytes for s in log.volume.live_segments())
    log.close()
    os.truncate(path, live_end)
    before = open(path, "rb").read()

    with pytest.raises(CorruptionError) as e:
        Log.open(f"file:{path}", writable=True)
    text = str(e.value)
    assert "\n" not in text and "truncated" in text and f"declares {8 * MiB}" in text

    dropped = []
    ro = Log.open(f"file:{path}", writable=False, reporter=dropped.append)
    try:
        assert [d.kind for d in dropped] == ["truncated"]
        assert dropped[0].offset == live_end and dropped[0].length == 8 * MiB - live_end
        assert ro.last_committed_epoch == 6
        assert (replay(ro, model.npages, model.page_bytes) == model.state_after(6)).all()
    finally:
        ro.close()
    assert open(path, "rb").read() == before  # nothing was written
