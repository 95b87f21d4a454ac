"""Where a profiled training step spends its device time: ``python -m benchmarks.trace_summary TRACE.json``.

Reads a torch.profiler chrome trace (``train.py --profile.enable`` writes
``<dump_folder>/profile/step<N>/rank<R>_trace.json``) and sums the GPU kernel time by op family (the families
of ``benchmarks.speedup``), plus the wall span of the ``harts.microbatch.*`` and ``harts.backward.*`` ranges,
and where the device sits idle: the idle time between the first and the last kernel (kernel intervals merged
over streams), attributed to the innermost host op running at each gap (e.g. ``aten::_local_scalar_dense`` = a
host sync, ``cudaLaunchKernel`` = launch-bound, an all-to-all), plus the largest gaps, and which host code
launched the device time (``launchers``: each kernel's launch, matched by its correlation id, inside the
autograd node and ATen op that issued it). Prints tables; ``--json OUT`` writes them (a few KB instead of a
trace of hundreds of MB). On a CPU trace (no kernel events) it sums CPU op inclusive time instead, and says
so.
"""
from __future__ import annotations

import argparse
import heapq
import json
from collections import defaultdict

from benchmarks.common import family


def summarize(trace: dict) -> dict:
    events = trace.get("traceEvents", trace if isinstance(trace, list) else None)
    if events is None:
        raise ValueError("not a chrome trace: no 'traceEvents'")
    kern = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    source = "gpu_kernels"
    if not kern:
        kern = [e for e in events if e.get("ph") == "X" and e.get("cat") == "cpu_op"]
        source = "cpu_ops_inclusive"
    fam = defaultdict(float)
    for e in kern:
        fam[family(e.get("name", ""))] += float(e.get("dur", 0.0)) / 1e6
    ranges = defaultdict(float)
    for e in events:
        name = e.get("name", "")
        if e.get("ph") == "X" and e.get("cat") == "user_annotation":
            for key in ("harts.microbatch.", "harts.backward.", "harts.pipeline"):
                if name.startswith(key):
                    ranges[key.rstrip(".")] += float(e.get("dur", 0.0)) / 1e6
    total = sum(fam.values())
    out = {"source": source, "total_s": total, "families_s": dict(sorted(fam.items(), key=lambda kv: -kv[1])),
           "ranges_s": dict(ranges)}
    if source == "gpu_kernels":
        out["device_idle"] = device_idle(events)
        out["launchers"] = launchers(events)
    return out


_DEVICE = ("kernel", "gpu_memcpy", "gpu_memset")
_HOST = ("cpu_op", "cuda_runtime", "cuda_driver")


def device_idle(events: list, *, min_gap_us: float = 5.0, top: int = 8, top_ops: int = 12) -> dict:
    """Idle device time between the first and last kernel/copy (intervals merged over streams), each gap
    attributed to the innermost host op (latest-starting cpu_op / CUDA runtime call, any thread) running
    at its midpoint; "(no host op)" means Python or other untraced host work. Gaps shorter than
    ``min_gap_us`` are counted in the total but not attributed."""
    dev = sorted(((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)), e.get("name", ""))
                  for e in events if e.get("ph") == "X" and e.get("cat") in _DEVICE), key=lambda x: x[0])
    if not dev:
        return {"span_s": 0.0, "busy_s": 0.0, "idle_s": 0.0, "idle_by_host_op_s": {}, "gaps": []}
    gaps, busy = [], 0.0  # (start, end, kernel before, kernel after)
    cur0, cur1, cur_name = dev[0]
    for t0, t1, name in dev[1:]:
        if t0 > cur1:
            busy += cur1 - cur0
            gaps.append((cur1, t0, cur_name, name))
            cur0, cur1 = t0, t1
        elif t1 > cur1:
            cur1 = t1
        if t1 >= cur1:
            cur_name = name
    busy += cur1 - cur0
    span = max(d[1] for d in dev) - dev[0][0]
    # innermost host op at each gap midpoint: sweep the midpoints in time order over host ops sorted by
    # start, keeping a max-heap by start time; ended ops are popped when they reach the top
    host = sorted(((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)), e.get("name", ""))
                   for e in events if e.get("ph") == "X" and e.get("cat") in _HOST), key=lambda x: x[0])
    attributed = sorted((((g0 + g1) / 2, i) for i, (g0, g1, _, _) in enumerate(gaps) if g1 - g0 >= min_gap_us))
    owner: dict[int, str] = {}
    heap: list = []
    j = 0
    for mid, i in attributed:
        while j < len(host) and host[j][0] <= mid:
            heapq.heappush(heap, (-host[j][0], host[j][1], host[j][2]))
            j += 1
        while heap and heap[0][1] <= mid:
            heapq.heappop(heap)
        owner[i] = heap[0][2] if heap else "(no host op)"
    by_op = defaultdict(float)
    for i, name in owner.items():
        by_op[name[:80]] += (gaps[i][1] - gaps[i][0]) / 1e6
    idle = sum(g1 - g0 for g0, g1, _, _ in gaps) / 1e6
    big = sorted(range(len(gaps)), key=lambda i: gaps[i][0] - gaps[i][1])[:top]
    return {"span_s": span / 1e6, "busy_s": busy / 1e6, "idle_s": idle, "gaps_count": len(gaps),
            "idle_by_host_op_s": dict(sorted(by_op.items(), key=lambda kv: -kv[1])[:top_ops]),
            "gaps": [{"gap_us": gaps[i][1] - gaps[i][0], "before": gaps[i][2][:60], "next": gaps[i][3][:60],
                      "host": owner.get(i, "")[:80]} for i in big]}


