"""The CuPy view of a framework's stream (`regions._foreign_stream`): CuPy 14's
`Stream.from_external` where it exists, with no deprecation warning; the view
names the stream and its device, and going away leaves the framework's stream
alive (a CuPy Stream would destroy its handle)."""

from __future__ import annotations

import gc
import warnings

import pytest

from concordia.regions.streams import StreamOrder, foreign_stream

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch", reason="PyTorch is not installed here")
cp = pytest.importorskip("cupy", reason="CuPy is not installed here")
if not torch.cuda.is_available():
    pytest.skip("this PyTorch build has no CUDA device", allow_module_level=True)


def test_a_torch_stream_is_viewed_without_the_deprecated_class_and_outlives_the_view():
    x = torch.zeros(1 << 20, device="cuda")
    side = torch.cuda.Stream()
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)  # ExternalStream warns from CuPy 14 on
        (view,) = StreamOrder.of([(x, side)]).streams
    assert view.ptr == side.cuda_stream and view.device_id == x.device.index
    if hasattr(cp.cuda.Stream, "from_external"):
        assert isinstance(view, cp.cuda.Stream)
    with view:
        y = cp.arange(1 << 20, dtype=cp.float32)  # CuPy work on the framework's stream
    del view
    gc.collect()
    with torch.cuda.stream(side):  # a destroyed handle would fail here, or queue nowhere
        x.add_(1)
    side.synchronize()
    assert float(x[0]) == 1.0 and float(y[-1]) == (1 << 20) - 1


def test_the_current_torch_stream_and_a_raw_handle():
    x = torch.zeros(16, device="cuda")
    (cur,) = StreamOrder.of([(x, None)]).streams
    assert cur.ptr == torch.cuda.current_stream(x.device).cuda_stream and cur.device_id == x.device.index
    side = torch.cuda.Stream()
    raw = foreign_stream(cp, int(side.cuda_stream), -1)  # a bare cudaStream_t: device unknown
    assert raw.ptr == side.cuda_stream and raw.device_id == -1
    del raw
    gc.collect()
    side.synchronize()  # still a live handle
