"""Where a profiled training step spends its device time: ``python -m harts.bench.trace_summary TRACE.json``.

Reads a torch.profiler chrome trace (``train.py --profile.enable`` writes
``<dump_folder>/profile/step<N>/rank<R>_trace.json``) and sums the GPU kernel time by op family (the
families of ``harts.bench.speedup``), plus the wall span of the ``harts.microbatch.*`` and
``harts.backward.*`` ranges. Prints a table; ``--json OUT`` writes it (a few hundred bytes instead of a
trace of hundreds of MB). On a CPU trace (no kernel events) it sums CPU op self time instead, and says so.
"""
from __future__ import annotations

import argparse
import json
from collections import defaultdict

from harts.bench.common import family


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
    return {"source": source, "total_s": total, "families_s": dict(sorted(fam.items(), key=lambda kv: -kv[1])),
            "ranges_s": dict(ranges)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m harts.bench.trace_summary", description=__doc__.split("\n\n")[0])
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
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
