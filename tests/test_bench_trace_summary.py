"""trace_summary's device-idle analysis on a hand-made chrome trace with known answers."""
import pytest

from benchmarks.trace_summary import device_idle, launchers, summarize


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


def _launch(name, ts, corr, tid=1):
    return {"ph": "X", "cat": "cuda_runtime", "name": name, "ts": ts, "dur": 2, "tid": tid,
            "args": {"correlation": corr}}


def _op(name, ts, dur, tid=1, cat="cpu_op"):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid}


def _kernel(name, ts, dur, corr):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "tid": 7, "args": {"correlation": corr}}


def test_launchers_attribute_kernels_to_the_innermost_node_and_op_on_the_launching_thread():
    events = [
        # forward thread: an add inside a linear's outer op, then a launch outside every op
        _op("aten::linear", 0, 100), _op("aten::add", 10, 20), _launch("cudaLaunchKernel", 15, 1),
        _launch("cudaLaunchKernel", 150, 2),
        # backward thread: a node with two ops; the second op's launch comes after the first op ended
        _op("autograd::engine::evaluate_function: AccumulateGrad", 200, 100, tid=2),
        _op("aten::add_", 210, 10, tid=2), _launch("cudaLaunchKernel", 212, 3, tid=2),
        _op("aten::copy_", 240, 10, tid=2), _launch("cuLaunchKernel", 245, 4, tid=2),
        _op("## Call CompiledFxGraph abc ##", 400, 50, tid=2), _launch("cuLaunchKernel", 410, 5, tid=2),
        _kernel("vectorized_elementwise_kernel<add>", 20, 3000, 1),
        _kernel("vectorized_elementwise_kernel<add>", 160, 1000, 2),
        _kernel("vectorized_elementwise_kernel<add>", 220, 2000, 3),
        _kernel("bfloat16_copy_kernel_cuda", 250, 500, 4),
        _kernel("triton_poi_fused_mul_0", 420, 4000, 5),
        _kernel("orphan_kernel", 500, 250, 99),  # no matching launch
    ]
    rows = {(r["node"], r["op"]): (r["ms"], r["count"]) for r in launchers(events)}
    assert rows == {("forward", "aten::add"): (3.0, 1), ("forward", "(no host op)"): (1.0, 1),
                    ("AccumulateGrad", "aten::add_"): (2.0, 1), ("AccumulateGrad", "aten::copy_"): (0.5, 1),
                    ("forward", "(compiled graph)"): (4.0, 1), ("(no host op)", "(no host op)"): (0.25, 1)}
    assert [r["ms"] for r in launchers(events)] == sorted((r["ms"] for r in launchers(events)), reverse=True)
