"""Minimum-call plan of one microbatch from a JSONL file, against the naive schedules.

``python -m benchmarks.plan_calls_cli --input F.jsonl --chunk-size 64 [--json OUT]``: prints the rounds
(calls) and replay tokens of Algorithm 1 (``harts.planning.calls``) next to one call per segment and
segments packed by depth. The input is the rollout JSONL of ``harts.data.jsonl`` (one ``{"tokens": [...]}``
object per line). Exit code 2 with one ``error:`` line for bad input.
"""
from __future__ import annotations

import argparse
import json
import sys

from harts.data.jsonl import read_jsonl
from harts.planning.calls import naive_schedule, plan_calls


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.plan_calls_cli", description=__doc__.split("\n")[0])
    ap.add_argument("--input", required=True, help="rollout JSONL, one {'tokens': [...]} object per line")
    ap.add_argument("--chunk-size", type=int, default=64)
    ap.add_argument("--json", help="write the plan (to_dict) and the summary here")
    args = ap.parse_args(argv)
    try:
        plan = plan_calls(read_jsonl(args.input), chunk_size=args.chunk_size)
    except (OSError, ValueError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    plan.validate()
    trie = plan.trie
    naive = naive_schedule(plan.tree, args.chunk_size)
    print(f"trajectories {trie.num_trajectories}  semantic tokens S={trie.num_positions}"
          f"  compact rows C={trie.num_rows}  segments {plan.tree.num_segments}  trees {plan.tree.num_trees}"
          f"  chunk_size {args.chunk_size}")
    print(f"{'schedule':<24}{'calls':>8}{'replay':>10}  sequences per round")
    print(f"{'minimum-call (Alg. 1)':<24}{plan.num_calls:>8}{plan.replay_tokens:>10}  {plan.sequences_per_round()}")
    for name, d in naive.items():
        print(f"{name:<24}{d['num_calls']:>8}{d['replay_tokens']:>10}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"summary": plan.summary(), "naive": naive, "plan": plan.to_dict()}, fh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
