"""Exact contiguous search (paper 3.2, "Exact search for small inputs", Eq. 9).

F[k, e] = min over s < e with W(s+1, e) <= T of F[k-1, s] + W(s+1, e) (1-based), compared first by total
work and then by the largest single microbatch of the partition; remaining ties go to the smallest s.
That secondary order is exact too: for a fixed state, a predecessor with equal total and larger peak can
never yield a smaller peak after appending the same last interval.

Feasible-start skip: W(s+1, e) only shrinks as s moves right, so for each e every s before the first
capacity-feasible start is skipped (it is masked out of the vectorised row, never evaluated as valid).

Two exact evaluations of the same recurrence:

* ``exact_partitions`` (fast path): (total, peak) packed into one int64 key total * (T + 1) + peak, which
  orders exactly like the pair because peak <= T; each DP row only visits the end positions e that are
  reachable with k microbatches *and* can still reach N within the largest target (both bounds come from
  the feasible starts), so useless states are never computed. Used whenever the packed key cannot
  overflow (sum of lengths * (T + 1) < 2**60), i.e. always in practice.
* ``exact_partitions_pairwise`` (reference): separate total and peak arrays over every end position;
  the fallback when the packed key could overflow, and the tests' cross-check of the fast path.

Legend: N trajectories, B the band (widest capacity-feasible last interval, in positions), K the
largest target; DP arrays are [e, r] with end position e in 0..N and split point s = e - B + r, so r
ascends with s and argmin's first hit is the smallest s.
"""
from __future__ import annotations

import numpy as np

from harts.planning.prefix_cost import PrefixIndex

_INF = np.iinfo(np.int64).max // 4
_KEY_INF = 1 << 61  # packed-key "unreachable"; two of them plus T still fit in int64


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


def band_width(index: PrefixIndex, capacity: int, first: np.ndarray | None = None) -> int:
    """B = max_e (e - first[e]): the most positions one capacity-feasible contiguous microbatch spans."""
    if first is None:
        first = first_feasible_start(index, capacity)
    return int(np.max(np.arange(1, index.n + 1) - first[1:])) if index.n else 1


def packed_key_fits(index: PrefixIndex, capacity: int) -> bool:
    """True when every partition's total * (T + 1) + peak stays below the packed-key sentinel."""
    total_bound = int(index.length.sum())  # no partition costs more than its raw tokens
    return total_bound * (capacity + 1) + capacity < _KEY_INF // 2


def dp_size(index: PrefixIndex, capacity: int, targets: list[int], first: np.ndarray | None = None) -> tuple[int, int]:
    """(K (N+1) B, (N+1) B): the DP's worst-case cell count (time) and its per-row arrays (memory)."""
    if not targets:
        return 0, 0
    row = (index.n + 1) * band_width(index, capacity, first)
    return min(max(targets), index.n) * row, row


def exact_partitions(index: PrefixIndex, capacity: int, targets: list[int], first: np.ndarray | None = None) -> dict[int, np.ndarray]:
    """Minimum-(total, peak) contiguous partition into k microbatches for every k in ``targets``.

    Returns {k: cuts} for the feasible targets (infeasible ones are absent); identical to
    ``exact_partitions_pairwise`` (same ties: smallest split point), at O(K N B) worst case.
    ``first``: ``first_feasible_start(index, capacity)`` if the caller already has it."""
    n = index.n
    if not targets:
        return {}
    if not packed_key_fits(index, capacity):
        return exact_partitions_pairwise(index, capacity, targets)
    k_hi = min(max(targets), n)
    if first is None:
        first = first_feasible_start(index, capacity)
    band = band_width(index, capacity, first)
    m = capacity + 1
    e = np.arange(n + 1, dtype=np.int64)
    s = e[:, None] - band + np.arange(band, dtype=np.int64)[None, :]  # [N+1, B] split points, ascending
    legal = (s >= first[:, None]) & (s >= 0)
    legal[0] = False
    s_safe = np.where(legal, s, 0)
    work = np.where(legal, index.prefix[e][:, None] - index.prefix[s_safe] + index.lcp[s_safe], 0)
    work_m = np.where(legal, work * m, _KEY_INF)  # illegal cells can never win

    # Windows: (k, e) is worth computing only if e is reachable with k parts (e <= reach_k, e >= k) and
    # N is reachable from e within the k_hi - k parts left (e >= back_{k_hi - k}); first[] gives both.
    reach = np.searchsorted(first, np.arange(n + 1), side="right") - 1  # farthest end from start s
    back = [n]
    for _ in range(k_hi):
        back.append(int(first[back[-1]]))
    key = np.full(n + 1, _KEY_INF, dtype=np.int64)
    key[0] = 0
    choice = np.full((k_hi + 1, n + 1), -1, dtype=np.int64)
    found: dict[int, np.ndarray] = {}
    wanted = set(targets)
    far = 0
    for k in range(1, k_hi + 1):
        far = min(n, int(reach[far]))
        lo, hi = max(k, back[k_hi - k]), far
        new = np.full(n + 1, _KEY_INF, dtype=np.int64)
        if lo <= hi:
            rows = slice(lo, hi + 1)
            sw = s_safe[rows]
            peak = key % m
            prev_peak = peak[sw]
            cand = key[sw] + work_m[rows]
            cand += np.maximum(prev_peak, work[rows]) - prev_peak
            r = cand.argmin(axis=1)
            best = np.take_along_axis(cand, r[:, None], axis=1)[:, 0]
            ok = best < _KEY_INF
            new[rows] = np.where(ok, best, _KEY_INF)
            choice[k, rows] = np.where(ok, e[rows] - band + r, -1)
        key = new
        if k in wanted and key[n] < _KEY_INF:
            found[k] = _backtrack(choice, k, n)
    return found


def _backtrack(choice: np.ndarray, k: int, n: int) -> np.ndarray:
    cuts = [n]
    end = n
    for level in range(k, 0, -1):
        end = int(choice[level, end])
        cuts.append(end)
    return np.asarray(cuts[::-1], dtype=np.int64)


def exact_partitions_pairwise(index: PrefixIndex, capacity: int, targets: list[int]) -> dict[int, np.ndarray]:
    """Reference evaluation of Eq. 9 with separate (total, peak) arrays over every end position.

    The DP runs on a band: row r of the [B, N+1] arrays is the split point s = e - 1 - r, and B = max_e
    (e - first[e]) is the widest capacity-feasible last interval, so the cost is O(K N B), not O(K N^2)."""
    n = index.n
    if not targets:
        return {}
    k_hi = min(max(targets), n)
    e = np.arange(n + 1, dtype=np.int64)[None, :]
    first = first_feasible_start(index, capacity)
    band = band_width(index, capacity, first)
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
            found[k] = _backtrack(back, k, n)
    return found
