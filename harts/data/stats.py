"""Workload statistics: ``python -m harts.data.stats FILE.jsonl [--chunk-size 64]``.

Prints paths, raw and compact tokens, compression, tree count, depth and fan-out distributions, and the
histogram of fork positions modulo the KDA chunk size (a fork at p forces replay of p mod B tokens,
paper Eq. 15, so this histogram is what KDA replay costs).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

from harts.data.trie import CompactTrie, build_trie


def _quantiles(x: np.ndarray) -> str:
    if x.shape[0] == 0:
        return "n/a"
    q = np.percentile(x, [0, 50, 90, 100])
    return f"min {q[0]:,.0f}  p50 {q[1]:,.0f}  p90 {q[2]:,.0f}  max {q[3]:,.0f}  (mean {x.mean():,.1f})"


def workload_stats(trie: CompactTrie, chunk_size: int = 64) -> dict:
    forks = np.flatnonzero(trie.num_children > 1)
    fork_pos = trie.depth[forks] + 1  # position of the first token after the fork
    leaves = trie.num_children == 0
    # Depth of a trajectory in the tree = number of forks on its path.
    seg_depth = np.zeros(trie.num_segments, dtype=np.int64)
    for g in range(1, trie.num_segments):  # parents precede children (preorder)
        p = trie.segment_parent[g]
        seg_depth[g] = seg_depth[p] + 1 if p >= 0 else 0
    end_rows = trie.row_of_position[trie.offsets[1:] - 1]
    traj_fork_depth = seg_depth[trie.segment_of_row[end_rows]]
    return {
        "paths": trie.num_trajectories,
        "raw_tokens": trie.num_positions,
        "compact_tokens": trie.num_rows,
        "compression": trie.compression,
        "trees": trie.num_trees,
        "segments": trie.num_segments,
        "path_length": trie.lengths,
        "tree_unique_tokens": np.bincount(trie.tree_of_row),
        "fork_depth": traj_fork_depth,
        "fan_out": trie.num_children[forks],
        "leaves": int(leaves.sum()),
        "fork_mod": np.bincount(fork_pos % chunk_size, minlength=chunk_size),
        # Eq. 15: every branch but the direct continuation replays [B*floor(p/B), p).
        "replay_tokens": int(((trie.num_children[forks] - 1) * (fork_pos % chunk_size)).sum()),
    }


def format_stats(s: dict, chunk_size: int = 64) -> str:
    lines = [
        f"paths             {s['paths']:,}",
        f"raw tokens        {s['raw_tokens']:,}",
        f"compact tokens    {s['compact_tokens']:,}",
        f"compression       {s['compression']:.3f}x",
        f"trees             {s['trees']:,}   segments {s['segments']:,}",
        f"path length       {_quantiles(s['path_length'])}",
        f"tree unique toks  {_quantiles(s['tree_unique_tokens'])}",
        f"forks on a path   {_quantiles(s['fork_depth'])}",
        f"fan-out at forks  {_quantiles(s['fan_out'])}",
    ]
    fo = s["fan_out"]
    if fo.shape[0]:
        counts = np.bincount(fo)
        lines.append("fan-out counts    " + "  ".join(f"{k}:{c}" for k, c in enumerate(counts) if c))
    hist = s["fork_mod"]
    total = max(int(hist.sum()), 1)
    lines.append(f"fork position mod {chunk_size} ({total:,} forks; mandatory replay {s['replay_tokens']:,} tokens):")
    width = max(1, chunk_size // 16)
    for lo in range(0, chunk_size, width):
        c = int(hist[lo : lo + width].sum())
        bar = "#" * int(round(60 * c / total))
        lines.append(f"  [{lo:3d},{min(lo + width, chunk_size):3d})  {c:7,d}  {bar}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m harts.data.stats", description=__doc__.split("\n\n")[0])
    ap.add_argument("file", help="rollout JSONL file")
    ap.add_argument("--chunk-size", type=int, default=64, help="KDA chunk size B for the fork histogram")
    args = ap.parse_args(argv)
    if args.chunk_size < 1:
        ap.error(f"--chunk-size {args.chunk_size}: the chunk size must be >= 1")
    from harts.data.jsonl import read_jsonl
    from harts.data.trajectory import TrajectoryError

    t0 = time.perf_counter()
    try:
        batch = read_jsonl(args.file)  # the schema's validator (docs/byo-rollouts.md)
    except TrajectoryError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    t1 = time.perf_counter()
    trie = build_trie(batch)
    t2 = time.perf_counter()
    try:
        print(format_stats(workload_stats(trie, args.chunk_size), args.chunk_size))
        print(f"read {t1 - t0:.2f}s, trie {t2 - t1:.2f}s")
        sys.stdout.flush()
    except BrokenPipeError:  # the reader left early (``| head``): nothing more to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit-time flush writes nowhere
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
