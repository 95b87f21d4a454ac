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
    """P0: recursively split only intervals whose work exceeds T, at the best valley (cuts array).

    Each interval's split depends on that interval alone, so the recursion runs level by level: all
    over-capacity intervals of a level are split at once (``best_splits``), giving the same cuts."""
    done = [np.asarray([index.n], dtype=np.int64)]
    a = np.asarray([0], dtype=np.int64)
    b = np.asarray([index.n], dtype=np.int64)
    while a.shape[0]:
        over = index.interval_work(a, b) > capacity
        done.append(a[~over])
        a, b = a[over], b[over]
        if not a.shape[0]:
            break
        single = np.flatnonzero(b - a < 2)
        if single.shape[0]:  # a single trajectory above capacity: rejected earlier by the planner
            raise ValueError(f"natural_partition: position {int(a[single[0]])} alone exceeds capacity {capacity}")
        t = best_splits(index, a, b)
        a, b = np.concatenate((a, t)), np.concatenate((t, b))
    return np.sort(np.concatenate(done))


def best_splits(index: PrefixIndex, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``best_split`` for many disjoint intervals [a_i, b_i) (b_i - a_i >= 2) at once: the same keys,
    applied one after the other as segmented minima over the split points still tied."""
    size = b - a - 1  # candidate split points per interval
    seg = np.repeat(np.arange(a.shape[0]), size)
    t = np.arange(seg.shape[0], dtype=np.int64) - np.repeat(np.cumsum(size) - size, size) + a[seg] + 1
    seg, t = _keep_segment_min(seg, t, index.lcp[t])
    left, right = index.interval_work(a[seg], t), index.interval_work(t, b[seg])
    seg, t = _keep_segment_min(seg, t, np.maximum(left, right))
    left, right = index.interval_work(a[seg], t), index.interval_work(t, b[seg])
    seg, t = _keep_segment_min(seg, t, np.abs(left - right))
    return t[np.concatenate(([True], seg[1:] != seg[:-1]))]  # remaining ties: the leftmost t


def _keep_segment_min(seg: np.ndarray, t: np.ndarray, value: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Keep, in every segment (contiguous runs of ``seg``), only the entries with its minimum value."""
    starts = np.flatnonzero(np.concatenate(([True], seg[1:] != seg[:-1])))
    low = np.minimum.reduceat(value, starts)
    keep = value == np.repeat(low, np.diff(np.append(starts, seg.shape[0])))
    return seg[keep], t[keep]


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
