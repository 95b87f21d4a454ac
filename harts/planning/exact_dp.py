"""Exact contiguous search (paper 3.2, "Exact search for small inputs", Eq. 9).

F[k, e] = min over s < e with W(s+1, e) <= T of F[k-1, s] + W(s+1, e) (1-based), compared first by total
work and then by the largest single microbatch of the partition; remaining ties go to the smallest s.
That secondary order is exact too: for a fixed state, a predecessor with equal total and larger peak can
never yield a smaller peak after appending the same last interval.

Feasible-start skip: W(s+1, e) only shrinks as s moves right, so for each e every s before the first
capacity-feasible start is skipped (the fast path has no cell for it; the reference masks it out).

Two exact evaluations of the same recurrence:

* ``exact_partitions`` (fast path): the total of [0, e) ending with [s, e) is prefix[e] + A(s) with
  A(s) = F(s) - prefix[s] + lcp[s] independent of e (Eq. 5), so each row is one min-reduction of A over
  e's feasible split points; only the cells reaching the minimum compare peaks. The cells are ragged
  (exactly the feasible [first[e], e) per e, ``band_cells``), and each DP row only visits the end
  positions e that are reachable with k microbatches *and* can still reach N within the largest target
  (both bounds come from the feasible starts), so useless states are never computed.
* ``exact_partitions_pairwise`` (reference): separate total and peak arrays over every end position on
  the rectangular band; the tests' cross-check of the fast path.

Legend: N trajectories, B the band (widest capacity-feasible last interval, in positions), K the
largest target; ragged cells are ordered by (e, s), so the first minimum of a run of cells is the
smallest s.
"""
from __future__ import annotations

import numpy as np

from harts.planning.prefix_cost import PrefixIndex

_INF = np.iinfo(np.int64).max // 4
_UNREACHED = 1 << 62  # fast-path key of an unreachable state; any reachable key is smaller


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


def dp_size(index: PrefixIndex, capacity: int, targets: list[int], first: np.ndarray | None = None) -> tuple[int, int]:
    """(K (N+1) B, (N+1) B): the DP's worst-case cell count (time) and its per-row arrays (memory)."""
    if not targets:
        return 0, 0
    row = (index.n + 1) * band_width(index, capacity, first)
    return min(max(targets), index.n) * row, row


