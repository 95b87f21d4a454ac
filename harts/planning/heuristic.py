"""Heuristic base search for large inputs (paper 3.2, "Heuristic base search for large inputs").

Targets are sampled from the Eq. 8 range with budget Q_max = 32, and each target is reached by evolving
the natural partition P0: merges of capacity-feasible adjacent microbatches with the largest saving for
K < K0, cheapest contiguous splits for K > K0. By Eq. 6 both are read straight off the adjacent LCPs: merging
neighbours separated at cut t saves lcp[t], splitting before t costs lcp[t]. Evolution is a single chain
from P0 in each direction, so every sampled target is a snapshot of that chain.
"""
from __future__ import annotations

import numpy as np

from harts.planning.prefix_cost import PrefixIndex

Q_MAX = 32
DENSE = 16  # sampled-K budget spent on consecutive small values starting at K_min


def sample_targets(targets: list[int], budget: int = Q_MAX) -> list[int]:
    """All targets if they fit the budget; else both endpoints, the DENSE smallest, and the rest spread
    evenly over the remaining interval."""
    if len(targets) <= budget:
        return list(targets)
    dense = min(DENSE, budget - 1)
    chosen = set(targets[:dense])
    rest = targets[dense:]
    sparse = budget - dense
    for i in range(sparse):
        chosen.add(rest[round(i * (len(rest) - 1) / (sparse - 1))] if sparse > 1 else rest[-1])
    chosen.add(targets[-1])
    return sorted(chosen)


def _merge_chain(index: PrefixIndex, cuts: np.ndarray, capacity: int, stops: set[int]) -> dict[int, np.ndarray]:
    """Merge adjacent microbatches (largest saving lcp[cut], then smaller merged work, then leftmost)."""
    out: dict[int, np.ndarray] = {}
    cuts = cuts.copy()
    lowest = min(stops) if stops else cuts.shape[0] - 1
    while cuts.shape[0] - 1 > lowest:
        merged = index.interval_work(cuts[:-2], cuts[2:])  # merge parts i and i+1 -> drop cuts[i+1]
        ok = merged <= capacity
        if not ok.any():
            break
        inner = cuts[1:-1]
        saving = index.lcp[inner]
        keys = (np.arange(inner.shape[0]), merged, -saving, ~ok)
        i = int(np.lexsort(keys)[0])
        cuts = np.delete(cuts, i + 1)
        if cuts.shape[0] - 1 in stops:
            out[cuts.shape[0] - 1] = cuts.copy()
    return out


def _split_chain(index: PrefixIndex, cuts: np.ndarray, stops: set[int]) -> dict[int, np.ndarray]:
    """Split microbatches at the cheapest new cut (lcp[t], then the smaller larger side, then the smaller
    difference, then the leftmost t); splitting never violates capacity."""
    out: dict[int, np.ndarray] = {}
    n = index.n
    highest = max(stops) if stops else cuts.shape[0] - 1
    t_all = np.arange(1, n, dtype=np.int64)
    while cuts.shape[0] - 1 < highest:
        is_cut = np.zeros(n + 1, dtype=bool)
        is_cut[cuts] = True
        t = t_all[~is_cut[t_all]]
        if t.shape[0] == 0:
            break
        part = np.searchsorted(cuts, t, side="right") - 1
        a, b = cuts[part], cuts[part + 1]
        left = index.interval_work(a, t)
        right = index.interval_work(t, b)
        keys = (t, np.abs(left - right), np.maximum(left, right), index.lcp[t])
        best = int(t[np.lexsort(keys)[0]])
        cuts = np.sort(np.append(cuts, best))
        if cuts.shape[0] - 1 in stops:
            out[cuts.shape[0] - 1] = cuts.copy()
    return out


def evolve_natural(index: PrefixIndex, natural_cuts: np.ndarray, capacity: int,
                   targets: list[int]) -> dict[int, np.ndarray]:
    """{K: cuts} for every target reachable from P0 by legal merges / splits (others are absent)."""
    k0 = natural_cuts.shape[0] - 1
    out: dict[int, np.ndarray] = {}
    if k0 in targets:
        out[k0] = natural_cuts.copy()
    below = {k for k in targets if k < k0}
    above = {k for k in targets if k > k0}
    if below:
        out.update(_merge_chain(index, natural_cuts, capacity, below))
    if above:
        out.update(_split_chain(index, natural_cuts, above))
    return out
