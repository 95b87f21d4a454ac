"""Minimum-call planning for linear-attention execution (paper 3.3, Eqs. 11-15, Algorithm 1).

Execution model (the scope of the optimality claim): one packed chunkwise linear-attention call per
*round*; a call runs several independent input sequences; a chunk-boundary state produced inside a call
can initialise another sequence only after the call returns; a side branch at fork p starts from the fixed
anchor state S_{a(p)} and replays [a(p), p) inside the core (replay length is fixed by B and p, never
optimised); every non-replay output is produced exactly once.

Two passes over the segment tree, both linear:
1. ``dp``: Eqs. (12)-(14) in postorder (T_pre, T_in per segment);
2. ``recover``: Algorithm 1 lines 12-29 in preorder, giving the sequences of every round (``plan``'s
   ``CallPlan``), with independent trees merged by round.
``validate`` checks a plan against the execution model; ``api`` holds the entry points.

CLI: ``python -m benchmarks.plan_calls_cli --input F.jsonl --chunk-size 64 [--json OUT]``.
"""
from __future__ import annotations

from harts.planning.calls.api import leaf_trajectories, naive_schedule, plan_calls, plan_calls_for_trie
from harts.planning.calls.dp import dp_with_argmax, min_calls_dp, min_calls_dp_reference
from harts.planning.calls.plan import ZERO_STATE, CallPlan, assemble_plan
from harts.planning.calls.recover import plan_segment_tree, plan_segment_tree_reference
from harts.planning.calls.validate import validate_plan

__all__ = [
    "ZERO_STATE",
    "CallPlan",
    "assemble_plan",
    "dp_with_argmax",
    "leaf_trajectories",
    "min_calls_dp",
    "min_calls_dp_reference",
    "naive_schedule",
    "plan_calls",
    "plan_calls_for_trie",
    "plan_segment_tree",
    "plan_segment_tree_reference",
    "validate_plan",
]
