"""Entry points of the minimum-call planner: trajectories or a compact trie in, a validated-shape ``CallPlan`` out.

Legend: G segments, N trajectories.
"""
from __future__ import annotations

import numpy as np

from harts.data.trajectory import as_token_arrays
from harts.data.trie import CompactTrie, build_trie
from harts.planning.calls.plan import CallPlan
from harts.planning.calls.recover import plan_segment_tree
from harts.planning.checks import integer_arg
from harts.planning.segments import SegmentTree


def leaf_trajectories(trie: CompactTrie) -> np.ndarray:
    """[G] for each leaf segment, the smallest trajectory index ending at its last row (-1 for internal ones)."""
    N = trie.num_trajectories
    last_rows = trie.row_of_position[trie.offsets[1:] - 1]
    by_row = np.full(trie.num_rows, -1, dtype=np.int64)
    by_row[last_rows[::-1]] = np.arange(N - 1, -1, -1, dtype=np.int64)  # the last write wins: smallest index
    out = by_row[trie.segment_end - 1]
    leaf = trie.num_children[trie.segment_end - 1] == 0
    bad = np.flatnonzero(leaf & (out < 0))
    if bad.shape[0]:
        row = int(trie.segment_end[bad[0]] - 1)
        raise ValueError(f"trie: leaf row {row} (segment {int(bad[0])}) is the last row of no trajectory")
    return np.where(leaf, out, -1)


def plan_calls_for_trie(trie: CompactTrie, *, chunk_size: int) -> CallPlan:
    """Minimum-call plan of the trajectories of a compact trie (``harts.data.trie.build_trie``)."""
    B = integer_arg(chunk_size, "chunk_size", where="plan_calls_for_trie")
    if not isinstance(trie, CompactTrie):
        raise TypeError(f"plan_calls_for_trie: trie must be a CompactTrie, got {type(trie).__name__}")
    tree = SegmentTree.from_trie(trie)
    return plan_segment_tree(tree, B, trie=trie, leaf_trajectory=leaf_trajectories(trie))


def plan_calls(trajectories, *, chunk_size: int) -> CallPlan:
    """Minimum-call linear-attention plan of one microbatch (RolloutBatch, Trajectory objects or token lists).

    ``chunk_size`` is the KDA chunk size B: an int or numpy integer >= 1 (TypeError for a float or a string).
    """
    B = integer_arg(chunk_size, "chunk_size", where="plan_calls")
    arrays = as_token_arrays(trajectories)
    if not arrays:
        raise ValueError("plan_calls: no trajectories to plan (empty input)")
    return plan_calls_for_trie(build_trie(arrays), chunk_size=B)


def naive_schedule(tree: SegmentTree, chunk_size: int) -> dict:
    """Baselines: one call per segment, and segments packed by depth (a parent's call must return first)."""
    B = integer_arg(chunk_size, "chunk_size", where="naive_schedule")
    replay = int((tree.start[tree.parent >= 0] % B).sum())  # every non-root segment replays from a(s_v)
    return {
        "one_call_per_segment": {"num_calls": tree.num_segments, "replay_tokens": replay},
        "packed_by_depth": {"num_calls": tree.height(), "replay_tokens": replay},
    }
