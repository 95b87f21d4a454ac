"""Planning demo on a generated workload: ``python -m harts.demo [--preset swe-small] [--dp 2] ...``.

Generates one step of SWE-like rollout trees, prints its statistics, plans microbatches / DP replicas /
slots (paper 3.2) and the minimum-call KDA rounds of every microbatch (paper 3.3).
"""
from __future__ import annotations

import argparse
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m harts.demo", description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="swe-small")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--capacity", type=int, default=2048)
    ap.add_argument("--chunk-size", type=int, default=16)
    args = ap.parse_args(argv)

    from harts.data.stats import format_stats, workload_stats
    from harts.data.synthetic import generate
    from harts.data.trie import build_trie
    from harts.planning import plan_calls, plan_microbatches

    t0 = time.perf_counter()
    batch = generate(args.preset, seed=args.seed, scale=args.scale)
    trie = build_trie(batch)
    print(f"== workload: preset {args.preset}, seed {args.seed}, scale {args.scale} "
          f"({time.perf_counter() - t0:.2f}s)")
    print(format_stats(workload_stats(trie, args.chunk_size), args.chunk_size))

    t0 = time.perf_counter()
    plan = plan_microbatches(batch, dp_degree=args.dp, capacity=args.capacity)
    t_plan = time.perf_counter() - t0
    plan.validate()
    total = sum(plan.work)
    print(f"\n== microbatch plan: DP {args.dp}, capacity {args.capacity:,} ({t_plan * 1e3:.1f} ms)")
    print(f"microbatches {len(plan.microbatches)}  compact work {total:,}  "
          f"raw/planned compact {trie.num_positions / total:.3f}x  objective {tuple(plan.objective)}")
    for d, mbs in enumerate(plan.replicas):
        print(f"  replica {d}: slots {len(mbs)}  work {sum(plan.work[m] for m in mbs):,}")

    print(f"\n== KDA call plans (chunk size {args.chunk_size})")
    calls = replay = segs = 0
    t0 = time.perf_counter()
    for mb in plan.microbatches:
        cp = plan_calls([batch[i].tokens for i in mb], chunk_size=args.chunk_size)
        cp.validate()
        calls += cp.num_calls
        replay += cp.replay_tokens
        segs += sum(len(r) for r in cp.to_dict()["rounds"])
    print(f"packed KDA calls {calls} for {len(plan.microbatches)} microbatches ({segs} input sequences), "
          f"replay tokens {replay:,} ({(time.perf_counter() - t0) * 1e3:.1f} ms)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
