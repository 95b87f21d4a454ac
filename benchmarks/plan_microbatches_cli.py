"""Microbatch, DP-replica and slot plan of one step from a JSONL file (paper 3.2, ``harts.planning.microbatch``).

``python -m benchmarks.plan_microbatches_cli --input F.jsonl --dp D --capacity T [--json OUT]
[--exact-threshold N0]``: prints K, compact work, slot-critical and max-replica work, within-slot and
step-total imbalance and the planning time. The input is the rollout JSONL of ``harts.data.jsonl``. Exit code
2 with one ``error:`` line for bad input or an infeasible request.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from harts.data.jsonl import read_jsonl
from harts.planning.microbatch import MicrobatchPlan, plan_from_arrays


def summarize(plan: MicrobatchPlan, seconds: float) -> dict:
    imb = plan.slot_imbalances()
    return {
        "K": plan.num_microbatches,
        "slots": plan.num_slots,
        "total_compact_work": int(plan.objective[0]),
        "slot_critical_work": int(plan.objective[1]),
        "max_replica_work": int(plan.objective[2]),
        "within_slot_imbalance_p50": float(np.percentile(imb, 50)),
        "within_slot_imbalance_p95": float(np.percentile(imb, 95)),
        "step_total_imbalance": plan.step_imbalance(),
        "planning_seconds": seconds,
        "candidate": plan.candidate,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.plan_microbatches_cli",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--input", required=True, help="JSONL file, one trajectory per line")
    ap.add_argument("--dp", type=int, required=True, help="data-parallel degree D")
    ap.add_argument("--capacity", type=int, required=True, help="microbatch capacity T (compact tokens)")
    ap.add_argument("--json", default=None, help="write the plan (to_dict) plus a summary here")
    ap.add_argument("--exact-threshold", type=int, default=None,
                    help="literal paper mode with this N0 (512 = the paper); default: N0 = 512 plus exact-DP "
                         "candidates above it")
    args = ap.parse_args(argv)
    try:
        arrays = read_jsonl(args.input).token_arrays
        t0 = time.perf_counter()
        plan = plan_from_arrays(arrays, dp_degree=args.dp, capacity=args.capacity,
                                exact_threshold=args.exact_threshold)
        seconds = time.perf_counter() - t0
    except (OSError, ValueError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    plan.validate()
    s = summarize(plan, seconds)
    raw = int(sum(a.shape[0] for a in arrays))
    print(f"trajectories {len(arrays):,}  raw tokens {raw:,}  D {args.dp}  T {args.capacity:,}")
    print(f"K {s['K']}  slots {s['slots']}  total compact work {s['total_compact_work']:,}  "
          f"(raw/compact {raw / s['total_compact_work']:.3f})")
    print(f"slot-critical work {s['slot_critical_work']:,}  max replica work {s['max_replica_work']:,}")
    print(f"within-slot imbalance P50 {100 * s['within_slot_imbalance_p50']:.4f}%  "
          f"P95 {100 * s['within_slot_imbalance_p95']:.4f}%  "
          f"step-total imbalance {100 * s['step_total_imbalance']:.4f}%")
    print(f"planning time {seconds:.3f} s (winner: {s['candidate']})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**plan.to_dict(), "summary": s}, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