def band_cells(index: PrefixIndex, first: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The ragged band: for every end e = 1..N, one cell per feasible split point s in [first[e], e).

    Returns (offsets [N+2], s [cells], rank [cells], work [cells]); the cells of e are
    offsets[e]:offsets[e+1], ascending in s, rank = s - first[e] and work = W([s, e)). Only feasible
    cells exist, so a DP row costs the mean feasible width, not the widest one (B)."""
    n = index.n
    e = np.arange(n + 1, dtype=np.int64)
    width = e - first
    width[0] = 0
    offsets = np.zeros(n + 2, dtype=np.int64)
    np.cumsum(width, out=offsets[1:])
    e_of = np.repeat(e, width)
    rank = np.arange(offsets[-1], dtype=np.int64) - offsets[e_of]
    s = first[e_of] + rank
    work = index.prefix[e_of] - index.prefix[s] + index.lcp[s]
    return offsets, s, rank, work


def packed_key_fits(index: PrefixIndex, capacity: int, band: int) -> bool:
    """True when every cell key (A (T + 1) + peak) B + rank stays below the unreachable sentinel."""
    total_bound = int(index.length.sum())  # no partition costs more than its raw tokens
    return (total_bound + 1) * (capacity + 1) * band < _UNREACHED


def exact_partitions(index: PrefixIndex, capacity: int, targets: list[int],
                     first: np.ndarray | None = None) -> dict[int, np.ndarray]:
    """Minimum-(total, peak) contiguous partition into k microbatches for every k in ``targets``.

    Returns {k: cuts} for the feasible targets (infeasible ones are absent); identical to
    ``exact_partitions_pairwise`` (same ties: smallest split point).
    ``first``: ``first_feasible_start(index, capacity)`` if the caller already has it.

    Appending [s, e) to the best (k-1)-partition of [0, s) gives the total prefix[e] + A(s), with
    A(s) = F(s) - prefix[s] + lcp[s] independent of e (Eq. 5). One int64 per cell orders exactly like
    (total, peak, s): (A(s) (T + 1) + max(peak(s), W([s, e)))) B + rank, because peak <= T and rank < B;
    so a DP row is one ragged min-reduction, and the winner's A, peak and s decode from its key."""
    n = index.n
    if not targets:
        return {}
    if first is None:
        first = first_feasible_start(index, capacity)
    band = band_width(index, capacity, first)
    if not packed_key_fits(index, capacity, band):
        return exact_partitions_pairwise(index, capacity, targets)
    k_hi = min(max(targets), n)
    m = capacity + 1
    offsets, s, rank, work = band_cells(index, first)
    work_rank = work * band + rank  # max(peak, W) B + rank == max(peak B + rank, W B + rank)
    lcp_key = np.append(index.lcp, 0) * (m * band)  # [N+1] lcp[e] (T + 1) B; e = N is never a split point

    # Windows: (k, e) is worth computing only if e is reachable with k parts (e <= reach_k, e >= k) and
    # N is reachable from e within the k_hi - k parts left (e >= back_{k_hi - k}); first[] gives both.
    reach = np.searchsorted(first, np.arange(n + 1), side="right") - 1  # farthest end from start s
    back = [n]
    for _ in range(k_hi):
        back.append(int(first[back[-1]]))
    key_a = np.full(n + 1, _UNREACHED, dtype=np.int64)  # A(s) (T + 1) B per split point s
    key_a[0] = 0
    peak_b = np.zeros(n + 1, dtype=np.int64)  # peak(s) B (only read where key_a is reachable)
    # Two row buffers, swapped every row; a buffer is reset only on the window it held two rows ago.
    new_key_a, new_peak_b = np.full(n + 1, _UNREACHED, dtype=np.int64), np.zeros(n + 1, dtype=np.int64)
    held = [(0, 0), (1, 0)]  # rows of even / odd k: the (lo, hi) window last written to their buffer
    choice = np.full((k_hi + 1, n + 1), -1, dtype=np.int64)
    found: dict[int, np.ndarray] = {}
    wanted = set(targets)
    far = 0
    for k in range(1, k_hi + 1):
        far = min(n, int(reach[far]))
        lo, hi = max(k, back[k_hi - k]), far
        old_lo, old_hi = held[k % 2]
        new_key_a[old_lo : old_hi + 1] = _UNREACHED
        held[k % 2] = (lo, hi)
        if lo <= hi:
            c0, c1 = int(offsets[lo]), int(offsets[hi + 1])
            sw = s[c0:c1]
            cand = np.maximum(peak_b[sw] + rank[c0:c1], work_rank[c0:c1])
            cand += key_a[sw]
            best = np.minimum.reduceat(cand, offsets[lo : hi + 1] - c0)
            a_peak, r = np.divmod(best, band)
            a, pk = np.divmod(a_peak, m)
            rows = slice(lo, hi + 1)
            new_key_a[rows] = a * (m * band) + lcp_key[rows]  # A(e) = total - prefix[e] + lcp[e]; no overflow
            new_peak_b[rows] = pk * band
            choice[k, rows] = first[rows] + r
            if best.max() >= _UNREACHED:  # unreachable ends inside the window
                dead = lo + np.flatnonzero(best >= _UNREACHED)
                new_key_a[dead] = _UNREACHED
                choice[k, dead] = -1
        key_a, new_key_a = new_key_a, key_a
        peak_b, new_peak_b = new_peak_b, peak_b
        if k in wanted and key_a[n] < _UNREACHED:
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
