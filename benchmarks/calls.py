"""Minimum-call planner benchmark: ``python -m benchmarks.calls [--max-segments 1000000] [--out out/bench_calls]``.

Two parts:
* Scaling curve of Algorithm 1 (DP + recovery, ``plan_segment_tree``) on synthetic segment trees of
  1e3 .. 1e6 segments, three shapes: ``random`` (fan-out 2-4, breadth-first growth, forks biased to
  B-1, B, B+1 around chunk boundaries), ``caterpillar`` (a trunk where every fork has one leaf: depth
  G/2, the worst case for anything level-synchronous), ``star`` (one root with G-1 leaf children). Time is
  the best of --repeats runs, wall clock on this machine; the tree arrays are built outside the timing.
* A SWE-like synthetic step (``harts.data.synthetic``, preset swe-step): trie build, plan_calls, layout
  build times, calls/replay/sequences per round versus the naive one-call-per-segment and
  packed-by-depth schedules.

Prints tables; writes calls.json and calls_scaling.png to --out.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time

import numpy as np

from harts.planning.calls import naive_schedule, plan_calls_for_trie, plan_segment_tree
from harts.planning.segments import SegmentTree


def _positions(parent: np.ndarray, rng, B: int):
    """start/end of every segment: a child starts at its parent's end; fork positions biased to a(p)+-1."""
    G = parent.shape[0]
    kind = rng.integers(0, 4, size=G)
    rand_len = rng.integers(1, 3 * B, size=G)
    near = rng.integers(1, 3, size=G)
    off = rng.integers(-1, 2, size=G)
    par = parent.tolist()
    start = [0] * G
    end = [0] * G
    kind_l, rand_l, near_l, off_l = kind.tolist(), rand_len.tolist(), near.tolist(), off.tolist()
    for v in range(G):
        s = 0 if par[v] < 0 else end[par[v]]
        if kind_l[v] == 0:
            L = rand_l[v]
        else:
            target = (s // B + near_l[v]) * B + off_l[v]
            L = target - s if target > s else 1 + rand_l[v] % B
        start[v] = s
        end[v] = s + L
    return np.asarray(start, dtype=np.int64), np.asarray(end, dtype=np.int64)


def random_tree(G: int, rng, B: int):
    """Breadth-first growth with fan-out 2..4 (parents precede children)."""
    parent = np.empty(G, dtype=np.int64)
    parent[0] = -1
    fan = rng.integers(2, 5, size=G)
    n, v = 1, 0
    while n < G:
        k = min(int(fan[v]), G - n)
        parent[n : n + k] = v
        n += k
        v += 1
    return parent


def caterpillar_tree(G: int, rng, B: int):
    """Trunk T0, leaf L0, T1, leaf L1, ... in preorder: parent(L_k) = parent(T_{k+1}) = T_k."""
    parent = np.empty(G, dtype=np.int64)
    parent[0] = -1
    idx = np.arange(1, G)
    trunk_of = (idx - 1) // 2 * 2  # T_k has id 2k
    parent[1:] = trunk_of
    return parent


def star_tree(G: int, rng, B: int):
    parent = np.zeros(G, dtype=np.int64)
    parent[0] = -1
    return parent


SHAPES = {"random": random_tree, "caterpillar": caterpillar_tree, "star": star_tree}


def time_plan(tree: SegmentTree, B: int, repeats: int) -> tuple[float, object]:
    best, plan = float("inf"), None
    for _ in range(repeats):
        t0 = time.perf_counter()
        plan = plan_segment_tree(tree, B)
        best = min(best, time.perf_counter() - t0)
    return best, plan


def scaling(max_segments: int, B: int, repeats: int, seed: int) -> list[dict]:
    sizes = [s for s in (1_000, 10_000, 100_000, 300_000, 1_000_000, 3_000_000) if s <= max_segments]
    rows = []
    print(f"Algorithm 1 scaling (B={B}; best of {repeats}; plan_segment_tree = DP + recovery + plan arrays)")
    print(f"{'shape':<12}{'segments':>10}{'calls':>7}{'sequences':>11}{'plan s':>9}{'us/seg':>8}{'tree s':>8}")
    for shape, make in SHAPES.items():
        for G in sizes:
            rng = np.random.default_rng(seed)
            parent = make(G, rng, B)
            start, end = _positions(parent, rng, B)
            t0 = time.perf_counter()
            tree = SegmentTree.from_arrays(parent, start, end)
            t_tree = time.perf_counter() - t0
            t_plan, plan = time_plan(tree, B, repeats if G < 1_000_000 else max(1, repeats - 1))
            if G <= 100_000:
                plan.validate()  # outside the timing
            row = {"shape": shape, "segments": G, "num_calls": plan.num_calls, "sequences": plan.num_sequences,
                   "replay_tokens": plan.replay_tokens, "plan_s": t_plan, "tree_s": t_tree}
            rows.append(row)
            print(f"{shape:<12}{G:>10}{plan.num_calls:>7}{plan.num_sequences:>11}{t_plan:>9.3f}"
                  f"{1e6 * t_plan / G:>8.2f}{t_tree:>8.3f}")
    return rows


def swe_step(B: int, seed: int, scale: float) -> dict:
    from harts.data.synthetic import generate
    from harts.data.trie import build_trie
    from harts.planning.layout import build_layout

    batch = generate("swe-step", seed=seed, scale=scale, metadata=False)
    t0 = time.perf_counter()
    trie = build_trie(batch)
    t1 = time.perf_counter()
    plan = plan_calls_for_trie(trie, chunk_size=B)
    t2 = time.perf_counter()
    lay = build_layout(plan, conv_width=4)
    t3 = time.perf_counter()
    plan.validate()
    lay.validate(plan)
    naive = naive_schedule(plan.tree, B)
    out = {
        "preset": "swe-step", "seed": seed, "scale": scale, "chunk_size": B,
        "trajectories": trie.num_trajectories, "S": trie.num_positions, "C": trie.num_rows,
        "segments": plan.tree.num_segments, "trees": plan.tree.num_trees,
        "num_calls": plan.num_calls, "replay_tokens": plan.replay_tokens,
        "sequences_per_round": plan.sequences_per_round(), "emitted_states": plan.num_emitted_states,
        "mla_kv_tokens": lay.mla_kv_tokens, "kda_tokens": lay.kda_tokens,
        "trie_s": t1 - t0, "plan_s": t2 - t1, "layout_s": t3 - t2, "naive": naive,
    }
    print(f"\nSWE-like step (synthetic swe-step, seed {seed}, scale {scale}, B={B}): N={out['trajectories']} "
          f"S={out['S']} C={out['C']} segments={out['segments']} trees={out['trees']}")
    print(f"{'schedule':<24}{'calls':>7}{'replay':>9}  sequences per round")
    print(f"{'minimum-call (Alg. 1)':<24}{plan.num_calls:>7}{plan.replay_tokens:>9}  {plan.sequences_per_round()}")
    for name, d in naive.items():
        print(f"{name:<24}{d['num_calls']:>7}{d['replay_tokens']:>9}")
    print(f"replay / C = {plan.replay_tokens / trie.num_rows:.4f}; MLA KV rows {lay.mla_kv_tokens} "
          f"({lay.mla_kv_tokens / trie.num_rows:.2f} x C); trie {out['trie_s']:.3f}s plan {out['plan_s']:.3f}s "
          f"layout {out['layout_s']:.3f}s")
    return out


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    by = collections.defaultdict(list)
    for r in rows:
        by[r["shape"]].append((r["segments"], r["plan_s"]))
    for shape, pts in by.items():
        x, y = zip(*pts)
        ax.loglog(x, y, "o-", label=shape)
    xs = np.array([min(r["segments"] for r in rows), max(r["segments"] for r in rows)])
    ax.loglog(xs, xs * 1e-6, "k:", label="1 us / segment")
    ax.axhline(2.0, color="r", lw=0.8, ls="--", label="2 s budget")
    ax.set_xlabel("segments")
    ax.set_ylabel("plan time (s)")
    ax.set_title("Minimum-call planner (Algorithm 1) scaling")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.calls", description=__doc__.split("\n")[0])
    ap.add_argument("--max-segments", type=int, default=1_000_000)
    ap.add_argument("--chunk-size", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--swe-scale", type=float, default=1.0, help="0 skips the SWE-like step")
    ap.add_argument("--out", default="out/bench_calls")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    rows = scaling(args.max_segments, args.chunk_size, args.repeats, args.seed)
    result = {"machine": os.uname().nodename, "cpu_count": os.cpu_count(), "chunk_size": args.chunk_size,
              "scaling": rows}
    if args.swe_scale > 0:
        result["swe_step"] = swe_step(args.chunk_size, args.seed, args.swe_scale)
    with open(os.path.join(args.out, "calls.json"), "w") as fh:
        json.dump(result, fh, indent=1)
    try:
        plot(rows, os.path.join(args.out, "calls_scaling.png"))
    except ImportError:
        print("matplotlib missing: no PNG")
    print(f"wrote {args.out}/calls.json and calls_scaling.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