_NODE = "autograd::engine::evaluate_function: "


def launchers(events: list, *, top: int = 25) -> list[dict]:
    """Device time by the host code that launched it: each kernel / copy / memset is matched to its launch
    (the runtime or driver call with the same ``correlation`` id) and the launch to the cpu_ops open on its
    thread at that moment. Key: (family, innermost autograd node or ``forward``, innermost ATen op or
    ``(compiled graph)``). Why: an elementwise or copy family is many small kernels that a family sum cannot
    explain, while the op that launched them (an ``aten::add_`` under ``AccumulateGrad``, say) names the code to
    change. Launches that are not inside any cpu_op count under ``(no host op)``."""
    launch_at: dict[int, tuple[int, float]] = {}
    ops_by_tid: dict = defaultdict(list)
    for e in events:
        if e.get("ph") != "X":
            continue
        cat = e.get("cat")
        if cat in ("cuda_runtime", "cuda_driver") and "correlation" in (e.get("args") or {}):
            launch_at[e["args"]["correlation"]] = (e.get("tid"), float(e["ts"]))
        elif cat in ("cpu_op", "user_annotation"):
            t0 = float(e["ts"])
            ops_by_tid[e.get("tid")].append((t0, t0 + float(e.get("dur", 0.0)), e.get("name", "")))
    acc: dict[tuple, list] = {}

    def add(key, ms):
        a = acc.setdefault(key, [0.0, 0])
        a[0] += ms
        a[1] += 1

    want = defaultdict(list)  # tid -> [(launch ts, kernel ms, family)]
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in _DEVICE:
            corr = (e.get("args") or {}).get("correlation")
            ms, fam = float(e.get("dur", 0.0)) / 1e3, family(e.get("name", ""))
            if corr in launch_at:
                tid, ts = launch_at[corr]
                want[tid].append((ts, ms, fam))
            else:
                add((fam, "(no host op)", "(no host op)"), ms)
    for tid, launches in want.items():
        ops = sorted(ops_by_tid.get(tid, ()), key=lambda o: (o[0], -o[1]))
        stack: list = []  # open ops, outermost first (ops on one thread nest)
        j = 0
        for ts, ms, fam in sorted(launches):
            while j < len(ops) and ops[j][0] <= ts:
                while stack and stack[-1][1] < ops[j][0]:
                    stack.pop()
                stack.append(ops[j])
                j += 1
            while stack and stack[-1][1] < ts:
                stack.pop()
            node, aten = "forward", "(no host op)"
            for t0, t1, name in stack:
                if name.startswith(_NODE):
                    node = name[len(_NODE):]
                if "CompiledFxGraph" in name:
                    aten = "(compiled graph)"
                elif name.startswith(("aten::", "harts::")):
                    aten = name
            add((fam, node[:70], aten[:70]), ms)
    rows = sorted(acc.items(), key=lambda kv: -kv[1][0])[:top]
    return [{"family": f, "node": n, "op": o, "ms": v[0], "count": v[1]} for (f, n, o), v in rows]


def print_launchers(rows: list[dict]) -> None:
    print("| family | autograd node | op | ms | kernels |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['family']} | {r['node']} | {r['op']} | {r['ms']:.2f} | {r['count']} |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.trace_summary", description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", help="chrome trace JSON written by torch.profiler")
    ap.add_argument("--json", default=None, help="write the summary here")
    args = ap.parse_args(argv)
    with open(args.trace) as f:
        res = summarize(json.load(f))
    res["trace"] = args.trace
    print(f"{args.trace}: {res['source']}, {res['total_s']:.3f} s in total")
    print("| family | s | share |\n|---|---|---|")
    for k, v in res["families_s"].items():
        print(f"| {k} | {v:.4f} | {v / max(res['total_s'], 1e-12):.1%} |")
    for k, v in res["ranges_s"].items():
        print(f"range {k}: {v:.3f} s (wall, host side)")
    idle = res.get("device_idle")
    if idle:
        print(f"device: span {idle['span_s']:.3f} s, busy {idle['busy_s']:.3f} s, idle {idle['idle_s']:.3f} s "
              f"in {idle['gaps_count']} gaps; idle by the host op running at the gap:")
        print("| host op | idle s |\n|---|---|")
        for k, v in idle["idle_by_host_op_s"].items():
            print(f"| {k} | {v:.4f} |")
        for g in idle["gaps"]:
            print(f"    gap {g['gap_us']:9.1f} us before {g['next']} (host: {g['host']})")
    if res.get("launchers"):
        print("device time by launching host code:")
        print_launchers(res["launchers"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
