"""Exact contiguous search for small inputs (paper 3.2, "Exact search for small inputs", Eq. 9).

F[k, e] = min over s < e with W(s+1, e) <= T of F[k-1, s] + W(s+1, e) (1-based), compared first by total
work and then by the largest single microbatch of the partition; remaining ties go to the smallest s.
That secondary order is exact too: for a fixed state, a predecessor with equal total and larger peak can
never yield a smaller peak after appending the same last interval.

Feasible-start skip: W(s+1, e) only shrinks as s moves right, so for each e every s before the first
capacity-feasible start is skipped (it is masked out of the vectorised row, never evaluated as valid).
"""
from __future__ import annotations

import numpy as np

from harts.planning.prefix_cost import PrefixIndex

_INF = np.iinfo(np.int64).max // 4


def first_feasible_start(index: PrefixIndex, capacity: int) -> np.ndarray:
    """first[e] = smallest s (0-based start position) with W([s, e)) <= T, for e = 1..N (first[0] = 0).

    Vectorised binary search over all e at once; relies on W([s, e)) being non-increasing in s.
    """
    n = index.n
    e = np.arange(n + 1, dtype=np.int64)
    lo = np.zeros(n + 1, dtype=np.int64)  # invariant: answer in [lo, hi]
    hi = np.maximum(e - 1, 0)
    while True:
        active = lo < hi
        if not active.any():
            break
        mid = (lo + hi) // 2
        work = index.prefix[e] - index.prefix[mid] + index.lcp[mid]
        ok = work <= capacity
        hi = np.where(active & ok, mid, hi)
        lo = np.where(active & ~ok, mid + 1, lo)
    return lo


def exact_partitions(index: PrefixIndex, capacity: int, targets: list[int]) -> dict[int, np.ndarray]:
    """Minimum-(total, peak) contiguous partition into k microbatches for every k in ``targets``.

    Returns {k: cuts} for the feasible targets (infeasible ones are absent). The DP runs on a band: row r
    of the [B, N+1] arrays is the split point s = e - 1 - r, and B = max_e (e - first[e]) is the widest
    capacity-feasible last interval, so the cost is O(K N B) instead of O(K N^2).
    """
    n = index.n
    if not targets:
        return {}
    k_hi = min(max(targets), n)
    e = np.arange(n + 1, dtype=np.int64)[None, :]
    first = first_feasible_start(index, capacity)
    band = int(np.max(e[0, 1:] - first[1:])) if n else 1
    s = e - 1 - np.arange(band, dtype=np.int64)[:, None]  # [B, N+1] split points
    legal = (s >= first[None, :]) & (s >= 0)
    s_safe = np.where(legal, s, 0)
    work = np.where(legal, index.prefix[e] - index.prefix[s_safe] + index.lcp[s_safe], 0)

    total = np.full(n + 1, _INF, dtype=np.int64)
    peak = np.full(n + 1, _INF, dtype=np.int64)
    total[0] = peak[0] = 0
    back = np.full((k_hi + 1, n + 1), -1, dtype=np.int64)
    found: dict[int, np.ndarray] = {}
    wanted = set(targets)
    for k in range(1, k_hi + 1):
        prev_total = total[s_safe]
        valid = legal & (prev_total < _INF)
        cand_total = np.where(valid, prev_total + work, _INF)
        cand_peak = np.where(valid, np.maximum(peak[s_safe], work), _INF)
        best_total = cand_total.min(axis=0)
        tie = valid & (cand_total == best_total[None, :])
        best_peak = np.where(tie, cand_peak, _INF).min(axis=0)
        pick = tie & (cand_peak == best_peak[None, :])
        # Smallest s among exact ties = the largest row index r that is picked.
        r = band - 1 - np.argmax(pick[::-1], axis=0)
        reach = pick.any(axis=0)
        back[k] = np.where(reach, e[0] - 1 - r, -1)
        total = np.where(reach, best_total, _INF)
        peak = np.where(reach, best_peak, _INF)
        if k in wanted and reach[n]:
            cuts = [n]
            end = n
            for level in range(k, 0, -1):
                end = int(back[level, end])
                cuts.append(end)
            found[k] = np.asarray(cuts[::-1], dtype=np.int64)
    return found
