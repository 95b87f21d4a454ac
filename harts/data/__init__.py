"""Rollout data: trajectories with RL metadata, the compact trie, JSONL I/O (``harts.data.jsonl``: the rollout
file schema, version 1, documented in docs/byo-rollouts.md) and synthetic workloads.

numpy and the standard library only, so it can run in data-loader workers.
"""
from harts.data.trajectory import RolloutBatch, Trajectory, TrajectoryError, as_token_arrays
from harts.data.trie import CompactTrie, build_trie

__all__ = ["RolloutBatch", "Trajectory", "TrajectoryError", "as_token_arrays", "CompactTrie", "build_trie"]
