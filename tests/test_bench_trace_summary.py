"""trace_summary's device-idle analysis on a hand-made chrome trace with known answers."""
import pytest

from benchmarks.trace_summary import device_idle, summarize


def _x(cat, name, ts, dur):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


EVENTS = [
    _x("cpu_op", "outer", 0, 1000),
    _x("cpu_op", "aten::_local_scalar_dense", 300, 200),  # a host sync inside outer
    _x("cuda_runtime", "cudaLaunchKernel", 700, 5),
    _x("kernel", "k1", 0, 100),
    _x("kernel", "k2", 50, 200),  # another stream, overlaps k1: busy until 250
    _x("kernel", "k3", 520, 80),
    _x("kernel", "k4", 710, 90),
    _x("kernel", "k5", 802, 3),  # a 2 us gap: counted, not attributed
]


def test_idle_time_is_attributed_to_the_innermost_host_op():
    r = device_idle(EVENTS)
    assert r["span_s"] == pytest.approx(805e-6) and r["busy_s"] == pytest.approx(423e-6)
    assert r["idle_s"] == pytest.approx((270 + 110 + 2) * 1e-6) and r["gaps_count"] == 3
    assert r["idle_by_host_op_s"] == pytest.approx({"aten::_local_scalar_dense": 270e-6, "outer": 110e-6})
    big = r["gaps"][0]
    assert (big["gap_us"], big["before"], big["next"], big["host"]) == (270, "k2", "k3", "aten::_local_scalar_dense")


def test_summary_includes_idle_only_for_device_traces():
    assert "device_idle" in summarize({"traceEvents": EVENTS})
    cpu = summarize({"traceEvents": [e for e in EVENTS if e["cat"] != "kernel"]})
    assert cpu["source"] == "cpu_ops_inclusive" and "device_idle" not in cpu
