"""Natural partition and the base K range (paper 3.2, "Candidate range and natural partition", Eqs. 7-8).

A contiguous partition is described by its cuts: an increasing int array ``cuts`` with cuts[0] = 0 and
cuts[-1] = N; microbatch i is the position interval [cuts[i], cuts[i+1]).
"""
from __future__ import annotations

import numpy as np

from harts.planning.prefix_cost import PrefixIndex


def best_split(index: PrefixIndex, a: int, b: int) -> int:
    """Split position t in (a, b) for [a, b): lowest valley lcp[t] (Eq. 6 cost), then the smaller
    larger side, then the smaller work difference, then the leftmost t (for determinism)."""
    t = np.arange(a + 1, b, dtype=np.int64)
    left = index.prefix[t] - index.prefix[a] + index.lcp[a]
    right = index.prefix[b] - index.prefix[t] + index.lcp[t]
    keys = (t, np.abs(left - right), np.maximum(left, right), index.lcp[t])
    return int(t[np.lexsort(keys)[0]])


def natural_partition(index: PrefixIndex, capacity: int) -> np.ndarray:
    """P0: recursively split only intervals whose work exceeds T, at the best valley (cuts array)."""
    cuts = []
    stack = [(0, index.n)]
    while stack:
        a, b = stack.pop()
        if int(index.interval_work(a, b)) <= capacity:
            cuts.append(a)
            continue
        if b - a < 2:  # a single trajectory above capacity: rejected earlier by the planner
            raise ValueError(f"natural_partition: position {a} alone exceeds capacity {capacity}")
        t = best_split(index, a, b)
        stack.append((t, b))
        stack.append((a, t))
    cuts.append(index.n)
    return np.asarray(sorted(cuts), dtype=np.int64)


def k_range(total_work: int, capacity: int, dp: int, k0: int, n: int) -> list[int]:
    """Eqs. 7-8: K_min = D max(1, ceil(G / (T D))), K_max = max(K_min, min(D ceil(K0/D), D floor(N/D)))."""
    k_min = dp * max(1, -(-total_work // (capacity * dp)))
    k_max = max(k_min, min(dp * -(-k0 // dp), dp * (n // dp)))
    return list(range(k_min, k_max + 1, dp))


def cuts_to_owner(cuts: np.ndarray, n: int) -> np.ndarray:
    """owner[position] = microbatch index of a contiguous partition."""
    return np.repeat(np.arange(cuts.shape[0] - 1, dtype=np.int64), np.diff(cuts))


def owner_is_contiguous(owner: np.ndarray) -> bool:
    """True when every group is one run of consecutive positions."""
    starts = np.flatnonzero(np.concatenate(([True], owner[1:] != owner[:-1])))
    return np.unique(owner).shape[0] == starts.shape[0]


def owner_to_cuts(owner: np.ndarray) -> np.ndarray:
    starts = np.flatnonzero(np.concatenate(([True], owner[1:] != owner[:-1])))
    return np.append(starts, owner.shape[0]).astype(np.int64)
