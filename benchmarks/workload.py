"""Calibration table of a synthetic preset: ``python -m benchmarks.workload --preset swe-step --seeds 0-9``.

Per seed: paths, raw tokens, compact tokens, whole-step compression, mean path, median tree unique
tokens, generation and trie time; with ``--plan`` also raw / planned compact work at the given capacity
and DP degree (the paper's 5.44-5.63 figure). Writes JSON with ``--json``.
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np


def _seeds(text: str) -> list[int]:
    if "-" in text:
        lo, hi = text.split("-")
        return list(range(int(lo), int(hi) + 1))
    return [int(s) for s in text.split(",")]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.workload", description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="swe-step")
    ap.add_argument("--seeds", default="0-9")
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--plan", action="store_true", help="also run the microbatch planner")
    ap.add_argument("--dp", type=int, default=4)
    ap.add_argument("--capacity", type=int, default=65536)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    from harts.data.synthetic import generate
    from harts.data.trie import build_trie

    rows = []
    hdr = (f"{'seed':>4} {'paths':>6} {'raw':>12} {'compact':>11} {'compr':>6} {'mean path':>9} "
           f"{'tree uniq p50':>13} {'gen s':>6} {'trie s':>6}")
    if args.plan:
        hdr += f" {'planned':>11} {'raw/plan':>8} {'plan s':>6}"
    print(hdr)
    for seed in _seeds(args.seeds):
        t0 = time.perf_counter()
        batch = generate(args.preset, seed=seed, scale=args.scale, metadata=False)
        t_gen = time.perf_counter() - t0
        t0 = time.perf_counter()
        trie = build_trie(batch)
        t_trie = time.perf_counter() - t0
        r = {
            "seed": seed, "paths": len(batch), "raw": trie.num_positions, "compact": trie.num_rows,
            "compression": trie.compression, "mean_path": trie.num_positions / len(batch),
            "tree_unique_p50": float(np.median(np.bincount(trie.tree_of_row))),
            "gen_s": t_gen, "trie_s": t_trie,
        }
        line = (f"{seed:>4} {r['paths']:>6,} {r['raw']:>12,} {r['compact']:>11,} {r['compression']:>6.2f} "
                f"{r['mean_path']:>9,.0f} {r['tree_unique_p50']:>13,.0f} {t_gen:>6.2f} {t_trie:>6.2f}")
        if args.plan:
            from harts.planning import plan_microbatches

            arrays = batch.token_arrays
            t0 = time.perf_counter()
            plan = plan_microbatches(arrays, dp_degree=args.dp, capacity=args.capacity)
            r["plan_s"] = time.perf_counter() - t0
            r["planned_compact"] = int(sum(plan.work))
            r["raw_over_planned"] = trie.num_positions / r["planned_compact"]
            line += f" {r['planned_compact']:>11,} {r['raw_over_planned']:>8.3f} {r['plan_s']:>6.2f}"
        print(line, flush=True)
        rows.append(r)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"preset": args.preset, "scale": args.scale, "dp": args.dp, "capacity": args.capacity,
                       "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
