"""Adaptive candidate refinement (paper 3.2, "Adaptive candidate refinement").

Local refinement changes a few memberships without changing K: boundary refinement moves the cuts of a
lexicographically contiguous anchor within H = 8 positions (at most two sweeps); sparse repair then makes
at most four single moves or swaps between lexicographic neighbours (within H positions), each the best
strict improvement of the two affected microbatches' total work. Every step keeps coverage, nonempty
microbatches and capacity.

All move/swap costs are exact and vectorised with Eq. 10: the work x adds to (or removes from) a
microbatch is |x| minus its largest LCP with the other members, found at their nearest members on
either side of x's position (``_shared_with``).
"""
from __future__ import annotations

import numpy as np

from harts.planning.greedy import neighbour_shared
from harts.planning.natural import cuts_to_owner, owner_is_contiguous, owner_to_cuts
from harts.planning.prefix_cost import PrefixIndex

H = 8
BOUNDARY_SWEEPS = 2
REPAIR_ITERS = 4


def boundary_refine(index: PrefixIndex, cuts: np.ndarray, capacity: int) -> np.ndarray:
    """Move each inner cut within H positions to lower (pair total, pair max); strict improvements only,
    closest move then leftmost on ties."""
    cuts = cuts.copy()
    for _ in range(BOUNDARY_SWEEPS):
        changed = False
        for i in range(1, cuts.shape[0] - 1):
            a, c, b = int(cuts[i - 1]), int(cuts[i]), int(cuts[i + 1])
            t = np.arange(max(a + 1, c - H), min(b - 1, c + H) + 1, dtype=np.int64)
            left = index.interval_work(a, t)
            right = index.interval_work(t, b)
            tot, mx = left + right, np.maximum(left, right)
            cur = (int(index.interval_work(a, c) + index.interval_work(c, b)),
                   int(max(index.interval_work(a, c), index.interval_work(c, b))))
            ok = (left <= capacity) & (right <= capacity) & ((tot < cur[0]) | ((tot == cur[0]) & (mx < cur[1])))
            if not ok.any():
                continue
            t, tot, mx = t[ok], tot[ok], mx[ok]
            j = np.lexsort((t, np.abs(t - c), mx, tot))[0]
            cuts[i] = t[j]
            changed = True
        if not changed:
            break
    return cuts


def _shared_with(index: PrefixIndex, keys: np.ndarray, g: np.ndarray, p: np.ndarray, exclude: np.ndarray) -> np.ndarray:
    """Largest LCP of position p with the members of microbatch g other than p and ``exclude``.

    ``keys`` = sorted owner * N + position. The nearest member strictly on each side is found by
    bisection; when it is the excluded position, the next one out is used."""
    n = index.n
    target = g * n + p
    best = np.zeros(p.shape[0], dtype=np.int64)
    for side in (-1, 1):
        i = np.searchsorted(keys, target, side="left" if side < 0 else "right")
        i = i - 1 if side < 0 else i
        for _ in range(2):
            inside = (i >= 0) & (i < keys.shape[0])
            cand = keys[np.clip(i, 0, keys.shape[0] - 1)]
            valid = inside & (cand // n == g)
            pos = cand % n
            skip = valid & (pos == exclude)
            if not skip.any():
                break
            i = np.where(skip, i + side, i)
        inside = (i >= 0) & (i < keys.shape[0])
        cand = keys[np.clip(i, 0, keys.shape[0] - 1)]
        pos = cand % n
        valid = inside & (cand // n == g) & (pos != exclude) & (pos != p)
        if valid.any():
            val = np.zeros(p.shape[0], dtype=np.int64)
            val[valid] = index.pair_lcp(pos[valid], p[valid])
            best = np.maximum(best, val)
    return best


def _best_move(index, owner, work, keys, own_shared, capacity):
    n = index.n
    k = work.shape[0]
    counts = np.bincount(owner, minlength=k)
    pos = np.arange(n, dtype=np.int64)
    src_ok = counts[owner] > 1
    ps, gs = [], []
    for off in range(-H, H + 1):
        if off == 0:
            continue
        q = pos + off
        sel = src_ok & (q >= 0) & (q < n)
        p = pos[sel]
        d = owner[q[sel]]
        keep = d != owner[p]
        ps.append(p[keep])
        gs.append(d[keep])
    if not ps:
        return None
    pair = np.unique(np.concatenate(ps) * k + np.concatenate(gs))
    p, d = pair // k, pair % k
    if p.shape[0] == 0:
        return None
    sh = _shared_with(index, keys, d, p, np.full(p.shape[0], -1))
    new_d = work[d] + index.length[p] - sh
    gain = sh - own_shared[p]
    ok = (new_d <= capacity) & (gain > 0)
    if not ok.any():
        return None
    p, d, gain = p[ok], d[ok], gain[ok]
    j = np.lexsort((d, p, -gain))[0]
    return int(gain[j]), int(p[j]), int(d[j])


def _best_swap(index, owner, work, keys, own_shared, capacity):
    n = index.n
    length = index.length
    best = None
    ps, qs = [], []
    pos = np.arange(n, dtype=np.int64)
    for off in range(1, min(H, n - 1) + 1):
        p = pos[: n - off]
        q = p + off
        keep = owner[p] != owner[q]
        ps.append(p[keep])
        qs.append(q[keep])
    if not ps:
        return None
    p = np.concatenate(ps)
    q = np.concatenate(qs)
    if p.shape[0] == 0:
        return None
    a, b = owner[p], owner[q]
    s_ax = own_shared[p]
    s_by = own_shared[q]
    s_ay = _shared_with(index, keys, a, q, p)  # y joins A once x has left
    s_bx = _shared_with(index, keys, b, p, q)  # x joins B once y has left
    new_a = work[a] - length[p] + s_ax + length[q] - s_ay
    new_b = work[b] - length[q] + s_by + length[p] - s_bx
    gain = work[a] + work[b] - new_a - new_b
    ok = (new_a <= capacity) & (new_b <= capacity) & (gain > 0)
    if not ok.any():
        return best
    p, q, gain = p[ok], q[ok], gain[ok]
    j = np.lexsort((q, p, -gain))[0]
    return int(gain[j]), int(p[j]), int(q[j])


def sparse_repair(index: PrefixIndex, owner: np.ndarray, capacity: int) -> np.ndarray:
    """At most REPAIR_ITERS best strict-improvement moves (else swaps) between near lexicographic neighbours."""
    owner = owner.copy()
    n = index.n
    k = int(owner.max()) + 1
    for _ in range(REPAIR_ITERS):
        work = index.owner_work(owner, k)
        keys = np.sort(owner * n + np.arange(n, dtype=np.int64))
        own_shared = neighbour_shared(index, owner)
        move = _best_move(index, owner, work, keys, own_shared, capacity)
        if move is not None:
            _, p, d = move
            owner[p] = d
            continue
        swap = _best_swap(index, owner, work, keys, own_shared, capacity)
        if swap is None:
            break
        _, p, q = swap
        owner[p], owner[q] = owner[q], owner[p]
    return owner


def refine(index: PrefixIndex, owner: np.ndarray, capacity: int) -> np.ndarray:
    """Boundary refinement for contiguous anchors, then sparse repair (K unchanged)."""
    if owner_is_contiguous(owner):
        cuts = boundary_refine(index, owner_to_cuts(owner), capacity)
        owner = cuts_to_owner(cuts, index.n)
    return sparse_repair(index, owner, capacity)
